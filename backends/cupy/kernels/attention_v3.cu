// QuantMLA CuPy backend: decode attention v3 (tokens as the MMA M dimension of QK).
//
// Serves what v2 serves (bf16 queries; 2/4-bit content and 4-bit RoPE codes; d_c/d_r 512/64 and
// 256/32; content groups a multiple of 64 channels), packed tokens only: the sink and local
// tokens of a cache with protection come from v2's protected-only launch (QMLA_V2_PROT_MODE 2,
// one tile per CTA) as more partials, merged by v1's qmla_combine with this kernel's (v1-layout)
// partials.
//
// ================================================================ design note
// Grid: x = B * ceil(R / 16) (R = S_q * H query rows of one request), y = KV splits. Block: 4
// warps (QMLA_V3_NW = 8: two warps per 16 tokens, below). Tiles of T = 64 tokens; the raw page
// sections of a tile are staged by cp.async into an NSTAGE-deep ring as in v2 (stage.cuh).
//
// Why: v2 splits QK by channels (heads = M, tokens = N), so every warp sums four partial score
// tiles and runs the same softmax; its tile loop issues ~177 warp-instructions per token. Here:
//  * QK: warp w owns tokens 16w..16w+15 of the tile as the M dimension (mma.sync m16n8k16) over
//    ALL 576 channels; the 16 query rows are N (two n-tiles), read per k-step from shared memory
//    with one ldmatrix.x4 (the query is staged once per CTA in the permuted K order below).
//    Lane (g, q) reads one 16-byte chunk of its tokens g and g+8 per 64-byte block of the code
//    row; word e of the chunk gives k-step (block, slice c, e): bytes 0/2 of slice c are columns
//    2q/2q+1, bytes 1/3 are columns 2q+8/2q+9. A register is prmt((x >> CBITS c) & mask, 0x43)
//    = bf16x2 (128 + code): a shift and a lop3 per four codes, a prmt per two; no zero points.
//    Each 64-channel sub-group (one scale group, 4 k-steps) accumulates on its own and is
//    flushed as  S += s * acc - s * (128 + z) * sumQ  (sumQ: the sub-group's query sum per row,
//    computed once per CTA), so scale and zero point cost two FFMA per score per sub-group.
//  * Softmax: per row, each warp's maximum over its 16 tokens meets the others' in shared memory
//    (barrier 1); every warp derives the same new maximum, so P needs no exchange of scores.
//  * P * s: the owner warp of a token writes bf16(p * s_group) for every content group with one
//    stmatrix.x4.trans per group (sm_90; movmatrix + 32-bit stores before that) as [group]
//    [8-token block][row][8 tokens] (barrier 2, which also publishes the next staged tile).
//  * PV: heads = M, tokens = K (4 k-steps), channels = N; warp w owns the code bytes
//    [CB/4 * w, CB/4 * (w + 1)) of every token (all nibble slices: 128 channels at d_c 512).
//    A = P * s of the slice's group by ldmatrix.x4; B = bf16x2 (128 + code) of two tokens from
//    one prmt of their code words plus a shift and a lop3 per register. The offset and the zero
//    point come out through one more MMA per (k-step, slice) with B = (128 + z) of the k-step's
//    tokens, whose product is subtracted from the slice's channels at the end of every tile (it
//    uses the same bf16 A operand; per tile, because the tensor cores' fp32 accumulation rounds
//    toward zero and the offset makes the accumulated values ~100x the result for 2-bit codes).
//  * 8 warps (opt-in): warps w and w + 4 take the same 16 tokens and half of the QK sub-groups
//    each; their partial scores meet in shared memory (one more barrier) and both hold the sum.
//    P * s groups and PV channels split 8 ways, <= 128 registers, 16 warps per SM.
// tests/test_cupy_v3_fragments.py is a NumPy model of these mappings (4 and 8 warps) that
// reproduces a float64 matmul of the dequantized tile.
//
// Measured (H200, benchmarks/RESULTS.md "Stop 12"): 1,786 SASS instructions per warp per tile
// (112 per token; v2: 177), 246-255 registers, 96.5 KB of shared memory, 2 CTAs/SM. C4R4 H16
// B32 L32K 304 us against v2's 373 (FlashInfer BF16 ~300), B128 0.76-0.82x FlashInfer; ncu:
// 0.47 IPC per scheduler, latency-bound. The 8-warp build is slower from 32K tokens on.
#include "common.cuh"

#ifndef QMLA_V3_STAGES
#define QMLA_V3_STAGES 3
#endif
#ifndef QMLA_V3_MINB
#define QMLA_V3_MINB 1
#endif
#ifndef QMLA_V3_NW
#define QMLA_V3_NW 4  // warps per CTA: 4, or 8 (two warps per 16 tokens split the QK channels)
#endif
#ifndef QMLA_V3_LAZY_RESCALE
#define QMLA_V3_LAZY_RESCALE 0  // 1: skip the output rescale while no row's maximum moves (bit-identical)
#endif

#define DC QMLA_DC
#define DR QMLA_DR
#define DT (QMLA_DC + QMLA_DR)
#define T 64
#define NW QMLA_V3_NW
#define NH (NW / 4)           // warps per 16-token group (QK channel halves)
#define NTH (NW * 32)
#define CBITS QMLA_CBITS
#define KCH (8 / CBITS)
#define CB QMLA_CB
#define RB QMLA_RB
#define NCT (CB / 16)
#define NBLK (CB / 64)        // 64-byte blocks of a content code row (QK: one 16-byte chunk per lane)
#define NSG (NBLK * KCH)      // 64-channel content sub-groups (4 QK k-steps each)
#define KSC (4 * NSG)         // content k-steps
#define RLB (RB / 4)          // RoPE code bytes per QK lane
#define NWR (RLB / 4)         // ... in 32-bit words
#define KSR (2 * NWR)         // RoPE k-steps
#define KS (KSC + KSR)
#define CBW (CB / NW)         // PV: code bytes of one warp's channel slice
#define LBP (CBW / 8)         // ... per lane and token
#define NTP (KCH * LBP)       // PV n-tiles per warp
#define NGC (DC / QMLA_GC)
#define CMASK4 ((CBITS == 4) ? 0x0f0f0f0fu : 0x03030303u)
#define NSTAGE QMLA_V3_STAGES
#define CSZ (QMLA_CSCALE_BF16 ? 2 : 4)
#define RSZ (QMLA_RSCALE_BF16 ? 2 : 4)

#if !QMLA_QUANT || !(CBITS == 2 || CBITS == 4) || QMLA_RBITS != 4 || !QMLA_IN_BF16
#error "attention_v3.cu serves bf16 queries with 2/4-bit content and 4-bit RoPE codes"
#endif
static_assert(CB == DC * CBITS / 8 && RB == DR / 2, "code bytes per token");
static_assert(CB % 64 == 0 && (RB == 16 || RB == 32), "d_c 256/512 and d_r 32/64");
static_assert(QMLA_GC % 64 == 0, "a QK sub-group (64 channels) must lie inside one scale group");
static_assert(QMLA_GC % CBW == 0, "a warp's PV channel slice must lie inside one scale group");
static_assert(QMLA_GR == DR, "one RoPE group per token");
static_assert(NW == 4 || NW == 8, "4 or 8 warps");
static_assert(NSG % NH == 0 && NGC % NH == 0, "the QK sub-groups and P * s groups split between a warp pair");
static_assert(LBP == 2 || LBP == 4 || LBP == 8, "PV lane load of 2, 4 or 8 bytes");
static_assert(NTP * 8 * NW == DC, "PV n-tiles must cover the latent");
static_assert(NSTAGE == 3 || NSTAGE == 4, "3 or 4 stages");
static_assert(NGC % 4 == 0 || NGC == 2, "zero points are read 4 per word (or one pair)");
static_assert(16 * DT / 8 * 4 <= NGC * (T / 8) * 256, "query-sum partials must fit in the P * s area");

// ---------------------------------------------------------------- shared memory layout
#include "stage.cuh"  // the stage layout (SO_*, STAGE_BYTES) and its copies
#define QS_OFF (NSTAGE * STAGE_BYTES)           // query, bf16 [KS][2 k-halves][16 rows][8]
#define SQ_OFF (QS_OFF + KS * 2 * 16 * 16)      // query sums, float [NSG + 2 RoPE slices][16 rows]
#define PS_OFF (SQ_OFF + (NSG + 2) * 16 * 4)    // P * s, bf16 [NGC][T / 8][16 rows][8 tokens]
#define RED_OFF (PS_OFF + NGC * (T / 8) * 16 * 16)  // per-token-group row maxima / sums, float [4][16]
#define XS_OFF (RED_OFF + 4 * 16 * 4)           // NW = 8: both warps' partial scores, float [4][2][32][8]
#define SMEM_TOTAL (XS_OFF + (NH - 1) * 4 * 2 * 32 * 32)
#ifdef QMLA_V3_SMEM
static_assert(SMEM_TOTAL == QMLA_V3_SMEM, "launcher's v3_smem_bytes() disagrees with the kernel's layout");
#endif
static_assert(SMEM_TOTAL <= 227 * 1024, "shared memory per block");

static_assert(16 * OT_STRIDE * 4 <= NSTAGE * STAGE_BYTES, "the partial-output tile reuses the stages");

// Codes of slice c (bits [CBITS c, CBITS c + CBITS) of every byte) of x, one per byte
__device__ __forceinline__ u32 v3_slice(u32 x, int c) { return (x >> (CBITS * c)) & CMASK4; }
// bf16x2 (128 + code) of bytes 0 and 2 (ODD = 0) or 1 and 3 (ODD = 1) of a v3_slice() word
template <int ODD>
__device__ __forceinline__ u32 v3_code2(u32 cv) {
    return __byte_perm(cv, 0x43u, ODD ? 0x4341u : 0x4240u);
}

// staged content scale number i ([T][NGC]) and RoPE scale of token t, as floats
__device__ __forceinline__ float v3_cscale(const u8* st, int i) {
#if QMLA_CSCALE_BF16
    return bf16_bits_to_f32(((const u16*)(st + SO_CS))[i]);
#else
    return ((const float*)(st + SO_CS))[i];
#endif
}
__device__ __forceinline__ float v3_rscale(const u8* st, int t) {
#if QMLA_RSCALE_BF16
    return bf16_bits_to_f32(((const u16*)(st + SO_RS))[t]);
#else
    return ((const float*)(st + SO_RS))[t];
#endif
}

// S += s * acc - s * (128 + z) * sumQ for one 16-token x 8-row C fragment (tokens t0: s0/c0, t1: s1/c1)
__device__ __forceinline__ void v3_flush(float* S, const float* acc, float s0, float s1, float c0, float c1, float2 sq) {
    S[0] = fmaf(-c0, sq.x, fmaf(s0, acc[0], S[0]));
    S[1] = fmaf(-c0, sq.y, fmaf(s0, acc[1], S[1]));
    S[2] = fmaf(-c1, sq.x, fmaf(s1, acc[2], S[2]));
    S[3] = fmaf(-c1, sq.y, fmaf(s1, acc[3], S[3]));
}

// the NGC content scales of token t as floats (one or two 16-byte loads)
__device__ __forceinline__ void v3_token_scales(const u8* st, int t, float (&sc)[NGC]) {
#if QMLA_CSCALE_BF16
    static_assert(NGC % 2 == 0, "bf16 scales are read in pairs");
    const u32* p = (const u32*)(st + SO_CS + t * NGC * 2);
#pragma unroll
    for (int k = 0; k < NGC / 2; ++k) {
        const u32 w = p[k];
        sc[2 * k] = __uint_as_float(w << 16);
        sc[2 * k + 1] = __uint_as_float(w & 0xffff0000u);
    }
#else
    const float* p = (const float*)(st + SO_CS + t * NGC * 4);
#pragma unroll
    for (int k = 0; k < NGC; ++k) sc[k] = p[k];
#endif
}

// 128 + z as a float for byte k of a word of zero points: bf16 bits 0x43zz in the high half
__device__ __forceinline__ float v3_off_zb(u32 zw, int k) {
    return __uint_as_float(__byte_perm(zw, 0x43u, 0x4055u | (k << 8)));
}

// 128 + z as a float (z < 128)
__device__ __forceinline__ float v3_off_z(u32 z) { return __uint_as_float(0x43000000u | (z << 16)); }

// four bf16x2 fragments (C-fragment order of a 16-token x 16-row tile) stored transposed:
// row addresses from lanes 8i..8i+7 for matrix i
__device__ __forceinline__ void v3_store_ps(u32 row_addr, u32 r0, u32 r1, u32 r2, u32 r3, int lane) {
#if __CUDA_ARCH__ >= 900
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};" ::"r"(row_addr), "r"(r0),
                 "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
#else
    const u32 rs[4] = {r0, r1, r2, r3};
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        u32 t;
        asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(t) : "r"(rs[m]));
        // after the transpose lane (g, q) holds row g, columns 2q, 2q+1 of matrix m; matrix m's
        // row g address sits in lane 8m + g
        const u32 a = __shfl_sync(0xffffffffu, row_addr, 8 * m + (lane >> 2));
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(a + 4 * (lane & 3)), "r"(t) : "memory");
    }
#endif
}

extern "C" __global__ void __launch_bounds__(NTH, QMLA_V3_MINB) qmla_attn_v3(
    const u16* __restrict__ q_lat, const u16* __restrict__ q_rope, const u8* __restrict__ pages,
    const u16* __restrict__ sink_buf, const u16* __restrict__ local_buf, const int* __restrict__ block_table,
    const qmla_index_t* __restrict__ seq_lens, const qmla_index_t* __restrict__ seq_ids, float* __restrict__ o_part,
    float2* __restrict__ ml_part, int S_q, int H, int max_pages, int bt_stride, int num_pages, int max_seqs,
    int sink, int local, int tiles_per_split, int num_splits, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem[];
    (void)sink_buf;
    (void)local_buf;
    u16* qs = (u16*)(smem + QS_OFF);
    float* sq = (float*)(smem + SQ_OFF);
    float* red = (float*)(smem + RED_OFF);

    const int tid = threadIdx.x;
    const int w = tid >> 5, lane = tid & 31;
    const int g8 = lane >> 2, q4 = lane & 3;
    const int tg = w & 3;                      // this warp's 16-token group of each tile
    const int hh = (NH == 1) ? 0 : (w >> 2);  // ... and its half of the QK sub-groups and P * s groups
    const int R = S_q * H;
    const int NCHK = (R + 15) / 16;
    const int b = blockIdx.x / NCHK, chk = blockIdx.x % NCHK;
    const int rbase = chk * 16;
    const int L = (int)seq_lens[b];
    const i64 sid = seq_ids[b];
    const bool sid_ok = sid >= 0 && sid < max_seqs;
    // packed tokens only: [keep_lo, keep_hi) lies between the sink and the local window
    const int keep_lo = sid_ok ? min(sink, L) : 0;
    const int keep_hi = (sid_ok && local > 0) ? max(keep_lo, L - local) : L;
    const int split = blockIdx.y;
    const int t_end = min(keep_hi, (split + 1) * tiles_per_split * T);
    const int t_begin = max(split * tiles_per_split * T, keep_lo / T * T);

    // QK C-fragment columns of this lane: rows 2q, 2q+1 (n-tile 0) and 8 + 2q, 9 + 2q (n-tile 1)
    int lim[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int r = rbase + 2 * q4 + (k & 1) + 8 * (k >> 1);
        lim[k] = min(keep_hi, L - S_q + r / H + 1);
    }

    float acc[NTP][4];
    float corr[KCH][4];
#pragma unroll
    for (int i = 0; i < NTP; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll
    for (int c = 0; c < KCH; ++c) corr[c][0] = corr[c][1] = corr[c][2] = corr[c][3] = 0.0f;
    float lq[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // partial row sums over this lane's tokens
    float m_run = -QMLA_INF;                  // running maximum of row (lane & 15)

    if (t_begin < t_end) {
        // ------------------------------------------------------------ query in permuted K order, query sums
        // one 16-byte load per (row, 8 channels); the 8 channels share a sub-group, whose sum is
        // formed from per-chunk partials in a fixed order (deterministic, no atomics)
        float* part = (float*)(smem + PS_OFF);  // [16 rows][DT / 8 chunks], before P * s needs the space
        {
            constexpr int NCK = (DC + DR) / 8;
            uint4 v[(16 * NCK + NTH - 1) / NTH];
#pragma unroll
            for (int k = 0; k < (16 * NCK + NTH - 1) / NTH; ++k) {
                const int idx = tid + k * NTH, row = idx / NCK, ck = idx % NCK;
                v[k] = make_uint4(0u, 0u, 0u, 0u);
                if (idx < 16 * NCK && rbase + row < R) {
                    const i64 qrow = (i64)b * R + rbase + row;
                    v[k] = ck < DC / 8 ? *(const uint4*)(q_lat + qrow * DC + 8 * ck)
                                       : *(const uint4*)(q_rope + qrow * DR + 8 * (ck - DC / 8));
                }
            }
#pragma unroll
            for (int k = 0; k < (16 * NCK + NTH - 1) / NTH; ++k) {
                const int idx = tid + k * NTH, row = idx / NCK, ck = idx % NCK;
                if (idx < 16 * NCK) {
                    const u32 wv[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
                    float sum = 0.0f;
#pragma unroll
                    for (int x = 0; x < 8; ++x) {
                        const u32 h = (wv[x >> 1] >> (16 * (x & 1))) & 0xffffu;
                        sum += bf16_bits_to_f32(h);
                        int ks, rem;
                        if (ck < DC / 8) {
                            const int ch = 8 * ck + x, c = ch / CB;
                            rem = ch % 64;
                            ks = 4 * ((ch % CB) / 64 * KCH + c) + (rem % 16) / 4;
                        } else {
                            const int ch = 8 * (ck - DC / 8) + x, c = ch / RB;
                            rem = (ch % RB) % RLB + 16 * ((ch % RB) / RLB);
                            ks = KSC + c * NWR + (rem % 16) / 4;
                        }
                        // lane q = rem / 16, byte = rem % 4 -> column 8 (byte & 1) + 2q + (byte >> 1)
                        const int byte = rem & 3, kk = 8 * (byte & 1) + 2 * (rem >> 4) + (byte >> 1);
                        qs[((ks * 2 + (kk >> 3)) * 16 + row) * 8 + (kk & 7)] = (u16)h;
                    }
                    part[row * NCK + ck] = sum;
                }
            }
            // zero the stages once: bytes never copied (missing pages) stay finite codes/scales
            uint4* z4 = (uint4*)smem;
            for (int k = tid; k < NSTAGE * STAGE_BYTES / 16; k += NTH) z4[k] = make_uint4(0u, 0u, 0u, 0u);
            __syncthreads();
            for (int idx = tid; idx < (NSG + 2) * 16; idx += NTH) {
                const int sgi = idx >> 4, row = idx & 15;
                // content sub-group (block bl, slice c): channels CB c + 64 bl + [0, 64); RoPE slice c: RB c + [0, RB)
                const int ck0 = sgi < NSG ? (CB * (sgi % KCH) + 64 * (sgi / KCH)) / 8 : (DC + RB * (sgi - NSG)) / 8;
                const int nck = sgi < NSG ? 8 : RB / 8;
                float s = 0.0f;
                for (int k = 0; k < nck; ++k) s += part[row * NCK + ck0 + k];
                sq[idx] = s;
            }
        }

        // ------------------------------------------------------------ staging (as v2, without token flags)
        auto load_pages = [&](int tt, int (&pgs)[NSEG]) {
            qmla_load_pages(tt, pgs, block_table + (i64)b * bt_stride, L, max_pages, num_pages);
        };
        auto issue_copy = [&](int tt, int st, const int (&pgs)[NSEG]) {
            qmla_issue_stage(smem + st * STAGE_BYTES, pages, pgs, tt, L, tid);
        };

        __syncthreads();  // query sums visible, partials consumed (P * s reuses their space)
        int pg_next[NSEG];
#pragma unroll
        for (int s = 0; s < NSTAGE - 1; ++s) {
            load_pages(t_begin + s * T, pg_next);
            if (t_begin + s * T < t_end) issue_copy(t_begin + s * T, s, pg_next);
            cp_async_commit();
        }
        load_pages(t_begin + (NSTAGE - 1) * T, pg_next);
        qmla_wait_group<NSTAGE - 2>();
        __syncthreads();

        const u32 qs_lane = smem_addr(qs) + (((lane >> 3) & 1) * 16 + 8 * (lane >> 4) + (lane & 7)) * 16;
        // P * s rows: stmatrix lane address (this warp's 16 tokens) and ldmatrix lane address (k-step 0)
        const u32 ps_base = smem_addr(smem + PS_OFF);
        const u32 ps_st = ps_base + ((2 * tg + ((lane >> 3) & 1)) * 16 + 8 * (lane >> 4) + (lane & 7)) * 16;
        const u32 ps_ld = ps_base + ((lane >> 4) * 16 + 8 * ((lane >> 3) & 1) + (lane & 7)) * 16;
        const int tq0 = 16 * tg + g8, tq1 = tq0 + 8;

        int i = 0;
        for (int t0 = t_begin; t0 < t_end; t0 += T, ++i) {
            const u8* stg = smem + (i % NSTAGE) * STAGE_BYTES;

            // -------------------------------------------------------- QK: 16 tokens x 16 rows per warp
            float S[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
            // content scales and zero points of this lane's two tokens: with 4 warps (compile-time
            // groups) read once per tile as vectors and kept for P * s; with 8, read where used
            float sc0[NGC], sc1[NGC];
            u32 zw0[(NGC + 3) / 4], zw1[(NGC + 3) / 4];
            if constexpr (NH == 1) {
                v3_token_scales(stg, tq0, sc0);
                v3_token_scales(stg, tq1, sc1);
#pragma unroll
                for (int k = 0; k < (NGC + 3) / 4; ++k) {
                    if (NGC >= 4) {
                        zw0[k] = *(const u32*)(stg + SO_CZ + tq0 * NGC + 4 * k);
                        zw1[k] = *(const u32*)(stg + SO_CZ + tq1 * NGC + 4 * k);
                    } else {
                        zw0[k] = *(const u16*)(stg + SO_CZ + tq0 * NGC);
                        zw1[k] = *(const u16*)(stg + SO_CZ + tq1 * NGC);
                    }
                }
            }
            auto cscale = [&](int t, const float (&sc)[NGC], int grp) -> float {
                if constexpr (NH == 1) return sc[grp];
                else return v3_cscale(stg, t * NGC + grp);
            };
            auto czero = [&](int t, const u32 (&zw)[(NGC + 3) / 4], int grp) -> float {
                if constexpr (NH == 1) return v3_off_zb(zw[grp >> 2], grp & 3);
                else return v3_off_z(stg[SO_CZ + t * NGC + grp]);
            };
#pragma unroll
            for (int bll = 0; bll < NBLK / NH; ++bll) {
                const int bl = hh * (NBLK / NH) + bll;
                const uint4 v0 = *(const uint4*)(stg + qmla_coff(tq0, 64 * bl + 16 * q4));
                const uint4 v1 = *(const uint4*)(stg + qmla_coff(tq1, 64 * bl + 16 * q4));
                const u32 W0[4] = {v0.x, v0.y, v0.z, v0.w}, W1[4] = {v1.x, v1.y, v1.z, v1.w};
#pragma unroll
                for (int c = 0; c < KCH; ++c) {
                    const int sgi = bl * KCH + c;
                    const int grp = (64 * bl + CB * c) / QMLA_GC;
                    float tmp[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const u32 x0 = v3_slice(W0[e], c), x1 = v3_slice(W1[e], c);
                        const u32 a[4] = {v3_code2<0>(x0), v3_code2<0>(x1), v3_code2<1>(x0), v3_code2<1>(x1)};
                        u32 b00, b01, b10, b11;
                        ldsm_x4(qs_lane + (sgi * 4 + e) * 512, b00, b01, b10, b11);
                        mma_bf16(tmp[0], a, b00, b01);
                        mma_bf16(tmp[1], a, b10, b11);
                    }
                    const float s0 = cscale(tq0, sc0, grp), s1 = cscale(tq1, sc1, grp);
                    const float c0 = s0 * czero(tq0, zw0, grp), c1 = s1 * czero(tq1, zw1, grp);
                    const float2 sqa = *(const float2*)(sq + sgi * 16 + 2 * q4);
                    const float2 sqb = *(const float2*)(sq + sgi * 16 + 8 + 2 * q4);
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt) v3_flush(S[nt], tmp[nt], s0, s1, c0, c1, nt ? sqb : sqa);
                }
            }
            {
                // RoPE: nibble slice c (channels RB c + [0, RB)) in k-steps KSC + c NWR + e; with 8 warps
                // each half of a pair takes one slice
                u32 R0[NWR], R1[NWR];
#if RLB == 8
                const uint2 r0 = *(const uint2*)(stg + SO_R + tq0 * RB + 8 * q4);
                const uint2 r1 = *(const uint2*)(stg + SO_R + tq1 * RB + 8 * q4);
                R0[0] = r0.x; R0[1] = r0.y; R1[0] = r1.x; R1[1] = r1.y;
#else
                R0[0] = *(const u32*)(stg + SO_R + tq0 * RB + 4 * q4);
                R1[0] = *(const u32*)(stg + SO_R + tq1 * RB + 4 * q4);
#endif
                const float s0 = v3_rscale(stg, tq0), s1 = v3_rscale(stg, tq1);
                const float c0 = s0 * v3_off_z(stg[SO_RZ + tq0]), c1 = s1 * v3_off_z(stg[SO_RZ + tq1]);
#pragma unroll
                for (int cc = 0; cc < 2 / NH; ++cc) {
                    const int c = hh * (2 / NH) + cc;
                    float tmp[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
                    for (int e = 0; e < NWR; ++e) {
                        const u32 x0 = (R0[e] >> (4 * c)) & 0x0f0f0f0fu, x1 = (R1[e] >> (4 * c)) & 0x0f0f0f0fu;
                        const u32 a[4] = {v3_code2<0>(x0), v3_code2<0>(x1), v3_code2<1>(x0), v3_code2<1>(x1)};
                        u32 b00, b01, b10, b11;
                        ldsm_x4(qs_lane + (KSC + c * NWR + e) * 512, b00, b01, b10, b11);
                        mma_bf16(tmp[0], a, b00, b01);
                        mma_bf16(tmp[1], a, b10, b11);
                    }
                    const float2 sqa = *(const float2*)(sq + (NSG + c) * 16 + 2 * q4);
                    const float2 sqb = *(const float2*)(sq + (NSG + c) * 16 + 8 + 2 * q4);
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt) v3_flush(S[nt], tmp[nt], s0, s1, c0, c1, nt ? sqb : sqa);
                }
            }
            if constexpr (NH == 2) {
                // the pair's two partial score tiles meet in shared memory; both warps add them (a + b
                // is exact-commutative, so both hold the same scores)
                float4* xs = (float4*)(smem + XS_OFF);
                xs[((tg * 2 + hh) * 32 + lane) * 2] = make_float4(S[0][0], S[0][1], S[0][2], S[0][3]);
                xs[((tg * 2 + hh) * 32 + lane) * 2 + 1] = make_float4(S[1][0], S[1][1], S[1][2], S[1][3]);
                __syncthreads();  // barrier 0: partial scores
                const float4 o0 = xs[((tg * 2 + (hh ^ 1)) * 32 + lane) * 2];
                const float4 o1 = xs[((tg * 2 + (hh ^ 1)) * 32 + lane) * 2 + 1];
                S[0][0] += o0.x; S[0][1] += o0.y; S[0][2] += o0.z; S[0][3] += o0.w;
                S[1][0] += o1.x; S[1][1] += o1.y; S[1][2] += o1.z; S[1][3] += o1.w;
            }

            // -------------------------------------------------------- mask, per-token-group row maxima
            const int n0 = t0 + tq0, n1 = t0 + tq1;
            float mx[4];
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const int n = (k & 2) ? n1 : n0;
                    const int col = 2 * nt + (k & 1);  // lim[] index of this column
                    S[nt][k] = (n >= keep_lo && n < lim[col]) ? S[nt][k] * scale_log2 : -QMLA_INF;
                }
                mx[2 * nt] = fmaxf(S[nt][0], S[nt][2]);
                mx[2 * nt + 1] = fmaxf(S[nt][1], S[nt][3]);
            }
#pragma unroll
            for (int o = 4; o <= 16; o <<= 1) {
#pragma unroll
                for (int k = 0; k < 4; ++k) mx[k] = fmaxf(mx[k], __shfl_xor_sync(0xffffffffu, mx[k], o));
            }
            if (g8 == 0 && hh == 0) {
                *(float2*)(red + tg * 16 + 2 * q4) = make_float2(mx[0], mx[1]);
                *(float2*)(red + tg * 16 + 8 + 2 * q4) = make_float2(mx[2], mx[3]);
            }
            __syncthreads();  // barrier 1: row maxima of all token groups

            // -------------------------------------------------------- online softmax (every warp the same maxima)
            const int rr = lane & 15;
            float mt = m_run;
#pragma unroll
            for (int ww = 0; ww < 4; ++ww) mt = fmaxf(mt, red[ww * 16 + rr]);
            const float u = (mt == -QMLA_INF) ? 0.0f : mt;
            const float alpha = exp2f(m_run - u);
            m_run = mt;
            float uq[4], aq[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int src = 2 * q4 + (k & 1) + 8 * (k >> 1);
                uq[k] = __shfl_sync(0xffffffffu, u, src);
                aq[k] = __shfl_sync(0xffffffffu, alpha, src);
            }
            const float al0 = __shfl_sync(0xffffffffu, alpha, g8), al1 = __shfl_sync(0xffffffffu, alpha, g8 + 8);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int k = 0; k < 4; ++k) S[nt][k] = exp2f(S[nt][k] - uq[2 * nt + (k & 1)]);
            }
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int nt = k >> 1, c = k & 1;
                lq[k] = lq[k] * aq[k] + S[nt][c] + S[nt][c + 2];
            }
            // P * s per content group (this warp's half of them), stored transposed for the PV A operand
#pragma unroll
            for (int gl = 0; gl < NGC / NH; ++gl) {
                const int grp = hh * (NGC / NH) + gl;
                const float s0 = cscale(tq0, sc0, grp), s1 = cscale(tq1, sc1, grp);
                v3_store_ps(ps_st + grp * (T / 8) * 256, pack_bf16x2(S[0][0] * s0, S[0][1] * s0),
                            pack_bf16x2(S[0][2] * s1, S[0][3] * s1), pack_bf16x2(S[1][0] * s0, S[1][1] * s0),
                            pack_bf16x2(S[1][2] * s1, S[1][3] * s1), lane);
            }

            qmla_wait_group<NSTAGE - 3>();  // this thread's copies of tile i+1 landed
            __syncthreads();              // barrier 2: P * s and the next staged tile visible
            if (t0 + (NSTAGE - 1) * T < t_end) {
                issue_copy(t0 + (NSTAGE - 1) * T, (i + NSTAGE - 1) % NSTAGE, pg_next);
                load_pages(t0 + NSTAGE * T, pg_next);
            }
            cp_async_commit();

            // -------------------------------------------------------- PV over this warp's channel slice
            qmla_rescale_rows<QMLA_V3_LAZY_RESCALE>(acc, al0, al1);
#pragma unroll
            for (int kt = 0; kt < T / 16; ++kt) {
                const int ta = 16 * kt + 2 * q4;
                const int tk[4] = {ta, ta + 1, ta + 8, ta + 9};
                u32 Wp[4][(LBP + 3) / 4];
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    qmla_load_bytes<LBP>(stg + qmla_coff(tk[k], CBW * w + LBP * g8), Wp[k]);
                }
#pragma unroll
                for (int c = 0; c < KCH; ++c) {
                    const int grp = (CBW * w + CB * c) / QMLA_GC;
                    u32 a[4];
                    ldsm_x4(ps_ld + (grp * (T / 8) + 2 * kt) * 256, a[0], a[1], a[2], a[3]);
                    const u8* zc = stg + SO_CZ + grp;
                    const u32 zb0 = 0x43004300u | (u32)zc[tk[0] * NGC] | ((u32)zc[tk[1] * NGC] << 16);
                    const u32 zb1 = 0x43004300u | (u32)zc[tk[2] * NGC] | ((u32)zc[tk[3] * NGC] << 16);
                    mma_bf16(corr[c], a, zb0, zb1);
#pragma unroll
                    for (int jx = 0; jx < LBP / 2; ++jx) {
                        // code bytes 2jx, 2jx+1 of two tokens side by side: {A.b, A.b', B.b, B.b'}
                        const u32 sel = (jx & 1) ? 0x7632u : 0x5410u;
                        const u32 x01 = v3_slice(__byte_perm(Wp[0][jx >> 1], Wp[1][jx >> 1], sel), c);
                        const u32 x89 = v3_slice(__byte_perm(Wp[2][jx >> 1], Wp[3][jx >> 1], sel), c);
                        mma_bf16(acc[c * LBP + 2 * jx], a, v3_code2<0>(x01), v3_code2<0>(x89));
                        mma_bf16(acc[c * LBP + 2 * jx + 1], a, v3_code2<1>(x01), v3_code2<1>(x89));
                    }
                }
            }
            // Take the offsets and zero points out once per tile: the tensor cores accumulate
            // (128 + code) products, ~100x the result for 2-bit codes, and round toward zero at
            // every MMA, so over a whole split the error would grow with the split's length.
#pragma unroll
            for (int c = 0; c < KCH; ++c) {
#pragma unroll
                for (int j = 0; j < LBP; ++j) {
                    acc[c * LBP + j][0] -= corr[c][0];
                    acc[c * LBP + j][1] -= corr[c][0];
                    acc[c * LBP + j][2] -= corr[c][2];
                    acc[c * LBP + j][3] -= corr[c][2];
                }
                corr[c][0] = corr[c][1] = corr[c][2] = corr[c][3] = 0.0f;
            }
        }
    }

    // ---------------------------------------------------------------- partial results (v1 layout)
#pragma unroll
    for (int o = 4; o <= 16; o <<= 1) {
#pragma unroll
        for (int k = 0; k < 4; ++k) lq[k] += __shfl_xor_sync(0xffffffffu, lq[k], o);
    }
    __syncthreads();  // every warp is past its last read of red[] and of the stages
    if (g8 == 0 && hh == 0) {  // both warps of a pair hold the same sums
        *(float2*)(red + tg * 16 + 2 * q4) = make_float2(lq[0], lq[1]);
        *(float2*)(red + tg * 16 + 8 + 2 * q4) = make_float2(lq[2], lq[3]);
    }
    // the partial outputs through the stage area, free now (qmla_store_partial_rows; ncu: the
    // scalar stores were 14 % of the kernel's sectors, H16 B32 L32K)
    float* ot = (float*)smem;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int c = 0; c < KCH; ++c) {
#pragma unroll
            for (int j = 0; j < LBP; ++j) {
                const int ch = CBW * w + LBP * (2 * q4) + j + CB * c;
                ot[(g8 + 8 * h) * OT_STRIDE + ch] = acc[c * LBP + j][2 * h];
                ot[(g8 + 8 * h) * OT_STRIDE + ch + LBP] = acc[c * LBP + j][2 * h + 1];
            }
        }
    }
    __syncthreads();
    if (w == 0 && lane < 16 && rbase + lane < R) {
        float l = 0.0f;
#pragma unroll
        for (int ww = 0; ww < 4; ++ww) l += red[ww * 16 + lane];
        ml_part[((i64)b * R + rbase + lane) * num_splits + split] = make_float2(m_run, l);
    }
    qmla_store_partial_rows(o_part, ot, b, R, rbase, num_splits, split, tid);
}
