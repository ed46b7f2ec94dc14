"""Host time of the CuPy attention paths on the CPU, runnable against any installed version of the package
(an A/B of two commits: install one with ``pip install --target DIR`` and run this file under each).

Prints, for H16 B8 (64 pages a request, int32 index tensors), medians of 15 rounds of 2,000 calls: the
``qm.attention`` front end (backend stubbed, [B, H, d] queries), the eager CuPy launcher and a prepared
``plan.run`` (returning lse, not returning it, and into a given ``out``), with compilation stubbed and each
launch reduced to its argument packing::

    python benchmarks/host_overhead_ab.py new
    PYTHONPATH=/tmp/base python benchmarks/host_overhead_ab.py base
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from _pytest.monkeypatch import MonkeyPatch

import quantmla_core as qm
import quantmla_core.api as api
from quantmla_core.backends.cupy import CupyBackend
from quantmla_core.backends.cupy import attention as A
from quantmla_core.backends.cupy.kernel_args import pack_args
from quantmla_core.plan import AttentionPlan
from quantmla_core.testing import stub_cupy_launcher

B, H, PAGES = 8, 16, 64


def median_us(fn, rounds: int = 15, calls: int = 2000) -> float:
    """Median over ``rounds`` of the mean microseconds per call of ``calls`` calls, after one warm-up round."""
    for _ in range(calls):
        fn()
    means = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(means)


def main(label: str) -> None:
    mp = MonkeyPatch()
    stub_cupy_launcher(mp)
    mp.setattr(A, "launch", lambda fn, grid, block, args, dev, smem=0, stream=None, types=None, pdl=False:
               pack_args(args) if types is None else pack_args(args, types))
    cache = qm.MLACache.allocate(qm.PackFormat.parse("C4R4"), B * PAGES, B, 4, 128, device="cpu")
    q, r = torch.randn((B, H, 512)).bfloat16(), torch.randn((B, H, 64)).bfloat16()
    table = torch.arange(B * PAGES, dtype=torch.int32).view(B, PAGES)
    lens, ids = torch.full((B,), 4096, dtype=torch.int32), torch.arange(B, dtype=torch.int32)
    out3, lse3, out4, lse4 = torch.zeros((B, H, 512)), torch.zeros((B, H)), torch.zeros((B, 1, H, 512)), torch.zeros((B, 1, H))

    class Impl:
        takes_3d_queries = True  # read by the API only where it knows the attribute

        @staticmethod
        def attention(qq, *rest):
            return (out3, lse3) if qq.ndim == 3 else (out4, lse4)

    runner = CupyBackend().plan_attention(cache, table, lens, ids, (B, H, 512), torch.bfloat16, 0.05)
    plan = AttentionPlan(cache, runner, "cupy", (B, H, 512), torch.bfloat16, validate=False)
    kw = dict(block_table=table, seq_lens=lens, seq_ids=ids, softmax_scale=0.05, backend="cupy", validate=False)
    with MonkeyPatch.context() as m:
        m.setattr(api, "select_backend", lambda problem, backend: Impl)
        front = median_us(lambda: qm.attention(q, r, cache, **kw))
    launcher = median_us(lambda: A.attention(q[:, None], r[:, None], cache, table, lens, ids, 0.05))
    planned = median_us(lambda: plan.run(q, r))
    o = torch.empty_like(q)
    no_lse = median_us(lambda: plan.run(q, r, return_lse=False))
    into_no_lse = median_us(lambda: plan.run(q, r, out=o, return_lse=False))
    print(f"{label}: front end {front:.2f} us, launcher {launcher:.2f} us, plan.run {planned:.2f} us, "
          f"plan.run(return_lse=False) {no_lse:.2f} us, plan.run(out=, return_lse=False) {into_no_lse:.2f} us")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "this")
