"""Numerics of the v8 probe's unscaled key tile (bf16 ``128 + code``) and of an fp16 one (``1024 + code``), against
float64 and kernel v5's arithmetic (RESULTS.md, stop 73).

The v8 probe (``v8_probe.cu``) keeps the scales off the values: QK sums ``q (off + code)`` a group of 64 channels in
float32, adds it times the token's scale and takes the zero point off with ``s (off + z)`` times the query sums; PV
multiplies ``P' = p s`` (rounded to the tile's type) by ``off + code`` and takes ``P' (off + z)`` off at the end. Its
tile is bf16 with ``off = 128``, which needs three shifts a 32-bit word of codes to bring each nibble to bits 0-3.
An fp16 tile takes nibbles at bits 0-3 as ``1024 + code`` and at bits 4-7 as ``1024 + 16 code`` (one shift a word),
but fp16's range is narrow, so the model asks what it costs in accuracy:

* QK: the queries as fp16 after one power of two that puts the largest at ``2 ** 14``; the high-nibble groups' 1/16
  folded into their queries (so their offset is 64). Partial sums a 16-channel k-step are exact and accumulate in
  float32, as the MMA does.
* PV: ``P' = fp16(fp16(p) fp16(s 2 ** k))``; ``2 ** k`` (``shift``) is one power of two a call that puts the largest
  possible ``P'`` (``2 ** SLACK`` times the largest scale) at ``2 ** 15`` (an integer add to the scale's bf16 exponent
  before its conversion; ``shift=False`` leaves it out, to show what it is for). The output is divided by it.

The ``tiny`` regime scales the content latents by ``2 ** -16`` (the queries by ``2 ** 16``: the same logits), where
an fp16 ``P'`` without the shift falls below fp16's normal range. Printed: one JSON line per (regime, length)::

    python benchmarks/tile_numerics.py --lengths 64 1024 32768
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from benchmarks.int8_numerics import (DC, G, LOG2E, NG, REGIMES, SLACK, TILE, Case, errors, make_case,
                                      online_softmax, reference, v5_numerics)
from quantmla_core.reference.quantize import bf16_round

TILES = ("bf16", "fp16")
KSTEP = 16
#: regime -> (logit standard deviation, needles, content latent scale)
TILE_REGIMES = {**{k: (*v, 0) for k, v in REGIMES.items()}, "tiny": (2.0, 0, -16)}


def f32(x) -> np.ndarray:
    return np.asarray(x, np.float64).astype(np.float32)


def f16(x) -> np.ndarray:
    return np.asarray(x, np.float64).astype(np.float16).astype(np.float64)


def scaled_case(rng: np.random.Generator, length: int, logit_std: float, needles: int, log2_latent: int) -> Case:
    """``make_case`` with the content scales times ``2 ** log2_latent`` and its queries times the inverse (exact)."""
    case = make_case(rng, length, logit_std, needles)
    case.scales[:, :DC // G] *= np.float32(2.0 ** log2_latent)
    case.qc = case.qc * 2.0 ** -log2_latent
    return case


def channel_offsets(tile: str) -> np.ndarray:
    """[576] the offset each channel's value carries in the tile: 128 (bf16); 1024, or 64 for high nibbles (fp16,
    channels 256 .. 511 of the content and 32 .. 63 of the RoPE key, whose 1/16 sits in their queries)."""
    off = np.full(DC + 64, 128.0)
    if tile == "fp16":
        off[:] = 1024.0
        off[DC // 2:DC] = off[DC + 32:] = 64.0
    return off


def tile_numerics(case: Case, tile: str = "bf16", shift: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The v8 probe's arithmetic with a ``tile`` key tile (module docstring); float32 where the kernel rounds."""
    if tile not in TILES:
        raise ValueError(f"tile: expected one of {TILES}, got {tile!r}")
    q = np.concatenate([case.qc, case.qr], axis=1)
    off = channel_offsets(tile)
    q_log2 = 0.0
    if tile == "fp16":
        q_log2 = 14.0 - np.ceil(np.log2(np.abs(q).max()))
        q = f16(q * 2.0 ** q_log2)
    codes = case.codes.astype(np.float64)
    scales, zeros = case.scales.astype(np.float64), case.zeros.astype(np.float64)
    group = np.arange(DC + 64) // G  # 8 content groups, then the RoPE group
    sums = np.stack([q[:, group == g].sum(axis=1) for g in range(NG)], axis=1)  # [16, 9]
    # the zero-point MMAs' sum_ch q s (off + z), exact (W in two parts, the sums in three): the z part by group, the
    # offset part by channel (fp16's RoPE group carries two offsets)
    score = f32(-(sums @ (scales * zeros).T) - (q * off) @ np.repeat(scales, np.bincount(group), axis=1).T)
    for g in range(NG):
        acc = np.zeros((q.shape[0], codes.shape[0]), np.float32)
        for k0 in range(G * g, G * (g + 1), KSTEP):
            ch = slice(k0, k0 + KSTEP)
            acc = f32(acc + q[:, ch] @ (off[ch] + codes[:, ch]).T)
        score = f32(score + scales[:, g][None, :] * acc)
    x2 = f32(score * f32(case.tau * LOG2E * 2.0 ** -q_log2))
    p_log2 = 0.0
    if tile == "fp16" and shift:
        p_log2 = np.floor(15.0 - SLACK - np.log2(scales[:, :DC // G].max()))  # P' <= 2 ** SLACK s 2 ** k
    p_round = bf16_round if tile == "bf16" else f16

    def pv(t: int, p: np.ndarray, tile_max: np.ndarray, m_ref: np.ndarray) -> np.ndarray:
        rows = slice(TILE * t, TILE * (t + 1))
        pb = np.asarray(p_round(p.astype(np.float64)), np.float64)
        out = np.zeros((p.shape[0], DC), np.float32)
        for g in range(DC // G):
            ch = slice(G * g, G * (g + 1))
            s_g = np.asarray(p_round(scales[rows, g] * 2.0 ** p_log2), np.float64)  # the shift is exact in bf16 bits
            w = np.asarray(p_round(pb * s_g[None, :]), np.float64)
            full, zero = f32(w @ (off[ch] + codes[rows, ch])), f32(w @ (off[ch][0] + zeros[rows, g]))
            out[:, ch] = f32(full - zero[:, None])
        return f32(out * 2.0 ** -p_log2)

    return online_softmax(x2, pv)


def run(lengths: list[int], seed: int) -> list[dict]:
    rows = []
    for name, (logit_std, needles, log2_latent) in TILE_REGIMES.items():
        for length in lengths:
            case = scaled_case(np.random.default_rng(seed), length, logit_std, needles, log2_latent)
            want = reference(case)
            rows.append({"regime": name, "length": length, "v5": errors(v5_numerics(case), want),
                         **{f"v8_{t}": errors(tile_numerics(case, t), want) for t in TILES},
                         "v8_fp16_no_shift": errors(tile_numerics(case, "fp16", shift=False), want)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 1024, 32768])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for length in args.lengths:
        if length % TILE:
            raise ValueError(f"--lengths: each a multiple of {TILE}, got {length}")
    for row in run(args.lengths, args.seed):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
