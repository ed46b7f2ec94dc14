"""Host (Python) time of one decode-attention call, on the CPU, with the CUDA work stubbed out.

A decode step calls attention once per layer; when the GPU work of a call is tens of
microseconds (B = 8, L = 4K), the host time decides the step time unless the caller captures a
CUDA graph. Two numbers, at H = 16, B = 8, 64 pages per request:

* ``cupy_launcher``: ``quantmla_core.backends.cupy.attention.attention`` with kernel compilation
  stubbed and each launch reduced to its argument packing (the prepared call's lookup, argument
  packing, workspace, outputs; not the driver call);
* ``triton_launcher``: ``quantmla_core.backends.triton.attention.attention`` with the three
  kernels replaced by recorders (plan, constexprs, outputs, argument lists; Triton's own launch
  time is not included);
* ``api_front_end``: ``quantmla_core.attention(..., validate=False)`` with the backend replaced
  by one that takes [B, H, d] queries as the CuPy backend does and returns preallocated outputs
  (argument checks, dispatch);
* ``cupy_planned_run`` (and ``_into_outputs``): ``AttentionPlan.run`` of a CuPy plan made once,
  launches reduced to their argument packing (query checks, output allocation or none, arguments);
* ``triton_planned_run`` (and ``_into_outputs``): the same for a Triton plan (``PreparedCall``),
  the two kernels replaced by recorders (partials and outputs allocated, argument tuples built).

    python -m pytest benchmarks/test_host_overhead.py -m benchmark --benchmark-enable
"""

from __future__ import annotations

import pytest
import torch

import quantmla_core as qm
from quantmla_core.backends.cupy.kernel_args import pack_args
from quantmla_core.testing import stub_cupy_launcher, stub_triton_launcher

pytestmark = pytest.mark.benchmark
B, H, PAGES = 8, 16, 64


@pytest.fixture
def stubbed_cupy(monkeypatch):
    from quantmla_core.backends.cupy import attention as A

    stub_cupy_launcher(monkeypatch)
    # what a launch does on the host before the driver call: pack the arguments (the stub's recording is not timed)
    monkeypatch.setattr(A, "launch", lambda fn, grid, block, args, dev, smem=0, stream=None, types=None, pdl=False:
                        pack_args(args) if types is None else pack_args(args, types))
    return A


def _cache():
    return qm.MLACache.allocate(qm.PackFormat.parse("C4R4"), B * PAGES, B, 4, 128, device="cpu")


def _inputs():
    q = torch.randn((B, 1, H, 512)).to(torch.bfloat16)
    r = torch.randn((B, 1, H, 64)).to(torch.bfloat16)
    table = torch.arange(B * PAGES, dtype=torch.int32).view(B, PAGES)
    return q, r, table, torch.full((B,), 4096), torch.arange(B)


def _bench_launcher(benchmark, attention, what: str) -> None:
    """One checked call of a stubbed launcher's ``attention``, then its benchmark."""
    cache = _cache()
    q, r, table, lens, ids = _inputs()
    out, lse = attention(q, r, cache, table, lens, ids, 0.05)
    assert out.shape == q.shape and lse.shape == (B, 1, H)
    benchmark.extra_info.update({"what": what, "B": B, "H": H})
    benchmark(attention, q, r, cache, table, lens, ids, 0.05)


def test_cupy_launcher(benchmark, stubbed_cupy):
    _bench_launcher(benchmark, stubbed_cupy.attention, "cupy launcher host path, CUDA stubbed")


def test_triton_launcher(benchmark, monkeypatch):
    from quantmla_core.backends.triton import attention as A

    stub_triton_launcher(monkeypatch)
    _bench_launcher(benchmark, A.attention, "triton launcher host path, kernels stubbed")


def test_api_front_end(benchmark, monkeypatch):
    import quantmla_core.api as api

    cache = _cache()
    q, r, table, lens, ids = _inputs()
    out3, lse3 = torch.zeros_like(q[:, 0]), torch.zeros((B, H))

    class Impl:
        takes_3d_queries = True  # as the CuPy backend: [B, H, d] queries go through as they are

        @staticmethod
        def attention(*args):
            return out3, lse3

    monkeypatch.setattr(api, "select_backend", lambda problem, backend: Impl)
    kw = dict(block_table=table, seq_lens=lens, seq_ids=ids, softmax_scale=0.05, backend="cupy", validate=False)
    out, lse = qm.attention(q[:, 0], r[:, 0], cache, **kw)
    assert out.shape == (B, H, 512) and lse.shape == (B, H)
    benchmark.extra_info.update({"what": "qm.attention front end, backend stubbed", "B": B, "H": H})
    benchmark(qm.attention, q[:, 0], r[:, 0], cache, **kw)


def _bench_planned(benchmark, backend, given_outputs: bool, what: str) -> None:
    """One checked ``AttentionPlan.run`` of a plan ``backend`` (a stubbed backend instance) made once, then its
    benchmark; into given outputs where ``given_outputs``."""
    from quantmla_core.plan import AttentionPlan

    cache = _cache()
    q, r, table, lens, ids = _inputs()
    q3, r3 = q[:, 0].contiguous(), r[:, 0].contiguous()
    runner = backend.plan_attention(cache, table, lens.int(), ids.int(), (B, H, 512), torch.bfloat16, 0.05)
    plan = AttentionPlan(cache, runner, backend.name, (B, H, 512), torch.bfloat16, validate=False)
    kw = {"out": torch.empty_like(q3), "lse": torch.empty((B, H))} if given_outputs else {}
    out, lse = plan.run(q3, r3, **kw)
    assert out.shape == (B, H, 512) and lse.shape == (B, H)
    benchmark.extra_info.update({"what": what, "B": B, "H": H, "given_outputs": given_outputs})
    benchmark(plan.run, q3, r3, **kw)


@pytest.mark.parametrize("given_outputs", [False, True], ids=["", "into_outputs"])
def test_cupy_planned_run(benchmark, stubbed_cupy, given_outputs):
    from quantmla_core.backends.cupy import CupyBackend

    _bench_planned(benchmark, CupyBackend(), given_outputs, "CuPy plan.run host path, CUDA stubbed")


@pytest.mark.parametrize("given_outputs", [False, True], ids=["", "into_outputs"])
def test_triton_planned_run(benchmark, monkeypatch, given_outputs):
    from quantmla_core.backends.triton import TritonBackend

    launches = stub_triton_launcher(monkeypatch)
    _bench_planned(benchmark, TritonBackend(), given_outputs, "Triton plan.run host path, kernels stubbed")
    assert {name for name, *_ in launches} == {"split_kernel_v2", "protect_kernel", "merge_kernel"}
