"""Pure-NumPy model of the register fragments of the CuPy attention kernel v3
(``backends/cupy/kernels/attention_v3.cu``): catches layout mistakes without a GPU.

It follows the kernel expression by expression on one staged 64-token tile (staged by the v2
model's copy, whose stage layout v3 shares minus the flag bytes): the permuted query the
prologue writes and its per-sub-group sums, the 16-byte chunk each QK lane loads, the
``(x >> CBITS c) & mask`` + ``prmt`` conversion to bf16 ``128 + code``, ``ldmatrix.x4`` of the
query, the per-sub-group flush ``S += s acc - s (128 + z) sumQ`` (with 8 warps: two halves of
the sub-groups and the exchange of partial scores), ``stmatrix.x4.trans`` of P * s, the PV
operands (``ldmatrix.x4`` of P * s; two tokens' code bytes joined by ``prmt``), the zero-point
correction MMA, its per-tile subtraction, and the output channel order. ``mma.sync.m16n8k16``
runs from the PTX fragment layouts (``test_cupy_fragments.mma``).

It checks that the scores equal a float64 matmul of the dequantized tile and that the PV
accumulators equal P * s times the dequantized values, for every served format, dims and
group size, with 4 and 8 warps.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_cupy_fragments import (
    K,
    bf16_to_f32,
    byte_perm,
    f32_to_bf16,
    issue_copy,
    load_u32,
    mma,
    pack_split_half,
)

import quantmla_core as qm

T = 64


class V3:
    """The kernel's constants (attention_v3.cu) for ``fmt`` and ``nw`` warps."""

    def __init__(self, fmt: qm.PackFormat, nw: int):
        self.NW, self.NH = nw, nw // 4
        self.DC, self.DR = fmt.latent_dim, fmt.rope_dim
        self.CBITS = fmt.content_bits
        self.KCH = 8 // self.CBITS
        self.CB, self.RB = fmt.content_code_bytes, fmt.rope_code_bytes
        self.GC = fmt.content_group_size
        self.NBLK = self.CB // 64
        self.NSG = self.NBLK * self.KCH
        self.KSC = 4 * self.NSG
        self.RLB = self.RB // 4
        self.NWR = self.RLB // 4
        self.KSR = 2 * self.NWR
        self.KS = self.KSC + self.KSR
        self.CBW = self.CB // nw
        self.LBP = self.CBW // 8
        self.NTP = self.KCH * self.LBP
        self.NGC = self.DC // self.GC
        self.CMASK4 = 0x0F0F0F0F if self.CBITS == 4 else 0x03030303
        assert self.NTP * 8 * nw == self.DC and self.LBP in (2, 4, 8)


def code2(cv: int, odd: int) -> int:
    """v3_code2<ODD>: bf16x2 (128 + code) of bytes 0/2 (or 1/3) of a v3_slice() word."""
    return byte_perm(cv, 0x43, 0x4341 if odd else 0x4240)


def off_z(z: int) -> float:
    """v3_off_z / v3_off_zb: 128 + z as a float from bf16 bits 0x43zz."""
    return float(bf16_to_f32(0x4300 | int(z)))


def flush(S, tmp, lane: int, s0: float, s1: float, c0: float, c1: float, sq_row: np.ndarray) -> None:
    """v3_flush on lane ``lane``'s fragments of both row n-tiles: S += s acc - s (128 + z) sumQ."""
    q4 = lane & 3
    for nt in range(2):
        sqn = sq_row[8 * nt + 2 * q4 : 8 * nt + 2 * q4 + 2]
        acc = tmp[nt][lane]
        S[nt][lane][0] += s0 * acc[0] - c0 * sqn[0]
        S[nt][lane][1] += s0 * acc[1] - c0 * sqn[1]
        S[nt][lane][2] += s1 * acc[2] - c1 * sqn[0]
        S[nt][lane][3] += s1 * acc[3] - c1 * sqn[1]


def permuted_query(v: V3, q: np.ndarray, qr: np.ndarray) -> np.ndarray:
    """The prologue's scatter: qs[ks][khalf][row][8] (u16 bf16 bits) from the inverse mapping."""
    qs = np.full((v.KS, 2, 16, 8), -1, np.int64)
    for ch in range(v.DC + v.DR):
        if ch < v.DC:
            c, rem = ch // v.CB, ch % 64
            ks = 4 * ((ch % v.CB) // 64 * v.KCH + c) + (rem % 16) // 4
            bits = q[:, ch]
        else:
            chr_ = ch - v.DC
            c = chr_ // v.RB
            rem = (chr_ % v.RB) % v.RLB + 16 * ((chr_ % v.RB) // v.RLB)
            ks = v.KSC + c * v.NWR + (rem % 16) // 4
            bits = qr[:, chr_]
        byte = rem & 3
        kk = 8 * (byte & 1) + 2 * (rem >> 4) + (byte >> 1)
        assert (qs[ks, kk >> 3, :, kk & 7] == -1).all(), "two channels map to one query slot"
        qs[ks, kk >> 3, :, kk & 7] = bits
    assert (qs >= 0).all(), "a query slot is never written"
    return qs


def ldsm_x4(rows: list[np.ndarray]) -> list[list[int]]:
    """ldmatrix.x4 (no transpose): ``rows[i]`` = the 8 rows (8 x 8 u16) of matrix i; lane t gets
    row t / 4, elements 2 (t % 4) and 2 (t % 4) + 1 of each matrix, low half first."""
    out = []
    for t in range(32):
        r, c = t >> 2, 2 * (t & 3)
        out.append([int(m[r, c]) | (int(m[r, c + 1]) << 16) for m in rows])
    return out


def stsm_x4_trans(regs: list[list[int]]) -> list[np.ndarray]:
    """stmatrix.x4.trans: fragment matrix i (lane t: row t / 4, columns 2 (t % 4), +1 in regs[t][i])
    stored transposed; returns the 8 stored rows (8 x 8 u16) of each matrix."""
    mats = []
    for i in range(4):
        m = np.zeros((8, 8), np.int64)
        for t in range(32):
            r, c = t >> 2, 2 * (t & 3)
            m[c, r] = regs[t][i] & 0xFFFF
            m[c + 1, r] = regs[t][i] >> 16
        mats.append(m)
    return mats


FORMATS = [(n, dc, dr, g) for n in ("C4R4", "C2R4") for dc, dr in ((512, 64), (256, 32)) for g in (64, 128)]
CASES = [f + (4,) for f in FORMATS] + [f + (8,) for f in FORMATS if qm.PackFormat.parse(
    f[0], latent_dim=f[1], rope_dim=f[2]).content_code_bytes >= 128]


@pytest.mark.parametrize("name,dc,dr,gs,nw", CASES, ids=lambda v: str(v))
def test_v3_fragments_reproduce_dequantized_attention(name, dc, dr, gs, nw):
    fmt = qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr, group_size=gs, page_size=64)
    v, k = V3(fmt, nw), K(fmt, T)
    rng = np.random.default_rng(abs(hash((name, dc, dr, gs, nw))) % 2**32)
    cm = (1 << v.CBITS) - 1
    codes = rng.integers(0, cm + 1, (T, dc))
    rcodes = rng.integers(0, 16, (T, dr))
    zc = rng.integers(0, cm + 1, (T, v.NGC))
    zr = rng.integers(0, 16, (T,))
    sc = bf16_to_f32(f32_to_bf16(rng.uniform(0.01, 0.1, (T, v.NGC)).astype(np.float32))).astype(np.float64)
    sr = rng.uniform(0.01, 0.1, (T,)).astype(np.float32)
    grp_of = np.arange(dc) // gs
    V = (codes - zc[:, grp_of]) * sc[:, grp_of]
    Vr = (rcodes - zr[:, None]) * sr[:, None].astype(np.float64)
    qbits = f32_to_bf16(rng.standard_normal((16, dc)).astype(np.float32)).astype(np.int64)
    rbits = f32_to_bf16(rng.standard_normal((16, dr)).astype(np.float32)).astype(np.int64)
    Q, Qr = bf16_to_f32(qbits).astype(np.float64), bf16_to_f32(rbits).astype(np.float64)
    ref_scores = V @ Q.T + Vr @ Qr.T  # [tokens, rows]

    # stage one full tile (tokens [tt, tt + 64) of a longer request) with the v2 model's copy
    tt, L = 64, 3 * 64
    npages = L // 64
    pages = np.full((npages + 1, fmt.page_bytes), 0xFF, np.uint8)
    table = rng.permutation(npages + 1)[:npages].astype(np.int32)
    packed, rpacked = pack_split_half(codes, v.CBITS), pack_split_half(rcodes, 4)
    pg = table[tt // 64]
    for t in range(T):
        pages[pg, fmt.content_codes_offset + t * v.CB : fmt.content_codes_offset + (t + 1) * v.CB] = packed[t]
        pages[pg, fmt.rope_codes_offset + t * v.RB : fmt.rope_codes_offset + (t + 1) * v.RB] = rpacked[t]
        o = fmt.content_scales_offset + t * v.NGC * 2
        pages[pg, o : o + 2 * v.NGC] = f32_to_bf16(sc[t].astype(np.float32)).astype(np.uint16).view(np.uint8)
        pages[pg, fmt.content_zeros_offset + t * v.NGC : fmt.content_zeros_offset + (t + 1) * v.NGC] = zc[t]
        o = fmt.rope_scales_offset + t * 4
        pages[pg, o : o + 4] = np.array([sr[t]], np.float32).view(np.uint8)
        pages[pg, fmt.rope_zeros_offset + t] = zr[t]
    stage = np.zeros(k.STAGE_BYTES, np.uint8)
    issue_copy(k, pages, table, tt, L, np.zeros(T, bool), stage)

    def scale(t, grp):  # content scale as staged (bf16)
        off = k.SO_CS + (t * v.NGC + grp) * 2
        return float(bf16_to_f32(stage[off : off + 2].view(np.uint16)[0]))

    def rscale(t):
        return float(stage[k.SO_RS + 4 * t : k.SO_RS + 4 * t + 4].view(np.float32)[0])

    # ---------------- prologue: permuted query and sub-group sums (content sub-groups, RoPE slices)
    qs = permuted_query(v, qbits, rbits)
    sq = np.zeros((v.NSG + 2, 16))
    for sgi in range(v.NSG + 2):
        ks0, nk = (4 * sgi, 4) if sgi < v.NSG else (v.KSC + (sgi - v.NSG) * v.NWR, v.NWR)
        sq[sgi] = bf16_to_f32(qs[ks0 : ks0 + nk]).astype(np.float64).sum(axis=(0, 1, 3))

    def q_frags(ks):  # ldsm_x4 at qs_lane + ks * 512: matrices (khalf, 8-row block)
        return ldsm_x4([qs[ks, mi & 1, 8 * (mi >> 1) : 8 * (mi >> 1) + 8] for mi in range(4)])

    # ---------------- QK per 16-token group (and pair half with 8 warps)
    S_all = np.zeros((T, 16))
    ps = np.zeros((v.NGC, T // 8, 16, 8), np.int64)  # P * s in shared memory: [grp][8-token block][row][8]
    for tg in range(4):
        S_half = []
        for hh in range(v.NH):
            S = [[0.0] * 4 for _ in range(32)], [[0.0] * 4 for _ in range(32)]
            for bll in range(v.NBLK // v.NH):
                bl = hh * (v.NBLK // v.NH) + bll
                W = [[load_u32(stage, k.coff(16 * tg + (lane >> 2) + 8 * j, 64 * bl + 16 * (lane & 3)), 16)
                      for j in range(2)] for lane in range(32)]
                for c in range(v.KCH):
                    sgi, grp = bl * v.KCH + c, (64 * bl + v.CB * c) // v.GC
                    tmp = [[0.0] * 4 for _ in range(32)], [[0.0] * 4 for _ in range(32)]
                    for e in range(4):
                        b = q_frags(sgi * 4 + e)
                        a = []
                        for lane in range(32):
                            x0 = (W[lane][0][e] >> (v.CBITS * c)) & v.CMASK4
                            x1 = (W[lane][1][e] >> (v.CBITS * c)) & v.CMASK4
                            a.append([code2(x0, 0), code2(x1, 0), code2(x0, 1), code2(x1, 1)])
                        mma(tmp[0], a, [b[ln][0] for ln in range(32)], [b[ln][1] for ln in range(32)])
                        mma(tmp[1], a, [b[ln][2] for ln in range(32)], [b[ln][3] for ln in range(32)])
                    for lane in range(32):
                        t0, t1 = 16 * tg + (lane >> 2), 16 * tg + (lane >> 2) + 8
                        s0, s1 = scale(t0, grp), scale(t1, grp)
                        c0 = s0 * off_z(stage[k.SO_CZ + t0 * v.NGC + grp])
                        c1 = s1 * off_z(stage[k.SO_CZ + t1 * v.NGC + grp])
                        flush(S, tmp, lane, s0, s1, c0, c1, sq[sgi])
            for cc in range(2 // v.NH):  # RoPE slices
                c = hh * (2 // v.NH) + cc
                tmp = [[0.0] * 4 for _ in range(32)], [[0.0] * 4 for _ in range(32)]
                for e in range(v.NWR):
                    b = q_frags(v.KSC + c * v.NWR + e)
                    a = []
                    for lane in range(32):
                        t0, t1 = 16 * tg + (lane >> 2), 16 * tg + (lane >> 2) + 8
                        r0 = load_u32(stage, k.SO_R + t0 * v.RB + v.RLB * (lane & 3), v.RLB)
                        r1 = load_u32(stage, k.SO_R + t1 * v.RB + v.RLB * (lane & 3), v.RLB)
                        x0, x1 = (r0[e] >> (4 * c)) & 0x0F0F0F0F, (r1[e] >> (4 * c)) & 0x0F0F0F0F
                        a.append([code2(x0, 0), code2(x1, 0), code2(x0, 1), code2(x1, 1)])
                    mma(tmp[0], a, [b[ln][0] for ln in range(32)], [b[ln][1] for ln in range(32)])
                    mma(tmp[1], a, [b[ln][2] for ln in range(32)], [b[ln][3] for ln in range(32)])
                for lane in range(32):
                    t0, t1 = 16 * tg + (lane >> 2), 16 * tg + (lane >> 2) + 8
                    s0, s1 = rscale(t0), rscale(t1)
                    c0, c1 = s0 * off_z(stage[k.SO_RZ + t0]), s1 * off_z(stage[k.SO_RZ + t1])
                    flush(S, tmp, lane, s0, s1, c0, c1, sq[v.NSG + c])
            S_half.append(S)
        S = S_half[0]
        for hh in range(1, v.NH):  # the pair's partial scores, added in the exchange
            S = tuple([[S[nt][ln][i] + S_half[hh][nt][ln][i] for i in range(4)] for ln in range(32)] for nt in range(2))
        for lane in range(32):
            g8, q4 = lane >> 2, lane & 3
            for nt in range(2):
                for i in range(4):
                    S_all[16 * tg + g8 + 8 * (i >> 1), 8 * nt + 2 * q4 + (i & 1)] = S[nt][lane][i]
        # P * s: a stand-in P (any values: the layout is what is checked), one stmatrix per group
        P = rng.uniform(0.0, 1.0, (16, 16))  # [token of the group, row]
        for grp in range(v.NGC):
            regs = []
            for lane in range(32):
                g8, q4 = lane >> 2, lane & 3
                t0, t1 = 16 * tg + g8, 16 * tg + g8 + 8
                s0, s1 = scale(t0, grp), scale(t1, grp)

                def pk(a, b):
                    return int(f32_to_bf16(np.float32(a))) | (int(f32_to_bf16(np.float32(b))) << 16)

                regs.append([pk(P[g8, 2 * q4] * s0, P[g8, 2 * q4 + 1] * s0),
                             pk(P[g8 + 8, 2 * q4] * s1, P[g8 + 8, 2 * q4 + 1] * s1),
                             pk(P[g8, 8 + 2 * q4] * s0, P[g8, 9 + 2 * q4] * s0),
                             pk(P[g8 + 8, 8 + 2 * q4] * s1, P[g8 + 8, 9 + 2 * q4] * s1)])
            for i, m in enumerate(stsm_x4_trans(regs)):  # matrix i: 8-token block 2 tg + (i & 1), rows 8 (i >> 1)
                ps[grp, 2 * tg + (i & 1), 8 * (i >> 1) : 8 * (i >> 1) + 8] = m
    np.testing.assert_allclose(S_all, ref_scores, rtol=1e-5, atol=1e-4 * np.abs(ref_scores).max())

    # ---------------- PV: heads = M, tokens = K, this warp's channel slice = N
    PS = bf16_to_f32(ps).astype(np.float64)  # [grp][tb][row][8 tokens]
    ps_rows = PS.transpose(0, 2, 1, 3).reshape(v.NGC, 16, T)  # [grp][row][token]
    out = np.zeros((16, dc))
    for w in range(v.NW):
        acc = [[[0.0] * 4 for _ in range(32)] for _ in range(v.NTP)]
        corr = [[[0.0] * 4 for _ in range(32)] for _ in range(v.KCH)]
        for kt in range(T // 16):
            for c in range(v.KCH):
                grp = (v.CBW * w + v.CB * c) // v.GC
                # ldsm_x4 at ps_ld: matrix mi = (8-token block 2 kt + (mi >> 1), rows 8 (mi & 1))
                a = ldsm_x4([ps[grp, 2 * kt + (mi >> 1), 8 * (mi & 1) : 8 * (mi & 1) + 8] for mi in range(4)])
                zb = []
                for lane in range(32):
                    ta = 16 * kt + 2 * (lane & 3)
                    z = [int(stage[k.SO_CZ + t * v.NGC + grp]) for t in (ta, ta + 1, ta + 8, ta + 9)]
                    zb.append((0x43004300 | z[0] | (z[1] << 16), 0x43004300 | z[2] | (z[3] << 16)))
                mma(corr[c], a, [z0 for z0, _ in zb], [z1 for _, z1 in zb])
                for jx in range(v.LBP // 2):
                    b = []
                    for lane in range(32):
                        ta = 16 * kt + 2 * (lane & 3)
                        wp = [load_u32(stage, k.coff(t, v.CBW * w + v.LBP * (lane >> 2)), v.LBP)
                              for t in (ta, ta + 1, ta + 8, ta + 9)]
                        sel = 0x7632 if jx & 1 else 0x5410
                        x01 = (byte_perm(wp[0][jx >> 1], wp[1][jx >> 1], sel) >> (v.CBITS * c)) & v.CMASK4
                        x89 = (byte_perm(wp[2][jx >> 1], wp[3][jx >> 1], sel) >> (v.CBITS * c)) & v.CMASK4
                        b.append((code2(x01, 0), code2(x89, 0), code2(x01, 1), code2(x89, 1)))
                    mma(acc[c * v.LBP + 2 * jx], a, [x[0] for x in b], [x[1] for x in b])
                    mma(acc[c * v.LBP + 2 * jx + 1], a, [x[2] for x in b], [x[3] for x in b])
        for c in range(v.KCH):  # the per-tile subtraction of the correction
            for j in range(v.LBP):
                for lane in range(32):
                    acc[c * v.LBP + j][lane][0] -= corr[c][lane][0]
                    acc[c * v.LBP + j][lane][1] -= corr[c][lane][0]
                    acc[c * v.LBP + j][lane][2] -= corr[c][lane][2]
                    acc[c * v.LBP + j][lane][3] -= corr[c][lane][2]
        for lane in range(32):  # the kernel's output store order
            g8, q4 = lane >> 2, lane & 3
            for h in range(2):
                for c in range(v.KCH):
                    for j in range(v.LBP):
                        ch = v.CBW * w + v.LBP * (2 * q4) + j + v.CB * c
                        out[g8 + 8 * h, ch] += acc[c * v.LBP + j][lane][2 * h]
                        out[g8 + 8 * h, ch + v.LBP] += acc[c * v.LBP + j][lane][2 * h + 1]
    # reference: P * s of each channel's group (the same bf16 values) times (code - z)
    ref = np.zeros((16, dc))
    for ch in range(dc):
        g = grp_of[ch]
        ref[:, ch] = ps_rows[g] @ (codes[:, ch] - zc[:, g])
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-5 * np.abs(ref).max())


def test_model_matches_kernel_source():
    """Pin the expressions this model encodes to the kernel text (attention_v3.cu + stage.cuh)."""
    from quantmla_core.backends.cupy import KERNEL_DIR

    src = " ".join(((KERNEL_DIR / "attention_v3.cu").read_text() + (KERNEL_DIR / "stage.cuh").read_text()).split())
    for expr in (
        "ks = 4 * ((ch % CB) / 64 * KCH + c) + (rem % 16) / 4;",  # query k order, content
        "rem = (ch % RB) % RLB + 16 * ((ch % RB) / RLB);",  # ... RoPE
        "const int byte = rem & 3, kk = 8 * (byte & 1) + 2 * (rem >> 4) + (byte >> 1);",
        "qs[((ks * 2 + (kk >> 3)) * 16 + row) * 8 + (kk & 7)] = (u16)h;",
        "const int ck0 = sgi < NSG ? (CB * (sgi % KCH) + 64 * (sgi / KCH)) / 8 : (DC + RB * (sgi - NSG)) / 8;",
        "const u32 qs_lane = smem_addr(qs) + (((lane >> 3) & 1) * 16 + 8 * (lane >> 4) + (lane & 7)) * 16;",
        "const u32 ps_st = ps_base + ((2 * tg + ((lane >> 3) & 1)) * 16 + 8 * (lane >> 4) + (lane & 7)) * 16;",
        "const u32 ps_ld = ps_base + ((lane >> 4) * 16 + 8 * ((lane >> 3) & 1) + (lane & 7)) * 16;",
        "const int tq0 = 16 * tg + g8, tq1 = tq0 + 8;",
        "const int bl = hh * (NBLK / NH) + bll;",
        "qmla_coff(tq0, 64 * bl + 16 * q4)",
        "const int grp = (64 * bl + CB * c) / QMLA_GC;",
        "const u32 a[4] = {v3_code2<0>(x0), v3_code2<0>(x1), v3_code2<1>(x0), v3_code2<1>(x1)};",
        "ldsm_x4(qs_lane + (sgi * 4 + e) * 512, b00, b01, b10, b11);",
        "return __byte_perm(cv, 0x43u, ODD ? 0x4341u : 0x4240u);",
        "S[0] = fmaf(-c0, sq.x, fmaf(s0, acc[0], S[0]));",
        "ldsm_x4(qs_lane + (KSC + c * NWR + e) * 512, b00, b01, b10, b11);",
        "const int c = hh * (2 / NH) + cc;",
        "v3_store_ps(ps_st + grp * (T / 8) * 256, pack_bf16x2(S[0][0] * s0, S[0][1] * s0),",
        "pack_bf16x2(S[0][2] * s1, S[0][3] * s1), pack_bf16x2(S[1][0] * s0, S[1][1] * s0),",
        "const int grp = (CBW * w + CB * c) / QMLA_GC;",
        "ldsm_x4(ps_ld + (grp * (T / 8) + 2 * kt) * 256, a[0], a[1], a[2], a[3]);",
        "const u32 zb0 = 0x43004300u | (u32)zc[tk[0] * NGC] | ((u32)zc[tk[1] * NGC] << 16);",
        "qmla_load_bytes<LBP>(stg + qmla_coff(tk[k], CBW * w + LBP * g8), Wp[k]);",
        "const u32 sel = (jx & 1) ? 0x7632u : 0x5410u;",
        "mma_bf16(acc[c * LBP + 2 * jx], a, v3_code2<0>(x01), v3_code2<0>(x89));",
        "acc[c * LBP + j][2] -= corr[c][2];",
        "const int ch = CBW * w + LBP * (2 * q4) + j + CB * c;",
        "return ((t & 1) << 2) ^ (t & 6);",
    ):
        assert expr in src, f"attention_v3.cu / stage.cuh no longer contain: {expr}"
