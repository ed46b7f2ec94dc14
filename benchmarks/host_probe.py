"""Host time of an eager CuPy attention call (GPU): H16 B8 L4K C4R4, where calls are host-bound.

Prints, for int32 and for int64 ``seq_lens``/``seq_ids``, the host microseconds per call through
``qm.attention`` and straight into the backend (launches only, no sync inside the loop) and the
eager ``do_bench`` time, then a cProfile of 300 calls by own time.

    PYTHONPATH=. python -P benchmarks/host_probe.py
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(__file__))
import quantmla_core as qm  # noqa: E402
from _mla_bench_common import Workload  # noqa: E402
from quantmla_core.backends.cupy import attention as cupy_attention  # noqa: E402


def host_us(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main() -> None:
    w = Workload(8, 4096)
    cache = w.build("C4R4")
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(8, 16, 512, device="cuda", generator=g).bfloat16()
    r = torch.randn(8, 16, 64, device="cuda", generator=g).bfloat16()
    for label, lens, ids in (("int32", w.seq_lens, w.seq_ids), ("int64", w.seq_lens.long(), w.seq_ids.long())):
        def api():
            return qm.attention(q, r, cache, block_table=w.table, seq_lens=lens, seq_ids=ids, softmax_scale=0.07,
                                backend="cupy")

        def backend_only():
            return cupy_attention.attention(q[:, None], r[:, None], cache, w.table, lens, ids, 0.07)

        eager = do_bench(api, warmup=25, rep=200, return_mode="median") * 1e3
        print(f"{label} seq_lens/seq_ids: qm.attention host {host_us(api):.1f} us/call, backend only "
              f"{host_us(backend_only):.1f} us/call, eager do_bench {eager:.1f} us", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        qm.attention(q, r, cache, block_table=w.table, seq_lens=w.seq_lens, seq_ids=w.seq_ids, softmax_scale=0.07,
                     backend="cupy")
    profile.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(20)
    print(out.getvalue())


if __name__ == "__main__":
    main()
