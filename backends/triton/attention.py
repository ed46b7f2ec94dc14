"""Triton decode attention: split-KV kernel over packed pages, protected-tile kernel, merge kernel.

See ``attention_kernel.py`` for the math and ``heuristics.py`` for the launch rules.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from types import MappingProxyType
from typing import Mapping

import torch
import triton

from ...envvars import env_int_choice, getenv
from ..buffers import capturing as graph_capturing
from ..buffers import carve
from ..prepared_calls import call_key, reuse_or_prepare
from ..streams import fork_side_stream, join_side_stream, launching_on
from . import interpreting, slice_width
from .attention_kernel import merge_kernel, protect_kernel, split_kernel
from .attention_v2_kernel import split_kernel_v2
from .attention_v3_kernel import split_kernel_v3
from .attention_v4_kernel import GLUON_IMPORT_ERROR, split_kernel_v4
from .attention_v5_kernel import split_kernel_v5
from .attention_v6_kernel import split_kernel_v6
from .common import launch_dims, page_layout_constexprs, ptr_or_dummy
from .heuristics import (INTERPRETER_SM_COUNT, MERGE_BLOCK_C, MERGE_BLOCK_R, MERGE_WARPS, PDL_MODES,
                         PROTECT_STAGES, TMEM_COLUMNS, V2_CODE_WORDS, V2_FLOAT32_ON_GPU, V2_HOLD_RAW, V2_ZSUB,
                         V3_BLOCK_N, V3_BLOCK_R, V3_MIN_ROWS, V3_NUM_STAGES, V3_NUM_WARPS, V3_PREFETCH, AttentionPlan,
                         DeviceLimits, PROTECT_ROWS_CHOICES, merge_load_width, pdl_default, plan, plan_v2, plan_v3,
                         planned_shared_max, plan_v4, protect_parts, v3_code_words, v3_tile_groups, v3_word_lanes,
                         V4_AUTO, V4_CAPABILITY_MAJOR, V4_INLINE_PROTECT, V4_LOADER_WARPS, V4_MIN_ROWS, V4_PIPELINE,
                         v4_channel_order, v4_format_unsupported, plan_v5, V5_AHEAD, V5_AHEAD_2A, V5_AHEAD_CHOICES,
                         V5_AUTO, V5_ATTENDERS, V5_ATTENDERS_CHOICES, V5_BLOCK_R_CHOICES, V5_LOADER_WARPS,
                         V5_LOADER_WARPS_2A, V5_MAX_ROWS, plan_v6, V6_AHEAD, V6_AHEAD_CHOICES, V6_AUTO, V6_BLOCK_R,
                         V6_INLINE_PROTECT, V6_MIN_TABLE_TOKENS, v6_key_planes,
                         v6_format_unsupported)

#: environment variable choosing the split kernel ("auto" default, "v1" to "v6"); read on every call.
#: ``auto`` runs v4 (Gluon, Hopper) where it would run v3 and v4 serves the call (``heuristics.V4_AUTO``); below 64
#: query rows over packed pages v5 (Gluon, few rows) up to ``heuristics.V5_MAX_ROWS`` rows and v4 above. v6 (Gluon,
#: 16 rows a program, C4R4 / C2R4) runs only when asked for
VARIANT_ENV = "QUANTMLA_TRITON_ATTENTION"
VARIANTS = ("auto", "v1", "v2", "v3", "v4", "v5", "v6")
#: query rows a program of the protected-tile kernel attends (a measurement knob, read on every call; unset: the
#: plan's 16, see heuristics.PROTECT_ROWS_CHOICES)
PROTECT_ROWS_ENV = "QUANTMLA_TRITON_PROTECT_ROWS"
#: "1": the protected-tile kernel runs on a second stream beside the split kernel (bit-identical); "0" or unset: on the
#: caller's stream (read on every call). A measurement knob: as CUDA graphs on an H100 (stop 48) the fork made H16 B8
#: L4K 24 % slower (49.3 -> 61.4 us) and H128 B8 L4K no faster
PROTECTED_STREAM_ENV = "QUANTMLA_TRITON_PROTECTED_STREAM"
#: programmatic dependent launch (PDL, NVIDIA sm_90+): a kernel launched with it starts its programs while the one
#: before it finishes and waits on the GPU for that one's writes (bit-identical). "1": the merge kernel; "2": also
#: the protected-tile kernel, launched after the split kernel instead of before it (it reads no partial; it waits for
#: the split kernel only at its end, so that the merge, waiting for it, waits for both); "0": plain launches; unset:
#: :func:`heuristics.pdl_default` where the GPU and triton have PDL. Read when a call is prepared; 1 or 2 where they
#: have not is refused. With ``QUANTMLA_TRITON_PROTECTED_STREAM=1`` the launches are plain (the merge waits on the side
#: stream's event)
PDL_ENV = "QUANTMLA_TRITON_PDL"
#: kernel v4's build, 0 to 4 (:data:`heuristics.V4_PIPELINE` says what each is; unset: that default; 4 over BF16
#: pages is refused). A measurement knob, read when a call is prepared
V4_PIPELINE_ENV = "QUANTMLA_TRITON_V4_PIPELINE"
#: kernel v4's loader warps, 4 or 8 (:data:`heuristics.V4_LOADER_WARPS`; unset: that default). A measurement knob,
#: read when a call is prepared
V4_LOADER_WARPS_ENV = "QUANTMLA_TRITON_V4_LOADER_WARPS"
#: "1": the last split of kernel v4 (v5, v6) also attends to the protected tokens (bfloat16 protection only), so that no
#: protected-tile kernel runs; "0": that kernel runs; unset: :data:`heuristics.V4_INLINE_PROTECT`. Read when a call is
#: prepared
V4_INLINE_PROTECT_ENV = "QUANTMLA_TRITON_V4_INLINE_PROTECT"
#: "1": kernel v4 keeps a packed cache's key tiles in ``channel_of`` order; "0": in plain order; unset:
#: :func:`heuristics.v4_channel_order` (by pages a split). BF16 pages are always read in plain order. Read when a call
#: is prepared
V4_CHANNEL_ORDER_ENV = "QUANTMLA_TRITON_V4_CHANNEL_ORDER"
#: kernel v4's measurement builds, WRONG OUTPUTS (benchmarks only; a warning on every call that takes one): 1, the
#: loader loads and writes no keys; 2, it skips its output product; 3, both; 4, it loads no packed page bytes (it
#: dequantizes made-up words). Unset or 0: the real kernel
V4_PROBE_ENV = "QUANTMLA_TRITON_V4_PROBE"
#: kernel v5's query rows a program, 16 or 32 (unset: :func:`heuristics.v5_block_r`, 16 up to 16 rows a request and
#: 32 above). A measurement knob, read when a call is prepared
V5_BLOCK_R_ENV = "QUANTMLA_TRITON_V5_BLOCK_R"
#: pages between kernel v5's loads of a packed page and its conversion, 1 or 2 (:data:`heuristics.V5_AHEAD`; unset:
#: that default). A measurement knob, read when a call is prepared
V5_AHEAD_ENV = "QUANTMLA_TRITON_V5_AHEAD"
#: kernel v5's attending warpgroups, 1 or 2 (:data:`heuristics.V5_ATTENDERS`; 2 with 16 rows a program only). A
#: measurement knob, read when a call is prepared
V5_ATTENDERS_ENV = "QUANTMLA_TRITON_V5_ATTENDERS"
#: kernel v5's converter warps, 4 or 8 (unset: :data:`heuristics.V5_LOADER_WARPS` beside one attender,
#: :data:`heuristics.V5_LOADER_WARPS_2A` beside two). A measurement knob, read when a call is prepared
V5_LOADER_WARPS_ENV = "QUANTMLA_TRITON_V5_LOADER_WARPS"
#: kernel v5's measurement builds, WRONG OUTPUTS (benchmarks only; a warning on every call that takes one): 1, the
#: converter hands the key slots over unwritten (no page loaded or converted); 2, the attenders hand them back unread
#: (no products, no softmax). Unset or 0: the real kernel
V5_PROBE_ENV = "QUANTMLA_TRITON_V5_PROBE"
#: when kernel v6 loads a page's bytes: 0 at its start, 1 a page ahead, 2 two chunks ahead
#: (:data:`heuristics.V6_AHEAD`). A measurement knob, read when a call is prepared
V6_AHEAD_ENV = "QUANTMLA_TRITON_V6_AHEAD"
#: kernel v6's key tile: 1, one shared allocation a 64-channel plane; 0, one allocation
#: (:data:`heuristics.V6_KEY_PLANES`). A measurement knob, read when a call is prepared
V6_KEY_PLANES_ENV = "QUANTMLA_TRITON_V6_KEY_PLANES"
_KERNELS = {"v1": split_kernel, "v2": split_kernel_v2, "v3": split_kernel_v3,
            **({} if split_kernel_v4 is None else {"v4": split_kernel_v4, "v5": split_kernel_v5,
                                                   "v6": split_kernel_v6})}
#: the Gluon kernels (Hopper, no interpreter): v4's arguments and constexprs; v4 and v5 attend to the protected tokens
#: themselves and may keep packed tiles in channel order, v6 leaves both to the protected-tile kernel and plain order
GLUON_VARIANTS = ("v4", "v5", "v6")


def _plan_v5(*args, **kw) -> AttentionPlan:
    """:func:`heuristics.plan_v5` with :data:`V5_BLOCK_R_ENV`'s rows a program (unset: the rows' default)."""
    return plan_v5(*args, **kw, block_r=env_int_choice(V5_BLOCK_R_ENV, V5_BLOCK_R_CHOICES))


_PLANNERS = {"v1": plan, "v2": plan_v2, "v3": plan_v3, "v4": plan_v4, "v5": _plan_v5, "v6": plan_v6}


def auto_variant(quantized: bool, q_bf16: bool, rows: int = 1, v3_fits: bool = True) -> str:
    """The kernel ``auto`` runs for requests of ``rows`` = S_q x H query rows: v3 (64 rows per
    program) from :data:`heuristics.V3_MIN_ROWS` rows with bfloat16 queries where it suits the device (``v3_fits``:
    a Hopper GPU, see :func:`v3_suits`, whose shared memory holds it); else v2 for
    packed formats with bfloat16 queries (on the H200 it takes 0.55-0.6x of v1's time there,
    benchmarks/RESULTS.md), v1 for BF16 pages (v1 is faster on them) and float32 queries (v2
    keeps float32 queries for the interpreter)."""
    if q_bf16 and rows >= V3_MIN_ROWS and v3_fits:
        return "v3"
    return "v2" if quantized and q_bf16 else "v1"


def _auto_takes_v4(variant: str, quantized: bool, rows: int) -> bool:
    """Whether ``auto``, having picked ``variant`` for ``rows`` query rows, runs kernel v4 instead where v4 serves the
    call (:data:`heuristics.V4_AUTO`): in v3's place, and in v2's over packed pages from :data:`heuristics.V4_MIN_ROWS`
    rows up to v3's :data:`heuristics.V3_MIN_ROWS` (v4 masks the rows of its 64-row block past them)."""
    few_rows = variant == "v2" and quantized and V4_MIN_ROWS <= rows < V3_MIN_ROWS
    return V4_AUTO and (variant == "v3" or few_rows)


def _v5_constexprs(block_r: int) -> dict:
    """Kernel v5's build from its knobs (:data:`V5_AHEAD_ENV`, :data:`V5_ATTENDERS_ENV`, :data:`V5_LOADER_WARPS_ENV`,
    :data:`V5_PROBE_ENV`) and defaults for ``block_r`` rows a program: two attenders only at 16 rows."""
    attenders = env_int_choice(V5_ATTENDERS_ENV, V5_ATTENDERS_CHOICES)
    if attenders == 2 and block_r != 16:
        raise ValueError(f"{V5_ATTENDERS_ENV}=2: kernel v5's two attenders take 16 query rows a program, the call has "
                         f"{block_r} ({V5_BLOCK_R_ENV}, or unset: 32 above 16 rows a request)")
    if attenders is None:
        attenders = V5_ATTENDERS if block_r == 16 else 1
    warps = env_int_choice(V5_LOADER_WARPS_ENV, (4, 8))
    if warps is None:
        warps = V5_LOADER_WARPS if attenders == 1 else V5_LOADER_WARPS_2A
    ahead = env_int_choice(V5_AHEAD_ENV, V5_AHEAD_CHOICES)
    if ahead is None:
        ahead = V5_AHEAD if attenders == 1 else V5_AHEAD_2A
    consts = {"LOADER_WARPS": warps, "AHEAD": ahead, "ATTENDERS": attenders}
    probe = env_int_choice(V5_PROBE_ENV, (0, 1, 2)) or 0
    if probe:  # PreparedCall.run warns on every call that takes it
        consts["PROBE"] = probe
    return consts


def _auto_takes_v5(variant: str, quantized: bool, rows: int) -> bool:
    """Whether ``auto``, having picked ``variant`` for ``rows`` query rows, runs kernel v5 instead where v5 serves the
    call (:data:`heuristics.V5_AUTO`): in kernel v2's place over packed pages up to :data:`heuristics.V5_MAX_ROWS`
    rows."""
    return V5_AUTO and variant == "v2" and quantized and rows <= V5_MAX_ROWS


def _auto_takes_v6(variant: str, quantized: bool, rows: int, table_tokens: int) -> bool:
    """Whether ``auto``, having picked ``variant`` for ``rows`` query rows over a block table of ``table_tokens``
    tokens a request, runs kernel v6 instead where v6 serves the call (:data:`heuristics.V6_AUTO`): in kernel v2's
    place (v5's) over packed pages up to one row block of :data:`heuristics.V6_BLOCK_R` rows a request, from
    :data:`heuristics.V6_MIN_TABLE_TOKENS` tokens."""
    if not (V6_AUTO and variant == "v2" and quantized):
        return False
    return rows <= V6_BLOCK_R and table_tokens >= V6_MIN_TABLE_TOKENS


def v3_suits(device: torch.device) -> bool:
    """Whether ``auto`` may run kernel v3 on ``device``: on Hopper (sm_90), where its dots are warpgroup MMAs, and in
    the interpreter, which plans as the H200. Elsewhere its 64-row output stays in registers (A100: mma.sync; for 64
    rows and 128 tokens its loops issue 1.6x v2's warp instructions, 22K of them spill loads and stores; gfx942: 1.6 KB
    of scratch a lane) or overflows Blackwell's tensor memory (a trap at d_c 512), stop 42; v2 and v1 run there."""
    if interpreting() or device.type != "cuda":
        return True
    return _nvidia_major(_device_index(device)) == 9


def v4_unsupported(fmt, q_dtype: torch.dtype, device: torch.device, variant: str = "v4") -> str | None:
    """Why Gluon kernel ``variant`` (v4, v5 or v6: Hopper ``wgmma``; v5 reads what v4 reads, v6 its packed formats)
    cannot serve a call of ``fmt`` pages and ``q_dtype`` queries on ``device``, or None. Gluon has no interpreter, so
    they run on NVIDIA sm_90 GPUs alone."""
    name = f"kernel {variant}"
    if GLUON_IMPORT_ERROR is not None:
        return f"{name} needs triton's Gluon: {GLUON_IMPORT_ERROR}"
    reason = _not_nvidia(device, f"{name} (Gluon) runs on NVIDIA GPUs", f"{name} (Gluon) is built for NVIDIA Hopper, "
                         "not ROCm")
    if reason is not None:
        return reason
    major = _nvidia_major(_device_index(device))
    if major != V4_CAPABILITY_MAJOR:
        return f"{name} needs compute capability {V4_CAPABILITY_MAJOR}.x (Hopper), {device} is {major}.x"
    if q_dtype != torch.bfloat16:
        return f"{name} takes bfloat16 queries, got {q_dtype}"
    return v6_format_unsupported(fmt, name) if variant == "v6" else v4_format_unsupported(fmt, name)


@functools.lru_cache(maxsize=16)
def _nvidia_major(index: int) -> int | None:
    """The CUDA compute capability's major number of device ``index``; None on ROCm (whose MI250/MI300X report 9.x)."""
    return None if torch.version.hip is not None else torch.cuda.get_device_capability(index)[0]


#: compiled-kernel handles of the last launch (``n_regs``, ``n_spills``) for probes
LAST_LAUNCH: dict = {}


#: switches of the split kernels an ``overrides`` dict may set (probes, tests): name -> (the kernels that take it,
#: the type it is read as; None keeps the value). :func:`v2_constexprs` / :func:`v3_constexprs` take them as keywords
KERNEL_SWITCHES = {
    "pv_form": (("v2",), None), "hold_raw": (("v2",), None), "code_bias": (("v2",), None), "zsub": (("v2",), None),
    "word_codes": (("v2", "v3"), bool), "ptx_split": (("v2", "v3"), bool),
    "prefetch": (("v3",), bool), "word_lanes": (("v3",), int), "tile_groups": (("v3",), bool),
}


def v2_constexprs(quant: bool, cbits: int, rbits: int, dot_bf16: bool, pv_form: int = 0,
                  hold_raw: bool = V2_HOLD_RAW, code_bias: int | None = None, zsub: bool = V2_ZSUB,
                  word_codes: bool = V2_CODE_WORDS, ptx_split: bool = False) -> dict:
    """Kernel-v2 switches. ``code_bias`` 128 turns codes into ``128 + code`` (the bfloat16 bit trick;
    on by default for bfloat16 dots and codes below 8 bits). Tests force 128 with float32 dots
    in the interpreter, where the bit trick itself cannot run, to check the bias algebra. ``word_codes`` /
    ``ptx_split``: ``WORDS`` as kernel v3's (:func:`words_constexpr`), off by default (heuristics.V2_CODE_WORDS)."""
    def bias(bits: int) -> int:
        if not quant or bits >= 8:
            return 0
        if code_bias is not None:
            return int(code_bias)
        return 128 if dot_bf16 else 0

    return dict(CBIAS=bias(cbits), RBIAS=bias(rbits), PV_FORM=int(pv_form), HOLD_RAW=bool(hold_raw), ZSUB=bool(zsub),
                WORDS=words_constexpr(cbits, bool(word_codes), ptx_split))


def v3_constexprs(quant: bool, cbits: int, rbits: int, dot_bf16: bool, prefetch: bool = V3_PREFETCH,
                  word_codes: bool | None = None, ptx_split: bool = False, word_lanes: int | None = None,
                  tile_groups: bool | None = None) -> dict:
    """Kernel-v3 switches: v2's code biases (the same operand algebra), ``PREFETCH``, ``WORDS``
    (:func:`words_constexpr`), ``WORD_LANES`` and ``TILE_GROUPS`` (None: the heuristics' choice for the content's
    bits)."""
    v2 = v2_constexprs(quant, cbits, rbits, dot_bf16)
    return dict(CBIAS=v2["CBIAS"], RBIAS=v2["RBIAS"], PREFETCH=bool(prefetch),
                WORDS=words_constexpr(cbits, word_codes, ptx_split),
                WORD_LANES=v3_word_lanes(cbits) if word_lanes is None else int(word_lanes),
                TILE_GROUPS=v3_tile_groups(cbits) if tile_groups is None else bool(tile_groups))


def words_constexpr(content_bits: int, word_codes: bool | None, ptx_split: bool) -> int:
    """Kernel v3's ``WORDS`` (``code_words``): 0, codes from bytes; 1, from 32-bit words; 2, words taken apart in
    PTX (``ptx_split``: NVIDIA only, :func:`nvidia_asm_unsupported`). ``word_codes`` None:
    :func:`heuristics.v3_code_words` for the content's bits."""
    if word_codes is None:
        word_codes = v3_code_words(content_bits)
    return (2 if ptx_split else 1) if word_codes else 0


def _not_nvidia(device: torch.device, needs: str, on_rocm: str) -> str | None:
    """Why ``device`` is no NVIDIA GPU for a feature that ``needs`` one (``on_rocm``: the reason on ROCm), or None."""
    if interpreting() or device.type != "cuda":
        return f"{needs}, the call runs on {device.type}" + (" (TRITON_INTERPRET=1)" if interpreting() else "")
    if _nvidia_major(_device_index(device)) is None:
        return on_rocm
    return None


def nvidia_asm_unsupported(device: torch.device) -> str | None:
    """Why the kernels on ``device`` cannot hold NVIDIA PTX (kernel v3's ``WORDS`` 2), or None."""
    return _not_nvidia(device, "PTX runs on NVIDIA GPUs", "ROCm GPUs run no NVIDIA PTX")


def device_limits(device: torch.device, latent_dim: int, rope_dim: int) -> DeviceLimits:
    """What the launcher checks each build against on ``device`` for ``latent_dim`` / ``rope_dim`` vectors: shared
    memory a block where it is less than the plans may ask for (:func:`heuristics.planned_shared_max`), and tensor
    memory on NVIDIA GPUs that have it (sm_100 and later); nothing off a GPU and in the interpreter."""
    if interpreting() or device.type != "cuda":
        return DeviceLimits()
    index = _device_index(device)
    shared = _device_max_shared(index)
    planned = planned_shared_max(latent_dim, rope_dim)
    return DeviceLimits(shared=None if planned is not None and shared >= planned else shared,
                        tmem=TMEM_COLUMNS if _has_tensor_memory(index) else None)


def _has_tensor_memory(index: int) -> bool:
    """Blackwell and later (sm_100+): the dots' accumulators live in tensor memory."""
    return (_nvidia_major(index) or 0) >= 10


def _device_index(device: torch.device) -> int:
    if device.index is not None or device.type != "cuda":
        return device.index or 0
    return torch.cuda.current_device()


@functools.lru_cache(maxsize=16)
def _device_max_shared(index: int) -> int:
    import triton

    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


#: stand-in integer arguments of a warm-up build: neither 1 nor a multiple of 16, so Triton specialises none of them
_PLAIN_INT = 17


def _arg_kinds(args: tuple) -> tuple:
    """What a warm-up build needs of launch arguments: tensors as their dtypes (a dtype stands for a pointer of it),
    numbers as their types."""
    return tuple(a.dtype if isinstance(a, torch.Tensor) else a if isinstance(a, torch.dtype) else type(a) for a in args)


@functools.lru_cache(maxsize=256)
def _build_needs(kernel_name: str, arg_dtypes: tuple, consts: tuple, options: tuple, device_index: int) -> tuple[int, int]:
    """(shared memory bytes a block, tensor-memory columns) of the kernel ``kernel_name`` built for these constexprs
    and launch options on the device: a warm-up build (Triton caches it, so the launch that follows does not build
    again), pointers as their dtypes (``arg_dtypes``: :func:`_arg_kinds`)."""
    kernel = {"protect": protect_kernel, **{f"split_{v}": k for v, k in _KERNELS.items()}}[kernel_name]
    with torch.cuda.device(device_index):
        metadata = kernel.warmup(*warmup_args(arg_dtypes), grid=(1,), **dict(consts), **dict(options)).metadata
    return build_needs_of(metadata)


def warmup_args(arg_dtypes: tuple) -> tuple:
    """Stand-ins for launch arguments of these kinds (:func:`_arg_kinds`) that Triton specialises on no value."""
    return tuple(_PLAIN_INT if a is int else 1.5 if a is float else a for a in arg_dtypes)


def build_needs_of(metadata) -> tuple[int, int]:
    """(shared memory bytes a block, tensor-memory columns) of a compiled kernel's ``metadata`` (no tensor memory
    where the target has none)."""
    return int(metadata.shared), int(getattr(metadata, "tmem_size", 0) or 0)


def _split_args(q: torch.Tensor, qr: torch.Tensor, cache, block_table: torch.Tensor, seq_lens: torch.Tensor, o_part,
                lse_part, scale_log2: float, rows: int, heads: int, s_q: int, num_splits: int) -> tuple:
    """The split kernels' positional arguments (v1, v2 and v3 take the same)."""
    return (q, qr, cache.pages, block_table, seq_lens, o_part, lse_part, block_table.stride(0), cache.num_pages,
            scale_log2, rows, heads, s_q, cache.sink, cache.local, num_splits)


def _split_excess(variant: str, fmt, q_dtype: torch.dtype, cache, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  dot_bf16: bool, block: tuple[int, int], dims: tuple[int, int], device: torch.device,
                  limits: DeviceLimits) -> str | None:
    """Why split kernel ``variant`` with ``block`` = (BLOCK_N, BLOCK_R) and ``dims`` = (warps, stages) does not fit
    ``limits`` for this call's format and dtypes, or None; checked before its partials exist (the split kernels'
    arguments, see :func:`attention`, with the partials as their dtype and one split)."""
    consts = _split_constexprs(fmt, variant, q_dtype == torch.bfloat16, dot_bf16, *block)
    args = _split_args(q_dtype, q_dtype, cache, block_table, seq_lens, torch.float32, torch.float32, 1.0, 1, 1, 1, 1)
    return limits.excess(_build_needs(f"split_{variant}", _arg_kinds(args), tuple(consts.items()),
                                      tuple(launch_dims(*dims).items()), _device_index(device)))


def _check_protect_fits(args: tuple, consts: dict, num_warps: int, fmt, device: torch.device,
                        limits: DeviceLimits) -> None:
    """Raise ``ValueError`` where the protected-tile kernel launched with ``args`` and ``consts`` does not fit
    ``limits`` (:func:`device_limits`; nothing to check: nothing built). 16-token tiles in one stage: no smaller
    plan of it."""
    if not limits.checked:
        return
    needs = _build_needs("protect", _arg_kinds(args), tuple(consts.items()),
                         tuple(launch_dims(num_warps, PROTECT_STAGES).items()), _device_index(device))
    excess = limits.excess(needs)
    if excess:
        raise ValueError(f"the Triton protected-tile kernel {excess} for {fmt}; no smaller plan of it is built")


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_SM_COUNT


def _code_bits(fmt) -> tuple[bool, int, int]:
    """(quantized, content bits, RoPE bits) as the kernels take them (16 for BF16 pages)."""
    return (fmt.quantized, *((fmt.content_bits, fmt.rope_bits) if fmt.quantized else (16, 16)))


@functools.lru_cache(maxsize=256)
def _split_constexprs(fmt, variant: str, q_bf16: bool, dot_bf16: bool, block_n: int,
                      block_r: int, nvidia_asm: bool = False) -> Mapping[str, int | bool]:
    """Constexprs of one split-kernel launch without probe switches; cached, since a decode step
    asks for the same ones on every layer (read-only). ``nvidia_asm``: the device runs NVIDIA PTX."""
    quant, cbits, rbits = _code_bits(fmt)
    cg = fmt.content_group_size if quant else 64
    rg = fmt.rope_group_size if quant else 64
    dc, dr = fmt.latent_dim, fmt.rope_dim
    consts = dict(
        Q_BF16=q_bf16, DOT_BF16=dot_bf16, QUANT=quant, DC=dc, DR=dr, CBITS=cbits, RBITS=rbits,
        CG=cg, RG=rg, CCW=slice_width(dc, cbits, cg), RCW=slice_width(dr, rbits, rg), **page_layout_constexprs(fmt),
        BLOCK_N=block_n, BLOCK_R=block_r, PROBE_SKIP_PV=False,
    )
    if variant == "v2":
        consts.update(v2_constexprs(quant, cbits, rbits, dot_bf16, ptx_split=nvidia_asm))
    elif variant in ("v3", *GLUON_VARIANTS):  # v4-v6 take v3's arguments and constexprs (they read no switch)
        consts.update(v3_constexprs(quant, cbits, rbits, dot_bf16, ptx_split=nvidia_asm))
    return MappingProxyType(consts)


def attention(q_latent: torch.Tensor, q_rope: torch.Tensor, cache, block_table: torch.Tensor,
              seq_lens: torch.Tensor, seq_ids: torch.Tensor, softmax_scale: float,
              num_splits: int | None = None, overrides: dict | None = None,
              variant: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q_latent ``[B, S_q, H, d_c]``, q_rope ``[B, S_q, H, d_r]`` (float32/bfloat16) ->
    out ``[B, S_q, H, d_c]`` (q's dtype), lse ``[B, S_q, H]`` float32 (natural log).

    ``num_splits`` overrides the heuristic (tests use it to cover several splits);
    ``overrides`` replaces fields of the heuristic plan (benchmark probes; v2 also takes the
    kernel switches ``pv_form``, ``hold_raw``, ``code_bias``, ``zsub``, v3 ``prefetch``, ``word_codes``,
    ``ptx_split``; all take
    ``maxnreg``).
    ``variant`` ("auto", "v1" to "v6") overrides ``$QUANTMLA_TRITON_ATTENTION`` (read per call;
    default "auto", see :func:`auto_variant`). v2 on a GPU with float32 queries runs v1 (``heuristics.V2_FLOAT32_ON_GPU``);
    ``LAST_LAUNCH["variant"]`` names the kernel that ran. The call is prepared once for its index tensors, geometry
    and knobs (:func:`prepared`)."""
    b, s_q, h, _ = q_latent.shape
    call = prepared(cache, block_table, seq_lens, seq_ids, b, s_q, h, q_latent.dtype, softmax_scale,
                    num_splits=num_splits, overrides=overrides, variant=variant)
    return call.run(q_latent, q_rope, cache)


#: eager calls prepared by :func:`prepared`: key -> (variables read, their values then, the PreparedCall)
_PREPARED: dict[tuple, tuple] = {}
#: calls kept by :func:`prepared` (the oldest goes first); a decode step with one set of index tensors needs one
PREPARED_KEEP = 64


def prepared(cache, block_table: torch.Tensor, seq_lens: torch.Tensor, seq_ids: torch.Tensor, batch: int,
             q_len: int, heads: int, q_dtype: torch.dtype, softmax_scale: float, *, num_splits: int | None = None,
             overrides: dict | None = None, variant: str | None = None) -> "PreparedCall":
    """:func:`prepare`'s call for these arguments, reused while nothing it depends on changed: the same
    ``block_table``, ``seq_lens`` and ``seq_ids`` objects (the call holds them, and the kernels read their values at
    launch, so values changed in place are seen) with the same shapes and strides, a cache of the same geometry, the
    same query shape, dtype and scale, ``num_splits`` and ``variant``, and the same values of every variable
    ``prepare`` read (:func:`~quantmla_core.backends.prepared_calls.reuse_or_prepare`). Calls with ``overrides``
    (probes) and calls under CUDA-graph capture are prepared afresh."""
    def make() -> PreparedCall:
        return prepare(cache, block_table, seq_lens, seq_ids, batch, q_len, heads, q_dtype, softmax_scale,
                       num_splits=num_splits, overrides=overrides, variant=variant)

    if overrides is not None or graph_capturing():
        return make()
    key = (*call_key(cache, block_table, seq_lens, seq_ids), batch, q_len, heads, q_dtype, softmax_scale, num_splits,
           variant)
    return reuse_or_prepare(_PREPARED, key, PREPARED_KEEP, make, lambda call: call.block_table is block_table
                            and call.seq_lens is seq_lens and call.seq_ids is seq_ids)


@dataclasses.dataclass(frozen=True)
class PreparedCall:
    """One decode-attention call with everything but the queries, the outputs and the layer's cache
    decided (:func:`prepare`): variant, launch plan, constexprs, grids, the float32 partials (shape, dtype) (the splits'
    outputs and log2-sum-exps, then the protected parts'), the protected tiles (``protect_grid[2]`` parts a request
    and row block of ``protect_tiles`` tiles of ``protect_consts["BLOCK_T"]`` tokens; no grid without sink and
    local tokens), which launches use PDL (``pdl``: 0, 1 or 2, see :data:`PDL_ENV`)."""

    variant: str
    plan: AttentionPlan
    batch: int
    q_len: int
    heads: int
    device: torch.device
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    seq_ids: torch.Tensor
    scale_log2: float
    partial_specs: tuple
    split_grid: tuple
    split_consts: Mapping
    split_dims: Mapping
    protect_grid: tuple | None
    protect_tiles: int
    protect_consts: Mapping
    protect_dims: Mapping
    merge_grid: tuple
    merge_consts: Mapping
    merge_dims: Mapping
    pdl: int = 0

    def run(self, q_latent: torch.Tensor, q_rope: torch.Tensor, cache, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q_latent ``[B, S_q, H, d_c]`` / ``[B, H, d_c]`` (S_q = 1), q_rope likewise with d_r (the prepared dtype,
        on the prepared device), ``cache`` of the prepared geometry -> (out, lse) shaped like the queries (out:
        [..., d_c] in their dtype, lse float32 [...]). ``out`` / ``lse`` given (contiguous, those shapes): the merge
        kernel writes there."""
        b, rows, pl = self.batch, self.q_len * self.heads, self.plan
        LAST_LAUNCH.update(variant=self.variant, plan=pl, pdl=self.pdl)
        if self.split_consts.get("PROBE"):
            env = V4_PROBE_ENV if self.variant == "v4" else V5_PROBE_ENV
            warnings.warn(f"{env}={self.split_consts['PROBE']}: a measurement build of kernel {self.variant}, its "
                          "outputs are wrong", RuntimeWarning, stacklevel=2)
        npt = self.protect_grid[2] if self.protect_grid else 0
        dc, dr = q_latent.shape[-1], q_rope.shape[-1]
        q = q_latent.contiguous().view(b, rows, dc)
        qr = q_rope.contiguous().view(b, rows, dr)
        partials = list(self.partial_specs)
        outputs = [((b, rows, dc), q.dtype)] if out is None else []
        outputs += [((b, rows), torch.float32)] if lse is None else []
        if graph_capturing():  # one allocation: the partials live as long as the outputs (backends/buffers.py)
            made = iter(carve(partials + outputs, self.device))
        else:  # the partials in one allocation, freed on return; the outputs on their own
            made = iter(carve(partials, self.device) + [torch.empty(sh, dtype=dt, device=self.device) for sh, dt in outputs])
        o_part, lse_part, o_prot, lse_prot = next(made), next(made), next(made), next(made)
        o_flat = next(made) if out is None else _given("out", out).view(b, rows, dc)
        l_flat = next(made) if lse is None else _given("lse", lse).view(b, rows)
        side = None
        if npt and _protect_on_side_stream() and _uses_cuda_streams(self.device):  # the knob checked everywhere
            side = fork_side_stream(self.device.index)  # before the split launch, so that it does not wait for it
        protect_after = bool(npt) and self.pdl == 2 and side is None
        pdl = {"launch_pdl": True} if self.pdl and side is None else {}
        if npt:
            pargs = _protect_args(q, qr, cache, self.seq_lens, self.seq_ids, o_prot, lse_prot, self.scale_log2, rows,
                                  self.heads, self.q_len, npt, self.protect_tiles)
        else:  # no sink or local tokens: the merge reads no protected partial (any pointer will do)
            o_prot, lse_prot = o_part, lse_part
        if npt and not protect_after:
            with launching_on(side):
                self._launch_protect(pargs)
        args = _split_args(q, qr, cache, self.block_table, self.seq_lens, o_part, lse_part, self.scale_log2, rows,
                           self.heads, self.q_len, pl.num_splits)
        prot = {}
        if self.split_consts.get("INLINE_PROT"):  # kernel v4's own protected tokens
            prot = dict(sink_ptr=cache.sink_buf, local_ptr=cache.local_buf, ids_ptr=self.seq_ids,
                        max_seqs=cache.max_seqs)
        LAST_LAUNCH["split"] = _KERNELS[self.variant][self.split_grid](*args, **self.split_consts, **self.split_dims,
                                                                       **prot)
        if protect_after:
            self._launch_protect(pargs, **pdl)
        if side is not None:
            join_side_stream(self.device.index, side)
        margs = (o_part, lse_part, o_prot, lse_prot, o_flat, l_flat, rows, pl.num_splits, npt)
        LAST_LAUNCH["merge"] = merge_kernel[self.merge_grid](*margs, **self.merge_consts, **self.merge_dims, **pdl)
        lead = q_latent.shape[:-1]
        return (o_flat.view(*lead, dc) if out is None else out), (l_flat.view(lead) if lse is None else lse)

    def _launch_protect(self, pargs: tuple, **launch) -> None:
        """The protected-tile kernel over ``pargs`` (:func:`_protect_args`), with extra ``launch`` options."""
        LAST_LAUNCH["protect"] = protect_kernel[self.protect_grid](*pargs, **self.protect_consts, **self.protect_dims,
                                                                   **launch)


def _v4_inline_protect(cache, default: bool | None = None) -> bool:
    """Whether kernel v4 (v5, v6) attends to ``cache``'s protected tokens itself (:data:`V4_INLINE_PROTECT_ENV`; unset:
    ``default``, or :data:`heuristics.V4_INLINE_PROTECT` where None): where it is asked to and the cache has protected
    tokens. Asked for with float32 protection: refused (it reads bfloat16 rows)."""
    asked = env_int_choice(V4_INLINE_PROTECT_ENV, (0, 1))
    if asked is None:
        inline = V4_INLINE_PROTECT if default is None else default
    else:
        inline = asked == 1
    if not inline or cache.sink + cache.local == 0:
        return False
    if cache.sink_buf.dtype != torch.bfloat16:
        if asked == 1:
            raise ValueError(f"{V4_INLINE_PROTECT_ENV}=1: kernel v4 reads bfloat16 protected tokens, the cache keeps "
                             f"{cache.sink_buf.dtype}")
        return False
    return True


def _v4_channel_order(table_pages: int, num_splits: int) -> bool:
    """Whether kernel v4 keeps a packed cache's key tiles in ``channel_of`` order (:data:`V4_CHANNEL_ORDER_ENV`;
    unset: :func:`heuristics.v4_channel_order` of the block table's pages and the split count)."""
    asked = env_int_choice(V4_CHANNEL_ORDER_ENV, (0, 1))
    return v4_channel_order(table_pages, num_splits) if asked is None else asked == 1


def _given(name: str, x: torch.Tensor) -> torch.Tensor:
    """A caller-given output the merge kernel can write: contiguous."""
    if not x.is_contiguous():
        raise ValueError(f"{name}: the Triton backend writes contiguous outputs, got strides {tuple(x.stride())}")
    return x


def _protect_args(q, qr, cache, seq_lens, seq_ids, o_prot, lse_prot, scale_log2: float, rows: int, heads: int,
                  s_q: int, parts: int, tiles: int) -> tuple:
    """The protected-tile kernel's positional arguments (tensors, or their dtypes for a warm-up build)."""
    return (q, qr, ptr_or_dummy(cache.sink_buf), ptr_or_dummy(cache.local_buf), seq_lens, seq_ids, o_prot, lse_prot,
            cache.max_seqs, scale_log2, rows, heads, s_q, cache.sink, cache.local, parts, tiles)


def _uses_cuda_streams(device: torch.device) -> bool:
    """Whether launches on ``device`` go to CUDA streams (not under the interpreter, whose tensors are on the CPU)."""
    return device.type == "cuda"


def _protect_on_side_stream() -> bool:
    """``$QUANTMLA_TRITON_PROTECTED_STREAM`` is "1" ("0" or unset: one stream; anything else is refused)."""
    return env_int_choice(PROTECTED_STREAM_ENV, (0, 1)) == 1


def _pdl_from_env(device: torch.device, variant: str) -> int:
    """Which launches of a call of split kernel ``variant`` use PDL (:data:`PDL_ENV`: "0", "1", "2", or unset for
    :func:`heuristics.pdl_default` where :func:`pdl_unsupported` finds nothing against it)."""
    mode = env_int_choice(PDL_ENV, PDL_MODES)
    if mode == 0:
        return 0
    why = pdl_unsupported(device)
    if mode is not None and why:
        raise ValueError(f"{PDL_ENV}={mode}: {why}")
    if why:
        return 0
    return pdl_default(variant) if mode is None else mode


def pdl_unsupported(device: torch.device) -> str | None:
    """Why kernels on ``device`` cannot be launched with programmatic dependent launch, or None: it needs an NVIDIA
    GPU of compute capability 9.0 or later and a triton whose launches take ``launch_pdl``."""
    reason = _not_nvidia(device, "programmatic dependent launch needs a CUDA GPU", "ROCm has no programmatic dependent launch")
    if reason is not None:
        return reason
    major = _nvidia_major(_device_index(device))
    if major < 9:
        return f"programmatic dependent launch needs compute capability 9.0 or later, {device} is {major}.x"
    if not _triton_launches_pdl():
        import triton

        return f"triton {triton.__version__} launches no kernel with launch_pdl"
    return None


@functools.lru_cache(maxsize=1)
def _triton_launches_pdl() -> bool:
    """Whether this triton's NVIDIA launch options include ``launch_pdl``."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}


def _protect_rows_from_env(pl: AttentionPlan, overrides: dict | None) -> AttentionPlan:
    """``pl`` with ``$QUANTMLA_TRITON_PROTECT_ROWS`` query rows a protected-tile program, where set (an explicit
    ``protect_block_r`` override wins)."""
    if overrides and "protect_block_r" in overrides:
        return pl
    rows = env_int_choice(PROTECT_ROWS_ENV, PROTECT_ROWS_CHOICES)
    return pl if rows is None else dataclasses.replace(pl, protect_block_r=rows)


def prepare(cache, block_table: torch.Tensor, seq_lens: torch.Tensor, seq_ids: torch.Tensor, batch: int, q_len: int,
            heads: int, q_dtype: torch.dtype, softmax_scale: float, *, num_splits: int | None = None,
            overrides: dict | None = None, variant: str | None = None) -> PreparedCall:
    """Decide a call of :func:`attention` for ``batch`` x ``q_len`` x ``heads`` queries of ``q_dtype`` over caches
    of ``cache``'s geometry (the arguments mean what they mean there; ``block_table``, ``seq_lens``, ``seq_ids`` are
    kept by reference). Checks the kernels' fit to the GPU once; :meth:`PreparedCall.run` launches."""
    variant = variant or getenv(VARIANT_ENV, "").strip().lower() or "auto"
    if variant not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV}: expected one of {VARIANTS}, got {variant!r}")
    fmt = cache.format
    b, rows, dc, dr = batch, q_len * heads, fmt.latent_dim, fmt.rope_dim
    dev = cache.pages.device
    q_bf16 = q_dtype == torch.bfloat16
    interp = interpreting()
    dot_bf16 = q_bf16 and not interp  # the interpreter's bfloat16 math is wrong: float32 there
    limits = device_limits(dev, dc, dr)
    if variant in GLUON_VARIANTS and (why := v4_unsupported(fmt, q_dtype, dev, variant)):
        raise ValueError(f"{VARIANT_ENV}={variant}: {why}")
    v3_fits = False
    if q_bf16 and (variant == "v3" or (variant == "auto" and rows >= V3_MIN_ROWS and v3_suits(dev))):
        v3_excess = _split_excess("v3", fmt, q_dtype, cache, block_table, seq_lens, dot_bf16, (V3_BLOCK_N, V3_BLOCK_R),
                                  (V3_NUM_WARPS, V3_NUM_STAGES), dev, limits) if limits.checked else None
        if variant == "v3" and v3_excess:
            raise ValueError(f"{VARIANT_ENV}=v3: kernel v3 {v3_excess} for {fmt} (auto runs v2 there)")
        v3_fits = not v3_excess
    if variant == "auto":
        variant = auto_variant(fmt.quantized, q_bf16, rows, v3_fits)
        table_tokens = int(block_table.shape[1]) * fmt.page_size
        if _auto_takes_v6(variant, fmt.quantized, rows, table_tokens) and v4_unsupported(fmt, q_dtype, dev,
                                                                                         "v6") is None:
            variant = "v6"
        elif _auto_takes_v5(variant, fmt.quantized, rows) and v4_unsupported(fmt, q_dtype, dev, "v5") is None:
            variant = "v5"
        elif _auto_takes_v4(variant, fmt.quantized, rows) and v4_unsupported(fmt, q_dtype, dev) is None:
            variant = "v4"
    if variant in ("v2", "v3") and not q_bf16 and not interp and not V2_FLOAT32_ON_GPU:
        variant = "v1"  # float32 queries on a GPU: see heuristics.V2_FLOAT32_ON_GPU
    LAST_LAUNCH["variant"] = variant
    sms = _sm_count(dev)
    pl: AttentionPlan = _PLANNERS[variant](b, rows, dc, fmt.page_size, int(block_table.shape[1]) * fmt.page_size,
                                sms, interp, num_splits, fp32_dot=not dot_bf16)
    probe_skip_pv = False
    switches: dict = {}
    extra_launch: dict = {}
    if overrides:
        overrides = dict(overrides)
        probe_skip_pv = bool(overrides.pop("skip_pv", False))
        if probe_skip_pv and variant in GLUON_VARIANTS:
            raise ValueError(f"overrides: 'skip_pv' is a switch of kernels v1-v3, the call runs {variant}")
        for key, (kernels, kind) in KERNEL_SWITCHES.items():
            if key in overrides:
                if variant not in kernels:
                    takers = "/".join(kernels)
                    raise ValueError(f"overrides: {key!r} is a kernel-{takers} switch, the call runs {variant}")
                value = overrides.pop(key)
                switches[key] = kind(value) if kind else value
        if "maxnreg" in overrides:  # CUDA only (ptx .maxnreg); probes
            extra_launch["maxnreg"] = int(overrides.pop("maxnreg"))
        pl = dataclasses.replace(pl, **overrides)
        if "block_r" in overrides:
            pl = dataclasses.replace(pl, row_blocks=-(-rows // pl.block_r))
    pl = _protect_rows_from_env(pl, overrides)
    LAST_LAUNCH["plan"] = pl
    if limits.checked and variant not in ("v3", *GLUON_VARIANTS):  # v3's plan is checked above; v4/v5 run on sm_90
        excess = _split_excess(variant, fmt, q_dtype, cache, block_table, seq_lens, dot_bf16, (pl.block_n, pl.block_r),
                               (pl.num_warps, pl.num_stages), dev, limits)
        if excess:
            raise ValueError(f"Triton kernel {variant} {excess} for {fmt}; no smaller plan of it is built")
    nvidia_asm = nvidia_asm_unsupported(dev) is None
    if switches.get("ptx_split") and not nvidia_asm:
        raise ValueError(f"overrides: 'ptx_split' cannot run here: {nvidia_asm_unsupported(dev)}")
    if probe_skip_pv or switches:  # probes: built per call
        consts = dict(_split_constexprs(fmt, variant, q_bf16, dot_bf16, pl.block_n, pl.block_r, nvidia_asm))
        consts["PROBE_SKIP_PV"] = probe_skip_pv
        if variant == "v2":
            consts.update(v2_constexprs(*_code_bits(fmt), dot_bf16, **{"ptx_split": nvidia_asm, **switches}))
        elif variant == "v3":
            consts.update(v3_constexprs(*_code_bits(fmt), dot_bf16, **{"ptx_split": nvidia_asm, **switches}))
    else:
        consts = _split_constexprs(fmt, variant, q_bf16, dot_bf16, pl.block_n, pl.block_r, nvidia_asm)
    pdl = _pdl_from_env(dev, variant)
    LAST_LAUNCH["pdl"] = pdl
    consts = {**consts, "PDL": pdl > 0}
    if variant == "v4":
        build = env_int_choice(V4_PIPELINE_ENV, (0, 1, 2, 3, 4))
        if build == 4 and not fmt.quantized:
            raise ValueError(f"{V4_PIPELINE_ENV}=4: kernel v4's build 4 reads packed pages, the cache holds {fmt.name}")
        consts["PIPELINE"] = V4_PIPELINE[fmt.name] if build is None else build
        warps = env_int_choice(V4_LOADER_WARPS_ENV, (4, 8))
        consts["LOADER_WARPS"] = V4_LOADER_WARPS[fmt.name] if warps is None else warps
        probe = env_int_choice(V4_PROBE_ENV, (0, 1, 2, 3, 4)) or 0
        if probe:  # PreparedCall.run warns on every call that takes it
            consts["PROBE"] = probe
    if variant == "v5":
        consts.update(_v5_constexprs(pl.block_r))
    if variant == "v6":
        ahead = env_int_choice(V6_AHEAD_ENV, V6_AHEAD_CHOICES)
        consts["AHEAD"] = V6_AHEAD if ahead is None else ahead
        planes = env_int_choice(V6_KEY_PLANES_ENV, (0, 1))
        consts["KEY_PLANES"] = v6_key_planes(triton.__version__) if planes is None else bool(planes)
    if variant in GLUON_VARIANTS and _v4_inline_protect(cache, V6_INLINE_PROTECT if variant == "v6" else None):
        consts["INLINE_PROT"] = True
    if variant in ("v4", "v5") and fmt.quantized and _v4_channel_order(int(block_table.shape[1]), pl.num_splits):
        consts["CHANNEL_ORDER"] = True  # v6 keeps plain order
    scale_log2 = float(softmax_scale) * math.log2(math.e)
    pconsts = dict(Q_BF16=q_bf16, DOT_BF16=dot_bf16, PROT_BF16=cache.sink_buf.dtype == torch.bfloat16, DC=dc, DR=dr,
                   BLOCK_T=pl.protect_block_t, BLOCK_R=pl.protect_block_r, PDL=pdl == 2)
    protect_blocks = -(-rows // pl.protect_block_r)
    if consts.get("INLINE_PROT"):  # the split kernel attends to them
        parts, tiles = 0, 0
    else:
        parts, tiles = protect_parts(-(-(cache.sink + cache.local) // pl.protect_block_t), b * protect_blocks, sms)
    if parts:
        pargs = _protect_args(q_dtype, q_dtype, cache, seq_lens, seq_ids, torch.float32, torch.float32, scale_log2,
                              rows, heads, q_len, 2, 2)
        _check_protect_fits(pargs, pconsts, pl.protect_warps, fmt, dev, limits)
    block_c = min(MERGE_BLOCK_C, dc)
    mconsts = dict(Q_BF16=q_bf16, DC=dc, BLOCK_R=MERGE_BLOCK_R, BLOCK_C=block_c, SC=merge_load_width(pl.num_splits),
                   SCP=merge_load_width(parts), PDL=pdl > 0, CHANNEL_ORDER=bool(consts.get("CHANNEL_ORDER")))
    partial_specs = tuple((shape, torch.float32) for shape in (
        (b, pl.num_splits, rows, dc), (b, pl.num_splits, rows), (b, parts, rows, dc), (b, parts, rows)))
    return PreparedCall(variant, pl, b, q_len, heads, dev, block_table, seq_lens, seq_ids, scale_log2, partial_specs,
                        (pl.num_splits, b, pl.row_blocks), MappingProxyType(dict(consts)),
                        MappingProxyType({**launch_dims(pl.num_warps, pl.num_stages), **({} if interp else extra_launch)}),
                        (b, protect_blocks, parts) if parts else None, tiles,
                        MappingProxyType(pconsts), MappingProxyType(launch_dims(pl.protect_warps, PROTECT_STAGES)),
                        (b, -(-rows // MERGE_BLOCK_R), dc // block_c),
                        MappingProxyType(mconsts), MappingProxyType(launch_dims(MERGE_WARPS)), pdl)
