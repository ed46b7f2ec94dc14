"""Split-KV decode attention, kernel v2: 2-D ``tl.dot`` per quantization group, 64-token tiles.

Runs by default for packed formats with bfloat16 queries (``attention.auto_variant``; forced
with ``QUANTMLA_TRITON_ATTENTION=v2``, read per call); the H200 measured it 1.6-1.9x faster
than v1 there. The protected-tile and log-sum-exp merge kernels are
v1's (``attention_kernel.protect_kernel``, ``merge_kernel``): v2 writes the same partials. Float32 queries
on a GPU run v1 (``heuristics.V2_FLOAT32_ON_GPU``); the interpreter runs v2 in float32.

Design note
-----------
Why v1 is slow (H200): 255 registers with spills in every variant; C2R4 as slow as C4R4 (bytes
are not the limit); skipping PV saves only 15 %, so QK dominates: batched 3-D ``tl.dot`` over
``[NS, 32, CW]`` slice stacks through ``mma.sync``, 3-D layout conversions, an ``[NS, 32, R]``
float32 score stack reduced over NS.

v2, per program (split s, request b, block of BLOCK_R query rows), per tile of BLOCK_N = 64
tokens — the M dimension of every product, so each ``tl.dot`` becomes a Hopper ``wgmma``
(m64n16k16 with 4 warps; the offline sm_90a compile shows 18 ``warp_group_dot`` and no
``mma.sync``) — and per slice ``sl`` (CW elements of one bit plane of one run of bytes, inside
one quantization group; ``__init__.slice_width``), with ``B`` = 128 for sub-8-bit codes:

    codes_sl  = bits(code | 0x4300) as bf16 = B + code          [64, CW]  (shift, and, or)
    QK:   S      += s[:, sl] * ( dot(codes_sl, q_sl)  -  (B + z[:, sl]) * qsum_sl )     [64, N]
    PV:   O_sl^T += dot(codes_sl^T, P_sl)  -  sum_t P_sl * (B + z[:, sl])             [CW, N]
          P_sl = (p * s[:, sl]) rounded to bf16 once; the correction uses the same rounded
          values, per tile, so the +B bias cancels exactly (a running correction does not: v1)

Only 2-D products; the float32 state is the ``[64, N]`` score tile and NSC per-slice output
tiles ``[CW, N]`` (a tuple carried through the loop; DC x N float32 in all, the unavoidable
output state). Scales and zero points are applied per (token, slice) on the score /
probability side, never per element. Query slices are loaded once per program (they live in
shared memory as the wgmma B operand). Switches (probe knobs, all interpreter-tested):
``PV_FORM`` 1 = ``O[N, CW] += P^T @ codes``; ``HOLD_RAW`` keeps the tile's bytes in registers
for PV instead of re-loading them (L1/L2 hits); ``ZSUB`` subtracts ``B + z`` on the operand
(``code - z`` exact in bf16, one ``sub.bf16x2`` per two elements) so neither product needs a
correction (no query sums, no cross-warp token reduction per slice in PV).

Registers (offline: ``python -m quantmla_core.backends.triton.sm90_report``, sm_90a, triton
3.7.1's ptxas; v1 C4R4 reads 255 there as on the H200). C4R4, d_c 512, 16 rows, 4 warps,
1 stage: 255 registers, 76 B spilled (ZSUB: 4 B; C2R4 264 B / ZSUB 148 B; d_c 256: 207, none).
Traps found on the way (each cost 100s of bytes of spill): loop-invariant 2-D broadcasts
(column offsets, query sums, causal limits) hoisted out of the tile loop by the compiler —
defeated with a loop-variant zero ``lv0``; CSE merging the PV operand with the QK one (all 8
code tiles live across the softmax) — the PV pass writes ``code + 0x4300``; int32 code bytes
(4x the registers of uint8). 32 rows per program spill 0.8-1.8 KB, so H = 128 still runs 8
row blocks of 16 (heuristics.plan_v2).

Code words (``WORDS``, the ``word_codes`` override, off by default: ``heuristics.V2_CODE_WORDS``): 2- and 4-bit
codes from 32-bit words, two per mask and OR (``code_words``), in the quad order of the ``wgmma`` register operand
(:func:`_word_plane`), so QK converts only the raw words' layout. Offline sm_90a (triton 3.7.1), tile loop,
instructions a thread / bytes spilled: C4R4 3,484 / 76 from bytes (962 of them ``PRMT``), 2,461 / 176 from words
split in PTX, 2,637 / 184 in portable Triton; C2R4 3,286 / 264, 2,474 / 168, 2,641 / 172; with ``ZSUB`` as well
(no query sums, no per-slice reductions in PV) C4R4 1,910 / 0, C2R4 1,899 / 0. Untimed: stop 50 timed words in v2
11-22 % slower in the order that staged the operand through shared memory.

Predictions for the H200 (benchmarks/triton_probe.py, PROBE_VARIANTS=v1,v2,v2z):
* H = 16, C4R4, B = 32, L = 32K (v1 1,801 µs = 5.9x FlashInfer BF16): the QK side moves from
  3-D mma.sync + an NS-deep float32 reduction to ten wgmma per 64 tokens (spills are not what
  separates them: v1 compiles here to 255 registers and 0 B, the H200 reported 22 spills).
  Predicted 2-3x faster: 600-900 µs (2-3x FlashInfer). The 0.35x target needs
  the conversion to go straight into the wgmma register layout (Triton stages the code bytes
  through shared memory, one ``st.shared`` + ``ld.shared`` per tile and chunk) and probably
  warp specialisation; v2z predicted 10-20 % under v2 (no per-slice cross-warp reductions).
* C2R4 = C4R4 time or 10 % less (ALU/layout-bound, not byte-bound).
* H = 128: 8 row blocks as v1, each cheaper per tile: predicted 1.5-2.5x over v1 (9,325 ->
  4,000-6,000 µs at B = 32, L = 32K); the block_r 32/64 knobs show whether wider programs pay
  despite their spills.
* B = 8, L = 4K: split shares of >= 2 tiles of 64; predicted 1.2-1.5x over v1.
Risks: Triton 3.6 (H200) may place layouts differently from 3.7.1 (registers measured here);
the A-operand-from-registers wgmma path re-stages codes through shared memory per slice, which
may cap the gain below the prediction.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention_kernel import split_tiles
from .code_words import load_words, quad_order, word_channels, word_pair
from .common_kernels import bf16_bits_to_f32, load_f32, pdl_launch_dependents


@triton.jit
def _dot(a, b, DOT_BF16: tl.constexpr):
    """2-D ``tl.dot`` with float32 accumulation; float32 operands in IEEE precision."""
    if DOT_BF16:
        return tl.dot(a, b)
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _codes(raw, PLANE: tl.constexpr, BITS: tl.constexpr, BIAS: tl.constexpr, DOT_BF16: tl.constexpr,
           ALT: tl.constexpr = False):
    """Plane PLANE of packed bytes ``raw`` (uint8, kept narrow: a C4R4 tile's 16 KB are 32
    registers per thread as bytes, 128 as int32) as dot operands: ``BIAS + code``.

    BIAS 128 on the GPU: the bit trick ``bits(code | 0x4300)`` = bfloat16 ``128 + code`` (one OR,
    no conversion). BIAS 128 in float32 (tests of the bias algebra in the interpreter):
    ``code + 128`` converted. BIAS 0: the code converted (8-bit codes, float32 queries).

    ``ALT`` (the PV pass) writes the same value as ``code + 0x4300`` so that common-subexpression
    elimination cannot merge it with the QK pass's ``code | 0x4300``: merged, all NSC operand
    tiles stay live across the softmax (128 registers for C4R4; ptxas spilled)."""
    code = ((raw >> (PLANE * BITS)) & ((1 << BITS) - 1)).to(tl.int16)
    if BIAS == 128:
        if DOT_BF16:
            if ALT:
                return (code + 0x4300).to(tl.bfloat16, bitcast=True)
            else:
                return (code | 0x4300).to(tl.bfloat16, bitcast=True)
        else:
            return (code + 128).to(tl.float32)
    else:
        if DOT_BF16:
            return code.to(tl.bfloat16)
        else:
            return code.to(tl.float32)


@triton.jit
def _zsub(codes, zb, DOT_BF16: tl.constexpr):
    """ZSUB: ``(BIAS + code) - (BIAS + zero)`` = ``code - zero`` on the operand (exact small
    integers in bfloat16; one packed subtraction per two elements), so neither product needs a
    zero-point correction (no query sums in QK, no per-slice token reductions in PV)."""
    if DOT_BF16:
        return codes - zb.to(tl.bfloat16)[:, None]
    else:
        return codes - zb[:, None]


@triton.jit
def _slice_order(CW: tl.constexpr, WORDS: tl.constexpr):
    """Channel offset inside its slice of each column of a slice operand: the column itself from bytes, with
    ``WORDS`` :func:`_word_plane`'s quad order (``code_words.word_channels``)."""
    if WORDS:
        return word_channels(0, CW, 1, CW, 4)
    else:
        return tl.arange(0, CW)


@triton.jit
def _word_plane(w, PLANE: tl.constexpr, BITS: tl.constexpr, BIAS: tl.constexpr, DOT_BF16: tl.constexpr,
                ALT: tl.constexpr, WORDS: tl.constexpr, BLOCK_N: tl.constexpr, CW: tl.constexpr):
    """Plane PLANE of a slice's words ``w`` ``[BLOCK_N, CW // 4]`` as dot operands ``BIAS + code`` ``[BLOCK_N, CW]``
    in the quad order of the ``wgmma`` register operand (``code_words.quad_order``: each thread converts the words
    it holds; ``word_pair``: two codes a mask and OR, ``WORDS`` 2 in NVIDIA PTX)."""
    x = tl.join(word_pair(w, BITS * PLANE, BITS, BIAS, DOT_BF16, ALT, WORDS == 2),
                word_pair(w, 8 + BITS * PLANE, BITS, BIAS, DOT_BF16, ALT, WORDS == 2))  # [N, W, h, b]
    return quad_order(x, BLOCK_N, CW, 4, 1)


@triton.jit
def _scale_rows(pages_ptr, page_off, tp, NG: tl.constexpr, SCALES_OFF: tl.constexpr, ZEROS_OFF: tl.constexpr,
                SCALE_BF16: tl.constexpr):
    """Per-token pointers to the tile's scale and zero rows (``[BLOCK_N]`` each). Built once per
    tile so each group's loads are these pointers plus a constant (an immediate offset), not a
    fresh 64-bit address per element and group."""
    if SCALE_BF16:
        srow = pages_ptr.to(tl.pointer_type(tl.uint16)) + ((page_off + SCALES_OFF) // 2 + tp * NG)
    else:
        srow = pages_ptr.to(tl.pointer_type(tl.float32)) + ((page_off + SCALES_OFF) // 4 + tp * NG)
    zrow = pages_ptr + (page_off + ZEROS_OFF + tp * NG)
    return srow, zrow


@triton.jit
def _scale_col(srow, zrow, tok_ok, gi, SCALE_BF16: tl.constexpr, BIAS: tl.constexpr):
    """Scale and ``BIAS + zero`` of group ``gi`` for the tile's tokens, float32 ``[BLOCK_N]``
    (scale 0 where a token is not ``tok_ok``)."""
    if SCALE_BF16:
        s = bf16_bits_to_f32(tl.load(srow + gi, mask=tok_ok, other=0))
    else:
        s = tl.load(srow + gi, mask=tok_ok, other=0.0)
    z = tl.load(zrow + gi, mask=tok_ok, other=0).to(tl.float32)
    return s, z + BIAS


@triton.jit
def _load_raw(pages_ptr, page_off, tp, ld_mask, lv0, c, BYTES: tl.constexpr, CW: tl.constexpr,
              CODES_OFF: tl.constexpr):
    """Bytes ``[c*CW, (c+1)*CW)`` of the tile's packed code rows as uint8 ``[BLOCK_N, CW]``.

    ``lv0`` is a loop-variant zero: without it the compiler hoists the loop-invariant 2-D
    broadcasts of the column offsets (int64 [64, 64]: 64 registers per thread each) out of the
    tile loop and spills (seen in ptxas for sm_90a)."""
    row = pages_ptr + (page_off + CODES_OFF + tp * BYTES)  # [BLOCK_N] pointers
    # lv0 hides the alignment from the compiler's axis analysis: restate it (16-byte vector loads)
    col = tl.max_contiguous(tl.multiple_of(c * CW + tl.arange(0, CW) + lv0, CW), CW)
    return tl.load(row[:, None] + col[None, :], mask=ld_mask, other=0)


@triton.jit
def _load_bf16_vals(pages_ptr, page_off, tp, ld_mask, tok_ok, lv0, sl, D: tl.constexpr, CW: tl.constexpr,
                    CODES_OFF: tl.constexpr, DOT_BF16: tl.constexpr):
    """BF16-format values of slice ``sl`` as ``[BLOCK_N, CW]`` dot operands (0 where not ``tok_ok``:
    unwritten slots may hold any bits). ``lv0``: loop-variant zero, see :func:`_load_raw`."""
    p16 = pages_ptr.to(tl.pointer_type(tl.uint16))
    row = p16 + ((page_off + CODES_OFF) // 2 + tp * D)
    col = tl.max_contiguous(tl.multiple_of(sl * CW + tl.arange(0, CW) + lv0, CW), CW)
    v = tl.load(row[:, None] + col[None, :], mask=ld_mask, other=0)
    if DOT_BF16:
        x = v.to(tl.int16).to(tl.bfloat16, bitcast=True)
        return tl.where(tok_ok[:, None], x, 0.0).to(tl.bfloat16)
    else:
        return tl.where(tok_ok[:, None], bf16_bits_to_f32(v), 0.0)


@triton.jit
def _load_q_slices(q_base, rows, row_ok, D: tl.constexpr, CW: tl.constexpr, Q_BF16: tl.constexpr,
                   DOT_BF16: tl.constexpr, WORDS: tl.constexpr = 0):
    """Query rows as a tuple of NS slices ``[CW, BLOCK_R]`` (dot dtype) and a tuple of their
    column sums ``[BLOCK_R]`` (float32, from the values the dot sees). ``WORDS``: each slice's channels in
    :func:`_slice_order`."""
    NS: tl.constexpr = D // CW
    j = _slice_order(CW, WORDS)
    qs = ()
    sums = ()
    for sl in tl.static_range(NS):
        offs = rows[None, :] * D + (sl * CW + j)[:, None]  # int32: q_base carries the 64-bit part
        x = load_f32(q_base, offs, row_ok[None, :], Q_BF16)
        if DOT_BF16:
            xd = x.to(tl.bfloat16)
            qs = qs + (xd,)
            sums = sums + (tl.sum(xd.to(tl.float32), axis=0),)
        else:
            qs = qs + (x,)
            sums = sums + (tl.sum(x, axis=0),)
    return qs, sums


@triton.jit
def _qk_path(pages_ptr, page_off, tp, ld_mask, tok_ok, lv0, qs, qsums,
             D: tl.constexpr, BITS: tl.constexpr, CW: tl.constexpr, G: tl.constexpr,
             CODES_OFF: tl.constexpr, SCALES_OFF: tl.constexpr, ZEROS_OFF: tl.constexpr,
             SCALE_BF16: tl.constexpr, BIAS: tl.constexpr, DOT_BF16: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, ZSUB: tl.constexpr = False, WORDS: tl.constexpr = 0):
    """Unscaled scores ``[BLOCK_N, BLOCK_R]`` of one path (content or RoPE) of one tile, plus the
    tile's raw byte chunks and per-slice (scale, BIAS + zero) columns in (chunk, plane) order.
    ``lv0``: loop-variant zero (int32) that keeps 2-D broadcasts of loop invariants (column
    offsets, query sums) inside the loop instead of hoisted into registers for its lifetime. ``WORDS``: the
    chunks as 32-bit words and the operands in :func:`_word_plane`'s order (2- and 4-bit codes)."""
    lvf = lv0.to(tl.float32)
    score = tl.zeros([BLOCK_N, BLOCK_R], tl.float32)
    raws = ()
    ss = ()
    zbs = ()
    if BITS == 16:
        NS: tl.constexpr = D // CW
        for sl in tl.static_range(NS):
            k = _load_bf16_vals(pages_ptr, page_off, tp, ld_mask, tok_ok, lv0, sl, D, CW, CODES_OFF, DOT_BF16)
            score += _dot(k, qs[sl], DOT_BF16)
    else:
        BYTES: tl.constexpr = D * BITS // 8
        NCH: tl.constexpr = BYTES // CW
        PLANES: tl.constexpr = 8 // BITS
        NG: tl.constexpr = D // G
        srow, zrow = _scale_rows(pages_ptr, page_off, tp, NG, SCALES_OFF, ZEROS_OFF, SCALE_BF16)
        for c in tl.static_range(NCH):
            if WORDS:
                raw = load_words(pages_ptr, page_off, tp, ld_mask, lv0, c, BYTES, CW, CODES_OFF)
            else:
                raw = _load_raw(pages_ptr, page_off, tp, ld_mask, lv0, c, BYTES, CW, CODES_OFF)
            raws = raws + (raw,)
            for pl in tl.static_range(PLANES):
                # slice pl * NCH + c (constexpr; the code generator does not let a loop rebind a
                # constexpr name, so the index is written out where it is used)
                s, zb = _scale_col(srow, zrow, tok_ok, (pl * NCH + c) * CW // G, SCALE_BF16, BIAS)
                ss = ss + (s,)
                zbs = zbs + (zb,)
                if WORDS:
                    k = _word_plane(raw, pl, BITS, BIAS, DOT_BF16, False, WORDS, BLOCK_N, CW)
                else:
                    k = _codes(raw, pl, BITS, BIAS, DOT_BF16)
                if ZSUB:
                    score += s[:, None] * _dot(_zsub(k, zb, DOT_BF16), qs[pl * NCH + c], DOT_BF16)
                else:
                    d = _dot(k, qs[pl * NCH + c], DOT_BF16)
                    qsum = qsums[pl * NCH + c] + lvf
                    score += s[:, None] * (d - zb[:, None] * qsum[None, :])
    return score, raws, ss, zbs


@triton.jit
def _zeros_tuple(M: tl.constexpr, N: tl.constexpr, COUNT: tl.constexpr):
    """A tuple of COUNT float32 ``[M, N]`` zero tiles (built with ``+`` and indexing only, the
    oldest tuple operations of Triton's frontend, for triton 3.6 as well as 3.7)."""
    out = ()
    for i in tl.static_range(COUNT):
        out = out + (tl.zeros([M, N], tl.float32),)
    return out


@triton.jit
def _tuple_set(t, IDX: tl.constexpr, value, COUNT: tl.constexpr):
    """``t`` with element IDX replaced by ``value`` (tuples are immutable in Triton)."""
    out = ()
    for i in tl.static_range(COUNT):
        if i == IDX:
            out = out + (value,)
        else:
            out = out + (t[i],)
    return out


@triton.jit
def _pv_update(acc, alpha, codes, pg, corr, PV_FORM: tl.constexpr, DOT_BF16: tl.constexpr):
    """One slice's accumulator after a tile: rescale by ``alpha`` and add ``P^T codes - corr``."""
    if PV_FORM == 0:  # acc [CW, BLOCK_R]
        return acc * alpha[None, :] + (_dot(tl.trans(codes), pg, DOT_BF16) - corr[None, :])
    else:  # acc [BLOCK_R, CW]
        return acc * alpha[:, None] + (_dot(tl.trans(pg), codes, DOT_BF16) - corr[:, None])


@triton.jit
def tile_pages(table_row, n0, n, ps, pe, num_pages, P: tl.constexpr, PAGE_BYTES: tl.constexpr,
               ONE_PAGE: tl.constexpr):
    """Where the tile of tokens ``n`` (first ``n0``) lives: offsets inside their page ``tp``, the
    page byte offsets (a scalar when ``ONE_PAGE``: the tile never spans two pages, one table
    lookup), the load mask (pages in range) and ``tok_ok`` (packed token in ``[ps, pe)`` on a
    valid page)."""
    in_rng = (n >= ps) & (n < pe)
    if ONE_PAGE:
        page = tl.load(table_row + n0 // P)
        page_ok = (page >= 0) & (page < num_pages)
        page_off = tl.where(page_ok, page, 0).to(tl.int64) * PAGE_BYTES  # scalar
        ld_mask = page_ok
    else:
        page = tl.load(table_row + n // P, mask=in_rng, other=-1)
        page_ok = (page >= 0) & (page < num_pages)
        page_off = tl.where(page_ok, page, 0).to(tl.int64) * PAGE_BYTES  # [BLOCK_N]
        ld_mask = page_ok[:, None]
    return n % P, page_off, ld_mask, in_rng & page_ok


@triton.jit
def split_kernel_v2(
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
    PV_FORM: tl.constexpr = 0,
    HOLD_RAW: tl.constexpr = True,
    ZSUB: tl.constexpr = False,
    PROBE_SKIP_PV: tl.constexpr = False,
    PDL: tl.constexpr = False,
    WORDS: tl.constexpr = 0,
):
    """One (split, request, row block): partial normalised output and log2-sum-exp (same
    partial format as v1's ``split_kernel``). ``PROBE_SKIP_PV`` (probes only; wrong results); ``PDL`` as v1's;
    ``WORDS`` as kernel v3's (0 bytes, 1 words, 2 words taken apart in PTX) for 2- and 4-bit codes."""
    pid_s = tl.program_id(0)
    b = tl.program_id(1)
    rb = tl.program_id(2)
    NSC: tl.constexpr = DC // CCW
    CBYTES: tl.constexpr = DC * CBITS // 8
    CNCH: tl.constexpr = CBYTES // CCW
    CPLANES: tl.constexpr = 8 // CBITS
    ONE_PAGE: tl.constexpr = (P % BLOCK_N) == 0  # a tile never spans two pages: one table lookup
    cwords: tl.constexpr = WORDS if (CBITS < 8 if QUANT else False) else 0
    rwords: tl.constexpr = WORDS if (RBITS < 8 if QUANT else False) else 0

    L = tl.load(lens_ptr + b).to(tl.int32)
    ps, pe, t_lo, t_hi = split_tiles(L, SINK, LOCAL, NSPLIT, pid_s, BLOCK_N)

    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    limit = L - S_Q + rows // H + 1  # row r (query i = r // H) sees tokens n < limit
    q_base = q_ptr + b.to(tl.int64) * R * DC
    qr_base = qr_ptr + b.to(tl.int64) * R * DR
    qc, qc_sum = _load_q_slices(q_base, rows, row_ok, DC, CCW, Q_BF16, DOT_BF16, cwords)
    qr, qr_sum = _load_q_slices(qr_base, rows, row_ok, DR, RCW, Q_BF16, DOT_BF16, rwords)
    table_row = table_ptr + b.to(tl.int64) * stride_table

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    if PV_FORM == 0:
        accs = _zeros_tuple(CCW, BLOCK_R, NSC)
    else:
        accs = _zeros_tuple(BLOCK_R, CCW, NSC)
    for t in range(t_lo, t_hi):
        n0 = t * BLOCK_N
        n = n0 + tl.arange(0, BLOCK_N)
        tp, page_off, ld_mask, tok_ok = tile_pages(table_row, n0, n, ps, pe, num_pages, P, PAGE_BYTES, ONE_PAGE)
        lv0 = tl.minimum(t, 0)  # 0 (t >= 0), unknown to the compiler: see _qk_path

        score, raws, cs, czb = _qk_path(pages_ptr, page_off, tp, ld_mask, tok_ok, lv0, qc, qc_sum,
                                        DC, CBITS if QUANT else 16, CCW, CG, C_CODES_OFF, C_SCALES_OFF, C_ZEROS_OFF,
                                        C_SCALE_BF16, CBIAS, DOT_BF16, BLOCK_N, BLOCK_R, ZSUB, cwords)
        score_r, _r0, _r1, _r2 = _qk_path(pages_ptr, page_off, tp, ld_mask, tok_ok, lv0, qr, qr_sum,
                                          DR, RBITS if QUANT else 16, RCW, RG, R_CODES_OFF, R_SCALES_OFF, R_ZEROS_OFF,
                                          R_SCALE_BF16, RBIAS, DOT_BF16, BLOCK_N, BLOCK_R, ZSUB, rwords)
        score += score_r
        vis = tok_ok[:, None] & (n[:, None] < (limit + lv0)[None, :])  # lv0: not a hoisted [64, N] tile
        score = tl.where(vis, score * sm_scale_log2, float("-inf"))  # [BLOCK_N, BLOCK_R]

        m_new = tl.maximum(m_i, tl.max(score, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(score - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new

        if QUANT:
            for c in tl.static_range(CNCH):
                if HOLD_RAW:
                    raw = raws[c]
                else:
                    # a second loop-variant zero: the same one would let CSE merge the reload
                    if cwords:
                        raw = load_words(pages_ptr, page_off, tp, ld_mask, tl.minimum(n0, 0), c, CBYTES, CCW,
                                         C_CODES_OFF)
                    else:
                        raw = _load_raw(pages_ptr, page_off, tp, ld_mask, tl.minimum(n0, 0), c, CBYTES, CCW,
                                        C_CODES_OFF)
                for pl in tl.static_range(CPLANES):
                    # slice pl * CNCH + c; its scale / zero columns sit at c * CPLANES + pl
                    if DOT_BF16:
                        pg = (p * cs[c * CPLANES + pl][:, None]).to(tl.bfloat16)
                        pgf = pg.to(tl.float32)
                    else:
                        pg = p * cs[c * CPLANES + pl][:, None]
                        pgf = pg
                    # the zero-point / +128 correction goes in per tile, with the same rounded
                    # probabilities as the dot (v1: a running correction cancels catastrophically)
                    if ZSUB:
                        corr = tl.zeros([BLOCK_R], tl.float32)
                    else:
                        corr = tl.sum(pgf * czb[c * CPLANES + pl][:, None], axis=0)  # [BLOCK_R]
                    acc = accs[pl * CNCH + c]
                    if PROBE_SKIP_PV:
                        if PV_FORM == 0:
                            new = acc * alpha[None, :] - corr[None, :]
                        else:
                            new = acc * alpha[:, None] - corr[:, None]
                    else:
                        if cwords:
                            k = _word_plane(raw, pl, CBITS, CBIAS, DOT_BF16, True, cwords, BLOCK_N, CCW)
                        else:
                            k = _codes(raw, pl, CBITS, CBIAS, DOT_BF16, True)
                        if ZSUB:
                            k = _zsub(k, czb[c * CPLANES + pl], DOT_BF16)
                        new = _pv_update(acc, alpha, k, pg, corr, PV_FORM, DOT_BF16)
                    accs = _tuple_set(accs, pl * CNCH + c, new, NSC)
        else:
            if DOT_BF16:
                pg = p.to(tl.bfloat16)
            else:
                pg = p
            zero = tl.zeros([BLOCK_R], tl.float32)
            for sl in tl.static_range(NSC):
                k = _load_bf16_vals(pages_ptr, page_off, tp, ld_mask, tok_ok, lv0, sl, DC, CCW, C_CODES_OFF, DOT_BF16)
                new = _pv_update(accs[sl], alpha, k, pg, zero, PV_FORM, DOT_BF16)
                accs = _tuple_set(accs, sl, new, NSC)

    pdl_launch_dependents(PDL)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    lse2 = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
    part = (b.to(tl.int64) * NSPLIT + pid_s) * R
    e = _slice_order(CCW, cwords)
    for sl in tl.static_range(NSC):
        if PV_FORM == 0:
            o = accs[sl] / l_safe[None, :]
            o_offs = (part + rows[None, :]) * DC + sl * CCW + e[:, None]
            tl.store(o_part_ptr + o_offs, o, mask=row_ok[None, :])
        else:
            o = accs[sl] / l_safe[:, None]
            o_offs = (part + rows[:, None]) * DC + sl * CCW + e[None, :]
            tl.store(o_part_ptr + o_offs, o, mask=row_ok[:, None])
    tl.store(lse_part_ptr + part + rows, lse2, mask=row_ok)
