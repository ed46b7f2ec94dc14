// QuantMLA CuPy backend: fused quantize + split-half pack + page write + sink/ring update.
//
// One warp per token, QMLA_WRITER_WARPS warps per block, one launch per call.
// Inputs: latent [N, DC], k_rope [N, DR] (float32, or bfloat16 with QMLA_IN_BF16=1; rows 16-byte
// aligned), index arrays as int64. Tokens whose slot is outside [0, num_slots) are skipped
// entirely; the protection copy is skipped when the seq id or position is out of range, so a bad
// index never writes outside the cache.
//
// Lane layout (per path, content or RoPE, of D values at BITS bits): split-half packing puts
// element j + p * NB of the token (NB = D * BITS / 8 bytes, p < K = 8 / BITS) into bits
// [p * BITS, (p + 1) * BITS) of byte j. Lane l holds, in every plane p, the CB = NB / 32 elements
// p * NB + l * CB .. + CB - 1, so it loads K contiguous runs and packs its CB bytes without
// exchanging values with other lanes; only the group minima and maxima cross lanes (shuffles).
//
// Quantizer math is float32 (DESIGN.md 3.1). Scales and zero points use IEEE division and match
// the reference exactly; codes multiply by a per-group reciprocal, so they may differ by 1 where
// x/s lies within float32 rounding of a .5 boundary.
#include "common.cuh"

#define DC QMLA_DC
#define DR QMLA_DR
#define DT (QMLA_DC + QMLA_DR)
#define NWARP QMLA_WRITER_WARPS

#if QMLA_QUANT
#define NGC (QMLA_DC / QMLA_GC)
#define NGR (QMLA_DR / QMLA_GR)
#define CBITS_ QMLA_CBITS
#define RBITS_ QMLA_RBITS
#define GC_ QMLA_GC
#define GR_ QMLA_GR
#else
#define CBITS_ 16
#define RBITS_ 16
#define GC_ QMLA_DC
#define GR_ QMLA_DR
#endif

#if QMLA_IN_BF16
typedef u16 in_t;
#else
typedef float in_t;
#endif

// Where one path's values sit in the lanes (see the header comment).
template <int D, int BITS>
struct Lanes {
    static constexpr int K = BITS >= 16 ? 1 : 8 / BITS;  // planes: values per code byte
    static constexpr int NB = D / K;                     // values per plane (code bytes per token)
    static constexpr int CB = NB >= 32 ? NB / 32 : 1;    // values per lane per plane
    static constexpr int LANES = NB / CB;                // lanes holding values (<= 32)
    static_assert(NB % CB == 0 && LANES <= 32, "plane split");
};

// ---------------------------------------------------------------- vector moves of CB values
// CB consecutive input values -> float (the run starts CB-aligned, rows are 16-byte aligned).
template <int CB>
__device__ __forceinline__ void load_run(const in_t* src, float* x) {
#if QMLA_IN_BF16
    if constexpr (CB % 8 == 0) {
#pragma unroll
        for (int v = 0; v < CB / 8; ++v) {
            const uint4 w = ((const uint4*)src)[v];
            const u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                x[8 * v + 2 * i] = __uint_as_float(ws[i] << 16);
                x[8 * v + 2 * i + 1] = __uint_as_float(ws[i] & 0xffff0000u);
            }
        }
    } else if constexpr (CB == 4) {
        const uint2 w = *(const uint2*)src;
        x[0] = __uint_as_float(w.x << 16), x[1] = __uint_as_float(w.x & 0xffff0000u);
        x[2] = __uint_as_float(w.y << 16), x[3] = __uint_as_float(w.y & 0xffff0000u);
    } else if constexpr (CB == 2) {
        const u32 w = *(const u32*)src;
        x[0] = __uint_as_float(w << 16), x[1] = __uint_as_float(w & 0xffff0000u);
    } else {
        x[0] = bf16_bits_to_f32(src[0]);
    }
#else
    if constexpr (CB % 4 == 0) {
#pragma unroll
        for (int v = 0; v < CB / 4; ++v) {
            const float4 w = ((const float4*)src)[v];
            x[4 * v] = w.x, x[4 * v + 1] = w.y, x[4 * v + 2] = w.z, x[4 * v + 3] = w.w;
        }
    } else if constexpr (CB == 2) {
        const float2 w = *(const float2*)src;
        x[0] = w.x, x[1] = w.y;
    } else {
        x[0] = src[0];
    }
#endif
}

// CB bytes -> dst (CB-aligned): byte u is the low byte of b[u] (higher bits are ignored).
template <int CB>
__device__ __forceinline__ void store_bytes(u8* dst, const u32* b) {
    if constexpr (CB >= 4) {
        u32 w[CB / 4];
#pragma unroll
        for (int i = 0; i < CB / 4; ++i)
            w[i] = __byte_perm(__byte_perm(b[4 * i], b[4 * i + 1], 0x0040u), __byte_perm(b[4 * i + 2], b[4 * i + 3], 0x0040u),
                               0x5410u);
        if constexpr (CB == 16) *(uint4*)dst = make_uint4(w[0], w[1], w[2], w[3]);
        else if constexpr (CB == 8) *(uint2*)dst = make_uint2(w[0], w[1]);
        else *(u32*)dst = w[0];
    } else if constexpr (CB == 2) {
        *(u16*)dst = (u16)__byte_perm(b[0], b[1], 0x0040u);
    } else {
        dst[0] = (u8)b[0];
    }
}

// CB values as bfloat16 -> dst (CB-aligned, 2 * CB bytes).
template <int CB>
__device__ __forceinline__ void store_bf16_run(u16* dst, const float* x) {
    if constexpr (CB % 8 == 0) {
#pragma unroll
        for (int v = 0; v < CB / 8; ++v) {
            u32 w[4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                w[i] = (u32)f32_to_bf16_bits(x[8 * v + 2 * i]) | ((u32)f32_to_bf16_bits(x[8 * v + 2 * i + 1]) << 16);
            ((uint4*)dst)[v] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    } else if constexpr (CB == 4) {
        *(uint2*)dst = make_uint2((u32)f32_to_bf16_bits(x[0]) | ((u32)f32_to_bf16_bits(x[1]) << 16),
                                  (u32)f32_to_bf16_bits(x[2]) | ((u32)f32_to_bf16_bits(x[3]) << 16));
    } else if constexpr (CB == 2) {
        *(u32*)dst = (u32)f32_to_bf16_bits(x[0]) | ((u32)f32_to_bf16_bits(x[1]) << 16);
    } else {
        dst[0] = f32_to_bf16_bits(x[0]);
    }
}

// ---------------------------------------------------------------- one path of one token
// x[p][u] = value p * NB + lane * CB + u of the token's D-wide path (lanes >= LANES hold zeros).
template <int D, int BITS>
__device__ __forceinline__ void load_path(const in_t* row, int lane, float (&x)[Lanes<D, BITS>::K][Lanes<D, BITS>::CB]) {
    using S = Lanes<D, BITS>;
#pragma unroll
    for (int p = 0; p < S::K; ++p) {
        if (lane < S::LANES) {
            load_run<S::CB>(row + p * S::NB + lane * S::CB, x[p]);
        } else {
#pragma unroll
            for (int u = 0; u < S::CB; ++u) x[p][u] = 0.0f;
        }
    }
}

#if QMLA_QUANT
// 1.5 * 2^23: a float32 in [MAGIC, MAGIC + 2^22) holds the integer (value - MAGIC) in its low
// mantissa bits, so adding it rounds to an integer (half to even) and the bits hold the code.
#define MAGIC 12582912.0f

// Scale (stored), zero point and reciprocal of a group with range [lo, hi] (DESIGN.md 3.1):
// s = max(hi - lo, 1e-8) / M rounded to the stored dtype, z = clamp(rint(-lo / s), 0, M).
template <int BITS, bool SCALE_BF16>
__device__ __forceinline__ void group_params(float lo, float hi, float& s, float& zf, float& r) {
    constexpr float M = (float)((1 << BITS) - 1);
    s = __fdiv_rn(fmaxf(hi - lo, 1e-8f), M);
    if (SCALE_BF16) {
        s = fminf(s, __uint_as_float(0x7f7f0000u));  // largest finite bfloat16
        s = bf16_bits_to_f32(f32_to_bf16_bits(s));
    } else {
        s = fminf(s, __uint_as_float(0x7f7fffffu));  // largest finite float32
    }
    zf = fminf(fmaxf(rintf(__fdiv_rn(-lo, s)), 0.0f), M);
    // x / s as (x * 2^-64) * rn(1 / (s * 2^-64)): no division per value; the 2^-64 keeps the
    // reciprocal of a clamped huge scale a normal float
    r = __frcp_rn(s * 0x1p-64f);
}

template <bool SCALE_BF16>
__device__ __forceinline__ void store_group(u8* scales, u8* zeros, int i, float s, float zf) {
    if (SCALE_BF16) ((u16*)scales)[i] = f32_to_bf16_bits(s);
    else ((float*)scales)[i] = s;
    zeros[i] = (u8)zf;
}

// Quantize and store one path of the token at slot offset `off` of page `pg`: codes (split-half
// packed), scales (bf16 or f32) and zero points of its groups of G values. x holds the values on
// entry and their finite-or-zero versions on return (non-finite values count as 0).
template <int D, int BITS, int G, bool SCALE_BF16>
__device__ __forceinline__ void quantize_path(float (&x)[Lanes<D, BITS>::K][Lanes<D, BITS>::CB], int lane, u8* codes,
                                              u8* scales, u8* zeros, int off) {
    using S = Lanes<D, BITS>;
    constexpr int K = S::K, NB = S::NB, CB = S::CB;
    constexpr int NG = D / G;
    static_assert(G % CB == 0, "a lane's run lies in one group");
    // per plane: the range of this lane's run (the reference's min(., 0) / max(., 0))
    float lo[K], hi[K];
#pragma unroll
    for (int p = 0; p < K; ++p) {
        lo[p] = 0.0f, hi[p] = 0.0f;
#pragma unroll
        for (int u = 0; u < CB; ++u) {
            x[p][u] = fabsf(x[p][u]) < QMLA_INF ? x[p][u] : 0.0f;
            lo[p] = fminf(lo[p], x[p][u]), hi[p] = fmaxf(hi[p], x[p][u]);
        }
    }
    constexpr bool SPAN = G > NB;             // a group covers PG whole planes (all lanes)
    constexpr int PG = SPAN ? G / NB : 1;
    constexpr int GL = SPAN ? 32 : G / CB;    // lanes sharing a group in a plane
    constexpr bool SCATTER = !SPAN && K > 1;  // one group per lane after a reduce-scatter
    float mz[K], r[K];  // per plane: MAGIC + zero point, reciprocal
    if constexpr (SCATTER) {
        // Reduce-scatter over the low log2(K) lane bits: at offset o a lane keeps the half of its
        // planes selected by its bit o and sends the other half to lane ^ o. Lane l ends with the
        // range of plane pl = l % K over K lanes, then a butterfly over offsets K .. GL / 2 gives
        // the group's range, and the lane computes that one group's parameters.
        static_assert(GL >= K && GL % K == 0, "the K lanes of a reduce-scatter share a group");
#pragma unroll
        for (int o = K / 2; o >= 1; o >>= 1) {
            const bool upper = lane & o;
#pragma unroll
            for (int i = 0; i < o; ++i) {
                const float send_lo = upper ? lo[i] : lo[i + o], send_hi = upper ? hi[i] : hi[i + o];
                const float keep_lo = upper ? lo[i + o] : lo[i], keep_hi = upper ? hi[i + o] : hi[i];
                lo[i] = fminf(keep_lo, __shfl_xor_sync(0xffffffffu, send_lo, o));
                hi[i] = fmaxf(keep_hi, __shfl_xor_sync(0xffffffffu, send_hi, o));
            }
        }
#pragma unroll
        for (int o = K; o < GL; o <<= 1) {
            lo[0] = fminf(lo[0], __shfl_xor_sync(0xffffffffu, lo[0], o));
            hi[0] = fmaxf(hi[0], __shfl_xor_sync(0xffffffffu, hi[0], o));
        }
        const int pl = lane % K;
        float s, zf, rl;
        group_params<BITS, SCALE_BF16>(lo[0], hi[0], s, zf, rl);
        if (lane % GL < K) store_group<SCALE_BF16>(scales, zeros, off * NG + (pl * NB + lane * CB) / G, s, zf);
        const float mzl = MAGIC + zf;
#pragma unroll
        for (int p = 0; p < K; ++p) {
            const int src = (lane & ~(K - 1)) | p;  // holds plane p of this lane's group
            mz[p] = __shfl_sync(0xffffffffu, mzl, src);
            r[p] = __shfl_sync(0xffffffffu, rl, src);
        }
    } else {
        if constexpr (SPAN) {
#pragma unroll
            for (int p = 0; p < K; ++p)
                if (p % PG) lo[p - p % PG] = fminf(lo[p - p % PG], lo[p]), hi[p - p % PG] = fmaxf(hi[p - p % PG], hi[p]);
        }
#pragma unroll
        for (int o = 1; o < GL; o <<= 1) {
#pragma unroll
            for (int p = 0; p < K; p += PG) {
                lo[p] = fminf(lo[p], __shfl_xor_sync(0xffffffffu, lo[p], o));
                hi[p] = fmaxf(hi[p], __shfl_xor_sync(0xffffffffu, hi[p], o));
            }
        }
#pragma unroll
        for (int p = 0; p < K; p += PG) {
            float s, zf;
            group_params<BITS, SCALE_BF16>(lo[p], hi[p], s, zf, r[p]);
            mz[p] = MAGIC + zf;
            const int g = SPAN ? p / PG : p * (NB / G) + lane * CB / G;  // group index in the token
            const bool leader = SPAN ? lane == 0 : (lane * CB) % G == 0 && lane < S::LANES;
            if (leader) store_group<SCALE_BF16>(scales, zeros, off * NG + g, s, zf);
        }
#pragma unroll
        for (int p = 0; p < K; ++p) mz[p] = mz[p - p % PG], r[p] = r[p - p % PG];
    }
    if (lane >= S::LANES) return;
    // code q = clamp(rint(x / s) + z, 0, M) as the low bits of fma(x * 2^-64, r, MAGIC + z) clamped
    // to [MAGIC, MAGIC + M]; byte u of the packed run is sum_p q_p << (p * BITS) in the low byte
    // of bytes[u] (the MAGIC bits shift above it; every q_p << p * BITS sum stays below 256).
    constexpr float M = (float)((1 << BITS) - 1);
    u32 bytes[CB];
#pragma unroll
    for (int u = 0; u < CB; ++u) bytes[u] = 0u;
#pragma unroll
    for (int p = 0; p < K; ++p) {
#pragma unroll
        for (int u = 0; u < CB; ++u) {
            const float q = fminf(fmaxf(fmaf(x[p][u] * 0x1p-64f, r[p], mz[p]), MAGIC), MAGIC + M);
            bytes[u] += __float_as_uint(q) << (p * BITS);
        }
    }
    store_bytes<CB>(codes + off * NB + lane * CB, bytes);
}
#undef MAGIC
#endif

// The path's values as bfloat16 into a [.., D] row (protection buffers; BF16 pages).
template <int D, int BITS>
__device__ __forceinline__ void store_path_bf16(u16* row, int lane, const float (&x)[Lanes<D, BITS>::K][Lanes<D, BITS>::CB]) {
    using S = Lanes<D, BITS>;
    if (lane >= S::LANES) return;
#pragma unroll
    for (int p = 0; p < S::K; ++p) store_bf16_run<S::CB>(row + p * S::NB + lane * S::CB, x[p]);
}

extern "C" __global__ void __launch_bounds__(NWARP * 32) qmla_write(
    const void* __restrict__ latent, const void* __restrict__ k_rope, const i64* __restrict__ slots,
    const i64* __restrict__ seq_ids, const i64* __restrict__ positions, const i64* __restrict__ seq_lens,
    u8* __restrict__ pages, u16* __restrict__ sink_buf, u16* __restrict__ local_buf, int n_tokens,
    i64 num_slots, int max_seqs, int sink, int local) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 t = (i64)blockIdx.x * NWARP + warp;
    if (t >= n_tokens) return;
    const i64 slot = slots[t];
    if (slot < 0 || slot >= num_slots) return;  // -1 skips; out of range is masked

    float xc[Lanes<DC, CBITS_>::K][Lanes<DC, CBITS_>::CB];
    float xr[Lanes<DR, RBITS_>::K][Lanes<DR, RBITS_>::CB];
    load_path<DC, CBITS_>((const in_t*)latent + t * DC, lane, xc);
    load_path<DR, RBITS_>((const in_t*)k_rope + t * DR, lane, xr);

    const i64 page = slot / QMLA_P;
    const int off = (int)(slot % QMLA_P);
    u8* pg = pages + page * (i64)QMLA_PAGE_BYTES;
#if QMLA_QUANT
    quantize_path<DC, CBITS_, GC_, (bool)QMLA_CSCALE_BF16>(xc, lane, pg + QMLA_OFF_CC, pg + QMLA_OFF_CS, pg + QMLA_OFF_CZ,
                                                          off);
    quantize_path<DR, RBITS_, GR_, (bool)QMLA_RSCALE_BF16>(xr, lane, pg + QMLA_OFF_RC, pg + QMLA_OFF_RS, pg + QMLA_OFF_RZ,
                                                          off);
#else
    store_path_bf16<DC, CBITS_>((u16*)(pg + QMLA_OFF_CC) + (i64)off * DC, lane, xc);
    store_path_bf16<DR, RBITS_>((u16*)(pg + QMLA_OFF_RC) + (i64)off * DR, lane, xr);
#endif

    // protection buffers: sink rows and the local ring (DESIGN.md 3.5), the values as given
    // (reloaded: the quantizer replaced non-finite values in xc / xr)
    const i64 seq = seq_ids[t];
    const i64 pos = positions[t];
    if (seq < 0 || seq >= max_seqs || pos < 0) return;
    const bool to_sink = pos < sink;
    const bool to_local = local > 0 && pos >= seq_lens[seq] - local;
    if (!to_sink && !to_local) return;
#if QMLA_QUANT
    load_path<DC, CBITS_>((const in_t*)latent + t * DC, lane, xc);
    load_path<DR, RBITS_>((const in_t*)k_rope + t * DR, lane, xr);
#endif
    if (to_sink) {
        u16* dst = sink_buf + (seq * sink + pos) * DT;
        store_path_bf16<DC, CBITS_>(dst, lane, xc);
        store_path_bf16<DR, RBITS_>(dst + DC, lane, xr);
    }
    if (to_local) {
        u16* dst = local_buf + (seq * local + pos % local) * DT;
        store_path_bf16<DC, CBITS_>(dst, lane, xc);
        store_path_bf16<DR, RBITS_>(dst + DC, lane, xr);
    }
}
