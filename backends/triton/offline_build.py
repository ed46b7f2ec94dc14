"""Build the Triton kernels the launchers would launch for any Triton target, without that GPU (ROCm included).

The launchers (``writer.write``, ``attention.attention``) run on CPU tensors with their kernels swapped for
recorders (:func:`recorded_launches`): each launch's positional arguments, constexprs and launch options are
kept, and :func:`compile_launch` turns one into ``triton.compile`` for a :class:`~triton.backends.compiler.GPUTarget`
such as ``GPUTarget("hip", "gfx942", 64)`` (AMD MI300X) or ``GPUTarget("cuda", 90, 32)``. Pointer arguments are
taken 16-byte aligned and integer arguments divisible by 16 where they are, as the runtime specialises them, so the
code is the code a GPU call builds. The launchers run with ``TRITON_INTERPRET`` unset, so the plan (block sizes,
bfloat16 dots) is the GPU's; no kernel runs.

    python -m quantmla_core.backends.triton.offline_build            # gfx942: every kernel, the default matrix
    python -m quantmla_core.backends.triton.offline_build gfx90a C4R4 C2R4
    python -m quantmla_core.backends.triton.offline_build sm_80      # NVIDIA A100
    QUANTMLA_TRITON_ATTENTION=v3 python -m quantmla_core.backends.triton.offline_build sm_100 C4R4 dims=1024,64

:func:`amd_resources` reads what the AMD compiler reports (VGPRs, AGPRs, spills, scratch, LDS, occupancy, MFMA count);
:func:`nvidia_resources` what Triton's own ``ptxas -v`` reports (registers, spill bytes, shared memory, MMA count),
with tensor memory, whether the kernel is a ``trap;`` and its SASS loop and spill counts (:func:`sass_loop_counts`).
Run under another triton (``PYTHONPATH=<an unpacked triton wheel>``) it checks that release builds the kernels
(:data:`quantmla_core.backends.triton.MIN_TRITON`); :func:`compile_launch` speaks both ``ASTSource`` APIs (3.3+
and 3.0-3.2).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

#: the launch options of a Triton launch (not kernel arguments)
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg", "enable_fp_fusion", "launch_pdl")
_TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8",
                  torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}


@dataclass
class Launch:
    """One recorded launch: the ``kernel`` (a ``triton.jit`` function), its positional ``args``, its constexprs
    and its launch ``options``."""

    name: str
    kernel: Any
    args: tuple
    constexprs: dict[str, Any]
    options: dict[str, int] = field(default_factory=dict)


class _Recorder:
    """Stands in for a ``triton.jit`` kernel: ``kernel[grid](*args, **kw)`` records a :class:`Launch`."""

    def __init__(self, name: str, kernel: Any, into: list[Launch]):
        self.name, self.kernel, self.into = name, kernel, into

    def __getitem__(self, grid):
        def launch(*args, **kw):
            options = {k: kw.pop(k) for k in LAUNCH_OPTIONS if k in kw}
            self.into.append(Launch(self.name, self.kernel, args, kw, options))

        return launch


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """While active, the Triton writer and attention launchers record their launches instead of running them (the
    list this yields); ``TRITON_INTERPRET`` is unset so that they plan as on a GPU."""
    import os

    from . import attention as att
    from . import writer as wr

    seen: list[Launch] = []
    saved = (dict(att._KERNELS), att.protect_kernel, att.merge_kernel, wr.write_kernel,
             os.environ.pop("TRITON_INTERPRET", None))
    try:
        for variant, kernel in saved[0].items():
            att._KERNELS[variant] = _Recorder(f"split_{variant}", kernel, seen)
        att.protect_kernel = _Recorder("protect", saved[1], seen)
        att.merge_kernel = _Recorder("merge", saved[2], seen)
        wr.write_kernel = _Recorder("write", saved[3], seen)
        yield seen
    finally:
        att._KERNELS.clear()
        att._KERNELS.update(saved[0])
        att.protect_kernel, att.merge_kernel, wr.write_kernel = saved[1], saved[2], saved[3]
        if saved[4] is not None:
            os.environ["TRITON_INTERPRET"] = saved[4]


def _arg_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TRITON_DTYPES[value.dtype]
    if isinstance(value, torch.dtype):  # a pointer of that dtype, as Triton's warm-up builds take one
        return "*" + _TRITON_DTYPES[value]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2 ** 31) <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type a kernel argument of {type(value).__name__}")


def defaults_of(signature: Any, given: set[str], kernel_name: str) -> dict[str, Any]:
    """The parameters of a kernel's ``signature`` (``inspect.signature(kernel.fn).parameters``) not in ``given``, at
    their defaults (constexprs a launch leaves out); a ValueError for one without a default."""
    left = {}
    for p, param in signature.items():
        if p not in given:
            if param.default is inspect.Parameter.empty:
                raise ValueError(f"{kernel_name}: no value for parameter {p!r}")
            left[p] = param.default
    return left


def compile_launch(launch: Launch, target) -> Any:
    """``triton.compile`` of ``launch`` for ``target`` (a ``GPUTarget``): the compiled kernel (``.asm``, ``.metadata``)."""
    import triton
    from triton.compiler import ASTSource

    signature = inspect.signature(launch.kernel.fn).parameters
    params = list(signature)
    runtime = [p for p in params if p not in launch.constexprs]
    if len(runtime) < len(launch.args):
        raise ValueError(f"{launch.name}: {len(launch.args)} positional arguments for {len(runtime)} parameters")
    sig: dict[str, str] = {}
    attrs: dict[tuple[int], list] = {}
    for p, value in zip(runtime, launch.args):
        sig[p] = _arg_type(value)
        aligned = (isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0) or isinstance(value, torch.dtype) or (
            type(value) is int and value % 16 == 0)
        if aligned:
            attrs[(params.index(p),)] = [["tt.divisibility", 16]]
    consts = {p: v for p, v in launch.constexprs.items() if p in params}
    consts.update(defaults_of(signature, {*sig, *consts}, launch.name))
    if "constexprs" in inspect.signature(ASTSource).parameters:
        sig.update({p: "constexpr" for p in consts})
        src = ASTSource(launch.kernel, sig, constexprs={(params.index(p),): v for p, v in consts.items()}, attrs=attrs)
    else:  # triton < 3.3: constants by name, an AttrsDescriptor of the aligned arguments' indices
        src = ASTSource(launch.kernel, sig, consts, _old_attrs([i for (i,) in attrs]))
    cuda_only = ("maxnreg", "launch_pdl")
    options = {k: v for k, v in launch.options.items() if k not in cuda_only or target.backend == "cuda"}
    return triton.compile(src, target=target, options=options)


def _old_attrs(divisible_by_16: list[int]) -> Any:
    """The ``AttrsDescriptor`` of triton 3.0-3.2 for arguments at ``divisible_by_16`` (parameter indices)."""
    try:  # 3.2
        from triton.backends.compiler import AttrsDescriptor

        return AttrsDescriptor.from_hints({i: 16 for i in divisible_by_16})
    except ImportError:  # 3.0, 3.1
        from triton.compiler.compiler import AttrsDescriptor

        return AttrsDescriptor(divisible_by_16=tuple(divisible_by_16), equal_to_1=())


def amd_resources(compiled) -> dict[str, int]:
    """What the AMD backend reports for a compiled kernel: VGPRs (architectural + accumulation), AGPRs, VGPR and SGPR
    spills, scratch bytes a lane, LDS bytes, waves a SIMD, and the number of MFMA instructions."""
    asm = compiled.asm["amdgcn"]

    def first(pattern: str) -> int:
        m = re.search(pattern, asm)
        return int(m.group(1)) if m else -1

    return {"vgpr": first(r"\.vgpr_count:\s+(\d+)"), "agpr": first(r"NumAgprs:\s*(\d+)"),
            "vgpr_spill": first(r"\.vgpr_spill_count:\s+(\d+)"), "sgpr_spill": first(r"\.sgpr_spill_count:\s+(\d+)"),
            "scratch": first(r"ScratchSize:\s*(\d+)"), "lds": int(compiled.metadata.shared),
            "occupancy": first(r"Occupancy:\s*(\d+)"), "mfma": len(re.findall(r"\bv_mfma", asm))}


def launches_of(fmt_name: str, heads: int = 16, s_q: int = 1, latent_dim: int = 512, rope_dim: int = 64,
                length: int = 4096, page_size: int = 64, dtype: torch.dtype = torch.bfloat16) -> list[Launch]:
    """The launches of one write and one attention call on a ``fmt_name`` cache (``dtype`` tokens and queries, 2
    requests of ``length`` tokens, sink 4 / local 128), recorded on CPU tensors: the kernels a GPU call builds. The
    launcher plans as for an H200 here (no device limits, ``v3_suits``); set ``QUANTMLA_TRITON_ATTENTION`` to record
    another split kernel."""
    import quantmla_core as qm

    from .attention import attention
    from .writer import write

    fmt = qm.PackFormat.parse(fmt_name, latent_dim=latent_dim, rope_dim=rope_dim, page_size=page_size)
    b, pages_per = 2, -(-length // page_size)
    cache = qm.MLACache.allocate(fmt, b * pages_per, b, 4, 128, "cpu")
    n = 8
    latent, rope = torch.zeros(n, latent_dim, dtype=dtype), torch.zeros(n, rope_dim, dtype=dtype)
    ids, pos = torch.zeros(n, dtype=torch.int64), torch.arange(n, dtype=torch.int64)
    lens = torch.full((b,), length, dtype=torch.int64)
    table = torch.arange(b * pages_per, dtype=torch.int32).view(b, pages_per)
    q = torch.zeros(b, s_q, heads, latent_dim, dtype=dtype)
    r = torch.zeros(b, s_q, heads, rope_dim, dtype=dtype)
    with recorded_launches() as seen:
        write(cache, latent, rope, pos.clone(), ids, pos, lens)
        attention(q, r, cache, table, lens, torch.arange(b, dtype=torch.int64), 0.07)
    return seen


#: (format, heads): the writer, the split kernel auto runs (v2 at 16 rows, v3 at 128 for packed formats; v1 and v3 for
#: BF16 pages), the protected tiles and the merge
DEFAULT_MATRIX = [("C4R4", 16), ("C2R4", 16), ("C8R8", 16), ("BF16", 16), ("C4R4", 128), ("BF16", 128)]


def target_of(arch: str):
    """The ``GPUTarget`` of ``arch``: ``"gfx942"`` (AMD, wave 64) or ``"sm_90"`` / ``"90"`` (NVIDIA)."""
    from triton.backends.compiler import GPUTarget

    if arch.startswith("gfx"):
        return GPUTarget("hip", arch, 64)
    return GPUTarget("cuda", int(arch.removeprefix("sm_")), 32)


def _nvidia_tool(name: str) -> str:
    """The path of ``name`` (``ptxas``, ``cuobjdump``, ...) among the NVIDIA tools Triton's wheel bundles."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


@contextlib.contextmanager
def _temp_file(data: str | bytes, suffix: str) -> Iterator[str]:
    """The path of a temporary file holding ``data``, removed afterwards (the NVIDIA tools read files)."""
    with tempfile.NamedTemporaryFile("wb" if isinstance(data, bytes) else "w", suffix=suffix, delete=False) as f:
        f.write(data)
    try:
        yield f.name
    finally:
        os.unlink(f.name)


def _run_ptxas(arch: str, ptx_path: str) -> subprocess.CompletedProcess:
    """``ptxas -v`` of Triton's wheel on ``ptx_path`` for ``arch`` (``sm_90a``): the ``ptxas`` Triton builds that
    target with first (``ptxas-blackwell`` from sm_100), the other where the first refuses the PTX version."""
    names = ["ptxas", "ptxas-blackwell"]
    if int(re.sub(r"\D", "", arch)) >= 100:
        names.reverse()
    r = None
    for path in [p for p in map(_nvidia_tool, names) if os.path.exists(p)]:
        r = subprocess.run([path, "-v", "--gpu-name", arch, ptx_path, "-o", os.devnull], capture_output=True, text=True)
        if r.returncode == 0:
            break
    if r is None:
        raise RuntimeError(f"this triton has no ptxas in {os.path.dirname(_nvidia_tool('ptxas'))}")
    return r


def nvidia_resources(compiled) -> dict[str, int]:
    """Registers, spill bytes (stores), shared memory and MMA instructions (``wgmma``, ``mma.sync``) of a kernel
    compiled for an NVIDIA target, from the ``ptxas -v`` bundled with Triton (registers are known only once a
    driver loads the cubin); ``tcgen05`` counts Blackwell's tensor-memory MMAs."""
    ptx = compiled.asm["ptx"]
    arch = re.search(r"^\.target\s+(\w+)", ptx, re.M).group(1)
    with _temp_file(ptx, ".ptx") as path:
        r = _run_ptxas(arch, path)
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed on {compiled.metadata.name}: {r.stderr[-500:]}")
    txt = r.stderr + r.stdout
    regs, spill = re.search(r"Used (\d+) registers", txt), re.search(r"(\d+) bytes spill stores", txt)
    if regs is None:
        raise RuntimeError(f"ptxas -v reported no register count for {compiled.metadata.name}: {txt[-500:]}")
    return {"regs": int(regs.group(1)), "spill_bytes": int(spill.group(1)) if spill else 0,
            "shared": int(compiled.metadata.shared), "tmem": int(getattr(compiled.metadata, "tmem_size", 0) or 0),
            "trap": "trap;" in ptx, "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
            "mma_sync": len(re.findall(r"\bmma\.sync", ptx)), "tcgen05": len(re.findall(r"tcgen05\.mma", ptx)),
            **sass_loop_counts(compiled)}


def sass_loop_counts(compiled) -> dict[str, int]:
    """Instructions of a kernel compiled for NVIDIA, from ``cuobjdump -sass`` of its cubin (Triton's own): all of
    them, those inside loops (between a backward branch and its target), and among those the local-memory spill stores
    (STL) and loads (LDL), the plain shared-memory stores (STS) and loads (LDS) and the CTA barriers (BAR), and the
    length of each outermost loop in program order (``loop_sizes``)."""
    with _temp_file(compiled.asm["cubin"], ".cubin") as path:
        sass = subprocess.run([_nvidia_tool("cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    index: dict[int, int] = {}
    ins: list[str] = []
    for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*)$", sass, re.M):
        index[int(m.group(1), 16)] = len(ins)
        ins.append(m.group(2))
    in_loop = [False] * len(ins)
    for i, text in enumerate(ins):
        m = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
        start = index.get(int(m.group(1), 16)) if m else None
        if start is not None and start <= i:
            in_loop[start:i + 1] = [True] * (i + 1 - start)
    runs = [len(list(g)) for inside, g in itertools.groupby(in_loop) if inside]
    return {"sass": len(ins), "sass_in_loops": sum(in_loop), "loop_sizes": runs,
            "stl_in_loops": sum("STL" in t for t, inside in zip(ins, in_loop) if inside),
            "ldl_in_loops": sum("LDL" in t for t, inside in zip(ins, in_loop) if inside),
            "sts_in_loops": sum(_opcode(t) == "STS" for t, inside in zip(ins, in_loop) if inside),
            "lds_in_loops": sum(_opcode(t) == "LDS" for t, inside in zip(ins, in_loop) if inside),
            "bar_in_loops": sum(_opcode(t) == "BAR" for t, inside in zip(ins, in_loop) if inside)}


def _opcode(instruction: str) -> str:
    """A SASS instruction's opcode without its predicate and modifiers (``@!P0 STS.128 [R1], R2`` -> ``STS``)."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def innermost_error(exc: BaseException) -> str:
    """``Type: message`` of the exception that started ``exc``'s chain: the compiler's own words (a failing
    ``triton.compile`` raises at the outermost call of a kernel's helpers)."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    return f"{type(exc).__name__}: {exc}"


def main(argv: list[str]) -> None:
    import triton

    dims = [a for a in argv if a.startswith("dims=")]
    argv = [a for a in argv if a not in dims]
    latent_dim, rope_dim = (int(x) for x in (dims[-1][5:] if dims else "512,64").split(","))
    arch = argv[0] if argv else "gfx942"
    runs = [(f, h) for f in argv[1:] for h in (16, 128)] if len(argv) > 1 else DEFAULT_MATRIX
    target = target_of(arch)
    resources = amd_resources if target.backend == "hip" else nvidia_resources
    for fmt_name, heads in runs:
        for launch in launches_of(fmt_name, heads, latent_dim=latent_dim, rope_dim=rope_dim):
            try:
                res = resources(compile_launch(launch, target))
            except Exception as exc:  # report, keep going
                res = {"err": innermost_error(exc)[-300:]}
            print({"triton": triton.__version__, "arch": arch, "fmt": fmt_name, "dims": (latent_dim, rope_dim), "H": heads,
                   "kernel": launch.name, **launch.options, **res}, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
