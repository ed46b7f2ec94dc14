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


@pytest.mark.parametrize("batch,tokens,row_blocks,splits", [
    (8, 4096, 2, 8),          # H128 B8 L4K: 16 programs of 32 tiles, 8 splits of 4 (one program a SM)
    (32, 32768, 2, 2),        # H128 B32 L32K: 64 programs, two splits fill 128 of 132 SMs
    (128, 131072, 2, 18),     # H128 B128 L128K: 256 programs, 18 splits of 57 tiles
])
def test_v3_plans_at_known_shapes(batch, tokens, row_blocks, splits):
    """Kernel v3 (64 query rows a program, 128-token tiles, one program a SM) at H = 128."""
    p = hz.plan_v3(batch, 128, 512, 64, tokens, H200_SMS)
    assert (p.block_n, p.block_r, p.row_blocks, p.num_splits) == (128, 64, row_blocks, splits)
    assert (p.num_warps, p.num_stages) == (hz.V3_NUM_WARPS, hz.V3_NUM_STAGES)
    tiles = -(-tokens // 128)
    assert splits == 1 or tiles // splits >= hz.V3_MIN_TILES_PER_SPLIT


@pytest.mark.parametrize("fp32,block_n,stages,splits_b32", [(False, 32, 2, 8), (True, 16, 1, 41)])
def test_v1_plans_at_known_shapes(fp32, block_n, stages, splits_b32):
    """Kernel v1 (float32 queries on a GPU, bf16 pages): 32-token tiles, 16 for IEEE float32 dots, one stage."""
    p = hz.plan(8, 16, 512, 64, 4096, H200_SMS, fp32_dot=fp32)
    assert (p.block_n, p.block_r, p.row_blocks, p.num_splits, p.num_stages) == (block_n, 16, 1, 32, stages)
    assert hz.plan(32, 16, 512, 64, 32768, H200_SMS, fp32_dot=fp32).num_splits == splits_b32
    assert hz.plan(8, 128, 512, 64, 4096, H200_SMS, fp32_dot=fp32).row_blocks == 8
    # the interpreter has no IEEE float32 tile limit
    assert hz.plan(8, 16, 512, 64, 4096, H200_SMS, interpreter=True, fp32_dot=True).block_n == 32


def test_v1_plan_rows_and_splits_follow_the_latent_width_and_the_sm_count():
    """d_c 256 holds 32 rows a program in 64 accumulator registers a thread; splits fill CTAS_PER_SM x SMs."""
    p = hz.plan(4, 64, 256, 64, 1000, H200_SMS)
    assert (p.block_r, p.row_blocks, p.num_splits) == (32, 2, 8)
    assert hz.plan(128, 16, 512, 64, 32768, H200_SMS).num_splits == 2  # 128 requests: two splits fill 2 x 132 programs
    assert hz.plan(128, 16, 512, 64, 32768, 66).num_splits == 1  # half the SMs: the requests fill them alone
    for planner in (hz.plan, hz.plan_v2, hz.plan_v3):  # an empty table still plans one tile and one split
        assert planner(1, 64, 512, 64, 0, H200_SMS).num_splits == 1


def test_device_limits_fit_a_build_at_exactly_the_limit():
    lim = hz.DeviceLimits(shared=1000, tmem=256)
    assert lim.excess((1000, 256)) is None
    assert lim.excess((1001, 256)) == "needs 1001 B of shared memory a block, this GPU gives 1000 B"
    assert lim.excess((1000, 257)) == "needs 257 columns of tensor memory, an SM has 256"
    assert hz.DeviceLimits().excess((1 << 30, 1 << 20)) is None  # nothing known: nothing to check
    assert lim.checked and not hz.DeviceLimits().checked


def test_v1_plan_at_h128_splits_by_requests_times_row_blocks():
    """H128 B8 L4K on kernel v1: 8 row blocks of 16 rows, so 64 programs before splitting; four splits fill the
    SMs (the split count follows B x row blocks, not B alone)."""
    p = hz.plan(8, 128, 512, 64, 4096, H200_SMS)
    assert (p.row_blocks, p.num_splits) == (8, 4)


@pytest.mark.parametrize("planner,block_n", [(hz.plan, 32), (hz.plan_v2, 64), (hz.plan_v3, 128)])
def test_one_tile_is_one_split_even_in_the_interpreter(planner, block_n):
    """The interpreter splits down to one tile a split: a table of one tile still runs one split, one more token
    two."""
    assert planner(1, 64, 512, 64, block_n, 4, interpreter=True).block_n == block_n
    assert planner(1, 64, 512, 64, block_n, 4, interpreter=True).num_splits == 1
    assert planner(1, 64, 512, 64, block_n + 1, 4, interpreter=True).num_splits == 2


def test_planned_shared_bound_covers_the_design_dims_only():
    """The plans' shared-memory bound holds up to d_c 512 and d_r 64 (DESIGN.md's dims, 256 / 32 included); wider
    vectors have no bound, so every GPU checks their builds."""
    assert hz.planned_shared_max(512, 64) == hz.planned_shared_max(256, 32) == hz.PLANNED_SHARED_MAX
    assert hz.planned_shared_max(513, 64) is None and hz.planned_shared_max(512, 65) is None
    assert hz.planned_shared_max(1024, 64) is None


def test_protect_parts_of_a_lone_program():
    """One request of at most 64 rows: one program a part. With 4 slots, 9 tiles go as 3 parts of 3 (one wave of 3
    tile-times), not 9 parts of 1 (three waves: the same time, more partials); no tile, no part."""
    assert hz.protect_parts(9, 1, 4) == (3, 3)
    assert hz.protect_parts(9, 0, 4) == (3, 3)  # no programs counts as one
    assert hz.protect_parts(1, 8, 132) == (1, 1) and hz.protect_parts(0, 8, 132) == (0, 0)
