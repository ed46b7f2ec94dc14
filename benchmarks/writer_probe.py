"""Writer probe (H200): a 128K-token bfloat16 prompt into C4R4 and C2R4 pages, one launch.

Times the Triton writer over (tokens per program, warps) and the CuPy writer, checks every
configuration writes the same page bytes as the default, and reports input TB/s (the issue's
target counts the input bytes: 576 bf16 values per token). ``--baseline MODULE_PATH`` also times
another Triton writer kernel file (an A/B of a kernel change) under the same launch.

    PYTHONPATH=. python -P benchmarks/writer_probe.py [--baseline probe_tmp/writer_kernel_old.py] [--json F]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(__file__))
import quantmla_core as qm  # noqa: E402
from _mla_bench_common import Workload, gpu_info  # noqa: E402
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
    try:
        row("cupy", lambda: qm.write(cache, latent, rope, slot_mapping=slot, seq_ids=b, positions=pos,
                                     seq_lens=lens, backend="cupy", validate=False))
    except Exception as exc:  # noqa: BLE001 - a probe reports what failed
        print(f"{name} cupy: {type(exc).__name__}: {exc}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default=None, help="another writer_kernel.py to A/B")
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs", default="1x1,2x1,4x1,8x1,2x2,4x2,4x4")
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
