"""The wave-aware split planner shared by the GPU launchers (backends/splits.py)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from quantmla_core.backends.splits import CTA_OVERHEAD_TILES, plan_kv_splits, rounds, search_limit


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

