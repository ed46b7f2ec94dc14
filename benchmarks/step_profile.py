"""Where a serving decode step's time goes (H200): the serving stack at a fixed batch.

For each (format, batch, MLP kind) it admits ``batch`` requests of ``--prompt-len`` tokens into
the serving harness's stack (:mod:`benchmarks.serving`), then times ``--steps`` decode steps
(wall clock, synchronised) and the GPU time of each kernel family (``torch.profiler``) over a
few more. It shows how much of a step is attention and writer, and how much the model's own
modules and the host take.

    python -P -m benchmarks.step_profile --out step_profile.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from .machine import command_line, machine_info
from .serving import H200, MLAStackRunner, Workload, build_model, make_trace


def _families(prof) -> dict[str, float]:
    """GPU µs per step by kernel family (QuantMLA attention/combine/writer vs everything else)."""
    out: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if not us or e.key.startswith(("ProfilerStep", "aten::", "cuda")):
            continue
        k = e.key.lower()
        fam = ("attention" if "qmla_attn" in k or "split_kernel" in k or "protect_kernel" in k
               else "combine" if "combine" in k or "merge_kernel" in k
               else "writer" if "write" in k and ("qmla" in k or "write_kernel" in k) else "other kernels")
        out[fam] = out.get(fam, 0.0) + us
    return out


def profile(w: Workload, fmt: str, batch: int, steps: int, prof_steps: int, device: str = "cuda") -> dict:
    cuda = device.startswith("cuda")
    model = build_model(w, device, torch.bfloat16 if cuda else torch.float32)
    runner = MLAStackRunner(model, fmt, 2**32, batch, w.sink, w.local, "auto", w.page_size)
    trace = make_trace(Workload(**{**w.__dict__, "requests": batch}))
    ids, toks = [], []
    for r in trace:
        sid, nxt = runner.prefill(r.prompt)
        ids.append(sid)
        toks.append(nxt)
    for _ in range(3):  # warm-up (compiles, plans)
        toks = runner.decode(ids, toks)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        toks = runner.decode(ids, toks)
    sync()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(prof_steps):
            toks = runner.decode(ids, toks)
        sync()
    fam = {k: v / prof_steps / 1e3 for k, v in _families(prof).items()}  # ms per step
    row = {"format": fmt, "batch": batch, "dense_mlp": w.dense_mlp, "step_ms": step_ms,
           "gpu_ms_per_step": fam, "gpu_ms_total": sum(fam.values())}
    print(f"{fmt:<5} batch {batch:>3} {'dense' if w.dense_mlp else 'moe  '}: step {step_ms:6.2f} ms, GPU "
          f"{row['gpu_ms_total']:6.2f} ms = " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(fam.items())), flush=True)
    del runner, model
    if cuda:
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="BF16:16,C4R4:16,C4R4:48", help="FORMAT:BATCH,...")
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prof-steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for dense in (False, True):
        w = Workload(**{**H200.__dict__, "prompt_len": args.prompt_len, "dense_mlp": dense})
        for case in args.cases.split(","):
            fmt, batch = case.split(":")
            rows.append(profile(w, fmt, int(batch), args.steps, args.prof_steps))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_info(), "command": command_line(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
