"""Device time of each kernel one attention call launches (H200): where a call's fixed cost goes.

For each shape, format and backend it runs ``quantmla_core.attention`` under ``torch.profiler`` (CUPTI sees the CuPy
and Triton kernels as well as torch's) and prints every kernel's mean device time per call, their sum, and the same
call replayed as a CUDA graph (GPU time with the launch gaps); FlashInfer BF16 beside it when installed. The
difference between a kernel sum and the graph time is what the call spends between its kernels.

    PYTHONPATH=. python -P benchmarks/kernel_times.py [--shapes 128x8x32768,128x32x32768] [--formats C4R4,C2R4]
        [--backends cupy] [--calls 20] [--json F]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
import quantmla_core as qm  # noqa: E402
from _mla_bench_common import FlashInferMLA, Workload, add_probe_arguments, probe_shapes  # noqa: E402
from graph_probe import SCALE, bench, graphed  # noqa: E402


def kernel_means(fn, calls: int) -> dict[str, float]:
    """Mean device µs per call of each kernel ``fn`` launches, by kernel name (``calls`` profiled calls)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total
    return {name: us / calls for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}


def _row(h: int, b: int, l: int, fmt: str, backend: str, fn, calls: int) -> dict:
    kernels = kernel_means(fn, calls)
    row = {"H": h, "B": b, "L": l, "format": fmt, "backend": backend, "kernels_us": kernels,
           "kernel_sum_us": sum(kernels.values()), "graph_us": bench(graphed(fn))}
    print(f"H{h} B{b} L{l} {fmt} {backend}: graph {row['graph_us']:.1f} us, kernels {row['kernel_sum_us']:.1f} us",
          flush=True)
    for name, us in kernels.items():
        print(f"    {us:9.1f} us  {name[:110]}", flush=True)
    return row


def probe_shape(h: int, b: int, l: int, args) -> list[dict]:
    """Every backend x format at one shape, FlashInfer BF16 first when installed."""
    work = Workload(b, l)
    q, r = work.queries(h)
    kw = work.attention_kwargs(SCALE)
    rows = []
    if FlashInferMLA.available() is None:
        fi = FlashInferMLA(work, work.bf16_dense(), h, SCALE)
        rows.append(_row(h, b, l, "BF16", "flashinfer", lambda: fi.run(q[:, 0], r[:, 0]), args.calls))
    for name in args.formats.split(","):
        cache = work.build(name, sink=args.sink, local=args.local)
        for backend in args.backends.split(","):
            rows.append(_row(h, b, l, name, backend,
                             lambda backend=backend, cache=cache: qm.attention(q, r, cache, backend=backend, **kw),
                             args.calls))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    add_probe_arguments(ap, shapes="128x8x32768,128x32x32768", formats="C4R4,C2R4", backends="cupy")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args(argv)
    probe_shapes(args, lambda h, b, l: probe_shape(h, b, l, args))


if __name__ == "__main__":
    main()
