"""benchmarks/v8_probe: its channel maps agree with the CUDA source; NumPy emulations of its QK (the lanes' code
pairs, the mma.sync fragments, the per-group scales and the zero-point MMAs) and of a tile's PV (every stmatrix and
ldmatrix at the kernel's swizzled addresses) match float64; its options are checked before CuPy is imported; and its
tile loop holds the instructions the design counts on."""
import re

import numpy as np
import pytest

from benchmarks.v7_probe import _bf16_to_f64, make_inputs
from benchmarks.v8_probe import (DC, HMMA_PER_TILE, KSTEPS, NGC, PARTS, exact_keys, kslot_channel, kstep_group,
                                 query_fragments, run, tile_loop_histogram)
from quantmla_core.backends.cupy.sass_report import missing_tools
from quantmla_core.reference.quantize import bf16_round


def _cuda_channel():
    """v8_parts.cuh's v8_channel(c, i), evaluated as written (its body is a C integer expression Python reads alike)."""
    body = re.search(r"int v8_channel\(int c, int i\) \{\s*return (.*?);\s*\}", PARTS.read_text(), re.S).group(1)
    return lambda c, i: eval(body, {}, {"c": c, "i": i})


def test_each_group_is_covered_once_by_its_ksteps():
    for grp in range(NGC + 1):
        got = sorted(kslot_channel(ks, k) for ks in range(KSTEPS) if kstep_group(ks) == grp for k in range(16))
        assert got == list(range(64 * grp, 64 * grp + 64))


def test_key_tile_chunks_hold_what_stmatrix_stores():
    """QK's A fragment of content k-step (gp, half, e) is stored as 4 matrices; matrix column i of k-slot block kb
    lands in chunk 32 half + 8 gp + 2 e + kb: the channel there must be the k-slot's."""
    channel = _cuda_channel()
    seen = set()
    for ks in range(32):
        gp, half, e = ks // 8, (ks // 4) % 2, ks % 4
        for kb in range(2):
            for i in range(8):
                chunk = 32 * half + 8 * gp + 2 * e + kb
                assert channel(chunk, i) == kslot_channel(ks, 8 * kb + i)
                seen.add(channel(chunk, i))
    assert seen == set(range(DC))  # the 512 positions hold the 512 channels


def _pair(x: np.ndarray, sh: int) -> tuple[np.ndarray, np.ndarray]:
    """v8_pair: the bf16 values (128 + nibble) at bits sh and sh + 16 of x."""
    y = ((x >> sh) & 0x000F000F) | 0x43004300
    return _bf16_to_f64((y & 0xFFFF).astype(np.uint16)), _bf16_to_f64((y >> 16).astype(np.uint16))


def _words(rows: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """The little-endian 32-bit word at byte offset[q] of each row: [rows, 4 lanes]."""
    b = np.stack([rows[:, offset + k] for k in range(4)], axis=-1).astype(np.uint32)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _b_matrix(frag: np.ndarray) -> np.ndarray:
    """[16 slots, 16 heads] float64 of one k-step's B fragments ([32 lanes, 4] uint32: nb 0 b0, b1, nb 1 b0, b1)."""
    b = np.zeros((16, 16))
    for lane in range(32):
        g, q = lane >> 2, lane & 3
        for nb in range(2):
            for reg, slot in ((2 * nb, 2 * q), (2 * nb + 1, 2 * q + 8)):
                word = np.array([frag[lane, reg]], np.uint32)
                b[slot, g + 8 * nb] = _bf16_to_f64((word & 0xFFFF).astype(np.uint16))[0]
                b[slot + 1, g + 8 * nb] = _bf16_to_f64((word >> 16).astype(np.uint16))[0]
    return b


def _bf16_round(x) -> np.ndarray:
    """bf16 rounding (the reference's) of x as float64, in x's shape (a scalar stays 0-dimensional)."""
    return bf16_round(x).astype(np.float64).reshape(np.shape(x))


def test_emulated_qk_matches_float64():
    """The kernel's QK for 16 tokens, emulated: A from the lanes' code pairs (rows = tokens), B from
    query_fragments, one accumulator a group times the token's scale, started at W Z (zero points and the 128)."""
    inp = make_inputs(np.random.default_rng(3), 16)
    frags = query_fragments(inp["q"])
    q = np.arange(4)
    cc, rc = inp["cc"], inp["rc"]
    acc = np.zeros((NGC + 1, 16, 16))
    for ks in range(KSTEPS):
        if ks < 32:
            gp, half, e = ks // 8, (ks // 4) % 2, ks % 4
            x = _words(cc, 64 * gp + 16 * q + 4 * e)
        else:
            half, e = (ks - 32) >> 1, (ks - 32) & 1
            x = _words(rc, 8 * q + 4 * e)
        a = np.zeros((16, 16))
        lo0, hi0 = _pair(x, 4 if half else 0)
        lo1, hi1 = _pair(x, 12 if half else 8)
        a[:, 2 * q], a[:, 2 * q + 1], a[:, 2 * q + 8], a[:, 2 * q + 9] = lo0, hi0, lo1, hi1
        acc[kstep_group(ks)] += a @ _b_matrix(frags[ks])
    scales = np.concatenate([_bf16_to_f64(inp["csc"]), _bf16_to_f64(inp["rsc"])[:, None]], axis=1)  # [16, 9]
    zeros = np.concatenate([inp["cze"], inp["rze"][:, None]], axis=1).astype(np.float64)
    w = scales * (128.0 + zeros)
    w_slots = np.zeros((16, 16))
    w_slots[:, :NGC + 1] = w
    wh = _bf16_round(w_slots)
    wl = _bf16_round(w_slots - wh)
    assert np.array_equal(wh + wl, w_slots)  # s (128 + z) has 16 significant bits: two bf16 parts hold it
    z = sum(_b_matrix(frags[KSTEPS + part]) for part in range(3))
    scores = (wh + wl) @ z + np.einsum("tg,gth->th", scales, acc)
    want = exact_keys(inp, 0, 16) @ _bf16_to_f64(inp["q"]).T
    assert np.abs(scores - want).max() < 1e-5 * np.abs(want).max()
    # the zero-point MMAs carry the 128 and the zero points: without them the scores are far off
    assert np.abs(np.einsum("tg,gth->th", scales, acc) - want).max() > 10 * np.abs(want).max()


@pytest.mark.parametrize("kwargs, match", [({"skip": 3}, "--skip must be one of"), ({"skip": 1}, "pass --check 0"),
                                           ({"skip": 2}, "pass --check 0"),
                                           ({"tpc": 192}, "multiple of 128"), ({"tpc": 0}, "multiple of 128")])
def test_run_checks_its_options_before_cupy(kwargs, match):
    args = {"ctas": 1, "tpc": 128, "iters": 1, "check": 1, "skip": 0} | kwargs
    with pytest.raises(ValueError, match=match):
        run(**args)


@pytest.mark.skipif(bool(missing_tools()), reason=f"SASS tools missing: {missing_tools()}")
@pytest.mark.parametrize("skip", [0, 1, 2])
def test_tile_loop_holds_the_designed_instructions(skip):
    hist = tile_loop_histogram(skip)
    assert hist["HMMA"] == HMMA_PER_TILE[skip]
    assert hist["STSM"] == 32 + NGC  # the key tile (one stmatrix a content k-step) and the P' tiles
    assert hist.get("HADD2", 0) == 0 and hist.get("HFMA2", 0) == 0  # no value is scaled or offset
    if skip == 1:
        assert "LDSM" not in hist
    else:
        assert hist["LDSM"] == 4 * (2 + 8) + 2  # per k-step: P' of 2 groups, 8 key-tile pairs; 128 + z twice
        assert sum(hist.values()) < 1100  # stop 72's count (v5: 1,307 a warp and tile)
    # the 39 query fragments (36 k-steps, 3 zero-point parts) are one 16-byte load each, then the 7 maxima reads
    assert hist["LDS"] == (7 if skip == 2 else 39 + 7)


class _Smem:
    """Shared memory as bf16 values at byte addresses, with the warp-wide ldmatrix / stmatrix of v8_probe.cu.
    A register is a pair (low, high) of floats; ``regs[lane][i]`` is register i of a lane."""

    def __init__(self):
        self.mem = {}

    def stsm(self, addrs, regs, trans=False):
        for i in range(4):
            for r in range(8):
                for c in range(8):
                    # matrix i's element (row g, column c) sits in register i of lane 4 g + c // 2
                    src_row, src_col = (c, r) if trans else (r, c)
                    self.mem[addrs[8 * i + r] + 2 * c] = regs[4 * src_row + src_col // 2][i][src_col % 2]

    def ldsm(self, addrs, trans=False):
        out = [[None] * 4 for _ in range(32)]
        for i in range(4):
            m = [[self.mem[addrs[8 * i + r] + 2 * c] for c in range(8)] for r in range(8)]
            for lane in range(32):
                g, q = lane >> 2, lane & 3
                out[lane][i] = (m[2 * q][g], m[2 * q + 1][g]) if trans else (m[g][2 * q], m[g][2 * q + 1])
        return out


def _mma(c, a, b0, b1):
    """mma.sync m16n8k16 on lists of lanes: c [32][4] floats += A (a [32][4] pairs) B (b0, b1 [32] pairs)."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, q = lane >> 2, lane & 3
        for e in range(2):
            A[g, 2 * q + e], A[g + 8, 2 * q + e] = a[lane][0][e], a[lane][1][e]
            A[g, 2 * q + 8 + e], A[g + 8, 2 * q + 8 + e] = a[lane][2][e], a[lane][3][e]
            B[2 * q + e, g], B[2 * q + 8 + e, g] = b0[lane][e], b1[lane][e]
    C = A @ B
    for lane in range(32):
        g, q = lane >> 2, lane & 3
        for e in range(2):
            c[lane][e] += C[g, 2 * q + e]
            c[lane][2 + e] += C[g + 8, 2 * q + e]


def test_emulated_pv_matches_float64():
    """One 64-token tile of a worker through v8_parts.cuh's shared-memory traffic, transcribed: the key tile stored by
    stmatrix from QK's A fragments, P'_g = bf16(bf16(p) s_g) by stmatrix.trans, the 128 + z rows; PV and its zero-point
    MMAs read them back by ldmatrix (the same swizzled addresses), and the output lands at v8_channel."""
    rng = np.random.default_rng(5)
    inp = make_inputs(rng, 64)
    codes = np.concatenate([inp["cc"] & 15, inp["cc"] >> 4], axis=1).astype(np.float64)  # [64, 512]
    scales = _bf16_to_f64(inp["csc"])
    zeros = inp["cze"].astype(np.float64)
    p = rng.uniform(0.0, 1.0, (16, 64))  # weights of (head, token)
    channel = _cuda_channel()
    vt, pt = 0, 64 * DC * 2
    zt = pt + NGC * 16 * 64 * 2
    sm = _Smem()
    lanes = range(32)
    for w in range(4):
        # the key tile: content k-step (gp, half, e) stored from QK's A fragment
        stok = [16 * w + (l & 7) + 8 * ((l >> 3) & 1) for l in lanes]
        for ks in range(32):
            gp, half, e = ks // 8, (ks // 4) % 2, ks % 4
            val = lambda t, slot: 128.0 + codes[t, kslot_channel(ks, slot)]  # noqa: E731
            regs = []
            for l in lanes:
                g, q = l >> 2, l & 3
                t0, t1 = 16 * w + g, 16 * w + 8 + g
                regs.append([(val(t0, 2 * q), val(t0, 2 * q + 1)), (val(t1, 2 * q), val(t1, 2 * q + 1)),
                             (val(t0, 2 * q + 8), val(t0, 2 * q + 9)), (val(t1, 2 * q + 8), val(t1, 2 * q + 9))])
            sm.stsm([vt + stok[l] * DC * 2 + (32 * half + 8 * gp) * 16 + (((2 * e + (l >> 4)) ^ (l & 7)) * 16)
                     for l in lanes], regs)
        # P' of the warp's 16 tokens, every group, stored transposed
        for grp in range(NGC):
            pq = lambda h, t: float(_bf16_round(_bf16_round(p[h, t]) * scales[t, grp]))  # noqa: E731
            regs = []
            for l in lanes:
                g, q = l >> 2, l & 3
                t0, t1 = 16 * w + g, 16 * w + 8 + g
                regs.append([(pq(2 * q, t0), pq(2 * q + 1, t0)), (pq(2 * q, t1), pq(2 * q + 1, t1)),
                             (pq(8 + 2 * q, t0), pq(9 + 2 * q, t0)), (pq(8 + 2 * q, t1), pq(9 + 2 * q, t1))])
            addrs = []
            for l in lanes:
                mi = l >> 3
                hrow = (l & 7) + 8 * (mi >> 1)
                addrs.append(pt + grp * 16 * 64 * 2 + hrow * 64 * 2 + (((2 * w + (mi & 1)) ^ (hrow & 7)) * 16))
            sm.stsm(addrs, regs, trans=True)
        for t in range(16 * w, 16 * w + 16):  # the 128 + z rows
            for grp in range(NGC):
                sm.mem[zt + t * 16 + 2 * grp] = 128.0 + zeros[t, grp]
    out = np.full((16, DC), np.nan)
    for w in range(4):
        r16 = [(l & 7) + 8 * ((l >> 3) & 1) for l in lanes]
        hi16 = [l >> 4 for l in lanes]
        o = [[[0.0] * 4 for _ in lanes] for _ in range(16)]
        za = [[[0.0] * 4 for _ in lanes] for _ in range(2)]
        zb = None
        for kk in range(4):
            a = [sm.ldsm([pt + r16[l] * 64 * 2 + (2 * w + j) * 16 * 64 * 2 + (((2 * kk + hi16[l]) ^ (r16[l] & 7)) * 16)
                          for l in lanes]) for j in range(2)]
            for n in range(0, 16, 2):
                b = sm.ldsm([vt + r16[l] * DC * 2 + 16 * kk * DC * 2
                             + (16 * w + 8 * (n // 8) + (((n % 8) + hi16[l]) ^ (r16[l] & 7))) * 16 for l in lanes],
                            trans=True)
                _mma(o[n], a[n // 8], [x[0] for x in b], [x[1] for x in b])
                _mma(o[n + 1], a[n // 8], [x[2] for x in b], [x[3] for x in b])
            if kk % 2 == 0:
                z = sm.ldsm([zt + (r16[l] + 16 * hi16[l]) * 16 + 16 * kk * 16 for l in lanes], trans=True)
                zk, zb = ([x[0] for x in z], [x[1] for x in z]), ([x[2] for x in z], [x[3] for x in z])
            else:
                zk = zb
            for j in range(2):
                _mma(za[j], a[j], *zk)
        for l in lanes:
            g, q = l >> 2, l & 3
            src = (l & ~3) | w
            for n in range(16):
                j = n // 8
                for e in range(2):
                    ch = channel(16 * w + n, 2 * q + e)
                    out[g, ch] = o[n][l][e] - za[j][src][j]
                    out[g + 8, ch] = o[n][l][2 + e] - za[j][src][2 + j]
    pq_all = np.stack([_bf16_round(_bf16_round(p) * scales[:, grp][None, :]) for grp in range(NGC)])  # [8, 16, 64]
    x = codes - np.repeat(zeros, 64, axis=1)
    want = np.stack([pq_all[c // 64] @ x[:, c] for c in range(DC)], axis=1)  # [16, 512]
    assert not np.isnan(out).any()
    assert np.abs(out - want).max() < 1e-9 * np.abs(want).max()
