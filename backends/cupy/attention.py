"""CuPy decode-attention launcher: split-KV tensor-core kernels plus a log-sum-exp combine.

Six attention kernels share the partials layout and the combine kernel:

* ``v1`` (``kernels/attention.cu``): dequantizes each tile to bf16 in shared memory, 16 query
  rows per CTA; serves every format and float32/bfloat16 queries.
* ``v2`` (``kernels/attention_v2.cu``): dequantizes straight into ``mma.sync`` fragments (heads
  as the MMA M dimension), one block barrier per tile, up to 2 row groups per CTA sharing one
  staged tile. Serves bfloat16 queries with 2/4-bit content and 4-bit RoPE codes (C4R4, C2R4).
* ``v3`` (``kernels/attention_v3.cu``): tokens as the QK M dimension over all channels, P * s
  through shared memory, zero points by a correction MMA; 64-token tiles. Serves what v2 serves
  with content groups of 64k channels, packed tokens only. On the H200 it takes 0.62-0.86x of
  v2's time from 32K tokens on, but has more fixed cost per call.
* ``v4`` (``kernels/attention_v4.cu``): 64 query rows per CTA share one tile dequantized to bf16
  in shared memory (flash-decoding on it, 8 warps); for requests with many query rows
  (S_q * H >= :data:`V4_MIN_ROWS`: H = 128 or 64), where v2/v3 would convert every token once
  per 16 rows. Serves what v3 serves, and bf16 pages (rows copied into the tile). On compute
  capability 9.0 both matmuls are Hopper ``wgmma`` reading that tile (an NVRTC build for sm_90a,
  :func:`v4_uses_wgmma`), elsewhere ``mma.sync``. With long splits its own extra CTAs take the sink
  and local-window tiles (bf16 rows copied into the key tile); with short ones ``protected.cu`` does.

* ``v5`` (``kernels/attention_v5.cu``, compute capability 9.0 only: an NVRTC build for sm_90a): the
  few-row counterpart of v4 on Hopper. The 64 tokens of a tile are the M dimension of warpgroup MMAs
  and 16 query rows their N; lanes dequantize straight into QK's A fragments (registers), which also
  go to a bf16 key tile in shared memory for PV. Two worker warpgroups per CTA take alternate tiles.
  Serves what v4 serves over packed pages. On the H200 (CUDA graphs, H16) its stop-20
  build took 0.87-0.98x of v3's time for C4R4 at L 32K (B 8-128) and 0.82-0.94x for C2R4; at L128K, with
  its own split overhead (:data:`V5_CTA_OVERHEAD_TILES`), 0.92-0.93x (C4R4) and 0.78-0.82x (C2R4). Stop 21
  took another 8-18 % off (conflict-free stage reads, leaner copies), stop 22 1-5 % (no stage: each lane
  loads the codes it dequantizes straight from the pages a tile ahead; benchmarks/RESULTS.md).

* ``v6`` (``kernels/attention_v6.cu``, compute capability 9.0 only: an NVRTC build for sm_90a): v4's
  64 rows per CTA over packed pages with the work split by kind: one warpgroup dequantizes the next tile
  into the second of two key tiles (codes loaded straight from the pages into registers) while the
  other runs this tile's QK over all channels, the softmax and half of PV (the dequantizer takes the
  other half). On the H200 (CUDA graphs, H128/H64, C4R4/C2R4, stop 23) it took 0.75-0.84x of v4's time.
  Its CTAs take equal splits of a request (planned with :data:`V6_CTA_OVERHEAD_TILES` of fixed work each) or,
  in a balanced plan (:func:`v6_balanced`), pieces of requests read from a device table, so that every SM
  gets as many tiles.

v6 and v5 attend to the sink and local-window tokens themselves: they are the last tiles of one split
per row chunk, their bf16 rows copied into v6's key tile or loaded into v5's QK operands. v3 and v2
(``separate`` mode, the default) leave them to ``kernels/protected.cu``, a bfloat16 flash-decoding
kernel (one 32-token tile per CTA) whose partials the combine merges with the split kernel's; it may
run on a second stream beside the split kernel (:func:`protected_on_side_stream`).

``QUANTMLA_CUPY_ATTENTION`` (``auto``, the default: v6, else v4, where it serves and a request has at
least :data:`V4_MIN_ROWS` query rows, else, where the block table holds at least :data:`V3_MIN_TOKENS`
tokens, v5 where it serves and v3 where it does not, else v5 where it serves and the batch's block
tables hold at least :data:`V5_MIN_BATCH_TOKENS` tokens, else v2 where it serves, else v1; or ``v1`` /
``v2`` / ``v3`` / ``v4`` / ``v5`` / ``v6``; read on every call, nothing global is rewritten) picks the kernel.
``QUANTMLA_CUPY_V2_RG`` (1 or 2 row groups per CTA; default 2 when the
row-group count is even), ``QUANTMLA_CUPY_V2_STAGES`` (cp.async ring depth 3-5, default 4),
``QUANTMLA_CUPY_V2_MINB`` (minimum blocks per SM given to ``__launch_bounds__``, default 1),
``QUANTMLA_CUPY_V2_LAZY_RESCALE`` (1: skip the output rescale while no row's running maximum
moves; bit-identical, default 0), ``QUANTMLA_CUPY_V2_PROTECTED`` (``separate``, the default:
the split kernel reads packed tokens only and the protected kernel adds the sink and local
tokens; ``inline``: sink/local tokens inside the split kernel, from the bf16 buffers),
``QUANTMLA_CUPY_PROTECTED_STREAM`` (0/1; unset: under CUDA-graph capture, and for v3/v4/v5 from
:data:`V3_MIN_TOKENS` tokens), ``QUANTMLA_CUPY_V3_STAGES`` (3 or 4) and
``QUANTMLA_CUPY_V3_MINB`` / ``QUANTMLA_CUPY_V3_LAZY_RESCALE`` (default 1: measured 1-2 % faster,
bit-identical) / ``QUANTMLA_CUPY_V3_WARPS`` (4 or 8) and ``QUANTMLA_CUPY_V4_STAGES`` (2 or 3) /
``QUANTMLA_CUPY_V4_LAZY_RESCALE`` (default 1) / ``QUANTMLA_CUPY_V4_MMA`` (``auto``, ``wgmma``, ``mma``)
and ``QUANTMLA_CUPY_V5_LAZY_RESCALE`` (default 1) / ``QUANTMLA_CUPY_V5_WORKERS`` (2 or 3) /
``QUANTMLA_CUPY_V5_PROTECTED`` (``inline``, ``separate``) / ``QUANTMLA_CUPY_V5_PROT_LOADS`` (``pairs``, ``vec``) /
``QUANTMLA_CUPY_V5_ROPE_FOLD`` / ``QUANTMLA_CUPY_V5_QUAD_LOADS`` (``auto``, 0/1) / ``QUANTMLA_CUPY_V5_PACKED_GROUPS``
(0/1) / ``QUANTMLA_CUPY_V5_HALVES`` (1/2) and ``QUANTMLA_CUPY_V6_PV_AT`` (1-3) / ``QUANTMLA_CUPY_V6_PAGE_AHEAD``
(0/1) / ``QUANTMLA_CUPY_V6_PROTECTED`` (``inline``, ``separate``) / ``QUANTMLA_CUPY_V6_PAIR`` (``auto``, 0/1) /
``QUANTMLA_CUPY_V6_SLACK`` (0/1) / ``QUANTMLA_CUPY_V6_ROPE_FOLD`` (``auto``, 0/1) and ``QUANTMLA_CUPY_PLAN_PROTECTED`` (0/1: v5 (default 1) and v6
(default 0) count the sink/local tiles they append to one split in the split plan) are
tuning knobs for measurements, also read per call.
:func:`select_variant` says which kernel a call will run, and why.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from ...envvars import getenv, recording, snapshot
from ...formats import PackFormat
from ..buffers import capturing as graph_capturing
from ..buffers import carve
from ..splits import CTA_OVERHEAD_TILES, PiecePlan, equal_splits_cost, plan_kv_splits, plan_pieces
from . import (
    ATTN_TILE,
    ATTN_WARPS,
    current_stream_handle,
    external_stream,
    format_defines,
    get_kernel,
    launch,
    nvrtc_version,
    resident_ctas,
)

#: environment variable that selects the attention kernel (read per call)
VARIANT_ENV = "QUANTMLA_CUPY_ATTENTION"
VARIANTS = ("auto", "v1", "v2", "v3", "v4", "v5", "v6")
#: v2: default tokens per tile (QMLA_V2_T) and the sizes QUANTMLA_CUPY_V2_TILE may ask for (64 spreads
#: the per-tile work over twice the tokens: offline SASS 177 -> 159 instructions per token, not yet timed)
V2_TILE = 32
V2_TILES = (32, 64)
#: v2: warps per row group (fixed in attention_v2.cu)
V2_WARPS = 4
V2_STAGES = 4  # default of QMLA_V2_STAGES (cp.async ring depth; copies run NSTAGE-1 tiles ahead)
#: v2 split heuristic: never create splits shorter than this many tiles (256 tokens)
V2_MIN_TILES_PER_SPLIT = 8
#: v3 (``kernels/attention_v3.cu``): tokens per tile, warps per CTA (4, or 8 with ``QUANTMLA_CUPY_V3_WARPS``),
#: default copy stages
V3_TILE = 64
V3_WARPS = 4
V3_STAGES = 3
#: auto picks v3 when the block table holds at least this many tokens per request. Measured on the
#: H200 (CUDA graphs, C4R4 H16 B32): v3 costs ~6.9 ns per token and request against v2's ~9.8 but
#: ~90 us of fixed cost against ~48 us, so it wins from ~14K tokens (benchmarks/RESULTS.md)
V3_MIN_TOKENS = 16384
#: auto also picks v5 for shorter tables when the batch holds at least this many tokens of block-table
#: capacity (batch x tokens per request). Measured on the H200 (CUDA graphs, H16, C4R4 and C2R4, stop 20):
#: v5 took 0.56-0.97x of v2's time at every shape from 64K tokens (B 8-128, L 2K-16K) and 1.05-1.15x at
#: 32K (B8 L4K, B16 L2K) (benchmarks/RESULTS.md)
V5_MIN_BATCH_TOKENS = 65536
#: v5's fixed work per CTA in tile-times for the split planner (two workers filling their pipelines,
#: two partials written and read back by the combine). Measured on the H200 (CUDA graphs, H16, stop 20):
#: with 1 (v2/v3's value) B32 L128K split 41 ways and took 1,004.9 us (C4R4); with 2, 4 ways, 890.8 us
#: (C2R4 869.6 -> 756.8, B8 L128K 263.1 -> 249.2); 4 planned the same as 2, and B64 L64K did not move
V5_CTA_OVERHEAD_TILES = 2.0
#: v4 (``kernels/attention_v4.cu``): tokens per tile, query rows per CTA, warps per CTA, default copy stages
V4_TILE = 64
V4_ROWS = 64
V4_WARPS = 8
V4_STAGES = 2
#: the NVRTC target of v4's wgmma build (``QUANTMLA_CUPY_V4_MMA``): Hopper's architecture-specific features
V4_WGMMA_ARCH = "sm_90a"
#: the oldest NVRTC that builds for sm_90a
V4_WGMMA_NVRTC = (12, 0)
#: auto picks v4 for requests with at least this many query rows (S_q * H)
V4_MIN_ROWS = 64
#: v4 attends to the protected tiles in its own launch (one more CTA per tile and row chunk) when its
#: splits hold at least this many tiles; they then run beside the long packed CTAs. With shorter
#: splits they would form a second wave: H200, H128 C4R4 (CUDA graphs), B8 L4K (8 tiles per split)
#: 80.9 us in-grid vs 72.6 with protected.cu; B32 L32K (256 tiles) 1192.7 vs 1223.9-1235.0
V4_INGRID_MIN_TILES = 64


#: v5 (``kernels/attention_v5.cu``, sm_90a only): tokens per tile (wgmma M), query rows per CTA (wgmma N),
#: worker warpgroups per CTA
V5_TILE = 64
V5_ROWS = 16
V5_WORKERS = 2
#: worker counts the kernel builds with (``QUANTMLA_CUPY_V5_WORKERS``): three fit shared memory at
#: 168 registers a thread, with the loads issued after QK and QK chunks of 2 k-steps; four at d_c 256 only (128
#: registers a thread: 16 warps an SM, the occupancy v5's halves seek at d_c 512, without their exchange)
V5_WORKER_CHOICES = (2, 3, 4)
#: warpgroups of one v5 worker (``QUANTMLA_CUPY_V5_HALVES``): 1, or 2, each taking half of every tile's channels and
#: adding the pair's scores through shared memory, so four warpgroups share an SM at 128 registers a thread (d_c 512 /
#: d_r 64, two workers; a measurement knob, built and modelled offline in stop 41, not yet timed)
V5_HALVES = 1
V5_HALVES_CHOICES = (1, 2)
#: the only compute capability v5's sm_90a build runs on
V5_CAPABILITY = (9, 0)
#: threads of a combine block, one row per block (``attention.cu``'s ``QMLA_COMBINE_THREADS``)
COMBINE_THREADS = 128
#: v6 (``kernels/attention_v6.cu``, sm_90a only): tokens per tile, query rows per CTA, threads per CTA
#: (an attending and a dequantizing warpgroup)
V6_TILE = 64
V6_ROWS = 64
V6_THREADS = 256
#: whether v6's split plan counts the sink/local tiles it appends to one split (:class:`V6Knobs` ``plan_protected``):
#: H200, H128/H64 B8-B128 L4K-128K, CUDA graphs (stop 26): within -4 % .. +2 % of not counting them, so off (stop
#: 25's plan); v5, whose protected tiles cost more, counts them (H16 B8 L32K C4R4: 66.4 against 86.2 us)
V6_PLAN_PROTECTED = False
#: whether ``QUANTMLA_CUPY_V6_PAIR=auto`` pairs v6's CTAs where the row chunks come in pairs (:func:`v6_pairs`)
V6_PAIR_AUTO = False
#: v6's default ``QUANTMLA_CUPY_V6_BALANCE`` (:class:`V6Knobs` ``balance``): ``auto`` launches a balanced plan (pieces
#: of requests cut so that every SM gets as many tiles; ``backends/splits.py``'s :func:`plan_pieces`) for the content
#: bits in :data:`V6_BALANCE_CONTENT_BITS` where its simulated schedule beats equal splits per request
V6_BALANCE = "auto"
#: the content bits ``auto`` balances. H200, H128, CUDA graphs, stop 35, against equal splits planned with
#: :data:`V6_CTA_OVERHEAD_TILES`: C2R4 2.3-2.4 % faster at B128 L32K and B32 L128K, equal at B32 L32K and B8 L128K;
#: C4R4 1.7-5.2 % slower everywhere (its piece-table build reads the piece from memory instead of ``blockIdx``, so
#: ptxas moves the tile loops' index arithmetic from the uniform datapath to the threads' registers: offline SASS,
#: the attender's tile loop 911 -> 922 instructions and 4 % more encoded stall cycles, at 255 registers). Stop 39, after
#: stop 38's prologue change left that build's loops within 3 instructions of the equal-splits build's: C4R4 balanced
#: 1.3 % faster at B128 L128K (at the 700 W cap), even at B128 L32K, 0.5 % slower at B32 L128K and 1.5 % at B8 L32K,
#: so C4R4 stays on equal splits
V6_BALANCE_CONTENT_BITS = (2,)
#: v6's fixed work per CTA in tile-times for its split plans (the queries' load, the first tile's dequantization
#: before any QK, a 64 x 512 float32 partial written and read back). H200, H128, CUDA graphs, stop 35: with 1 (v2's
#: value) B32 L128K split 35 ways (2,240 CTAs) and took 2,583 us (C4R4) / 2,396 (C2R4), with 4 or 8 two ways,
#: 2,346-2,350 / 2,127-2,129; B8 L128K (8 splits against 41) 654 -> 593-603 (C4R4); 4 and 8 planned alike at the
#: PERFORMANCE.md shapes, and every shape from 4K to 32K tokens planned as with 1
V6_CTA_OVERHEAD_TILES = 8.0
#: v6's defaults of :class:`V6Knobs` ``pv_at`` and ``page_ahead``
V6_PV_AT = 3
V6_PAGE_AHEAD = False
#: log2 units a score may pass its row's reference maximum before v6 moves the reference (``QMLA_V6_MAX_SLACK``, as
#: v5's ``QMLA_V5_MAX_SLACK``) where :class:`V6Knobs` ``slack`` is on, and whether it is on by default (H200, H128,
#: CUDA graphs, stop 31: 0-2.5 % faster at B8-B128, L4K-128K; C4R4 B32 L32K unchanged)
V6_MAX_SLACK = 8
V6_SLACK = True
#: the content bits for which v6 multiplies each score's RoPE part by the token's scale once instead of dequantizing
#: each RoPE value through float32 (``QMLA_V6_ROPE_FOLD``; :class:`V6Knobs` ``rope_fold`` forces it): with the slack,
#: C4R4 1-4 % faster than the slack alone from 32K tokens on the H200, C2R4 0.5-1.5 % slower (stop 31)
V6_ROPE_FOLD_CONTENT_BITS = (4,)
#: whether v5 converts 2-bit codes where they lie in their byte (``common.cuh``'s ``qmla_code2_in_place``;
#: ``QUANTMLA_CUPY_CODES_IN_PLACE``): 38 fewer instructions per warp and tile in its loop (1,521 against 1,559 at
#: d_c 512; 973 against 987 at 256). H200, C2R4 H16, CUDA graphs (stop 28, one call, the old build run before and
#: after): B128 L32K 680.9 against 690.9-695.7 us, B32 L128K 674.3 against 685.7-689.7, B128 L128K 2,610.8 against
#: 2,683.2-2,683.6, but B32 L32K 2.5 % slower (192.2 against 187.9, and the same in two more calls).
#: v6's dequantizer gained 10 or lost 6 instructions with it (d_c 512 / 256), so v6 does not take it.
CODES_IN_PLACE = True

#: content bits for which v5 multiplies each score's RoPE part by the token's float32 RoPE scale once instead of
#: dequantizing every RoPE value through float32 (``QMLA_V5_ROPE_FOLD``; ``QUANTMLA_CUPY_V5_ROPE_FOLD`` forces it on
#: or off): 72 fewer instructions per warp and tile at d_c 512 (1,320 against 1,392 for C4R4, 1,384 against 1,455 for
#: C2R4). H200, H16, CUDA graphs, stop 29 (1 / 0 / 1 in one process): C2R4 B32 L32K 177.7 / 188.4 / 177.9 us, B128 L32K
#: 652.5 / 676.7 / 652.7, B32 L128K 647.0 / 670.0 / 646.8, B128 L128K 2,530.7 / 2,605.1 / 2,529.3; C4R4 B32 L32K
#: 1.5 % slower with it (186.1-187.4 against 183.5-184.6 in two calls), B128 L32K the same (697-699), so 4-bit
#: content takes it only with the quad loads (:func:`v5_rope_fold`).
ROPE_FOLD_CONTENT_BITS = (2,)

#: whether v5 lets the four lanes of a quad load a token's 4-bit d_c 512 content codes together (64 contiguous bytes a
#: load, one 128-byte line a token and load instead of two) where the build can (``QMLA_V5_QUAD_LOADS``:
#: :func:`v5_quad_loads`; ``QUANTMLA_CUPY_V5_QUAD_LOADS`` forces it on or off). H200, H16 C4R4, CUDA graphs, stop 32
#: (0 / 1 / 1 with the RoPE fold, twice in one process): B32 L32K 187.2 / 177.8 / 171.3 us and 186.2 / 178.0 / 171.7,
#: B128 L32K 717.2 / 682.7 / 666.4 and 711.4 / 700.0 / 665.4, B32 L128K 696.2 / 682.0 / 652.6 and 706.0 / 689.5 /
#: 663.2; ncu at B32 L32K: L1/TEX throughput 85.1 -> 77.4 %, issued warps per scheduler 0.52 -> 0.56. With the quad
#: loads C4R4 is no longer held by L1, and the RoPE fold's 72 fewer instructions pay as they do for C2R4.
V5_QUAD_LOADS = True

#: whether v5 loads a token's 2-bit d_c 512 content zero points and scales in one 8- and one 16-byte load and picks
#: the lane's groups once a tile (``QMLA_V5_PACKED_GROUPS``; ``QUANTMLA_CUPY_V5_PACKED_GROUPS`` = 0/1 forces it): 6
#: loads a token fewer; offline SASS of the packed tile loop, C2R4 d_c 512: 1,388 -> 1,310 instructions a warp and
#: tile, 27 -> 15 LDG, 236 -> 228 registers. H200, H16 C2R4, CUDA graphs, stop 32 (0 / 1 twice in one process): B32
#: L32K 178.3 / 169.7 and 177.5 / 169.8 us, B128 L32K 658.9 / 618.3 and 652.5 / 618.9, B32 L128K 648.8 / 612.5 and
#: 646.6 / 612.5, B128 L128K 2,530.0 / 2,392.6 and 2,532.4 / 2,392.0 (5-6 % faster); B32 L4K equal (40.7-41.1)
V5_PACKED_GROUPS = True


def smem_per_block(capability: tuple[int, int] | None) -> int:
    """Opt-in dynamic shared memory per block (bytes): 227 KB on sm_90, sm_100 and sm_110 (and when the GPU is not
    known yet), 163 KB on sm_80/87, 99 KB on the other sm_8x parts and on sm_120/121 (consumer Blackwell; CUDA
    programming guide, compute capabilities table)."""
    if capability is None or (9, 0) <= tuple(capability) < (12, 0):
        return 227 * 1024
    return 163 * 1024 if tuple(capability) in ((8, 0), (8, 7)) else 99 * 1024

LOG2E = 1.4426950408889634


def attention_defines(fmt: PackFormat, dtype: str, index64: bool = True) -> dict[str, int]:
    """``-D`` defines of ``kernels/attention.cu`` for ``fmt`` and query dtype.

    float32 queries use a split (hi + lo) bf16 A operand for float32-level accuracy. ``index64``:
    seq_lens / seq_ids are int64 (else int32).
    """
    d = format_defines(fmt)
    bf16 = dtype == "bfloat16"
    d.update(QMLA_IN_BF16=int(bf16), QMLA_SPLIT=1 if bf16 else 2, QMLA_INDEX64=int(index64))
    return d


def attention_smem_bytes(fmt: PackFormat) -> int:
    """Dynamic shared memory of one attention block (mirrors the SMEM_* sizes in attention.cu)."""
    ncol = fmt.latent_dim // ATTN_WARPS
    ld = ncol + 24
    ng = fmt.content_groups + 1 if fmt.quantized else 1
    kv = ATTN_WARPS * ATTN_TILE * ld * 2
    scl = 2 * ATTN_TILE * ng * 4
    xchg = ATTN_WARPS * (ATTN_TILE // 8) * 32 * 16
    staging = ATTN_WARPS * ATTN_TILE * (fmt.content_code_bytes // ATTN_WARPS + 32 + 8)
    return kv + scl + xchg + staging


def plan_splits(batch: int, row_groups: int, max_tokens: int, resident: int) -> tuple[int, int]:
    """(num_splits, tiles_per_split) for v1: ``batch * row_groups * num_splits`` CTAs in whole
    rounds of the ``resident`` CTAs the GPU holds at once (``backends/splits.py``).

    ``max_tokens`` is the block table's capacity (max_pages * P), so planning needs no sync."""
    return plan_kv_splits(batch * row_groups, math.ceil(max(1, max_tokens) / ATTN_TILE), resident)


def requested_variant() -> str:
    """The kernel ``QUANTMLA_CUPY_ATTENTION`` asks for (``auto`` when unset), read now."""
    v = getenv(VARIANT_ENV, "").strip().lower() or "auto"
    if v not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV}: expected one of {VARIANTS}, got {v!r}")
    return v


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


def variant_nvrtc(capability: tuple[int, int]) -> tuple[int, int]:
    """The NVRTC version :func:`select_variant` needs for a GPU of ``capability``: asked on compute
    capability 9.0 (the sm_90a builds), elsewhere :data:`V4_WGMMA_NVRTC` (no build there depends on it)."""
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


def stage_bytes(fmt: PackFormat, tile: int, flags: bool) -> int:
    """Bytes of one staged tile (the SO_* layout of kernels v2/v3, 16-byte rounded): content codes,
    RoPE codes, content scales, content zeros, RoPE scale, RoPE zero, and v2's token flag."""
    csz = 2 if fmt.content_scale_dtype == "bfloat16" else 4
    rsz = 2 if fmt.rope_scale_dtype == "bfloat16" else 4
    per_token = fmt.content_code_bytes + fmt.rope_code_bytes + fmt.content_groups * (csz + 1) + rsz + 1 + int(flags)
    return (tile * per_token + 15) // 16 * 16


def v3_smem_bytes(fmt: PackFormat, stages: int = V3_STAGES, warps: int = V3_WARPS) -> int:
    """Dynamic shared memory of one v3 block (mirrors SMEM_TOTAL in attention_v3.cu): the staged
    tiles, the permuted query, its sub-group sums, P * s per content group, the row maxima and,
    with 8 warps, the exchange of partial scores."""
    t, ngc = V3_TILE, fmt.content_groups
    stage = stage_bytes(fmt, t, flags=False)
    ksteps = (fmt.latent_dim + fmt.rope_dim) // 16
    sub_groups = fmt.latent_dim // 64 + 2
    xchg = 4 * 2 * 32 * 32 if warps == 8 else 0  # [token group][pair half][lane][8 floats]
    return stages * stage + ksteps * 512 + sub_groups * 64 + ngc * (t // 8) * 256 + 4 * 64 + xchg


def v4_smem_bytes(fmt: PackFormat, stages: int = V4_STAGES, wgmma: bool = False) -> int:
    """Dynamic shared memory of one v4 block (mirrors SMEM_TOTAL in attention_v4.cu): the staged
    tiles, the dequantized tile and the queries (bf16 rows padded by 16 bytes), P (bf16 [64][64 + 8]),
    the QK score exchange (float4 [8 warps][4 n-tiles][32 lanes]) and four float rows of row statistics.
    ``wgmma``: the build whose K, query and P tiles are 128-byte swizzled (64-channel column blocks of
    128-byte rows, 1024-byte aligned, plus 1 KB to align the base)."""
    staged = stages * stage_bytes(fmt, V4_TILE, flags=False) if fmt.quantized else 0  # bf16 pages: no stages
    stats = V4_WARPS * 4 * 32 * 16 + 4 * V4_ROWS * 4
    if wgmma:
        blocks = -(-(fmt.latent_dim + fmt.rope_dim) // 64)
        return -(-staged // 1024) * 1024 + (V4_TILE + V4_ROWS) * blocks * 128 + V4_ROWS * 128 + stats + 1024
    row = 2 * (fmt.latent_dim + fmt.rope_dim) + 16
    return staged + V4_TILE * row + V4_ROWS * row + V4_ROWS * (2 * V4_TILE + 16) + stats


def v4_defines(fmt: PackFormat, stages: int = V4_STAGES, lazy_rescale: bool = True, index64: bool = True,
               protected: bool = False, wgmma: bool = False) -> dict[str, int]:
    """``-D`` defines of ``kernels/attention_v4.cu`` (bfloat16 queries). ``index64``: int64
    seq_lens / seq_ids (else int32); ``protected``: the build whose last CTAs attend to the
    protected tiles (else packed tokens only); ``wgmma``: both matmuls by Hopper's wgmma (a build
    for sm_90a, :data:`V4_WGMMA_ARCH`)."""
    d = attention_defines(fmt, "bfloat16", index64)
    d.update(QMLA_V4_STAGES=int(stages), QMLA_V4_SMEM=v4_smem_bytes(fmt, stages, wgmma),
             QMLA_V4_LAZY_RESCALE=int(lazy_rescale), QMLA_V4_PROTECTED=int(protected), QMLA_V4_WGMMA=int(wgmma))
    return d


def v4_uses_wgmma(mma: str, capability: tuple[int, int] | None, nvrtc: tuple[int, int] = V4_WGMMA_NVRTC) -> bool:
    """Whether a v4 launch runs its wgmma build: ``mma`` is ``QUANTMLA_CUPY_V4_MMA`` (``auto``: on
    compute capability 9.0 exactly, wgmma being an sm_90a instruction that later GPUs do not run,
    with an NVRTC of at least :data:`V4_WGMMA_NVRTC`, ``nvrtc``). Raises ``ValueError`` naming the
    variable when ``wgmma`` is forced where it cannot run."""
    hopper = capability is not None and tuple(capability) == (9, 0)
    new_nvrtc = tuple(nvrtc) >= V4_WGMMA_NVRTC
    if mma == "wgmma" and not (hopper and new_nvrtc):
        got = "an unknown GPU" if capability is None else f"{capability[0]}.{capability[1]}"
        raise ValueError(f"QUANTMLA_CUPY_V4_MMA: wgmma needs compute capability 9.0 (sm_90a) and NVRTC "
                         f"{V4_WGMMA_NVRTC[0]}.{V4_WGMMA_NVRTC[1]}+, got {got} and NVRTC {nvrtc[0]}.{nvrtc[1]}; use mma")
    return mma == "wgmma" or (mma == "auto" and hopper and new_nvrtc)


def v5_smem_bytes(fmt: PackFormat, workers: int = V5_WORKERS, halves: int = V5_HALVES) -> int:
    """Dynamic shared memory of one v5 block (mirrors SMEM_TOTAL in attention_v5.cu): per worker
    (1024-byte aligned) the 128-byte-swizzled key tile of the content channels (64-channel column blocks
    of 64 rows), P^T (bf16 [16][64]), column statistics (float [4][16]) and 16 bytes of the warps'
    new-maximum flags; then the queries (16 rows of d_c + d_r channels in column blocks), plus 1 KB to
    align the base. No stage: the lanes load their codes from the pages into registers. ``workers``:
    workers per CTA (2 or 3); ``halves``: warpgroups of a worker, each with an area of its own over its share of the
    channels (with 2: and 8 float scores per thread to hand over) and a query tile of its own."""
    blocks = -(-(fmt.latent_dim + fmt.rope_dim) // halves // 64)
    exchange = 2 * 128 * 16 if halves > 1 else 0
    area = V5_TILE * (fmt.latent_dim // halves // 64) * 128 + V5_ROWS * V5_TILE * 2 + 4 * V5_ROWS * 4 + 16 + exchange
    return workers * halves * (-(-area // 1024) * 1024) + halves * blocks * V5_ROWS * 128 + 1024


def v5_defines(fmt: PackFormat, lazy_rescale: bool = True, index64: bool = True,
               workers: int = V5_WORKERS, protected: bool = True, prot_vec: bool = True,
               codes_in_place: bool = CODES_IN_PLACE, rope_fold: bool | None = None,
               quad_loads: bool | None = None, packed_groups: bool = V5_PACKED_GROUPS,
               halves: int = V5_HALVES) -> dict[str, int]:
    """``-D`` defines of ``kernels/attention_v5.cu`` (bfloat16 queries; an sm_90a build,
    :data:`V4_WGMMA_ARCH`). ``index64``: int64 seq_lens / seq_ids (else int32); ``workers``: worker
    warpgroups per CTA; ``protected``: the sink/local tokens as the kernel's own tiles (else packed
    tokens only, for the protected-only launch); ``prot_vec``: a protected tile's bf16 pairs in loads of up to
    16 bytes (``QMLA_V5_PROT_VEC``; else one 4-byte load per fragment register); ``codes_in_place``: 2-bit codes
    converted where they lie (``QMLA_CODES_IN_PLACE``, :data:`CODES_IN_PLACE`; 4-bit content ignores it);
    ``rope_fold``: the RoPE scale multiplies each score once instead of each RoPE value (``QMLA_V5_ROPE_FOLD``;
    None: :func:`v5_rope_fold`'s default; two workers only: three have no registers for the second accumulator);
    ``quad_loads``: a quad's lanes load a token's content codes together (``QMLA_V5_QUAD_LOADS``,
    :func:`v5_quad_loads`); ``packed_groups``: a 2-bit d_c 512 build with 64-channel groups loads a token's zero points
    and scales at once (``QMLA_V5_PACKED_GROUPS``, :data:`V5_PACKED_GROUPS`; other formats and three workers, which
    spilled 8 bytes with it, ignore it); ``halves``: warpgroups of a worker (``QMLA_V5_HALVES``, :data:`V5_HALVES`;
    2 builds neither the fold, quad loads nor packed groups, which need registers four warpgroups do not have)."""
    reasons = v5_build_reasons(fmt, workers, halves)
    if reasons:
        raise ValueError(f"v5 cannot build {fmt} with {workers} workers of {halves} warpgroups: {'; '.join(reasons)}")
    if halves > 1:
        rope_fold, quad_loads, packed_groups = False, False, False
    d = attention_defines(fmt, "bfloat16", index64)
    d.update(QMLA_V5_SMEM=v5_smem_bytes(fmt, workers, halves), QMLA_V5_HALVES=halves,
             QMLA_V5_LAZY_RESCALE=int(lazy_rescale),
             QMLA_V5_WORKERS=workers, QMLA_V5_PROTECTED=int(protected), QMLA_V5_PROT_VEC=int(prot_vec),
             QMLA_CODES_IN_PLACE=int(codes_in_place and fmt.content_bits == 2),
             QMLA_V5_ROPE_FOLD=int(v5_rope_fold(fmt, workers, rope_fold, quad_loads)),
             QMLA_V5_QUAD_LOADS=int(v5_quad_loads(fmt, workers, quad_loads)),
             QMLA_V5_PACKED_GROUPS=int(packed_groups and _v5_loads_token_groups(fmt, workers, 2)))
    return d


def v5_build_reasons(fmt: PackFormat, workers: int, halves: int = V5_HALVES) -> list[str]:
    """Why v5 cannot build ``fmt`` with ``workers`` workers of ``halves`` warpgroups (empty: it can). Four workers
    take d_c 256 (512 threads at 128 registers each hold a quarter of d_c 512's accumulators); two halves take d_c
    512 / d_r 64 (a half's 128 or 64 content code bytes a token, 16 RoPE bytes) and two workers (also 512 threads)."""
    reasons = []
    if workers not in V5_WORKER_CHOICES:
        reasons.append(f"workers: expected one of {V5_WORKER_CHOICES}, got {workers!r}")
    if halves not in V5_HALVES_CHOICES:
        reasons.append(f"halves: expected one of {V5_HALVES_CHOICES}, got {halves!r}")
    if reasons:
        return reasons
    if workers == 4 and fmt.latent_dim != 256:
        reasons.append(f"four workers need d_c 256, got {fmt.latent_dim}")
    if halves == 2 and (fmt.latent_dim, fmt.rope_dim) != (512, 64):
        reasons.append(f"two halves need d_c 512 / d_r 64, got {fmt.latent_dim} / {fmt.rope_dim}")
    if halves == 2 and workers != 2:
        reasons.append(f"two halves need two workers, got {workers}")
    return reasons


def _v5_loads_token_groups(fmt: PackFormat, workers: int, content_bits: int) -> bool:
    """Whether a v5 build with ``workers`` worker warpgroups can load all of a token's content zero points and scales
    at once (``attention_v5.cu``'s PACKED: eight 64-channel groups of d_c 512, bf16 scales) for ``fmt`` with
    ``content_bits``: two workers only (three, at 168 registers a thread, spilled 108 bytes with quad loads and 8 with
    packed groups)."""
    return (workers == 2 and fmt.content_bits == content_bits and fmt.latent_dim == 512 and fmt.group_size == 64
            and fmt.content_scale_dtype == "bfloat16")


def v5_quad_loads(fmt: PackFormat, workers: int = 2, quad_loads: bool | None = None) -> bool:
    """Whether v5 with ``workers`` worker warpgroups loads ``fmt``'s content codes a quad of lanes at a time: where a
    lane's share is 64 bytes a token (4-bit codes) and the build can load a token's groups at once
    (:func:`_v5_loads_token_groups`); there ``quad_loads``, or by default :data:`V5_QUAD_LOADS`."""
    if not _v5_loads_token_groups(fmt, workers, 4):
        return False
    return V5_QUAD_LOADS if quad_loads is None else bool(quad_loads)


def v5_rope_fold(fmt: PackFormat, workers: int, rope_fold: bool | None = None, quad_loads: bool | None = None) -> bool:
    """Whether v5 with ``workers`` worker warpgroups folds the RoPE scale into the scores for ``fmt``: never with
    three (no registers for the second accumulator); else ``rope_fold``, or by default for the content bits in
    :data:`ROPE_FOLD_CONTENT_BITS` and where the build loads its codes a quad at a time (``quad_loads``, as
    :func:`v5_quad_loads` takes it)."""
    if workers != 2:
        return False
    if rope_fold is not None:
        return bool(rope_fold)
    return fmt.content_bits in ROPE_FOLD_CONTENT_BITS or v5_quad_loads(fmt, workers, quad_loads)


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


def v6_smem_bytes(fmt: PackFormat, pair: bool = False, rope_fold: bool = False) -> int:
    """Dynamic shared memory of one v6 block (mirrors SMEM_TOTAL in attention_v6.cu): two key tiles and
    the queries (64 rows of d_c + d_r channels each, 128-byte-swizzled column blocks), P (bf16 [64][64]),
    the rows' rescale factors and, for the partials, maxima and sums (float [3][64]), with ``rope_fold`` the
    two key tiles' RoPE scales (float [2][64]), with ``pair`` four 8-byte mbarriers, plus 1 KB to align the
    base. No stage: the dequantizing warpgroup loads its codes from the pages into registers."""
    blocks = -(-(fmt.latent_dim + fmt.rope_dim) // 64)
    tile = V6_TILE * blocks * 128
    return (2 * tile + V6_ROWS * blocks * 128 + V6_ROWS * V6_TILE * 2 + 3 * V6_ROWS * 4 + 2 * V6_TILE * 4 * rope_fold
            + 32 * pair + 1024)


def v6_rope_fold(fmt: PackFormat, pair: bool = False, rope_fold: bool | None = None) -> bool:
    """Whether v6 folds the RoPE scale into the scores for ``fmt``: ``rope_fold``, or by default for the content bits
    in :data:`V6_ROPE_FOLD_CONTENT_BITS`; never in a ``pair`` build (its kernel has no fold)."""
    if pair:
        return False
    return fmt.content_bits in V6_ROPE_FOLD_CONTENT_BITS if rope_fold is None else bool(rope_fold)


def v6_defines(fmt: PackFormat, index64: bool = True, pv_at: int = V6_PV_AT, page_ahead: bool = V6_PAGE_AHEAD,
               protected: bool = True, pair: bool = False, slack: bool = V6_SLACK,
               rope_fold: bool | None = None, pieces: bool = False) -> dict[str, int]:
    """``-D`` defines of ``kernels/attention_v6.cu`` (bfloat16 queries; an sm_90a build,
    :data:`V4_WGMMA_ARCH`). ``index64``: int64 seq_lens / seq_ids (else int32); ``pv_at``, ``page_ahead``,
    ``protected`` (the sink/local tokens as the kernel's own tiles), ``pair`` (two-CTA clusters sharing
    each key tile), ``slack`` (a reference maximum per row that moves by more than :data:`V6_MAX_SLACK` only) and
    ``rope_fold`` (the RoPE scale applied to each score once; None: :func:`v6_rope_fold`'s default; True is refused
    with ``pair``): :class:`V6Knobs`; ``pieces``: each CTA's work from a balanced plan's piece table (:func:`v6_balanced`;
    refused with ``pair``)."""
    if pair and rope_fold:
        raise ValueError("v6 pair builds do not fold the RoPE scale: rope_fold=True needs pair=False")
    if pair and pieces:
        raise ValueError("v6 pair builds take equal splits: pieces=True needs pair=False")
    fold = v6_rope_fold(fmt, pair, rope_fold)
    d = attention_defines(fmt, "bfloat16", index64)
    d.update(QMLA_V6_SMEM=v6_smem_bytes(fmt, pair, fold), QMLA_V6_PV_AT=pv_at, QMLA_V6_PAGE_AHEAD=int(page_ahead),
             QMLA_V6_PROTECTED=int(protected), QMLA_V6_PAIR=int(pair), QMLA_V6_MAX_SLACK=V6_MAX_SLACK if slack else 0,
             QMLA_V6_ROPE_FOLD=int(fold), QMLA_V6_PIECES=int(pieces))
    return d


def v6_pairs(mode: str, rows: int) -> bool:
    """Whether v6 runs as two-CTA clusters (``QUANTMLA_CUPY_V6_PAIR``): ``1`` always (an odd number of
    64-row chunks gets one more, past the rows), ``0`` never, ``auto`` (default) where the request's
    ``rows`` fill an even number of chunks, so no CTA is added (:data:`V6_PAIR_AUTO`)."""
    if mode == "1":
        return True
    chunks = -(-rows // V6_ROWS)
    return mode == "auto" and V6_PAIR_AUTO and chunks % 2 == 0


def v6_unsupported_reasons(fmt: PackFormat, capability: tuple[int, int] | None, dtype: str = "bfloat16",
                           nvrtc: tuple[int, int] = V4_WGMMA_NVRTC) -> list[str]:
    """Why kernel v6 cannot serve ``fmt`` with ``dtype`` queries on a GPU of ``capability`` (empty: it
    can): what v5 serves (2/4-bit content and 4-bit RoPE codes over packed pages, bf16 queries, compute
    capability 9.0, an NVRTC that builds sm_90a)."""
    return [r.replace("v5 ", "v6 ", 1) for r in v5_unsupported_reasons(fmt, capability, dtype, nvrtc)]


def v3_defines(fmt: PackFormat, stages: int = V3_STAGES, min_blocks: int | None = None, lazy_rescale: bool = True,
               warps: int = V3_WARPS, index64: bool = True) -> dict[str, int]:
    """``-D`` defines of ``kernels/attention_v3.cu`` (bfloat16 queries). ``min_blocks`` None: 2 at
    8 warps (at most 128 registers, so two 8-warp CTAs fit an SM), else 1. ``index64``: int64
    seq_lens / seq_ids (else int32)."""
    minb = (2 if warps == 8 else 1) if min_blocks is None else min_blocks
    d = attention_defines(fmt, "bfloat16", index64)
    d.update(QMLA_V3_STAGES=int(stages), QMLA_V3_MINB=int(minb), QMLA_V3_SMEM=v3_smem_bytes(fmt, stages, warps),
             QMLA_V3_LAZY_RESCALE=int(lazy_rescale), QMLA_V3_NW=int(warps))
    return d


def v2_defines(fmt: PackFormat, row_groups: int = 1, min_blocks: int = 1, stages: int = V2_STAGES,
               lazy_rescale: bool = False, no_protection: bool = False, prot_mode: int = 0,
               tile: int = V2_TILE, index64: bool = True) -> dict[str, int]:
    """``-D`` defines of ``kernels/attention_v2.cu`` (bfloat16 queries). ``no_protection``: the
    cache keeps no sink/local tokens, so only the pure-tile path is compiled (fewer registers,
    half the loop code). ``prot_mode``: 0 protected tokens inline; 1 packed tokens only, with
    ``kernels/protected.cu`` adding the protected ones (``QUANTMLA_CUPY_V2_PROTECTED``). ``tile``:
    tokens per tile, 32 or 64 (``QUANTMLA_CUPY_V2_TILE``). ``index64``: int64 seq_lens / seq_ids
    (else int32)."""
    if prot_mode not in (0, 1):
        raise ValueError(f"prot_mode: expected 0 (inline) or 1 (packed only), got {prot_mode!r}")
    d = attention_defines(fmt, "bfloat16", index64)
    d.update(QMLA_V2_RG=int(row_groups), QMLA_V2_MINB=int(min_blocks), QMLA_V2_STAGES=int(stages),
             QMLA_V2_SMEM=v2_smem_bytes(fmt, row_groups, stages, tile),
             QMLA_V2_LAZY_RESCALE=int(lazy_rescale),
             QMLA_V2_NO_PROTECTION=int(no_protection), QMLA_V2_PROT_MODE=int(prot_mode), QMLA_V2_T=int(tile))
    return d


def v2_default_stages(tile: int) -> int:
    """Copy stages for ``tile``-token tiles: 4 x 32 tokens, or 3 x 64 (4 x 64 = 81 KB of stages
    plus the score exchange would leave room for one CTA per SM instead of two)."""
    return V2_STAGES if tile == V2_TILE else 3


def v2_smem_bytes(fmt: PackFormat, row_groups: int = 1, stages: int = 4, tile: int = V2_TILE) -> int:
    """Dynamic shared memory of one v2 block (mirrors SMEM_TOTAL in attention_v2.cu)."""
    stage = stage_bytes(fmt, tile, flags=True)
    xchg = 2 * row_groups * V2_WARPS * (tile // 8) * 32 * 16
    return stages * stage + xchg


#: kernels/protected.cu: tokens per CTA (one tile) and warps per CTA (each scores 8 of the tokens)
PROTECTED_TILE = 32
PROTECTED_WARPS = 4


def protected_ctas(sink: int, local: int, tile: int = PROTECTED_TILE) -> int:
    """CTAs per row chunk that attend to protected tokens, one ``tile``-token tile each: the tiles
    of the ``sink`` first tokens and every tile the local window of ``local`` tokens can touch (it
    need not start on a tile boundary). Each writes one partial, the last ones of a row's slots.
    The protected-only launch (``kernels/protected.cu``, 16-row chunks) uses 32-token tiles;
    kernel v4's own protected CTAs use its 64."""
    return -(-sink // tile) + (-(-local // tile) + 1 if local > 0 else 0)


def plan_splits_v2(batch: int, chunks: int, max_tokens: int, resident: int,
                   min_tiles: int = V2_MIN_TILES_PER_SPLIT, tile: int = V2_TILE,
                   overhead_tiles: float = CTA_OVERHEAD_TILES) -> tuple[int, int]:
    """(num_splits, tiles_per_split) for v2, as :func:`plan_splits`, but never splitting below
    ``min_tiles`` 32-token tiles (:data:`V2_MIN_TILES_PER_SPLIT`: small batches were paying for
    many tiny splits plus a combine that reads them all). ``tile``: the kernel's tokens per tile;
    the result counts those tiles."""
    tiles = math.ceil(max(1, max_tokens) / tile)
    return plan_kv_splits(batch * chunks, tiles, resident, max(1, min_tiles * V2_TILE // tile), None, overhead_tiles)


_CACHE_LOCK = threading.Lock()
_SM_COUNT: dict[int, tuple[int, tuple[int, int]]] = {}
_FNS: dict[tuple, object] = {}
_PLANS: dict[tuple, object] = {}
#: the pointers that open every split kernel's parameter list: q, q_rope, pages, sink, local, block_table, seq_lens,
#: seq_ids, partial outputs, partial row statistics
SPLIT_POINTERS = 10
#: the combine's parameters: partial outputs, partial row statistics, out, lse (pointers), partials per row
COMBINE_TYPES = (np.uint64,) * 4 + (np.int32,)
_WORKSPACE: dict[tuple[int, int], torch.Tensor] = {}


def _device_info(dev: int) -> tuple[int, tuple[int, int]]:
    """(SM count, compute capability) of device ``dev``, queried once."""
    info = _SM_COUNT.get(dev)
    if info is None:
        props = torch.cuda.get_device_properties(dev)
        info = (int(props.multi_processor_count), (int(props.major), int(props.minor)))
        with _CACHE_LOCK:
            _SM_COUNT[dev] = info
    return info


def _env_int(name: str, default: int, allowed: tuple[int, ...]) -> int:
    raw = getenv(name, "").strip()
    if not raw:
        return default
    try:
        v = int(raw)
    except ValueError:
        v = None
    if v not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {raw!r}")
    return v


def _env_choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    raw = getenv(name, "").strip().lower()
    if not raw:
        return default
    if raw not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {raw!r}")
    return raw


def _env_auto_bool(name: str) -> bool | None:
    """An ``auto``/``0``/``1`` knob: None (the launcher's default), False or True."""
    return {"auto": None, "0": False, "1": True}[_env_choice(name, "auto", ("auto", "0", "1"))]


def _workspace(dev: int, numel: int) -> torch.Tensor:
    """float32 scratch of at least ``numel`` elements for the split partials, reused per
    (device, current stream) so steady-state decode allocates nothing but its outputs.
    Calls on one stream are ordered, so the next call's kernels write only after this call's
    combine has read. Not for CUDA-graph capture (see :func:`outputs_and_partials`)."""
    key = (dev, current_stream_handle(dev))
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1 << 16), dtype=torch.float32, device=torch.device("cuda", dev))
        with _CACHE_LOCK:
            _WORKSPACE[key] = buf
    return buf


def outputs_and_partials(shape: tuple[int, ...], dtype: torch.dtype, partial_floats: int, device: torch.device,
                         dev: int, capturing: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``out`` (``shape`` = [B, S_q, H, d_c], ``dtype``), ``lse`` ([B, S_q, H] float32) and a float32
    scratch of ``partial_floats`` for the split partials.

    Eagerly the scratch is the reused per-stream workspace. While a CUDA graph is being captured
    all three are views of ONE new allocation: the graph's kernels write the scratch on every
    replay, so its memory must live as long as the outputs the caller keeps (a scratch freed at
    the end of the call could be handed to a later allocation of the same capture)."""
    if capturing is None:
        capturing = graph_capturing()
    lse_shape = shape[:-1]
    if not capturing:
        ws = _workspace(dev, partial_floats)
        return torch.empty(shape, dtype=dtype, device=device), torch.empty(lse_shape, dtype=torch.float32, device=device), ws

    out, lse, ws = carve([(shape, dtype), (lse_shape, torch.float32), ((partial_floats,), torch.float32)], device)
    return out, lse, ws


def attention(q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale: float, want_lse: bool = True):
    """q ``[B, S_q, H, d_c]`` / ``[B, S_q, H, d_r]``, or ``[B, H, d_c]`` / ``[B, H, d_r]`` for S_q = 1
    (float32 or bfloat16, CUDA) -> out shaped like q_latent in its dtype and lse ``[B, S_q, H]``
    (``[B, H]``) float32, or None where not ``want_lse`` (written to scratch instead of a new tensor).

    Runs kernel v1 to v6 (see the module docstring and :func:`select_variant`), prepared by
    :func:`prepared` (once per index tensors, geometry and knobs)."""
    shape = q_latent.shape
    b, h = shape[0], shape[-2]
    s_q = shape[1] if len(shape) == 4 else 1
    capturing = graph_capturing()
    call = prepared(cache, block_table, seq_lens, seq_ids, b, s_q, h, q_latent.dtype, softmax_scale, shape, capturing)
    return call.run(q_latent, q_rope, cache, want_lse=want_lse, capturing=capturing)


#: eager calls prepared by :func:`prepared`: key -> (variables read, their values then, the SplitCall)
_PREPARED: dict[tuple, tuple[tuple[str, ...], tuple, "SplitCall"]] = {}
#: calls kept by :func:`prepared` (the oldest goes first); a decode step with one set of index tensors needs one
PREPARED_KEEP = 64


def prepared(cache, block_table, seq_lens, seq_ids, batch: int, s_q: int, heads: int, q_dtype: torch.dtype,
             softmax_scale: float, out_shape: tuple[int, ...], capturing: bool) -> "SplitCall":
    """:func:`prepare`'s call for these arguments, reused while nothing it depends on changed.

    A kept call is reused for the same ``block_table``, ``seq_lens`` and ``seq_ids`` objects (it
    holds them, so their ids stay theirs) with the same shapes and strides, a cache of the same
    geometry, the same query shape, dtype and scale, and the same values of every ``QUANTMLA_*``
    variable ``prepare`` read (:func:`~quantmla_core.envvars.recording`). Only calls that use the
    index tensors as they are get kept: the kernels read their values at launch, so values changed
    in place between calls are seen. A call that converts one (a copy of this call's values) and
    any call under CUDA-graph capture (``capturing``) is prepared afresh."""
    if capturing:
        return prepare(cache, block_table, seq_lens, seq_ids, batch, s_q, heads, q_dtype, softmax_scale, out_shape)
    key = (id(block_table), block_table.shape, block_table.stride(), id(seq_lens), seq_lens.shape, seq_lens.stride(),
           id(seq_ids), seq_ids.shape, seq_ids.stride(), cache.format, cache.pages.device, cache.pages.shape[0],
           cache.max_seqs, cache.sink, cache.local, batch, s_q, heads, q_dtype, softmax_scale, out_shape)
    kept = _PREPARED.get(key)
    if kept is not None and snapshot(kept[0]) == kept[1]:
        return kept[2]
    with recording() as read:
        call = prepare(cache, block_table, seq_lens, seq_ids, batch, s_q, heads, q_dtype, softmax_scale, out_shape)
    table, lens, ids = call.index
    if table is block_table and lens is seq_lens and ids is seq_ids:
        names = tuple(dict.fromkeys(read))
        with _CACHE_LOCK:
            _PREPARED.pop(key, None)
            _PREPARED[key] = (names, snapshot(names), call)
            while len(_PREPARED) > PREPARED_KEEP:
                _PREPARED.pop(next(iter(_PREPARED)))
    return call


def prepare(cache, block_table, seq_lens, seq_ids, batch: int, s_q: int, heads: int, q_dtype: torch.dtype,
            softmax_scale: float, out_shape: tuple[int, ...] | None = None) -> "SplitCall":
    """Everything of an attention call that does not depend on the queries or on which layer's
    cache of this geometry it reads: the kernel variant and its launch plan, block_table /
    seq_lens / seq_ids in the kernels' dtypes, the scalar arguments. ``run`` launches.
    ``out_shape``: the shape of the queries and outputs, [B, S_q, H, d_c] (default) or, where
    S_q = 1, [B, H, d_c]."""
    fmt = cache.format
    dtype = "bfloat16" if q_dtype == torch.bfloat16 else "float32"
    device = cache.pages.device
    dev = device.index if device.index is not None else torch.cuda.current_device()
    sm_count, capability = _device_info(dev)
    max_pages = int(block_table.shape[1])
    nvrtc = variant_nvrtc(capability)
    max_tokens = max_pages * fmt.page_size
    variant, _ = select_variant(fmt, dtype, capability, max_tokens, s_q * heads, nvrtc, batch)
    index64 = True
    side_default = False
    if variant in ("v2", "v3", "v4", "v5", "v6"):
        # only this variant's QUANTMLA_CUPY_* knobs are read (each read is host time of every call)
        make_plan, knob_type = {"v2": (v2_plan, V2Knobs), "v3": (v3_plan, V3Knobs), "v4": (v4_plan, V4Knobs),
                                "v5": (v5_plan, V5Knobs), "v6": (v6_plan, V6Knobs)}[variant]
        knobs = knob_type.from_env()
        no_prot = cache.sink == 0 and cache.local == 0
        # int32 seq_lens and seq_ids get an int32 build rather than a conversion on every call
        index64 = not (seq_lens.dtype == torch.int32 and seq_ids.dtype == torch.int32)
        plan = make_plan(fmt, dev, sm_count, batch, s_q * heads, max_pages, no_prot, knobs, cache.sink, cache.local,
                         index64)
        side_default = make_plan is not v2_plan and max_tokens >= V3_MIN_TOKENS
    else:
        plan = _v1_plan(fmt, dtype, dev, sm_count, batch, s_q * heads, max_pages)
    shape = (batch, s_q, heads, fmt.latent_dim)
    return SplitCall.make(plan, cache, block_table, seq_lens, seq_ids, shape, tuple(out_shape or shape),
                          softmax_scale, dev, side_default, index64)


def _split_kernel(key: tuple, variant: str, dev: int, smem: int, defines, arch: str | None = None) -> tuple:
    """(compiled ``qmla_attn_<variant>`` of ``kernels/attention_<variant>.cu``, its dynamic shared
    memory), cached under ``key``; ``defines`` is called only to build it; ``arch``: see
    :func:`~quantmla_core.backends.cupy.get_kernel`."""
    fn = _FNS.get(key)
    if fn is None:
        fn = (get_kernel(f"attention_{variant}.cu", f"qmla_attn_{variant}", defines(), dev, smem, arch), smem)
        with _CACHE_LOCK:
            _FNS[key] = fn
    return fn


def _v2_kernel(fmt: PackFormat, dev: int, rg: int, minb: int, stages: int, lazy: bool, no_prot: bool, mode: int,
               tile: int = V2_TILE, index64: bool = True):
    """Compiled ``qmla_attn_v2`` for one set of defines (cached) and its dynamic shared memory."""
    return _split_kernel(("v2", fmt, dev, rg, minb, stages, lazy, no_prot, mode, tile, index64), "v2", dev,
                         v2_smem_bytes(fmt, rg, stages, tile),
                         lambda: v2_defines(fmt, rg, minb, stages, lazy, no_prot, mode, tile, index64))


def _combine_kernel(fmt: PackFormat, dev: int):
    key = ("combine", fmt, dev)
    fn = _FNS.get(key)
    if fn is None:
        fn = get_kernel("attention.cu", "qmla_combine", attention_defines(fmt, "bfloat16"), dev)
        with _CACHE_LOCK:
            _FNS[key] = fn
    return fn


@dataclass(frozen=True)
class V2Knobs:
    """The ``QUANTMLA_CUPY_V2_*`` tuning variables of one call (``rg`` None: the default rule)."""

    rg: int | None
    minb: int
    stages: int
    lazy: bool
    separate: bool
    min_tiles: int = V2_MIN_TILES_PER_SPLIT
    tile: int = V2_TILE

    @staticmethod
    def from_env() -> "V2Knobs":
        rg = _env_int("QUANTMLA_CUPY_V2_RG", 0, (1, 2)) or None
        tile = _env_int("QUANTMLA_CUPY_V2_TILE", V2_TILE, V2_TILES)
        return V2Knobs(rg, _env_int("QUANTMLA_CUPY_V2_MINB", 1, (1, 2, 3, 4)),
                       _env_int("QUANTMLA_CUPY_V2_STAGES", v2_default_stages(tile), (3, 4, 5)),
                       bool(_env_int("QUANTMLA_CUPY_V2_LAZY_RESCALE", 0, (0, 1))),
                       _env_choice("QUANTMLA_CUPY_V2_PROTECTED", "separate", ("inline", "separate")) == "separate",
                       _env_int("QUANTMLA_CUPY_V2_MIN_TILES", V2_MIN_TILES_PER_SPLIT, (1, 2, 4, 8, 16)), tile)


@dataclass(frozen=True)
class SplitPlan:
    """Everything a v2 or v3 call launches for one problem shape: split kernels (kernel, grid,
    block, shared bytes), the combine, tiles per split and partial slots per row."""

    launches: tuple
    combine: object
    per: int
    slots: int
    #: arguments the split kernel (the first launch) takes after the shared list: v6's (piece table, tiles per request)
    extra_args: tuple = ()
    #: what the launches read and the plan keeps alive: v6's piece table (a device tensor)
    keep: tuple = ()


def v2_plan(fmt: PackFormat, dev: int, sm_count: int, batch: int, rows: int, max_pages: int, no_prot: bool,
            knobs: V2Knobs, sink: int = 0, local: int = 0, index64: bool = True) -> SplitPlan:
    """The launch plan of kernel v2 (cached per shape and knobs: steady-state decode reuses it).
    ``sink``/``local``: the cache's protected tokens (size the separate mode's protected launch);
    ``index64``: the width of seq_lens / seq_ids the kernels are built for."""
    key = (fmt, dev, sm_count, batch, rows, max_pages, no_prot, knobs, sink, local, index64)
    plan = _PLANS.get(key)
    if plan is None:
        row_groups = (rows + 15) // 16
        rg = knobs.rg or (2 if row_groups % 2 == 0 else 1)
        chunks = (rows + 16 * rg - 1) // (16 * rg)
        separate = knobs.separate and not no_prot
        attn, smem = _v2_kernel(fmt, dev, rg, knobs.minb, knobs.stages, knobs.lazy, no_prot, 1 if separate else 0,
                                knobs.tile, index64)
        block = (V2_WARPS * 32 * rg,)
        resident = resident_ctas(attn, block[0], smem, dev, sm_count)
        splits, per = plan_splits_v2(batch, chunks, max(1, max_pages) * fmt.page_size, resident, knobs.min_tiles,
                                     knobs.tile)
        launches = [(attn, (batch * chunks, splits), block, smem)]
        if separate:
            launches.append(_protected_launch(fmt, dev, batch, rows, sink, local, index64))
        nprot = protected_ctas(sink, local) if separate else 0
        plan = SplitPlan(tuple(launches), _combine_kernel(fmt, dev), per, splits + nprot)
        with _CACHE_LOCK:
            _PLANS[key] = plan
    return plan


def protected_smem_bytes(fmt: PackFormat) -> int:
    """Dynamic shared memory of ``kernels/protected.cu``: 16 query rows and 32 key rows of
    d_c + d_r bfloat16 values padded by 8, P as bfloat16 [16][40], row maxima and sums [2][4][16]."""
    row = fmt.latent_dim + fmt.rope_dim + 8
    return (16 + PROTECTED_TILE) * row * 2 + 16 * (PROTECTED_TILE + 8) * 2 + 2 * PROTECTED_WARPS * 16 * 4


def protected_defines(fmt: PackFormat, index64: bool = True) -> dict[str, int]:
    """``-D`` defines of ``kernels/protected.cu``: the row widths, tile and warps, the shared
    memory size the launch gives it (the kernel checks it against its own layout) and the width
    of seq_lens / seq_ids."""
    return {"QMLA_DC": fmt.latent_dim, "QMLA_DR": fmt.rope_dim, "QMLA_PROT_T": PROTECTED_TILE,
            "QMLA_PROT_NW": PROTECTED_WARPS, "QMLA_PROT_SMEM_EXPECTED": protected_smem_bytes(fmt),
            "QMLA_INDEX64": int(index64)}


def _protected_launch(fmt: PackFormat, dev: int, batch: int, rows: int, sink: int, local: int,
                      index64: bool = True) -> tuple:
    """(kernel, grid, block, shared bytes) of the protected-only launch (``kernels/protected.cu``):
    the sink and local-window tokens as :func:`protected_ctas` more partials per 16-row chunk, one
    32-token tile per CTA."""
    key = ("protected", fmt.latent_dim, fmt.rope_dim, dev, index64)
    fn = _FNS.get(key)
    if fn is None:
        smem = protected_smem_bytes(fmt)
        fn = (get_kernel("protected.cu", "qmla_attn_protected", protected_defines(fmt, index64), dev, smem), smem)
        with _CACHE_LOCK:
            _FNS[key] = fn
    kernel, smem = fn
    return kernel, (batch * ((rows + 15) // 16), protected_ctas(sink, local)), (PROTECTED_WARPS * 32,), smem


def _v3_kernel(fmt: PackFormat, dev: int, stages: int, minb: int | None, lazy: bool = True, warps: int = V3_WARPS,
               index64: bool = True):
    """Compiled ``qmla_attn_v3`` (cached) and its dynamic shared memory."""
    return _split_kernel(("v3", fmt, dev, stages, minb, lazy, warps, index64), "v3", dev,
                         v3_smem_bytes(fmt, stages, warps),
                         lambda: v3_defines(fmt, stages, minb, lazy, warps, index64))


@dataclass(frozen=True)
class V3Knobs:
    """The ``QUANTMLA_CUPY_V3_*`` tuning variables of one call (stages: copy ring depth; minb:
    ``__launch_bounds__`` minimum blocks per SM, None: the build's default; lazy: skip the output
    rescale while no row's maximum moves; warps: 4 or 8 per CTA) and v2's split floor."""

    stages: int
    minb: int | None
    min_tiles: int = V2_MIN_TILES_PER_SPLIT
    lazy: bool = True
    warps: int = V3_WARPS

    @staticmethod
    def from_env() -> "V3Knobs":
        return V3Knobs(_env_int("QUANTMLA_CUPY_V3_STAGES", V3_STAGES, (3, 4)),
                       _env_int("QUANTMLA_CUPY_V3_MINB", 0, (1, 2, 3)) or None,
                       _env_int("QUANTMLA_CUPY_V2_MIN_TILES", V2_MIN_TILES_PER_SPLIT, (1, 2, 4, 8, 16)),
                       bool(_env_int("QUANTMLA_CUPY_V3_LAZY_RESCALE", 1, (0, 1))),
                       _env_int("QUANTMLA_CUPY_V3_WARPS", V3_WARPS, (4, 8)))


def v3_plan(fmt: PackFormat, dev: int, sm_count: int, batch: int, rows: int, max_pages: int, no_prot: bool,
            knobs: V3Knobs, sink: int = 0, local: int = 0, index64: bool = True) -> SplitPlan:
    """The launch plan of kernel v3: its split kernel over packed tokens and, when the cache keeps
    sink/local tokens, the protected-only launch adding them as more partials per row.
    ``index64``: the width of seq_lens / seq_ids the kernels are built for."""
    key = ("v3", fmt, dev, sm_count, batch, rows, max_pages, no_prot, knobs, sink, local, index64)
    plan = _PLANS.get(key)
    if plan is None:
        if knobs.warps == 8 and fmt.content_code_bytes < 128:
            raise ValueError(f"QUANTMLA_CUPY_V3_WARPS: 8 warps need >= 128 content code bytes per token (16 per "
                             f"warp slice), {fmt.name} d_c={fmt.latent_dim} has {fmt.content_code_bytes}; use 4")
        attn, smem = _v3_kernel(fmt, dev, knobs.stages, knobs.minb, knobs.lazy, knobs.warps, index64)
        plan = _packed_split_plan(key, attn, smem, knobs.warps * 32, V3_TILE, 1, fmt, dev, sm_count, batch, rows,
                                  max_pages, no_prot, knobs.min_tiles, sink, local, index64)
    return plan


def _packed_split_plan(key: tuple, attn, smem: int, threads: int, tile: int, slots_per_cta: int, fmt: PackFormat,
                       dev: int, sm_count: int, batch: int, rows: int, max_pages: int, no_prot: bool, min_tiles: int,
                       sink: int, local: int, index64: bool,
                       overhead_tiles: float = CTA_OVERHEAD_TILES, rows_per_cta: int = 16,
                       own_protected_tiles: int = 0, chunk_multiple: int = 1, extra_args: tuple = (),
                       cache: bool = True) -> SplitPlan:
    """The plan of a split kernel (v3, v5, v6): ``attn`` over ``rows_per_cta``-row chunks and
    wave-planned splits of ``tile``-token tiles (``overhead_tiles``: a CTA's fixed work, see
    :func:`~quantmla_core.backends.splits.plan_kv_splits`), each CTA writing ``slots_per_cta`` partials,
    then, unless ``no_prot`` (no sink/local tokens, or a kernel that attends to them itself), the
    protected-only launch adding them as the last partials of each row; cached under ``key``.
    ``own_protected_tiles``: the sink/local tiles a kernel that attends to them itself appends to one
    split per row chunk (the last, or the first past the packed tokens), planned as that many more tiles
    of table, so that the last split's packed run leaves room for them. ``chunk_multiple``: the row chunks
    are padded to a multiple of it (v6's two-CTA clusters; the kernel pads the same way)."""
    resident = resident_ctas(attn, threads, smem, dev, sm_count)
    chunks = -(-rows // rows_per_cta)
    chunks = -(-chunks // chunk_multiple) * chunk_multiple
    tokens = max(1, max_pages) * fmt.page_size + own_protected_tiles * tile
    splits, per = plan_splits_v2(batch, chunks, tokens, resident, min_tiles, tile, overhead_tiles)
    launches = [(attn, (batch * chunks, splits), (threads,), smem)]
    if not no_prot:
        launches.append(_protected_launch(fmt, dev, batch, rows, sink, local, index64))
    nprot = 0 if no_prot else protected_ctas(sink, local)
    plan = SplitPlan(tuple(launches), _combine_kernel(fmt, dev), per, slots_per_cta * splits + nprot, extra_args)
    if cache:
        with _CACHE_LOCK:
            _PLANS[key] = plan
    return plan


def _own_protected_tiles(no_prot: bool, knobs: "V5Knobs | V6Knobs", sink: int, local: int, tile: int) -> int:
    """The sink/local tiles a kernel that attends to them itself (v5, v6 without ``knobs.separate``) has its
    split plan count (``knobs.plan_protected``): :func:`protected_ctas` of its ``tile``, else 0."""
    return 0 if no_prot or knobs.separate or not knobs.plan_protected else protected_ctas(sink, local, tile)


def _v4_kernel(fmt: PackFormat, dev: int, stages: int, lazy: bool, index64: bool, protected: bool,
               wgmma: bool = False):
    """Compiled ``qmla_attn_v4`` (cached) and its dynamic shared memory."""
    return _split_kernel(("v4", fmt, dev, stages, lazy, index64, protected, wgmma), "v4", dev,
                         v4_smem_bytes(fmt, stages, wgmma), lambda: v4_defines(fmt, stages, lazy, index64, protected, wgmma),
                         V4_WGMMA_ARCH if wgmma else None)


@dataclass(frozen=True)
class V4Knobs:
    """The ``QUANTMLA_CUPY_V4_*`` tuning variables of one call (stages: copy ring depth; lazy: skip
    the output rescale while no row's maximum moves; mma: ``auto``, ``wgmma`` or ``mma``, see
    :func:`v4_uses_wgmma`) and v2's split floor."""

    stages: int = V4_STAGES
    lazy: bool = True
    min_tiles: int = V2_MIN_TILES_PER_SPLIT
    mma: str = "auto"

    @staticmethod
    def from_env() -> "V4Knobs":
        return V4Knobs(_env_int("QUANTMLA_CUPY_V4_STAGES", V4_STAGES, (2, 3)),
                       bool(_env_int("QUANTMLA_CUPY_V4_LAZY_RESCALE", 1, (0, 1))),
                       _env_int("QUANTMLA_CUPY_V2_MIN_TILES", V2_MIN_TILES_PER_SPLIT, (1, 2, 4, 8, 16)),
                       _env_choice("QUANTMLA_CUPY_V4_MMA", "auto", ("auto", "wgmma", "mma")))


def v4_plan(fmt: PackFormat, dev: int, sm_count: int, batch: int, rows: int, max_pages: int, no_prot: bool,
            knobs: V4Knobs, sink: int = 0, local: int = 0, index64: bool = True) -> SplitPlan:
    """The launch plan of kernel v4 (64 query rows per CTA) over the packed splits. A cache with
    sink/local tokens adds, when the splits hold >= :data:`V4_INGRID_MIN_TILES` tiles, one CTA per
    protected 64-token tile and row chunk to the same launch (``protected_ctas(sink, local, 64)``),
    else the protected-only launch of v2/v3; either way their partials are the last slots."""
    key = ("v4", fmt, dev, sm_count, batch, rows, max_pages, no_prot, knobs, sink, local, index64)
    plan = _PLANS.get(key)
    if plan is None:
        chunks = -(-rows // V4_ROWS)
        capability = _device_info(dev)[1]
        wgmma = v4_uses_wgmma(knobs.mma, capability, nvrtc_version())
        have = smem_per_block(capability)
        need = v4_smem_bytes(fmt, knobs.stages, wgmma)
        if need > have:
            raise ValueError(f"QUANTMLA_CUPY_V4_STAGES: {knobs.stages} stages need {need} "
                             f"B of shared memory for {fmt.name} d_c={fmt.latent_dim}, this GPU allows {have}")
        block = (V4_WARPS * 32,)
        probe, smem = _v4_kernel(fmt, dev, knobs.stages, knobs.lazy, index64, False, wgmma)
        resident = resident_ctas(probe, block[0], smem, dev, sm_count)
        splits, per = plan_splits_v2(batch, chunks, max(1, max_pages) * fmt.page_size, resident, knobs.min_tiles,
                                     V4_TILE)
        in_grid = not no_prot and per >= V4_INGRID_MIN_TILES
        attn, smem = _v4_kernel(fmt, dev, knobs.stages, knobs.lazy, index64, in_grid, wgmma)
        nprot = protected_ctas(sink, local, V4_TILE) if in_grid else 0
        launches = [(attn, (batch * chunks, splits + nprot), block, smem)]
        if not no_prot and not in_grid:
            launches.append(_protected_launch(fmt, dev, batch, rows, sink, local, index64))
            nprot = protected_ctas(sink, local)
        plan = SplitPlan(tuple(launches), _combine_kernel(fmt, dev), per, splits + nprot)
        with _CACHE_LOCK:
            _PLANS[key] = plan
    return plan


def _v5_kernel(fmt: PackFormat, dev: int, lazy: bool, index64: bool, workers: int = V5_WORKERS,
               protected: bool = True, prot_vec: bool = True, codes_in_place: bool = CODES_IN_PLACE,
               rope_fold: bool | None = None, quad_loads: bool | None = None,
               packed_groups: bool = V5_PACKED_GROUPS, halves: int = V5_HALVES):
    """Compiled ``qmla_attn_v5`` (cached, an sm_90a build) and its dynamic shared memory."""
    return _split_kernel(("v5", fmt, dev, lazy, index64, workers, protected, prot_vec, codes_in_place, rope_fold,
                          quad_loads, packed_groups, halves), "v5", dev, v5_smem_bytes(fmt, workers, halves),
                         lambda: v5_defines(fmt, lazy, index64, workers, protected, prot_vec, codes_in_place, rope_fold,
                                            quad_loads, packed_groups, halves),
                         V4_WGMMA_ARCH)


@dataclass(frozen=True)
class V5Knobs:
    """The ``QUANTMLA_CUPY_V5_*`` tuning variables of one call (lazy: skip the output rescale while
    no row's maximum moves; workers: worker warpgroups per CTA; separate (``QUANTMLA_CUPY_V5_PROTECTED``,
    ``inline`` (default) or ``separate``): leave the sink/local tokens to the protected-only launch instead
    of attending to them as the kernel's own tiles; plan_protected (``QUANTMLA_CUPY_PLAN_PROTECTED``, 0/1,
    default 1): count those tiles in the split plan; prot_vec (``QUANTMLA_CUPY_V5_PROT_LOADS``, ``vec``
    (default) or ``pairs``): load a protected tile's bf16 pairs in loads of up to 16 bytes, not one by one;
    codes_in_place (``QUANTMLA_CUPY_CODES_IN_PLACE``, 0/1, default :data:`CODES_IN_PLACE`): convert 2-bit codes where
    they lie in their byte; rope_fold (``QUANTMLA_CUPY_V5_ROPE_FOLD``, ``auto`` (default: None, :func:`v5_rope_fold`),
    ``0`` or ``1``): scale each score's RoPE part once instead of dequantizing each RoPE value; quad_loads
    (``QUANTMLA_CUPY_V5_QUAD_LOADS``, ``auto`` (default: None, :func:`v5_quad_loads`), ``0`` or ``1``): a quad of
    lanes loads a token's content codes together; packed_groups (``QUANTMLA_CUPY_V5_PACKED_GROUPS``, 0/1,
    default :data:`V5_PACKED_GROUPS`): a token's 2-bit content zero points and scales in one load each; halves
    (``QUANTMLA_CUPY_V5_HALVES``, 1/2, default :data:`V5_HALVES`): warpgroups of a worker, each over half of every
    tile's channels) and v2's split floor."""

    lazy: bool = True
    min_tiles: int = V2_MIN_TILES_PER_SPLIT
    workers: int = V5_WORKERS
    separate: bool = False
    plan_protected: bool = True
    prot_vec: bool = True
    codes_in_place: bool = CODES_IN_PLACE
    rope_fold: bool | None = None
    quad_loads: bool | None = None
    packed_groups: bool = V5_PACKED_GROUPS
    halves: int = V5_HALVES

    @staticmethod
    def from_env() -> "V5Knobs":
        return V5Knobs(bool(_env_int("QUANTMLA_CUPY_V5_LAZY_RESCALE", 1, (0, 1))),
                       _env_int("QUANTMLA_CUPY_V2_MIN_TILES", V2_MIN_TILES_PER_SPLIT, (1, 2, 4, 8, 16)),
                       _env_int("QUANTMLA_CUPY_V5_WORKERS", V5_WORKERS, V5_WORKER_CHOICES),
                       _env_choice("QUANTMLA_CUPY_V5_PROTECTED", "inline", ("inline", "separate")) == "separate",
                       bool(_env_int("QUANTMLA_CUPY_PLAN_PROTECTED", 1, (0, 1))),
                       _env_choice("QUANTMLA_CUPY_V5_PROT_LOADS", "vec", ("vec", "pairs")) == "vec",
                       bool(_env_int("QUANTMLA_CUPY_CODES_IN_PLACE", int(CODES_IN_PLACE), (0, 1))),
                       _env_auto_bool("QUANTMLA_CUPY_V5_ROPE_FOLD"),
                       _env_auto_bool("QUANTMLA_CUPY_V5_QUAD_LOADS"),
                       bool(_env_int("QUANTMLA_CUPY_V5_PACKED_GROUPS", int(V5_PACKED_GROUPS), (0, 1))),
                       _env_int("QUANTMLA_CUPY_V5_HALVES", V5_HALVES, V5_HALVES_CHOICES))


def v5_plan(fmt: PackFormat, dev: int, sm_count: int, batch: int, rows: int, max_pages: int, no_prot: bool,
            knobs: V5Knobs, sink: int = 0, local: int = 0, index64: bool = True) -> SplitPlan:
    """The launch plan of kernel v5 (16 query rows per CTA, two worker warpgroups): one launch, each CTA
    writing one partial per worker; the sink/local tokens are the last tiles of one split per row chunk
    (``stage.cuh``'s ``qmla_protected_split``), so there is no protected-only launch (but with
    ``knobs.separate``)."""
    key = ("v5", fmt, dev, sm_count, batch, rows, max_pages, no_prot, knobs, sink, local, index64)
    plan = _PLANS.get(key)
    if plan is None:
        reasons = v5_build_reasons(fmt, knobs.workers, knobs.halves)
        if reasons:
            raise ValueError(f"QUANTMLA_CUPY_V5_WORKERS={knobs.workers} / QUANTMLA_CUPY_V5_HALVES={knobs.halves} cannot "
                             f"serve this call: {'; '.join(reasons)}")
        attn, smem = _v5_kernel(fmt, dev, knobs.lazy, index64, knobs.workers, not knobs.separate, knobs.prot_vec,
                                knobs.codes_in_place, knobs.rope_fold, knobs.quad_loads, knobs.packed_groups,
                                knobs.halves)
        own = _own_protected_tiles(no_prot, knobs, sink, local, V5_TILE)
        threads = knobs.workers * knobs.halves * 128  # one partial per worker, whatever its warpgroups
        plan = _packed_split_plan(key, attn, smem, threads, V5_TILE, knobs.workers, fmt, dev, sm_count, batch,
                                  rows, max_pages, no_prot or not knobs.separate, knobs.min_tiles, sink, local, index64,
                                  V5_CTA_OVERHEAD_TILES, own_protected_tiles=own)
    return plan


@dataclass(frozen=True)
class V6Knobs:
    """The tuning variables of one v6 call: v2's split floor (``QUANTMLA_CUPY_V2_MIN_TILES``); ``pv_at``
    (``QUANTMLA_CUPY_V6_PV_AT``, 1-3): how many of the next tile's three parts (two tokens' content, RoPE) a
    dequantizing thread converts before it issues its PV, the rest running beside that PV; ``page_ahead``
    (``QUANTMLA_CUPY_V6_PAGE_AHEAD``, 0/1): read a tile's page ids one tile before its codes; ``separate``
    (``QUANTMLA_CUPY_V6_PROTECTED``, ``inline`` (default) or ``separate``): leave the sink/local tokens to the
    protected-only launch instead of attending to them as the kernel's own tiles; ``plan_protected``
    (``QUANTMLA_CUPY_PLAN_PROTECTED``, 0/1, default :data:`V6_PLAN_PROTECTED`): count those tiles in the split plan;
    ``pair`` (``QUANTMLA_CUPY_V6_PAIR``, ``auto`` (default), ``0`` or ``1``): run two-CTA clusters that share each
    dequantized key tile (:func:`v6_pairs`); ``slack`` (``QUANTMLA_CUPY_V6_SLACK``, 0/1, default :data:`V6_SLACK`):
    move a row's reference maximum only when a score passes it by :data:`V6_MAX_SLACK`; ``rope_fold``
    (``QUANTMLA_CUPY_V6_ROPE_FOLD``, ``auto`` (default: None, :data:`V6_ROPE_FOLD_CONTENT_BITS`), ``0`` or ``1``):
    multiply each score's RoPE part by the token's scale instead of dequantizing each RoPE value (pair builds never
    fold); ``balance`` (``QUANTMLA_CUPY_V6_BALANCE``, ``auto`` (default, :data:`V6_BALANCE`), ``0`` or ``1``): cut the
    requests into pieces so that every SM gets as many tiles, instead of equal splits per request (:func:`v6_balanced`)."""

    min_tiles: int = V2_MIN_TILES_PER_SPLIT
    pv_at: int = V6_PV_AT
    page_ahead: bool = V6_PAGE_AHEAD
    separate: bool = False
    plan_protected: bool = V6_PLAN_PROTECTED
    pair: str = "auto"
    slack: bool = V6_SLACK
    rope_fold: bool | None = None
    balance: str = V6_BALANCE

    @staticmethod
    def from_env() -> "V6Knobs":
        return V6Knobs(_env_int("QUANTMLA_CUPY_V2_MIN_TILES", V2_MIN_TILES_PER_SPLIT, (1, 2, 4, 8, 16)),
                       _env_int("QUANTMLA_CUPY_V6_PV_AT", V6_PV_AT, (1, 2, 3)),
                       bool(_env_int("QUANTMLA_CUPY_V6_PAGE_AHEAD", int(V6_PAGE_AHEAD), (0, 1))),
                       _env_choice("QUANTMLA_CUPY_V6_PROTECTED", "inline", ("inline", "separate")) == "separate",
                       bool(_env_int("QUANTMLA_CUPY_PLAN_PROTECTED", int(V6_PLAN_PROTECTED), (0, 1))),
                       _env_choice("QUANTMLA_CUPY_V6_PAIR", "auto", ("auto", "0", "1")),
                       bool(_env_int("QUANTMLA_CUPY_V6_SLACK", int(V6_SLACK), (0, 1))),
                       _env_auto_bool("QUANTMLA_CUPY_V6_ROPE_FOLD"),
                       _env_choice("QUANTMLA_CUPY_V6_BALANCE", V6_BALANCE, ("auto", "0", "1")))


def v6_plan(fmt: PackFormat, dev: int, sm_count: int, batch: int, rows: int, max_pages: int, no_prot: bool,
            knobs: V6Knobs, sink: int = 0, local: int = 0, index64: bool = True) -> SplitPlan:
    """The launch plan of kernel v6 (64 query rows per CTA, an attending and a dequantizing warpgroup):
    one launch, one partial per CTA; the sink/local tokens are the last tiles of one split per row chunk
    (``stage.cuh``'s ``qmla_protected_split``), so there is no protected-only launch (but with
    ``knobs.separate``). Equal splits per request, or a balanced plan's pieces (:func:`v6_balanced`), the
    table's build of the kernel reading each CTA's piece from a device table the plan keeps."""
    key = ("v6", fmt, dev, sm_count, batch, rows, max_pages, no_prot, knobs, sink, local, index64)
    plan = _PLANS.get(key)
    if plan is None:
        pair = v6_pairs(knobs.pair, rows)
        fold = v6_rope_fold(fmt, pair, knobs.rope_fold)
        attn, smem = _v6_kernel(fmt, dev, index64, knobs, pair, fold, False)
        # the kernel attends to the sink/local tokens itself unless knobs.separate: no protected-only launch
        own = _own_protected_tiles(no_prot, knobs, sink, local, V6_TILE)
        chunks = -(-rows // V6_ROWS)
        chunks += chunks % 2 if pair else 0
        unit_tiles = -(-(max(1, max_pages) * fmt.page_size) // V6_TILE) + own
        resident = resident_ctas(attn, V6_THREADS, smem, dev, sm_count)
        balanced = v6_balanced(fmt, knobs, pair, batch, chunks, unit_tiles, resident)
        if balanced is not None and not graph_capturing():
            # entry e: blockIdx.x / chunks (the kernel's v6_piece); int4 rows
            table = _device_table(balanced.pieces, dev)
            attn, smem = _v6_kernel(fmt, dev, index64, knobs, pair, fold, True)
            plan = SplitPlan(((attn, (len(balanced.pieces) * chunks, 1), (V6_THREADS,), smem),),
                             _combine_kernel(fmt, dev), balanced.per, balanced.slots,
                             (np.uint64(table.data_ptr()), np.int32(unit_tiles)), (table,))
            with _CACHE_LOCK:
                _PLANS[key] = plan
        else:
            # a balanced plan's table cannot be uploaded under capture: equal splits now, uncached, the table next call
            plan = _packed_split_plan(key, attn, smem, V6_THREADS, V6_TILE, 1, fmt, dev, sm_count, batch, rows,
                                      max_pages, no_prot or not knobs.separate, knobs.min_tiles, sink, local, index64,
                                      V6_CTA_OVERHEAD_TILES, rows_per_cta=V6_ROWS, own_protected_tiles=own,
                                      chunk_multiple=2 if pair else 1,
                                      extra_args=(np.uint64(0), np.int32(unit_tiles)), cache=balanced is None)
    return plan


def _v6_kernel(fmt: PackFormat, dev: int, index64: bool, knobs: V6Knobs, pair: bool, fold: bool, pieces: bool):
    """Compiled ``qmla_attn_v6`` (cached) for a call's knobs and its dynamic shared memory (:func:`v6_defines`)."""
    return _split_kernel(("v6", fmt, dev, index64, knobs.pv_at, knobs.page_ahead, knobs.separate, pair, knobs.slack,
                          fold, pieces), "v6", dev, v6_smem_bytes(fmt, pair, fold),
                         lambda: v6_defines(fmt, index64, knobs.pv_at, knobs.page_ahead, not knobs.separate, pair,
                                            knobs.slack, fold, pieces),
                         V4_WGMMA_ARCH)


def _device_table(rows: tuple, dev: int) -> torch.Tensor:
    """``rows`` (equal-length int tuples) as an int32 [len(rows), width] tensor on CUDA device ``dev``."""
    return torch.tensor(rows, dtype=torch.int32, device=torch.device("cuda", dev))


def v6_balanced(fmt: PackFormat, knobs: V6Knobs, pair: bool, batch: int, chunks: int, unit_tiles: int, resident: int
                ) -> PiecePlan | None:
    """v6's balanced plan of ``batch`` requests of ``unit_tiles`` tiles and ``chunks`` 64-row chunks each on a GPU
    running ``resident`` v6 CTAs at once, or None for equal splits per request: ``knobs.balance`` ``0``, a pair
    build or ``knobs.separate`` (their kernels take equal splits), or with ``auto`` content bits outside
    :data:`V6_BALANCE_CONTENT_BITS` or a balanced plan whose simulated schedule (:func:`plan_pieces`) is no shorter
    than the equal splits' (:func:`plan_splits_v2`'s cost)."""
    if knobs.balance == "0" or pair or knobs.separate:
        return None
    if knobs.balance == "auto" and fmt.content_bits not in V6_BALANCE_CONTENT_BITS:
        return None
    groups = max(1, resident // chunks)
    balanced = plan_pieces(batch, unit_tiles, groups, V6_CTA_OVERHEAD_TILES)
    if knobs.balance == "auto":
        splits, per = plan_splits_v2(batch, chunks, unit_tiles * V6_TILE, resident, knobs.min_tiles, V6_TILE,
                                     V6_CTA_OVERHEAD_TILES)
        if balanced.cost >= equal_splits_cost(batch * chunks * splits, per, resident, V6_CTA_OVERHEAD_TILES):
            return None
    return balanced


def _kernel_input(name: str, x: torch.Tensor, dtype: torch.dtype, capturing: bool) -> torch.Tensor:
    """``x`` as a contiguous, 16-byte aligned ``dtype`` tensor (the kernels read rows with 16-byte
    loads), without a copy when it already is one. Under CUDA-graph capture a copy would be freed
    when the call returns while the graph keeps reading it, so there the caller must pass the
    right dtype and layout."""
    aligned = x.data_ptr() % 16 == 0
    if x.dtype == dtype and x.is_contiguous() and aligned:
        return x
    if capturing:
        raise ValueError(f"{name}: under CUDA-graph capture the CuPy backend needs a contiguous, 16-byte aligned "
                         f"{dtype} tensor (a converted copy would not outlive the capture), got {x.dtype}"
                         f"{'' if x.is_contiguous() else ', non-contiguous'}{'' if aligned else ', misaligned'}")
    return x.to(dtype).contiguous() if x.dtype != dtype or not x.is_contiguous() else x.clone()


def _v1_plan(fmt: PackFormat, dtype: str, dev: int, sm_count: int, batch: int, rows: int, max_pages: int
             ) -> SplitPlan:
    """The launch plan of kernel v1 (16 query rows per CTA, every format and query dtype)."""
    row_groups = (rows + 15) // 16
    smem = attention_smem_bytes(fmt)
    defines = attention_defines(fmt, dtype)
    attn = get_kernel("attention.cu", "qmla_attn", defines, dev, smem)
    combine = get_kernel("attention.cu", "qmla_combine", defines, dev)
    resident = resident_ctas(attn, ATTN_WARPS * 32, smem, dev, sm_count)
    splits, per = plan_splits(batch, row_groups, max(1, max_pages) * fmt.page_size, resident)
    return SplitPlan(((attn, (batch * row_groups, splits), (ATTN_WARPS * 32,), smem),), combine, per, splits)


PROTECTED_STREAM_ENV = "QUANTMLA_CUPY_PROTECTED_STREAM"
_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def protected_on_side_stream(default: bool) -> bool:
    """Whether the protected-only launch runs on a second stream, concurrently with the split
    kernel (the result is bit-identical either way). ``QUANTMLA_CUPY_PROTECTED_STREAM`` (read per
    call) 1 or 0 decides; unset, ``default``: the launchers' rule is every variant under CUDA-graph
    capture, and v3/v4/v5 eager calls from :data:`V3_MIN_TOKENS` tokens of block-table capacity
    (measured, H200: up to 14 % less GPU time per call at short contexts, none at B=128 or H=128,
    but ~10-20 µs more host time per eager call, which short eager calls, host-bound, would pay)."""
    raw = _env_int(PROTECTED_STREAM_ENV, -1, (-1, 0, 1))
    return default if raw < 0 else bool(raw)


def _side_stream(dev: int) -> torch.cuda.Stream:
    """A second stream of device ``dev``, made once (one per device and process)."""
    s = _SIDE_STREAMS.get(dev)
    if s is None:
        with _CACHE_LOCK:
            s = _SIDE_STREAMS.setdefault(dev, torch.cuda.Stream(dev))
    return s


def _fork_side_stream(dev: int) -> torch.cuda.Stream:
    """The side stream of ``dev``, ordered after the work queued so far on the current stream."""
    side = _side_stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    return side


def _join_side_stream(dev: int, side: torch.cuda.Stream) -> None:
    """Order the current stream's next work after everything queued on ``side``."""
    torch.cuda.current_stream(dev).wait_stream(side)


@dataclass(frozen=True)
class SplitCall:
    """A prepared call: the split kernels (``plan.launches``: (kernel, grid, block, shared bytes);
    v1, v2 and v3 share the argument list) and the LSE combine over ``plan.slots`` partials per
    row, with the index inputs converted once (``index``: block_table, seq_lens, seq_ids, kept
    alive here) and the scalar arguments packed. A protected-only launch (the second of
    ``plan.launches``) may fork onto a second stream (:func:`protected_on_side_stream`, with
    ``side_default`` the launcher's rule outside graph capture)."""

    plan: SplitPlan
    index: tuple
    shape: tuple  # (B, S_q, H, d_c)
    out_shape: tuple  # shape of the queries and outputs: ``shape`` or, with S_q = 1, (B, H, d_c)
    scalars: tuple
    dev: int
    side_default: bool
    #: scratch of runs captured into CUDA graphs with caller-given outputs: the graphs write it on
    #: every replay, so it lives as long as this call
    graph_scratch: list = field(default_factory=list)
    #: numpy scalar types of the split kernel's parameters and of the shared list (protected-only launch)
    arg_types: tuple = ((), ())

    @staticmethod
    def make(plan: SplitPlan, cache, block_table, seq_lens, seq_ids, shape: tuple, out_shape: tuple,
             softmax_scale: float, dev: int, side_default: bool, index64: bool) -> "SplitCall":
        """seq_lens / seq_ids go in as int64, or int32 where the kernels were built with ``index64`` False."""
        capturing = graph_capturing()
        index = torch.int64 if index64 else torch.int32
        table = _kernel_input("block_table", block_table, torch.int32, capturing)
        lens = _kernel_input("seq_lens", seq_lens, index, capturing)
        ids = _kernel_input("seq_ids", seq_ids, index, capturing)
        i32 = np.int32
        scalars = (i32(shape[1]), i32(shape[2]), i32(table.shape[1]), i32(table.stride(0)), i32(cache.num_pages),
                   i32(cache.max_seqs), i32(cache.sink), i32(cache.local), i32(plan.per), i32(plan.slots),
                   np.float32(softmax_scale * LOG2E))
        types = (np.uint64,) * SPLIT_POINTERS + tuple(map(type, scalars))
        return SplitCall(plan, (table, lens, ids), shape, out_shape, scalars, dev, side_default,
                         arg_types=(types + tuple(map(type, plan.extra_args)), types))

    def run(self, q_latent, q_rope, cache, out=None, lse=None, want_lse: bool = True, capturing: bool | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q ``out_shape`` (the planned dtype) over ``cache`` (the planned geometry) -> out, lse,
        written into ``out`` / ``lse`` where given (contiguous, 16-byte aligned; checked by the
        caller for shape, dtype and device); on torch's current stream. With ``want_lse`` False and no
        ``lse`` given, the combine writes lse to the scratch and None comes back in its place.
        ``capturing``: whether a CUDA graph is being captured, where the caller has asked already."""
        if capturing is None:
            capturing = graph_capturing()
        dev, plan = self.dev, self.plan
        q = _kernel_input("q_latent", q_latent, q_latent.dtype, capturing)
        r = _kernel_input("q_rope", q_rope, q_rope.dtype, capturing)
        b, s_q, h, dc = self.shape
        rows, slots = s_q * h, plan.slots
        n_o = b * rows * slots * dc
        n_ws = n_o + b * rows * slots * 2
        if out is None and lse is None and want_lse:
            out, lse, ws = outputs_and_partials(self.out_shape, q_latent.dtype, n_ws, q_latent.device, dev, capturing)
        else:
            _check_output("out", out)
            _check_output("lse", lse)
            # an lse nobody reads goes to the scratch after the partials, 16-byte aligned as the outputs are
            n_scratch = _lse_offset(n_ws) + (b * rows if lse is None and not want_lse else 0)
            if capturing:
                ws = torch.empty(n_scratch, dtype=torch.float32, device=q_latent.device)
                self.graph_scratch.append(ws)
            else:
                ws = _workspace(dev, n_scratch)
            if out is None:
                out = torch.empty(self.out_shape, dtype=q_latent.dtype, device=q_latent.device)
            if lse is None and want_lse:
                lse = torch.empty(self.out_shape[:-1], dtype=torch.float32, device=q_latent.device)
        # pointers as Python ints: the launches pack them by the parameter types made once in ``make``
        o_ptr = ws.data_ptr()
        ml_ptr = o_ptr + 4 * n_o
        lse_ptr = lse.data_ptr() if lse is not None else o_ptr + 4 * _lse_offset(n_ws)
        table, lens, ids = self.index
        args = (q.data_ptr(), r.data_ptr(), cache.pages.data_ptr(), cache.sink_buf.data_ptr(),
                cache.local_buf.data_ptr(), table.data_ptr(), lens.data_ptr(), ids.data_ptr(),
                o_ptr, ml_ptr) + self.scalars
        split_types, types = self.arg_types
        stream = external_stream(dev)
        launches = plan.launches
        split_args = args + plan.extra_args
        side = None
        if len(launches) > 1 and protected_on_side_stream(self.side_default or capturing):
            # fork: the protected-only launch runs beside the split kernel (captured as a parallel
            # branch under CUDA graphs); the combine waits for both
            side = _fork_side_stream(dev)
            for fn, grid, block, smem in launches[1:]:
                launch(fn, grid, block, args, dev, smem, stream=external_stream(dev, side), types=types)
            launches = launches[:1]
        fn, grid, block, smem = launches[0]
        launch(fn, grid, block, split_args, dev, smem, stream=stream, types=split_types)
        for fn, grid, block, smem in launches[1:]:
            launch(fn, grid, block, args, dev, smem, stream=stream, types=types)
        if side is not None:
            _join_side_stream(dev, side)
        launch(plan.combine, (b * rows,), (COMBINE_THREADS,), (o_ptr, ml_ptr, out.data_ptr(), lse_ptr, slots),
               dev, stream=stream, types=COMBINE_TYPES)
        return out, lse


def _lse_offset(partial_floats: int) -> int:
    """Where in the scratch (float32 elements) an unwanted lse goes: after ``partial_floats``, 16-byte aligned."""
    return -(-partial_floats // 4) * 4


def _check_output(name: str, x) -> None:
    """A caller-given output the combine can write: contiguous and 16-byte aligned (or None)."""
    if x is not None and not (x.is_contiguous() and x.data_ptr() % 16 == 0):
        raise ValueError(f"{name}: the CuPy backend writes contiguous, 16-byte aligned outputs, got "
                         f"{'a non-contiguous' if not x.is_contiguous() else 'a misaligned'} tensor")
