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
// Two workers of 4 warps a CTA take alternate tiles; two named barriers a tile and worker (tile ready, tile read). A
// lane's codes are refilled with its worker's next tile's group pair by group pair as QK uses them (one set of code
// registers: stop 72's two sets spilled), the scales and zero points a tile ahead.
// The reference maximum (log2 units) is exchanged on a worker's first tile and then moves lazily, as kernel v5's:
// p may exceed 1 by up to 2^SLACK, so a score that passes the maximum by more than ~120 would overflow (a probe's
// limit, not checked).
#define QMLA_DC 512  // common.cuh wants a layout; the probe's is fixed in v8_parts.cuh
#include "common.cuh"
#include "wgmma.cuh"
#include "v8_parts.cuh"

#define WORKERS 2
// Stage-skip builds (timing only: their outputs are wrong): 1 skips PV (its ldmatrix and mma.sync); 2 reads no query
// fragment from shared memory in the tile loop (every k-step's MMAs take one fragment held in registers), which
// measures what those reads (624 of ~1,970 wavefronts a tile) cost.
#ifndef V8_SKIP
#define V8_SKIP 0
#endif

// shared memory (bytes): the queries' B fragments (QK's, then the zero-point MMAs'), then per worker its key tile,
// P' tiles, 128 + z rows and tile maxima
#define QB_BYTES ((36 + 3) * 32 * 16)
#define MX_BYTES (H * 4 * 4)         // [head][warp] float tile maxima (then row sums)
#define WK_BYTES (VT_BYTES + PT_BYTES + ZT_BYTES + MX_BYTES)
#define SMEM_BYTES (QB_BYTES + WORKERS * WK_BYTES)

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
    const V8Addr ad = v8_addresses(vt, pt, zt, w, lane);
#if V8_SKIP == 2
    const uint4 qreg = qb[lane];
#endif

    float o[NB][4], za[2][4];  // PV: rows (heads) g, g + 8; the warp's positions 128 w + 8 n + 2 q (+ 1)
#pragma unroll
    for (int n = 0; n < NB; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    za[0][0] = za[0][1] = za[0][2] = za[0][3] = za[1][0] = za[1][1] = za[1][2] = za[1][3] = 0.0f;
    float mref[4] = {-QMLA_INF, -QMLA_INF, -QMLA_INF, -QMLA_INF};  // heads 2q, 2q + 1, 8 + 2q, 9 + 2q
    float mrow[2] = {-QMLA_INF, -QMLA_INF};                          // heads g, g + 8 (PV's rows)
    float mlane = -QMLA_INF;                                         // head lane % 16 (the move test)
    float l[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    // tokens g, g + 8 of this tile: the codes are refilled with the worker's next tile's as they are used (v9's
    // rolling prefetch), its scales and zero points at the tile's start into nx, swapped in once P' is stored
    V8Token x[2];
    V8Scales nx[2];
    if (wk < ntiles) {
        v8_load(x[0], cc, rc, csc, cze, rsc, rze, base + T * wk + 16 * w + g, q);
        v8_load(x[1], cc, rc, csc, cze, rsc, rze, base + T * wk + 16 * w + 8 + g, q);
    }
    auto tile = [&](int it, auto first) {
        const bool more = it + WORKERS < ntiles;
        const long long tn = base + (long long)T * (it + WORKERS) + 16 * w + g;  // the next tile's tokens
        if (more) {
#pragma unroll
            for (int t = 0; t < 2; ++t) v8_load_scales(nx[t], csc, cze, rsc, rze, tn + 8 * t);
        }
        float s[2][4];
        auto refill = [&](int step) {
            if (!more) return;
#pragma unroll
            for (int t = 0; t < 2; ++t) v8_load_codes(x[t], cc, rc, tn + 8 * t, step, q);
        };
#if V8_SKIP == 2
        v8_scores(s, x[0], x[1], q, ad, [&](int) { return qreg; }, refill);
#else
        v8_scores(s, x[0], x[1], q, ad, [&](int ks) { return qb[ks * 32 + lane]; }, refill);
#endif
        v8_store_zero_rows(zt, x[0], x[1], w, g, q);
        v8_tile_maxima(s, scale_log2, mx, w, g, q);  // the softmax's maxima over the warp's 16 tokens
        if constexpr (decltype(first)::value) {  // a worker's first tile: its maxima set the reference first
            asm volatile("bar.sync %0, 128;" ::"r"(bar_ready) : "memory");
            v8_read_maxima(mx, lane, mref, mrow, mlane);
            asm volatile("bar.sync %0, 128;" ::"r"(bar_read) : "memory");  // the exchange below reads them again
        }
        v8_store_weights(s, mref, l, x[0], x[1], ad.pst);
        if (more) {
#pragma unroll
            for (int t = 0; t < 2; ++t) v8_set_scales(x[t], nx[t]);
        }
        asm volatile("bar.sync %0, 128;" ::"r"(bar_ready) : "memory");
        // ---- does the reference maximum move (for the next tile)? one head a lane, the same answer in every warp
        const float mnew = v8_max4(((const float4*)mx)[lane & 15]);
        const bool move = __any_sync(0xffffffffu, mnew > mlane + SLACK);
        float nm[4], nrow[2], n1;
        if (move) v8_read_maxima(mx, lane, nm, nrow, n1);
#if V8_SKIP != 1
        v8_pv(o, za, ad, w);
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
    if (wk < ntiles) tile(wk, V8Flag<true>{});
    for (int it = wk + WORKERS; it < ntiles; it += WORKERS) tile(it, V8Flag<false>{});
    // ---- the row sums over the worker's 4 warps, then the outputs
    const long long slot = (long long)blockIdx.x * WORKERS + wk;
    if (wk < ntiles) {
        v8_write_row_sums(l, mx, w, g, q);
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
    v8_store_out(out + slot * H * DC, o, za, w, lane);
}
