"""Eager CuPy calls reuse their prepared call (``attention.prepared``) only while nothing it was
made from changed: the index tensors (by identity, shape, strides), the cache geometry, the query
shape, dtype and scale, and the ``QUANTMLA_*`` variables it read. Run on the CPU with the CUDA
calls stubbed (``quantmla_core.testing.stub_cupy_launcher``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import quantmla_core as qm
from quantmla_core.backends.cupy import attention as A
from quantmla_core.testing import stub_cupy_launcher

B, H, PAGES = 3, 16, 8


class Cache:
    format = qm.PackFormat.parse("C4R4")
    pages = torch.zeros((B * PAGES, format.page_bytes), dtype=torch.uint8)
    sink_buf = torch.zeros((B, 4, 576), dtype=torch.bfloat16)
    local_buf = torch.zeros((B, 128, 576), dtype=torch.bfloat16)
    num_pages, max_seqs, sink, local = B * PAGES, B, 4, 128


def _index(dtype=torch.int32):
    table = torch.arange(B * PAGES, dtype=torch.int32).view(B, PAGES)
    return table, torch.full((B,), 300, dtype=dtype), torch.arange(B, dtype=dtype)


@pytest.fixture
def stubbed(monkeypatch):
    """(launch log, list of prepare calls) with the launcher stubbed and ``prepare`` counted."""
    _kernels, launches = stub_cupy_launcher(monkeypatch)
    monkeypatch.delenv(A.VARIANT_ENV, raising=False)
    made = []
    real = A.prepare
    monkeypatch.setattr(A, "prepare", lambda *a, **k: made.append(a) or real(*a, **k))
    return launches, made


def _call(table, lens, ids, s_q=1, scale=0.05, cache=Cache):
    q = torch.randn((B, s_q, H, 512)).bfloat16()
    r = torch.randn((B, s_q, H, 64)).bfloat16()
    return A.attention(q, r, cache, table, lens, ids, scale)


def _ptr(launch, i):
    return int(launch[3][i])


def test_same_index_tensors_reuse_the_call_and_see_new_values(stubbed):
    launches, made = stubbed
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
    _launches, made = stubbed
    table, lens, ids = _index()
    _call(table, lens, ids)
    _call(table.clone(), lens, ids)  # equal values, another tensor
    _call(table, lens, ids, s_q=2)
    _call(table, lens, ids, scale=0.07)
    _call(table[:, :4], lens, ids)  # another shape of a view

    class Bigger(Cache):
        pages = torch.zeros((B * PAGES + 1, Cache.format.page_bytes), dtype=torch.uint8)
        num_pages = B * PAGES + 1

    _call(table, lens, ids, cache=Bigger)
    assert len(made) == 6
    _call(table, lens, ids)
    assert len(made) == 6, "the first call's entry was dropped"


def test_a_knob_prepare_read_changes_the_call(stubbed, monkeypatch):
    launches, made = stubbed
    table, lens, ids = _index()
    monkeypatch.setenv(A.VARIANT_ENV, "v2")
    _call(table, lens, ids)
    assert launches[0][0].kernel == "qmla_attn_v2"
    launches.clear()
    monkeypatch.setenv(A.VARIANT_ENV, "v5")
    _call(table, lens, ids)
    assert len(made) == 2 and launches[0][0].kernel == "qmla_attn_v5"
    launches.clear()
    monkeypatch.setenv("QUANTMLA_TEST_UNREAD_KNOB", "1")  # a variable prepare never read
    _call(table, lens, ids)
    assert len(made) == 2 and launches[0][0].kernel == "qmla_attn_v5"
    monkeypatch.setenv(A.VARIANT_ENV, "v9")
    with pytest.raises(ValueError, match=A.VARIANT_ENV):
        _call(table, lens, ids)


def test_converted_index_tensors_are_not_kept(stubbed):
    launches, made = stubbed
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
    _launches, made = stubbed
    table, lens, ids = _index()
    _call(table, lens, ids)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    _call(table, lens, ids)
    _call(table, lens, ids)
    assert len(made) == 3 and len(A._PREPARED) == 1


def test_kept_calls_are_bounded(stubbed, monkeypatch):
    _launches, made = stubbed
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
    launches, _made = stubbed
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


@pytest.mark.parametrize("takes_3d", [False, True])
def test_api_hands_three_d_queries_to_backends_that_take_them(monkeypatch, takes_3d):
    import quantmla_core.api as api

    cache = qm.MLACache.allocate(qm.PackFormat.parse("C4R4"), B * PAGES, B, 4, 128, device="cpu")
    seen = []

    class Impl:
        takes_3d_queries = takes_3d

        @staticmethod
        def attention(q, r, *rest):
            seen.append((tuple(q.shape), tuple(r.shape)))
            return torch.zeros(q.shape), torch.zeros(q.shape[:-1])

    monkeypatch.setattr(api, "select_backend", lambda problem, backend: Impl)
    table, lens, ids = _index()
    q, r = torch.randn((B, H, 512)), torch.randn((B, H, 64))
    out, lse = qm.attention(q, r, cache, block_table=table, seq_lens=lens, seq_ids=ids, softmax_scale=0.1,
                            validate=False)
    assert out.shape == (B, H, 512) and lse.shape == (B, H)
    assert seen == [((B, H, 512), (B, H, 64))] if takes_3d else [((B, 1, H, 512), (B, 1, H, 64))]
