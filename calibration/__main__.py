"""Command line: ``python -m quantmla_core.calibration --model DIR --format C4R4 --text FILE... --out DIR``.

Loads a local ``transformers`` MLA checkpoint, learns the QuantMLA transforms of every MLA layer on
the calibration text (the embedded default when no ``--text``), fuses them into the weights,
checks the fused model against the original with quantization off, and writes to ``--out``: the
fused model (``save_pretrained``; loads with plain ``transformers``), ``quantmla_transforms``
(safetensors + JSON), ``quantmla_report.json``, ``objectives.csv``, ``dual_path.csv`` and
``dual_path.png``. Defaults are the recipe of DESIGN.md §7.
"""

from __future__ import annotations

import argparse
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    from .train import Recipe

    r = Recipe()
    p = argparse.ArgumentParser(prog="python -m quantmla_core.calibration", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="local transformers checkpoint directory")
    p.add_argument("--format", default="C4R4", help="pack format, e.g. C4R4, C2R4")
    p.add_argument("--text", nargs="*", default=[], help="calibration text file(s); default: embedded text")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--n-train", type=int, default=128)
    p.add_argument("--n-val", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=r.steps)
    p.add_argument("--batch-size", type=int, default=r.batch_size, help="training sequences per step")
    p.add_argument("--lr-rotation", type=float, default=r.lr_rotation)
    p.add_argument("--lr-scale", type=float, default=r.lr_scale)
    p.add_argument("--lr-angle", type=float, default=r.lr_angle)
    p.add_argument("--val-every", type=int, default=r.val_every)
    p.add_argument("--layers", type=int, nargs="*", default=None, help="layer indices (default: all)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: cuda if available)")
    p.add_argument("--dtype", default="auto", help="teacher dtype: auto (checkpoint's), float32, bfloat16")
    p.add_argument("--no-baselines", action="store_true", help="skip RTN/QuaRot evaluation")
    p.add_argument("--no-analysis", action="store_true", help="skip the dual-path analysis")
    p.add_argument("--cache-nmse", type=float, default=0.01, help="matched cache NMSE of the analysis")
    p.add_argument("--layers-per-pass", type=int, default=4, help="layers captured per teacher pass (memory)")
    p.add_argument("--no-check", action="store_true", help="skip the quantization-off check (saves a model copy)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .capture import make_sequences, read_texts, tokenize
    from .pipeline import CalibrationConfig, calibrate
    from .train import Recipe

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    try:
        tok = AutoTokenizer.from_pretrained(args.model)
    except Exception:  # tiny test checkpoints carry no tokenizer: byte-level fallback
        tok = None
        print("no tokenizer in the checkpoint: using UTF-8 bytes modulo the vocabulary", file=sys.stderr)
    vocab = model.config.get_text_config().vocab_size
    ids = tokenize(read_texts(args.text), tok, vocab)
    seqs = make_sequences(ids, args.n_train + args.n_val, args.seq_len, seed=args.seed)
    recipe = Recipe(steps=args.steps, lr_rotation=args.lr_rotation, lr_scale=args.lr_scale, lr_angle=args.lr_angle,
                    val_every=args.val_every, batch_size=args.batch_size, seed=args.seed)
    cfg = CalibrationConfig(fmt=args.format, n_train=args.n_train, n_val=args.n_val, seq_len=args.seq_len,
                            recipe=recipe, layers=args.layers, baselines=not args.no_baselines,
                            analysis=not args.no_analysis, cache_nmse=args.cache_nmse, device=device,
                            progress=not args.quiet, layers_per_pass=args.layers_per_pass, check=not args.no_check)
    print(f"model {args.model} ({model.config.model_type}), {ids.numel()} calibration tokens, "
          f"{seqs.shape[0]} sequences x {seqs.shape[1]}, format {args.format}, device {device}")
    calibrate(model, seqs, cfg, out_dir=args.out, tokenizer=tok)
    print(f"\nfused model and transforms written to {os.path.abspath(args.out)} ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
