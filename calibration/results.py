"""Reproduce the results table of ``calibration/RESULTS.md``.

``python -m quantmla_core.calibration.results [--steps 300] [--out calibration/RESULTS.md]``

Tiny random-weight DeepSeek-V2 and -V3 models with planted outlier channels in the latent and the
RoPE key (``tiny.plant_outliers``); teacher activations on the embedded calibration text (byte
tokens); per layer, held-out content and RoPE objectives of RTN, SmoothQuant-style,
QuaRot-style and the learned QuantMLA transforms at C4R4 and C2R4, with the recipe of DESIGN.md §7
(300 AdamW steps, lrs 3e-3 / 1e-3, warm-up + cosine, clip 1.0, validation every 20 steps).
"""

from __future__ import annotations

import argparse
import time

import torch

from .adapters import find_mla_layers
from .analysis import dual_path
from .capture import capture, default_text, layer_tensors, make_sequences, tokenize
from .objectives import QuantSpec
from .pipeline import METHODS, compare_methods
from .tiny import tiny_model
from .train import Recipe

MODELS = {
    "DeepseekV2 (q_proj, YaRN, pairs interleaved)": dict(arch="v2", q_lora=False, yarn=True),
    "DeepseekV3 (q LoRA, rope_interleave, cache even/odd halves)": dict(arch="v3", q_lora=True, rope_interleave=True),
}


def run(steps: int, n_train: int, n_val: int, seq_len: int, d_c: int, d_r: int, hidden: int, heads: int,
        formats=("C4R4", "C2R4")) -> tuple[list[dict], list[dict]]:
    rows, ana = [], []
    ids = tokenize(default_text(), None, 256)
    seqs = make_sequences(ids, n_train + n_val, seq_len, seed=0)
    for name, kw in MODELS.items():
        kw = dict(kw)
        arch = kw.pop("arch")
        m = tiny_model(arch, outliers=True, d_c=d_c, d_r=d_r, hidden=hidden, heads=heads, d_nope=32, d_v=32,
                       max_pos=4 * seq_len, **kw)
        specs = find_mla_layers(m)
        caps = capture(m, specs, seqs, batch_size=8)
        for s in specs:
            d = layer_tensors(caps[s.layer_idx])
            train, val = d.subset(slice(0, n_train)), d.subset(slice(n_train, None))
            for fmt in formats:
                qs = QuantSpec.from_format(fmt, s.d_c, s.d_r)
                t0 = time.time()
                res, *_ = compare_methods(train, val, qs, Recipe(steps=steps))
                for path in ("content", "rope"):
                    rows.append({"model": name, "layer": s.layer_idx, "format": fmt, "path": path, **res[path],
                                 "seconds": time.time() - t0})
                ana.append({"model": name, **dual_path(val, qs)} | {"format": fmt})
                print(f"{name} L{s.layer_idx} {fmt}: {res}", flush=True)
    return rows, ana


def table(rows: list[dict]) -> str:
    out = ["| model | layer | format | path | " + " | ".join(METHODS) + " | best baseline / QuantMLA |",
           "|---|---|---|---|" + "---|" * (len(METHODS) + 1)]
    for r in rows:
        best_base = min(r[m] for m in METHODS if m != "quantmla")
        out.append(f"| {r['model']} | {r['layer']} | {r['format']} | {r['path']} | "
                   + " | ".join(f"{r[m]:.4g}" for m in METHODS) + f" | {best_base / r['quantmla']:.2f}x |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m quantmla_core.calibration.results")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--n-train", type=int, default=32)
    p.add_argument("--n-val", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--d-c", type=int, default=256)
    p.add_argument("--d-r", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    rows, ana = run(args.steps, args.n_train, args.n_val, args.seq_len, args.d_c, args.d_r, args.hidden, args.heads)
    print("\n" + table(rows))
    print("\n| model | format | layer | content out NMSE | RoPE out NMSE | RoPE/content |\n|---|---|---|---|---|---|")
    for a in ana:
        print(f"| {a['model']} | {a['format']} | {a['layer']} | {a['content_out_nmse']:.4g} | {a['rope_out_nmse']:.4g} "
              f"| {a['ratio']:.3g}x |")
    print(f"\n{time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
