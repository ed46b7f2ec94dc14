"""Wave-aware split-KV planning shared by the GPU attention launchers (CuPy, Triton).

Flash-decoding splits each request's tokens into ``num_splits`` equal shares, one CTA each.
All CTAs of a launch do the same amount of work, so a launch of ``n`` CTAs on a GPU that holds
``resident`` of them at once takes ``ceil(n / resident)`` *rounds*, each as long as one CTA's
share. Asking for "two waves" rounds badly: on an H200 holding 2 CTAs/SM (264), B = 32 with 9
splits is 288 CTAs, i.e. 2 rounds of which the second is 9 % full -- the kernel then runs at
~55 % of the GPU (measured: the split count alone moved C4R4 H=16 B=32 from 1.06 ms).

Cost model (in tile-times of one CTA): ``rounds(s) * (ceil(tiles / s) + CTA_OVERHEAD_TILES)``,
the overhead being what every CTA pays besides its tiles (query fragments, filling the copy
pipeline, writing a partial that the combine reads back). :func:`plan_kv_splits`
returns the cheapest ``s`` within ``[1, max_splits]`` that keeps ``min_tiles`` tiles per split,
preferring fewer splits on ties.
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass

#: fixed work of one CTA in tile-times: loading its query fragments, filling a 3-4 tile copy
#: pipeline before the first tile computes, and a 16 x 512 float32 partial (32 KB) written and
#: read back by the combine -- about one tile of a 32-64-token C4R4 loop.
CTA_OVERHEAD_TILES = 1.0


def rounds(ctas: int, resident: int) -> int:
    """Rounds a launch of ``ctas`` equal CTAs takes when ``resident`` fit on the GPU at once."""
    return max(1, math.ceil(ctas / max(1, resident)))


def equal_splits_cost(ctas: int, per: int, resident: int, overhead_tiles: float = CTA_OVERHEAD_TILES) -> float:
    """Tile-times of a launch of ``ctas`` equal CTAs of ``per`` tiles each plus ``overhead_tiles`` of fixed work, in
    whole rounds of the ``resident`` CTAs the GPU holds at once."""
    return rounds(ctas, resident) * (per + overhead_tiles)


def search_limit(base_ctas: int, resident: int) -> int:
    """Largest split count worth trying: k rounds cost about ``tiles*base/resident + k`` tile-times,
    so past a few rounds more splits only add overhead (64 keeps the rounding effects of small
    grids in reach)."""
    return max(64, 4 * math.ceil(max(1, resident) / max(1, base_ctas)))


@functools.lru_cache(maxsize=4096)
def plan_kv_splits(base_ctas: int, tiles: int, resident: int, min_tiles: int = 1,
                   max_splits: int | None = None, overhead_tiles: float = CTA_OVERHEAD_TILES) -> tuple[int, int]:
    """(num_splits, tiles_per_split) for ``base_ctas`` = batch x row-blocks CTAs per split over
    ``tiles`` KV tiles per request, on a GPU that runs ``resident`` CTAs at once; ``overhead_tiles``:
    the fixed work of one CTA in tile-times (a kernel whose CTAs write more partials pays more).

    Every split has ``tiles_per_split`` tiles except possibly the last; ``num_splits`` is the
    number of non-empty splits (``ceil(tiles / tiles_per_split)``)."""
    base_ctas, tiles = max(1, base_ctas), max(1, tiles)
    cap = max(1, tiles // max(1, min_tiles))
    if max_splits is not None:
        cap = min(cap, max(1, max_splits))
    cap = min(cap, search_limit(base_ctas, resident))
    best: tuple[float, int] | None = None
    for s in range(1, cap + 1):
        per = math.ceil(tiles / s)
        s_eff = math.ceil(tiles / per)
        cost = equal_splits_cost(base_ctas * s_eff, per, resident, overhead_tiles)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, s_eff)
    s = best[1]
    return s, math.ceil(tiles / s)


@dataclass(frozen=True)
class PiecePlan:
    """A balanced plan: ``pieces`` (request, first tile, end tile, slot | last << 16) in launch order, ``last`` set on a
    request's last piece; ``per``: the tiles of one run; ``slots``: the most pieces of one request (the partials
    per row the combine reads); ``cost``: the simulated makespan in tile-times."""

    pieces: tuple[tuple[int, int, int, int], ...]
    per: int
    slots: int
    cost: float


def list_schedule(lengths: list[float], workers: int) -> float:
    """Makespan of jobs of ``lengths`` handed in order to whichever of ``workers`` frees first (how the GPU hands
    out the CTAs of a launch, in block order, as SMs free up)."""
    heap = [0.0] * max(1, workers)
    for t in lengths:
        heapq.heappush(heap, heapq.heappop(heap) + t)
    return max(heap)


@functools.lru_cache(maxsize=1024)
def plan_pieces(requests: int, unit_tiles: int, groups: int,
                overhead_tiles: float = CTA_OVERHEAD_TILES) -> PiecePlan:
    """The balanced plan of ``requests`` x ``unit_tiles`` tiles on a GPU running ``groups`` CTA groups at once (a
    group: the CTAs of one request's row chunks, side by side). The requests' tiles, laid end to end, are cut into
    ``groups`` runs of ``per`` tiles, each run into its requests' pieces; the pieces launch longest first, so that the
    GPU handing them to SMs as they free up ends every SM at about the same time (the cost: that schedule, each piece
    paying ``overhead_tiles``).

    Equal splits per request leave SMs idle when requests x splits is not a multiple of the SMs (H200, 132 SMs,
    H128 B32: 32 x 2 row chunks x 2 splits = 128 CTAs) or, with many rounds, pay a CTA's fixed work and a partial per
    short split (B32 L128K: 35 splits); FlashMLA plans its splits across requests for the same reason."""
    requests, unit_tiles, groups = max(1, requests), max(1, unit_tiles), max(1, groups)
    total = requests * unit_tiles
    per = -(-total // groups)
    cut: list[tuple[int, int, int]] = []
    for v0 in range(0, total, per):
        v1 = min(v0 + per, total)
        for b in range(v0 // unit_tiles, -(-v1 // unit_tiles)):
            cut.append((b, max(v0 - b * unit_tiles, 0), min(v1 - b * unit_tiles, unit_tiles)))
    count: dict[int, int] = {}
    pieces = []
    for b, lo, hi in cut:  # request order: slots count a request's pieces
        slot = count.get(b, 0)
        count[b] = slot + 1
        pieces.append((b, lo, hi, slot | (int(hi == unit_tiles) << 16)))
    pieces.sort(key=lambda p: p[1] - p[2])  # longest first (stable)
    cost = list_schedule([p[2] - p[1] + overhead_tiles for p in pieces], groups)
    return PiecePlan(tuple(pieces), per, max(count.values()), cost)
