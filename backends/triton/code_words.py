"""Packed codes taken from 32-bit words, two codes per mask and OR (kernel v3).

A word holds bytes ``4*i .. 4*i + 3`` of a run of code bytes (little-endian: byte ``4*i + t`` is bits ``8*t`` to
``8*t + 7``). Shifting it by ``8*b + BITS*pl`` and masking both 16-bit halves with ``(2**BITS - 1) * 0x00010001``
leaves plane ``pl`` of bytes ``4*i + b`` (low half) and ``4*i + 2 + b`` (high half), each a code in bits 0 to
BITS-1 of its half. OR-ing 0x4300 into both halves makes two bfloat16 ``128 + code`` at once (the bit trick of
``attention_v2_kernel._codes``, which takes one code per byte). So a word's 2 * 8/BITS codes cost 8/BITS masks and
fewer shifts where bytes cost a shift, a mask and a repack each. On NVIDIA GPUs the mask, the OR and the split into
two bfloat16 registers are one ``lop3`` and a register move (``WORDS`` 2); portable Triton splits the halves with a
shift and two truncations (``WORDS`` 1), which ptxas repacks with ``prmt``.

Offline sm_90a SASS (triton 3.7.1's ptxas) of kernel v3's C4R4 tile loop, instructions a thread: 4,003 with bytes,
3,662 with portable words, 2,848 with words split in PTX.
"""

from __future__ import annotations

import triton
import triton.language as tl

# (x & mask) | 0x43004300 in one lop3 (LUT 0xEA), then the halves as two bfloat16 registers. The _ALT forms use ^
# (LUT 0x6A; the same bits, as the mask and 0x4300 share none) so that CSE keeps QK's and PV's operands apart (all
# of a tile's operands would stay live across the softmax: attention_v2_kernel._codes).
ASM_NIBBLES = tl.constexpr("{ .reg .b32 t; lop3.b32 t, $2, 983055, 1124090624, 0xEA; mov.b32 {$0, $1}, t; }")
ASM_NIBBLES_ALT = tl.constexpr("{ .reg .b32 t; lop3.b32 t, $2, 983055, 1124090624, 0x6A; mov.b32 {$0, $1}, t; }")
ASM_CRUMBS = tl.constexpr("{ .reg .b32 t; lop3.b32 t, $2, 196611, 1124090624, 0xEA; mov.b32 {$0, $1}, t; }")
ASM_CRUMBS_ALT = tl.constexpr("{ .reg .b32 t; lop3.b32 t, $2, 196611, 1124090624, 0x6A; mov.b32 {$0, $1}, t; }")


@triton.jit
def load_words(pages_ptr, page_off, tp, ld_mask, lv0, c, BYTES: tl.constexpr, CW: tl.constexpr,
               CODES_OFF: tl.constexpr):
    """Bytes ``[c*CW, (c+1)*CW)`` of the tile's packed code rows (``BYTES`` a token from ``CODES_OFF``, token ``tp``
    of its page at byte ``page_off``, a multiple of the page's bytes) as uint32 words ``[BLOCK_N, CW // 4]``; 0
    outside ``ld_mask``. Every layout PackFormat builds keeps these runs 4-byte aligned. ``lv0``: a loop-variant zero
    (``attention_v2_kernel._load_raw``)."""
    tl.static_assert((CW % 4 == 0 and BYTES % 4 == 0) and CODES_OFF % 4 == 0, "code words need 4-byte aligned runs")
    W: tl.constexpr = CW // 4
    row = pages_ptr.to(tl.pointer_type(tl.uint32)) + (page_off + CODES_OFF + tp * BYTES) // 4
    col = tl.max_contiguous(tl.multiple_of(c * W + tl.arange(0, W) + lv0, W), W)
    return tl.load(row[:, None] + col[None, :], mask=ld_mask, other=0)


@triton.jit
def _or_bias_split(x, ASM: tl.constexpr):
    """uint32 ``x`` ``[N, W]`` -> ``[N, W, 2]`` bfloat16 ``128 + code`` of its two masked halves (NVIDIA PTX)."""
    lo, hi = tl.inline_asm_elementwise(ASM, "=h,=h,r", [x], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    return tl.join(lo, hi)


@triton.jit
def word_pair(w, SHIFT: tl.constexpr, BITS: tl.constexpr, BIAS: tl.constexpr, DOT_BF16: tl.constexpr,
              ALT: tl.constexpr, PTX_SPLIT: tl.constexpr):
    """The codes at bit ``SHIFT`` of both 16-bit halves of the words ``w`` ``[N, W]`` as ``BIAS + code``
    ``[N, W, 2]`` (low half first) in the dot dtype (bfloat16 or float32). ``ALT``: the PV pass's form (the same
    values). ``PTX_SPLIT``: in NVIDIA PTX (bfloat16 dots with BIAS 128 only)."""
    MASK: tl.constexpr = ((1 << BITS) - 1) * 0x00010001
    if (DOT_BF16 and BIAS == 128) and PTX_SPLIT:  # no chained and: triton 3.3 refuses it
        if BITS == 4:
            return _or_bias_split(w >> SHIFT, ASM_NIBBLES_ALT if ALT else ASM_NIBBLES)
        else:
            return _or_bias_split(w >> SHIFT, ASM_CRUMBS_ALT if ALT else ASM_CRUMBS)
    elif DOT_BF16 and BIAS == 128:
        v = (w >> SHIFT) & MASK
        if ALT:
            v = v + 0x43004300
        else:
            v = v | 0x43004300
        return tl.join(v.to(tl.int16), (v >> 16).to(tl.int16)).to(tl.bfloat16, bitcast=True)
    else:
        v = (w >> SHIFT) & MASK
        x = tl.join(v & 0xFFFF, v >> 16) + BIAS
        if DOT_BF16:
            return x.to(tl.bfloat16)
        else:
            return x.to(tl.float32)


@triton.jit
def word_channels(c0, CW: tl.constexpr, PLANES: tl.constexpr, BYTES: tl.constexpr, LANES: tl.constexpr):
    """Channel of each column ``e`` (``[CW * PLANES]``) of the run of ``CW`` code bytes from byte ``c0`` of a vector
    packed into ``BYTES`` bytes (plane ``pl`` of byte ``j`` is channel ``pl*BYTES + j``), in :func:`quad_order`.
    Column ``h + 2*u + 2*L*(m + M*v)`` (``M = 2*PLANES``, ``m = b*PLANES + pl``) is plane ``pl`` of byte
    ``4*i + 2*h + b`` of the run, word ``i = u*(CW/4/L) + v``; ``L`` is ``LANES`` where it divides the run's
    ``CW // 4`` words, else 1 (then a row's words lie in consecutive columns)."""
    e = tl.arange(0, CW * PLANES)
    L: tl.constexpr = LANES if (CW // 4) % LANES == 0 else 1
    M: tl.constexpr = 2 * PLANES
    m = (e // (2 * L)) % M
    word = ((e // 2) % L) * (CW // 4 // L) + e // (2 * L * M)
    return (m % PLANES) * BYTES + c0 + 4 * word + 2 * (e % 2) + m // PLANES


@triton.jit
def quad_order(x, N: tl.constexpr, CW: tl.constexpr, LANES: tl.constexpr, K: tl.constexpr):
    """Codes of a run of ``CW`` bytes, ``x`` ``[N, CW // 4, 2, 2, ...]`` (word, half, then ``K`` axes of the code's
    byte and plane bits, :func:`word_pair`'s pairs joined), as dot operands ``[N, CW // 4 * 2**(K + 1)]`` in
    :func:`word_channels` order. With ``LANES`` 4 the word index's high bits are the quad's lane bits of a ``wgmma``
    register operand and the half, byte and plane bits are register bits, so each thread converts words it holds
    and only the raw words change layout; with 1 the operand is built in the words' layout and the compiler moves
    it through shared memory."""
    L: tl.constexpr = LANES if (CW // 4) % LANES == 0 else 1
    W: tl.constexpr = CW // 4
    if K == 1:  # [N, u, v, h, b] -> [N, v, b, u, h]
        x = tl.permute(tl.reshape(x, [N, L, W // L, 2, 2]), (0, 2, 4, 1, 3))
    elif K == 2:
        x = tl.permute(tl.reshape(x, [N, L, W // L, 2, 2, 2]), (0, 2, 4, 5, 1, 3))
    else:
        x = tl.permute(tl.reshape(x, [N, L, W // L, 2, 2, 2, 2]), (0, 2, 4, 5, 6, 1, 3))
    return tl.reshape(x, [N, W * (2 << K)])
