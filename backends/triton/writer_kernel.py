"""Writer kernel: quantize, split-half pack, slot-mapped page write and protection-buffer
update of BLOCK_T tokens per program, in one launch (DESIGN.md §3.1–3.5)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common_kernels import BF16_MAX, FLOAT32_MAX, TWO_POW_64, TWO_POW_M64, f32_to_bf16_bits, load_f32, rint, store_f32


@triton.jit
def _token_offsets(A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    """[1, A, B, C] element offsets ``a*B*C + b*C + c`` of one token's A*B*C-wide vector: the
    plane view of ``writer.plane_view`` (row-major, so any view of it loads the same elements)."""
    a = tl.arange(0, A)[None, :, None, None]
    b = tl.arange(0, B)[None, None, :, None]
    c = tl.arange(0, C)[None, None, None, :]
    return a * (B * C) + b * C + c


@triton.jit
def _quantize_store(
    x,  # [T, A, B, C] float32 in the plane view, non-finite values already replaced by 0
    page_ptr,  # [T] uint8 pointers to the tokens' pages
    t,  # [T] token offsets inside the pages
    ok,  # [T] the slot is valid
    BITS: tl.constexpr,
    SPAN: tl.constexpr,  # a group spans the B planes of an A row (else: one group per (a, b))
    CODES_OFF: tl.constexpr,
    SCALES_OFF: tl.constexpr,
    ZEROS_OFF: tl.constexpr,
    SCALE_BF16: tl.constexpr,
):
    """Quantize T tokens' vectors group by group; store packed codes, scales and zero points.

    In the plane view (``writer.plane_view``) every group is a slice ``x[:, a, b, :]`` (or
    ``x[:, a, :, :]`` with SPAN), and every byte of packed codes gathers its elements along the
    plane axes held by the same thread: no data crosses threads except the group reductions."""
    M: tl.constexpr = (1 << BITS) - 1
    T: tl.constexpr = x.shape[0]
    A: tl.constexpr = x.shape[1]
    B: tl.constexpr = x.shape[2]
    C: tl.constexpr = x.shape[3]
    lo = tl.min(x, axis=3, keep_dims=True)
    hi = tl.max(x, axis=3, keep_dims=True)
    if SPAN:
        lo = tl.min(lo, axis=2, keep_dims=True)  # [T, A, 1, 1]
        hi = tl.max(hi, axis=2, keep_dims=True)
    lo = tl.minimum(lo, 0.0)
    hi = tl.maximum(hi, 0.0)
    s = tl.math.div_rn(tl.maximum(hi - lo, 1e-8), tl.full(lo.shape, M, tl.float32))
    # group index of each [T, A, B or 1, 1] entry
    if SPAN:
        g = tl.arange(0, A)[None, :, None, None] + tl.zeros(lo.shape, tl.int32)
        ng: tl.constexpr = A
    else:
        g = tl.arange(0, A)[None, :, None, None] * B + tl.arange(0, B)[None, None, :, None]
        ng: tl.constexpr = A * B
    tok = t[:, None, None, None] * ng + g
    m4 = ok[:, None, None, None]
    if SCALE_BF16:
        sbits = f32_to_bf16_bits(tl.minimum(s, BF16_MAX))
        s = (sbits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        tl.store((page_ptr + SCALES_OFF).to(tl.pointer_type(tl.uint16))[:, None, None, None] + tok, sbits, mask=m4)
    else:
        s = tl.minimum(s, FLOAT32_MAX)
        tl.store((page_ptr + SCALES_OFF).to(tl.pointer_type(tl.float32))[:, None, None, None] + tok, s, mask=m4)
    z = tl.minimum(tl.maximum(rint(tl.math.div_rn(-lo, s)), 0.0), M)
    tl.store(page_ptr[:, None, None, None] + ZEROS_OFF + tok, z.to(tl.uint8), mask=m4)
    # x / s as (x * 2^-64) * (2^64 / s): no division per element (DESIGN §3.1 allows ±1 at .5
    # boundaries; the approximate reciprocal is within 2 ulp). The 2^64 keeps the reciprocal of a
    # clamped huge scale a normal float.
    r = TWO_POW_64 / s
    q = tl.minimum(tl.maximum(rint((x * TWO_POW_M64) * r) + z, 0.0), M).to(tl.int32)
    # split-half packing: plane p (a, or a*B + b with SPAN) goes to bits [p*BITS, (p+1)*BITS)
    if SPAN:
        plane = tl.arange(0, A)[None, :, None, None] * B + tl.arange(0, B)[None, None, :, None]
        packed = tl.sum(tl.sum(q << (plane * BITS), axis=2, keep_dims=True), axis=1, keep_dims=True)  # [T, 1, 1, C]
        byte = tl.arange(0, C)[None, None, None, :]
    else:
        plane = tl.arange(0, A)[None, :, None, None]
        packed = tl.sum(q << (plane * BITS), axis=1, keep_dims=True)  # [T, 1, B, C]
        byte = tl.arange(0, B)[None, None, :, None] * C + tl.arange(0, C)[None, None, None, :]
    NB: tl.constexpr = A * B * C * BITS // 8  # code bytes per token
    tl.store(page_ptr[:, None, None, None] + CODES_OFF + t[:, None, None, None] * NB + byte, packed.to(tl.uint8), mask=m4)


@triton.jit
def write_kernel(
    latent_ptr,  # [N, DC] float32 or bfloat16
    rope_ptr,  # [N, DR]
    slot_ptr,  # [N] int
    seq_ptr,  # [N] int
    pos_ptr,  # [N] int
    lens_ptr,  # [max_seqs] int
    pages_ptr,  # uint8 [num_pages, PAGE_BYTES]
    sink_ptr,  # [max_seqs, SINK, DC + DR] protection dtype
    local_ptr,  # [max_seqs, LOCAL, DC + DR]
    stride_latent,
    stride_rope,
    N,
    num_slots,  # num_pages * P
    max_seqs,
    SINK,
    LOCAL,
    IN_BF16: tl.constexpr,
    PROT_BF16: tl.constexpr,
    QUANT: tl.constexpr,
    DC: tl.constexpr,
    DR: tl.constexpr,
    CBITS: tl.constexpr,
    RBITS: tl.constexpr,
    CA: tl.constexpr,  # content plane view [CA, CB, CC] (writer.plane_view)
    CB: tl.constexpr,
    CC: tl.constexpr,
    C_SPAN: tl.constexpr,
    RA: tl.constexpr,  # RoPE plane view
    RB: tl.constexpr,
    RC: tl.constexpr,
    R_SPAN: tl.constexpr,
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
    BLOCK_T: tl.constexpr,
):
    """BLOCK_T tokens per program. A slot outside ``[0, num_slots)`` (e.g. -1) skips the token;
    a seq id outside ``[0, max_seqs)`` or a negative position skips its protection copy."""
    i = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = i < N
    slot = tl.load(slot_ptr + i, mask=in_range, other=-1).to(tl.int64)
    ok = in_range & (slot >= 0) & (slot < num_slots)
    slot_c = tl.where(ok, slot, 0)
    page_ptr = pages_ptr + (slot_c // P) * PAGE_BYTES  # [T]
    t = slot_c % P

    offs_c = _token_offsets(CA, CB, CC)  # [1, CA, CB, CC]
    offs_r = _token_offsets(RA, RB, RC)
    tok = i[:, None, None, None]
    m4 = ok[:, None, None, None]
    xc = load_f32(latent_ptr, tok * stride_latent + offs_c, m4, IN_BF16)  # [T, CA, CB, CC]
    xr = load_f32(rope_ptr, tok * stride_rope + offs_r, m4, IN_BF16)

    if QUANT:
        zc = tl.where(tl.abs(xc) < float("inf"), xc, 0.0)  # non-finite counts as 0
        zr = tl.where(tl.abs(xr) < float("inf"), xr, 0.0)
        _quantize_store(zc, page_ptr, t, ok, CBITS, C_SPAN, C_CODES_OFF, C_SCALES_OFF, C_ZEROS_OFF, C_SCALE_BF16)
        _quantize_store(zr, page_ptr, t, ok, RBITS, R_SPAN, R_CODES_OFF, R_SCALES_OFF, R_ZEROS_OFF, R_SCALE_BF16)
    else:
        slot_at = t[:, None, None, None]
        store_f32(page_ptr[:, None, None, None] + C_CODES_OFF, slot_at * DC + offs_c, xc, m4, True)
        store_f32(page_ptr[:, None, None, None] + R_CODES_OFF, slot_at * DR + offs_r, xr, m4, True)

    # protection buffers (pre-quantization values)
    seq = tl.load(seq_ptr + i, mask=ok, other=-1).to(tl.int64)
    pos = tl.load(pos_ptr + i, mask=ok, other=-1).to(tl.int64)
    live = ok & (seq >= 0) & (seq < max_seqs) & (pos >= 0)
    seq_c = tl.where(live, seq, 0)
    W: tl.constexpr = DC + DR
    to_sink = live & (pos < SINK)
    base_s = ((seq_c * SINK + tl.where(to_sink, pos, 0)) * W)[:, None, None, None]
    ms = to_sink[:, None, None, None]
    if tl.max(to_sink.to(tl.int32), axis=0) > 0:  # a uniform branch: most blocks of a prompt hold no sink token
        store_f32(sink_ptr, base_s + offs_c, xc, ms, PROT_BF16)
        store_f32(sink_ptr, base_s + DC + offs_r, xr, ms, PROT_BF16)
    length = tl.load(lens_ptr + seq_c, mask=live, other=0).to(tl.int64)
    to_local = live & (LOCAL > 0) & (pos >= length - LOCAL)
    ring = tl.where(to_local, pos % tl.maximum(LOCAL, 1), 0)
    base_l = ((seq_c * LOCAL + ring) * W)[:, None, None, None]
    ml = to_local[:, None, None, None]
    if tl.max(to_local.to(tl.int32), axis=0) > 0:  # ... nor a token of the local window
        store_f32(local_ptr, base_l + offs_c, xc, ml, PROT_BF16)
        store_f32(local_ptr, base_l + DC + offs_r, xr, ml, PROT_BF16)
