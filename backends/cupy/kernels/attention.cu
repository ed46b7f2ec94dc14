// QuantMLA CuPy backend: split-KV decode attention over packed pages (absorbed MLA).
//
// Grid: x = B * ceil(R / 16) (R = S_q * H query rows of one request, 16 rows per CTA),
//       y = number of KV splits. Block: 4 warps. Each CTA walks its split's tokens in tiles
// of 32. Warp w owns a quarter of the latent channels (the channels held by its quarter of
// the packed bytes of each token) plus one 16-wide slice of the RoPE key:
//   1. it dequantizes its slice of the tile to bfloat16 *codes minus zero point* (exact small
//      integers; bit-trick nibble conversion) in warp-private shared memory; protected tokens
//      (sink / local ring) are copied from the BF16 buffers instead, with scale 1;
//   2. QK: mma.sync m16n8k16 (heads x tokens), query fragments held in registers, per-group
//      partial dot products multiplied by the per-(token, group) scale;
//   3. the four warps' partial scores are summed through shared memory; each warp runs the
//      same online softmax (base-2, scale folded in);
//   4. PV: the probabilities, multiplied by each group's per-token scale, are the A operand
//      (so scales never touch the codes), the same shared tile read with ldmatrix.trans is B.
// Float32 queries use a split bf16 hi+lo A operand (codes and BF16 values are exact in bf16)
// so the result keeps float32-level accuracy. Partial (unnormalized) outputs and (max, sum)
// per split go to scratch; qmla_combine merges them with log-sum-exp.
#include "common.cuh"

#define DC QMLA_DC
#define DR QMLA_DR
#define DT (QMLA_DC + QMLA_DR)
#define T 32
#define NW 4
#define CBITS QMLA_CBITS
#define KCH ((CBITS == 16) ? 1 : (8 / CBITS))
#define CSTR ((CBITS == 16) ? DC : QMLA_CB)
#define CBW (QMLA_CB / NW)
#define CW ((CBITS == 16) ? (CBW / 2) : CBW)
#define NCOL (CW * KCH)
#define KSC (NCOL / 16)
#define KSR (DR / 16)
#define LD (NCOL + 24)
#define UPT (CBW / 16)
#define NTQ (T / 8)
#define NTP (NCOL / 8)
#define SPLIT QMLA_SPLIT
#ifndef QMLA_MIN_BLOCKS
#define QMLA_MIN_BLOCKS 1
#endif
#if QMLA_QUANT
#define NGC (DC / QMLA_GC)
#define NG (NGC + 1)
#else
#define NGC 0
#define NG 1
#endif

static_assert(NCOL * NW == DC, "warp channel slices must cover the latent");
static_assert(CW % 16 == 0, "chunk width must be a multiple of 16");
static_assert(KSC % 2 == 0, "content k-steps must be even");
static_assert(DR % 16 == 0 && KSR <= NW, "rope dim must be 16..64");
static_assert(!QMLA_QUANT || (QMLA_GR == DR), "one RoPE group per token");

// byte sizes of the dynamic shared memory regions
#define SMEM_KV (NW * T * LD * 2)
#define SMEM_SCL (2 * T * NG * 4)
#define SMEM_X (NW * NTQ * 32 * 16)
// per-warp staging of the next tile: content codes [T][CBW], RoPE codes [T][32], zeros [T][8]
#define STG_WARP (T * CBW + T * 32 + T * 8)
#define SMEM_TOTAL (SMEM_KV + SMEM_SCL + SMEM_X + NW * STG_WARP)
#if QMLA_QUANT
#define CSB (NGC * (QMLA_CSCALE_BF16 ? 2 : 4))
#define ZW ((NGC >= 4) ? (NGC / 4) : 1)
#endif

__device__ __forceinline__ int col_to_ch(int col, int w) {
    return (col / CW) * CSTR + w * CW + (col % CW);
}

__device__ __forceinline__ void load_q_pair(const void* q, i64 idx, bool ok, u32& hi, u32& lo) {
    if (!ok) {
        hi = 0u;
        lo = 0u;
        return;
    }
#if QMLA_IN_BF16
    hi = *(const u32*)((const u16*)q + idx);
    lo = 0u;
#else
    float2 v = *(const float2*)((const float*)q + idx);
    hi = pack_bf16x2(v.x, v.y);
    float hx = bf16_bits_to_f32(hi & 0xffffu), hy = bf16_bits_to_f32(hi >> 16);
    lo = pack_bf16x2(v.x - hx, v.y - hy);
#endif
}

// 16 code bytes -> 16 bf16 values (code - zero) per chunk, stored at smem cols
#if QMLA_QUANT
__device__ __forceinline__ u32 nib_pair(u32 v, u32 sel, u32 negz2) {
    return fma_bf16x2(__byte_perm(v, 0x43u, sel), 0x3f803f80u, negz2);
}
#endif

extern "C" __global__ void __launch_bounds__(NW * 32, QMLA_MIN_BLOCKS) qmla_attn(
    const void* __restrict__ q_lat, const void* __restrict__ q_rope, const u8* __restrict__ pages,
    const u16* __restrict__ sink_buf, const u16* __restrict__ local_buf, const int* __restrict__ block_table,
    const qmla_index_t* __restrict__ seq_lens, const qmla_index_t* __restrict__ seq_ids, float* __restrict__ o_part,
    float2* __restrict__ ml_part, int S_q, int H, int max_pages, int bt_stride, int num_pages, int max_seqs,
    int sink, int local, int tiles_per_split, int num_splits, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem[];
    u16* kv_all = (u16*)smem;
    float* scl_all = (float*)(smem + SMEM_KV);
    float4* xchg = (float4*)(smem + SMEM_KV + SMEM_SCL);

    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g8 = lane >> 2, q4 = lane & 3;
    const int R = S_q * H;
    const int MG = (R + 15) / 16;
    const int b = blockIdx.x / MG, mg = blockIdx.x % MG;
    const int split = blockIdx.y;
    const i64 L = seq_lens[b];
    const i64 sid = seq_ids[b];
    const bool sid_ok = sid >= 0 && sid < max_seqs;
    const int r0 = mg * 16 + g8, r1 = r0 + 8;
    const i64 t_begin = (i64)split * tiles_per_split * T;
    const i64 t_end = min(L, t_begin + (i64)tiles_per_split * T);

    // causal limits: query row r (position s = r / H of S_q) sees tokens < L - S_q + s + 1
    const i64 lim0 = min(L, L - S_q + (i64)(r0 / H) + 1);
    const i64 lim1 = min(L, L - S_q + (i64)(r1 / H) + 1);

    float m0 = -QMLA_INF, m1 = -QMLA_INF, l0 = 0.0f, l1 = 0.0f;
    float acc[NTP][4];
#pragma unroll
    for (int i = 0; i < NTP; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    if (t_begin < t_end) {
        // ---------------------------------------------------------- query fragments
        u32 qa[KSC + 1][4];
#if SPLIT == 2
        u32 ql[KSC + 1][4];
#endif
        {
            const bool ok0 = r0 < R, ok1 = r1 < R;
            const i64 base0 = ((i64)b * R + r0), base1 = ((i64)b * R + r1);
#pragma unroll
            for (int ks = 0; ks <= KSC; ++ks) {
                u32 lo[4];
                if (ks < KSC) {
                    const int c0 = col_to_ch(16 * ks + 2 * q4, w), c1 = col_to_ch(16 * ks + 8 + 2 * q4, w);
                    load_q_pair(q_lat, base0 * DC + c0, ok0, qa[ks][0], lo[0]);
                    load_q_pair(q_lat, base1 * DC + c0, ok1, qa[ks][1], lo[1]);
                    load_q_pair(q_lat, base0 * DC + c1, ok0, qa[ks][2], lo[2]);
                    load_q_pair(q_lat, base1 * DC + c1, ok1, qa[ks][3], lo[3]);
                } else {
                    const bool has = w < KSR;
                    const int c0 = 16 * w + 2 * q4, c1 = c0 + 8;
                    load_q_pair(q_rope, base0 * DR + c0, ok0 && has, qa[ks][0], lo[0]);
                    load_q_pair(q_rope, base1 * DR + c0, ok1 && has, qa[ks][1], lo[1]);
                    load_q_pair(q_rope, base0 * DR + c1, ok0 && has, qa[ks][2], lo[2]);
                    load_q_pair(q_rope, base1 * DR + c1, ok1 && has, qa[ks][3], lo[3]);
                }
#if SPLIT == 2
                ql[ks][0] = lo[0];
                ql[ks][1] = lo[1];
                ql[ks][2] = lo[2];
                ql[ks][3] = lo[3];
#endif
            }
        }

        u16* kv = kv_all + w * (T * LD);
        const u32 kv_s = smem_addr(kv);
        u8* stg = smem + SMEM_KV + SMEM_SCL + SMEM_X + w * STG_WARP;  // this warp's staging
        u8* stg_c = stg;                    // [T][CBW] content code bytes
        u8* stg_r = stg + T * CBW;          // [T][32] RoPE code bytes
        u8* zt = stg_r + T * 32;            // [T][8] content zero points
        // page id of the lane's token in tile t (-1: no page)
        auto page_of = [&](i64 tt) -> int {
            const i64 n = tt + lane;
            const i64 pidx = n / QMLA_P;
            if (n >= L || pidx >= max_pages) return -1;
            return block_table[(i64)b * bt_stride + pidx];
        };
        // token source of the lane's token: kind 0 packed (src = page byte offset), 1 sink row,
        // 2 local-ring row (src = element offset), 3 nothing (masked)
        auto source_of = [&](i64 tt, int page, int& kind, i64& src, int& slot) {
            const i64 n = tt + lane;
            kind = 3;
            src = 0;
            slot = (int)(n % QMLA_P);
            if (n < L) {
                if (sid_ok && n < sink) {
                    kind = 1;
                    src = (sid * sink + n) * DT;
                } else if (sid_ok && local > 0 && n >= L - local) {
                    kind = 2;
                    src = (sid * local + n % local) * DT;
                } else if (page >= 0 && page < num_pages) {
                    kind = 0;
                    src = (i64)page * QMLA_PAGE_BYTES;
                }
            }
        };
#if QMLA_QUANT
        u32 msc[CSB / 4];  // prefetched content scale row of the lane's token (raw words)
        float mrs = 0.0f;  // RoPE scale
        u32 mrz = 0u;      // RoPE zero point
        u32 mzw[ZW];       // content zero points (raw)
#endif
        // start the copies of tile tt (lane token info given) into staging and metadata registers
        auto issue = [&](int kind, i64 src, int slot) {
#pragma unroll
            for (int k = 0; k < UPT; ++k) {
                const int i = lane + 32 * k;
                const int t = i / UPT, u = i % UPT;
                const int tk = __shfl_sync(0xffffffffu, kind, t);
                const i64 ts = __shfl_sync(0xffffffffu, src, t);
                const int tslot = __shfl_sync(0xffffffffu, slot, t);
                if (tk == 0) cp_async16(stg_c + t * CBW + 16 * u, pages + ts + QMLA_OFF_CC + (i64)tslot * QMLA_CB + w * CBW + 16 * u);
            }
            if (kind == 0) {
                const u8* pg = pages + src;
                if (w < KSR) {
#if CBITS == 16
                    const u8* rc = pg + QMLA_OFF_RC + (i64)slot * QMLA_RB + 32 * w;
                    cp_async16(stg_r + lane * 32, rc);
                    cp_async16(stg_r + lane * 32 + 16, rc + 16);
#elif QMLA_RB >= 16
                    cp_async16(stg_r + lane * 32, pg + QMLA_OFF_RC + (i64)slot * QMLA_RB + (16 * w) % QMLA_RB);
#else
                    cp_async8(stg_r + lane * 32, pg + QMLA_OFF_RC + (i64)slot * QMLA_RB);
#endif
                }
#if QMLA_QUANT
                const u32* cs = (const u32*)(pg + QMLA_OFF_CS + (i64)slot * CSB);
#pragma unroll
                for (int e = 0; e < CSB / 4; ++e) msc[e] = cs[e];
#if NGC >= 4
                const u32* zp = (const u32*)(pg + QMLA_OFF_CZ + (i64)slot * NGC);
#pragma unroll
                for (int e = 0; e < ZW; ++e) mzw[e] = zp[e];
#else
                mzw[0] = *(const u16*)(pg + QMLA_OFF_CZ + (i64)slot * NGC);
#endif
#if QMLA_RSCALE_BF16
                mrs = bf16_bits_to_f32(((const u16*)(pg + QMLA_OFF_RS))[slot]);
#else
                mrs = ((const float*)(pg + QMLA_OFF_RS))[slot];
#endif
                mrz = pg[QMLA_OFF_RZ + slot];
#endif
            }
            cp_async_commit();
        };

        int kind, slot;
        i64 src;
        source_of(t_begin, page_of(t_begin), kind, src, slot);
        int page_next = page_of(t_begin + T);
        issue(kind, src, slot);

        int buf = 0;
        for (i64 t0 = t_begin; t0 < t_end; t0 += T, buf ^= 1) {
            float* scl = scl_all + buf * (T * NG);
            cp_async_wait_all();
            __syncwarp();
#if QMLA_QUANT
            // ------------------------------------------------------ metadata -> smem (lane = token)
            {
                u32* zrow = (u32*)(zt + lane * 8);
#pragma unroll
                for (int e = 0; e < ZW; ++e) zrow[e] = mzw[e];
                for (int g = w; g < NG; g += NW) {
                    float s = 0.0f;
                    if (kind == 1 || kind == 2) {
                        s = 1.0f;
                    } else if (kind == 0) {
                        if (g < NGC) {
#if QMLA_CSCALE_BF16
                            u32 word = 0u;
#pragma unroll
                            for (int e = 0; e < CSB / 4; ++e) word = (e == (g >> 1)) ? msc[e] : word;
                            s = bf16_bits_to_f32((word >> (16 * (g & 1))) & 0xffffu);
#else
                            u32 word = 0u;
#pragma unroll
                            for (int e = 0; e < CSB / 4; ++e) word = (e == g) ? msc[e] : word;
                            s = __uint_as_float(word);
#endif
                        } else {
                            s = mrs;
                        }
                    }
                    scl[lane * NG + g] = s;
                }
            }
            __syncwarp();
#endif
            // ------------------------------------------------------ content slice -> smem
#pragma unroll
            for (int k = 0; k < UPT; ++k) {
                const int i = lane + 32 * k;
                const int t = i / UPT, u = i % UPT;
                const int tk = __shfl_sync(0xffffffffu, kind, t);
                const i64 ts = __shfl_sync(0xffffffffu, src, t);
                const int bs = w * CBW + 16 * u;  // first byte of this unit in the token's code row
                u16* row = kv + t * LD;
                if (tk == 0) {
                    const uint4 v = *(const uint4*)(stg_c + t * CBW + 16 * u);
#if CBITS == 16
                    *(uint4*)(row + 8 * u) = v;
#else
                    const u8* zr = zt + t * 8;
                    const u32 wd[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int c = 0; c < KCH; ++c) {
                        const u32 z = zr[(c * CSTR + bs) / QMLA_GC];
                        u32 o[8];
#if CBITS == 8
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const float zf = (float)z;
                            o[2 * e] = pack_bf16x2((float)(wd[e] & 0xffu) - zf, (float)((wd[e] >> 8) & 0xffu) - zf);
                            o[2 * e + 1] =
                                pack_bf16x2((float)((wd[e] >> 16) & 0xffu) - zf, (float)(wd[e] >> 24) - zf);
                        }
#else
                        const u32 neg = 0xc300u | z;
                        const u32 negz2 = neg | (neg << 16);
                        const u32 mask = (CBITS == 4) ? 0x0f0f0f0fu : 0x03030303u;
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const u32 cv = (wd[e] >> (c * CBITS)) & mask;
                            o[2 * e] = nib_pair(cv, 0x4140u, negz2);
                            o[2 * e + 1] = nib_pair(cv, 0x4342u, negz2);
                        }
#endif
                        uint4* dst = (uint4*)(row + c * CW + 16 * u);
                        dst[0] = make_uint4(o[0], o[1], o[2], o[3]);
                        dst[1] = make_uint4(o[4], o[5], o[6], o[7]);
                    }
#endif
                } else if (tk == 1 || tk == 2) {
                    const u16* bufp = (tk == 1 ? sink_buf : local_buf) + ts;
#if CBITS == 16
                    *(uint4*)(row + 8 * u) = *(const uint4*)(bufp + bs / 2);
#else
#pragma unroll
                    for (int c = 0; c < KCH; ++c) {
                        const uint4* s4 = (const uint4*)(bufp + c * CSTR + bs);
                        uint4* dst = (uint4*)(row + c * CW + 16 * u);
                        dst[0] = s4[0];
                        dst[1] = s4[1];
                    }
#endif
                } else {
                    const uint4 zero4 = make_uint4(0u, 0u, 0u, 0u);
#if CBITS == 16
                    *(uint4*)(row + 8 * u) = zero4;
#else
#pragma unroll
                    for (int c = 0; c < KCH; ++c) {
                        uint4* dst = (uint4*)(row + c * CW + 16 * u);
                        dst[0] = zero4;
                        dst[1] = zero4;
                    }
#endif
                }
            }
            // ------------------------------------------------------ RoPE slice -> smem (lane = token)
            if (w < KSR) {
                u16* row = kv + lane * LD + NCOL;
                uint4 o0, o1;
                if (kind == 0) {
                    const u8* rs = stg_r + lane * 32;
#if CBITS == 16
                    o0 = ((const uint4*)rs)[0];
                    o1 = ((const uint4*)rs)[1];
#else
                    const float zf = (float)mrz;
                    u32 o[8];
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        float v2[2];
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int ch = 16 * w + 2 * e + h;
                            const u32 byte = rs[(QMLA_RB >= 16) ? (2 * e + h) : (ch % QMLA_RB)];
                            const u32 code = (byte >> ((ch / QMLA_RB) * QMLA_RBITS)) & ((1u << QMLA_RBITS) - 1u);
                            v2[h] = (float)code - zf;
                        }
                        o[e] = pack_bf16x2(v2[0], v2[1]);
                    }
                    o0 = make_uint4(o[0], o[1], o[2], o[3]);
                    o1 = make_uint4(o[4], o[5], o[6], o[7]);
#endif
                } else if (kind == 1 || kind == 2) {
                    const uint4* s4 = (const uint4*)((kind == 1 ? sink_buf : local_buf) + src + DC + 16 * w);
                    o0 = s4[0];
                    o1 = s4[1];
                } else {
                    o0 = o1 = make_uint4(0u, 0u, 0u, 0u);
                }
                ((uint4*)row)[0] = o0;
                ((uint4*)row)[1] = o1;
            }
            __syncwarp();  // staging consumed: the next tile's copies may start
            if (t0 + T < t_end) {
                source_of(t0 + T, page_next, kind, src, slot);
                page_next = page_of(t0 + 2 * T);
                issue(kind, src, slot);
            }
            __syncthreads();  // S1: tile and scale table visible

            // ------------------------------------------------------ QK (partial over this warp's channels)
            float S[NTQ][4];
#pragma unroll
            for (int j = 0; j < NTQ; ++j) {
                S[j][0] = S[j][1] = S[j][2] = S[j][3] = 0.0f;
#if QMLA_QUANT
                float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                const int tka = 8 * j + 2 * q4;
#define QMLA_FLUSH(gidx)                                        \
    {                                                           \
        const float sa = scl[tka * NG + (gidx)];                \
        const float sb = scl[(tka + 1) * NG + (gidx)];          \
        S[j][0] += tmp[0] * sa;                                 \
        S[j][1] += tmp[1] * sb;                                 \
        S[j][2] += tmp[2] * sa;                                 \
        S[j][3] += tmp[3] * sb;                                 \
        tmp[0] = tmp[1] = tmp[2] = tmp[3] = 0.0f;               \
    }
                float* accq = tmp;
#else
                float* accq = S[j];
#endif
                const u32 rowaddr = kv_s + (u32)(((8 * j + (lane & 7)) * LD) * 2);
#pragma unroll
                for (int ks = 0; ks < KSC; ks += 2) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4(rowaddr + (u32)((16 * ks + 8 * (lane >> 3)) * 2), b0, b1, b2, b3);
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int kk = ks + h;
                        mma_bf16(accq, qa[kk], h ? b2 : b0, h ? b3 : b1);
#if SPLIT == 2
                        mma_bf16(accq, ql[kk], h ? b2 : b0, h ? b3 : b1);
#endif
#if QMLA_QUANT
                        const int off = (16 * kk) % CW;
                        const int ch = (16 * kk / CW) * CSTR + w * CW + off;
                        if (off + 16 == CW || (ch + 16) % QMLA_GC == 0) QMLA_FLUSH(ch / QMLA_GC)
#endif
                    }
                }
                if (w < KSR) {
                    u32 b0, b1;
                    ldsm_x2(rowaddr + (u32)((NCOL + 8 * ((lane >> 3) & 1)) * 2), b0, b1);
                    mma_bf16(accq, qa[KSC], b0, b1);
#if SPLIT == 2
                    mma_bf16(accq, ql[KSC], b0, b1);
#endif
#if QMLA_QUANT
                    QMLA_FLUSH(NGC)
#endif
                }
                xchg[(w * NTQ + j) * 32 + lane] = make_float4(S[j][0], S[j][1], S[j][2], S[j][3]);
            }
            __syncthreads();  // S2: partial scores of all warps visible
            qmla_sum_partials<NTQ, NW>(xchg, lane, (i64)t0, q4, lim0, lim1, scale_log2, S);
            qmla_online_softmax<NTQ, NTP>(S, m0, m1, l0, l1, acc);  // (same in every warp)
            // ------------------------------------------------------ PV over this warp's channels
#pragma unroll
            for (int kt = 0; kt < T / 16; ++kt) {
                const float* pa = S[2 * kt];
                const float* pb = S[2 * kt + 1];
                u32 ah[4];
#if SPLIT == 2
                u32 al[4];
#endif
#if QMLA_QUANT
                const int ta = 16 * kt + 2 * q4;
                int gprev = -1;
#endif
                const u32 rowaddr =
                    kv_s + (u32)(((16 * kt + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 8 * (lane >> 4)) * 2);
#pragma unroll
                for (int ks = 0; ks < KSC; ++ks) {
                    float x[8];
#if QMLA_QUANT
                    const int ch = (16 * ks / CW) * CSTR + w * CW + (16 * ks) % CW;
                    const int g = ch / QMLA_GC;
                    const bool rebuild = g != gprev;
                    gprev = g;
                    if (rebuild) {
                        const float s0 = scl[ta * NG + g], s1 = scl[(ta + 1) * NG + g];
                        const float s2 = scl[(ta + 8) * NG + g], s3 = scl[(ta + 9) * NG + g];
                        x[0] = pa[0] * s0; x[1] = pa[1] * s1; x[2] = pa[2] * s0; x[3] = pa[3] * s1;
                        x[4] = pb[0] * s2; x[5] = pb[1] * s3; x[6] = pb[2] * s2; x[7] = pb[3] * s3;
#else
                    const bool rebuild = ks == 0;
                    if (rebuild) {
                        x[0] = pa[0]; x[1] = pa[1]; x[2] = pa[2]; x[3] = pa[3];
                        x[4] = pb[0]; x[5] = pb[1]; x[6] = pb[2]; x[7] = pb[3];
#endif
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            ah[e] = pack_bf16x2(x[2 * e], x[2 * e + 1]);
#if SPLIT == 2
                            al[e] = pack_bf16x2(x[2 * e] - bf16_bits_to_f32(ah[e] & 0xffffu),
                                                x[2 * e + 1] - bf16_bits_to_f32(ah[e] >> 16));
#endif
                        }
                    }
                    u32 b0, b1, b2, b3;
                    ldsm_x4_t(rowaddr + (u32)(16 * ks * 2), b0, b1, b2, b3);
                    mma_bf16(acc[2 * ks], ah, b0, b1);
                    mma_bf16(acc[2 * ks + 1], ah, b2, b3);
#if SPLIT == 2
                    mma_bf16(acc[2 * ks], al, b0, b1);
                    mma_bf16(acc[2 * ks + 1], al, b2, b3);
#endif
                }
            }
            __syncwarp();
        }
    }

    // ---------------------------------------------------------------- partial results
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, o);
        l1 += __shfl_xor_sync(0xffffffffu, l1, o);
    }
    const i64 row0 = (i64)b * R + r0, row1 = (i64)b * R + r1;
    if (r0 < R) {
        float* dst = o_part + (row0 * num_splits + split) * DC;
#pragma unroll
        for (int i = 0; i < NTP; ++i) *(float2*)(dst + col_to_ch(8 * i + 2 * q4, w)) = make_float2(acc[i][0], acc[i][1]);
        if (w == 0 && q4 == 0) ml_part[row0 * num_splits + split] = make_float2(m0, l0);
    }
    if (r1 < R) {
        float* dst = o_part + (row1 * num_splits + split) * DC;
#pragma unroll
        for (int i = 0; i < NTP; ++i) *(float2*)(dst + col_to_ch(8 * i + 2 * q4, w)) = make_float2(acc[i][2], acc[i][3]);
        if (w == 0 && q4 == 0) ml_part[row1 * num_splits + split] = make_float2(m1, l1);
    }
}

// Merge the splits of each query row (common.cuh's qmla_merge_stats and qmla_combine_add). One block of
// QMLA_COMBINE_THREADS per row; a thread owns 4 adjacent channels (one 16-byte load per split). Its first
// QMLA_COMBINE_AHEAD partials are loaded before the splits' (m, l), so a row of up to that many splits takes one round
// trip to memory, not two; each further batch of as many is loaded while the one before it is summed.

// Partials per row read through shared memory (larger counts read them from global memory):
// one round trip for every split's (m, l) instead of one per loop trip.
#define QMLA_COMBINE_SMEM_SPLITS 512
#define QMLA_COMBINE_THREADS 128  // the launcher's block
#define QMLA_COMBINE_AHEAD 8

extern "C" __global__ void __launch_bounds__(QMLA_COMBINE_THREADS) qmla_combine(const float* __restrict__ o_part,
                                                                               const float2* __restrict__ ml_part,
                                                                               void* __restrict__ out,
                                                                               float* __restrict__ lse, int num_splits) {
    static_assert(DC % 4 == 0 && DC / 4 <= QMLA_COMBINE_THREADS, "4 channels per thread, one pass");
    __shared__ float2 ml_s[QMLA_COMBINE_SMEM_SPLITS];
    qmla_wait_prior_grid();  // launched with PDL: the split kernel's partials are complete from here
    const i64 row = blockIdx.x;
    const int c4 = threadIdx.x;
    const bool mine = c4 < DC / 4;
    const float4* op = (const float4*)(o_part + row * num_splits * DC) + c4;
    float4 o[QMLA_COMBINE_AHEAD];
#pragma unroll
    for (int k = 0; k < QMLA_COMBINE_AHEAD; ++k) {
        if (mine && k < num_splits) o[k] = op[k * (DC / 4)];
    }
    const float2* ml = ml_part + row * num_splits;
    if (num_splits <= QMLA_COMBINE_SMEM_SPLITS) {
        for (int i = threadIdx.x; i < num_splits; i += blockDim.x) ml_s[i] = ml[i];
        __syncthreads();
        ml = ml_s;
    }
    const float2 st = qmla_merge_stats(ml, num_splits);
    const float M = st.x;
    if (threadIdx.x == 0) lse[row] = qmla_merged_lse(st);
    if (!mine) return;
    float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // batches of QMLA_COMBINE_AHEAD splits: the next batch's loads go out before this one's sums, so a long row keeps
    // a batch in flight while it adds (the sums still run over i in order)
    for (int base = 0; base < num_splits; base += QMLA_COMBINE_AHEAD) {
        float4 next[QMLA_COMBINE_AHEAD];
#pragma unroll
        for (int k = 0; k < QMLA_COMBINE_AHEAD; ++k) {
            if (base + QMLA_COMBINE_AHEAD + k < num_splits) next[k] = op[(base + QMLA_COMBINE_AHEAD + k) * (DC / 4)];
        }
#pragma unroll
        for (int k = 0; k < QMLA_COMBINE_AHEAD; ++k) {
            if (base + k < num_splits) qmla_combine_add(a, ml[base + k], M, o[k]);
        }
#pragma unroll
        for (int k = 0; k < QMLA_COMBINE_AHEAD; ++k) o[k] = next[k];
    }
#if QMLA_IN_BF16
    ((uint2*)out)[row * (DC / 4) + c4] = qmla_merged_bf16x4(a, st.y);
#else
    ((float4*)out)[row * (DC / 4) + c4] = qmla_merged_f32x4(a, st.y);
#endif
}
