"""Pure-NumPy model of the register fragments of the CuPy attention kernel v2
(``backends/cupy/kernels/attention_v2.cu``): catches layout mistakes without a GPU.

The model follows the kernel expression by expression -- the swizzled stage layout the
cp.async copies write, the byte each lane loads for QK and PV, the nibble -> bf16 bit trick
(``(code | 0x4300)`` is 128 + code, then ``fma.rn.bf16x2`` with 1.0 and -(128 + z)), the
``prmt`` interleave of two tokens, the channel order of every k-step and n-tile, the protected
(sink/local) path that loads bf16 pairs from the buffer rows, and the store order of the
outputs -- and executes ``mma.sync.m16n8k16`` from the PTX ISA fragment layouts:

    A (16x16, row): a0 = A[g][2q:2q+2], a1 = A[g+8][2q:2q+2], a2 = A[g][2q+8:2q+10], a3 = A[g+8][2q+8:2q+10]
    B (16x8, col):  b0 = B[2q:2q+2][g],  b1 = B[2q+8:2q+10][g]
    C (16x8):       c0,c1 = C[g][2q:2q+2], c2,c3 = C[g+8][2q:2q+2]
    (lane = 4g + q; the lower k/column of a pair sits in the low 16 bits)

Then it checks that the per-warp partial scores and the PV accumulators reproduce a plain
matmul of the dequantized cache, for random data, every v2 format/dims/group size. It also
checks that the shared-memory reads of both fragment patterns are bank-conflict free.
"""

from __future__ import annotations

import numpy as np
import pytest

import quantmla_core as qm

TILES = (32, 64)  # tokens per tile (QMLA_V2_T)
NW = 4  # warps (channel quarters) per row group
NTH = 32 * NW  # threads of a CTA with one row group


# ------------------------------------------------------------------ bit helpers
def bf16_to_f32(bits):
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    """round to nearest even (the kernel's cvt.rn.bf16x2)"""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint32)


def byte_perm(x: int, y: int, s: int) -> int:
    """__byte_perm(x, y, s): result byte i = byte (s >> 4i) & 7 of the 8-byte value {y, x}."""
    v = (int(y) << 32) | int(x)
    out = 0
    for i in range(4):
        sel = (s >> (4 * i)) & 7
        out |= ((v >> (8 * sel)) & 0xFF) << (8 * i)
    return out


def fma_bf16x2_one(a: int, c: int) -> int:
    """fma.rn.bf16x2(a, 1.0, c); exact here (small integers), so plain float math."""
    lo = bf16_to_f32(a & 0xFFFF) + bf16_to_f32(c & 0xFFFF)
    hi = bf16_to_f32(a >> 16) + bf16_to_f32(c >> 16)
    rlo, rhi = int(f32_to_bf16(lo)), int(f32_to_bf16(hi))
    if max(abs(bf16_to_f32(c & 0xFFFF)), abs(bf16_to_f32(c >> 16))) <= 128 + 255 // 2:  # a real zero point
        assert bf16_to_f32(rlo) == lo and bf16_to_f32(rhi) == hi, "code - z must be exact in bf16"
    return rlo | (rhi << 16)


def cvt_lo(cv: int, negz2: int) -> int:
    return fma_bf16x2_one(byte_perm(cv, 0x43, 0x4140), negz2)


def cvt_hi(cv: int, negz2: int) -> int:
    return fma_bf16x2_one(byte_perm(cv, 0x43, 0x4342), negz2)


def pair(reg: int) -> tuple[float, float]:
    return float(bf16_to_f32(reg & 0xFFFF)), float(bf16_to_f32(reg >> 16))


def pack_pair(lo: float, hi: float) -> int:
    return int(f32_to_bf16(np.float32(lo))) | (int(f32_to_bf16(np.float32(hi))) << 16)


# ------------------------------------------------------------------ mma.sync m16n8k16 from fragments
def mma(c_frag, a_frag, b0, b1):
    """c_frag [32][4] += A x B with A from a_frag [32][4] (u32 bf16x2) and B from b0/b1 [32]."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, q = lane >> 2, lane & 3
        A[g, 2 * q : 2 * q + 2] = pair(a_frag[lane][0])
        A[g + 8, 2 * q : 2 * q + 2] = pair(a_frag[lane][1])
        A[g, 2 * q + 8 : 2 * q + 10] = pair(a_frag[lane][2])
        A[g + 8, 2 * q + 8 : 2 * q + 10] = pair(a_frag[lane][3])
        B[2 * q : 2 * q + 2, g] = pair(b0[lane])
        B[2 * q + 8 : 2 * q + 10, g] = pair(b1[lane])
    C = A @ B
    for lane in range(32):
        g, q = lane >> 2, lane & 3
        c_frag[lane][0] += C[g, 2 * q]
        c_frag[lane][1] += C[g, 2 * q + 1]
        c_frag[lane][2] += C[g + 8, 2 * q]
        c_frag[lane][3] += C[g + 8, 2 * q + 1]


# ------------------------------------------------------------------ the kernel's constants and layout
class K:
    def __init__(self, fmt: qm.PackFormat, tile: int = 32):
        self.T = T = tile
        self.DC, self.DR = fmt.latent_dim, fmt.rope_dim
        self.CBITS = fmt.content_bits
        self.KCH = 8 // self.CBITS
        self.CB, self.RB = fmt.content_code_bytes, fmt.rope_code_bytes
        self.GC = fmt.content_group_size
        self.NCT = self.CB // 16
        self.CBW = self.CB // NW
        self.LB = self.CBW // 4
        self.NE = self.LB // 4
        self.KSC = self.NE * self.KCH
        self.LBP = self.CBW // 8
        self.NPW = (self.LBP + 3) // 4
        self.PB = min(self.LBP, 4)
        self.NTP = self.KCH * self.LBP
        self.KSR = self.DR // 16
        self.NGC = self.DC // self.GC
        self.CMASK = 0x0F0F0F0F if self.CBITS == 4 else 0x03030303
        # stage layout (SO_* in the kernel) and the page-segment copy plan
        self.CSZ = 2 if fmt.content_scale_dtype == "bfloat16" else 4
        self.RSZ = 2 if fmt.rope_scale_dtype == "bfloat16" else 4
        self.SO_R = T * self.CB
        self.SO_CS = self.SO_R + T * self.RB
        self.SO_CZ = self.SO_CS + T * self.NGC * self.CSZ
        self.SO_RS = self.SO_CZ + T * self.NGC
        self.SO_RZ = self.SO_RS + T * self.RSZ
        self.SO_FL = self.SO_RZ + T
        self.STAGE_BYTES = (self.SO_FL + T + 15) // 16 * 16
        self.P = fmt.page_size
        self.SEGT = min(self.P, T)
        self.NSEG = T // self.SEGT
        self.CH = [self.SEGT * self.CB // 16, self.SEGT * self.RB // 16, self.SEGT * self.NGC * self.CSZ // 16,
                   self.SEGT * self.NGC // 16, self.SEGT * self.RSZ // 16, self.SEGT // 16]
        self.CH_SEG = sum(self.CH)
        self.fmt = fmt
        assert self.GC % self.CBW == 0 and 8 * self.KSR == self.RB and self.NTP * 8 * NW == self.DC

    def swz(self, t):
        return (((t & 1) << 2) ^ (t & 6)) if self.NCT >= 8 else ((t >> 1) & 3)

    def coff(self, t, off):
        return t * self.CB + (((off >> 4) ^ self.swz(t)) << 4) + (off & 15)


def issue_copy(k: K, pages: np.ndarray, table: np.ndarray, tt: int, L: int, prot: np.ndarray, stage: np.ndarray):
    """The kernel's issue_copy for tile ``tt`` into ``stage``, thread by thread: per page segment,
    the content-code chunks (``NCT`` per token, swizzled), then one chunk of the small sections
    per thread, the scale chunks zero-filled past L (cp.async src-size); ``prot[t]``: token tt+t
    is read from the protected buffers."""
    T = k.T
    f = k.fmt
    sec_src = [f.rope_codes_offset, f.content_scales_offset, f.content_zeros_offset, f.rope_scales_offset,
               f.rope_zeros_offset]
    sec_dst = [k.SO_R, k.SO_CS, k.SO_CZ, k.SO_RS, k.SO_RZ]
    sec_bpt = [k.RB, k.NGC * k.CSZ, k.NGC, k.RSZ, 1]
    zero_filled = [False, True, False, True, False]
    small = k.CH[1:]
    written = np.zeros(k.STAGE_BYTES, int)
    for seg in range(k.NSEG):
        n0 = tt + seg * k.SEGT
        pg = -1
        if n0 < L and n0 // k.P < table.shape[0]:
            pg = int(table[n0 // k.P])
            if pg >= pages.shape[0]:
                pg = -1
        if pg < 0:
            continue
        slot0, t0s = n0 % k.P, seg * k.SEGT
        for tid in range(NTH):
            for kk in range(-(-k.CH[0] // NTH)):
                r = tid + kk * NTH
                if r < k.CH[0]:
                    t, u = t0s + r // k.NCT, r % k.NCT
                    dst = t * k.CB + ((u ^ k.swz(t)) << 4)
                    src = f.content_codes_offset + slot0 * k.CB + 16 * r
                    stage[dst : dst + 16] = pages[pg, src : src + 16]
                    written[dst : dst + 16] += 1
            for kk in range(-(-sum(small) // NTH)):
                r = tid + kk * NTH
                if r >= sum(small):
                    continue
                sec = 0
                while r >= small[sec]:
                    r -= small[sec]
                    sec += 1
                dst = sec_dst[sec] + t0s * sec_bpt[sec] + 16 * r
                src = sec_src[sec] + slot0 * sec_bpt[sec] + 16 * r
                nbytes = min(max((L - n0) * sec_bpt[sec] - 16 * r, 0), 16) if zero_filled[sec] else 16
                stage[dst : dst + 16] = 0
                stage[dst : dst + nbytes] = pages[pg, src : src + nbytes]
                written[dst : dst + 16] += 1
    assert written.max() <= 1, "a stage byte is copied twice"
    assert (written[: k.SO_FL] == 1).all() or k.NSEG > 1 or L <= tt, "a staged byte is never copied"
    for t in range(T):
        stage[k.SO_FL + t] = 2 if tt + t >= L else (1 if prot[t] else 0)


def cscale(k: K, stage: np.ndarray, t: int, grp: int, flags: bool = True) -> float:
    """v2_cscale<FLAGS>: raw staged scale, selected by the token flag in tiles with protected tokens."""
    fl = stage[k.SO_FL + t]
    if flags and fl != 0:
        return 1.0 if fl == 1 else 0.0
    off = k.SO_CS + (t * k.NGC + grp) * k.CSZ
    raw = stage[off : off + k.CSZ].view(np.uint16 if k.CSZ == 2 else np.float32)[0]
    return float(bf16_to_f32(raw)) if k.CSZ == 2 else float(raw)


def rscale(k: K, stage: np.ndarray, t: int, flags: bool = True) -> float:
    fl = stage[k.SO_FL + t]
    if flags and fl != 0:
        return 1.0 if fl == 1 else 0.0
    off = k.SO_RS + t * k.RSZ
    raw = stage[off : off + k.RSZ].view(np.uint16 if k.RSZ == 2 else np.float32)[0]
    return float(bf16_to_f32(raw)) if k.RSZ == 2 else float(raw)


def negz2(z: int) -> int:
    nz = 0xC300 | int(z)
    return nz | nz << 16


def load_u32(buf: np.ndarray, off: int, nbytes: int) -> list[int]:
    """little-endian words of ``nbytes`` (2, 4, 8 or 16) bytes at ``off``; 2 bytes -> one word."""
    raw = bytes(buf[off : off + nbytes])
    if nbytes == 2:
        return [int.from_bytes(raw, "little")]
    return [int.from_bytes(raw[i : i + 4], "little") for i in range(0, nbytes, 4)]


def pack_split_half(codes: np.ndarray, bits: int) -> np.ndarray:
    """[T, d] codes -> [T, d*bits/8] bytes, split-half order (DESIGN.md 3.3)."""
    k = 8 // bits
    d = codes.shape[1]
    out = np.zeros((codes.shape[0], d // k), np.uint32)
    for i in range(k):
        out |= codes[:, i * d // k : (i + 1) * d // k].astype(np.uint32) << (i * bits)
    return out.astype(np.uint8)


# ------------------------------------------------------------------ the test
V2_FORMATS = [(n, dc, dr, g) for n in ("C4R4", "C2R4") for dc, dr in ((512, 64), (256, 32)) for g in (64, 128)]
#: every format/dims/group size at page size 64, and the page sizes 16, 32, 128 for two of them
V2_MODEL_CASES = [v + (64,) for v in V2_FORMATS] + [
    ("C4R4", 512, 64, 64, 16), ("C2R4", 256, 32, 128, 16), ("C4R4", 256, 32, 64, 32), ("C2R4", 512, 64, 64, 128)]


#: 64-token tiles (QUANTMLA_CUPY_V2_TILE=64) for both content widths and the page sizes around 64
V2_MODEL_CASES_T64 = [("C4R4", 512, 64, 64, 64), ("C2R4", 512, 64, 64, 16), ("C4R4", 256, 32, 128, 32),
                      ("C2R4", 256, 32, 64, 128)]


@pytest.mark.parametrize("pure", [False, True], ids=["protected-tile", "pure-tile"])
@pytest.mark.parametrize("name,dc,dr,gs,page,tile", [v + (32,) for v in V2_MODEL_CASES] +
                         [v + (64,) for v in V2_MODEL_CASES_T64], ids=lambda v: str(v))
def test_v2_fragments_reproduce_dequantized_matmul(name, dc, dr, gs, page, tile, pure):
    """``pure``: a tile without protected tokens, which the kernel runs without the flag selects
    (its scales past L must come out of the copy as zeros)."""
    fmt = qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr, group_size=gs, page_size=page)
    k = K(fmt, tile)
    T = k.T
    rng = np.random.default_rng(abs(hash((name, dc, dr, gs, page))) % 2**32)
    cm, rm = (1 << k.CBITS) - 1, 15
    codes = rng.integers(0, cm + 1, (T, dc))
    rcodes = rng.integers(0, rm + 1, (T, dr))
    zc = rng.integers(0, cm + 1, (T, k.NGC))
    zr = rng.integers(0, rm + 1, (T,))
    sc = bf16_to_f32(f32_to_bf16(rng.uniform(0.01, 0.1, (T, k.NGC)).astype(np.float32)))
    sr = rng.uniform(0.01, 0.1, (T,)).astype(np.float32)
    prot = np.zeros(T, bool)
    if not pure:
        prot[rng.choice(T, 5, replace=False)] = True  # sink/local tokens read from bf16 buffers
    flags = not pure
    pvals_bits = f32_to_bf16(rng.standard_normal((T, dc + dr)).astype(np.float32))
    pvals = bf16_to_f32(pvals_bits).astype(np.float64)

    # reference operands: dequantized values (protected tokens: their bf16 values)
    grp_of = np.arange(dc) // gs
    V = (codes - zc[:, grp_of]) * sc[:, grp_of].astype(np.float64)
    Vr = (rcodes - zr[:, None]) * sr[:, None].astype(np.float64)
    V[prot] = pvals[prot, :dc]
    Vr[prot] = pvals[prot, dc:]
    qbits = f32_to_bf16(rng.standard_normal((16, dc)).astype(np.float32))
    rbits = f32_to_bf16(rng.standard_normal((16, dr)).astype(np.float32))
    Q, Qr = bf16_to_f32(qbits).astype(np.float64), bf16_to_f32(rbits).astype(np.float64)
    ref_scores = Q @ V.T + Qr @ Vr.T  # [16 rows, T tokens]

    # the tile is tokens [tt, tt + T) of a request of length L (the last 3 are past L), on
    # shuffled pages; bytes of unwritten slots are 0xFF (NaN scales) and must never matter
    tt = 2 * T
    L = tt + T - 3
    valid = np.arange(T) < L - tt
    npages = (tt + T) // k.P + 1
    pages = np.full((npages + 2, fmt.page_bytes), 0xFF, np.uint8)
    table = rng.permutation(npages + 2)[:npages].astype(np.int32)
    packed = pack_split_half(codes, k.CBITS)
    rpacked = pack_split_half(rcodes, 4)
    for t in range(T):
        if not valid[t]:
            continue
        n = tt + t
        pg, slot = table[n // k.P], n % k.P
        pages[pg, fmt.content_codes_offset + slot * k.CB : fmt.content_codes_offset + (slot + 1) * k.CB] = packed[t]
        pages[pg, fmt.rope_codes_offset + slot * k.RB : fmt.rope_codes_offset + (slot + 1) * k.RB] = rpacked[t]
        cs = f32_to_bf16(sc[t].astype(np.float32)).astype(np.uint16).view(np.uint8)
        o = fmt.content_scales_offset + slot * k.NGC * 2
        pages[pg, o : o + 2 * k.NGC] = cs
        o = fmt.content_zeros_offset + slot * k.NGC
        pages[pg, o : o + k.NGC] = zc[t]
        o = fmt.rope_scales_offset + slot * 4
        pages[pg, o : o + 4] = np.array([sr[t]], np.float32).view(np.uint8)
        pages[pg, fmt.rope_zeros_offset + slot] = zr[t]
    stage = np.zeros(k.STAGE_BYTES, np.uint8)  # the kernel zeroes the stages once
    issue_copy(k, pages, table, tt, L, prot, stage)
    stage_r = stage[k.SO_R :]

    def prow_pair(t, ch):  # *(const u32*)(prow + ch)
        return int(pvals_bits[t, ch]) | (int(pvals_bits[t, ch + 1]) << 16)

    # ---------------- QK: per warp, per n-tile; partial scores summed over the 4 warps
    total = np.zeros((16, T))
    for wc in range(NW):
        qa = [[[0] * 4 for _ in range(32)] for _ in range(k.KSC + 1)]
        for lane in range(32):
            g, q = lane >> 2, lane & 3
            for c in range(k.KCH):
                for e in range(k.NE):
                    ch = k.CBW * wc + k.LB * q + 4 * e + k.CB * c
                    a = qa[c * k.NE + e][lane]
                    a[0] = int(qbits[g, ch]) | int(qbits[g, ch + 1]) << 16
                    a[1] = int(qbits[g + 8, ch]) | int(qbits[g + 8, ch + 1]) << 16
                    a[2] = int(qbits[g, ch + 2]) | int(qbits[g, ch + 3]) << 16
                    a[3] = int(qbits[g + 8, ch + 2]) | int(qbits[g + 8, ch + 3]) << 16
            if wc < k.KSR:
                ch = 8 * wc + 2 * q
                a = qa[k.KSC][lane]
                a[0] = int(rbits[g, ch]) | int(rbits[g, ch + 1]) << 16
                a[1] = int(rbits[g + 8, ch]) | int(rbits[g + 8, ch + 1]) << 16
                a[2] = int(rbits[g, ch + k.RB]) | int(rbits[g, ch + k.RB + 1]) << 16
                a[3] = int(rbits[g + 8, ch + k.RB]) | int(rbits[g + 8, ch + k.RB + 1]) << 16
        for j in range(T // 8):
            S4 = [[0.0] * 4 for _ in range(32)]
            W = {}
            for lane in range(32):
                g, q = lane >> 2, lane & 3
                W[lane] = load_u32(stage, k.coff(8 * j + g, k.CBW * wc + k.LB * q), k.LB)
            for c in range(k.KCH):
                grp = (k.CBW * wc + k.CB * c) // gs
                tmp = [[0.0] * 4 for _ in range(32)]
                for e in range(k.NE):
                    b0, b1 = [0] * 32, [0] * 32
                    for lane in range(32):
                        g, q = lane >> 2, lane & 3
                        tq = 8 * j + g
                        if prot[tq]:
                            ch = k.CBW * wc + k.LB * q + 4 * e + k.CB * c
                            b0[lane], b1[lane] = prow_pair(tq, ch), prow_pair(tq, ch + 2)
                        else:
                            nz = negz2(stage[k.SO_CZ + tq * k.NGC + grp])
                            cv = (W[lane][e] >> (k.CBITS * c)) & k.CMASK
                            b0[lane] = cvt_lo(cv, nz)
                            b1[lane] = cvt_hi(cv, nz)
                    mma(tmp, [qa[c * k.NE + e][ln] for ln in range(32)], b0, b1)
                for lane in range(32):
                    q = lane & 3
                    tc = 8 * j + 2 * q
                    s0, s1 = cscale(k, stage, tc, grp, flags), cscale(k, stage, tc + 1, grp, flags)
                    S4[lane][0] += tmp[lane][0] * s0
                    S4[lane][1] += tmp[lane][1] * s1
                    S4[lane][2] += tmp[lane][2] * s0
                    S4[lane][3] += tmp[lane][3] * s1
            if wc < k.KSR:
                b0, b1 = [0] * 32, [0] * 32
                for lane in range(32):
                    g, q = lane >> 2, lane & 3
                    tq = 8 * j + g
                    if prot[tq]:
                        b0[lane] = prow_pair(tq, dc + 8 * wc + 2 * q)
                        b1[lane] = prow_pair(tq, dc + 8 * wc + 2 * q + k.RB)
                    else:
                        x = load_u32(stage_r, tq * k.RB + 8 * wc + 2 * q, 2)[0]
                        nz = negz2(stage[k.SO_RZ + tq])
                        b0[lane] = cvt_lo(x & 0x0F0F, nz)
                        b1[lane] = cvt_lo((x >> 4) & 0x0F0F, nz)
                tmp = [[0.0] * 4 for _ in range(32)]
                mma(tmp, [qa[k.KSC][ln] for ln in range(32)], b0, b1)
                for lane in range(32):
                    q = lane & 3
                    tc = 8 * j + 2 * q
                    s0, s1 = rscale(k, stage, tc, flags), rscale(k, stage, tc + 1, flags)
                    S4[lane][0] += tmp[lane][0] * s0
                    S4[lane][1] += tmp[lane][1] * s1
                    S4[lane][2] += tmp[lane][2] * s0
                    S4[lane][3] += tmp[lane][3] * s1
            for lane in range(32):  # C layout -> (row, token)
                g, q = lane >> 2, lane & 3
                tc = 8 * j + 2 * q
                total[g, tc] += S4[lane][0]
                total[g, tc + 1] += S4[lane][1]
                total[g + 8, tc] += S4[lane][2]
                total[g + 8, tc + 1] += S4[lane][3]
    # columns past L are masked to -inf by the kernel (a select): compare the others
    np.testing.assert_allclose(total[:, valid], ref_scores[:, valid], rtol=1e-5, atol=1e-4 * np.abs(ref_scores).max())

    # ---------------- PV: probabilities (any values) times dequantized content, per warp
    P = rng.uniform(0, 1, (16, T)).astype(np.float32)
    P[:, ~valid] = 0.0  # exp2(-inf - m)
    out = np.full((16, dc), np.nan)
    for wc in range(NW):
        acc = [[[0.0] * 4 for _ in range(32)] for _ in range(k.NTP)]
        for kt in range(T // 16):
            Wp = {}
            for lane in range(32):
                g, q = lane >> 2, lane & 3
                ta = 16 * kt + 2 * q
                Wp[lane] = [load_u32(stage, k.coff(tk, k.CBW * wc + k.LBP * g), k.LBP) for tk in (ta, ta + 1, ta + 8, ta + 9)]
            for c in range(k.KCH):
                grp = (k.CBW * wc + k.CB * c) // gs
                afr = []
                for lane in range(32):
                    g, q = lane >> 2, lane & 3
                    ta = 16 * kt + 2 * q
                    # S[2kt] holds C-layout probs of tokens ta, ta+1; S[2kt+1] of ta+8, ta+9
                    pa = [P[g, ta], P[g, ta + 1], P[g + 8, ta], P[g + 8, ta + 1]]
                    pb = [P[g, ta + 8], P[g, ta + 9], P[g + 8, ta + 8], P[g + 8, ta + 9]]
                    sa = (cscale(k, stage, ta, grp, flags), cscale(k, stage, ta + 1, grp, flags))
                    sb = (cscale(k, stage, ta + 8, grp, flags), cscale(k, stage, ta + 9, grp, flags))
                    afr.append([pack_pair(pa[0] * sa[0], pa[1] * sa[1]), pack_pair(pa[2] * sa[0], pa[3] * sa[1]),
                                pack_pair(pb[0] * sb[0], pb[1] * sb[1]), pack_pair(pb[2] * sb[0], pb[3] * sb[1])])
                for wd in range(k.NPW):
                    U = {}
                    for lane in range(32):
                        g, q = lane >> 2, lane & 3
                        ta = 16 * kt + 2 * q
                        U[lane] = []
                        for kk, tk in enumerate((ta, ta + 1, ta + 8, ta + 9)):
                            ch = k.CBW * wc + k.LBP * g + 4 * wd + k.CB * c
                            if prot[tk]:
                                u = [prow_pair(tk, ch), prow_pair(tk, ch + 2) if k.PB == 4 else 0]
                            else:
                                nz = negz2(stage[k.SO_CZ + tk * k.NGC + grp])
                                cv = (Wp[lane][kk][wd] >> (k.CBITS * c)) & k.CMASK
                                u = [cvt_lo(cv, nz), cvt_hi(cv, nz) if k.PB == 4 else 0]
                            U[lane].append(u)
                    for p in range(k.PB):
                        sel = 0x7632 if p & 1 else 0x5410
                        b0 = [byte_perm(U[ln][0][p >> 1], U[ln][1][p >> 1], sel) for ln in range(32)]
                        b1 = [byte_perm(U[ln][2][p >> 1], U[ln][3][p >> 1], sel) for ln in range(32)]
                        mma(acc[(c * k.NPW + wd) * k.PB + p], afr, b0, b1)
        for lane in range(32):  # the kernel's store order
            g, q = lane >> 2, lane & 3
            for c in range(k.KCH):
                for wd in range(k.NPW):
                    for p in range(k.PB):
                        nt = (c * k.NPW + wd) * k.PB + p
                        ch = k.CBW * wc + k.LBP * (2 * q) + 4 * wd + p + k.CB * c
                        for h, row in ((0, g), (1, g + 8)):
                            for col, cc in ((0, ch), (1, ch + k.LBP)):
                                assert np.isnan(out[row, cc]), f"channel {cc} of row {row} stored twice"
                                out[row, cc] = acc[nt][lane][2 * h + col]
    assert not np.isnan(out).any(), "some output channels were never stored"
    # reference with the same bf16 rounding of p * s as the kernel's A operand
    ps = np.zeros((16, T, k.NGC))
    for gi in range(k.NGC):
        s_t = np.array([cscale(k, stage, t, gi, flags) for t in range(T)], np.float32)
        assert (s_t[prot & valid] == 1.0).all() and (s_t[~valid] == 0.0).all()
        ps[:, :, gi] = bf16_to_f32(f32_to_bf16((P * s_t[None, :]).astype(np.float32)))
    Vc = np.where(prot[:, None], pvals[:, :dc], codes - zc[:, grp_of])  # unscaled values
    Vc[~valid] = 0.0
    ref_out = np.einsum("rtc,tc->rc", ps[:, :, grp_of], Vc)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5 * np.abs(ref_out).max())
    # and close to the exact product (bf16 rounding of p*s only)
    exact = P.astype(np.float64) @ np.where(valid[:, None], V, 0.0)
    assert np.abs(out - exact).max() <= 1e-2 * np.abs(exact).max()


def _banks_conflict_free(addrs: list[int], width: int) -> bool:
    """One shared-memory request: ``addrs`` per lane (bytes), ``width`` bytes per lane.
    Lanes are served in phases of 128 bytes worth of lanes; a phase is conflict-free when no
    two lanes touch different 4-byte words of the same bank."""
    per_phase = max(1, 128 // width) if width >= 4 else 32
    for s in range(0, 32, per_phase):
        seen: dict[int, set[int]] = {}
        for a in addrs[s : s + per_phase]:
            for wd in range(a // 4, (a + width - 1) // 4 + 1):
                seen.setdefault(wd % 32, set()).add(wd)
        if any(len(v) > 1 for v in seen.values()):
            return False
    return True


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("name,dc,dr,gs", [v for v in V2_FORMATS if v[3] == 64], ids=lambda v: str(v))
def test_v2_swizzle_is_bank_conflict_free(name, dc, dr, gs, tile):
    k = K(qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr, group_size=gs), tile)
    T = k.T
    for wc in range(NW):
        for j in range(T // 8):  # QK: lane token 8j+g, LB bytes at CBW*wc + LB*q
            addrs = [k.coff(8 * j + (ln >> 2), k.CBW * wc + k.LB * (ln & 3)) for ln in range(32)]
            assert _banks_conflict_free(addrs, k.LB), (wc, j, "QK")
        for kt in range(T // 16):  # PV: tokens 16kt + 2q + {0,1,8,9}, LBP bytes at CBW*wc + LBP*g
            for d in (0, 1, 8, 9):
                addrs = [k.coff(16 * kt + 2 * (ln & 3) + d, k.CBW * wc + k.LBP * (ln >> 2)) for ln in range(32)]
                assert _banks_conflict_free(addrs, k.LBP), (wc, kt, d, "PV")
    # the swizzle is a permutation of each token's chunks
    for t in range(T):
        assert sorted(u ^ k.swz(t) for u in range(k.NCT)) == list(range(k.NCT))


def test_nibble_bit_trick():
    """(code | 0x4300) as bf16 is 128 + code; fma with 1.0 and -(128 + z) gives code - z exactly."""
    for z in range(16):
        nz = 0xC300 | z
        for code in range(16):
            v = pair(cvt_lo(code | (code << 8), nz | nz << 16))
            assert v == (code - z, code - z)
    assert pair(byte_perm(0x0302_0100, 0x0706_0504, 0x5410)) == pair(0x0504_0100)


def test_model_matches_kernel_source():
    """Pin the expressions this model encodes to the kernel text, so that an edit of the
    kernel's fragment mapping cannot pass here without updating the model."""
    from quantmla_core.backends.cupy import KERNEL_DIR

    src = " ".join(((KERNEL_DIR / "attention_v2.cu").read_text() + (KERNEL_DIR / "stage.cuh").read_text()).split())
    for expr in (
        "return ((t & 1) << 2) ^ (t & 6);",  # swizzle, >= 8 chunks per token
        "return (t >> 1) & 3;",  # swizzle, 4 chunks per token
        "return t * CB + ((((off >> 4) ^ qmla_swz(t))) << 4) + (off & 15);",
        "const int ch = CBW * wc + LB * q4 + 4 * e + CB * c;",  # QK query k order
        "qmla_coff(tq, CBW * wc + LB * q4)",  # QK lane load
        "const int ch = 8 * wc + 2 * q4;",  # RoPE query k order
        "b0 = v2_cvt_lo(x & 0x0f0fu, negz2); b1 = v2_cvt_lo((x >> 4) & 0x0f0fu, negz2);",
        "const u32 cv = (W[e] >> (CBITS * c)) & CMASK;",
        "const int tk[4] = {ta, ta + 1, ta + 8, ta + 9};",
        "qmla_coff(tk[k], CBW * wc + LBP * g8)",  # PV lane load
        "const int ch = CBW * wc + LBP * g8 + 4 * wd + CB * c;",
        "const u32 sel = (p & 1) ? 0x7632u : 0x5410u;",
        "mma_bf16(acc[(c * NPW + wd) * PB + p], a, b0, b1);",
        "const int ch = CBW * wc + LBP * (2 * q4) + 4 * wd + p + CB * c;",  # output store
        "ot[(g8 + 8 * h) * OT_STRIDE + ch + LBP] = acc[nt][2 * h + 1];",
        "return fma_bf16x2(__byte_perm(cv, 0x43u, 0x4140u), 0x3f803f80u, negz2);",
        "return fma_bf16x2(__byte_perm(cv, 0x43u, 0x4342u), 0x3f803f80u, negz2);",
        "const u32 nz = 0xc300u | z;",
        "return fl == 0u ? s : (fl == 1u ? 1.0f : 0.0f);",
        "if (!FLAGS) return s;",
        "v2_cscale<PROT>(stg_c, tc, grp)",
        "const int t = t0s + r / NCT, u = r % NCT;",
        "cp_async16(base + t * CB + ((u ^ qmla_swz(t)) << 4), page + QMLA_OFF_CC + slot0 * CB + 16 * r);",
        "c.dst = SO_CS + 16 * r, c.src = QMLA_OFF_CS + 16 * r, c.wtok = NGC * CSZ;",
        "c.wz = NGC * CSZ, c.zoff = 16 * r;",
        "c.dst = SO_RS + 16 * r, c.src = QMLA_OFF_RS + 16 * r, c.wtok = RSZ;",
        "c.wz = RSZ, c.zoff = 16 * r;",
        "return min(max((L - n0) * c.wz - c.zoff, 0), 16);",
        "cp_async16_zfill(base + c.dst + t0s * c.wtok, page + c.src + slot0 * c.wtok, qmla_chunk_bytes(c, L, n0));",
        "base[SO_FL + tid] = (u8)(n >= L ? 2 : (prot_row(n) != nullptr ? 1 : 0));",
    ):
        assert expr in src, f"attention_v2.cu / stage.cuh no longer contain: {expr}"
