"""Launch plans of the CuPy attention kernels: the compiled split kernels (cached per build), their grids and
wave-planned split counts (``backends/splits.py``), the protected-only launch and the combine, cached per problem
shape and knobs so that steady-state decode reuses them."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace

import numpy as np
import torch

from ...formats import PackFormat
from ...host_copy import to_device
from ..buffers import nothing_kept
from ..splits import CTA_OVERHEAD_TILES, PiecePlan, equal_splits_cost, plan_kv_splits, plan_pieces
from . import ATTN_TILE, ATTN_WARPS, function_ptr, get_kernel, nvrtc_version, resident_ctas
from .builds import (
    CODES_IN_PLACE,
    PROTECTED_WARPS,
    V2_TILE,
    V2_WARPS,
    V3_TILE,
    V3_WARPS,
    V4_ROWS,
    V4_TILE,
    V4_WARPS,
    V4_WGMMA_ARCH,
    V5_HALVES,
    V5_PACKED_GROUPS,
    V5_TILE,
    V5_WORKERS,
    V6_MERGE_MAX_SPLITS,
    V6_ROWS,
    V6_THREADS,
    V6_TILE,
    attention_defines,
    attention_smem_bytes,
    protected_ctas,
    protected_defines,
    protected_smem_bytes,
    smem_per_block,
    v2_defines,
    v2_smem_bytes,
    v3_defines,
    v3_smem_bytes,
    v4_defines,
    v4_smem_bytes,
    v4_uses_wgmma,
    v5_build_reasons,
    v5_workers,
    v5_defines,
    v5_smem_bytes,
    v5_zfold,
    v6_defines,
    v6_pairs,
    v6_rope_fold,
    v6_smem_bytes,
)
from .clusters import max_active_clusters
from .knobs import V2Knobs, V2_MIN_TILES_PER_SPLIT, V3Knobs, V4Knobs, V5Knobs, V6Knobs

#: v5's fixed work per CTA in tile-times for the split planner (two workers filling their pipelines,
#: two partials written and read back by the combine). Measured on the H200 (CUDA graphs, H16, stop 20):
#: with 1 (v2/v3's value) B32 L128K split 41 ways and took 1,004.9 us (C4R4); with 2, 4 ways, 890.8 us
#: (C2R4 869.6 -> 756.8, B8 L128K 263.1 -> 249.2); 4 planned the same as 2, and B64 L64K did not move
V5_CTA_OVERHEAD_TILES = 2.0

#: v4 attends to the protected tiles in its own launch (one more CTA per tile and row chunk) when its
#: splits hold at least this many tiles; they then run beside the long packed CTAs. With shorter
#: splits they would form a second wave: H200, H128 C4R4 (CUDA graphs), B8 L4K (8 tiles per split)
#: 80.9 us in-grid vs 72.6 with protected.cu; B32 L32K (256 tiles) 1192.7 vs 1223.9-1235.0
V4_INGRID_MIN_TILES = 64

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


_LOCK = threading.Lock()
_SM_COUNT: dict[int, tuple[int, tuple[int, int]]] = {}
_FNS: dict[tuple, object] = {}
_PLANS: dict[tuple, object] = {}


def device_info(dev: int) -> tuple[int, tuple[int, int]]:
    """(SM count, compute capability) of device ``dev``, queried once."""
    info = _SM_COUNT.get(dev)
    if info is None:
        props = torch.cuda.get_device_properties(dev)
        info = (int(props.multi_processor_count), (int(props.major), int(props.minor)))
        with _LOCK:
            _SM_COUNT[dev] = info
    return info


def plan_splits(batch: int, row_groups: int, max_tokens: int, resident: int) -> tuple[int, int]:
    """(num_splits, tiles_per_split) for v1: ``batch * row_groups * num_splits`` CTAs in whole
    rounds of the ``resident`` CTAs the GPU holds at once (``backends/splits.py``).

    ``max_tokens`` is the block table's capacity (max_pages * P), so planning needs no sync."""
    return plan_kv_splits(batch * row_groups, math.ceil(max(1, max_tokens) / ATTN_TILE), resident)


def plan_splits_v2(batch: int, chunks: int, max_tokens: int, resident: int,
                   min_tiles: int = V2_MIN_TILES_PER_SPLIT, tile: int = V2_TILE,
                   overhead_tiles: float = CTA_OVERHEAD_TILES) -> tuple[int, int]:
    """(num_splits, tiles_per_split) for v2, as :func:`plan_splits`, but never splitting below
    ``min_tiles`` 32-token tiles (:data:`~.knobs.V2_MIN_TILES_PER_SPLIT`: small batches were paying for
    many tiny splits plus a combine that reads them all). ``tile``: the kernel's tokens per tile;
    the result counts those tiles."""
    tiles = math.ceil(max(1, max_tokens) / tile)
    return plan_kv_splits(batch * chunks, tiles, resident, max(1, min_tiles * V2_TILE // tile), None, overhead_tiles)


@dataclass(frozen=True)
class SplitPlan:
    """Everything a split-kernel call launches for one problem shape: split kernels (kernel, grid,
    block, shared bytes), the combine (None where the split kernel writes the output itself), tiles per
    split and partial slots per row."""

    launches: tuple
    combine: object | None
    per: int
    slots: int
    #: arguments the split kernel (the first launch) takes after the shared list: v6's (piece table, tiles per request)
    extra_args: tuple = ()
    #: what the launches read and the plan keeps alive: v6's piece table (a device tensor)
    keep: tuple = ()
    #: whether the split kernel's parameters end with the output and lse pointers (v6)
    out_args: bool = False


def _split_kernel(key: tuple, variant: str, dev: int, smem: int, defines, arch: str | None = None) -> tuple:
    """(compiled ``qmla_attn_<variant>`` of ``kernels/attention_<variant>.cu``, its dynamic shared
    memory), cached under ``key``; ``defines`` is called only to build it; ``arch``: see
    :func:`~quantmla_core.backends.cupy.get_kernel`."""
    fn = _FNS.get(key)
    if fn is None:
        fn = (get_kernel(f"attention_{variant}.cu", f"qmla_attn_{variant}", defines(), dev, smem, arch), smem)
        with _LOCK:
            _FNS[key] = fn
    return fn


def _combine_kernel(fmt: PackFormat, dev: int):
    key = ("combine", fmt, dev)
    fn = _FNS.get(key)
    if fn is None:
        fn = get_kernel("attention.cu", "qmla_combine", attention_defines(fmt, "bfloat16"), dev)
        with _LOCK:
            _FNS[key] = fn
    return fn


def _protected_launch(fmt: PackFormat, dev: int, batch: int, rows: int, sink: int, local: int,
                      index64: bool = True) -> tuple:
    """(kernel, grid, block, shared bytes) of the protected-only launch (``kernels/protected.cu``):
    the sink and local-window tokens as :func:`~.builds.protected_ctas` more partials per 16-row chunk, one
    32-token tile per CTA."""
    key = ("protected", fmt.latent_dim, fmt.rope_dim, dev, index64)
    fn = _FNS.get(key)
    if fn is None:
        smem = protected_smem_bytes(fmt)
        fn = (get_kernel("protected.cu", "qmla_attn_protected", protected_defines(fmt, index64), dev, smem), smem)
        with _LOCK:
            _FNS[key] = fn
    kernel, smem = fn
    return kernel, (batch * ((rows + 15) // 16), protected_ctas(sink, local)), (PROTECTED_WARPS * 32,), smem


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
        with _LOCK:
            _PLANS[key] = plan
    return plan


def _own_protected_tiles(no_prot: bool, knobs: "V5Knobs | V6Knobs", sink: int, local: int, tile: int) -> int:
    """The sink/local tiles a kernel that attends to them itself (v5, v6 without ``knobs.separate``) has its
    split plan count (``knobs.plan_protected``): :func:`~.builds.protected_ctas` of its ``tile``, else 0."""
    return 0 if no_prot or knobs.separate or not knobs.plan_protected else protected_ctas(sink, local, tile)


def v1_plan(fmt: PackFormat, dtype: str, dev: int, sm_count: int, batch: int, rows: int, max_pages: int
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


def _v2_kernel(fmt: PackFormat, dev: int, rg: int, minb: int, stages: int, lazy: bool, no_prot: bool, mode: int,
               tile: int = V2_TILE, index64: bool = True):
    """Compiled ``qmla_attn_v2`` for one set of defines (cached) and its dynamic shared memory."""
    return _split_kernel(("v2", fmt, dev, rg, minb, stages, lazy, no_prot, mode, tile, index64), "v2", dev,
                         v2_smem_bytes(fmt, rg, stages, tile),
                         lambda: v2_defines(fmt, rg, minb, stages, lazy, no_prot, mode, tile, index64))


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
        with _LOCK:
            _PLANS[key] = plan
    return plan


def _v3_kernel(fmt: PackFormat, dev: int, stages: int, minb: int | None, lazy: bool = True, warps: int = V3_WARPS,
               index64: bool = True):
    """Compiled ``qmla_attn_v3`` (cached) and its dynamic shared memory."""
    return _split_kernel(("v3", fmt, dev, stages, minb, lazy, warps, index64), "v3", dev,
                         v3_smem_bytes(fmt, stages, warps),
                         lambda: v3_defines(fmt, stages, minb, lazy, warps, index64))


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


def _v4_kernel(fmt: PackFormat, dev: int, stages: int, lazy: bool, index64: bool, protected: bool,
               wgmma: bool = False):
    """Compiled ``qmla_attn_v4`` (cached) and its dynamic shared memory."""
    return _split_kernel(("v4", fmt, dev, stages, lazy, index64, protected, wgmma), "v4", dev,
                         v4_smem_bytes(fmt, stages, wgmma), lambda: v4_defines(fmt, stages, lazy, index64, protected, wgmma),
                         V4_WGMMA_ARCH if wgmma else None)


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
        capability = device_info(dev)[1]
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
        with _LOCK:
            _PLANS[key] = plan
    return plan


def _v5_kernel(fmt: PackFormat, dev: int, lazy: bool, index64: bool, workers: int = V5_WORKERS,
               protected: bool = True, prot_vec: bool = True, codes_in_place: bool = CODES_IN_PLACE,
               rope_fold: bool | None = None, quad_loads: bool | None = None,
               packed_groups: bool = V5_PACKED_GROUPS, halves: int = V5_HALVES, zfold: bool | None = None,
               probe: int = 0):
    """Compiled ``qmla_attn_v5`` (cached, an sm_90a build) and its dynamic shared memory."""
    zf = v5_zfold(fmt, workers, halves, zfold, quad_loads, packed_groups)
    return _split_kernel(("v5", fmt, dev, lazy, index64, workers, protected, prot_vec, codes_in_place, rope_fold,
                          quad_loads, packed_groups, halves, zf, probe), "v5", dev,
                         v5_smem_bytes(fmt, workers, halves, zf),
                         lambda: v5_defines(fmt, lazy, index64, workers, protected, prot_vec, codes_in_place, rope_fold,
                                            quad_loads, packed_groups, halves, zf, probe),
                         V4_WGMMA_ARCH)


def v5_plan(fmt: PackFormat, dev: int, sm_count: int, batch: int, rows: int, max_pages: int, no_prot: bool,
            knobs: V5Knobs, sink: int = 0, local: int = 0, index64: bool = True) -> SplitPlan:
    """The launch plan of kernel v5 (16 query rows per CTA, two worker warpgroups): one launch, each CTA
    writing one partial per worker; the sink/local tokens are the last tiles of one split per row chunk
    (``stage.cuh``'s ``qmla_protected_split``), so there is no protected-only launch (but with
    ``knobs.separate``)."""
    knobs = replace(knobs, workers=v5_workers(fmt, batch, max_pages * fmt.page_size, knobs.workers))
    key = ("v5", fmt, dev, sm_count, batch, rows, max_pages, no_prot, knobs, sink, local, index64)
    plan = _PLANS.get(key)
    if plan is None:
        reasons = v5_build_reasons(fmt, knobs.workers, knobs.halves)
        if reasons:
            raise ValueError(f"QUANTMLA_CUPY_V5_WORKERS={knobs.workers} / QUANTMLA_CUPY_V5_HALVES={knobs.halves} cannot "
                             f"serve this call: {'; '.join(reasons)}")
        attn, smem = _v5_kernel(fmt, dev, knobs.lazy, index64, knobs.workers, not knobs.separate, knobs.prot_vec,
                                knobs.codes_in_place, knobs.rope_fold, knobs.quad_loads, knobs.packed_groups,
                                knobs.halves, knobs.zfold, knobs.probe)
        own = _own_protected_tiles(no_prot, knobs, sink, local, V5_TILE)
        threads = knobs.workers * knobs.halves * 128  # one partial per worker, whatever its warpgroups
        plan = _packed_split_plan(key, attn, smem, threads, V5_TILE, knobs.workers, fmt, dev, sm_count, batch,
                                  rows, max_pages, no_prot or not knobs.separate, knobs.min_tiles, sink, local, index64,
                                  V5_CTA_OVERHEAD_TILES, own_protected_tiles=own)
    return plan


def _v6_kernel(fmt: PackFormat, dev: int, index64: bool, knobs: V6Knobs, pair: bool, fold: bool, pieces: bool,
               merge: int = 0):
    """Compiled ``qmla_attn_v6`` (cached) for a call's knobs and its dynamic shared memory (:func:`~.builds.v6_defines`)."""
    return _split_kernel(("v6", fmt, dev, index64, knobs.pv_at, knobs.page_ahead, knobs.separate, pair, knobs.slack,
                          fold, pieces, merge), "v6", dev, v6_smem_bytes(fmt, pair, fold),
                         lambda: v6_defines(fmt, index64, knobs.pv_at, knobs.page_ahead, not knobs.separate, pair,
                                            knobs.slack, fold, pieces, merge),
                         V4_WGMMA_ARCH)


def v6_merge_reason(splits: int, units: int, resident: int, active_clusters: int | None) -> str | None:
    """Why the ``splits`` CTAs of each of ``units`` row chunks cannot run as one cluster that merges their partials
    (None: they can). A single split needs no cluster; more than :data:`~.builds.V6_MERGE_MAX_SPLITS` exceed a portable
    cluster; ``active_clusters`` (the driver's count of such clusters at once, None where it cannot say) must hold
    the grid in as many waves as ``resident`` single CTAs would."""
    if splits == 1:
        return None
    if splits > V6_MERGE_MAX_SPLITS:
        return f"{splits} splits a row chunk, more than a cluster of {V6_MERGE_MAX_SPLITS} CTAs"
    if active_clusters is None:
        return "the driver cannot say how many clusters run at once (cuOccupancyMaxActiveClusters)"
    if active_clusters < 1:
        return f"no cluster of {splits} v6 CTAs fits this GPU"
    waves, cluster_waves = -(-units * splits // resident), -(-units // active_clusters)
    if cluster_waves > waves:
        return (f"{units} clusters of {splits} CTAs take {cluster_waves} waves ({active_clusters} at once), "
                f"the CTAs alone {waves}")
    return None


def _v6_merged(plan: SplitPlan, fmt: PackFormat, dev: int, index64: bool, knobs: V6Knobs, fold: bool,
               resident: int) -> SplitPlan:
    """``plan`` (v6's equal splits) as clusters that merge each row chunk's splits and write the output
    (:func:`v6_merge_reason`), or ``plan`` itself where ``knobs.merge`` is ``0`` or, with ``auto``, there is a
    reason against it; ``1`` with a reason raises ValueError with it."""
    (_attn, grid, block, smem), = plan.launches
    units, splits = grid
    if knobs.merge == "0":
        return plan
    attn = active = None
    if splits <= V6_MERGE_MAX_SPLITS:  # the merging build and the driver's count of its clusters
        attn, smem = _v6_kernel(fmt, dev, index64, knobs, False, fold, False, splits)
        if splits > 1:
            active = max_active_clusters(function_ptr(attn), (1, splits, 1), block[0], smem, dev)
    reason = v6_merge_reason(splits, units, resident, active)
    if reason is not None:
        if knobs.merge == "1":
            raise ValueError(f"QUANTMLA_CUPY_V6_MERGE=1: v6 cannot merge this call's splits in clusters: {reason}")
        return plan
    return replace(plan, launches=((attn, grid, block, smem),), combine=None)


def _device_table(rows: tuple, dev: int) -> torch.Tensor:
    """``rows`` (equal-length int tuples) as an int32 [len(rows), width] tensor on CUDA device ``dev`` (copied
    without a stream sync)."""
    return to_device(torch.tensor(rows, dtype=torch.int32), torch.device("cuda", dev))


def v6_balanced(fmt: PackFormat, knobs: V6Knobs, pair: bool, batch: int, chunks: int, unit_tiles: int, resident: int
                ) -> PiecePlan | None:
    """v6's balanced plan of ``batch`` requests of ``unit_tiles`` tiles and ``chunks`` 64-row chunks each on a GPU
    running ``resident`` v6 CTAs at once, or None for equal splits per request: ``knobs.balance`` ``0``, a pair
    build or ``knobs.separate`` (their kernels take equal splits), or with ``auto`` content bits outside
    :data:`V6_BALANCE_CONTENT_BITS` or a balanced plan whose simulated schedule (:func:`plan_pieces`) is no shorter
    than the equal splits' (:func:`plan_splits_v2`'s cost)."""
    if knobs.balance == "0" or pair or knobs.separate or knobs.merge == "1":
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
        if knobs.merge == "1" and (pair or knobs.separate or knobs.balance == "1"):
            raise ValueError("QUANTMLA_CUPY_V6_MERGE=1 merges equal splits in clusters of one kernel: it cannot run "
                             f"with pairs ({pair}), the protected-only launch (QUANTMLA_CUPY_V6_PROTECTED=separate: "
                             f"{knobs.separate}) or a balanced plan (QUANTMLA_CUPY_V6_BALANCE=1: "
                             f"{knobs.balance == '1'})")
        fold = v6_rope_fold(fmt, pair, knobs.rope_fold)
        attn, smem = _v6_kernel(fmt, dev, index64, knobs, pair, fold, False)
        # the kernel attends to the sink/local tokens itself unless knobs.separate: no protected-only launch
        own = _own_protected_tiles(no_prot, knobs, sink, local, V6_TILE)
        chunks = -(-rows // V6_ROWS)
        chunks += chunks % 2 if pair else 0
        unit_tiles = -(-(max(1, max_pages) * fmt.page_size) // V6_TILE) + own
        resident = resident_ctas(attn, V6_THREADS, smem, dev, sm_count)
        balanced = v6_balanced(fmt, knobs, pair, batch, chunks, unit_tiles, resident)
        if balanced is not None and not nothing_kept():
            # entry e: blockIdx.x / chunks (the kernel's v6_piece); int4 rows
            table = _device_table(balanced.pieces, dev)
            attn, smem = _v6_kernel(fmt, dev, index64, knobs, pair, fold, True)
            plan = SplitPlan(((attn, (len(balanced.pieces) * chunks, 1), (V6_THREADS,), smem),),
                             _combine_kernel(fmt, dev), balanced.per, balanced.slots,
                             (np.uint64(table.data_ptr()), np.int32(unit_tiles)), (table,), out_args=True)
        else:
            # a balanced plan's table cannot be uploaded under capture (nor kept for a torch.compile operator's CUDA
            # graphs): equal splits now, uncached, the table next call
            plan = _packed_split_plan(key, attn, smem, V6_THREADS, V6_TILE, 1, fmt, dev, sm_count, batch, rows,
                                      max_pages, no_prot or not knobs.separate, knobs.min_tiles, sink, local, index64,
                                      V6_CTA_OVERHEAD_TILES, rows_per_cta=V6_ROWS, own_protected_tiles=own,
                                      chunk_multiple=2 if pair else 1,
                                      extra_args=(np.uint64(0), np.int32(unit_tiles)), cache=False)
            plan = replace(plan, out_args=True)
            if not pair and not knobs.separate:
                plan = _v6_merged(plan, fmt, dev, index64, knobs, fold, resident)
        if balanced is None or plan.keep:
            with _LOCK:
                _PLANS[key] = plan
    return plan
