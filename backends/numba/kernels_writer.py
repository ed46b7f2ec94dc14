"""Numba kernel of the fused writer: quantize + split-half pack + slot-mapped page write +
sink/ring protection, one pass over the tokens, parallel over chunks of tokens.

All sizes and byte offsets come from the layout vector of :func:`.common.layout_vector`
(derived from the PackFormat); nothing here knows a byte offset of its own. The quantizer
runs in float32 with true division and round-half-to-even, so its codes equal the
reference's (DESIGN.md §3.1).
"""

from __future__ import annotations

import math

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

_BF16_MAX = 3.3895313892515355e38  # largest finite bfloat16
_F32_MAX = 3.4028234663852886e38  # largest finite float32


@njit(cache=True)
def bf16_bits(b: np.uint32) -> np.uint16:
    """float32 bit pattern -> bfloat16 bit pattern, round to nearest even (the reference's rule)."""
    w = np.uint64(b)
    return np.uint16((w + np.uint64(0x7FFF) + ((w >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16))


@njit(cache=True, fastmath={"nnan", "ninf", "nsz"})
def group_range(x, e0, e1):
    """``(min(min(x[e0:e1]), 0), max(max(x[e0:e1]), 0))`` of finite float32 values."""
    lo = np.float32(0.0)
    hi = np.float32(0.0)
    for e in range(e0, e1):
        v = x[e]
        lo = min(lo, v)
        hi = max(hi, v)
    return lo, hi


@njit(cache=True)
def quantize_vector(x, d, group, bits, bf16_scale, codes, scales, zeros, one_f, one_u) -> None:
    """x float32 ``[d]`` (finite) -> codes uint8 ``[d]``, scales float32 ``[d/G]`` (the stored
    value), zeros uint8 ``[d/G]``. ``one_f``/``one_u``: a float32 [1] scratch and its uint32 view."""
    m = np.float32((1 << bits) - 1)
    zero = np.float32(0.0)
    for g in range(d // group):
        e0 = g * group
        lo, hi = group_range(x, e0, e0 + group)
        s = max(hi - lo, np.float32(1e-8)) / m
        if bf16_scale:
            one_f[0] = min(s, np.float32(_BF16_MAX))
            one_u[0] = np.uint32(bf16_bits(one_u[0])) << np.uint32(16)
            s = one_f[0]
        else:
            s = min(s, np.float32(_F32_MAX))
        z = min(max(np.rint(-lo / s), zero), m)
        for e in range(e0, e0 + group):
            q = min(max(np.rint(x[e] / s) + z, zero), m)
            codes[e] = np.uint8(q)
        scales[g] = s
        zeros[g] = np.uint8(z)


@njit(cache=True)
def pack_into(codes, d, bits, row, base) -> None:
    """Split-half pack codes uint8 ``[d]`` at ``bits`` into ``row[base : base + d*bits/8]``."""
    if bits == 8:
        for j in range(d):
            row[base + j] = codes[j]
        return
    k = 8 // bits
    n = d // k
    for j in range(n):
        row[base + j] = codes[j]
    for i in range(1, k):
        sh = i * bits
        for j in range(n):
            row[base + j] = row[base + j] | (codes[i * n + j] << sh)


@njit(cache=True)
def load_bits(src, t, n, is_bf16, dst_u, base) -> None:
    """Row ``t`` of n values in bit form (uint16: bfloat16 ``[.., n]`` or float32 halves
    ``[.., 2n]``) -> float32 bit patterns ``dst_u[base : base + n]`` (uint32)."""
    if is_bf16:
        for e in range(n):
            dst_u[base + e] = np.uint32(src[t, e]) << np.uint32(16)
    else:
        for e in range(n):
            dst_u[base + e] = np.uint32(src[t, 2 * e]) | (np.uint32(src[t, 2 * e + 1]) << np.uint32(16))


@njit(cache=True)
def store_protected(buf, seq, col, xu, width, prot_bf16) -> None:
    """Copy one token's pre-quantization values (float32 bits ``xu``) into ``buf[seq, col]``:
    uint16 bfloat16 ``[.., width]`` (rounded to nearest even) or float32 halves ``[.., 2 width]``."""
    if prot_bf16:
        for e in range(width):
            buf[seq, col, e] = bf16_bits(xu[e])
    else:
        for e in range(width):
            buf[seq, col, 2 * e] = np.uint16(xu[e] & np.uint32(0xFFFF))
            buf[seq, col, 2 * e + 1] = np.uint16(xu[e] >> np.uint32(16))


@njit(cache=True)
def write_chunk(
    ci, pages, pages16, pages32, c_in, r_in, in_bf16, slots, seq_ids, positions, seq_lens,
    sink_buf, local_buf, prot_bf16, lay, chunk,
) -> None:
    """Tokens ``[ci * chunk, (ci + 1) * chunk)`` of :func:`write_tokens` (same arguments)."""
    n_tok = slots.shape[0]
    p = lay[L_P]
    dc = lay[L_DC]
    dr = lay[L_DR]
    quant = lay[L_QUANT] != 0
    width = dc + dr
    num_slots = pages.shape[0] * p
    max_seqs = min(seq_lens.shape[0], min(sink_buf.shape[0], local_buf.shape[0]))
    sink = sink_buf.shape[1]
    local = local_buf.shape[1]
    ngc = lay[L_NGC]
    ngr = lay[L_NGR]
    xf = np.empty(width, np.float32)
    xu = xf.view(np.uint32)
    qx = np.empty(width, np.float32)
    codes = np.empty(width, np.uint8)
    csc = np.empty(max(ngc, 1), np.float32)
    czr = np.empty(max(ngc, 1), np.uint8)
    rsc = np.empty(max(ngr, 1), np.float32)
    rzr = np.empty(max(ngr, 1), np.uint8)
    cscu = csc.view(np.uint32)
    one_f = np.empty(1, np.float32)
    one_u = one_f.view(np.uint32)
    for t in range(ci * chunk, min(n_tok, (ci + 1) * chunk)):
        slot = slots[t]
        if slot < 0 or slot >= num_slots:
            continue
        page = slot // p
        off = slot - page * p
        row = pages[page]
        load_bits(c_in, t, dc, in_bf16, xu, 0)
        load_bits(r_in, t, dr, in_bf16, xu, dc)
        if quant:
            for e in range(width):
                v = xf[e]
                qx[e] = v if math.isfinite(v) else np.float32(0.0)
            quantize_vector(qx[:dc], dc, lay[L_GC], lay[L_BC], True, codes, csc, czr, one_f, one_u)
            pack_into(codes, dc, lay[L_BC], row, lay[L_OFF_CC] + off * lay[L_CC_BYTES])
            s16 = lay[L_OFF_CS] // 2 + off * ngc
            z8 = lay[L_OFF_CZ] + off * ngc
            for g in range(ngc):
                pages16[page, s16 + g] = np.uint16(cscu[g] >> np.uint32(16))  # already bf16-exact
                row[z8 + g] = czr[g]
            quantize_vector(qx[dc:], dr, lay[L_GR], lay[L_BR], False, codes, rsc, rzr, one_f, one_u)
            pack_into(codes, dr, lay[L_BR], row, lay[L_OFF_RC] + off * lay[L_RC_BYTES])
            s32 = lay[L_OFF_RS] // 4 + off * ngr
            z8 = lay[L_OFF_RZ] + off * ngr
            for g in range(ngr):
                pages32[page, s32 + g] = rsc[g]
                row[z8 + g] = rzr[g]
        else:
            base = (lay[L_OFF_CC] + off * lay[L_CC_BYTES]) // 2
            for e in range(dc):
                pages16[page, base + e] = bf16_bits(xu[e])
            base = (lay[L_OFF_RC] + off * lay[L_RC_BYTES]) // 2
            for e in range(dr):
                pages16[page, base + e] = bf16_bits(xu[dc + e])
        seq = seq_ids[t]
        pos = positions[t]
        if seq < 0 or seq >= max_seqs or pos < 0:
            continue
        if pos < sink:
            store_protected(sink_buf, seq, pos, xu, width, prot_bf16)
        if local > 0 and pos >= seq_lens[seq] - local:
            store_protected(local_buf, seq, pos % local, xu, width, prot_bf16)


@njit(cache=True, parallel=True)
def write_tokens(
    pages, pages16, pages32, c_in, r_in, in_bf16, slots, seq_ids, positions, seq_lens,
    sink_buf, local_buf, prot_bf16, lay, chunk,
) -> None:
    """Write N tokens into the packed pages and the protection buffers, in place.

    pages uint8 ``[num_pages, page_bytes]`` with its uint16 and float32 views ``pages16``/``pages32``;
    c_in ``[N, d_c]``, r_in ``[N, d_r]``: uint16 bfloat16 bits when ``in_bf16``, else float32
    bits as uint16 halves (``[N, 2 d_c]``, ``[N, 2 d_r]``); slots/seq_ids/positions int64 ``[N]``;
    seq_lens int64 ``[max_seqs]``; sink_buf/local_buf uint16 ``[max_seqs, sink|local, w]`` with
    w = d_c + d_r (bfloat16 bits, ``prot_bf16``) or 2 (d_c + d_r) (float32 halves). Every value
    travels as bits so that one compiled signature serves all dtypes.
    A token whose slot is negative or beyond the cache is skipped entirely; protection is written
    only for seq ids inside the buffers and positions >= 0.
    """
    n_chunks = (slots.shape[0] + chunk - 1) // chunk
    for ci in prange(n_chunks):
        write_chunk(ci, pages, pages16, pages32, c_in, r_in, in_bf16, slots, seq_ids, positions, seq_lens,
                    sink_buf, local_buf, prot_bf16, lay, chunk)
