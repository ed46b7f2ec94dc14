"""Writer kernel: quantize, split-half pack, slot-mapped page write and protection-buffer
update of BLOCK_T tokens per program, in one launch (DESIGN.md §3.1–3.5)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common_kernels import BF16_MAX, FLOAT32_MAX, MAGIC, TWO_POW_64, TWO_POW_M64, f32_to_bf16_bits, load_f32, rint, store_f32


@triton.jit
def _quantize_store(
    x,  # [T, NG, G] float32, non-finite values already replaced by 0
    page_ptr,  # [T] uint8 pointers to the tokens' pages
    t,  # [T] token offsets inside the pages
    ok,  # [T] the slot is valid
    BITS: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    NG: tl.constexpr,
    CODES_OFF: tl.constexpr,
    SCALES_OFF: tl.constexpr,
    ZEROS_OFF: tl.constexpr,
    SCALE_BF16: tl.constexpr,
):
    """Quantize T tokens' ``D``-wide vectors in groups of ``G``; store codes, scales, zeros."""
    M: tl.constexpr = (1 << BITS) - 1
    K: tl.constexpr = 8 // BITS  # elements per byte
    T: tl.constexpr = x.shape[0]
    lo = tl.minimum(tl.min(x, axis=2), 0.0)  # [T, NG]
    hi = tl.maximum(tl.max(x, axis=2), 0.0)
    s = tl.math.div_rn(tl.maximum(hi - lo, 1e-8), tl.full([T, NG], M, tl.float32))
    gi = tl.arange(0, NG)[None, :]
    m2 = ok[:, None]
    if SCALE_BF16:
        sbits = f32_to_bf16_bits(tl.minimum(s, BF16_MAX))
        s = (sbits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        sp = (page_ptr + SCALES_OFF).to(tl.pointer_type(tl.uint16))
        tl.store(sp[:, None] + t[:, None] * NG + gi, sbits, mask=m2)
    else:
        s = tl.minimum(s, FLOAT32_MAX)
        sp = (page_ptr + SCALES_OFF).to(tl.pointer_type(tl.float32))
        tl.store(sp[:, None] + t[:, None] * NG + gi, s, mask=m2)
    z = tl.minimum(tl.maximum(rint(tl.math.div_rn(-lo, s)), 0.0), M)
    tl.store(page_ptr[:, None] + ZEROS_OFF + t[:, None] * NG + gi, z.to(tl.uint8), mask=m2)
    # x / s as (x * 2^-64) * (2^64 / s): no division per element, and an approximate one (within
    # 2 ulp) per group (DESIGN §3.1 allows ±1 at .5 boundaries). The 2^64 keeps the reciprocal of a
    # clamped huge scale a normal float.
    r = TWO_POW_64 / s
    # q = clamp(rint(x / s) + z, 0, M) as the low mantissa bits of fma(x', r, MAGIC + z) clamped to
    # [MAGIC, MAGIC + M]: one fused rounding per value, no float-to-int conversion (a fused or
    # twice-rounded fma may differ from rint(x / s) + z only at .5 ties, which DESIGN §3.1 allows)
    q = tl.fma(x * TWO_POW_M64, r[:, :, None], (z + MAGIC)[:, :, None])
    q = tl.minimum(tl.maximum(q, MAGIC), MAGIC + M).to(tl.int32, bitcast=True)
    # split-half packing: byte j holds elements j + i*D/K in bits [i*BITS, (i+1)*BITS). Only the
    # low byte of the sum is stored: the MAGIC bits shift above it, and the codes' sum fits in it.
    planes = tl.reshape(q, [T, K, D // K])
    shift = (tl.arange(0, K) * BITS)[None, :, None]
    packed = tl.sum(planes << shift, axis=1)  # [T, D // K]
    jj = tl.arange(0, D // K)[None, :]
    tl.store(page_ptr[:, None] + CODES_OFF + t[:, None] * (D // K) + jj, packed.to(tl.uint8), mask=m2)


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
    CG: tl.constexpr,
    RG: tl.constexpr,
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
    if BLOCK_T == 1:
        # One token per program (the GPU default): its slot, seq id and position are loaded once
        # as scalars and broadcast. A [1]-vector load is repeated for every layout it is used in.
        # unmasked: writer.py launches exactly N programs at BLOCK_T = 1, so tok < N (masked, the
        # kernel's static sm_90 SASS grows from 849 to 862 instructions: benchmarks/writer_sass.py)
        tok = tl.program_id(0).to(tl.int64)
        one = tl.zeros([BLOCK_T], tl.int64)
        i = tok + one
        slot = tl.load(slot_ptr + tok).to(tl.int64) + one
        seq_s = tl.load(seq_ptr + tok).to(tl.int64)
        known = (seq_s >= 0) & (seq_s < max_seqs)
        length = tl.load(lens_ptr + tl.where(known, seq_s, 0), mask=known, other=0).to(tl.int64) + one
        seq = seq_s + one
        pos = tl.load(pos_ptr + tok).to(tl.int64) + one
    else:
        i = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        slot = tl.load(slot_ptr + i, mask=i < N, other=-1).to(tl.int64)
        seq = tl.load(seq_ptr + i, mask=i < N, other=-1).to(tl.int64)
        pos = tl.load(pos_ptr + i, mask=i < N, other=-1).to(tl.int64)
        known = (i < N) & (seq >= 0) & (seq < max_seqs)
        length = tl.load(lens_ptr + tl.where(known, seq, 0), mask=known, other=0).to(tl.int64)
    in_range = i < N
    ok = in_range & (slot >= 0) & (slot < num_slots)
    slot_c = tl.where(ok, slot, 0)
    page_ptr = pages_ptr + (slot_c // P) * PAGE_BYTES  # [T]
    t = slot_c % P

    NGC: tl.constexpr = DC // CG
    NGR: tl.constexpr = DR // RG
    offs_c = (tl.arange(0, NGC)[:, None] * CG + tl.arange(0, CG)[None, :])[None, :, :]
    offs_r = (tl.arange(0, NGR)[:, None] * RG + tl.arange(0, RG)[None, :])[None, :, :]
    m3 = ok[:, None, None]
    xc = load_f32(latent_ptr, i[:, None, None] * stride_latent + offs_c, m3, IN_BF16)  # [T, NGC, CG]
    xr = load_f32(rope_ptr, i[:, None, None] * stride_rope + offs_r, m3, IN_BF16)  # [T, NGR, RG]

    if QUANT:
        zc = tl.where(tl.abs(xc) < float("inf"), xc, 0.0)  # non-finite counts as 0
        zr = tl.where(tl.abs(xr) < float("inf"), xr, 0.0)
        _quantize_store(zc, page_ptr, t, ok, CBITS, DC, CG, NGC, C_CODES_OFF, C_SCALES_OFF, C_ZEROS_OFF, C_SCALE_BF16)
        _quantize_store(zr, page_ptr, t, ok, RBITS, DR, RG, NGR, R_CODES_OFF, R_SCALES_OFF, R_ZEROS_OFF, R_SCALE_BF16)
    else:
        store_f32(page_ptr[:, None, None] + C_CODES_OFF, t[:, None, None] * DC + offs_c, xc, m3, True)
        store_f32(page_ptr[:, None, None] + R_CODES_OFF, t[:, None, None] * DR + offs_r, xr, m3, True)

    # protection buffers (pre-quantization values)
    live = ok & (seq >= 0) & (seq < max_seqs) & (pos >= 0)
    seq_c = tl.where(live, seq, 0)
    W: tl.constexpr = DC + DR
    to_sink = live & (pos < SINK)
    ms = to_sink[:, None, None]
    if tl.max(to_sink.to(tl.int32), axis=0) > 0:  # a uniform branch: most blocks of a prompt hold no sink token
        base_s = ((seq_c * SINK + tl.where(to_sink, pos, 0)) * W)[:, None, None]
        store_f32(sink_ptr, base_s + offs_c, xc, ms, PROT_BF16)
        store_f32(sink_ptr, base_s + DC + offs_r, xr, ms, PROT_BF16)
    to_local = live & (LOCAL > 0) & (pos >= length - LOCAL)
    ml = to_local[:, None, None]
    if tl.max(to_local.to(tl.int32), axis=0) > 0:  # ... nor a token of the local window
        ring = tl.where(to_local, pos % tl.maximum(LOCAL, 1), 0)
        base_l = ((seq_c * LOCAL + ring) * W)[:, None, None]
        store_f32(local_ptr, base_l + offs_c, xc, ml, PROT_BF16)
        store_f32(local_ptr, base_l + DC + offs_r, xr, ml, PROT_BF16)
