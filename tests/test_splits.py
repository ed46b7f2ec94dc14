"""The wave-aware split planner shared by the GPU launchers (backends/splits.py)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from quantmla_core.backends.splits import CTA_OVERHEAD_TILES, list_schedule, plan_kv_splits, plan_pieces, rounds, search_limit


def test_rounds():
    assert rounds(264, 264) == 1 and rounds(265, 264) == 2 and rounds(0, 264) == 1


@pytest.mark.parametrize("base,tiles,resident,want", [
    (32, 1024, 264, 8),    # H=16 B=32 L=32K, 2 CTAs/SM: 256 CTAs in one round (9 splits = 288 = 2 rounds)
    (128, 1024, 264, 2),   # B=128: 256 CTAs
    (128, 1024, 132, 1),   # H=128 at 1 CTA/SM: already one full round
    (1, 1, 264, 1),
])
def test_known_plans(base, tiles, resident, want):
    assert plan_kv_splits(base, tiles, resident)[0] == want


@given(st.integers(1, 512), st.integers(1, 40000), st.integers(1, 600), st.integers(1, 16))
def test_plan_is_valid_and_never_worse_than_no_split(base, tiles, resident, min_tiles):
    s, per = plan_kv_splits(base, tiles, resident, min_tiles)
    assert s >= 1 and per >= 1
    assert (s - 1) * per < tiles <= s * per  # every split non-empty, all tiles covered
    assert s == 1 or per >= min_tiles
    def cost(n: int) -> float:
        pn = math.ceil(tiles / n)
        return rounds(base * math.ceil(tiles / pn), resident) * (pn + CTA_OVERHEAD_TILES)

    # the plan is the model's optimum among a few natural candidates (no split, one full round, ...)
    for t in (1, 2, max(1, resident // base), max(1, math.ceil(resident / base)), s + 1, 2 * s):
        if t <= min(max(1, tiles // min_tiles), search_limit(base, resident)):
            assert cost(s) <= cost(t) + 1e-9


def test_overhead_tiles_steers_away_from_many_small_splits():
    """A kernel whose CTAs cost more besides their tiles (v5: two workers, two partials each) gets fewer,
    longer splits: B32 L128K of 64-token tiles on 132 resident CTAs splits 41 ways at v2's overhead of
    one tile (10 rounds of 50 tiles, marginally cheaper than 1 round of 512) but 4 ways at two tiles
    (measured on the H200: 1,004.9 -> 890.8 us for v5 C4R4, benchmarks/RESULTS.md stop 20)."""
    assert plan_kv_splits(32, 2048, 132, 2) == (41, 50)
    assert plan_kv_splits(32, 2048, 132, 2, None, 2.0) == (4, 512)
    assert plan_kv_splits(32, 512, 132, 2, None, 2.0) == plan_kv_splits(32, 512, 132, 2)  # L32K unchanged



def test_ties_prefer_fewer_splits():
    # 2 requests, 4 tiles, 2 CTAs resident, no overhead: 1, 2 and 4 splits all cost 4 tile-times
    assert plan_kv_splits(2, 4, 2, overhead_tiles=0.0) == (1, 4)


def test_list_schedule():
    """Jobs go, in order, to whichever worker frees first."""
    assert list_schedule([3, 3, 2, 2, 2], 2) == 7.0  # 3 | 3, then 5 | 5, then 7 | 5
    assert list_schedule([4, 1, 1, 1, 1], 2) == 4.0
    assert list_schedule([1, 1, 4], 2) == 5.0  # the long job last waits for a free worker
    assert list_schedule([], 3) == 0.0


@given(st.integers(1, 40), st.integers(1, 3000), st.integers(1, 140))
def test_pieces_cover_every_tile_once(requests, unit_tiles, groups):
    """plan_pieces: each request's pieces partition [0, unit_tiles), numbered 0.. in token order with the last
    flagged; at most ``slots`` per request; launched longest first; the schedule no shorter than a perfect share."""
    plan = plan_pieces(requests, unit_tiles, groups)
    by_request: dict[int, list] = {}
    for b, lo, hi, word in plan.pieces:
        assert 0 <= lo < hi <= unit_tiles and hi - lo <= plan.per
        by_request.setdefault(b, []).append((lo, hi, word & 0xFFFF, word >> 16))
    assert sorted(by_request) == list(range(requests))
    for parts in by_request.values():
        parts.sort()
        assert [p[2] for p in parts] == list(range(len(parts))) and len(parts) <= plan.slots
        assert parts[0][0] == 0 and parts[-1][1] == unit_tiles and [p[3] for p in parts] == [0] * (len(parts) - 1) + [1]
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    assert plan.slots == max(len(p) for p in by_request.values())
    lengths = [hi - lo for _b, lo, hi, _w in plan.pieces]
    assert lengths == sorted(lengths, reverse=True)
    assert plan.cost >= requests * unit_tiles / groups


@pytest.mark.parametrize("requests,unit_tiles,groups,makespan", [
    (32, 512, 66, 251.0),     # H128 B32 L32K on 132 SMs (66 pairs of row chunks): equal splits take 256 + 1
    (32, 2048, 66, 995.0),    # B32 L128K: 993 tiles a run, two pieces where a run crosses a request
    (8, 512, 66, 64.0),
])
def test_known_piece_plans(requests, unit_tiles, groups, makespan):
    assert plan_pieces(requests, unit_tiles, groups).cost == makespan
