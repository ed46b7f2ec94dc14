"""Numba kernels of decode attention over packed pages (absorbed MLA, DESIGN.md §2).

One work item ("task") is (request, head block, range of pages). It walks its pages one at a
time: each page tile is dequantized once into float32 scratch (``ct [P, d_c]``, ``kt [P, d_r]``;
protected tokens come from the sink/local buffers instead), used for QK and for PV, and folded
into an online softmax. Tasks run in parallel (``prange``); when a request is split over
several tasks, each writes a normalised partial output and its LSE, merged by
:func:`merge_splits`. Sizes and byte offsets come from the layout vector
(:func:`.common.layout_vector`).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .common import (
    L_BC,
    L_BR,
    L_CC_BYTES,
    L_DC,
    L_DR,
    L_GC,
    L_GR,
    L_NGC,
    L_NGR,
    L_OFF_CC,
    L_OFF_CS,
    L_OFF_CZ,
    L_OFF_RC,
    L_OFF_RS,
    L_OFF_RZ,
    L_P,
    L_QUANT,
    L_RC_BYTES,
)

# Reassociation lets LLVM vectorize the dot-product reductions; no 'nnan'/'ninf' (-inf is used).
_FM = {"reassoc", "contract", "nsz", "arcp"}


@njit(cache=True, fastmath=_FM)
def dequant_4bit(row, base, d, group, scales, zb, dst) -> None:
    """4-bit split-half codes at ``row[base:]`` -> ``dst[:d] = (q - z) * s``; byte j holds
    elements j (low nibble) and j + d/2 (high nibble). scales float32 ``[d/G]``, zeros at ``row[zb:]``."""
    half = d // 2
    seg = min(half, group)
    for j0 in range(0, half, seg):
        g1 = j0 // group
        g2 = (j0 + half) // group
        s1 = scales[g1]
        z1 = np.float32(row[zb + g1])
        s2 = scales[g2]
        z2 = np.float32(row[zb + g2])
        src = row[base + j0 : base + j0 + seg]
        lo = dst[j0 : j0 + seg]
        hi = dst[half + j0 : half + j0 + seg]
        for j in range(seg):
            b = np.int32(src[j])
            lo[j] = (np.float32(b & 15) - z1) * s1
            hi[j] = (np.float32(b >> 4) - z2) * s2


@njit(cache=True, fastmath=_FM)
def dequant_2bit(row, base, d, group, scales, zb, dst) -> None:
    """2-bit split-half codes: byte j holds elements j, j + d/4, j + d/2, j + 3d/4 (see dequant_4bit)."""
    qd = d // 4
    seg = min(qd, group)
    for j0 in range(0, qd, seg):
        g0 = j0 // group
        g1 = (j0 + qd) // group
        g2 = (j0 + 2 * qd) // group
        g3 = (j0 + 3 * qd) // group
        s0 = scales[g0]
        z0 = np.float32(row[zb + g0])
        s1 = scales[g1]
        z1 = np.float32(row[zb + g1])
        s2 = scales[g2]
        z2 = np.float32(row[zb + g2])
        s3 = scales[g3]
        z3 = np.float32(row[zb + g3])
        src = row[base + j0 : base + j0 + seg]
        o0 = dst[j0 : j0 + seg]
        o1 = dst[qd + j0 : qd + j0 + seg]
        o2 = dst[2 * qd + j0 : 2 * qd + j0 + seg]
        o3 = dst[3 * qd + j0 : 3 * qd + j0 + seg]
        for j in range(seg):
            b = np.int32(src[j])
            o0[j] = (np.float32(b & 3) - z0) * s0
            o1[j] = (np.float32((b >> 2) & 3) - z1) * s1
            o2[j] = (np.float32((b >> 4) & 3) - z2) * s2
            o3[j] = (np.float32(b >> 6) - z3) * s3


@njit(cache=True, fastmath=_FM)
def dequant_8bit(row, base, d, group, scales, zb, dst) -> None:
    """8-bit codes (one byte per element; see dequant_4bit)."""
    for g in range(d // group):
        s = scales[g]
        z = np.float32(row[zb + g])
        src = row[base + g * group : base + (g + 1) * group]
        o = dst[g * group : (g + 1) * group]
        for j in range(group):
            o[j] = (np.float32(src[j]) - z) * s


@njit(cache=True, fastmath=_FM)
def dequant_vector(row, base, d, bits, group, scales, zb, dst) -> None:
    """One token's packed vector at ``bits`` -> float32 ``dst[:d]`` (layout version 1)."""
    if bits == 4:
        dequant_4bit(row, base, d, group, scales, zb, dst)
    elif bits == 2:
        dequant_2bit(row, base, d, group, scales, zb, dst)
    else:
        dequant_8bit(row, base, d, group, scales, zb, dst)


@njit(cache=True, fastmath=_FM)
def dequant_page(row, row16, row32, lay, nv, ct, kt, csc, cscu, rsc) -> None:
    """Tokens ``t < nv`` of one quantized page row -> float32 ``ct[t, :d_c]``, ``kt[t, :d_r]``.

    Scales of the whole page are decoded first (csc/cscu: float32 ``[P, d_c/G]`` scratch and its
    uint32 view; rsc ``[P, d_r/G]``), then each token's codes, segment by segment."""
    ngc = lay[L_NGC]
    ngr = lay[L_NGR]
    b16 = lay[L_OFF_CS] // 2
    for t in range(nv):
        for g in range(ngc):
            cscu[t, g] = np.uint32(row16[b16 + t * ngc + g]) << np.uint32(16)
    b32 = lay[L_OFF_RS] // 4
    for t in range(nv):
        for g in range(ngr):
            rsc[t, g] = row32[b32 + t * ngr + g]
    for t in range(nv):
        dequant_vector(row, lay[L_OFF_CC] + t * lay[L_CC_BYTES], lay[L_DC], lay[L_BC], lay[L_GC], csc[t],
                       lay[L_OFF_CZ] + t * ngc, ct[t])
        dequant_vector(row, lay[L_OFF_RC] + t * lay[L_RC_BYTES], lay[L_DR], lay[L_BR], lay[L_GR], rsc[t],
                       lay[L_OFF_RZ] + t * ngr, kt[t])


@njit(cache=True)
def load_protected(buf, seq, col, dc, dr, ct_row_u, kt_row_u, prot_bf16) -> None:
    """One protected token -> float32 bit patterns of its content/rope rows (uint32 views).

    buf uint16 ``[rows, n, w]``: bfloat16 bits (w = d_c + d_r, ``prot_bf16``) or float32 halves
    (w = 2 (d_c + d_r), low half first)."""
    if prot_bf16:
        for e in range(dc):
            ct_row_u[e] = np.uint32(buf[seq, col, e]) << np.uint32(16)
        for e in range(dr):
            kt_row_u[e] = np.uint32(buf[seq, col, dc + e]) << np.uint32(16)
    else:
        for e in range(dc):
            ct_row_u[e] = np.uint32(buf[seq, col, 2 * e]) | (np.uint32(buf[seq, col, 2 * e + 1]) << np.uint32(16))
        for e in range(dr):
            k = 2 * (dc + e)
            kt_row_u[e] = np.uint32(buf[seq, col, k]) | (np.uint32(buf[seq, col, k + 1]) << np.uint32(16))


@njit(cache=True, fastmath=_FM)
def qk_tile(qt, qrt, ct, kt, rows, nv, sc) -> None:
    """``sc[r, t] = qt[r] . ct[t] + qrt[r] . kt[t]`` for r < rows, t < nv.

    4 rows x 4 tokens per pass (16 vectorized reductions sharing their loads); edge blocks
    repeat the last row/token, which only rewrites the same value.
    """
    dc = ct.shape[1]
    dr = kt.shape[1]
    t = 0
    while t < nv:
        t1 = min(t + 1, nv - 1)
        t2 = min(t + 2, nv - 1)
        t3 = min(t + 3, nv - 1)
        c0 = ct[t]
        c1 = ct[t1]
        c2 = ct[t2]
        c3 = ct[t3]
        k0 = kt[t]
        k1 = kt[t1]
        k2 = kt[t2]
        k3 = kt[t3]
        r = 0
        while r < rows:
            r1 = min(r + 1, rows - 1)
            r2 = min(r + 2, rows - 1)
            r3 = min(r + 3, rows - 1)
            q0 = qt[r]
            q1 = qt[r1]
            q2 = qt[r2]
            q3 = qt[r3]
            a00 = a01 = a02 = a03 = np.float32(0.0)
            a10 = a11 = a12 = a13 = np.float32(0.0)
            a20 = a21 = a22 = a23 = np.float32(0.0)
            a30 = a31 = a32 = a33 = np.float32(0.0)
            for e in range(dc):
                x0 = c0[e]
                x1 = c1[e]
                x2 = c2[e]
                x3 = c3[e]
                y = q0[e]
                a00 += y * x0
                a01 += y * x1
                a02 += y * x2
                a03 += y * x3
                y = q1[e]
                a10 += y * x0
                a11 += y * x1
                a12 += y * x2
                a13 += y * x3
                y = q2[e]
                a20 += y * x0
                a21 += y * x1
                a22 += y * x2
                a23 += y * x3
                y = q3[e]
                a30 += y * x0
                a31 += y * x1
                a32 += y * x2
                a33 += y * x3
            q0 = qrt[r]
            q1 = qrt[r1]
            q2 = qrt[r2]
            q3 = qrt[r3]
            for e in range(dr):
                x0 = k0[e]
                x1 = k1[e]
                x2 = k2[e]
                x3 = k3[e]
                y = q0[e]
                a00 += y * x0
                a01 += y * x1
                a02 += y * x2
                a03 += y * x3
                y = q1[e]
                a10 += y * x0
                a11 += y * x1
                a12 += y * x2
                a13 += y * x3
                y = q2[e]
                a20 += y * x0
                a21 += y * x1
                a22 += y * x2
                a23 += y * x3
                y = q3[e]
                a30 += y * x0
                a31 += y * x1
                a32 += y * x2
                a33 += y * x3
            sc[r3, t3] = a33
            sc[r3, t2] = a32
            sc[r3, t1] = a31
            sc[r3, t] = a30
            sc[r2, t3] = a23
            sc[r2, t2] = a22
            sc[r2, t1] = a21
            sc[r2, t] = a20
            sc[r1, t3] = a13
            sc[r1, t2] = a12
            sc[r1, t1] = a11
            sc[r1, t] = a10
            sc[r, t3] = a03
            sc[r, t2] = a02
            sc[r, t1] = a01
            sc[r, t] = a00
            r += 4
        t += 4


@njit(cache=True, fastmath=_FM)
def pv_tile(sc, ct, acc, rows, cnt) -> None:
    """``acc[r] += sum_{t < cnt[r]} sc[r, t] * ct[t]`` for r < rows.

    4 rows x 4 tokens per pass over the d_c columns (each ``ct`` load feeds 4 rows); the
    tokens past the block's common count and the rows past a multiple of 4 go one at a time.
    """
    dc = ct.shape[1]
    r = 0
    while r < rows:
        rend = min(r + 4, rows)
        t = 0
        if rend == r + 4:
            n = min(min(cnt[r], cnt[r + 1]), min(cnt[r + 2], cnt[r + 3]))
            a0 = acc[r]
            a1 = acc[r + 1]
            a2 = acc[r + 2]
            a3 = acc[r + 3]
            pa = sc[r]
            pb = sc[r + 1]
            pc = sc[r + 2]
            pd = sc[r + 3]
            while t + 4 <= n:
                c0 = ct[t]
                c1 = ct[t + 1]
                c2 = ct[t + 2]
                c3 = ct[t + 3]
                x0, x1, x2, x3 = pa[t], pa[t + 1], pa[t + 2], pa[t + 3]
                y0, y1, y2, y3 = pb[t], pb[t + 1], pb[t + 2], pb[t + 3]
                z0, z1, z2, z3 = pc[t], pc[t + 1], pc[t + 2], pc[t + 3]
                w0, w1, w2, w3 = pd[t], pd[t + 1], pd[t + 2], pd[t + 3]
                for e in range(dc):
                    v0 = c0[e]
                    v1 = c1[e]
                    v2 = c2[e]
                    v3 = c3[e]
                    a0[e] += x0 * v0 + x1 * v1 + x2 * v2 + x3 * v3
                    a1[e] += y0 * v0 + y1 * v1 + y2 * v2 + y3 * v3
                    a2[e] += z0 * v0 + z1 * v1 + z2 * v2 + z3 * v3
                    a3[e] += w0 * v0 + w1 * v1 + w2 * v2 + w3 * v3
                t += 4
        for rr in range(r, rend):
            a = acc[rr]
            p = sc[rr]
            for tt in range(t, cnt[rr]):
                pt = p[tt]
                c = ct[tt]
                for e in range(dc):
                    a[e] += pt * c[e]
        r = rend


@njit(cache=True, fastmath=_FM)
def attend_task(
    ti, q, qr, pages, pages16, pages32, table, seq_lens, seq_ids, sink_buf, local_buf, prot_bf16, lay, tau,
    task_b, task_h0, task_p0, task_p1, task_part, head_block, out, lse, part_o, part_lse,
) -> None:
    """Task ``ti`` of :func:`attend_tasks` (same arguments)."""
    s_q = q.shape[1]
    n_heads = q.shape[2]
    p = lay[L_P]
    dc = lay[L_DC]
    dr = lay[L_DR]
    quant = lay[L_QUANT] != 0
    ngc = lay[L_NGC]
    ngr = lay[L_NGR]
    num_pages = pages.shape[0]
    n_seqs = min(sink_buf.shape[0], local_buf.shape[0])
    sink = sink_buf.shape[1]
    local = local_buf.shape[1]
    neg_inf = np.float32(-np.inf)
    b = task_b[ti]
    h0 = task_h0[ti]
    nh = min(head_block, n_heads - h0)
    rows = s_q * nh
    length = seq_lens[b]
    seq = seq_ids[b]
    seq_ok = seq >= 0 and seq < n_seqs
    n_sink = min(sink, length)
    first_local = max(length - local, n_sink)
    qt = np.empty((rows, dc), np.float32)
    qrt = np.empty((rows, dr), np.float32)
    lim = np.empty(rows, np.int64)
    for s in range(s_q):
        for hh in range(nh):
            r = s * nh + hh
            lim[r] = length - s_q + s + 1
            for e in range(dc):
                qt[r, e] = q[b, s, h0 + hh, e] * tau
            for e in range(dr):
                qrt[r, e] = qr[b, s, h0 + hh, e] * tau
    acc = np.zeros((rows, dc), np.float32)
    m = np.full(rows, neg_inf, np.float32)
    l = np.zeros(rows, np.float32)
    cnt = np.zeros(rows, np.int64)
    ct = np.empty((p, dc), np.float32)
    kt = np.empty((p, dr), np.float32)
    ctu = ct.view(np.uint32)
    ktu = kt.view(np.uint32)
    sc = np.empty((rows, p), np.float32)
    csc = np.empty((p, max(ngc, 1)), np.float32)
    cscu = csc.view(np.uint32)
    rsc = np.empty((p, max(ngr, 1)), np.float32)
    for pi in range(task_p0[ti], task_p1[ti]):
        n0 = pi * p
        nv = min(p, length - n0)
        if nv <= 0:
            break
        page = table[b, pi]
        page_ok = page >= 0 and page < num_pages
        # ---- dequantize the tile once; protected tokens then come from their buffers
        if not page_ok:
            ct[:nv, :] = 0.0
            kt[:nv, :] = 0.0
        elif quant:
            dequant_page(pages[page], pages16[page], pages32[page], lay, nv, ct, kt, csc, cscu, rsc)
        else:
            for t in range(nv):
                base = (lay[L_OFF_CC] + t * lay[L_CC_BYTES]) // 2
                for e in range(dc):
                    ctu[t, e] = np.uint32(pages16[page, base + e]) << np.uint32(16)
                base = (lay[L_OFF_RC] + t * lay[L_RC_BYTES]) // 2
                for e in range(dr):
                    ktu[t, e] = np.uint32(pages16[page, base + e]) << np.uint32(16)
        if seq_ok:
            for t in range(min(nv, n_sink - n0)):
                load_protected(sink_buf, seq, n0 + t, dc, dr, ctu[t], ktu[t], prot_bf16)
            if local > 0:
                for t in range(max(0, first_local - n0), nv):
                    load_protected(local_buf, seq, (n0 + t) % local, dc, dr, ctu[t], ktu[t], prot_bf16)
        # ---- scores, then the online-softmax update (causal limit is a prefix per row)
        qk_tile(qt, qrt, ct, kt, rows, nv, sc)
        for r in range(rows):
            nvr = min(nv, lim[r] - n0)
            if nvr <= 0:
                cnt[r] = 0
                continue
            cnt[r] = nvr
            mx = sc[r, 0]
            for t in range(1, nvr):
                mx = max(mx, sc[r, t])
            m_new = max(m[r], mx)
            alpha = np.exp(m[r] - m_new)
            total = np.float32(0.0)
            for t in range(nvr):
                e_t = np.exp(sc[r, t] - m_new)
                sc[r, t] = e_t
                total += e_t
            l[r] = l[r] * alpha + total
            if alpha != 1.0:
                for e in range(dc):
                    acc[r, e] *= alpha
            m[r] = m_new
        pv_tile(sc, ct, acc, rows, cnt)
    # ---- finish: normalise, write out / partials
    part = task_part[ti]
    for s in range(s_q):
        for hh in range(nh):
            r = s * nh + hh
            if l[r] > 0.0:
                inv = np.float32(1.0) / l[r]
                lse_r = m[r] + np.log(l[r])
            else:
                inv = np.float32(0.0)
                lse_r = neg_inf
            if part < 0:
                for e in range(dc):
                    out[b, s, h0 + hh, e] = acc[r, e] * inv
                lse[b, s, h0 + hh] = lse_r
            else:
                for e in range(dc):
                    part_o[part, r, e] = acc[r, e] * inv
                part_lse[part, r] = lse_r


@njit(cache=True, parallel=True, fastmath=_FM)
def attend_tasks(
    q, qr, pages, pages16, pages32, table, seq_lens, seq_ids, sink_buf, local_buf, prot_bf16, lay, tau,
    task_b, task_h0, task_p0, task_p1, task_part, head_block, out, lse, part_o, part_lse,
) -> None:
    """Run every task: request ``task_b[i]``, heads ``[task_h0[i], +head_block)``, pages
    ``[task_p0[i], task_p1[i])`` of its block-table row.

    q float32 ``[B, S_q, H, d_c]``, qr ``[B, S_q, H, d_r]``; pages uint8 ``[num_pages, page_bytes]``
    with uint16/float32 views; table/seq_lens/seq_ids int64; sink_buf/local_buf uint16 bits (see
    :func:`load_protected`). ``task_part[i] < 0``: the task
    covers its whole request and writes ``out [B, S_q, H, d_c]`` / ``lse [B, S_q, H]`` directly;
    otherwise it writes ``part_o[task_part[i], rows, d_c]`` (normalised) and
    ``part_lse[task_part[i], rows]``, rows ordered (query, head). Pages outside the cache read
    as zeros (never out of bounds); rows that see no token get out 0 and lse -inf.
    """
    for ti in prange(task_b.shape[0]):
        attend_task(ti, q, qr, pages, pages16, pages32, table, seq_lens, seq_ids, sink_buf, local_buf, prot_bf16,
                    lay, tau, task_b, task_h0, task_p0, task_p1, task_part, head_block, out, lse, part_o, part_lse)


@njit(cache=True)
def merge_splits(group_b, group_h0, group_start, group_end, head_block, part_o, part_lse, out, lse) -> None:
    """Combine the partial results ``part_o[group_start[i]:group_end[i]]`` of request
    ``group_b[i]``, heads ``[group_h0[i], +head_block)``, by log-sum-exp into out/lse
    (float64 weights; splits whose rows saw no token carry lse -inf and weigh 0)."""
    s_q = out.shape[1]
    n_heads = out.shape[2]
    dc = out.shape[3]
    for gi in range(group_b.shape[0]):  # light work: serial keeps compile time down
        b = group_b[gi]
        h0 = group_h0[gi]
        nh = min(head_block, n_heads - h0)
        k0 = group_start[gi]
        k1 = group_end[gi]
        for s in range(s_q):
            for hh in range(nh):
                r = s * nh + hh
                mx = -np.inf
                for k in range(k0, k1):
                    mx = max(mx, np.float64(part_lse[k, r]))
                o = out[b, s, h0 + hh]
                o[:] = 0.0
                if mx == -np.inf:
                    lse[b, s, h0 + hh] = -np.inf
                    continue
                total = 0.0
                for k in range(k0, k1):
                    total += np.exp(np.float64(part_lse[k, r]) - mx)
                for k in range(k0, k1):
                    w = np.float32(np.exp(np.float64(part_lse[k, r]) - mx) / total)
                    if w > 0.0:
                        for e in range(dc):
                            o[e] += w * part_o[k, r, e]
                lse[b, s, h0 + hh] = np.float32(mx + np.log(total))
