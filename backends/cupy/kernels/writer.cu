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

// CB bytes -> dst (CB-aligned).
template <int CB>
__device__ __forceinline__ void store_bytes(u8* dst, const u32* b) {
    if constexpr (CB >= 4) {
        u32 w[CB / 4];
#pragma unroll
        for (int i = 0; i < CB / 4; ++i) w[i] = b[4 * i] | (b[4 * i + 1] << 8) | (b[4 * i + 2] << 16) | (b[4 * i + 3] << 24);
        if constexpr (CB == 16) *(uint4*)dst = make_uint4(w[0], w[1], w[2], w[3]);
        else if constexpr (CB == 8) *(uint2*)dst = make_uint2(w[0], w[1]);
        else *(u32*)dst = w[0];
    } else if constexpr (CB == 2) {
        *(u16*)dst = (u16)(b[0] | (b[1] << 8));
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
// Quantize and store one path of the token at slot offset `off` of page `pg`: codes (split-half
// packed), scales (bf16 or f32) and zero points of its groups of G values.
template <int D, int BITS, int G, bool SCALE_BF16>
__device__ __forceinline__ void quantize_path(const float (&x)[Lanes<D, BITS>::K][Lanes<D, BITS>::CB], int lane,
                                              u8* codes, u8* scales, u8* zeros, int off) {
    using S = Lanes<D, BITS>;
    constexpr int K = S::K, NB = S::NB, CB = S::CB;
    constexpr int NG = D / G;
    constexpr float M = (float)((1 << BITS) - 1);
    static_assert(G % CB == 0, "a lane's run lies in one group");
    // per plane: the range of this lane's run, then of its group
    float lo[K], hi[K];
#pragma unroll
    for (int p = 0; p < K; ++p) {
        lo[p] = 0.0f, hi[p] = 0.0f;  // the reference's min(., 0) / max(., 0)
#pragma unroll
        for (int u = 0; u < CB; ++u) {
            const float v = is_finite_f32(x[p][u]) ? x[p][u] : 0.0f;
            lo[p] = fminf(lo[p], v), hi[p] = fmaxf(hi[p], v);
        }
    }
    constexpr bool SPAN = G > NB;             // a group covers PG whole planes (all lanes)
    constexpr int PG = SPAN ? G / NB : 1;
    constexpr int GL = SPAN ? 32 : G / CB;    // lanes sharing a group in a plane
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
    // scale, zero point and reciprocal of each group this lane touches
    float zf[K], r[K];
#pragma unroll
    for (int p = 0; p < K; p += PG) {
        float s = __fdiv_rn(fmaxf(hi[p] - lo[p], 1e-8f), M);
        if (SCALE_BF16) {
            s = fminf(s, __uint_as_float(0x7f7f0000u));  // largest finite bfloat16
            s = bf16_bits_to_f32(f32_to_bf16_bits(s));
        } else {
            s = fminf(s, __uint_as_float(0x7f7fffffu));  // largest finite float32
        }
        zf[p] = fminf(fmaxf(rintf(__fdiv_rn(-lo[p], s)), 0.0f), M);
        // x / s as (x * 2^-64) * rn(1 / (s * 2^-64)): no division per value; the 2^-64 keeps the
        // reciprocal of a clamped huge scale a normal float
        r[p] = __frcp_rn(s * 0x1p-64f);
        const int g = SPAN ? p / PG : p * (NB / G) + lane * CB / G;  // group index in the token
        const bool leader = SPAN ? lane == 0 : (lane * CB) % G == 0 && lane < S::LANES;
        if (leader) {
            if (SCALE_BF16) ((u16*)scales)[off * NG + g] = f32_to_bf16_bits(s);
            else ((float*)scales)[off * NG + g] = s;
            zeros[off * NG + g] = (u8)zf[p];
        }
    }
    if (lane >= S::LANES) return;
    u32 bytes[CB];
#pragma unroll
    for (int u = 0; u < CB; ++u) bytes[u] = 0u;
#pragma unroll
    for (int p = 0; p < K; ++p) {
        const int pg = p - p % PG;
#pragma unroll
        for (int u = 0; u < CB; ++u) {
            const float v = is_finite_f32(x[p][u]) ? x[p][u] : 0.0f;
            int q = __float2int_rn((v * 0x1p-64f) * r[pg]) + (int)zf[pg];
            q = min(max(q, 0), (1 << BITS) - 1);
            bytes[u] |= (u32)q << (p * BITS);
        }
    }
    store_bytes<CB>(codes + off * NB + lane * CB, bytes);
}
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
    const i64 seq = seq_ids[t];
    const i64 pos = positions[t];
    if (seq < 0 || seq >= max_seqs || pos < 0) return;
    if (pos < sink) {
        u16* dst = sink_buf + (seq * sink + pos) * DT;
        store_path_bf16<DC, CBITS_>(dst, lane, xc);
        store_path_bf16<DR, RBITS_>(dst + DC, lane, xr);
    }
    if (local > 0 && pos >= seq_lens[seq] - local) {
        u16* dst = local_buf + (seq * local + pos % local) * DT;
        store_path_bf16<DC, CBITS_>(dst, lane, xc);
        store_path_bf16<DR, RBITS_>(dst + DC, lane, xr);
    }
}
