"""Offline register / spill report of the split kernels for sm_90a — no GPU needed.

Compiles ``split_kernel`` (v1), ``split_kernel_v2`` or ``split_kernel_v3`` through Triton's own pipeline for an
sm_90 target (pointers assumed 16-byte aligned, as the runtime specialises torch tensors),
runs the ``ptxas`` bundled with Triton on the PTX with ``-v``, and reports registers, spill
bytes, shared memory and how many ``wgmma`` the TTGIR holds. Numbers track the H200's
``n_regs`` (v1 C4R4: 255 here and there); spill *bytes* here, not the driver's count.

    python -m quantmla_core.backends.triton.sm90_report            # the default matrix
    python -m quantmla_core.backends.triton.sm90_report v2 C4R4 block_r=32 num_warps=8
    python -m quantmla_core.backends.triton.sm90_report v3 C4R4 block_r=64 prefetch=false
"""

from __future__ import annotations

import inspect
import re
import sys

from . import slice_width
from .common import FP_FUSION, page_layout_constexprs
from .offline_build import defaults_of, nvidia_resources


def _consts(variant: str, fmt, block_n: int, block_r: int, bf16: bool, **switches) -> dict:
    quant = fmt.quantized
    cb, rb = (fmt.content_bits, fmt.rope_bits) if quant else (16, 16)
    cg = fmt.content_group_size if quant else 64
    rg = fmt.rope_group_size if quant else 64
    c = dict(Q_BF16=bf16, DOT_BF16=bf16, QUANT=quant, DC=fmt.latent_dim, DR=fmt.rope_dim, CBITS=cb, RBITS=rb, CG=cg,
             RG=rg, CCW=slice_width(fmt.latent_dim, cb, cg), RCW=slice_width(fmt.rope_dim, rb, rg),
             **page_layout_constexprs(fmt), BLOCK_N=block_n, BLOCK_R=block_r,
             PROBE_SKIP_PV=bool(switches.pop("skip_pv", False)))
    if variant in ("v2", "v3"):
        from .attention import v2_constexprs, v3_constexprs

        # an NVIDIA target: code words taken apart in PTX, as on the GPU
        switches = {"ptx_split": True, **switches}
        c.update((v2_constexprs if variant == "v2" else v3_constexprs)(quant, cb, rb, bf16, **switches))
    return c


def compile_report(variant: str = "v2", fmt_name: str = "C4R4", latent_dim: int = 512, rope_dim: int = 64,
                   page_size: int = 64, group_size: int = 64, bf16: bool = True, block_n: int | None = None,
                   block_r: int = 16, num_warps: int | None = None, num_stages: int | None = None,
                   maxnreg: int | None = None, **switches) -> dict:
    """Compile one split kernel for sm_90a and return its resources (see the module docstring)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from quantmla_core import PackFormat

    from . import heuristics as hz
    from .attention_kernel import split_kernel
    from .attention_v2_kernel import split_kernel_v2
    from .attention_v3_kernel import split_kernel_v3

    fmt = PackFormat.parse(fmt_name, latent_dim=latent_dim, rope_dim=rope_dim, page_size=page_size,
                           group_size=group_size)
    fn = {"v2": split_kernel_v2, "v3": split_kernel_v3}.get(variant, split_kernel)
    defaults = {"v2": (hz.V2_BLOCK_N, hz.V2_NUM_WARPS, hz.V2_NUM_STAGES),
                "v3": (hz.V3_BLOCK_N, hz.V3_NUM_WARPS, hz.V3_NUM_STAGES)}.get(variant, (min(page_size, hz.MAX_BLOCK_N), 4, 2))
    block_n = defaults[0] if block_n is None else block_n
    num_warps = defaults[1] if num_warps is None else num_warps
    num_stages = defaults[2] if num_stages is None else num_stages
    consts = _consts(variant, fmt, block_n, block_r, bf16, **switches)
    qt = "*bf16" if bf16 else "*fp32"
    types = dict(q_ptr=qt, qr_ptr=qt, pages_ptr="*u8", table_ptr="*i32", lens_ptr="*i32", o_part_ptr="*fp32",
                 lse_part_ptr="*fp32", stride_table="i32", num_pages="i32", sm_scale_log2="fp32", R="i32", H="i32",
                 S_Q="i32", SINK="i32", LOCAL="i32", NSPLIT="i32")
    signature = inspect.signature(fn.fn).parameters
    consts.update(defaults_of(signature, {*consts, *types}, fn.fn.__name__))  # PDL, ...
    params = list(signature)
    sig = {p: ("constexpr" if p in consts else types[p]) for p in params if p in consts or p in types}
    cex = {(params.index(k),): v for k, v in consts.items()}
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in types
             if types[p].startswith("*") or p in ("stride_table", "R")}
    opts = {"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": FP_FUSION}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    k = triton.compile(ASTSource(fn, sig, constexprs=cex, attrs=attrs), target=GPUTarget("cuda", 90, 32), options=opts)
    res = nvidia_resources(k)
    ttgir = k.asm["ttgir"]
    return {"variant": variant, "fmt": fmt.name, "dc": latent_dim, "P": page_size, "G": group_size, "bf16": bf16,
            "block_n": block_n, "block_r": block_r, "num_warps": num_warps, "num_stages": num_stages, **switches,
            "regs": res["regs"], "spill_bytes": res["spill_bytes"], "smem": res["shared"],
            "sass_in_loops": res["sass_in_loops"], "wgmma": len(re.findall(r"warp_group_dot ", ttgir)),
            "mma_sync": len(re.findall(r"tt\.dot ", ttgir))}


DEFAULT_MATRIX = [
    ("v1", "C4R4", {}),
    ("v2", "C4R4", {}),
    ("v2", "C2R4", {}),
    ("v2", "BF16", {}),
    ("v2", "C4R4", {"latent_dim": 256, "rope_dim": 32}),
    ("v2", "C4R4", {"block_r": 32}),
    ("v2", "C4R4", {"hold_raw": True}),
    ("v2", "C4R4", {"pv_form": 1}),
    ("v3", "C4R4", {"block_r": 64}),
    ("v3", "C4R4", {"block_r": 64, "word_codes": False}),
    ("v3", "C2R4", {"block_r": 64}),
    ("v3", "BF16", {"block_r": 64}),
]


def _parse(v: str):
    for cast in (int,):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def main(argv: list[str]) -> None:
    if argv:
        variant, fmt_name, *rest = argv
        runs = [(variant, fmt_name, {k: _parse(v) for k, v in (a.split("=", 1) for a in rest)})]
    else:
        runs = DEFAULT_MATRIX
    for variant, fmt_name, kw in runs:
        try:
            print(compile_report(variant, fmt_name, **kw), flush=True)
        except Exception as exc:  # report, keep going
            print({"variant": variant, "fmt": fmt_name, **kw, "err": f"{type(exc).__name__}: {exc}"[:400]}, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
