// A probe of a decode-attention design for 16 query rows (H 16, S_q 1) that never scales a dequantized value
// (benchmarks/v8_probe.py; stop 72 of benchmarks/RESULTS.md). Not a backend kernel: it reads v7_probe's synthetic
// token-major C4R4 layout (no pages, no protected tokens, no masks: every CTA owns whole 64-token tiles) and writes
// each worker's unnormalized partial output, which v8_probe.py checks against float64.
//
// Why: kernel v5 spends ~2 instructions a value turning 4-bit codes into bf16(s (code - z)) (stop 71's SASS: 580 of
// its 1,307 a warp and tile), and its wgmma at N = 16 runs at 44 % of the dense rate. With mma.sync, whose
// accumulators are the warp's own registers, the scales can leave the values:
//   * a code becomes the bf16 128 + code with one LOP3 a pair (0x4300 | nibble); the key tile holds these, unscaled;
//   * QK (tokens as M, 16 a warp; the 16 heads as N; channels as K, A = the lane's own converted codes): one fresh
//     accumulator a group of 64 channels, added to the score times that token's scale (an FFMA a score and group);
//     the zero point and the 128 come off through 12 small MMAs, W (s (128 + z): a bf16 high and low part, exact)
//     times the heads' per-group query sums (three bf16 parts);
//   * PV (heads as M, the warp's 128 channels as N, tokens as K): A = P'_g = p s_g for each content group g, made by
//     the lane that made p, stored transposed by stmatrix; B = the unscaled key tile by ldmatrix.trans; the zero
//     point and the 128 come off once at the end, from an MMA of the same P'_g against the tokens' 128 + z.
// Two workers of 4 warps a CTA take alternate tiles; two named barriers a tile and worker (tile ready, tile read).
// The reference maximum (log2 units) is exchanged on a worker's first tile and then moves lazily, as kernel v5's:
// p may exceed 1 by up to 2^SLACK, so a score that passes the maximum by more than ~120 would overflow (a probe's
// limit, not checked).
#define QMLA_DC 512  // common.cuh wants a layout; the probe's is fixed below
#include "common.cuh"
#include "wgmma.cuh"

#define H 16
#define DC 512
#define DR 64
#define CROW 256   // content code bytes a token (4-bit)
#define RROW 32    // RoPE code bytes a token
#define NGC 8      // content groups of 64 channels
#define T 64       // tokens a tile
#define WORKERS 2
#define NB 16      // 8-channel output blocks a warp (128 channels)
#define SLACK 8.0f
// Stage-skip builds (timing only: their outputs are wrong): 1 skips PV (its ldmatrix and mma.sync).
#ifndef V8_SKIP
#define V8_SKIP 0
#endif

// shared memory (bytes): the queries' B fragments (QK's, then the zero-point MMAs'), then per worker its key tile,
// P' tiles, 128 + z rows and tile maxima
#define QB_BYTES ((36 + 3) * 32 * 16)
#define VT_BYTES (T * DC * 2)        // [token][512 positions] bf16, 16-byte chunks swizzled by token % 8
#define PT_BYTES (NGC * H * T * 2)   // [group][head][token] bf16, 16-byte chunks swizzled by head % 8
#define ZT_BYTES (T * 16)            // [token][8 groups] bf16 128 + z
#define MX_BYTES (H * 4 * 4)         // [head][warp] float tile maxima (then row sums)
#define WK_BYTES (VT_BYTES + PT_BYTES + ZT_BYTES + MX_BYTES)
#define SMEM_BYTES (QB_BYTES + WORKERS * WK_BYTES)

template <bool B>
struct V8Flag {
    static constexpr bool value = B;
};

// bf16x2 128 + code of the nibbles at bits SH and SH + 16 of x: one LOP3 ((a & b) | c, both constants in
// registers: a LOP3 takes one immediate, so the compiler would split it in two)
template <int SH>
__device__ __forceinline__ u32 v8_pair(u32 x) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(x >> SH), "r"(0x000f000fu), "r"(0x43004300u));
    return d;
}

struct V8Token {
    uint4 c[4];   // content bytes 64 gp + 16 q .. + 15 (gp = 0..3)
    uint2 r;      // RoPE bytes 8 q .. 8 q + 7
    uint4 cs;     // the 8 content scales (bf16 bits)
    uint2 cz;     // the 8 content zero points
    u32 rs, rz;   // RoPE scale bits, zero point
};

__device__ __forceinline__ void v8_load(V8Token& x, const u8* __restrict__ cc, const u8* __restrict__ rc,
                                        const u16* __restrict__ csc, const u8* __restrict__ cze,
                                        const u16* __restrict__ rsc, const u8* __restrict__ rze, long long t, int q) {
#pragma unroll
    for (int gp = 0; gp < 4; ++gp) x.c[gp] = *(const uint4*)(cc + t * CROW + 64 * gp + 16 * q);
    x.r = *(const uint2*)(rc + t * RROW + 8 * q);
    x.cs = *(const uint4*)(csc + t * NGC);
    x.cz = *(const uint2*)(cze + t * NGC);
    x.rs = rsc[t];
    x.rz = rze[t];
}

__device__ __forceinline__ u32 v8_word(const uint4& v, int e) {
    return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}
// float of content scale g (bf16 bits in cs)
__device__ __forceinline__ float v8_scale(const uint4& cs, int g) {
    const u32 w = v8_word(cs, g >> 1);
    return __uint_as_float((g & 1) ? (w & 0xffff0000u) : (w << 16));
}
// bf16x2 (s, s) of content scale g
__device__ __forceinline__ u32 v8_scale2(const uint4& cs, int g) {
    return __byte_perm(v8_word(cs, g >> 1), 0u, (g & 1) ? 0x3232 : 0x1010);
}
__device__ __forceinline__ float v8_zero(const uint2& cz, int g) {
    return (float)(((g < 4 ? cz.x : cz.y) >> (8 * (g & 3))) & 0xffu);
}
// s (128 + z) of content group g (g < 8) or of the RoPE group (g = 8)
__device__ __forceinline__ float v8_w(const V8Token& x, int g) {
    const float s = g < 8 ? v8_scale(x.cs, g) : __uint_as_float(x.rs << 16);
    return s * (128.0f + (g < 8 ? v8_zero(x.cz, g) : (float)x.rz));
}
// bf16x2 high and low parts of (w0, w1)
__device__ __forceinline__ void v8_split(float w0, float w1, u32& hi, u32& lo) {
    hi = pack_bf16x2(w0, w1);
    lo = pack_bf16x2(w0 - __uint_as_float(hi << 16), w1 - __uint_as_float(hi & 0xffff0000u));
}
__device__ __forceinline__ float v8_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ u32 v8_mul_bf16x2(u32 a, u32 b) { return fma_bf16x2(a, b, 0x80008000u); }
__device__ __forceinline__ void v8_sts128(u32 addr, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
// scores += a group's accumulators times its scale: sa for token g (elements 0, 1), sb for token g + 8 (2, 3)
__device__ __forceinline__ void v8_add_group(float (&s)[2][4], const float (&acc)[2][4], float sa, float sb) {
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
        s[nb][0] = fmaf(sa, acc[nb][0], s[nb][0]);
        s[nb][1] = fmaf(sa, acc[nb][1], s[nb][1]);
        s[nb][2] = fmaf(sb, acc[nb][2], s[nb][2]);
        s[nb][3] = fmaf(sb, acc[nb][3], s[nb][3]);
    }
}
__device__ __forceinline__ float v8_max4(float4 v) { return fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)); }
// the content channel at value i (0..7) of key-tile chunk c (0..63): chunk 32 half + 8 gp + 2 e + odd holds QK's
// k-slots 8 odd .. 8 odd + 7 of k-step (gp, half, e), k-slot 2 q + el being channel 256 half + 64 gp + 16 q + 4 e +
// odd + 2 el (v8_pair's nibbles)
__device__ __forceinline__ int v8_channel(int c, int i) {
    return 256 * (c >> 5) + 64 * ((c >> 3) & 3) + 16 * (i >> 1) + 4 * ((c >> 1) & 3) + (c & 1) + 2 * (i & 1);
}

// grid (CTAs), block 128 WORKERS, dynamic shared memory SMEM_BYTES. CTA c owns tokens [c tpc, (c + 1) tpc), tpc a
// multiple of 64 WORKERS. qb [39][32] uint4: the queries' B fragments in QK's channel order (36 k-steps), then those
// of minus the heads' per-group query sums (three bf16 parts, largest first); out [CTAs][WORKERS][16][512] float32
// unnormalized, ml [CTAs][WORKERS][16][2] (reference maximum in log2 units of the scaled scores, row sum)
extern "C" __global__ void __launch_bounds__(128 * WORKERS, 1)
    v8_probe(const u8* __restrict__ cc, const u8* __restrict__ rc, const u16* __restrict__ csc,
             const u8* __restrict__ cze, const u16* __restrict__ rsc, const u8* __restrict__ rze,
             const uint4* __restrict__ qb_g, float* __restrict__ out, float* __restrict__ ml, int tpc,
             float scale_log2) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int wk = threadIdx.x / 128, w = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane >> 2,
              q = lane & 3;
    const uint4* qb = (const uint4*)smem;
    unsigned char* wbase = smem + QB_BYTES + wk * WK_BYTES;
    const u32 vt = smem_addr(wbase), pt = vt + VT_BYTES, zt = pt + PT_BYTES;
    float* mx = (float*)(wbase + VT_BYTES + PT_BYTES + ZT_BYTES);
    for (int i = threadIdx.x; i < 39 * 32; i += blockDim.x) ((uint4*)smem)[i] = qb_g[i];
    __syncthreads();
    const int bar_ready = 1 + 2 * wk, bar_read = 2 + 2 * wk;
    const long long base = (long long)blockIdx.x * tpc;
    const int ntiles = tpc / T;
    // addresses that stay fixed from tile to tile (16-byte chunks swizzled by row % 8: 8 rows of a matrix never
    // share a bank)
    // QK's A fragments stored as they are (stmatrix): lane l gives row l % 8 (token 16 w + l % 8 + 8 ((l / 8) % 2))
    // of matrix l / 8, whose 16 bytes are chunk 32 half + 8 gp + 2 e + l / 16 of that token's row
    const int sr = lane & 7, stok = 16 * w + sr + 8 * ((lane >> 3) & 1);
    const u32 vst = vt + stok * (DC * 2);
    u32 vsw[4];  // (2 e + l / 16) ^ (token % 8), in bytes, for e = 0..3
#pragma unroll
    for (int e = 0; e < 4; ++e) vsw[e] = (u32)(((2 * e + (lane >> 4)) ^ sr) * 16);
    const int mi = lane >> 3, hrow = (lane & 7) + 8 * (mi >> 1);           // P' stores (stmatrix.trans)
    const u32 pst = pt + hrow * (T * 2) + (u32)(((2 * w + (mi & 1)) ^ (hrow & 7)) * 16);
    const int r16 = (lane & 7) + 8 * ((lane >> 3) & 1), hi16 = lane >> 4;  // ldmatrix rows, second chunk
    const u32 pld = pt + r16 * (T * 2), vld = vt + r16 * (DC * 2), zld = zt + (r16 + 16 * hi16) * 16;
    const int sw16 = r16 & 7;

    float o[NB][4], za[2][4];  // PV: rows (heads) g, g + 8; the warp's positions 128 w + 8 n + 2 q (+ 1)
#pragma unroll
    for (int n = 0; n < NB; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    za[0][0] = za[0][1] = za[0][2] = za[0][3] = za[1][0] = za[1][1] = za[1][2] = za[1][3] = 0.0f;
    float mref[4] = {-QMLA_INF, -QMLA_INF, -QMLA_INF, -QMLA_INF};  // heads 2q, 2q + 1, 8 + 2q, 9 + 2q
    float mrow[2] = {-QMLA_INF, -QMLA_INF};                          // heads g, g + 8 (PV's rows)
    float mlane = -QMLA_INF;                                         // head lane % 16 (the move test)
    float l[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    V8Token xa[2], xb[2];  // tokens g, g + 8 of this tile and of the worker's next (two sets, used in turn)
    if (wk < ntiles) {
        v8_load(xa[0], cc, rc, csc, cze, rsc, rze, base + T * wk + 16 * w + g, q);
        v8_load(xa[1], cc, rc, csc, cze, rsc, rze, base + T * wk + 16 * w + 8 + g, q);
    }
    // the reference maxima of heads 2q (+1) (+8), g and g + 8, lane % 16 from the 4 warps' tile maxima
    auto read_maxima = [&](float (&m4)[4], float (&m2)[2], float& m1) {
#pragma unroll
        for (int i = 0; i < 4; ++i) m4[i] = v8_max4(((const float4*)mx)[2 * q + (i & 1) + 8 * (i >> 1)]);
        m2[0] = v8_max4(((const float4*)mx)[g]);
        m2[1] = v8_max4(((const float4*)mx)[g + 8]);
        m1 = v8_max4(((const float4*)mx)[lane & 15]);
    };
    auto tile = [&](int it, const V8Token (&cur)[2], V8Token (&next)[2], auto first) {
        const V8Token &c0 = cur[0], &c1 = cur[1];
        if (it + WORKERS < ntiles) {
            const long long t = base + (long long)T * (it + WORKERS) + 16 * w + g;
            v8_load(next[0], cc, rc, csc, cze, rsc, rze, t, q);
            v8_load(next[1], cc, rc, csc, cze, rsc, rze, t + 8, q);
        }
        // ---- scores: S[token g, g + 8][head 2q (+1) + 8 nb], started at -W Q (zero points and the 128)
        float s[2][4];
#pragma unroll
        for (int nb = 0; nb < 2; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
        {
            u32 wh[4], wl[4];  // A of W: rows g, g + 8; slots 2q, 2q + 1 (groups) and 2q + 8, 2q + 9 (group 8 at q 0)
            v8_split(v8_w(c0, 2 * q), v8_w(c0, 2 * q + 1), wh[0], wl[0]);
            v8_split(v8_w(c1, 2 * q), v8_w(c1, 2 * q + 1), wh[1], wl[1]);
            v8_split(q == 0 ? v8_w(c0, 8) : 0.0f, 0.0f, wh[2], wl[2]);
            v8_split(q == 0 ? v8_w(c1, 8) : 0.0f, 0.0f, wh[3], wl[3]);
            // W (16 significant bits) is exact as wh + wl; the sums, in three bf16 parts, to float32's 24 bits
#pragma unroll
            for (int part = 0; part < 3; ++part) {
                const uint4 qz = qb[(36 + part) * 32 + lane];
                mma_bf16(s[0], wh, qz.x, qz.y);
                mma_bf16(s[1], wh, qz.z, qz.w);
                mma_bf16(s[0], wl, qz.x, qz.y);
                mma_bf16(s[1], wl, qz.z, qz.w);
            }
        }
        // ---- QK a group at a time, and the key tile's stores (content only: PV's operand)
#pragma unroll
        for (int gp = 0; gp < 4; ++gp) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                float acc[2][4] = {};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    // A: rows (tokens) g, g + 8; P0/P2 at k-slots 2q, 2q + 1, P1/P3 at 2q + 8, 2q + 9
                    const u32 x0 = v8_word(c0.c[gp], e), x1 = v8_word(c1.c[gp], e);
                    const u32 a[4] = {half ? v8_pair<4>(x0) : v8_pair<0>(x0), half ? v8_pair<4>(x1) : v8_pair<0>(x1),
                                      half ? v8_pair<12>(x0) : v8_pair<8>(x0),
                                      half ? v8_pair<12>(x1) : v8_pair<8>(x1)};
                    const uint4 b = qb[(8 * gp + 4 * half + e) * 32 + lane];
                    mma_bf16(acc[0], a, b.x, b.y);
                    mma_bf16(acc[1], a, b.z, b.w);
                    stsm_x4(vst + (u32)((32 * half + 8 * gp) * 16) + vsw[e], a[0], a[1], a[2], a[3]);
                }
                const int grp = gp + 4 * half;
                const float sa = v8_scale(c0.cs, grp), sb = v8_scale(c1.cs, grp);
                v8_add_group(s, acc, sa, sb);
            }
        }
        {  // the RoPE group: 4 k-steps (low nibbles of words 0, 1, then high)
            float acc[2][4] = {};
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int half = k >> 1, e = k & 1;
                const u32 x0 = e ? c0.r.y : c0.r.x, x1 = e ? c1.r.y : c1.r.x;
                const u32 a[4] = {half ? v8_pair<4>(x0) : v8_pair<0>(x0), half ? v8_pair<4>(x1) : v8_pair<0>(x1),
                                  half ? v8_pair<12>(x0) : v8_pair<8>(x0), half ? v8_pair<12>(x1) : v8_pair<8>(x1)};
                const uint4 b = qb[(32 + k) * 32 + lane];
                mma_bf16(acc[0], a, b.x, b.y);
                mma_bf16(acc[1], a, b.z, b.w);
            }
            const float sa = __uint_as_float(c0.rs << 16), sb = __uint_as_float(c1.rs << 16);
            v8_add_group(s, acc, sa, sb);
        }
        // ---- the tokens' 128 + z rows (PV's zero points), by lane q 0 of each token
        if (q == 0) {
            const u32 k43 = 0x43434343u, zrow = zt + (16 * w + g) * 16;
            v8_sts128(zrow, __byte_perm(c0.cz.x, k43, 0x5140), __byte_perm(c0.cz.x, k43, 0x7362),
                      __byte_perm(c0.cz.y, k43, 0x5140), __byte_perm(c0.cz.y, k43, 0x7362));
            v8_sts128(zrow + 8 * 16, __byte_perm(c1.cz.x, k43, 0x5140), __byte_perm(c1.cz.x, k43, 0x7362),
                      __byte_perm(c1.cz.y, k43, 0x5140), __byte_perm(c1.cz.y, k43, 0x7362));
        }
        // ---- softmax over the warp's 16 tokens; the tile's per-head maxima go to shared memory
        float tm[4];  // heads 2q, 2q + 1, 8 + 2q, 9 + 2q
#pragma unroll
        for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                s[nb][e] *= scale_log2;
                s[nb][2 + e] *= scale_log2;
                tm[2 * nb + e] = fmaxf(s[nb][e], s[nb][2 + e]);
            }
        }
#pragma unroll
        for (int d = 4; d < 32; d <<= 1) {
#pragma unroll
            for (int i = 0; i < 4; ++i) tm[i] = fmaxf(tm[i], __shfl_xor_sync(0xffffffffu, tm[i], d));
        }
        if (g == 0) {
#pragma unroll
            for (int i = 0; i < 4; ++i) mx[4 * (2 * q + (i & 1) + 8 * (i >> 1)) + w] = tm[i];
        }
        if constexpr (decltype(first)::value) {  // a worker's first tile: its maxima set the reference first
            asm volatile("bar.sync %0, 128;" ::"r"(bar_ready) : "memory");
            read_maxima(mref, mrow, mlane);
            asm volatile("bar.sync %0, 128;" ::"r"(bar_read) : "memory");  // the exchange below reads them again
        }
        // p = 2^(x - mref) of tokens g, g + 8 as bf16 pairs; P'_grp = p s_grp stored transposed: [grp][head][token]
        u32 pp[4];  // (token g | g + 8) x (heads 2q, 2q + 1 | 8 + 2q, 9 + 2q): stmatrix's 4 matrices
#pragma unroll
        for (int nb = 0; nb < 2; ++nb) {
            const float e0 = v8_exp2(s[nb][0] - mref[2 * nb]), e1 = v8_exp2(s[nb][1] - mref[2 * nb + 1]);
            const float e2 = v8_exp2(s[nb][2] - mref[2 * nb]), e3 = v8_exp2(s[nb][3] - mref[2 * nb + 1]);
            l[2 * nb] += e0 + e2;
            l[2 * nb + 1] += e1 + e3;
            pp[2 * nb] = pack_bf16x2(e0, e1);
            pp[2 * nb + 1] = pack_bf16x2(e2, e3);
        }
#pragma unroll
        for (int grp = 0; grp < NGC; ++grp) {
            const u32 sa = v8_scale2(c0.cs, grp), sb = v8_scale2(c1.cs, grp);
            stsm_x4_t(pst + grp * (H * T * 2), v8_mul_bf16x2(pp[0], sa), v8_mul_bf16x2(pp[1], sb),
                      v8_mul_bf16x2(pp[2], sa), v8_mul_bf16x2(pp[3], sb));
        }
        asm volatile("bar.sync %0, 128;" ::"r"(bar_ready) : "memory");
        // ---- does the reference maximum move (for the next tile)? one head a lane, the same answer in every warp
        const float mnew = v8_max4(((const float4*)mx)[lane & 15]);
        const bool move = __any_sync(0xffffffffu, mnew > mlane + SLACK);
        float nm[4], nrow[2], n1;
        if (move) read_maxima(nm, nrow, n1);
        // ---- PV over the warp's 128 positions: groups 2 w, 2 w + 1
#if V8_SKIP != 1
        u32 zb[2];  // the 128 + z fragments of the odd k-steps, loaded with the even ones
#pragma unroll
        for (int kk = 0; kk < T / 16; ++kk) {
            u32 a[2][4];
            const u32 achunk = (u32)(((2 * kk + hi16) ^ sw16) * 16);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                ldsm_x4(pld + (2 * w + j) * (H * T * 2) + achunk, a[j][0], a[j][1], a[j][2], a[j][3]);
            }
            const u32 vrowk = vld + 16 * kk * (DC * 2);
#pragma unroll
            for (int n = 0; n < NB; n += 2) {
                u32 b0, b1, b2, b3;
                // chunk 16 w + n + hi16 = (16 w + 8 (n / 8)) + ((n % 8 + hi16) ^ sw16) after the swizzle
                ldsm_x4_t(vrowk + (u32)((16 * w + 8 * (n / 8) + (((n % 8) + hi16) ^ sw16)) * 16), b0, b1, b2, b3);
                mma_bf16(o[n], a[n / 8], b0, b1);
                mma_bf16(o[n + 1], a[n / 8], b2, b3);
            }
            if ((kk & 1) == 0) {
                u32 z0, z1;  // 128 + z of tokens 16 kk .. 16 kk + 31, all 8 groups as columns
                ldsm_x4_t(zld + 16 * kk * 16, z0, z1, zb[0], zb[1]);
                mma_bf16(za[0], a[0], z0, z1);
                mma_bf16(za[1], a[1], z0, z1);
            } else {
                mma_bf16(za[0], a[0], zb[0], zb[1]);
                mma_bf16(za[1], a[1], zb[0], zb[1]);
            }
        }
#endif
        asm volatile("bar.sync %0, 128;" ::"r"(bar_read) : "memory");
        if (move) {  // what is summed so far is rescaled to the moved maximum
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float m = fmaxf(mref[i], nm[i]);
                l[i] *= v8_exp2(mref[i] - m);
                mref[i] = m;
            }
            const float m0 = fmaxf(mrow[0], nrow[0]), m1 = fmaxf(mrow[1], nrow[1]);
            const float a0 = v8_exp2(mrow[0] - m0), a1 = v8_exp2(mrow[1] - m1);
            mrow[0] = m0;
            mrow[1] = m1;
            mlane = fmaxf(mlane, n1);
            qmla_rescale_rows<false>(o, a0, a1);
            qmla_rescale_rows<false>(za, a0, a1);
        }
    };
    if (wk < ntiles) tile(wk, xa, xb, V8Flag<true>{});
    for (int it = wk + WORKERS; it < ntiles; it += 2 * WORKERS) {
        tile(it, xb, xa, V8Flag<false>{});
        if (it + WORKERS < ntiles) tile(it + WORKERS, xa, xb, V8Flag<false>{});
    }
    // ---- the row sums over the worker's 4 warps, then the outputs
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int d = 4; d < 32; d <<= 1) l[i] += __shfl_xor_sync(0xffffffffu, l[i], d);
    }
    const long long slot = (long long)blockIdx.x * WORKERS + wk;
    if (wk < ntiles) {
        if (g == 0) {
#pragma unroll
            for (int i = 0; i < 4; ++i) mx[4 * (2 * q + (i & 1) + 8 * (i >> 1)) + w] = l[i];
        }
        asm volatile("bar.sync %0, 128;" ::"r"(bar_ready) : "memory");
        if (w == 0 && q == 0) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float4 v = ((const float4*)mx)[g + 8 * r];
                ml[(slot * H + g + 8 * r) * 2] = mrow[r];
                ml[(slot * H + g + 8 * r) * 2 + 1] = v.x + v.y + v.z + v.w;
            }
        }
    }
    // O - zacc: the zero-point sums of group 2 w + j sit in column 2 w + j of za[j], held by lane q = w
    float zr[2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int src = (lane & ~3) | w;
        zr[j][0] = __shfl_sync(0xffffffffu, za[j][j], src);
        zr[j][1] = __shfl_sync(0xffffffffu, za[j][2 + j], src);
    }
    float* op = out + slot * H * DC;
#pragma unroll
    for (int n = 0; n < NB; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int ch = v8_channel(16 * w + n, 2 * q + e);
            op[g * DC + ch] = o[n][e] - zr[n / 8][0];
            op[(g + 8) * DC + ch] = o[n][2 + e] - zr[n / 8][1];
        }
    }
}
