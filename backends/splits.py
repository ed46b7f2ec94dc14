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
import math

#: fixed work of one CTA in tile-times: loading its query fragments, filling a 3-4 tile copy
#: pipeline before the first tile computes, and a 16 x 512 float32 partial (32 KB) written and
#: read back by the combine -- about one tile of a 32-64-token C4R4 loop.
CTA_OVERHEAD_TILES = 1.0


def rounds(ctas: int, resident: int) -> int:
    """Rounds a launch of ``ctas`` equal CTAs takes when ``resident`` fit on the GPU at once."""
    return max(1, math.ceil(ctas / max(1, resident)))


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
        cost = rounds(base_ctas * s_eff, resident) * (per + overhead_tiles)
        if best is None or cost < best[0] - 1e-9:
            best = (cost, s_eff)
    s = best[1]
    return s, math.ceil(tiles / s)
