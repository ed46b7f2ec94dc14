"""The Triton launcher's eager host path on the CPU with the kernels stubbed
(``quantmla_core.testing.stub_triton_launcher``): eager calls reuse their prepared call (``attention.prepared``)
only while nothing it was made from changed -- the index tensors (by identity, shape, strides), the cache geometry,
the query shape, dtype and scale, ``num_splits``, ``variant`` and the ``QUANTMLA_*`` variables ``prepare`` read --
and never under CUDA-graph capture or with ``overrides``."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import quantmla_core as qm
from quantmla_core.backends.triton import attention as A
from quantmla_core.testing import stub_triton_launcher

B, H, PAGES = 3, 16, 8
FMT = qm.PackFormat.parse("C4R4")
CACHE = qm.MLACache.allocate(FMT, B * PAGES, B, 4, 128, device="cpu")


def _index():
    table = torch.arange(B * PAGES, dtype=torch.int32).view(B, PAGES)
    return table, torch.full((B,), 300, dtype=torch.int32), torch.arange(B, dtype=torch.int32)


class Stubbed(NamedTuple):
    launches: list  # (kernel name, grid, args, kwargs) of every launch
    made: list  # one entry per ``prepare`` call


@pytest.fixture
def stubbed(monkeypatch) -> Stubbed:
    """The launcher stubbed, with its kept calls emptied and ``prepare`` calls recorded."""
    launches = stub_triton_launcher(monkeypatch)
    monkeypatch.delenv(A.VARIANT_ENV, raising=False)
    monkeypatch.setattr(A, "_PREPARED", {})
    rec = Stubbed(launches, [])
    real_prepare = A.prepare
    monkeypatch.setattr(A, "prepare", lambda *a, **k: rec.made.append(a) or real_prepare(*a, **k))
    return rec


def _call(table, lens, ids, s_q=1, scale=0.05, cache=CACHE, **kw):
    q = torch.randn((B, s_q, H, 512)).bfloat16()
    r = torch.randn((B, s_q, H, 64)).bfloat16()
    return A.attention(q, r, cache, table, lens, ids, scale, **kw)


def test_same_index_tensors_reuse_the_call_and_see_new_values(stubbed):
    launches, made = stubbed.launches, stubbed.made
    table, lens, ids = _index()
    _call(table, lens, ids)
    first = list(launches)
    launches.clear()
    lens += 7  # in place, as a decode loop advances its lengths
    _call(table, lens, ids)
    assert len(made) == 1, "the second call prepared again"
    assert [(name, grid) for name, grid, _a, _k in launches] == [(name, grid) for name, grid, _a, _k in first]
    split_args = next(args for name, _grid, args, _kw in launches if name.startswith("split"))
    assert split_args[3] is table and split_args[4] is lens  # the caller's tensors: values changed in place are read


def test_other_tensors_geometry_shapes_scale_or_splits_prepare_again(stubbed):
    made = stubbed.made
    table, lens, ids = _index()
    _call(table, lens, ids)
    _call(table.clone(), lens, ids)  # equal values, another tensor
    _call(table, lens, ids, s_q=2)
    _call(table, lens, ids, scale=0.07)
    _call(table[:, :4], lens, ids)  # another shape of a view
    _call(table, lens, ids, num_splits=2)
    _call(table, lens, ids, variant="v1")
    _call(table, lens, ids, cache=qm.MLACache.allocate(FMT, B * PAGES + 1, B, 4, 128, device="cpu"))
    _call(table, lens, ids, cache=qm.MLACache.allocate(FMT, B * PAGES, B, 4, 128, device="cpu",
                                                       protect_dtype=torch.float32))
    assert len(made) == 9
    _call(table, lens, ids, cache=qm.MLACache.allocate(FMT, B * PAGES, B, 4, 128, device="cpu"))
    assert len(made) == 9, "another cache of the same geometry prepared again"


def test_a_knob_prepare_read_changes_the_call(stubbed, monkeypatch):
    launches, made = stubbed.launches, stubbed.made
    table, lens, ids = _index()
    monkeypatch.setenv(A.VARIANT_ENV, "v1")
    _call(table, lens, ids)
    assert A.LAST_LAUNCH["variant"] == "v1" and "split_kernel" in [name for name, *_ in launches]
    monkeypatch.setenv(A.VARIANT_ENV, "v2")
    _call(table, lens, ids)
    assert len(made) == 2 and A.LAST_LAUNCH["variant"] == "v2"
    monkeypatch.setenv("QUANTMLA_TEST_UNREAD_KNOB", "1")  # a variable prepare never read
    _call(table, lens, ids)
    assert len(made) == 2
    monkeypatch.setenv(A.VARIANT_ENV, "v1")
    _call(table, lens, ids)  # the v2 call took the key's entry
    _call(table, lens, ids, variant="v2")  # another key
    assert len(made) == 4 and A.LAST_LAUNCH["variant"] == "v2"
    _call(table, lens, ids)  # reused: the records name the call that ran
    assert len(made) == 4 and A.LAST_LAUNCH["variant"] == "v1" and A.LAST_LAUNCH["plan"].num_splits >= 1
    monkeypatch.setenv(A.VARIANT_ENV, "v9")
    with pytest.raises(ValueError, match=A.VARIANT_ENV):
        _call(table, lens, ids)


def test_calls_under_graph_capture_or_with_overrides_are_prepared_afresh(stubbed, monkeypatch):
    made = stubbed.made
    table, lens, ids = _index()
    _call(table, lens, ids)
    _call(table, lens, ids, overrides={"block_n": 32})
    _call(table, lens, ids, overrides={"block_n": 32})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    _call(table, lens, ids)
    _call(table, lens, ids)
    assert len(made) == 5 and len(A._PREPARED) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels need a CUDA GPU (the tests above stub them)")
def test_reused_calls_match_fresh_ones_on_the_gpu():
    """On the GPU, eager calls that reuse a kept call give a freshly prepared call's outputs bit for bit, also after
    the lengths advanced in place (the kept call reads the caller's tensors)."""
    from quantmla_core.testing import Case, write_case

    case = Case(qm.PackFormat.parse("C4R4"), (700, 2100, 90), heads=128, sink=4, local=128, seed=61)
    batch, args, cache = write_case(case, "cuda", "bfloat16")
    table, lens, ids = args["block_table"], args["attn_seq_lens"], args["attn_seq_ids"]
    q, r = args["q_latent"], args["q_rope"]

    def fresh():
        call = A.prepare(cache, table, lens, ids, len(case.lens), q.shape[1], case.heads, q.dtype,
                         batch.softmax_scale)
        return call.run(q, r, cache)

    for step in range(3):
        if step:
            lens -= 1  # in place: fewer tokens attended (both calls read the same), as the reused call must see
        got = A.attention(q, r, cache, table, lens, ids, batch.softmax_scale)
        want = fresh()
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
