// QuantMLA CuPy backend: fused quantize + split-half pack + page write + sink/ring update.
//
// One warp per token, QMLA_WRITER_WARPS warps per block, one launch per call.
// Inputs: latent [N, DC], k_rope [N, DR] (float32, or bfloat16 with QMLA_IN_BF16=1), index
// arrays as int64. Tokens whose slot is outside [0, num_slots) are skipped entirely; the
// protection copy is skipped when the seq id or position is out of range, so a bad index
// never writes outside the cache. Quantizer math is float32. Scales and zero points use IEEE
// division and match the reference exactly; codes multiply by a per-group reciprocal, so they may
// differ by 1 where x/s lies within float32 rounding of a .5 boundary (DESIGN.md 3.1).
#include "common.cuh"

#define DC QMLA_DC
#define DR QMLA_DR
#define DT (QMLA_DC + QMLA_DR)
#define NWARP QMLA_WRITER_WARPS

#if QMLA_QUANT
#define NGC (QMLA_DC / QMLA_GC)
#define NGR (QMLA_DR / QMLA_GR)
#define NG (NGC + NGR)
#else
#define NG 1
#endif

__device__ __forceinline__ float load_in(const void* p, i64 i) {
#if QMLA_IN_BF16
    return bf16_bits_to_f32(((const u16*)p)[i]);
#else
    return ((const float*)p)[i];
#endif
}

#if QMLA_QUANT
// Pack the codes of one path: element e of x[0..D) -> byte e % (D/K), bits (e / (D/K)) * BITS.
template <int D, int BITS, int G>
__device__ __forceinline__ void pack_path(const float* xs, const float* rg, const float* zg, u8* dst, int lane) {
    constexpr int K = 8 / BITS;
    constexpr int NB = D / K;        // bytes per token
    constexpr int NW4 = NB / 4;      // 32-bit words per token
    constexpr float M = (float)((1 << BITS) - 1);
    for (int w = lane; w < NW4; w += 32) {
        u32 word = 0;
#pragma unroll
        for (int by = 0; by < 4; ++by) {
            const int j = 4 * w + by;
            u32 byte = 0;
#pragma unroll
            for (int i = 0; i < K; ++i) {
                const int e = j + i * NB;
                float x = xs[e];
                x = is_finite_f32(x) ? x : 0.0f;
                const int g = e / G;
                float q = rintf((x * 0x1p-64f) * rg[g]) + zg[g];  // x / s, see rg in qmla_write
                q = fminf(fmaxf(q, 0.0f), M);
                byte |= ((u32)q) << (i * BITS);
            }
            word |= byte << (8 * by);
        }
        ((u32*)dst)[w] = word;
    }
}
#endif

extern "C" __global__ void __launch_bounds__(NWARP * 32) qmla_write(
    const void* __restrict__ latent, const void* __restrict__ k_rope, const i64* __restrict__ slots,
    const i64* __restrict__ seq_ids, const i64* __restrict__ positions, const i64* __restrict__ seq_lens,
    u8* __restrict__ pages, u16* __restrict__ sink_buf, u16* __restrict__ local_buf, int n_tokens,
    i64 num_slots, int max_seqs, int sink, int local) {
    __shared__ float xs_all[NWARP][DT];
    __shared__ float s_all[NWARP][NG];
    __shared__ float z_all[NWARP][NG];
    __shared__ float r_all[NWARP][NG];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 t = (i64)blockIdx.x * NWARP + warp;
    if (t >= n_tokens) return;
    const i64 slot = slots[t];
    if (slot < 0 || slot >= num_slots) return;  // -1 skips; out of range is masked
    float* xs = xs_all[warp];
    for (int e = lane; e < DC; e += 32) xs[e] = load_in(latent, t * DC + e);
    for (int e = lane; e < DR; e += 32) xs[DC + e] = load_in(k_rope, t * DR + e);
    __syncwarp();

    const i64 page = slot / QMLA_P;
    const int off = (int)(slot % QMLA_P);
    u8* pg = pages + page * (i64)QMLA_PAGE_BYTES;

#if QMLA_QUANT
    float* sg = s_all[warp];
    float* zg = z_all[warp];
    float* rg = r_all[warp];
    // per-group range, scale and zero point (content groups, then RoPE groups)
    for (int g = 0; g < NG; ++g) {
        const bool content = g < NGC;
        const int G = content ? QMLA_GC : QMLA_GR;
        const int base = content ? g * QMLA_GC : DC + (g - NGC) * QMLA_GR;
        float lo = 0.0f, hi = 0.0f;
        for (int e = lane; e < G; e += 32) {
            float x = xs[base + e];
            x = is_finite_f32(x) ? x : 0.0f;
            lo = fminf(lo, x);
            hi = fmaxf(hi, x);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
            hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
        }
        const int bits = content ? QMLA_CBITS : QMLA_RBITS;
        const float m = (float)((1 << bits) - 1);
        float s = __fdiv_rn(fmaxf(hi - lo, 1e-8f), m);
        const bool bf16_scale = content ? QMLA_CSCALE_BF16 : QMLA_RSCALE_BF16;
        if (bf16_scale) {
            s = fminf(s, __uint_as_float(0x7f7f0000u));  // largest finite bfloat16
            s = bf16_bits_to_f32(f32_to_bf16_bits(s));
        } else {
            s = fminf(s, __uint_as_float(0x7f7fffffu));  // largest finite float32
        }
        const float z = fminf(fmaxf(rintf(__fdiv_rn(-lo, s)), 0.0f), m);
        if (lane == 0) {
            sg[g] = s;
            zg[g] = z;
            // 2^64 / s: codes take (x * 2^-64) * rg, one division per group instead of one per
            // element; the 2^64 keeps the reciprocal of a clamped huge scale a normal float
            rg[g] = __fdiv_rn(0x1p64f, s);
        }
    }
    __syncwarp();
    pack_path<DC, QMLA_CBITS, QMLA_GC>(xs, rg, zg, pg + QMLA_OFF_CC + (i64)off * QMLA_CB, lane);
    pack_path<DR, QMLA_RBITS, QMLA_GR>(xs + DC, rg + NGC, zg + NGC, pg + QMLA_OFF_RC + (i64)off * QMLA_RB, lane);
    if (lane < NGC) {
        u8* cs = pg + QMLA_OFF_CS;
#if QMLA_CSCALE_BF16
        ((u16*)cs)[off * NGC + lane] = f32_to_bf16_bits(sg[lane]);
#else
        ((float*)cs)[off * NGC + lane] = sg[lane];
#endif
        pg[QMLA_OFF_CZ + off * NGC + lane] = (u8)zg[lane];
    }
    if (lane < NGR) {
        u8* rs = pg + QMLA_OFF_RS;
#if QMLA_RSCALE_BF16
        ((u16*)rs)[off * NGR + lane] = f32_to_bf16_bits(sg[NGC + lane]);
#else
        ((float*)rs)[off * NGR + lane] = sg[NGC + lane];
#endif
        pg[QMLA_OFF_RZ + off * NGR + lane] = (u8)zg[NGC + lane];
    }
#else
    {
        u16* cc = (u16*)(pg + QMLA_OFF_CC) + (i64)off * DC;
        u16* rc = (u16*)(pg + QMLA_OFF_RC) + (i64)off * DR;
        for (int e = lane; e < DC; e += 32) cc[e] = f32_to_bf16_bits(xs[e]);
        for (int e = lane; e < DR; e += 32) rc[e] = f32_to_bf16_bits(xs[DC + e]);
    }
#endif

    // protection buffers: sink rows and the local ring (DESIGN.md 3.5)
    const i64 seq = seq_ids[t];
    const i64 pos = positions[t];
    if (seq < 0 || seq >= max_seqs || pos < 0) return;
    if (pos < sink) {
        u16* dst = sink_buf + (seq * sink + pos) * DT;
        for (int e = lane; e < DT; e += 32) dst[e] = f32_to_bf16_bits(xs[e]);
    }
    if (local > 0 && pos >= seq_lens[seq] - local) {
        u16* dst = local_buf + (seq * local + pos % local) * DT;
        for (int e = lane; e < DT; e += 32) dst[e] = f32_to_bf16_bits(xs[e]);
    }
}
