"""Which CuPy attention kernel a call runs (v1-v6, see :mod:`.attention`), and why a faster one does not.

``QUANTMLA_CUPY_ATTENTION`` (``auto``, the default: v6, else v4, where it serves and a request has at
least :data:`V4_MIN_ROWS` query rows, else, where the block table holds at least :data:`V3_MIN_TOKENS`
tokens, v5 where it serves and v3 where it does not, else v5 where it serves and the batch's block
tables hold at least :data:`V5_MIN_BATCH_TOKENS` tokens, else v2 where it serves, else v1; or ``v1`` /
``v2`` / ``v3`` / ``v4`` / ``v5`` / ``v6``; read on every call, nothing global is rewritten) picks the kernel.
:func:`select_variant` says which kernel a call will run, and why.
"""

from __future__ import annotations

from functools import lru_cache

from ...envvars import getenv
from ...formats import PackFormat
from . import nvrtc_version
from .builds import V2_WARPS, V4_WGMMA_NVRTC, V5_CAPABILITY, smem_per_block, v4_smem_bytes

#: environment variable that selects the attention kernel (read per call)
VARIANT_ENV = "QUANTMLA_CUPY_ATTENTION"
VARIANTS = ("auto", "v1", "v2", "v3", "v4", "v5", "v6")

#: auto picks v3 when the block table holds at least this many tokens per request. Measured on the
#: H200 (CUDA graphs, C4R4 H16 B32): v3 costs ~6.9 ns per token and request against v2's ~9.8 but
#: ~90 us of fixed cost against ~48 us, so it wins from ~14K tokens (benchmarks/RESULTS.md)
V3_MIN_TOKENS = 16384
#: auto also picks v5 for shorter tables when the batch holds at least this many tokens of block-table
#: capacity (batch x tokens per request). Measured on the H200 (CUDA graphs, H16, C4R4 and C2R4, stop 20):
#: v5 took 0.56-0.97x of v2's time at every shape from 64K tokens (B 8-128, L 2K-16K) and 1.05-1.15x at
#: 32K (B8 L4K, B16 L2K) (benchmarks/RESULTS.md)
V5_MIN_BATCH_TOKENS = 65536

#: auto picks v4 for requests with at least this many query rows (S_q * H)
V4_MIN_ROWS = 64


def requested_variant() -> str:
    """The kernel ``QUANTMLA_CUPY_ATTENTION`` asks for (``auto`` when unset), read now."""
    v = getenv(VARIANT_ENV, "").strip().lower() or "auto"
    if v not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV}: expected one of {VARIANTS}, got {v!r}")
    return v


def variant_nvrtc(capability: tuple[int, int]) -> tuple[int, int]:
    """The NVRTC version :func:`select_variant` needs for a GPU of ``capability``: asked on compute
    capability 9.0 (the sm_90a builds), elsewhere :data:`~.builds.V4_WGMMA_NVRTC` (no build there depends on it)."""
    return nvrtc_version() if tuple(capability) == V5_CAPABILITY else V4_WGMMA_NVRTC


def select_variant(fmt: PackFormat, dtype: str, capability: tuple[int, int] | None = None,
                   max_tokens: int | None = None, rows: int | None = None,
                   nvrtc: tuple[int, int] = V4_WGMMA_NVRTC, batch: int | None = None) -> tuple[str, str | None]:
    """(kernel a call runs, why a faster kernel does not run, or None). No side effects.

    ``auto`` runs, where a request has at least :data:`V4_MIN_ROWS` query rows (``rows`` = S_q * H;
    None: unknown, treated as few), v6 where it serves (packed 2/4-bit pages on compute capability 9.0),
    else v4 where it serves (H200, H64/H128: v6 took 0.75-0.84x of v4's time); with fewer rows and a block
    table that can hold at least :data:`V3_MIN_TOKENS` tokens per request (``max_tokens``; None:
    unknown, treated as short) v5 where it serves (compute capability 9.0, ``nvrtc`` the NVRTC
    version), else v3 where it serves; with a shorter table, v5 where it serves and ``batch``
    requests hold at least :data:`V5_MIN_BATCH_TOKENS` tokens of capacity (None: unknown, treated as
    few); else v2 where it serves, else v1, each time with the reason. Only the environment
    variable is read per call; the decision is memoised per (format, dtype, GPU, NVRTC, long or
    short, many rows or few, large batch or not)."""
    long_ctx = max_tokens is not None and max_tokens >= V3_MIN_TOKENS
    wide = rows is not None and rows >= V4_MIN_ROWS
    busy = batch is not None and max_tokens is not None and batch * max_tokens >= V5_MIN_BATCH_TOKENS
    return _decide_variant(requested_variant(), fmt, dtype, None if capability is None else tuple(capability),
                           long_ctx, wide, tuple(nvrtc), busy)


@lru_cache(maxsize=1024)
def _decide_variant(want: str, fmt: PackFormat, dtype: str, capability: tuple[int, int] | None,
                    long_ctx: bool = False, wide: bool = False,
                    nvrtc: tuple[int, int] = V4_WGMMA_NVRTC, busy: bool = False) -> tuple[str, str | None]:
    if want == "v1":
        return "v1", None
    if not fmt.quantized and want in ("v4", "auto"):  # bf16 pages: v4 (many rows) or v1
        why4 = v4_unsupported_reasons(fmt, capability, dtype)
        if not why4 and (want == "v4" or wide):
            return "v4", None
        if why4:
            return "v1", "; ".join(why4)
        return "v1", f"auto runs v4 over bf16 pages from {V4_MIN_ROWS} query rows per request"
    why = v2_unsupported_reasons(fmt, dtype)
    if capability is not None and tuple(capability) < (8, 0):
        why.append(f"v2 needs compute capability 8.0+ (got {capability[0]}.{capability[1]})")
    if why:
        return "v1", "; ".join(why)
    if want == "v2":
        return "v2", None
    why5 = v5_unsupported_reasons(fmt, capability, dtype, nvrtc)
    if want in ("v3", "v4", "v5", "v6"):
        why_w = {"v3": lambda: v3_unsupported_reasons(fmt), "v4": lambda: v4_unsupported_reasons(fmt, capability),
                 "v5": lambda: why5, "v6": lambda: v6_unsupported_reasons(fmt, capability, dtype, nvrtc)}[want]()
        return (want, None) if not why_w else ("v2", "; ".join(why_w))
    if wide:
        why6 = v6_unsupported_reasons(fmt, capability, dtype, nvrtc)
        if not why6:
            return "v6", None
        if not v4_unsupported_reasons(fmt, capability):
            # on an H200 with too old an NVRTC, say what v6 needs; elsewhere v4 is the fastest there is
            return "v4", ("; ".join(why6) if capability == V5_CAPABILITY else None)
    if (long_ctx or busy) and not why5:
        return "v5", None
    why3 = v3_unsupported_reasons(fmt)
    if not why3 and not long_ctx:
        why3 = [f"auto runs v3 from {V3_MIN_TOKENS} tokens of block-table capacity (shorter: v2 is faster)"]
    if why3:
        return "v2", "; ".join(why3)
    # on an H200 with too old an NVRTC, say what v5 needs; elsewhere v3 is the fastest there is
    return "v3", ("; ".join(why5) if capability == V5_CAPABILITY else None)


def v2_unsupported_reasons(fmt: PackFormat, dtype: str) -> list[str]:
    """Why kernel v2 cannot serve ``fmt`` with ``dtype`` queries (empty: it can)."""
    reasons = []
    if dtype != "bfloat16":
        reasons.append(f"v2 serves bfloat16 queries (got {dtype})")
    if not fmt.quantized or fmt.content_bits not in (2, 4) or fmt.rope_bits != 4:
        reasons.append(f"v2 serves 2/4-bit content with 4-bit RoPE codes (got {fmt.name})")
    if fmt.latent_dim not in (256, 512) or fmt.rope_dim not in (32, 64):
        reasons.append(f"v2 serves d_c/d_r 512/64 and 256/32 (got {fmt.latent_dim}/{fmt.rope_dim})")
    elif fmt.quantized and fmt.content_bits in (2, 4):
        cbw = fmt.content_code_bytes // V2_WARPS  # channels of one warp slice per nibble slice
        if fmt.content_group_size % cbw:
            reasons.append(f"v2 needs the content group size to be a multiple of {cbw}")
        if fmt.rope_group_size != fmt.rope_dim:
            reasons.append("v2 needs one RoPE group per token")
    return reasons


def v3_unsupported_reasons(fmt: PackFormat) -> list[str]:
    """Why kernel v3 cannot serve ``fmt`` where v2 can (empty: it can): its QK flushes scales
    per 64-channel sub-group, so content groups must be whole multiples of 64 channels."""
    if fmt.content_group_size % 64:
        return [f"v3 needs the content group size to be a multiple of 64 (got {fmt.content_group_size})"]
    return []


def v4_unsupported_reasons(fmt: PackFormat, capability: tuple[int, int] | None = None,
                           dtype: str = "bfloat16") -> list[str]:
    """Why kernel v4 cannot serve ``fmt`` with ``dtype`` queries (empty: it can): bfloat16 queries
    over what v2 serves (2/4-bit content, 4-bit RoPE codes, d_c/d_r 512/64 or 256/32) with one RoPE
    scale per token, or over bf16 pages; its shared memory must fit one block of the GPU."""
    reasons = []
    if not fmt.quantized:
        if dtype != "bfloat16":
            reasons.append(f"v4 serves bfloat16 queries (got {dtype})")
        if (fmt.latent_dim, fmt.rope_dim) not in ((512, 64), (256, 32)):
            reasons.append(f"v4 serves d_c/d_r 512/64 and 256/32 (got {fmt.latent_dim}/{fmt.rope_dim})")
    else:
        reasons += [r.replace("v2 ", "v4 ", 1) for r in v2_unsupported_reasons(fmt, dtype)]
    if reasons:
        return reasons
    need, have = v4_smem_bytes(fmt), smem_per_block(capability)
    if need > have:
        cap = "this GPU" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
        reasons.append(f"v4 needs {need} B of shared memory per block for {fmt.name} d_c={fmt.latent_dim}, "
                       f"{cap} allows {have}")
    return reasons


def v5_unsupported_reasons(fmt: PackFormat, capability: tuple[int, int] | None, dtype: str = "bfloat16",
                           nvrtc: tuple[int, int] = V4_WGMMA_NVRTC) -> list[str]:
    """Why kernel v5 cannot serve ``fmt`` with ``dtype`` queries on a GPU of ``capability`` (None:
    not known, so not served) with ``nvrtc`` (empty: it can): what v4 serves over packed pages,
    on compute capability 9.0 with an NVRTC that builds for sm_90a."""
    reasons = [r.replace("v2 ", "v5 ", 1) for r in v2_unsupported_reasons(fmt, dtype)]
    if capability is None or tuple(capability) != V5_CAPABILITY:
        got = "an unknown GPU" if capability is None else f"{capability[0]}.{capability[1]}"
        reasons.append(f"v5 needs compute capability 9.0 (sm_90a wgmma), got {got}")
    if tuple(nvrtc) < V4_WGMMA_NVRTC:
        reasons.append(f"v5 needs NVRTC {V4_WGMMA_NVRTC[0]}.{V4_WGMMA_NVRTC[1]}+ to build for sm_90a, "
                       f"got {nvrtc[0]}.{nvrtc[1]}")
    return reasons


def v6_unsupported_reasons(fmt: PackFormat, capability: tuple[int, int] | None, dtype: str = "bfloat16",
                           nvrtc: tuple[int, int] = V4_WGMMA_NVRTC) -> list[str]:
    """Why kernel v6 cannot serve ``fmt`` with ``dtype`` queries on a GPU of ``capability`` (empty: it
    can): what v5 serves (2/4-bit content and 4-bit RoPE codes over packed pages, bf16 queries, compute
    capability 9.0, an NVRTC that builds sm_90a)."""
    return [r.replace("v5 ", "v6 ", 1) for r in v5_unsupported_reasons(fmt, capability, dtype, nvrtc)]
