"""Writer probe (H200): a 128K-token bfloat16 prompt into C4R4 and C2R4 pages, one launch.

Times the Triton writer over (tokens per program, warps) and the CuPy writer, checks every
configuration writes the same page bytes as the default, and reports input TB/s (the issue's
target counts the input bytes: 576 bf16 values per token). ``--baseline MODULE_PATH`` also times
another Triton writer kernel file (an A/B of a kernel change) under the same launch;
``--cupy-baseline FILE.cu`` does the same for the CuPy writer's source, and ``--cupy-warps``
times the CuPy writer at other warps per block. ``--graphs`` adds CUDA-graph replays (kernel time
without host launch cost) and the host time per call.

    PYTHONPATH=. python -P benchmarks/writer_probe.py [--baseline probe_tmp/writer_kernel_old.py]
        [--cupy-baseline probe_tmp/writer_old.cu] [--cupy-warps 2,8] [--json F]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(__file__))
import quantmla_core as qm  # noqa: E402
from _mla_bench_common import Workload, gpu_info, host_us  # noqa: E402
from quantmla_core.backends.triton import writer as twriter  # noqa: E402

TOKENS = 131072


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # µs


def _time_format(name: str, work: Workload, args, res: dict) -> None:
    """Every writer configuration on one format; rows go to ``res["rows"]``."""
    latent, rope = work.tokens(0, TOKENS)
    slot, b, pos = work.slots(0, TOKENS)
    lens = torch.tensor([TOKENS], device="cuda")
    in_bytes = TOKENS * 576 * 2
    fmt = qm.PackFormat.parse(name)
    ref = qm.MLACache.allocate(fmt, work.num_pages, 1, 4, 128, "cuda")
    ref.pages.fill_(0xA5)  # bytes no writer touches (section padding) keep this pattern in both
    twriter.write(ref, latent, rope, slot, b, pos, lens)
    cache = qm.MLACache.allocate(fmt, work.num_pages, 1, 4, 128, "cuda")

    def row(label, fn):
        cache.pages.fill_(0xA5)
        fn()
        same = bool(torch.equal(cache.pages, ref.pages))
        us = bench(fn)
        r = {"fmt": name, "config": label, "us": us, "input_TBps": in_bytes / us / 1e6, "same_bytes": same}
        res["rows"].append(r)
        print(f"{name} {label:<22} {us:8.1f} us {r['input_TBps']:6.3f} TB/s same={same}", flush=True)

    def graphed(label, fn):
        """``fn`` replayed from a CUDA graph: kernel time without the host's launch cost."""
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        row(f"{label} (graph)", graph.replay)

    def triton_write(bt=None, nw=None):
        return lambda: twriter.write(cache, latent, rope, slot, b, pos, lens, bt, nw)

    for cfg in args.configs.split(","):
        bt, nw = (int(x) for x in cfg.split("x"))
        row(f"triton bt={bt} warps={nw}", triton_write(bt, nw))
    row("triton default", triton_write())
    if args.baseline:
        spec = importlib.util.spec_from_file_location("writer_kernel_baseline", args.baseline)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        saved = twriter.write_kernel
        twriter.write_kernel = mod.write_kernel
        try:
            row("triton baseline kernel", triton_write())
        finally:
            twriter.write_kernel = saved
    def cupy_write():
        qm.write(cache, latent, rope, slot_mapping=slot, seq_ids=b, positions=pos, seq_lens=lens, backend="cupy",
                 validate=False)

    if args.graphs:
        graphed("triton default", triton_write())
        print(f"{name} host us per call: triton {host_us(triton_write(), 50, 0):.1f}", flush=True)
    try:
        row("cupy", cupy_write)
        if args.graphs:
            graphed("cupy", cupy_write)
            print(f"{name} host us per call: cupy {host_us(cupy_write, 50, 0):.1f}", flush=True)
        for warps in [int(w) for w in args.cupy_warps.split(",") if w]:
            with _cupy_writer(warps=warps):
                row(f"cupy warps={warps}", cupy_write)
        if args.cupy_baseline:
            with _cupy_writer(source=open(args.cupy_baseline).read()):
                row("cupy baseline kernel", cupy_write)
    except Exception as exc:  # noqa: BLE001 - a probe reports what failed
        print(f"{name} cupy: {type(exc).__name__}: {exc}", flush=True)


@contextlib.contextmanager
def _cupy_writer(warps: int | None = None, source: str | None = None):
    """The CuPy writer with another block size or ``writer.cu`` text, restored afterwards."""
    from quantmla_core.backends import cupy as cpkg
    from quantmla_core.backends.cupy import writer as cwriter

    saved_warps, saved_source = cwriter.WRITER_WARPS, cpkg.kernel_source
    if warps:
        cwriter.WRITER_WARPS = warps
    if source is not None:
        cpkg.kernel_source = lambda name: source if name == "writer.cu" else saved_source(name)
    def forget():
        for k in [k for k in cpkg._MODULES if k[0] == "writer.cu"]:
            del cpkg._MODULES[k]
        cwriter._KERNELS.clear()

    forget()
    try:
        yield
    finally:
        cwriter.WRITER_WARPS, cpkg.kernel_source = saved_warps, saved_source
        forget()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default=None, help="another writer_kernel.py to A/B")
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs", default="1x1,2x1,4x1,8x1,2x2,4x2,4x4")
    ap.add_argument("--cupy-baseline", default=None, help="another writer.cu to A/B")
    ap.add_argument("--graphs", action="store_true", help="also replay each writer from a CUDA graph, and time host calls")
    ap.add_argument("--cupy-warps", default="", help="comma-separated warps per block to time besides the default")
    args = ap.parse_args(argv)
    res = {"info": gpu_info(), "rows": []}
    work = Workload(1, TOKENS)
    for name in ("C4R4", "C2R4"):
        _time_format(name, work, args, res)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
