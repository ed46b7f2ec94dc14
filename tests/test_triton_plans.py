"""The Triton launch plans of the default kernel v2 at the PERFORMANCE.md shapes (pure functions; no GPU needed).

The numbers pinned here are the ones RESULTS.md reasons from (stop 45: H16 B8 L4K runs 32 splits of two 64-token tiles
on 256 programs); a change to the heuristics has to change them here, visibly.
"""

from __future__ import annotations

import pytest

from quantmla_core.backends.triton import heuristics as hz

H200_SMS = 132


@pytest.mark.parametrize("batch,rows,dc,tokens,row_blocks,splits", [
    (8, 16, 512, 4096, 1, 32),     # H16 B8 L4K: 32 x 2 tiles, 256 programs at two a SM
    (32, 16, 512, 32768, 1, 8),    # H16 B32 L32K: 256 programs of 64 tiles
    (8, 128, 512, 4096, 8, 4),     # H128 B8 L4K: 16 rows a program, 8 row blocks
    (4, 64, 256, 1000, 2, 8),      # d_c 256: 32 rows a program
    (1, 16, 512, 64, 1, 1),        # one tile: one split
])
def test_v2_plans_at_known_shapes(batch, rows, dc, tokens, row_blocks, splits):
    p = hz.plan_v2(batch, rows, dc, 64, tokens, H200_SMS)
    assert (p.block_n, p.block_r, p.row_blocks, p.num_splits) == (64, 64 * 128 // dc, row_blocks, splits)
    assert (p.num_warps, p.num_stages, p.protect_warps, p.protect_block_t) == (4, 1, hz.PROTECT_WARPS, 16)


@pytest.mark.parametrize("batch", [1, 8, 32, 128, 1024])
@pytest.mark.parametrize("tokens", [64, 4096, 32768, 131072, 1 << 20])
def test_v2_splits_keep_two_tiles_a_split(batch, tokens):
    p = hz.plan_v2(batch, 16, 512, 64, tokens, H200_SMS)
    tiles = -(-tokens // 64)
    assert 1 <= p.num_splits <= hz.MAX_SPLITS
    assert p.num_splits == 1 or tiles // p.num_splits >= hz.V2_MIN_TILES_PER_SPLIT
    assert p.row_blocks == 1 and p.block_r == 16


def test_interpreter_plans_allow_one_tile_splits():
    assert hz.plan_v2(2, 16, 512, 64, 256, 4, interpreter=True).num_splits == 4
    assert hz.plan_v2(2, 16, 512, 64, 256, 4).num_splits <= 2
    assert hz.plan_v2(2, 16, 512, 64, 256, 4, num_splits=3).num_splits == 3
