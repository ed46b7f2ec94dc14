// QuantMLA CuPy backend: helpers shared by the writer and the attention kernels.
//
// Compiled at run time by NVRTC (through cupy.RawModule) or, in the CPU test, by nvcc -ptx.
// Includes no system header, so it compiles in NVRTC without a CUDA include path.
// Every layout constant arrives as a -D define computed from quantmla_core.formats.PackFormat
// by quantmla_core.backends.cupy.format_defines(); nothing about the page layout is typed here.
#pragma once

#ifndef QMLA_DC
#error "QMLA_DC (latent dim) must be defined by the launcher"
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define QMLA_INF __int_as_float(0x7f800000)

// seq_lens / seq_ids of the attention kernels: int64, or int32 with QMLA_INDEX64=0 (the launcher
// builds the width the caller passes, so neither is converted per call)
#ifndef QMLA_INDEX64
#define QMLA_INDEX64 1
#endif
#if QMLA_INDEX64
typedef long long qmla_index_t;
#else
typedef int qmla_index_t;
#endif

// ----------------------------------------------------------------- bfloat16 bit helpers
// float32 -> bfloat16 bits, round to nearest even (the reference's bit trick; NaN stays NaN).
__device__ __forceinline__ u16 f32_to_bf16_bits(float x) {
    u32 b = __float_as_uint(x);
    if ((b & 0x7f800000u) == 0x7f800000u && (b & 0x007fffffu)) return (u16)((b >> 16) | 0x40u);
    b = b + 0x7fffu + ((b >> 16) & 1u);
    return (u16)(b >> 16);
}

__device__ __forceinline__ float bf16_bits_to_f32(u32 h) { return __uint_as_float(h << 16); }

// two floats -> packed bf16x2 (lo in the low half), round to nearest even (sm_80+).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// d = a * b + c on bf16x2 (sm_80+); used with b = 1.0 to subtract zero points exactly.
__device__ __forceinline__ u32 fma_bf16x2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// ----------------------------------------------------------------- code pairs -> bf16 (kernels v4, v5)
// Every value is dequantized as a bf16 cache would store it: bf16(s * (code - z)), rounded once.

// bf16x2 (128 + code) of bytes 0, 1 (HI = 0) or 2, 3 (HI = 1) of a word of codes (one per byte)
template <int HI>
__device__ __forceinline__ u32 qmla_code2(u32 x) {
    return __byte_perm(x, 0x43u, HI ? 0x4342u : 0x4140u);
}

// 2-bit codes converted where they lie in their byte (kernel v5's QMLA_CODES_IN_PLACE): a prmt moves a byte pair to
// the low bytes of the two half-words, once for all four slices, and one lop3 per slice masks the code and adds the
// exponent byte: bf16 128 + 2^p code, p = qmla_code_pos(c). The top slice's bits 6-7 move to 4-5 first (bit 7 is the
// exponent's). With the zero point placed at 2^p (off2) and the scale divided by 2^p (exact), the product is the same
// bf16(s * (code - z)). Per word of codes: 2 prmt, 2 shf, 8 lop3 (each slice shifted to bit 0: 3 shf, 4 lop3, 8 prmt).
__device__ __forceinline__ constexpr int qmla_code_pos(int c) { return c < 3 ? 2 * c : 4; }

// bytes 0, 1 (HI = 0) or 2, 3 (HI = 1) of w in the low bytes of the two half-words (the high bytes: don't care)
template <int HI>
__device__ __forceinline__ u32 qmla_pair_bytes(u32 w) {
    u32 d;
    asm("prmt.b32 %0, %1, %1, %2;" : "=r"(d) : "r"(w), "n"(HI ? 0x3322 : 0x1100));
    return d;
}

// 0x43004300 from x, whose low byte is 0x43 and which ptxas cannot fold (qmla_code2_in_place's m43: as an immediate
// beside the mask, ptxas splits its lop3 in two)
__device__ __forceinline__ u32 qmla_m43(u32 x) { return __byte_perm(x, 0u, 0x0404); }

// bf16x2 (128 + 2^p code) of slice c of the byte pair y (qmla_pair_bytes); m43 = qmla_m43(...)
__device__ __forceinline__ u32 qmla_code2_in_place(u32 y, int c, u32 m43) {
    return ((c == 3 ? y >> 2 : y) & (0x00030003u << qmla_code_pos(c))) | m43;
}

// zero point and bf16x2 scale of slice c for qmla_code2_in_place's codes: -(128 + 2^p z), s / 2^p (a zero scale
// stays zero)
__device__ __forceinline__ u32 qmla_off2_in_place(u32 z, int c) {
    const int p = qmla_code_pos(c);
    return 0xc300c300u | (z << p) | (z << (16 + p));
}
__device__ __forceinline__ u32 qmla_s2_in_place(u32 s2, int c) {
    const int p = qmla_code_pos(c);
    return p ? fma_bf16x2(s2, (0x3f80u - ((u32)p << 7)) * 0x10001u, 0x80008000u) : s2;
}

// bf16x2 of s * (code - z) for two codes given as bf16x2 (128 + code); off2 = bf16x2 -(128 + z).
// Content scales in bf16 (s2 = bf16x2 s): the subtraction is exact, the product rounds once.
__device__ __forceinline__ u32 qmla_dq2_bf16(u32 c2, u32 off2, u32 s2) {
    return fma_bf16x2(fma_bf16x2(c2, 0x3f803f80u, off2), s2, 0x80008000u);
}

// the same with a float32 scale: (code - z) exactly in bf16, then products and one rounding in float
__device__ __forceinline__ u32 qmla_dq2_f32(u32 c2, u32 off2, float s) {
    const u32 d = fma_bf16x2(c2, 0x3f803f80u, off2);
    return pack_bf16x2(__uint_as_float(d << 16) * s, __uint_as_float(d & 0xffff0000u) * s);
}

// ----------------------------------------------------------------- programmatic dependent launch (sm_90+)
// The combine, launched after a split kernel with PDL (pdl.py), waits here for that kernel to finish and for its
// writes before its first load; without PDL (or before sm_90) the wait returns at once. The split kernels trigger
// nothing: each CTA triggers as it exits, so the combine's CTAs start on a GPU that is all but free. A trigger
// after the tile loops (H100, stop 61) started them while the split kernel's last CTAs held most SMs, and made H16
// B8 L32K 2-3 % and H128 B128 L32K C2R4 3 % slower.
__device__ __forceinline__ void qmla_wait_prior_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// ----------------------------------------------------------------- merging split partials (the combine, v6's clusters)
// A query row's splits i, each an unnormalized partial output O_i with its row maximum m_i (log2 units) and sum l_i:
// out = sum_i 2^(m_i - M) O_i / den, den = sum_i 2^(m_i - M) l_i, lse = ln 2 * (M + log2 den). Sums run over i in
// order and skip the splits that saw no token (m_i = -inf), so every kernel that merges with these is bit-identical.

// (M, den) of n partials' (m, l)
__device__ __forceinline__ float2 qmla_merge_stats(const float2* ml, int n) {
    float M = -QMLA_INF;
    for (int i = 0; i < n; ++i) M = fmaxf(M, ml[i].x);
    float den = 0.0f;
    for (int i = 0; i < n; ++i) {
        const float2 v = ml[i];
        if (v.x != -QMLA_INF) den += exp2f(v.x - M) * v.y;
    }
    return make_float2(M, den);
}

// lse of a merged row (-inf where no split saw a token)
__device__ __forceinline__ float qmla_merged_lse(float2 st) {
    return st.y > 0.0f ? 0.69314718055994531f * (st.x + log2f(st.y)) : -QMLA_INF;
}

// a += 2^(m - M) o for one partial's 4 channels (v = its (m, l))
__device__ __forceinline__ void qmla_combine_add(float4& a, float2 v, float M, float4 o) {
    if (v.x != -QMLA_INF) {
        const float w = exp2f(v.x - M);
        a.x += w * o.x;
        a.y += w * o.y;
        a.z += w * o.z;
        a.w += w * o.w;
    }
}

// 4 merged channels a / den (0 where den is 0)
__device__ __forceinline__ float4 qmla_merged_f32x4(float4 a, float den) {
    const float inv = den > 0.0f ? 1.0f / den : 0.0f;
    return make_float4(a.x * inv, a.y * inv, a.z * inv, a.w * inv);
}

// the same as bf16
__device__ __forceinline__ uint2 qmla_merged_bf16x4(float4 a, float den) {
    a = qmla_merged_f32x4(a, den);
    return make_uint2((u32)f32_to_bf16_bits(a.x) | ((u32)f32_to_bf16_bits(a.y) << 16),
                      (u32)f32_to_bf16_bits(a.z) | ((u32)f32_to_bf16_bits(a.w) << 16));
}

// ----------------------------------------------------------------- tensor-core helpers
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x2(u32 addr, u32& r0, u32& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// C[16x8] += A[16x16] * B[16x8], bf16 inputs, float32 accumulators.
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ----------------------------------------------------------------- asynchronous copies (sm_80+)
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("{ .reg .u64 g; cvta.to.global.u64 g, %1; cp.async.cg.shared.global [%0], [g], 16; }"
                 :: "r"(smem_addr(dst)), "l"(src) : "memory");
}

// copies the first src_bytes (0..16) of the chunk and zero-fills the rest (src_bytes 0 reads nothing)
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, int src_bytes) {
    asm volatile("{ .reg .u64 g; cvta.to.global.u64 g, %1; cp.async.cg.shared.global [%0], [g], 16, %2; }"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    asm volatile("{ .reg .u64 g; cvta.to.global.u64 g, %1; cp.async.ca.shared.global [%0], [g], 8; }"
                 :: "r"(smem_addr(dst)), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// ---------------------------------------------------------------- many-row softmax steps (attention_v4.cu, attention_v6.cu)
// A lane holds two query rows (k >> 1) of NJ 8-token groups: S[j][k] is token n0 + 8 j + 2 q4 + (k & 1).

// Scale the lane's scores to base 2 and take each row's maximum over them; where not `whole` (both rows
// attend to every token of the tile), tokens outside [keep_lo, lim[row]) become -inf.
template <int NJ>
__device__ __forceinline__ void qmla_mask_row_max(float (&S)[NJ][4], int n0, int q4, int keep_lo, const int (&lim)[2],
                                                  float scale_log2, bool whole, float (&mx)[2]) {
    mx[0] = mx[1] = -QMLA_INF;
    if (whole) {
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                S[j][k] *= scale_log2;
                mx[k >> 1] = fmaxf(mx[k >> 1], S[j][k]);
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int n = n0 + 8 * j + 2 * q4 + (k & 1);
                S[j][k] = (n >= keep_lo && n < lim[k >> 1]) ? S[j][k] * scale_log2 : -QMLA_INF;
                mx[k >> 1] = fmaxf(mx[k >> 1], S[j][k]);
            }
        }
    }
}

// With each row's new maximum mt[k] (>= m_run[k]): al = 2^(m_run - mt), S = 2^(S - mt) (a row still at -inf
// subtracts 0 and keeps zeros), m_run = mt, l_run = l_run al + the lane's new sums
template <int NJ>
__device__ __forceinline__ void qmla_rows_exp(float (&S)[NJ][4], float mt, int k, float (&m_run)[2], float (&l_run)[2],
                                              float (&al)[2]) {
    const float u = (mt == -QMLA_INF) ? 0.0f : mt;
    al[k] = exp2f(m_run[k] - u);
    m_run[k] = mt;
    l_run[k] *= al[k];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        S[j][2 * k] = exp2f(S[j][2 * k] - u);
        S[j][2 * k + 1] = exp2f(S[j][2 * k + 1] - u);
        l_run[k] += S[j][2 * k] + S[j][2 * k + 1];
    }
}

// acc (mma / wgmma C fragments: rows g8 and g8 + 8 in elements 0-1 and 2-3) *= the rows' factors a0, a1;
// LAZY skips it while every factor of the warp is exactly 1 (bit-identical; all 32 lanes active)
template <bool LAZY, int N>
__device__ __forceinline__ void qmla_rescale_rows(float (&acc)[N][4], float a0, float a1) {
    if (!LAZY || __any_sync(0xffffffffu, a0 != 1.0f || a1 != 1.0f)) {
#pragma unroll
        for (int n = 0; n < N; ++n) {
            acc[n][0] *= a0;
            acc[n][1] *= a0;
            acc[n][2] *= a1;
            acc[n][3] *= a1;
        }
    }
}

// ---------------------------------------------------------------- split-KV softmax steps
// Shared by attention.cu and attention_v2.cu. Scores of one 16-row x (8 * NTQ_)-token tile live
// in mma C-fragment order: lane (g, q) holds rows g and g + 8, tokens 8j + 2q and 8j + 2q + 1.

// Sum the NW_ warps' partial scores from the exchange buffer xw[(warp * NTQ_ + j) * 32 + lane],
// scale them to base 2 and mask tokens at or past each row's limit (causal limit / end of request).
template <int NTQ_, int NW_, typename I>
__device__ __forceinline__ void qmla_sum_partials(const float4* xw, int lane, I t0, int q4, I lim0, I lim1,
                                                  float scale_log2, float (&S)[NTQ_][4]) {
#pragma unroll
    for (int j = 0; j < NTQ_; ++j) {
        float4 a = xw[(0 * NTQ_ + j) * 32 + lane];
#pragma unroll
        for (int ww = 1; ww < NW_; ++ww) {
            const float4 v = xw[(ww * NTQ_ + j) * 32 + lane];
            a.x += v.x;
            a.y += v.y;
            a.z += v.z;
            a.w += v.w;
        }
        const I n = t0 + 8 * j + 2 * q4;
        S[j][0] = (n < lim0) ? a.x * scale_log2 : -QMLA_INF;
        S[j][1] = (n + 1 < lim0) ? a.y * scale_log2 : -QMLA_INF;
        S[j][2] = (n < lim1) ? a.z * scale_log2 : -QMLA_INF;
        S[j][3] = (n + 1 < lim1) ? a.w * scale_log2 : -QMLA_INF;
    }
}

// One online-softmax step (base 2) for the lane's two rows: running maxima m0/m1 and sums l0/l1
// are updated, S becomes the unnormalised probabilities and the output accumulators are rescaled.
// A row whose scores are all -inf so far keeps max -inf and contributes zeros (never NaN).
// LAZY skips the accumulator rescale when no row of the warp changed its maximum (every factor is
// exactly 1.0 then, so the result is bit-identical); all 32 lanes must be active.
template <int NTQ_, int NTP_, bool LAZY = false>
__device__ __forceinline__ void qmla_online_softmax(float (&S)[NTQ_][4], float& m0, float& m1, float& l0, float& l1,
                                                    float (&acc)[NTP_][4]) {
    float mx0 = m0, mx1 = m1;
#pragma unroll
    for (int j = 0; j < NTQ_; ++j) {
        mx0 = fmaxf(mx0, fmaxf(S[j][0], S[j][1]));
        mx1 = fmaxf(mx1, fmaxf(S[j][2], S[j][3]));
    }
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
    }
    const float u0 = (mx0 == -QMLA_INF) ? 0.0f : mx0;
    const float u1 = (mx1 == -QMLA_INF) ? 0.0f : mx1;
    const float al0 = exp2f(m0 - u0), al1 = exp2f(m1 - u1);
    m0 = mx0;
    m1 = mx1;
    l0 *= al0;
    l1 *= al1;
#pragma unroll
    for (int j = 0; j < NTQ_; ++j) {
        S[j][0] = exp2f(S[j][0] - u0);
        S[j][1] = exp2f(S[j][1] - u0);
        S[j][2] = exp2f(S[j][2] - u1);
        S[j][3] = exp2f(S[j][3] - u1);
        l0 += S[j][0] + S[j][1];
        l1 += S[j][2] + S[j][3];
    }
    qmla_rescale_rows<LAZY>(acc, al0, al1);
}
