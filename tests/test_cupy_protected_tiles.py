"""Model of which tiles kernels v5 and v6 attend to (``attention_v5.cu``, ``attention_v6.cu``,
``stage.cuh``'s ``qmla_protected_split``), checked without a GPU.

A CTA of split ``s`` takes the packed tiles of its token range between the sink and the local window;
in the split ``qmla_protected_split`` picks it then takes the tiles of the sink and those the local
window touches, whose rows come from the bf16 protection buffers. v5's two workers take alternate tiles
of that list. Every token of a request must be attended to exactly once, whatever the lengths, the
protection sizes and the split plan; the negative controls show that the check can fail.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from quantmla_core.backends.cupy import KERNEL_DIR

T = 64  # tokens per tile


def protected_split(keep_lo: int, keep_hi: int, tiles_per_split: int, splits: int) -> int:
    """stage.cuh's qmla_protected_split."""
    last = (keep_hi - 1) // (tiles_per_split * T) if keep_hi > keep_lo else -1
    return min(last + 1, splits - 1)


def attended(L: int, sink: int, local: int, sid_ok: bool, tiles_per_split: int, splits: int, workers: int = 2,
             nl_last=lambda L: (L - 1) // T, worker_start=lambda wg, np_, nwg: (wg - np_ % nwg + nwg) % nwg) -> Counter:
    """How often each token is attended to over the grid's splits and workers (the kernel's formulas;
    ``nl_last`` and ``worker_start`` are there for the negative controls)."""
    keep_lo = min(sink, L) if sid_ok else 0
    keep_hi = max(keep_lo, L - local) if sid_ok and local > 0 else L
    seen: Counter = Counter()
    for split in range(splits):
        t_begin = max(split * tiles_per_split * T, keep_lo // T * T)
        t_end = min(keep_hi, (split + 1) * tiles_per_split * T)
        prot = sid_ok and split == protected_split(keep_lo, keep_hi, tiles_per_split, splits)
        np_ = (t_end - t_begin + T - 1) // T if t_begin < t_end else 0
        ns = (keep_lo + T - 1) // T if prot else 0
        nl = nl_last(L) - keep_hi // T + 1 if prot and keep_hi < L else 0
        for wg in range(workers):
            for t0 in range(t_begin + wg * T, t_end, workers * T):  # packed: n in [keep_lo, lim <= keep_hi)
                seen.update(n for n in range(t0, t0 + T) if keep_lo <= n < keep_hi)
            for j in range(worker_start(wg, np_, workers), ns + nl, workers):
                in_sink = j < ns
                t0 = T * j if in_sink else keep_hi // T * T + T * (j - ns)
                lo, hi = (0, keep_lo) if in_sink else (keep_hi, L)
                seen.update(n for n in range(t0, t0 + T) if lo <= n < hi)
    return seen


def _plans(L: int):
    """Split plans that cover a block table of at least L tokens: (tiles_per_split, splits)."""
    tiles = max(1, -(-L // T))
    for per in (1, 2, 3, 8):
        need = -(-tiles // per)
        for extra in (0, 1, 3):  # the batch's longest request may need more splits than this one
            yield per, need + extra


LENGTHS = [1, 2, 3, 4, 5, 63, 64, 65, 127, 128, 129, 131, 132, 133, 191, 192, 193, 200, 255, 256, 257, 1000, 4097]
PROTECTION = [(0, 0), (4, 128), (4, 0), (0, 128), (100, 40), (4, 16), (64, 64), (65, 1)]


@pytest.mark.parametrize("sink,local", PROTECTION)
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_every_token_attended_once(sink, local, workers):
    for L, sid_ok in itertools.product(LENGTHS, (True, False)):
        for per, splits in _plans(L):
            seen = attended(L, sink, local, sid_ok, per, splits, workers)
            assert sorted(seen) == list(range(L)) and set(seen.values()) == {1}, (L, sid_ok, per, splits)


def test_negative_controls():
    """An off-by-one in the local tile count, or two workers starting on the same protected tile, fail."""
    bad_nl = [L for L in LENGTHS if L > 132 and sorted(attended(L, 4, 128, True, 2, 9, 2, nl_last=lambda L: L // T))
              != list(range(L))]
    assert bad_nl
    doubled = any(set(attended(L, 4, 128, True, 2, 9, 2, worker_start=lambda wg, np_, nwg: 0).values()) != {1}
                  for L in LENGTHS)
    assert doubled


def _flat(name: str) -> str:
    return " ".join((KERNEL_DIR / name).read_text().split())


def attended_pieces(L: int, sink: int, local: int, sid_ok: bool, pieces: list[tuple[int, int]],
                    unit_tiles: int, clamp: bool = True) -> Counter:
    """v6 with a balanced plan's pieces (``pieces``: one request's (first tile, end tile), covering
    [0, unit_tiles)): how often each token is attended to. The sink/local tiles go to the piece holding the tile
    after the last packed one, or the request's last tile (``clamp`` False drops that clamp: a negative control)."""
    keep_lo = min(sink, L) if sid_ok else 0
    keep_hi = max(keep_lo, L - local) if sid_ok and local > 0 else L
    after = (keep_hi - 1) // T + 1
    prot_tile = (min(after, unit_tiles - 1) if clamp else after) if keep_hi > keep_lo else 0
    seen: Counter = Counter()
    for lo, hi in pieces:
        t_begin, t_end = max(lo * T, keep_lo // T * T), min(keep_hi, hi * T)
        for t0 in range(t_begin, t_end, T):
            seen.update(n for n in range(t0, t0 + T) if keep_lo <= n < keep_hi)
        if sid_ok and lo <= prot_tile < hi:
            seen.update(range(0, keep_lo))
            seen.update(range(keep_hi, L))
    return seen


@pytest.mark.parametrize("sink,local", PROTECTION)
def test_every_token_attended_once_in_pieces(sink, local):
    """Balanced plans (backends/splits.py's plan_pieces) cut requests anywhere, and a request may be shorter
    than the block table the plan was made for: still every token once, the protected ones in one piece."""
    from quantmla_core.backends.splits import plan_pieces

    for L, sid_ok in itertools.product(LENGTHS, (True, False)):
        for extra_tiles, requests, groups in ((0, 3, 2), (1, 3, 7), (5, 2, 5), (0, 1, 3)):
            unit_tiles = max(1, -(-L // T)) + extra_tiles
            pieces = [(p[1], p[2]) for p in plan_pieces(requests, unit_tiles, groups).pieces if p[0] == 0]
            seen = attended_pieces(L, sink, local, sid_ok, pieces, unit_tiles)
            assert sorted(seen) == list(range(L)) and set(seen.values()) == {1}, (L, sid_ok, pieces)
    # negative control: without the clamp, a request that fills the table (its last packed tile the table's last)
    # loses its sink and local tokens
    lost = attended_pieces(4 * T, 4, 16, True, [(0, 2), (2, 4)], 4, clamp=False)
    assert sorted(lost) != list(range(4 * T))


def test_model_matches_kernel_sources():
    """Pin the expressions this model encodes to the kernel texts."""
    stage = _flat("stage.cuh")
    assert "const int last = keep_hi > keep_lo ? (keep_hi - 1) / (tiles_per_split * tile) : -1; " \
           "return min(last + 1, splits - 1);" in stage
    common = ("const int keep_lo = sid_ok ? min(sink, L) : 0;",
              "const int keep_hi = (sid_ok && local > 0) ? max(keep_lo, L - local) : L;")
    v5 = _flat("attention_v5.cu")
    for expr in common + ("max(split * tiles_per_split * T, keep_lo / T * T);",
                          "const int t_end = min(keep_hi, (split + 1) * tiles_per_split * T);",
                          "qmla_protected_split(keep_lo, keep_hi, tiles_per_split, T, (int)gridDim.y);") + (
        "const int np = t_begin < t_end ? (t_end - t_begin + T - 1) / T : 0;",
        "const int ns = prot ? (keep_lo + T - 1) / T : 0;",
        "const int nl = (prot && keep_hi < L) ? (L - 1) / T - keep_hi / T + 1 : 0;",
        "for (int t0 = my_begin; t0 < t_end; t0 += NWG * T) {",
        "const int my_begin = t_begin + wg * T;",
        "for (int j = (wg - np % NWG + NWG) % NWG; j < ns + nl; j += NWG) {",
        "const int t0 = in_sink ? T * j : keep_hi / T * T + T * (j - ns);",
        "const int lo = in_sink ? 0 : keep_hi, hi = in_sink ? keep_lo : L;",
        "lm[i][e] = min(hi, L - S_q + (rbase + 8 * i + 2 * q4 + e) / H + 1);",
        "const int lim_min = v5_column_limits(lim, keep_hi, L, S_q, H, rbase, q4);",
        "const int lm_min = v5_column_limits(lm, hi, L, S_q, H, rbase, q4);",
        "S[k] = (n >= lo && n < lm[k >> 2][k & 1]) ? S[k] * scale_log2 : -QMLA_INF;",
        "attend_tile(t0, keep_lo, lim, lim_min, rs, dequantize,",
    ):
        assert expr in v5, f"attention_v5.cu no longer contains: {expr}"
    v6 = _flat("attention_v6.cu")
    for expr in common + (
        # a CTA's piece: equal splits (split blockIdx.y of its request) or a piece-table entry
        "return make_int4((int)blockIdx.x / nchk, (int)blockIdx.y * tiles_per_split, "
        "((int)blockIdx.y + 1) * tiles_per_split, (int)blockIdx.y);",
        "sp.t_begin = max(pc.y * T, keep_lo / T * T);",
        "const int t_end = min(keep_hi, pc.z * T);",
        "const int prot_tile = keep_hi > keep_lo ? min((keep_hi - 1) / T + 1, unit_tiles - 1) : 0;",
        "(QMLA_V6_PIECES ? pc.y <= prot_tile && prot_tile < pc.z "
        ": split == qmla_protected_split(keep_lo, keep_hi, tiles_per_split, T, (int)gridDim.y));",
        "sp.np = sp.t_begin < t_end ? (t_end - sp.t_begin + T - 1) / T : 0;",
        "sp.ns = prot ? (keep_lo + T - 1) / T : 0;",
        "sp.nl = prot && keep_hi < L ? (L - 1) / T - keep_hi / T + 1 : 0;",
        "if (k == 1) return {0, s.ns, 0, s.keep_lo};",
        "return {s.keep_hi / T * T, s.nl, s.keep_hi, s.L};",
    ):
        assert expr in v6, f"attention_v6.cu no longer contains: {expr}"
