"""Calls that drop lse (``return_lse=False``) let the backend skip allocating it: the API and
``plan.run`` pass ``want_lse=False``; the CuPy launcher then has its combine write lse to the
scratch, after the partials, and allocates only ``out`` (or nothing, with ``out=`` given).
CUDA calls stubbed (``quantmla_core.testing.stub_cupy_launcher``)."""

from __future__ import annotations

import pytest
import torch

import quantmla_core as qm
from quantmla_core.backends.cupy import CupyBackend
from quantmla_core.backends.cupy import attention as A
from quantmla_core.plan import AttentionPlan
from quantmla_core.testing import stub_cupy_launcher

B, H, PAGES = 3, 16, 8
FMT = qm.PackFormat.parse("C4R4")


class Cache:
    format = FMT
    pages = torch.zeros((B * PAGES, FMT.page_bytes), dtype=torch.uint8)
    sink_buf = torch.zeros((B, 4, 576), dtype=torch.bfloat16)
    local_buf = torch.zeros((B, 128, 576), dtype=torch.bfloat16)
    num_pages, max_seqs, sink, local, device, is_numpy = B * PAGES, B, 4, 128, torch.device("cpu"), False


@pytest.fixture
def stubbed(monkeypatch):
    """(launch log, scratch tensors handed out, number of torch.empty calls) with the launcher stubbed."""
    _kernels, launches = stub_cupy_launcher(monkeypatch)
    monkeypatch.delenv(A.VARIANT_ENV, raising=False)
    scratch = []
    real_empty = torch.empty
    monkeypatch.setattr(A, "_workspace", lambda dev, n: scratch.append(real_empty(n)) or scratch[-1])
    empties = []
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empties.append(a) or real_empty(*a, **k))
    return launches, scratch, empties


def _index():
    table = torch.arange(B * PAGES, dtype=torch.int32).view(B, PAGES)
    return table, torch.full((B,), 300, dtype=torch.int32), torch.arange(B, dtype=torch.int32)


def _queries():
    return torch.randn((B, H, 512)).bfloat16(), torch.randn((B, H, 64)).bfloat16()


def _combine_lse_pointer(launches) -> int:
    (fn, _grid, _block, args, _smem) = launches[-1]
    assert fn.kernel == "qmla_combine"
    return int(args[3])


def test_unwanted_lse_goes_to_the_scratch(stubbed):
    launches, scratch, empties = stubbed
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
    launches, scratch, empties = stubbed
    q, r = _queries()
    out, lse = A.attention(q, r, Cache, *_index(), 0.05)
    assert lse.shape == (B, H) and _combine_lse_pointer(launches) == lse.data_ptr()


def test_plan_run_without_lse_allocates_nothing_into_given_outputs(stubbed):
    launches, scratch, empties = stubbed
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


@pytest.mark.parametrize("return_lse", [True, False])
def test_api_tells_the_backend(monkeypatch, return_lse):
    import quantmla_core.api as api

    cache = qm.MLACache.allocate(FMT, B * PAGES, B, 4, 128, device="cpu")
    seen = []

    class Impl:
        takes_3d_queries = False

        @staticmethod
        def attention(q, r, *rest, **kw):
            seen.append(kw)
            return torch.zeros(q.shape), (torch.zeros(q.shape[:-1]) if kw.get("want_lse", True) else None)

    monkeypatch.setattr(api, "select_backend", lambda problem, backend: Impl)
    table, lens, ids = _index()
    q, r = torch.randn((B, H, 512)), torch.randn((B, H, 64))
    got = qm.attention(q, r, cache, block_table=table, seq_lens=lens, seq_ids=ids, softmax_scale=0.1,
                       return_lse=return_lse, validate=False)
    if return_lse:
        assert seen == [{}] and got[0].shape == (B, H, 512) and got[1].shape == (B, H)
    else:
        assert seen == [{"want_lse": False}] and got.shape == (B, H, 512)
