"""Split-KV decode attention, kernel v3: 64 query rows per program, for many rows per request.

For requests with at least :data:`heuristics.V3_MIN_ROWS` query rows (S_q x H: DeepSeek-V3/R1
and Kimi-K2 decode at H = 128, H = 64, speculative decoding). Kernels v1/v2 take the query rows
as the N dimension, 16 per program, so at H = 128 eight programs unpack the same tokens. Here one
program takes BLOCK_R = 64 rows of one request and writes v1's partials, so
``attention_kernel.protect_kernel`` adds the protected tokens and ``merge_kernel`` merges the partials.

Per tile of BLOCK_N = 128 tokens and per chunk ``c`` (CW bytes of every token's code row, all
its bit planes dequantized and joined: ``[BLOCK_N, CW * PLANES]``, 128 channels at 4 bits, 256
at 2; column ``j*PLANES + pl`` is channel ``pl*BYTES + c*CW + j``; the query chunks are loaded in
the same order), with ``K_c = bf16(s * (code - zero))`` (``code - zero`` exact, one rounding, as
a BF16 cache stores the value):

    QK:  S^T  += K_c @ Q_c^T        [BLOCK_N, BLOCK_R]   tokens are M: 8 warps x 16 tokens
    PV:  O_c   = O_c * alpha + P @ K_c   [BLOCK_R, CW * PLANES]   rows are M, channels split by 2 warpgroups

Why this shape: Triton lays the warps of a dot whose result feeds another dot along M only, so a
64-row QK on 8 warps would be computed twice (two warpgroups, one m64 row block); with 128
tokens as M each warpgroup owns 64 of them. PV's result feeds no dot, so its warps split the
channels and the DC x 64 float32 output (128 registers per thread) is held once. Joining the
planes halves the number of products (9 wgmma per tile for C4R4, 18 with one per plane).
``PREFETCH`` loads all of a tile's code bytes before its first product (one program per SM
leaves nothing else to hide their latency). PV re-reads the bytes (L1 hits) with a second
loop-variant zero so that the compiler cannot keep the QK operands alive across the softmax.

Measured (H200, triton 3.6, CUDA graphs, FlashInfer BF16 in the same run; benchmarks/RESULTS.md
"Stop 17"): C4R4 H=128 B=32 L=32K 2,593 us = 4.4x FlashInfer (v2: 7.1-8.9x in the grids), BF16
pages 1,942 us = 3.3x, QK alone (``PROBE_SKIP_PV``) 1,610 us; 255 registers, 74 spilled. Limits:
every ``wgmma`` is waited on at once (no overlap with the dequantization) and one program per SM
(8 warps) leaves the load latencies exposed.

Operands (stop 50): content scales are bfloat16, so ``s * (code - zero)`` is one packed bfloat16
product per two elements (exact operands, one rounding, as the float32 product rounded once), and
``WORDS`` (``heuristics.v3_code_words``: 4-bit content) takes the codes from 32-bit words
(``code_words``), two per ``lop3``, in PTX on NVIDIA GPUs. Offline sm_90a, C4R4 tile loop: 5,298
instructions a thread before, 4,003 with the packed scaling, 2,848 with words. H100, CUDA graphs:
C4R4 H=128 B=32 L=32K 2,531 -> 1,640 us (2.8x FlashInfer BF16), C2R4 (bytes) 2,528 -> 1,921.

Stop 51: ``WORD_LANES`` (``heuristics.v3_word_lanes``) orders a chunk's word columns so that QK's operand is built in
its ``wgmma`` register layout (:func:`_word_operand`). 2-bit content now takes words in that order: H100, CUDA graphs,
C2R4 H=128 B=32 L=32K 1,924-1,933 -> 1,671-1,672 us (2.9x FlashInfer BF16). C4R4 ran slower in it and keeps 1.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention_kernel import split_tiles
from .attention_v2_kernel import (_codes, _load_bf16_vals, _load_raw, _scale_col, _scale_rows, _tuple_set,
                                  _zeros_tuple, _zsub, tile_pages)
from .code_words import load_words, quad_order, word_channels, word_pair
from .common_kernels import bf16_bits_to_f32, load_f32, pdl_launch_dependents


@triton.jit
def _dot_acc(a, b, acc, DOT_BF16: tl.constexpr):
    """``acc + a @ b`` accumulated in place (float32; float32 operands in IEEE precision)."""
    if DOT_BF16:
        return tl.dot(a, b, acc)
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _chunk_channels(c: tl.constexpr, CW: tl.constexpr, PLANES: tl.constexpr, BYTES: tl.constexpr,
                    WORDS: tl.constexpr = False, LANES: tl.constexpr = 1):
    """Channel of each column ``e`` of chunk ``c`` (bytes ``[c*CW, (c+1)*CW)``, all PLANES bit planes
    joined). Bytes: column ``j*PLANES + pl`` is element ``pl*BYTES + c*CW + j`` (split-half packing).
    ``WORDS``: :func:`_word_operand`'s order, ``code_words.word_channels``."""
    if WORDS:
        return word_channels(c * CW, CW, PLANES, BYTES, LANES)
    else:
        e = tl.arange(0, CW * PLANES)
        return (e % PLANES) * BYTES + c * CW + e // PLANES


@triton.jit
def _load_q_plane(q_base, rows, row_ok, ch0, D: tl.constexpr, CW: tl.constexpr, Q_BF16: tl.constexpr):
    """Query channels ``[ch0, ch0 + CW)`` of the rows as float32 ``[CW, BLOCK_M]`` (0 past R)."""
    return load_f32(q_base, rows[None, :] * D + (ch0 + tl.arange(0, CW))[:, None], row_ok[None, :], Q_BF16)


@triton.jit
def _load_q_chunks(q_base, rows, row_ok, D: tl.constexpr, BITS: tl.constexpr, CW: tl.constexpr,
                   Q_BF16: tl.constexpr, DOT_BF16: tl.constexpr, WORDS: tl.constexpr, LANES: tl.constexpr):
    """Query rows as a tuple of chunk operands ``[CW * PLANES, BLOCK_M]`` in the dot dtype, rows in
    the column order of :func:`_chunk_operand` (0 past R). BF16 pages: slices of CW channels.
    Bytes: each plane is loaded as a contiguous run of channels and interleaved in registers."""
    PLANES: tl.constexpr = 8 // BITS if BITS < 16 else 1
    BYTES: tl.constexpr = D * BITS // 8 if BITS < 16 else D
    qs = ()
    for c in tl.static_range(BYTES // CW):
        if WORDS:  # one gather in the column order of the word operands
            ch = _chunk_channels(c, CW, PLANES, BYTES, True, LANES)
            x = load_f32(q_base, rows[None, :] * D + ch[:, None], row_ok[None, :], Q_BF16)
        elif PLANES == 1:
            x = _load_q_plane(q_base, rows, row_ok, c * CW, D, CW, Q_BF16)
        else:
            x0 = _load_q_plane(q_base, rows, row_ok, c * CW, D, CW, Q_BF16)
            x1 = _load_q_plane(q_base, rows, row_ok, BYTES + c * CW, D, CW, Q_BF16)
            if PLANES == 2:  # join: [j, m, pl] -> [j, pl, m]
                x = tl.reshape(tl.permute(tl.join(x0, x1), (0, 2, 1)), [2 * CW, x0.shape[1]])
            else:  # [j, m, i, o] (plane 2i + o) -> [j, i, o, m]
                x2 = _load_q_plane(q_base, rows, row_ok, 2 * BYTES + c * CW, D, CW, Q_BF16)
                x3 = _load_q_plane(q_base, rows, row_ok, 3 * BYTES + c * CW, D, CW, Q_BF16)
                x = tl.reshape(tl.permute(tl.join(tl.join(x0, x2), tl.join(x1, x3)), (0, 2, 3, 1)),
                               [4 * CW, x0.shape[1]])
        if DOT_BF16:
            qs = qs + (x.to(tl.bfloat16),)
        else:
            qs = qs + (x,)
    return qs


@triton.jit
def _times_scale(k, s, SCALE_BF16: tl.constexpr, DOT_BF16: tl.constexpr):
    """``k * s`` in the dot dtype for exact ``k = code - zero`` and float32 scales ``s`` broadcast to it. A bfloat16
    scale times ``k`` is one packed bfloat16 product per two elements, rounded once: the same bits as the float32
    product (exact) rounded to bfloat16."""
    if DOT_BF16:
        if SCALE_BF16:
            return k * s.to(tl.bfloat16)
        else:
            return (k.to(tl.float32) * s).to(tl.bfloat16)
    else:
        return k * s


@triton.jit
def _plane_operand(raw, srow, zrow, tok_ok, pl: tl.constexpr, c: tl.constexpr, NCH: tl.constexpr,
                   CW: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, SCALE_BF16: tl.constexpr,
                   BIAS: tl.constexpr, DOT_BF16: tl.constexpr, ALT: tl.constexpr):
    """Dequantized plane ``pl`` of the chunk bytes ``raw`` ``[BLOCK_N, CW]``: ``s * (code - zero)`` in
    the dot dtype. ``code - zero`` is exact, so a bfloat16 operand is rounded once, as a BF16
    cache stores it. ``ALT``: see ``attention_v2_kernel._codes``."""
    s, zb = _scale_col(srow, zrow, tok_ok, (pl * NCH + c) * CW // G, SCALE_BF16, BIAS)
    k = _zsub(_codes(raw, pl, BITS, BIAS, DOT_BF16, ALT), zb, DOT_BF16)
    return _times_scale(k, s[:, None], SCALE_BF16, DOT_BF16)


@triton.jit
def _raw_operand(raw, srow, zrow, tok_ok, c: tl.constexpr, NCH: tl.constexpr, CW: tl.constexpr, G: tl.constexpr,
                 BITS: tl.constexpr, SCALE_BF16: tl.constexpr, BIAS: tl.constexpr, DOT_BF16: tl.constexpr,
                 ALT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Chunk ``c``'s bytes ``raw`` ``[BLOCK_N, CW]`` dequantized, every bit plane joined:
    ``[BLOCK_N, CW * PLANES]`` in :func:`_chunk_channels` column order."""
    k0 = _plane_operand(raw, srow, zrow, tok_ok, 0, c, NCH, CW, G, BITS, SCALE_BF16, BIAS, DOT_BF16, ALT)
    if BITS == 8:
        k = k0
    else:
        k1 = _plane_operand(raw, srow, zrow, tok_ok, 1, c, NCH, CW, G, BITS, SCALE_BF16, BIAS, DOT_BF16, ALT)
        if BITS == 4:
            k = tl.reshape(tl.join(k0, k1), [BLOCK_N, 2 * CW])
        else:
            k2 = _plane_operand(raw, srow, zrow, tok_ok, 2, c, NCH, CW, G, BITS, SCALE_BF16, BIAS, DOT_BF16, ALT)
            k3 = _plane_operand(raw, srow, zrow, tok_ok, 3, c, NCH, CW, G, BITS, SCALE_BF16, BIAS, DOT_BF16, ALT)
            # join adds a trailing axis: [n, j, i, o] = plane 2i + o
            k = tl.reshape(tl.join(tl.join(k0, k2), tl.join(k1, k3)), [BLOCK_N, 4 * CW])
    return k


@triton.jit
def _scaled_pair(w, s, zb, SHIFT: tl.constexpr, BITS: tl.constexpr, SCALE_BF16: tl.constexpr, BIAS: tl.constexpr,
                 DOT_BF16: tl.constexpr, ALT: tl.constexpr, PTX_SPLIT: tl.constexpr):
    """``s * (code - zero)`` of ``code_words.word_pair``'s codes, ``[N, W, 2]`` in the dot dtype (``s``, ``zb``:
    ``[N]`` float32 from ``_scale_col``). ``code - zero`` is exact; a bfloat16 scale times it is
    rounded once, in one packed product per two elements."""
    k = word_pair(w, SHIFT, BITS, BIAS, DOT_BF16, ALT, PTX_SPLIT)
    if DOT_BF16:
        k = k - zb.to(tl.bfloat16)[:, None, None]
    else:
        k = k - zb[:, None, None]
    return _times_scale(k, s[:, None, None], SCALE_BF16, DOT_BF16)


@triton.jit
def _join_bits(x):
    """A tuple of 2**k tensors ``[..., ]`` joined into ``[..., 2, ..., 2]`` (k axes) whose row-major
    order is the tuple's order (k = 1, 2, 3)."""
    if len(x) == 2:
        return tl.join(x[0], x[1])
    elif len(x) == 4:
        return tl.join(tl.join(x[0], x[2]), tl.join(x[1], x[3]))
    else:
        return tl.join(tl.join(tl.join(x[0], x[4]), tl.join(x[2], x[6])),
                       tl.join(tl.join(x[1], x[5]), tl.join(x[3], x[7])))


@triton.jit
def _word_operand(w, srow, zrow, tok_ok, c: tl.constexpr, NCH: tl.constexpr, CW: tl.constexpr, G: tl.constexpr,
                  BITS: tl.constexpr, SCALE_BF16: tl.constexpr, BIAS: tl.constexpr, DOT_BF16: tl.constexpr,
                  ALT: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr, LANES: tl.constexpr, groups=()):
    """Chunk ``c``'s words ``w`` ``[BLOCK_N, CW // 4]`` (2- and 4-bit codes) dequantized:
    ``[BLOCK_N, CW * PLANES]`` in the ``WORDS`` column order of :func:`_chunk_channels`. Every mask and
    OR works on two codes at once (the byte path of :func:`_raw_operand` takes one code each).

    The column order (``code_words.quad_order``) decides where QK's register operand is built; with ``LANES`` 4 only
    the raw words (a quarter of the bytes) and the scales change layout: the tile's (``groups``, from
    :func:`_tile_groups`) or the chunk's, each in one load (:func:`_group_values`)."""
    PLANES: tl.constexpr = 8 // BITS
    scales = ()
    zeros = ()
    if len(groups) > 0:  # the tile's, from _tile_groups
        for pl in tl.static_range(PLANES):
            scales = scales + (groups[0][(pl * NCH + c) * CW // G],)
            zeros = zeros + (groups[1][(pl * NCH + c) * CW // G],)
    elif LANES > 1:  # the chunk's PLANES groups in one load each, taken apart in registers (_group_values)
        gi = (tl.arange(0, PLANES) * NCH + c) * CW // G
        scales, zeros = _group_values(srow[:, None] + gi[None, :], zrow[:, None] + gi[None, :], tok_ok, SCALE_BF16,
                                      BIAS, BLOCK_N, PLANES)
    else:
        for pl in tl.static_range(PLANES):
            s, zb = _scale_col(srow, zrow, tok_ok, (pl * NCH + c) * CW // G, SCALE_BF16, BIAS)
            scales = scales + (s,)
            zeros = zeros + (zb,)
    ks = ()
    for b in tl.static_range(2):
        for pl in tl.static_range(PLANES):
            ks = ks + (_scaled_pair(w, scales[pl], zeros[pl], 8 * b + BITS * pl, BITS, SCALE_BF16, BIAS, DOT_BF16,
                                    ALT, WORDS == 2),)
    return quad_order(_join_bits(ks), BLOCK_N, CW, LANES, 2 if PLANES == 2 else 3)  # [N, W, h, m bits...] joined


@triton.jit
def _group_columns(x, N: tl.constexpr, NG: tl.constexpr):
    """The ``NG`` columns of ``x`` ``[N, NG]`` (a power of two) as a tuple of ``[N]`` tensors, in order. Halving
    splits keep every value in its thread, so ``x`` changes layout once, not once per column."""
    cols = (x,)
    for lvl in tl.static_range(6):
        if (1 << lvl) < NG:
            halves = ()
            for t in tl.static_range(len(cols)):  # [N, 2m] -> its first and last m columns
                lo, hi = tl.split(tl.permute(tl.reshape(cols[t], [N, 2, NG >> (lvl + 1)]), (0, 2, 1)))
                halves = halves + (lo, hi)
            cols = halves
    out = ()
    for g in tl.static_range(NG):
        out = out + (tl.reshape(cols[g], [N]),)
    return out


@triton.jit
def _group_values(sptrs, zptrs, tok_ok, SCALE_BF16: tl.constexpr, BIAS: tl.constexpr, N: tl.constexpr,
                  NG: tl.constexpr):
    """Scales and ``BIAS + zero`` at the pointers ``[N, NG]`` (a row of groups per token) as two tuples of ``NG``
    float32 ``[N]`` (scale 0 where a token is not ``tok_ok``). One load each: with code words in quad order the
    operand's layout would otherwise take every group's vector apart on its own (:func:`_group_columns`)."""
    tl.static_assert((NG & (NG - 1)) == 0 and NG <= 64, "a power of two of at most 64 groups")
    sc = _group_columns(tl.load(sptrs, mask=tok_ok[:, None], other=0), N, NG)
    zc = _group_columns(tl.load(zptrs, mask=tok_ok[:, None], other=0), N, NG)
    scales = ()
    zeros = ()
    for i in tl.static_range(NG):
        if SCALE_BF16:
            scales = scales + (bf16_bits_to_f32(sc[i]),)
        else:
            scales = scales + (sc[i],)
        zeros = zeros + (zc[i].to(tl.float32) + BIAS,)
    return scales, zeros


@triton.jit
def _tile_groups(pages_ptr, page_off, tp, tok_ok, lv0, D: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                 SCALES_OFF: tl.constexpr, ZEROS_OFF: tl.constexpr, SCALE_BF16: tl.constexpr, BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, WORDS: tl.constexpr, LANES: tl.constexpr, TILE_GROUPS: tl.constexpr):
    """Every group's scale and ``BIAS + zero`` of the tile's tokens (:func:`_group_values`), from one load of each
    token's row, where ``TILE_GROUPS`` and the codes come from words in quad order (``LANES`` > 1); else ``()`` and
    each chunk loads its own. ``lv0``: a loop-variant zero that keeps QK's and PV's loads apart."""
    groups = ()
    if BITS < 8 and WORDS:
        if TILE_GROUPS and LANES > 1:
            NG: tl.constexpr = D // G
            srow, zrow = _scale_rows(pages_ptr, page_off, tp, NG, SCALES_OFF, ZEROS_OFF, SCALE_BF16)
            g = tl.arange(0, NG) + lv0
            groups = _group_values(srow[:, None] + g[None, :], zrow[:, None] + g[None, :], tok_ok, SCALE_BF16, BIAS,
                                   BLOCK_N, NG)
    return groups


@triton.jit
def _tile_raws(pages_ptr, page_off, tp, ld_mask, lv0, D: tl.constexpr, BITS: tl.constexpr, CW: tl.constexpr,
               CODES_OFF: tl.constexpr, WORDS: tl.constexpr):
    """Every chunk's bytes (words where ``WORDS``) of one path of the tile, loaded together (their
    latencies overlap)."""
    BYTES: tl.constexpr = D * BITS // 8
    raws = ()
    for c in tl.static_range(BYTES // CW):
        if WORDS:
            raws = raws + (load_words(pages_ptr, page_off, tp, ld_mask, lv0, c, BYTES, CW, CODES_OFF),)
        else:
            raws = raws + (_load_raw(pages_ptr, page_off, tp, ld_mask, lv0, c, BYTES, CW, CODES_OFF),)
    return raws


@triton.jit
def _chunk_operand(pages_ptr, page_off, tp, ld_mask, tok_ok, lv0, c: tl.constexpr,
                   D: tl.constexpr, BITS: tl.constexpr, CW: tl.constexpr, G: tl.constexpr,
                   CODES_OFF: tl.constexpr, SCALES_OFF: tl.constexpr, ZEROS_OFF: tl.constexpr,
                   SCALE_BF16: tl.constexpr, BIAS: tl.constexpr, DOT_BF16: tl.constexpr, ALT: tl.constexpr,
                   BLOCK_N: tl.constexpr, WORDS: tl.constexpr, LANES: tl.constexpr, raws, groups=()):
    """Dequantized chunk ``c`` of the tile, ``[BLOCK_N, CW * PLANES]`` in the dot dtype, columns
    in :func:`_chunk_channels` order (one operand per run of bytes, so every product is as wide
    as the bytes allow: 128 channels for 4-bit codes, 256 for 2-bit). BF16 pages: slice ``c``.
    ``WORDS``: the codes taken from 32-bit words (2- and 4-bit codes only).
    ``raws``: the chunks' bytes or words from :func:`_tile_raws` (empty: loaded here); ``groups``: the tile's scales
    and zeros from :func:`_tile_groups` (empty: loaded per chunk; words only)."""
    if BITS == 16:
        k = _load_bf16_vals(pages_ptr, page_off, tp, ld_mask, tok_ok, lv0, c, D, CW, CODES_OFF, DOT_BF16)
    else:
        BYTES: tl.constexpr = D * BITS // 8
        NCH: tl.constexpr = BYTES // CW
        srow, zrow = _scale_rows(pages_ptr, page_off, tp, D // G, SCALES_OFF, ZEROS_OFF, SCALE_BF16)
        if len(raws) > 0:
            raw = raws[c]
        elif WORDS:
            raw = load_words(pages_ptr, page_off, tp, ld_mask, lv0, c, BYTES, CW, CODES_OFF)
        else:
            raw = _load_raw(pages_ptr, page_off, tp, ld_mask, lv0, c, BYTES, CW, CODES_OFF)
        if WORDS:
            k = _word_operand(raw, srow, zrow, tok_ok, c, NCH, CW, G, BITS, SCALE_BF16, BIAS, DOT_BF16, ALT, BLOCK_N,
                              WORDS, LANES, groups)
        else:
            k = _raw_operand(raw, srow, zrow, tok_ok, c, NCH, CW, G, BITS, SCALE_BF16, BIAS, DOT_BF16, ALT, BLOCK_N)
    return k


@triton.jit
def _scores_t(pages_ptr, page_off, tp, ld_mask, tok_ok, lv0, qs, score,
              D: tl.constexpr, BITS: tl.constexpr, CW: tl.constexpr, G: tl.constexpr,
              CODES_OFF: tl.constexpr, SCALES_OFF: tl.constexpr, ZEROS_OFF: tl.constexpr,
              SCALE_BF16: tl.constexpr, BIAS: tl.constexpr, DOT_BF16: tl.constexpr, BLOCK_N: tl.constexpr,
              WORDS: tl.constexpr, LANES: tl.constexpr, TILE_GROUPS: tl.constexpr, raws):
    """``score`` ``[BLOCK_N, BLOCK_M]`` (tokens x rows, before the softmax scale) plus one path's
    (content or RoPE) products of the tile; ``qs`` from :func:`_load_q_chunks`; ``raws`` see
    :func:`_chunk_operand`."""
    BYTES: tl.constexpr = D * BITS // 8 if BITS < 16 else D
    groups = _tile_groups(pages_ptr, page_off, tp, tok_ok, lv0, D, BITS, G, SCALES_OFF, ZEROS_OFF, SCALE_BF16, BIAS,
                          BLOCK_N, WORDS, LANES, TILE_GROUPS)
    for c in tl.static_range(BYTES // CW):
        k = _chunk_operand(pages_ptr, page_off, tp, ld_mask, tok_ok, lv0, c, D, BITS, CW, G, CODES_OFF, SCALES_OFF,
                           ZEROS_OFF, SCALE_BF16, BIAS, DOT_BF16, False, BLOCK_N, WORDS, LANES, raws, groups)
        score = _dot_acc(k, qs[c], score, DOT_BF16)
    return score


@triton.jit
def _pv(accs, alpha, p, pages_ptr, page_off, tp, ld_mask, tok_ok, lv0,
        DC: tl.constexpr, BITS: tl.constexpr, CW: tl.constexpr, G: tl.constexpr,
        CODES_OFF: tl.constexpr, SCALES_OFF: tl.constexpr, ZEROS_OFF: tl.constexpr,
        SCALE_BF16: tl.constexpr, BIAS: tl.constexpr, DOT_BF16: tl.constexpr, BLOCK_N: tl.constexpr,
        WORDS: tl.constexpr, LANES: tl.constexpr, TILE_GROUPS: tl.constexpr):
    """The output chunks ``[BLOCK_M, CW * PLANES]`` after one tile: ``O * alpha + P @ k_chunk``."""
    BYTES: tl.constexpr = DC * BITS // 8 if BITS < 16 else DC
    NACC: tl.constexpr = BYTES // CW
    if DOT_BF16:
        pg = p.to(tl.bfloat16)
    else:
        pg = p
    groups = _tile_groups(pages_ptr, page_off, tp, tok_ok, lv0, DC, BITS, G, SCALES_OFF, ZEROS_OFF, SCALE_BF16, BIAS,
                          BLOCK_N, WORDS, LANES, TILE_GROUPS)
    for c in tl.static_range(NACC):
        k = _chunk_operand(pages_ptr, page_off, tp, ld_mask, tok_ok, lv0, c, DC, BITS, CW, G, CODES_OFF, SCALES_OFF,
                           ZEROS_OFF, SCALE_BF16, BIAS, DOT_BF16, True, BLOCK_N, WORDS, LANES, (), groups)
        accs = _tuple_set(accs, c, _dot_acc(pg, k, accs[c] * alpha[:, None], DOT_BF16), NACC)
    return accs


@triton.jit
def split_kernel_v3(
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
    CBIAS: tl.constexpr,
    RBIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    PROBE_SKIP_PV: tl.constexpr = False,
    PDL: tl.constexpr = False,
    WORDS: tl.constexpr = 0,
    WORD_LANES: tl.constexpr = 1,
    TILE_GROUPS: tl.constexpr = False,
):
    """One (split, request, block of BLOCK_R query rows): partial normalised output and
    log2-sum-exp over the split's share of the packed tokens (v1's partial format).
    ``PROBE_SKIP_PV`` (probes only; wrong results) leaves the PV products out; ``PDL`` as v1's."""
    pid_s = tl.program_id(0)
    b = tl.program_id(1)
    rb = tl.program_id(2)
    CPLANES: tl.constexpr = 8 // CBITS if QUANT else 1
    CBYTES: tl.constexpr = DC * CBITS // 8 if QUANT else DC
    NACC: tl.constexpr = CBYTES // CCW  # output chunks [BLOCK_R, CCW * CPLANES]
    ONE_PAGE: tl.constexpr = (P % BLOCK_N) == 0  # a tile never spans two pages: one table lookup
    cbits: tl.constexpr = CBITS if QUANT else 16
    rbits: tl.constexpr = RBITS if QUANT else 16
    cwords: tl.constexpr = WORDS if cbits < 8 else 0  # codes from 32-bit words (_word_operand)
    rwords: tl.constexpr = WORDS if rbits < 8 else 0

    L = tl.load(lens_ptr + b).to(tl.int32)
    ps, pe, t_lo, t_hi = split_tiles(L, SINK, LOCAL, NSPLIT, pid_s, BLOCK_N)

    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    limit = L - S_Q + rows // H + 1  # row r (query i = r // H) sees tokens n < limit
    qc = _load_q_chunks(q_ptr + b.to(tl.int64) * R * DC, rows, row_ok, DC, cbits, CCW, Q_BF16, DOT_BF16, cwords,
                        WORD_LANES)
    qr = _load_q_chunks(qr_ptr + b.to(tl.int64) * R * DR, rows, row_ok, DR, rbits, RCW, Q_BF16, DOT_BF16, rwords,
                        WORD_LANES)
    table_row = table_ptr + b.to(tl.int64) * stride_table

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    accs = _zeros_tuple(BLOCK_R, CCW * CPLANES, NACC)
    for t in range(t_lo, t_hi):
        n0 = t * BLOCK_N
        n = n0 + tl.arange(0, BLOCK_N)
        tp, page_off, ld_mask, tok_ok = tile_pages(table_row, n0, n, ps, pe, num_pages, P, PAGE_BYTES, ONE_PAGE)
        lv0 = tl.minimum(t, 0)  # 0 (t >= 0), unknown to the compiler: see attention_v2_kernel._load_raw

        craws = ()
        rraws = ()
        if QUANT and PREFETCH:
            craws = _tile_raws(pages_ptr, page_off, tp, ld_mask, lv0, DC, CBITS, CCW, C_CODES_OFF, cwords)
            rraws = _tile_raws(pages_ptr, page_off, tp, ld_mask, lv0, DR, RBITS, RCW, R_CODES_OFF, rwords)
        score = _scores_t(pages_ptr, page_off, tp, ld_mask, tok_ok, lv0, qc, tl.zeros([BLOCK_N, BLOCK_R], tl.float32),
                          DC, cbits, CCW, CG, C_CODES_OFF, C_SCALES_OFF, C_ZEROS_OFF, C_SCALE_BF16, CBIAS, DOT_BF16,
                          BLOCK_N, cwords, WORD_LANES, TILE_GROUPS, craws)
        score = _scores_t(pages_ptr, page_off, tp, ld_mask, tok_ok, lv0, qr, score, DR, rbits, RCW, RG,
                          R_CODES_OFF, R_SCALES_OFF, R_ZEROS_OFF, R_SCALE_BF16, RBIAS, DOT_BF16, BLOCK_N, rwords,
                          WORD_LANES, TILE_GROUPS, rraws)
        vis = tok_ok[:, None] & (n[:, None] < limit[None, :])
        score = tl.where(vis, score * sm_scale_log2, float("-inf"))  # [BLOCK_N, BLOCK_R]

        m_new = tl.maximum(m_i, tl.max(score, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p_t = tl.exp2(score - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p_t, axis=0)
        m_i = m_new
        p = tl.trans(p_t)  # [BLOCK_R, BLOCK_N], the A operand of PV
        if PROBE_SKIP_PV:
            for c in tl.static_range(NACC):
                accs = _tuple_set(accs, c, accs[c] * alpha[:, None], NACC)
        else:
            # a second loop-variant zero: the same one would let CSE keep the QK operands alive
            accs = _pv(accs, alpha, p, pages_ptr, page_off, tp, ld_mask, tok_ok, tl.minimum(n0, 0), DC, cbits, CCW,
                       CG, C_CODES_OFF, C_SCALES_OFF, C_ZEROS_OFF, C_SCALE_BF16, CBIAS, DOT_BF16, BLOCK_N, cwords,
                       WORD_LANES, TILE_GROUPS)

    pdl_launch_dependents(PDL)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    lse2 = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
    part = (b.to(tl.int64) * NSPLIT + pid_s) * R
    for c in tl.static_range(NACC):
        o_offs = (part + rows[:, None]) * DC + _chunk_channels(c, CCW, CPLANES, CBYTES, cwords, WORD_LANES)[None, :]
        tl.store(o_part_ptr + o_offs, accs[c] / l_safe[:, None], mask=row_ok[:, None])
    tl.store(lse_part_ptr + part + rows, lse2, mask=row_ok)
