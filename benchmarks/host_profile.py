"""Where an eager call's host time goes (GPU): cProfile of back-to-back ``quantmla_core.attention`` calls.

    PYTHONPATH=. python -P benchmarks/host_profile.py [--shape 128x8x4096] [--formats C4R4,BF16]
        [--backends triton,cupy] [--calls 300] [--top 25] [--out DIR]

For each format and backend: the wall time of ``--calls`` calls issued back to back, synchronized once at the end,
divided by the count (the host time of a call where it exceeds the GPU's, as at 4K tokens), then cProfile's
functions with the most internal time over as many calls, written to ``DIR/host_profile_<backend>_<format>.txt``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import quantmla_core as qm  # noqa: E402
from _mla_bench_common import Workload  # noqa: E402

SCALE = 1.0 / 576 ** 0.5


def per_call_us(call, calls: int) -> float:
    """Wall-clock µs a call of ``calls`` back-to-back ones, with one synchronization at the end."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def profile_text(call, calls: int, top: int) -> str:
    """cProfile's ``top`` functions by internal time over ``calls`` calls."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="128x8x4096", help="HxBxL")
    ap.add_argument("--formats", default="C4R4,BF16")
    ap.add_argument("--backends", default="triton,cupy")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    h, b, length = (int(x) for x in args.shape.split("x"))
    work = Workload(b, length)
    q, r = work.queries(h, 1)
    kw = work.attention_kwargs(SCALE)
    os.makedirs(args.out, exist_ok=True)
    for name in args.formats.split(","):
        cache = work.build(name)
        for backend in args.backends.split(","):

            def call(backend=backend, cache=cache):
                return qm.attention(q, r, cache, backend=backend, **kw)

            for _ in range(20):  # builds, plans, allocator warm
                call()
            us = per_call_us(call, args.calls)
            text = profile_text(call, args.calls, args.top)
            path = os.path.join(args.out, f"host_profile_{backend}_{name}.txt")
            with open(path, "w") as f:
                f.write(f"H{h} B{b} L{length} {name} {backend}: {us:.1f} us a call ({args.calls} calls)\n\n{text}")
            print(f"H{h} B{b} L{length} {name} {backend:<6} {us:8.1f} us a call (back to back) -> {path}", flush=True)


if __name__ == "__main__":
    main()
