"""What the decode-attention probes (``v7_probe.py``, ``v8_probe.py``) share: timing a launch, checking their partial
outputs against float64, printing a JSON line, and their command line."""
from __future__ import annotations

import argparse
import json
from typing import Callable

import numpy as np


def median_launch_us(launch: Callable[[], None], iters: int) -> float:
    """Median device time in µs (CUDA events) of ``launch`` over ``iters`` calls, after one warm-up call."""
    import cupy

    launch()
    cupy.cuda.runtime.deviceSynchronize()
    times = []
    for _ in range(iters):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        launch()
        b.record()
        b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b) * 1e3)
    return float(np.median(times))


def check_probe_options(skip: int, skips: dict[int, str], check: int, tpc: int, multiple: int) -> None:
    """Refuse, before any GPU work, a stage-skip build that is not one, a checked skip build (its output is wrong),
    and a CTA's token count that is not a positive multiple of ``multiple``."""
    if skip not in skips:
        raise ValueError(f"--skip must be one of {sorted(skips)}, got {skip}")
    if skip and check:
        raise ValueError(f"--skip {skip} leaves out {skips[skip]}: its output is wrong, pass --check 0")
    if tpc <= 0 or tpc % multiple:
        raise ValueError(f"--tpc must be a multiple of {multiple} (and positive), got {tpc}")


def softmax_reference(q: np.ndarray, keys: np.ndarray, sm_scale: float, dc: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 attention of q [16, d] over keys [n, d]: the normalized output [16, dc] (the keys' first dc channels
    are the values) and the log2-sum-exp [16] of the scaled scores."""
    s = q @ keys.T * sm_scale * np.log2(np.e)
    m = s.max(axis=1, keepdims=True)
    p = np.exp2(s - m)
    return p @ keys[:, :dc] / p.sum(axis=1, keepdims=True), (m[:, 0] + np.log2(p.sum(axis=1)))


def partial_errors(out: np.ndarray, stats: np.ndarray, check: int,
                   reference: Callable[[int, int], tuple[np.ndarray, np.ndarray]]) -> tuple[float, float]:
    """Largest relative output error and largest log2-sum-exp error of ``check`` CTAs' partial outputs.

    out [CTAs][parts][16][512] unnormalized, stats [CTAs][parts][16][2] (maximum in log2 units, row sum);
    ``reference(cta, part)`` gives the float64 normalized output and log2-sum-exp of that part."""
    err_o = err_lse = 0.0
    ctas, parts = out.shape[:2]
    for cta in np.linspace(0, ctas - 1, check).astype(int) if check > 0 else []:
        for part in range(parts):
            ref_o, ref_lse = reference(int(cta), part)
            got_o = out[cta, part] / stats[cta, part, :, 1:2]
            got_lse = stats[cta, part, :, 0] + np.log2(stats[cta, part, :, 1])
            err_o = max(err_o, float(np.abs(got_o - ref_o).max() / np.abs(ref_o).max()))
            err_lse = max(err_lse, float(np.abs(got_lse - ref_lse).max()))
    return err_o, err_lse


def probe_row(skip: str, ctas: int, tpc: int, us: float, nbytes: int, check: int, errors: tuple[float, float],
              out: np.ndarray) -> dict:
    """A probe's JSON row: what it skipped, its grid, its median time and bytes read (and GB/s), the CTAs checked,
    their errors (``partial_errors``) and whether any output stayed NaN (the outputs are poisoned first)."""
    return {"skip": skip, "ctas": ctas, "tokens_per_cta": tpc, "tokens": ctas * tpc, "us": us, "bytes": nbytes,
            "gbps": nbytes / us / 1e3, "checked_ctas": check, "max_rel_err_out": errors[0],
            "max_abs_err_lse2": errors[1], "nan_in_output": bool(np.isnan(out).any())}


def emit_json_row(row: dict, path: str | None) -> None:
    """Print ``row`` as one JSON line and, given ``path``, append the line to that file."""
    line = json.dumps(row)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def probe_main(argv: list[str] | None, description: str, run: Callable[..., dict],
               histogram: Callable[[int], dict[str, float]], skips: dict[int, str], label: str,
               tpc_multiple: int) -> None:
    """A probe's command line: time and check it (one JSON line), or ``--sass``: its tile loop's opcode counts."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--ctas", type=int, default=128)
    ap.add_argument("--tpc", type=int, default=8192, help=f"tokens a CTA (a multiple of {tpc_multiple})")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--check", type=int, default=2, help="CTAs checked against float64 (0: none)")
    ap.add_argument("--skip", type=int, default=0, choices=sorted(skips),
                    help="leave out one stage (timing only): " + ", ".join(f"{k} {v}" for k, v in skips.items()))
    ap.add_argument("--json", default=None, help="also append the JSON line to this file")
    ap.add_argument("--sass", action="store_true", help="print the tile loop's SASS opcode counts (offline) and stop")
    args = ap.parse_args(argv)
    if args.sass:
        hist = histogram(args.skip)
        top = ", ".join(f"{op} {n:g}" for op, n in sorted(hist.items(), key=lambda kv: -kv[1])[:18])
        print(f"{label} (skipped: {skips[args.skip]}): {sum(hist.values()):g} instructions; {top}")
        return
    emit_json_row(run(args.ctas, args.tpc, args.iters, args.check, skip=args.skip), args.json)
