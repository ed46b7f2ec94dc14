"""Split-KV decode attention kernels over packed pages (DESIGN.md §2, §3.4, §3.5).

``split_kernel`` — grid ``(num_splits, B, row_blocks)``. A program takes one request, one
block of BLOCK_R query rows (row r = i * H + h for query token i and head h) and one
contiguous share of that request's *packed* token range ``[min(sink, L), max(L - local, ·))``,
walks it in tiles of BLOCK_N tokens (one page or part of one), and keeps an online softmax.

Tokens are the M dimension of both matrix products and query rows the N dimension. Each
token vector is cut into NS slices of CW consecutive elements (``__init__.slice_width``):
one bit-plane of one run of bytes, inside one quantization group. With codes ``q``, scale
``s`` and zero ``z`` of the slice's group (per token), and ``B`` = 128 when codes are turned
into bfloat16 by the bit trick ``bits(code | 0x4300) = 128 + code`` (0 otherwise):

    QK:  qc . c[n]   = sum_slices s[n] * ( (B + q[n]) . qc_slice  -  (B + z[n]) * sum(qc_slice) )
    PV:  out_slice  += sum_n (p[n] s[n]) (B + q[n])  -  sum_n (p[n] s[n]) (B + z[n])

so scales and zero points are applied once per token and slice on the query / probability
side (never per element), and codes enter ``tl.dot`` as exact small integers. Batched
(3-D) dots over the slices keep every slice's accumulator separate. The partial result of a
split is stored normalised, with its log2-sum-exp. The zero-point term is subtracted per tile
(not in a running sum) to keep the +128 bias from cancelling catastrophically.

``protect_kernel`` — grid ``(B, row_blocks, parts)``: a run of tiles of the sink and local-window tokens from the
protection buffers per program (same softmax), written as one more partial; where B x row_blocks leaves SMs idle the
tiles split into the parts that take the fewest waves x tiles a part, all of them in one program where it fills the
GPU (``heuristics.protect_parts``).

``merge_kernel`` — grid ``(B, row_blocks, d_c / BLOCK_C)``: merges the splits' and protected tiles' partials by
log-sum-exp, a block of channels per program, and writes ``out`` and ``lse`` (natural log). Until stop 45 one
program per request and row block attended the protected tiles one after another and then merged the partials
one at a time (each a dependent round trip): at B = 8 that was 8 programs for the whole request.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common_kernels import (bf16_bits_to_f32, channel_of, load_f32, pdl_launch_dependents, pdl_wait, store_f32,
                             to_channel_order)

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _dot(a, b, DOT_BF16: tl.constexpr):
    """``tl.dot`` with float32 accumulation; float32 operands in full IEEE precision (not TF32,
    which misses the float32 tolerance of DESIGN.md §8 on GPUs)."""
    if DOT_BF16:
        return tl.dot(a, b)
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _slice_codes(
    page_ptr,  # uint8 pointer to the page
    tp,  # [BLOCK_N] token offsets inside the page
    ok,  # scalar: page index valid
    BITS: tl.constexpr,
    D: tl.constexpr,
    CW: tl.constexpr,
    CODES_OFF: tl.constexpr,
    BIAS: tl.constexpr,
    DOT_DT: tl.constexpr,
):
    """Codes (or BF16 values) of BLOCK_N tokens as ``[NS, BLOCK_N, CW]`` in DOT_DT.

    Quantized: ``B + code`` (B = BIAS); slice ``sl`` = plane ``sl // NCH`` of bytes
    ``(sl % NCH) * CW + j``. BITS == 16: BF16 values, slice ``sl`` = elements ``sl*CW + j``.
    """
    NS: tl.constexpr = D // CW
    sl = tl.arange(0, NS)[:, None, None]
    j = tl.arange(0, CW)[None, None, :]
    tok = tp[None, :, None]
    if BITS == 16:
        p16 = (page_ptr + CODES_OFF).to(tl.pointer_type(tl.uint16))
        v = tl.load(p16 + tok * D + sl * CW + j, mask=ok, other=0)
        vals = bf16_bits_to_f32(v)
        return vals.to(DOT_DT)
    else:
        BYTES: tl.constexpr = D * BITS // 8
        NCH: tl.constexpr = BYTES // CW
        raw = tl.load(page_ptr + CODES_OFF + tok * BYTES + (sl % NCH) * CW + j, mask=ok, other=0).to(tl.int32)
        code = (raw >> ((sl // NCH) * BITS)) & ((1 << BITS) - 1)
        if BIAS == 128:
            return (code | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            return code.to(DOT_DT)


@triton.jit
def _slice_scales(
    page_ptr, tp, valid, BITS: tl.constexpr, D: tl.constexpr, CW: tl.constexpr, G: tl.constexpr,
    SCALES_OFF: tl.constexpr, ZEROS_OFF: tl.constexpr, SCALE_BF16: tl.constexpr, BIAS: tl.constexpr,
):
    """Per (slice, token) scale and ``BIAS + zero`` as float32 ``[NS, BLOCK_N]``; 0 where not ``valid``."""
    NS: tl.constexpr = D // CW
    NG: tl.constexpr = D // G
    gi = (tl.arange(0, NS) * CW // G)[:, None]
    tok = tp[None, :]
    m = valid[None, :]
    if SCALE_BF16:
        sp = (page_ptr + SCALES_OFF).to(tl.pointer_type(tl.uint16))
        s = bf16_bits_to_f32(tl.load(sp + tok * NG + gi, mask=m, other=0))
    else:
        sp = (page_ptr + SCALES_OFF).to(tl.pointer_type(tl.float32))
        s = tl.load(sp + tok * NG + gi, mask=m, other=0.0)
    z = tl.load(page_ptr + ZEROS_OFF + tok * NG + gi, mask=m, other=0).to(tl.float32)
    return tl.where(m, s, 0.0), z + BIAS


@triton.jit
def _load_query_slices(q_ptr, rows, row_ok, D: tl.constexpr, CW: tl.constexpr, Q_BF16: tl.constexpr, DOT_DT: tl.constexpr):
    """Query rows as ``[NS, CW, BLOCK_R]`` (DOT_DT) and their per-slice sums ``[NS, BLOCK_R]`` (float32)."""
    NS: tl.constexpr = D // CW
    offs = rows[None, None, :].to(tl.int64) * D + tl.arange(0, NS)[:, None, None] * CW + tl.arange(0, CW)[None, :, None]
    q = load_f32(q_ptr, offs, row_ok[None, None, :], Q_BF16).to(DOT_DT)
    return q, tl.sum(q.to(tl.float32), axis=1)


@triton.jit
def split_tiles(L, SINK, LOCAL, NSPLIT, pid_s, BLOCK_N: tl.constexpr):
    """The packed token range ``[ps, pe)`` of a request of length ``L`` (between its sink and its
    local window) and split ``pid_s``'s tiles ``[t_lo, t_hi)`` of it (equal shares of whole tiles)."""
    ps = tl.minimum(SINK, L)
    pe = tl.maximum(L - LOCAL, ps)
    tb0 = ps // BLOCK_N
    tb1 = (pe + BLOCK_N - 1) // BLOCK_N
    per = (tb1 - tb0 + NSPLIT - 1) // NSPLIT
    t_lo = tb0 + pid_s * per
    return ps, pe, t_lo, tl.minimum(t_lo + per, tb1)


@triton.jit
def split_kernel(
    q_ptr,  # [B, R, DC] float32 / bfloat16, contiguous
    qr_ptr,  # [B, R, DR]
    pages_ptr,  # uint8 [num_pages, PAGE_BYTES]
    table_ptr,  # int32 [B, max_pages]
    lens_ptr,  # [B] int
    o_part_ptr,  # float32 [B, NSPLIT, R, DC]
    lse_part_ptr,  # float32 [B, NSPLIT, R] (log2 units)
    stride_table,
    num_pages,
    sm_scale_log2,
    R,
    H,
    S_Q,
    SINK,
    LOCAL,
    NSPLIT,
    Q_BF16: tl.constexpr,
    DOT_BF16: tl.constexpr,
    QUANT: tl.constexpr,
    DC: tl.constexpr,
    DR: tl.constexpr,
    CBITS: tl.constexpr,
    RBITS: tl.constexpr,
    CG: tl.constexpr,
    RG: tl.constexpr,
    CCW: tl.constexpr,
    RCW: tl.constexpr,
    P: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    C_CODES_OFF: tl.constexpr,
    R_CODES_OFF: tl.constexpr,
    C_SCALES_OFF: tl.constexpr,
    C_ZEROS_OFF: tl.constexpr,
    R_SCALES_OFF: tl.constexpr,
    R_ZEROS_OFF: tl.constexpr,
    C_SCALE_BF16: tl.constexpr,
    R_SCALE_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PROBE_SKIP_PV: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """One (split, request, row block): partial normalised output and log2-sum-exp.
    ``PROBE_SKIP_PV`` (benchmark probes only; wrong results) drops the PV product. ``PDL``: the merge kernel may
    launch once every program has left its tile loop (common_kernels.pdl_launch_dependents)."""
    pid_s = tl.program_id(0)
    b = tl.program_id(1)
    rb = tl.program_id(2)
    DOT_DT: tl.constexpr = tl.bfloat16 if DOT_BF16 else tl.float32
    CBIAS: tl.constexpr = 128 if ((DOT_BF16 and QUANT) and CBITS < 8) else 0  # triton 3.3: no chained `and`
    RBIAS: tl.constexpr = 128 if ((DOT_BF16 and QUANT) and RBITS < 8) else 0
    NSC: tl.constexpr = DC // CCW

    L = tl.load(lens_ptr + b).to(tl.int32)
    ps, pe, t_lo, t_hi = split_tiles(L, SINK, LOCAL, NSPLIT, pid_s, BLOCK_N)

    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    limit = L - S_Q + rows // H + 1  # row r (query i = r // H) sees tokens n < limit
    q_base = q_ptr + b.to(tl.int64) * R * DC
    qr_base = qr_ptr + b.to(tl.int64) * R * DR
    qc, qc_sum = _load_query_slices(q_base, rows, row_ok, DC, CCW, Q_BF16, DOT_DT)
    qr, qr_sum = _load_query_slices(qr_base, rows, row_ok, DR, RCW, Q_BF16, DOT_DT)

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([NSC, BLOCK_R, CCW], tl.float32)
    for t in range(t_lo, t_hi):
        n0 = t * BLOCK_N
        page = tl.load(table_ptr + b.to(tl.int64) * stride_table + n0 // P)
        page_ok = (page >= 0) & (page < num_pages)
        page_ptr = pages_ptr + tl.where(page_ok, page, 0).to(tl.int64) * PAGE_BYTES
        tp = n0 % P + tl.arange(0, BLOCK_N)
        n = n0 + tl.arange(0, BLOCK_N)
        tok_ok = (n >= ps) & (n < pe) & page_ok

        cc = _slice_codes(page_ptr, tp, page_ok, CBITS if QUANT else 16, DC, CCW, C_CODES_OFF, CBIAS, DOT_DT)
        rc = _slice_codes(page_ptr, tp, page_ok, RBITS if QUANT else 16, DR, RCW, R_CODES_OFF, RBIAS, DOT_DT)
        if QUANT:
            cs, cz = _slice_scales(page_ptr, tp, tok_ok, CBITS, DC, CCW, CG, C_SCALES_OFF, C_ZEROS_OFF, C_SCALE_BF16, CBIAS)
            rs, rz = _slice_scales(page_ptr, tp, tok_ok, RBITS, DR, RCW, RG, R_SCALES_OFF, R_ZEROS_OFF, R_SCALE_BF16, RBIAS)
            part_c = _dot(cc, qc, DOT_BF16)  # [NSC, BLOCK_N, BLOCK_R]
            part_r = _dot(rc, qr, DOT_BF16)
            score = tl.sum(cs[:, :, None] * (part_c - cz[:, :, None] * qc_sum[:, None, :]), axis=0)
            score += tl.sum(rs[:, :, None] * (part_r - rz[:, :, None] * qr_sum[:, None, :]), axis=0)
        else:
            cc = tl.where(tok_ok[None, :, None], cc, 0.0).to(DOT_DT)  # garbage in unowned slots
            rc = tl.where(tok_ok[None, :, None], rc, 0.0).to(DOT_DT)
            score = tl.sum(_dot(cc, qc, DOT_BF16), axis=0) + tl.sum(_dot(rc, qr, DOT_BF16), axis=0)
        vis = tok_ok[:, None] & (n[:, None] < limit[None, :])
        score = tl.where(vis, score * sm_scale_log2, float("-inf"))  # [BLOCK_N, BLOCK_R]

        m_new = tl.maximum(m_i, tl.max(score, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(score - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        pt = tl.trans(p)  # [BLOCK_R, BLOCK_N]
        if QUANT:
            pg = (pt[None, :, :] * cs[:, None, :]).to(DOT_DT)  # [NSC, BLOCK_R, BLOCK_N]
            # the zero-point correction is applied per tile, before the running sum: with the
            # +128 code bias a separate running correction cancels catastrophically (seen on
            # an H200: tensor-core fp32 accumulation loses low bits over hundreds of tiles)
            corr = tl.sum(pg.to(tl.float32) * cz[:, None, :], axis=2)  # [NSC, BLOCK_R]
            if PROBE_SKIP_PV:
                pv = -corr[:, :, None]
            else:
                pv = _dot(pg, cc, DOT_BF16) - corr[:, :, None]
        else:
            pg = tl.broadcast_to(pt[None, :, :], [NSC, BLOCK_R, BLOCK_N]).to(DOT_DT)
            pv = _dot(pg, cc, DOT_BF16)
        acc = acc * alpha[None, :, None] + pv
        m_i = m_new

    pdl_launch_dependents(PDL)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[None, :, None]
    lse2 = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
    part = (b.to(tl.int64) * NSPLIT + pid_s) * R
    o_offs = (part + rows[None, :, None]) * DC + tl.arange(0, NSC)[:, None, None] * CCW + tl.arange(0, CCW)[None, None, :]
    tl.store(o_part_ptr + o_offs, o, mask=row_ok[None, :, None])
    tl.store(lse_part_ptr + part + rows, lse2, mask=row_ok)


@triton.jit
def protect_kernel(
    q_ptr,  # [B, R, DC]
    qr_ptr,  # [B, R, DR]
    sink_ptr,  # [max_seqs, SINK, DC + DR]
    local_ptr,  # [max_seqs, LOCAL, DC + DR]
    lens_ptr,  # [B]
    ids_ptr,  # [B]
    o_prot_ptr,  # float32 [B, NPT, R, DC]
    lse_prot_ptr,  # float32 [B, NPT, R]
    max_seqs,
    sm_scale_log2,
    R,
    H,
    S_Q,
    SINK,
    LOCAL,
    NPT,
    TILES,
    Q_BF16: tl.constexpr,
    DOT_BF16: tl.constexpr,
    PROT_BF16: tl.constexpr,
    DC: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (b, rb, j): protected tiles ``j * TILES .. j * TILES + TILES - 1`` (BLOCK_T positions each of the sink
    then the local window) for query rows block rb of request b -> their partial j of NPT (normalised output,
    log2-sum-exp), as a split's. ``PDL``: launched with ``launch_pdl`` after the split kernel, whose partials it does
    not read; it lets the merge launch after its tiles and ends only after the split kernel has (the merge waits for
    this kernel alone)."""
    b = tl.program_id(0)
    rb = tl.program_id(1)
    j = tl.program_id(2)
    DOT_DT: tl.constexpr = tl.bfloat16 if DOT_BF16 else tl.float32
    W: tl.constexpr = DC + DR
    L = tl.load(lens_ptr + b).to(tl.int32)
    seq = tl.load(ids_ptr + b).to(tl.int64)
    seq_ok = (seq >= 0) & (seq < max_seqs)
    seq = tl.where(seq_ok, seq, 0)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    limit = L - S_Q + rows // H + 1
    dc = tl.arange(0, DC)
    dr = tl.arange(0, DR)
    q_offs = (b.to(tl.int64) * R + rows[:, None]) * DC + dc[None, :]
    qc = load_f32(q_ptr, q_offs, row_ok[:, None], Q_BF16).to(DOT_DT)  # [BLOCK_R, DC]
    qr_offs = (b.to(tl.int64) * R + rows[:, None]) * DR + dr[None, :]
    qr = load_f32(qr_ptr, qr_offs, row_ok[:, None], Q_BF16).to(DOT_DT)

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, DC], tl.float32)
    n_sink = tl.minimum(SINK, L)
    first_local = tl.maximum(L - LOCAL, n_sink)
    for k in range(0, TILES):
        t = (j * TILES + k) * BLOCK_T + tl.arange(0, BLOCK_T)
        is_sink = t < SINK
        n = tl.where(is_sink, t, first_local + t - SINK)
        valid = seq_ok & tl.where(is_sink, t < n_sink, (t < SINK + LOCAL) & (n < L))
        ring = tl.where(is_sink, 0, n % tl.maximum(LOCAL, 1))
        s_row = (seq * SINK + tl.where(is_sink & valid, t, 0)) * W
        l_row = (seq * LOCAL + tl.where(valid & ~is_sink, ring, 0)) * W
        ms = (valid & is_sink)[:, None]
        ml = (valid & ~is_sink)[:, None]
        kc = load_f32(sink_ptr, s_row[:, None] + dc[None, :], ms, PROT_BF16) + load_f32(local_ptr, l_row[:, None] + dc[None, :], ml, PROT_BF16)
        kr = load_f32(sink_ptr, s_row[:, None] + DC + dr[None, :], ms, PROT_BF16) + load_f32(local_ptr, l_row[:, None] + DC + dr[None, :], ml, PROT_BF16)
        kc = kc.to(DOT_DT)
        score = _dot(qc, tl.trans(kc), DOT_BF16) + _dot(qr, tl.trans(kr.to(DOT_DT)), DOT_BF16)  # [BLOCK_R, BLOCK_T]
        vis = valid[None, :] & (n[None, :] < limit[:, None])
        score = tl.where(vis, score * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(score, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(score - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(DOT_DT), kc, DOT_BF16)
        m_i = m_new
    pdl_launch_dependents(PDL)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    part = (b.to(tl.int64) * NPT + j) * R
    tl.store(o_prot_ptr + (part + rows[:, None]) * DC + dc[None, :], acc / l_safe[:, None], mask=row_ok[:, None])
    tl.store(lse_prot_ptr + part + rows, tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf")), mask=row_ok)
    pdl_wait(PDL)


@triton.jit
def _merge_partials(o_ptr, lse_ptr, b, NS, R, rows, row_ok, cols, m, l, acc, DC: tl.constexpr, SC: tl.constexpr):
    """Fold the ``NS`` partials of request b (o float32 [B, NS, R, DC], lse float32 [B, NS, R], log2 units) into the
    running merge of query rows ``rows``: ``m`` [BLOCK_R] the largest log2-sum-exp so far, ``l`` [BLOCK_R] the weights'
    sum and ``acc`` [BLOCK_R, BLOCK_C] the weighted outputs' channels ``cols``, both relative to 2^m. SC partials a
    step, their lse and outputs loaded together (neither load waits for the other). Every slot read was written: an
    empty split stores zeros and lse -inf."""
    for s0 in range(0, NS, SC):
        s = s0 + tl.arange(0, SC)
        ok = (s < NS)[:, None] & row_ok[None, :]  # [SC, BLOCK_R]
        part = (b.to(tl.int64) * NS + s[:, None]) * R + rows[None, :]
        lse = tl.load(lse_ptr + part, mask=ok, other=float("-inf"))
        o = tl.load(o_ptr + part[:, :, None] * DC + cols[None, None, :], mask=ok[:, :, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)  # 0 while nothing was merged (m = -inf)
        w = tl.exp2(lse - m_safe[None, :])
        l = l * alpha + tl.sum(w, axis=0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=0)
        m = m_new
    return m, l, acc


@triton.jit
def merge_kernel(
    o_part_ptr,  # float32 [B, NSPLIT, R, DC]
    lse_part_ptr,  # float32 [B, NSPLIT, R]
    o_prot_ptr,  # float32 [B, NPT, R, DC]
    lse_prot_ptr,  # float32 [B, NPT, R]
    out_ptr,  # [B, R, DC] float32 / bfloat16
    lse_ptr,  # float32 [B, R]
    R,
    NSPLIT,
    NPT,
    Q_BF16: tl.constexpr,
    DC: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SC: tl.constexpr,
    SCP: tl.constexpr,
    PDL: tl.constexpr = False,
    CHANNEL_ORDER: tl.constexpr = False,
):
    """Program (b, rb, cb): channels ``cb * BLOCK_C ..`` of query rows block rb of request b, merged over the
    splits' partials (SC a load) and the protected parts' (SCP a load) by log-sum-exp in one pass; ``lse`` (natural
    log) from the programs with cb = 0. ``PDL``: launched with ``launch_pdl``, it waits for the kernel before it before
    its first load: the split kernel (the protected-tile kernel, launched before it without PDL, has ended before it
    starts), or with PDL mode 2 the protected-tile kernel, which ends only after the split kernel. ``CHANNEL_ORDER``
    (kernel v4 over packed pages): the split partials' column ``j`` holds channel ``channel_of(j)``, as v4's key tiles
    do, so that v4 stores them in whole pairs; the protected parts are read through it, and the merged channels are
    put back in plain order in registers before the store."""
    b = tl.program_id(0)
    rb = tl.program_id(1)
    cb = tl.program_id(2)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    pdl_wait(PDL)
    m, l, acc = _merge_partials(o_part_ptr, lse_part_ptr, b, NSPLIT, R, rows, row_ok, cols, m, l, acc, DC, SC)
    if CHANNEL_ORDER:  # acc's column j holds channel channel_of(j): the protected parts are read through the map
        tl.static_assert(BLOCK_C % 4 == 0, "the channel order moves channels within groups of 4")
        m, l, acc = _merge_partials(o_prot_ptr, lse_prot_ptr, b, NPT, R, rows, row_ok, channel_of(cols), m, l, acc,
                                    DC, SCP)
        acc = to_channel_order(acc, BLOCK_R, BLOCK_C)  # back to plain order in registers: whole-vector stores
    else:
        m, l, acc = _merge_partials(o_prot_ptr, lse_prot_ptr, b, NPT, R, rows, row_ok, cols, m, l, acc, DC, SCP)
    l_safe = tl.where(l > 0.0, l, 1.0)
    out_offs = (b.to(tl.int64) * R + rows[:, None]) * DC + cols[None, :]
    store_f32(out_ptr, out_offs, acc / l_safe[:, None], row_ok[:, None], Q_BF16)
    lse = tl.where(l > 0.0, (m + tl.log2(l_safe)) * LN2, float("-inf"))
    tl.store(lse_ptr + b.to(tl.int64) * R + rows, lse, mask=row_ok & (cb == 0))
