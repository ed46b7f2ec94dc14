"""Offline sm_90a builds of the Gluon kernels v4 (``attention_v4_kernel.split_kernel_v4``), v5
(``attention_v5_kernel.split_kernel_v5``) and v6 (``attention_v6_kernel.split_kernel_v6``): no GPU needed.

The launch the Triton launcher records for kernel v3 at H = 128 (``offline_build.launches_of`` with
``QUANTMLA_TRITON_ATTENTION=v3``: its positional arguments and constexprs) is compiled with ``split_kernel_v4``
(or v5, v6) in its place, 4 warps in the default partition, through Gluon's AST source for
``GPUTarget("cuda", 90, 32)``.

    python -m quantmla_core.backends.triton.offline_v4 [BF16|C4R4|C2R4] [loader_regs=N] [pipeline=0-3] [probe=0-3]
        [loader_warps=4|8] [inline_prot=0|1] [channel_order=0|1]
    python -m quantmla_core.backends.triton.offline_v4 [BF16|C4R4|C2R4] kernel=5 [block_r=16|32] [ahead=1|2]
        [inline_prot=0|1] [channel_order=0|1]
    python -m quantmla_core.backends.triton.offline_v4 [C4R4|C2R4] kernel=6 [ahead=0|1|2] [inline_prot=0|1]
        [key_planes=0|1]

prints :func:`compile_report`'s dict: registers and spilled bytes (``ptxas -v``), shared memory, ``wgmma`` count in
the PTX, ``setmaxnreg`` values, SASS instruction counts (``cuobjdump``, where Triton bundles it).
"""

from __future__ import annotations

import inspect
import os
import re
import sys
from typing import Any

FORMATS = ("BF16", "C4R4", "C2R4")


def channel_order_of(fmt_name: str, channel_order: bool) -> bool:
    """The channel order a ``fmt_name`` build takes when asked for ``channel_order``: packed formats only (BF16 pages
    are read in plain order)."""
    return bool(channel_order) and fmt_name != "BF16"


def v3_launch(fmt_name: str, heads: int = 128) -> Any:
    """The split-kernel launch (``offline_build.Launch``) the launcher records for kernel v3 on a ``fmt_name`` cache
    with ``heads`` query rows a request (S_q = 1)."""
    from .offline_build import launches_of

    saved = os.environ.get("QUANTMLA_TRITON_ATTENTION")
    os.environ["QUANTMLA_TRITON_ATTENTION"] = "v3"
    try:
        launches = launches_of(fmt_name, heads)
    finally:
        if saved is None:
            os.environ.pop("QUANTMLA_TRITON_ATTENTION", None)
        else:
            os.environ["QUANTMLA_TRITON_ATTENTION"] = saved
    return next(x for x in launches if x.name == "split_v3")


def compile_v4(fmt_name: str = "C4R4", loader_regs: int = 0, heads: int = 128, pipeline: int = 0, probe: int = 0,
               loader_warps: int = 4, inline_prot: bool = False, channel_order: bool = False) -> Any:
    """``triton.compile`` of ``split_kernel_v4`` for sm_90a with v3's recorded launch (see the module docstring);
    ``channel_order`` applies to packed formats (BF16 pages are read in plain order)."""
    from .attention_v4_kernel import GLUON_IMPORT_ERROR

    if GLUON_IMPORT_ERROR is not None:
        raise RuntimeError(f"no Gluon in this triton: {GLUON_IMPORT_ERROR}")
    from .attention_v4_kernel import split_kernel_v4

    consts = {"PIPELINE": int(pipeline), "PROBE": int(probe), "LOADER_WARPS": int(loader_warps)}
    if loader_regs:
        consts["LOADER_REGS"] = int(loader_regs)
    return _compile_gluon(split_kernel_v4, fmt_name, consts, heads, inline_prot, channel_order)


def compile_v5(fmt_name: str = "C4R4", block_r: int = 16, ahead: int = 1, inline_prot: bool = False,
               channel_order: bool = False, attenders: int = 1, loader_warps: int = 8, probe: int = 0) -> Any:
    """``triton.compile`` of ``split_kernel_v5`` for sm_90a with v3's recorded launch at H = 128 (the rows change
    nothing in the build), ``block_r`` query rows a program, the converter's loads ``ahead`` pages early, its
    ``attenders``, the converter's ``loader_warps``, a ``probe`` build."""
    from .attention_v4_kernel import GLUON_IMPORT_ERROR

    if GLUON_IMPORT_ERROR is not None:
        raise RuntimeError(f"no Gluon in this triton: {GLUON_IMPORT_ERROR}")
    from .attention_v5_kernel import split_kernel_v5

    consts = {"BLOCK_R": int(block_r), "AHEAD": int(ahead), "LOADER_WARPS": int(loader_warps),
              "ATTENDERS": int(attenders), "PROBE": int(probe)}
    return _compile_gluon(split_kernel_v5, fmt_name, consts, 128, inline_prot, channel_order)


def compile_v6(fmt_name: str = "C4R4", ahead: int = 1, inline_prot: bool = False, key_planes: bool = False) -> Any:
    """``triton.compile`` of ``split_kernel_v6`` for sm_90a with v3's recorded launch at H = 128, 16 query rows a
    program, its ``AHEAD`` (0: each page's bytes at its start, 1: a page ahead, 2: two chunks ahead), the protected
    tokens inline or not, the key tile as one shared allocation or one a plane (``KEY_PLANES``)."""
    from .attention_v4_kernel import GLUON_IMPORT_ERROR

    if GLUON_IMPORT_ERROR is not None:
        raise RuntimeError(f"no Gluon in this triton: {GLUON_IMPORT_ERROR}")
    from .attention_v6_kernel import split_kernel_v6

    overrides = {"BLOCK_R": 16, "AHEAD": int(ahead), "KEY_PLANES": bool(key_planes)}
    return _compile_gluon(split_kernel_v6, fmt_name, overrides, 128, inline_prot, False)


def _compile_gluon(kernel: Any, fmt_name: str, overrides: dict, heads: int, inline_prot: bool,
                   channel_order: bool) -> Any:
    """``triton.compile`` of the Gluon split ``kernel`` for sm_90a: v3's recorded launch for ``heads`` rows, its
    constexprs updated with ``overrides``, the protected tokens inline or not, the channel order (packed formats)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from .attention_v4_kernel import V4_NUM_WARPS
    from .common import FP_FUSION
    from .offline_build import _arg_type, defaults_of

    launch = v3_launch(fmt_name, heads)
    signature = inspect.signature(kernel.fn).parameters
    params = list(signature)
    consts = {p: v for p, v in launch.constexprs.items() if p in params}
    consts.update(overrides)
    consts["INLINE_PROT"] = bool(inline_prot)
    consts["CHANNEL_ORDER"] = channel_order_of(fmt_name, channel_order)
    runtime = [p for p in params if p not in consts and signature[p].default is inspect.Parameter.empty]
    sig: dict[str, str] = {}
    attrs: dict[tuple[int], list] = {}
    for p, value in zip(runtime, launch.args):
        sig[p] = _arg_type(value)
        if sig[p].startswith("*") or (type(value) is int and value % 16 == 0):
            attrs[(params.index(p),)] = [["tt.divisibility", 16]]
    if inline_prot:  # the protected rows' buffers (bfloat16), the requests' slots, the slot count
        sig.update(sink_ptr="*bf16", local_ptr="*bf16", ids_ptr="*i32", max_seqs="i32")
        attrs.update({(params.index(p),): [["tt.divisibility", 16]] for p in ("sink_ptr", "local_ptr", "ids_ptr")})
    consts.update(defaults_of(signature, {*sig, *consts}, kernel.fn.__name__))
    sig.update({p: "constexpr" for p in consts})
    src = GluonASTSource(kernel, sig, constexprs={(params.index(p),): v for p, v in consts.items()},
                         attrs=attrs)
    options = {"num_warps": V4_NUM_WARPS, "enable_fp_fusion": FP_FUSION}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_report(fmt_name: str = "C4R4", loader_regs: int = 0, pipeline: int = 0, probe: int = 0,
                   loader_warps: int = 4, inline_prot: bool = False, channel_order: bool = False) -> dict:
    """Resources of kernel v4 compiled offline for sm_90a: registers, spilled bytes, shared memory, ``wgmma`` in the
    PTX, whether ptxas serialized them, the ``setmaxnreg`` values and SASS instruction counts (``sass``: all; -1 where
    no ``cuobjdump``)."""
    k = compile_v4(fmt_name, loader_regs, pipeline=pipeline, probe=probe, loader_warps=loader_warps,
                   inline_prot=inline_prot, channel_order=channel_order)
    return {"triton": _triton_version(), "fmt": fmt_name, "pipeline": int(pipeline), "probe": int(probe),
            "loader_warps": int(loader_warps), "inline_prot": bool(inline_prot),
            "channel_order": channel_order_of(fmt_name, channel_order), **_resources(k)}


def compile_report_v5(fmt_name: str = "C4R4", block_r: int = 16, ahead: int = 1, inline_prot: bool = False,
                      channel_order: bool = False, attenders: int = 1, loader_warps: int = 8, probe: int = 0) -> dict:
    """:func:`compile_report`'s resources of kernel v5 compiled offline for sm_90a."""
    k = compile_v5(fmt_name, block_r, ahead, inline_prot, channel_order, attenders, loader_warps, probe)
    return {"triton": _triton_version(), "kernel": 5, "fmt": fmt_name, "block_r": int(block_r), "ahead": int(ahead),
            "inline_prot": bool(inline_prot), "channel_order": channel_order_of(fmt_name, channel_order),
            "attenders": int(attenders), "loader_warps": int(loader_warps), "probe": int(probe), **_resources(k)}


def compile_report_v6(fmt_name: str = "C4R4", ahead: int = 1, inline_prot: bool = False,
                      key_planes: bool = False) -> dict:
    """:func:`compile_report`'s resources of kernel v6 compiled offline for sm_90a."""
    k = compile_v6(fmt_name, ahead, inline_prot, key_planes)
    return {"triton": _triton_version(), "kernel": 6, "fmt": fmt_name, "ahead": int(ahead),
            "inline_prot": bool(inline_prot), "key_planes": bool(key_planes), **_resources(k)}


def _triton_version() -> str:
    import triton

    return triton.__version__


def _resources(k: Any) -> dict:
    """A compiled sm_90a kernel's registers, spilled bytes, shared memory, ``wgmma`` count, whether ptxas serialized
    them, its ``setmaxnreg`` values and SASS counts (``sass`` -1 where no ``cuobjdump``)."""
    from .offline_build import _nvidia_tool, _run_ptxas, _temp_file, sass_loop_counts

    ptx = k.asm["ptx"]
    with _temp_file(ptx, ".ptx") as path:
        r = _run_ptxas("sm_90a", path)
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed: {r.stderr[-800:]}")
    txt = r.stderr + r.stdout
    regs, spill = re.search(r"Used (\d+) registers", txt), re.search(r"(\d+) bytes spill stores", txt)
    out = {"regs": int(regs.group(1)) if regs else -1,
           "spill_bytes": int(spill.group(1)) if spill else 0, "smem": int(k.metadata.shared),
           "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
           # ptxas C7514 / C7515: it found the accumulators touched inside an async pipeline stage and made every
           # wgmma of the kernel wait for the one before it
           "wgmma_serialized": bool(re.search(r"C751[0-9]\)? Potential Performance Loss", txt)),
           "setmaxnreg": sorted({int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})}
    if os.path.exists(_nvidia_tool("cuobjdump")):
        out.update(sass_loop_counts(k))
    else:
        out["sass"] = -1
    return out


def main(argv: list[str]) -> None:
    def option(name: str, default: int) -> int:  # the last ``name=N`` of argv
        return next((int(a.split("=", 1)[1]) for a in reversed(argv) if a.startswith(f"{name}=")), default)

    fmts = [a.upper() for a in argv if "=" not in a] or list(FORMATS)
    for f in fmts:
        try:
            if option("kernel", 4) == 6:
                print(compile_report_v6(f, option("ahead", 1), option("inline_prot", 0) == 1,
                                        option("key_planes", 0) == 1), flush=True)
                continue
            if option("kernel", 4) == 5:
                print(compile_report_v5(f, option("block_r", 16), option("ahead", 1), option("inline_prot", 0) == 1,
                                        option("channel_order", 0) == 1, option("attenders", 1),
                                        option("loader_warps", 8), option("probe", 0)), flush=True)
                continue
            print(compile_report(f, option("loader_regs", 0), option("pipeline", 0), option("probe", 0),
                                 option("loader_warps", 4), option("inline_prot", 0) == 1,
                                 option("channel_order", 0) == 1), flush=True)
        except Exception as exc:  # report, keep going
            from .offline_build import innermost_error

            print({"fmt": f, "err": innermost_error(exc)[-1500:]}, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
