"""The CuPy launcher's host path, on the CPU with the CUDA calls stubbed
(``quantmla_core.testing.stub_cupy_launcher``):

* eager calls reuse their prepared call (``attention.prepared``) only while nothing it was made from
  changed: the index tensors (by identity, shape, strides), the cache geometry, the query shape, dtype
  and scale, and the ``QUANTMLA_*`` variables it read;
* [B, H, d] queries launch as their [B, 1, H, d] views do;
* calls that drop lse (``want_lse=False``, what ``return_lse=False`` passes) have the combine write it
  to the scratch, after the partials, and allocate only ``out`` (or nothing, with ``out=`` given)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
import torch

import quantmla_core as qm
from quantmla_core.backends.cupy import CupyBackend
from quantmla_core.backends.cupy import attention as A
from quantmla_core.backends.cupy.variants import VARIANT_ENV
from quantmla_core.plan import AttentionPlan
from quantmla_core.testing import stub_cupy_launcher

B, H, PAGES = 3, 16, 8


FMT = qm.PackFormat.parse("C4R4")
Cache = qm.MLACache.allocate(FMT, B * PAGES, B, 4, 128, device="cpu")


def _index(dtype=torch.int32):
    table = torch.arange(B * PAGES, dtype=torch.int32).view(B, PAGES)
    return table, torch.full((B,), 300, dtype=dtype), torch.arange(B, dtype=dtype)


class Stubbed(NamedTuple):
    launches: list  # the recorded launches (kernel, grid, block, args, shared bytes)
    made: list  # one entry per ``prepare`` call
    scratch: list  # the workspaces handed out
    empties: list  # the shapes of every torch.empty


@pytest.fixture
def stubbed(monkeypatch) -> Stubbed:
    """The launcher stubbed, with ``prepare`` calls, workspaces and allocations recorded."""
    _kernels, launches = stub_cupy_launcher(monkeypatch)
    monkeypatch.delenv(VARIANT_ENV, raising=False)
    rec = Stubbed(launches, [], [], [])
    real_prepare, real_empty = A.prepare, torch.empty
    monkeypatch.setattr(A, "prepare", lambda *a, **k: rec.made.append(a) or real_prepare(*a, **k))
    monkeypatch.setattr(A, "_workspace", lambda dev, n: rec.scratch.append(real_empty(n)) or rec.scratch[-1])
    monkeypatch.setattr(torch, "empty", lambda *a, **k: rec.empties.append(a) or real_empty(*a, **k))
    return rec


def _call(table, lens, ids, s_q=1, scale=0.05, cache=Cache):
    q = torch.randn((B, s_q, H, 512)).bfloat16()
    r = torch.randn((B, s_q, H, 64)).bfloat16()
    return A.attention(q, r, cache, table, lens, ids, scale)


def _ptr(launch, i):
    return int(launch[3][i])


def test_same_index_tensors_reuse_the_call_and_see_new_values(stubbed):
    launches, made = stubbed.launches, stubbed.made
    table, lens, ids = _index()
    _call(table, lens, ids)
    first = list(launches)
    launches.clear()
    lens += 7  # in place, as a decode loop advances its lengths
    table[0, 0] = 5
    _call(table, lens, ids)
    assert len(made) == 1, "the second call prepared again"
    assert len(launches) == len(first)
    # the kernels get the caller's tensors themselves (arguments 5-7: table, seq_lens, seq_ids), so they read
    # the values changed in place
    for (got, want) in zip(launches, first):
        assert got[0] is want[0] and got[1] == want[1]
    assert [_ptr(launches[0], i) for i in (5, 6, 7)] == [table.data_ptr(), lens.data_ptr(), ids.data_ptr()]


def test_other_tensors_geometry_shapes_or_scale_prepare_again(stubbed):
    made = stubbed.made
    table, lens, ids = _index()
    _call(table, lens, ids)
    _call(table.clone(), lens, ids)  # equal values, another tensor
    _call(table, lens, ids, s_q=2)
    _call(table, lens, ids, scale=0.07)
    _call(table[:, :4], lens, ids)  # another shape of a view

    _call(table, lens, ids, cache=qm.MLACache.allocate(FMT, B * PAGES + 1, B, 4, 128, device="cpu"))
    assert len(made) == 6
    _call(table, lens, ids)
    assert len(made) == 6, "the first call's entry was dropped"


def test_a_knob_prepare_read_changes_the_call(stubbed, monkeypatch):
    launches, made = stubbed.launches, stubbed.made
    table, lens, ids = _index()
    monkeypatch.setenv(VARIANT_ENV, "v2")
    _call(table, lens, ids)
    assert launches[0][0].kernel == "qmla_attn_v2"
    launches.clear()
    monkeypatch.setenv(VARIANT_ENV, "v5")
    _call(table, lens, ids)
    assert len(made) == 2 and launches[0][0].kernel == "qmla_attn_v5"
    launches.clear()
    monkeypatch.setenv("QUANTMLA_TEST_UNREAD_KNOB", "1")  # a variable prepare never read
    _call(table, lens, ids)
    assert len(made) == 2 and launches[0][0].kernel == "qmla_attn_v5"
    monkeypatch.setenv(VARIANT_ENV, "v9")
    with pytest.raises(ValueError, match=VARIANT_ENV):
        _call(table, lens, ids)


def test_converted_index_tensors_are_not_kept(stubbed):
    launches, made = stubbed.launches, stubbed.made
    table, lens, ids = _index()
    wide = table.long()  # converted to int32 by every call: the copy holds this call's values
    _call(wide, lens, ids)
    _call(wide, lens, ids)
    assert len(made) == 2 and not A._PREPARED
    wide[1, 2] = 9
    launches.clear()
    _call(wide, lens, ids)
    assert len(made) == 3


def test_calls_under_graph_capture_are_prepared_afresh(stubbed, monkeypatch):
    made = stubbed.made
    table, lens, ids = _index()
    _call(table, lens, ids)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    _call(table, lens, ids)
    _call(table, lens, ids)
    assert len(made) == 3 and len(A._PREPARED) == 1


def test_kept_calls_are_bounded(stubbed, monkeypatch):
    made = stubbed.made
    monkeypatch.setattr(A, "PREPARED_KEEP", 4)
    kept = [_index() for _ in range(6)]
    for args in kept:
        _call(*args)
    assert len(A._PREPARED) == 4
    _call(*kept[-1])
    _call(*kept[0])  # dropped first
    assert len(made) == 7


def test_three_d_queries_launch_as_four_d_ones(stubbed):
    """[B, H, d] queries go to the kernels as they are: the same grids, blocks and scalar arguments as
    [B, 1, H, d] views of them, and results shaped [B, H, d_c] / [B, H]."""
    launches = stubbed.launches
    table, lens, ids = _index()
    q = torch.randn((B, H, 512)).bfloat16()
    r = torch.randn((B, H, 64)).bfloat16()
    out, lse = A.attention(q, r, Cache, table, lens, ids, 0.05)
    assert out.shape == (B, H, 512) and out.dtype == torch.bfloat16 and lse.shape == (B, H)

    def shape_of(log):
        return [(rec[0], rec[1], rec[2], [a for a in rec[3] if not isinstance(a, np.uint64)]) for rec in log]

    three = shape_of(launches)
    launches.clear()
    out4, lse4 = A.attention(q[:, None], r[:, None], Cache, table, lens, ids, 0.05)
    assert out4.shape == (B, 1, H, 512) and lse4.shape == (B, 1, H)
    assert shape_of(launches) == three and _ptr(launches[0], 0) == q.data_ptr()


def _queries():
    return torch.randn((B, H, 512)).bfloat16(), torch.randn((B, H, 64)).bfloat16()


def _combine_lse_pointer(launches) -> int:
    (fn, _grid, _block, args, _smem) = launches[-1]
    assert fn.kernel == "qmla_combine"
    return int(args[3])


def test_unwanted_lse_goes_to_the_scratch(stubbed):
    launches, scratch, empties = stubbed.launches, stubbed.scratch, stubbed.empties
    q, r = _queries()
    out, lse = A.attention(q, r, Cache, *_index(), 0.05, want_lse=False)
    assert lse is None and out.shape == (B, H, 512)
    assert empties == [((B, H, 512),)], empties  # out only
    ws = scratch[-1]
    ptr = _combine_lse_pointer(launches)
    offset = (ptr - ws.data_ptr()) // 4
    assert ptr % 16 == ws.data_ptr() % 16 and offset % 4 == 0
    slots = int(launches[-1][3][4])
    assert offset >= B * H * slots * (512 + 2)  # after the partial outputs and row statistics
    assert offset + B * H <= ws.numel()  # one float per row inside the scratch


def test_wanted_lse_is_a_tensor_of_its_own(stubbed):
    launches = stubbed.launches
    q, r = _queries()
    out, lse = A.attention(q, r, Cache, *_index(), 0.05)
    assert lse.shape == (B, H) and _combine_lse_pointer(launches) == lse.data_ptr()


def test_plan_run_without_lse_allocates_nothing_into_given_outputs(stubbed):
    launches, scratch, empties = stubbed.launches, stubbed.scratch, stubbed.empties
    table, lens, ids = _index()
    runner = CupyBackend().plan_attention(Cache, table, lens, ids, (B, H, 512), torch.bfloat16, 0.05)
    plan = AttentionPlan(Cache, runner, "cupy", (B, H, 512), torch.bfloat16, validate=False)
    q, r = _queries()
    o = torch.zeros((B, H, 512), dtype=torch.bfloat16)
    empties.clear()
    got = plan.run(q, r, out=o, return_lse=False)
    assert got is o and empties == []
    ws = scratch[-1]
    assert ws.data_ptr() <= _combine_lse_pointer(launches) < ws.data_ptr() + 4 * ws.numel()
    out, lse = plan.run(q, r)
    assert lse.shape == (B, H) and _combine_lse_pointer(launches) == lse.data_ptr()


def test_call_owned_scratch_keeps_nothing(stubbed):
    """Within ``buffers.call_owned_scratch`` (what ``torch.ops.quantmla.attention`` runs in): no reused workspace, no
    kept prepared call; out, lse and the partials share the outputs' one allocation (a plan's given-outputs path
    allocates its scratch afresh); outside it the workspace and the kept call come back."""
    from quantmla_core.backends.buffers import call_owned_scratch, nothing_kept

    made, scratch = stubbed.made, stubbed.scratch
    table, lens, ids = _index()
    assert not nothing_kept()
    with call_owned_scratch():
        assert nothing_kept()
        for _ in range(2):
            stubbed.launches.clear()
            out, lse = _call(table, lens, ids)
            assert out.untyped_storage().data_ptr() == lse.untyped_storage().data_ptr()
            partials = int(stubbed.launches[0][3][8])  # the split kernel's partial outputs pointer
            base = out.untyped_storage().data_ptr()
            assert base <= partials < base + out.untyped_storage().nbytes()
        runner = CupyBackend().plan_attention(Cache, table, lens, ids, (B, 1, H, 512), torch.bfloat16, 0.05)
        q, r = _queries()
        runner(q[:, None], r[:, None], Cache, torch.empty((B, 1, H, 512), dtype=torch.bfloat16), None)
    assert not nothing_kept()
    assert len(made) == 3 and not A._PREPARED and scratch == []
    _call(table, lens, ids)
    assert len(A._PREPARED) == 1 and len(scratch) == 1


@pytest.mark.parametrize("variant", ["v2", "v3", "v4", "v5", "v6"])
def test_split_launch_scalars_name_the_call(stubbed, monkeypatch, variant):
    """After its ten pointers every split kernel gets S_q, H, the block table's width and row stride, the cache's
    pages, request rows, sink and local, the plan's tiles per split and partial slots, and the softmax scale in log2
    units: the values of this call, in this order."""
    monkeypatch.setenv(VARIANT_ENV, variant)
    table, lens, ids = _index()
    _call(table, lens, ids, s_q=4, scale=0.0625)
    split = stubbed.launches[0]
    assert split[0].kernel == f"qmla_attn_{variant}"
    scalars = split[3][A.SPLIT_POINTERS:A.SPLIT_POINTERS + 11]
    assert [int(x) for x in scalars[:8]] == [4, H, PAGES, PAGES, B * PAGES, B, 4, 128]
    assert all(type(x) is np.int32 for x in scalars[:10])
    assert int(scalars[8]) >= 1 and int(scalars[9]) >= 1
    assert scalars[10] == np.float32(0.0625 * A.LOG2E)
