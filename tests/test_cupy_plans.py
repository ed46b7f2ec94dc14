"""The CuPy launch plans of kernels v1 and v4 (host arithmetic only), on the CPU with compilation stubbed
(``quantmla_core.testing.stub_cupy_launcher``: an sm_90 with 132 SMs holding two CTAs each).

v1 runs 16 query rows a CTA over 32-token tiles, every format and query dtype; v4 runs 64 rows a CTA over bf16 pages
and adds the sink and local tokens either to its own grid (one CTA a protected 64-token tile, where the splits are
long enough to hide them) or as the protected-only launch of v2/v3. Their plans decide grids and partial slots that
the combine reads, so a wrong number here is a wrong answer on the GPU."""

from __future__ import annotations

import pytest

import quantmla_core as qm
from quantmla_core.backends.cupy import ATTN_TILE, ATTN_WARPS
from quantmla_core.backends.cupy import plans as P
from quantmla_core.backends.cupy.builds import V4_ROWS, V4_TILE, V4_WARPS, protected_ctas
from quantmla_core.backends.cupy.knobs import V4Knobs
from quantmla_core.backends.splits import plan_kv_splits
from quantmla_core.testing import stub_cupy_launcher

SMS = 132
RESIDENT = 2 * SMS  # what the stub's resident_ctas gives


@pytest.fixture
def kernels(monkeypatch):
    return stub_cupy_launcher(monkeypatch, sm_count=SMS)[0]


@pytest.mark.parametrize("fmt,dtype", [("C4R4", "bfloat16"), ("C8R8", "float32"), ("BF16", "bfloat16")])
@pytest.mark.parametrize("batch,rows,pages", [(8, 16, 64), (3, 40, 5), (1, 128, 2048)])
def test_v1_plan_grid_and_slots(kernels, fmt, dtype, batch, rows, pages):
    f = qm.PackFormat.parse(fmt)
    plan = P.v1_plan(f, dtype, 0, SMS, batch, rows, pages)
    groups = -(-rows // 16)
    splits, per = plan_kv_splits(batch * groups, -(-pages * f.page_size // ATTN_TILE), RESIDENT)
    (attn, grid, block, smem), = plan.launches
    assert (grid, block, plan.per, plan.slots) == ((batch * groups, splits), (ATTN_WARPS * 32,), per, splits)
    assert (attn.source, attn.kernel, plan.combine.kernel) == ("attention.cu", "qmla_attn", "qmla_combine")
    assert splits * per * ATTN_TILE >= pages * f.page_size  # the splits cover the table


def _v4(batch, rows, pages, no_prot, sink=4, local=128, knobs=V4Knobs()):
    return P.v4_plan(qm.PackFormat.parse("BF16"), 0, SMS, batch, rows, pages, no_prot, knobs, sink, local)


def test_v4_adds_protected_tiles_to_its_grid_where_the_splits_are_long(kernels):
    plan = _v4(256, 128, 2048, False)  # 128K tokens of 256 requests: long splits
    assert plan.per >= P.V4_INGRID_MIN_TILES
    (attn, grid, block, _), = plan.launches  # one launch: the protected tiles are CTAs of the split kernel
    nprot = protected_ctas(4, 128, V4_TILE)
    splits = plan.slots - nprot
    assert grid == (512, splits + nprot) and block == (V4_WARPS * 32,)
    assert nprot == 1 + 3  # the sink's tile, every tile the ring can touch
    assert splits * plan.per * V4_TILE >= 2048 * 64
    assert attn.defines["QMLA_V4_PROTECTED"] == 1  # the build whose last CTAs attend to the protected tiles


def test_v4_uses_the_protected_launch_where_the_splits_are_short(kernels):
    plan = _v4(8, 128, 64, False)  # 4K tokens of eight requests: short splits
    assert plan.per < P.V4_INGRID_MIN_TILES
    (attn, grid, _, _), (prot, pgrid, pblock, _) = plan.launches
    splits = grid[1]
    assert grid[0] == 8 * (128 // V4_ROWS) and prot.kernel == "qmla_attn_protected"
    assert attn.defines["QMLA_V4_PROTECTED"] == 0
    assert pgrid == (8 * (128 // 16), protected_ctas(4, 128)) and plan.slots == splits + protected_ctas(4, 128)


def test_v4_without_protected_tokens_launches_the_splits_alone(kernels):
    plan = _v4(8, 16, 64, True)
    (attn, grid, _, _), = plan.launches
    assert grid == (8, plan.slots)  # 16 rows still take one 64-row chunk
    assert attn.defines["QMLA_V4_PROTECTED"] == 0


def test_v4_refuses_stages_the_gpu_cannot_hold(kernels, monkeypatch):
    monkeypatch.setattr(P, "smem_per_block", lambda capability: 1000)
    with pytest.raises(ValueError, match=r"QUANTMLA_CUPY_V4_STAGES: 2 stages need \d+ B of shared memory for BF16 "
                                         r"d_c=512, this GPU allows 1000"):
        _v4(1, 64, 8, True, knobs=V4Knobs(stages=2))
