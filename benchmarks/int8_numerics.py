"""Numerics of an 8-bit decode-attention design at H 16 (C4R4), against float64 and against kernel v5's bf16 numerics.

The design (RESULTS.md, stop 72) would run QK and PV on the 8-bit integer tensor cores (``wgmma_rates.py`` modes 6 to
8 time them). Its arithmetic, emulated here exactly in integers and in float32 where the kernel would use float32:

* QK: each head's 576 query values become integers ``q_int = rint(q / sigma_h)`` of ``--q-bits`` bits (sigma_h: the
  head's largest magnitude over ``2 ** (q_bits - 1) - 1``; 15 bits are an s8 high half times 128 plus a low half in
  0 .. 127, two column blocks of one 8-bit MMA). The MMA sums ``q_int * code`` exactly in int32, group by group
  (8 content groups, 1 RoPE group); the zero point comes off in integers (``- z * sum(q_int)``); the float32 score is
  ``sum_g s_g * acc_g`` then times ``sigma_h * tau``.
* Softmax: 64-token tiles, base 2, a reference maximum that moves only when a score passes it by 8 (kernel v5's).
* PV: per tile, head and content group, the weights ``w = p~ * s_g`` (p~: the probability relative to the tile's
  largest of that head) become integers ``P' = rint(w * 255 / top)`` of ``--p-bits`` bits, so ``sum_t P' (code - z)``
  is exact in int32; float32 then adds it times ``2 ** (tile max - reference max) * top / 255`` to the output.
  ``top`` is the largest ``w`` of that head and group in the tile ("exact") or its bound, the group's largest scale
  ("bound": no reduction over tokens, coarser steps). The row sum uses the float32 ``p``.

Kernel v5's numerics for comparison: keys ``bf16(s (code - z))``, float32 scores and softmax, ``P`` rounded to bf16.
Both are compared with the float64 reference on the same dequantized keys (DESIGN.md §8: bf16 outputs within 1e-2
relative Frobenius error). Printed: one JSON line per (regime, length)::

    python benchmarks/int8_numerics.py --lengths 64 1024 32768
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import numpy as np

from quantmla_core.reference.attention import mla_attention
from quantmla_core.reference.quantize import bf16_round, quantize_groups

H, DC, DR, G, TILE = 16, 512, 64, 64, 64
NG = DC // G + 1  # content groups and the RoPE group
SLACK = 8.0       # log2 units a score may pass the reference maximum before it moves (kernel v5's)
LOG2E = 1.4426950408889634
#: regime -> (logit standard deviation, needle tokens): random scores, sharper ones, and a few tokens that take about
#: half of every head's weight
REGIMES = {"random": (1.0, 0), "medium": (2.0, 0), "sharp": (4.0, 0), "needles": (1.0, 8)}
P_SCALES = ("exact", "bound")


@dataclass
class Case:
    """One request at C4R4: codes [L, 576] (uint8, content then RoPE), scales [L, 9] (float32 holding the stored
    values: bf16 for content, float32 for RoPE), zeros [L, 9]; bf16 queries qc [16, 512], qr [16, 64]."""

    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    qc: np.ndarray
    qr: np.ndarray
    tau: float

    def dequantized(self) -> np.ndarray:
        """[L, 576] float64: s (code - z), the reference's operands."""
        s = np.repeat(self.scales.astype(np.float64), G, axis=1)
        z = np.repeat(self.zeros.astype(np.float64), G, axis=1)
        return s * (self.codes.astype(np.float64) - z)


def make_case(rng: np.random.Generator, length: int, logit_std: float, needles: int) -> Case:
    """Gaussian latents with a few outlier channels, quantized as C4R4; queries scaled to the logit spread asked for."""
    c = rng.standard_normal((length, DC)).astype(np.float32)
    c[:, rng.choice(DC, 8, replace=False)] *= 6.0
    kr = rng.standard_normal((length, DR)).astype(np.float32)
    q = rng.standard_normal((H, DC + DR))
    tau = 1.0 / np.sqrt(192.0)
    if needles:
        at = rng.choice(length, needles, replace=False)
        c[at] = (q[rng.integers(0, H, needles), :DC] * 3.0).astype(np.float32)
    cc, cs, cz = quantize_groups(c, 4, G, "bfloat16")
    rc, rs, rz = quantize_groups(kr, 4, G, "float32")
    case = Case(np.concatenate([cc, rc], axis=1), np.concatenate([cs, rs], axis=1), np.concatenate([cz, rz], axis=1),
                q[:, :DC], q[:, DC:], tau)
    spread = (tau * q @ case.dequantized().T).std()
    q = bf16_round((q * logit_std / spread).astype(np.float32)).astype(np.float64)
    case.qc, case.qr = q[:, :DC], q[:, DC:]
    return case


def reference(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """float64 out [16, 512] and natural-log LSE [16] over the dequantized keys."""
    k = case.dequantized()
    out, lse = mla_attention(case.qc[None], case.qr[None], k[:, :DC], k[:, DC:], case.tau)
    return out[0], lse[0]


def online_softmax(x2: np.ndarray, pv_tile) -> tuple[np.ndarray, np.ndarray]:
    """Tile loop shared by both models: x2 [16, L] float32 scores in log2 units; ``pv_tile(t, p, tile_max, m_ref)``
    returns the tile's float32 contribution [16, 512] given p [16, 64] = 2 ** (x2 - m_ref). Returns out, lse (ln)."""
    m_ref = np.full(H, -np.inf, np.float32)
    row_sum = np.zeros(H, np.float32)
    acc = np.zeros((H, DC), np.float32)
    for t in range(x2.shape[1] // TILE):
        xs = x2[:, TILE * t:TILE * (t + 1)]
        tile_max = xs.max(axis=1)
        up = tile_max > m_ref + SLACK
        if up.any():
            new = np.where(up, tile_max, m_ref).astype(np.float32)
            alpha = np.exp2(m_ref - new).astype(np.float32)
            alpha[np.isneginf(m_ref)] = 0.0
            row_sum *= alpha
            acc *= alpha[:, None]
            m_ref = new
        p = np.exp2(xs - m_ref[:, None]).astype(np.float32)
        row_sum += p.sum(axis=1, dtype=np.float32)
        acc += pv_tile(t, p, tile_max, m_ref)
    out = acc.astype(np.float64) / row_sum[:, None]
    return out, (m_ref.astype(np.float64) + np.log2(row_sum)) / LOG2E


def v5_numerics(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """Kernel v5's arithmetic: bf16 keys bf16(s (code - z)), float32 scores, P rounded to bf16, float32 PV."""
    k = bf16_round(case.dequantized().astype(np.float32)).astype(np.float64)
    q = np.concatenate([case.qc, case.qr], axis=1)
    x2 = ((q @ k.T).astype(np.float32) * np.float32(case.tau * LOG2E)).astype(np.float32)

    def pv(t: int, p: np.ndarray, tile_max: np.ndarray, m_ref: np.ndarray) -> np.ndarray:
        pb = bf16_round(p).astype(np.float64)
        return (pb @ k[TILE * t:TILE * (t + 1), :DC]).astype(np.float32)

    return online_softmax(x2, pv)


def int8_numerics(case: Case, q_bits: int = 15, p_bits: int = 8,
                  p_scale: str = "exact") -> tuple[np.ndarray, np.ndarray]:
    """The 8-bit design's arithmetic (module docstring); integers are exact, float32 where the kernel rounds.

    ``p_scale`` "exact": each (head, group)'s weights span its own largest in the tile; "bound": they span the bound
    ``p~ <= 1`` times the group's largest scale (no reduction over the tile's tokens a head, but coarser steps).
    """
    if p_scale not in P_SCALES:
        raise ValueError(f"p_scale: expected one of {P_SCALES}, got {p_scale!r}")
    q = np.concatenate([case.qc, case.qr], axis=1)
    qmax = 2 ** (q_bits - 1) - 1
    sigma = np.abs(q).max(axis=1) / qmax
    q_int = np.rint(q / sigma[:, None]).astype(np.int64)
    codes = case.codes.astype(np.int64)
    score = np.zeros((H, codes.shape[0]), np.float32)
    for g in range(NG):
        sl = slice(G * g, G * (g + 1))
        acc = q_int[:, sl] @ codes[:, sl].T - np.outer(q_int[:, sl].sum(axis=1), case.zeros[:, g].astype(np.int64))
        if np.abs(acc).max() >= 2 ** 24:
            raise OverflowError(f"--q-bits {q_bits}: a group's integer dot product reaches {np.abs(acc).max()}, past "
                                "2 ** 24, where its float32 conversion stops being exact")
        score = (score + case.scales[:, g][None, :] * acc.astype(np.float32)).astype(np.float32)
    x2 = (score * (sigma.astype(np.float32) * np.float32(case.tau * LOG2E))[:, None]).astype(np.float32)
    levels = np.float32(2 ** p_bits - 1)

    def pv(t: int, p: np.ndarray, tile_max: np.ndarray, m_ref: np.ndarray) -> np.ndarray:
        rows = slice(TILE * t, TILE * (t + 1))
        p_rel = np.exp2(x2[:, rows] - tile_max[:, None]).astype(np.float32)  # [16, 64], at most 1
        s = case.scales[rows, :DC // G]                                       # [64, 8]
        out = np.zeros((H, DC), np.float32)
        for g in range(DC // G):
            ws = (p_rel * s[:, g][None, :]).astype(np.float32)
            top = ws.max(axis=1) if p_scale == "exact" else np.full(H, s[:, g].max(), np.float32)
            w = np.rint(ws * (levels / top)[:, None]).astype(np.int64)        # [16, 64] in 0 .. levels
            sl = slice(G * g, G * (g + 1))
            acc = w @ codes[rows, sl] - (w @ case.zeros[rows, g].astype(np.int64))[:, None]
            scale = (np.exp2(tile_max - m_ref) * (top / levels)).astype(np.float32)
            out[:, sl] = scale[:, None] * acc.astype(np.float32)
        return out

    return online_softmax(x2, pv)


def errors(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray]) -> dict[str, float]:
    """Relative Frobenius error of the output (its bf16 rounding included) and the largest LSE error."""
    out = bf16_round(got[0].astype(np.float32)).astype(np.float64)
    return {"rel_fro_out": float(np.linalg.norm(out - want[0]) / np.linalg.norm(want[0])),
            "max_abs_lse": float(np.abs(got[1] - want[1]).max())}


def top_weight(case: Case, lse: np.ndarray) -> float:
    """The largest softmax weight of each head, averaged over the heads (how peaked the regime is)."""
    scores = case.tau * (np.concatenate([case.qc, case.qr], axis=1) @ case.dequantized().T)
    return float(np.exp(scores.max(axis=1) - lse).mean())


def run(lengths: list[int], seed: int, q_bits: int, p_bits: int) -> list[dict]:
    rows = []
    for name, (logit_std, needles) in REGIMES.items():
        for length in lengths:
            case = make_case(np.random.default_rng(seed), length, logit_std, needles)
            want = reference(case)
            rows.append({"regime": name, "length": length, "q_bits": q_bits, "p_bits": p_bits,
                         "mean_top_weight": top_weight(case, want[1]), "v5": errors(v5_numerics(case), want),
                         **{f"int8_{m}": errors(int8_numerics(case, q_bits, p_bits, m), want) for m in P_SCALES}})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 1024, 32768])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--q-bits", type=int, default=15)
    ap.add_argument("--p-bits", type=int, default=8)
    args = ap.parse_args(argv)
    for length in args.lengths:
        if length % TILE:
            raise ValueError(f"--lengths: each a multiple of {TILE}, got {length}")
    for row in run(args.lengths, args.seed, args.q_bits, args.p_bits):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
