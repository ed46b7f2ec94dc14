// A probe of a decode-attention design for few query rows that keeps the dequantized keys out of shared memory
// (benchmarks/v7_probe.py; stop 70 of benchmarks/RESULTS.md). Not a backend kernel: it reads a synthetic token-major
// C4R4 layout (no pages, no protected tokens, no masks: every CTA owns a whole number of 32-token tiles) and writes
// each team's unnormalized partial output, which v7_probe.py checks against float64.
//
// Why: kernel v5 moves each dequantized key tile through shared memory (stmatrix, then PV's wgmma reads it back),
// ~1,430 shared-memory wavefronts a 64-token tile on the H200 (stop 33's ncu), more than the 0.35x target leaves a
// tile. Here PV's operand never leaves the registers:
//   * 16 query rows (H 16, S_q 1); a team of 4 warps takes a 32-token tile; warp w owns content channels
//     128 w .. 128 w + 127 (lane quad q: 32 of them, one 64-channel group) and RoPE channels 16 w .. 16 w + 15.
//   * QK: S[16 rows][32 tokens] over the warp's 144 channels, mma.sync m16n8k16 with the queries' A fragments held in
//     registers (9 k-steps) and B = the lane's own dequantized codes (lane g of a quad holds token g of each 8-token
//     block), bf16(s (code - z)) as the v5 kernel makes them (common.cuh's qmla_dq2_bf16).
//   * The 4 warps' partial scores meet in shared memory (double-buffered: one barrier a tile); each warp adds them
//     and runs the same online softmax (base 2).
//   * PV: O[16 rows][the warp's 128 channels] += P V, mma.sync with A = P straight from the score fragments and
//     B = the QK fragments transposed in registers by movmatrix (8x8 blocks: tokens x channels -> channels x tokens).
// Two teams a CTA take alternate tiles with their own softmax state and partial.
#define QMLA_DC 512  // common.cuh wants a layout; the probe's is fixed below
#include "common.cuh"

#define H 16
#define DC 512
#define DR 64
#define CROW 256  // content code bytes a token (4-bit)
#define RROW 32   // RoPE code bytes a token
#define NGC 8     // content groups of 64 channels
#define T 32      // tokens a tile
#define NJ 4      // 8-token blocks a tile
#define KS 9      // k-steps a warp: 8 content (128 channels) + 1 RoPE (16)
#define NCB 16    // 8-channel output blocks a warp
#define TEAMS 2
#define SLACK 8.0f  // log2 units a score may pass the row's reference maximum
// Stage-skip builds (timing only: their outputs are wrong): 1 skips PV (its mma.sync and movmatrix), 2 skips the
// partial-score exchange (each warp's softmax runs on its own partial scores, no shared memory, no barrier).
#ifndef V7_SKIP
#define V7_SKIP 0
#endif

__device__ __forceinline__ u32 movmatrix_t(u32 x) {
    u32 d;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(x));
    return d;
}

// channel of QK's k index kk in k-step ks of warp w (the fragments' permutation of the contraction):
// content word e = ks / 2 of lane quad q's 16 bytes gives k-steps 2e, 2e + 1; a register pairs nibbles 8e + {0, 2},
// {4, 6} (low nibbles of bytes 0..3) or {1, 3}, {5, 7} (high nibbles); RoPE: the quad's 2 bytes, pairs {0, 2}, {1, 3}
__device__ __forceinline__ int v7_channel(int w, int ks, int kk) {
    const int q = (kk & 7) >> 1, el = kk & 1, hi = kk >> 3;
    if (ks < 8) {
        const int e = ks >> 1, r = 2 * (ks & 1) + hi;  // register r of word e
        const int off = (r & 1) * 4 + (r >> 1) + 2 * el;
        return 128 * w + 32 * q + 8 * e + off;
    }
    return DC + 16 * w + 4 * q + hi + 2 * el;
}

struct V7Codes {
    uint4 c[NJ];  // the lane's 16 content bytes of token 8 j + g
    u32 r[NJ];    // its 2 RoPE bytes
    u32 cs[NJ], cz[NJ], rs[NJ], rz[NJ];  // bf16 scale bits and zero of its content group and of the RoPE group
};

__device__ __forceinline__ void v7_load(V7Codes& x, const u8* __restrict__ cc, const u8* __restrict__ rc,
                                        const u16* __restrict__ csc, const u8* __restrict__ cze,
                                        const u16* __restrict__ rsc, const u8* __restrict__ rze, long long t0, int w,
                                        int g, int q) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        const long long t = t0 + 8 * j + g;
        x.c[j] = *(const uint4*)(cc + t * CROW + 64 * w + 16 * q);
        x.r[j] = *(const u16*)(rc + t * RROW + 8 * w + 2 * q);
        x.cs[j] = csc[t * NGC + 2 * w + (q >> 1)];
        x.cz[j] = cze[t * NGC + 2 * w + (q >> 1)];
        x.rs[j] = rsc[t];
        x.rz[j] = rze[t];
    }
}

// bf16x2 s (code - z) of the two codes in bytes 0, 1 (HI 0) or 2, 3 (HI 1) of x (one code a byte)
template <int HI>
__device__ __forceinline__ u32 v7_dq(u32 x, u32 off2, u32 s2) {
    return qmla_dq2_bf16(qmla_code2<HI>(x), off2, s2);
}

// the lane's QK B fragments of a tile: b[j][ks][0..1]
__device__ __forceinline__ void v7_dequantize(u32 (&b)[NJ][KS][2], const V7Codes& x) {
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
        const u32 off2 = 0xc300c300u | x.cz[j] | (x.cz[j] << 16), s2 = x.cs[j] | (x.cs[j] << 16);
        const u32 w4[4] = {x.c[j].x, x.c[j].y, x.c[j].z, x.c[j].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const u32 lo = w4[e] & 0x0f0f0f0fu, hi = (w4[e] >> 4) & 0x0f0f0f0fu;
            b[j][2 * e][0] = v7_dq<0>(lo, off2, s2);      // nibbles 0, 2
            b[j][2 * e][1] = v7_dq<1>(lo, off2, s2);      // 4, 6
            b[j][2 * e + 1][0] = v7_dq<0>(hi, off2, s2);  // 1, 3
            b[j][2 * e + 1][1] = v7_dq<1>(hi, off2, s2);  // 5, 7
        }
        const u32 roff2 = 0xc300c300u | x.rz[j] | (x.rz[j] << 16), rs2 = x.rs[j] | (x.rs[j] << 16);
        b[j][8][0] = v7_dq<0>(x.r[j] & 0x0f0fu, roff2, rs2);         // RoPE nibbles 0, 2
        b[j][8][1] = v7_dq<0>((x.r[j] >> 4) & 0x0f0fu, roff2, rs2);  // 1, 3
    }
}

// grid (CTAs), block 128 TEAMS. CTA c owns tokens [c * tpc, (c + 1) * tpc), tpc a multiple of 32 TEAMS; q_lat
// [16][576] bf16 (one request's rows, shared by every CTA); out [CTAs][TEAMS][16][512] float32 unnormalized,
// ml [CTAs][TEAMS][16][2] (row maximum in log2 units of the scaled scores, row sum)
extern "C" __global__ void __launch_bounds__(128 * TEAMS, 1)
    v7_probe(const u8* __restrict__ cc, const u8* __restrict__ rc, const u16* __restrict__ csc,
             const u8* __restrict__ cze, const u16* __restrict__ rsc, const u8* __restrict__ rze,
             const u16* __restrict__ q_lat, float* __restrict__ out, float* __restrict__ ml, int tpc,
             float scale_log2) {
    __shared__ float4 xs[TEAMS][2][4][NJ][32];  // partial scores: team, buffer, warp, block, lane
    const int team = threadIdx.x / 128, w = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane >> 2,
              q = lane & 3;
    const long long base = (long long)blockIdx.x * tpc;
    u32 qa[KS][4];  // the queries' A fragments in QK's channel order
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i & 1), kk = 2 * q + 8 * (i >> 1);
            const u32 lo = q_lat[row * (DC + DR) + v7_channel(w, ks, kk)];
            const u32 hi = q_lat[row * (DC + DR) + v7_channel(w, ks, kk + 1)];
            qa[ks][i] = lo | (hi << 16);
        }
    }
    float o[NCB][4];
#pragma unroll
    for (int n = 0; n < NCB; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m0 = -QMLA_INF, m1 = -QMLA_INF, l0 = 0.0f, l1 = 0.0f;
    const int ntiles = tpc / T;
    V7Codes x;
    if (team < ntiles) v7_load(x, cc, rc, csc, cze, rsc, rze, base + T * team, w, g, q);
    int buf = 0;
    for (int it = team; it < ntiles; it += TEAMS, buf ^= 1) {
        u32 b[NJ][KS][2];
        v7_dequantize(b, x);
        if (it + TEAMS < ntiles) v7_load(x, cc, rc, csc, cze, rsc, rze, base + (long long)T * (it + TEAMS), w, g, q);
        float s[NJ][4];
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) mma_bf16(s[j], qa[ks], b[j][ks][0], b[j][ks][1]);
            if (V7_SKIP != 2) xs[team][buf][w][j][lane] = make_float4(s[j][0], s[j][1], s[j][2], s[j][3]);
        }
        if (V7_SKIP != 2) asm volatile("bar.sync %0, 128;" ::"r"(team + 1) : "memory");
#pragma unroll
        for (int ww = 1; ww < (V7_SKIP == 2 ? 1 : 4); ++ww) {
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const float4 v = xs[team][buf][(w + ww) & 3][j][lane];
                s[j][0] += v.x;
                s[j][1] += v.y;
                s[j][2] += v.z;
                s[j][3] += v.w;
            }
        }
        // online softmax over rows g (s[.][0..1]) and g + 8 (s[.][2..3]); the quad's four lanes hold the tile's tokens
        float t0 = -QMLA_INF, t1 = -QMLA_INF;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            t0 = fmaxf(t0, fmaxf(s[j][0], s[j][1]));
            t1 = fmaxf(t1, fmaxf(s[j][2], s[j][3]));
        }
#pragma unroll
        for (int d = 1; d < 4; d <<= 1) {
            t0 = fmaxf(t0, __shfl_xor_sync(0xffffffffu, t0, d));
            t1 = fmaxf(t1, __shfl_xor_sync(0xffffffffu, t1, d));
        }
        // the reference maximum moves only when a score passes it by SLACK (as kernel v5's): most tiles skip the
        // rescale of the 64 accumulators
        const bool up0 = t0 * scale_log2 > m0 + SLACK, up1 = t1 * scale_log2 > m1 + SLACK;
        if (__any_sync(0xffffffffu, up0 || up1)) {
            const float n0 = up0 ? t0 * scale_log2 : m0, n1 = up1 ? t1 * scale_log2 : m1;
            const float a0 = exp2f(m0 - n0), a1 = exp2f(m1 - n1);
            m0 = n0;
            m1 = n1;
            l0 *= a0;
            l1 *= a1;
            qmla_rescale_rows<false>(o, a0, a1);
        }
        u32 pa[NJ][2];  // P as bf16 pairs: pa[j][0] row g, pa[j][1] row g + 8 (tokens 8 j + 2 q, + 1)
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            const float p0 = exp2f(s[j][0] * scale_log2 - m0), p1 = exp2f(s[j][1] * scale_log2 - m0);
            const float p2 = exp2f(s[j][2] * scale_log2 - m1), p3 = exp2f(s[j][3] * scale_log2 - m1);
            l0 += p0 + p1;
            l1 += p2 + p3;
            pa[j][0] = pack_bf16x2(p0, p1);
            pa[j][1] = pack_bf16x2(p2, p3);
        }
        // PV: k-step kk covers blocks 2 kk, 2 kk + 1; output block n = 2 ks + r holds QK's register r of k-step ks
#pragma unroll
        for (int kk = 0; kk < (V7_SKIP == 1 ? 0 : NJ / 2); ++kk) {
            const u32 a[4] = {pa[2 * kk][0], pa[2 * kk][1], pa[2 * kk + 1][0], pa[2 * kk + 1][1]};
#pragma unroll
            for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    mma_bf16(o[2 * ks + r], a, movmatrix_t(b[2 * kk][ks][r]), movmatrix_t(b[2 * kk + 1][ks][r]));
                }
            }
        }
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const long long slot = (long long)blockIdx.x * TEAMS + team;
    float* op = out + slot * H * DC;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                // output column 2 q + e of block 2 ks + r is QK's k index 2 q + e + 8 r (movmatrix's transpose)
                const int ch = v7_channel(w, ks, 2 * q + e + 8 * r);
                op[g * DC + ch] = o[2 * ks + r][e];
                op[(g + 8) * DC + ch] = o[2 * ks + r][2 + e];
            }
        }
    }
    if (w == 0 && q == 0) {
        ml[(slot * H + g) * 2] = m0;
        ml[(slot * H + g) * 2 + 1] = l0;
        ml[(slot * H + g + 8) * 2] = m1;
        ml[(slot * H + g + 8) * 2 + 1] = l1;
    }
}
