// The v8 probe with warp roles (benchmarks/v9_probe.py; stop 72 of benchmarks/RESULTS.md), so that the queries' QK
// fragments live in registers instead of being read from shared memory by every warp (624 of the v8 probe's ~1,970
// shared-memory wavefronts a tile). Same synthetic layout, arithmetic and checks as v8_probe.cu (v8_parts.cuh):
//   * warps 0-3, the scorers: each holds the first V9_QREGS content k-steps' B fragments (4 registers a k-step and
//     lane; the others come from shared memory) and, for 16 tokens of a 64-token tile, converts the codes, runs QK,
//     stores the key tile, the 128 + z rows and P' into one of two buffers, and moves the reference maximum
//     (exchanged among the 4 scorers a tile). The next tile's codes are
//     loaded group pair by group pair as this tile's are used (one set of registers), its scales and zero points
//     at the tile's start (a second, small set);
//   * warps 4-7, the summers: PV of a whole tile over 128 channels each, from the buffer the scorers filled, after
//     rescaling what they hold by the factor the scorers left with it (1 unless the maximum moved).
// One CTA an SM runs its tokens' tiles in order; barriers (bar.arrive by one role, bar.sync by the other, 256
// threads): 1 + b, buffer b full; 3 + b, buffer b read; 5, the scorers' exchange (128 threads).
#define QMLA_DC 512  // common.cuh wants a layout; the probe's is fixed in v8_parts.cuh
#include "common.cuh"
#include "wgmma.cuh"
#include "v8_parts.cuh"

// Stage-skip builds (timing only: their outputs are wrong): 1 skips PV (the summers only wait and release).
#ifndef V9_SKIP
#define V9_SKIP 0
#endif

// shared memory (bytes): the zero-point sums' fragments, two tile buffers (key tile, P', 128 + z rows, the summers'
// factors), the scorers' tile maxima by tile parity
// the scorers hold content k-steps 0 .. V9_QREGS - 1 in registers (4 a k-step and lane)
#ifndef V9_QREGS
#define V9_QREGS 26  // v9_probe.py's QREGS says why
#endif
#define QZ_BYTES ((39 - V9_QREGS) * 32 * 16)  // the other k-steps' fragments and the zero-point sums'
#define AL_BYTES (H * 4)
#define BUF_BYTES (VT_BYTES + PT_BYTES + ZT_BYTES + AL_BYTES)
#define MX_BYTES (2 * H * 4 * 4)  // [tile parity][head][warp]
#define SMEM_BYTES (QZ_BYTES + 2 * BUF_BYTES + MX_BYTES)

__device__ __forceinline__ void v9_arrive(int id) { asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void v9_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}

// grid (CTAs), block 256, dynamic shared memory SMEM_BYTES. CTA c owns tokens [c tpc, (c + 1) tpc), tpc a multiple
// of 64. qb [39][32] uint4 as v8_probe's; out [CTAs][1][16][512] float32 unnormalized, ml [CTAs][1][16][2]
// (reference maximum in log2 units of the scaled scores, row sum)
extern "C" __global__ void __launch_bounds__(256, 1)
    v9_probe(const u8* __restrict__ cc, const u8* __restrict__ rc, const u16* __restrict__ csc,
             const u8* __restrict__ cze, const u16* __restrict__ rsc, const u8* __restrict__ rze,
             const uint4* __restrict__ qb_g, float* __restrict__ out, float* __restrict__ ml, int tpc,
             float scale_log2) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int role = threadIdx.x / 128, w = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane >> 2,
              q = lane & 3;
    const uint4* qz = (const uint4*)smem;
    for (int i = threadIdx.x; i < (39 - V9_QREGS) * 32; i += blockDim.x) ((uint4*)smem)[i] = qb_g[V9_QREGS * 32 + i];
    __syncthreads();
    const long long base = (long long)blockIdx.x * tpc;
    const int ntiles = tpc / T;
    auto buffer = [&](int b) { return smem + QZ_BYTES + b * BUF_BYTES; };
    auto factors = [&](int b) { return (float*)(buffer(b) + VT_BYTES + PT_BYTES + ZT_BYTES); };
    auto addresses = [&](int b) {
        const u32 vt = smem_addr(buffer(b));
        return v8_addresses(vt, vt + VT_BYTES, vt + VT_BYTES + PT_BYTES, w, lane);
    };
    if (role == 0) {
        // ---------------------------------------------------------------- the scorers
        u32 qf[V9_QREGS][4];  // the first content k-steps' fragments (the rest come from shared memory)
#pragma unroll
        for (int ks = 0; ks < V9_QREGS; ++ks) {
            const uint4 v = qb_g[ks * 32 + lane];
            qf[ks][0] = v.x;
            qf[ks][1] = v.y;
            qf[ks][2] = v.z;
            qf[ks][3] = v.w;
        }
        float* mxs = (float*)(smem + QZ_BYTES + 2 * BUF_BYTES);
        float mref[4] = {-QMLA_INF, -QMLA_INF, -QMLA_INF, -QMLA_INF};  // heads 2q, 2q + 1, 8 + 2q, 9 + 2q
        float mrow[2] = {-QMLA_INF, -QMLA_INF};                          // heads g, g + 8 (for ml)
        float mlane = -QMLA_INF, alpha = 1.0f;                           // head lane % 16: the move test, factor
        float l[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        V8Token x[2];  // tokens 16 w + g, + 8: this tile's codes, refilled with the next tile's as they are used
        V8Scales nx[2];
        v8_load(x[0], cc, rc, csc, cze, rsc, rze, base + 16 * w + g, q);
        v8_load(x[1], cc, rc, csc, cze, rsc, rze, base + 16 * w + 8 + g, q);
        for (int it = 0; it < ntiles; ++it) {
            const int b = it & 1;
            const bool more = it + 1 < ntiles;
            const long long tn = base + (long long)T * (it + 1) + 16 * w + g;  // the next tile's tokens
            if (more) {
#pragma unroll
                for (int t = 0; t < 2; ++t) v8_load_scales(nx[t], csc, cze, rsc, rze, tn + 8 * t);
            }
            if (it >= 2) v9_sync(3 + b, 256);  // the summers have read this buffer's tile it - 2
            const V8Addr ad = addresses(b);
            const u32 zt = smem_addr(buffer(b)) + VT_BYTES + PT_BYTES;
            float s[2][4];
            v8_scores(
                s, x[0], x[1], q, ad,
                [&](int ks) {
                    return ks < V9_QREGS ? make_uint4(qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3])
                                         : qz[(ks - V9_QREGS) * 32 + lane];
                },
                [&](int step) {
                    if (!more) return;
#pragma unroll
                    for (int t = 0; t < 2; ++t) v8_load_codes(x[t], cc, rc, tn + 8 * t, step, q);
                });
            v8_store_zero_rows(zt, x[0], x[1], w, g, q);
            float* mx = mxs + b * H * 4;
            v8_tile_maxima(s, scale_log2, mx, w, g, q);  // the softmax's maxima over the warp's 16 tokens
            if (it == 0) {  // the first tile's maxima set the reference before any p is made
                v9_sync(5, 128);
                v8_read_maxima(mx, lane, mref, mrow, mlane);
            }
            v8_store_weights(s, mref, l, x[0], x[1], ad.pst);
            if (w == 0 && lane < 16) factors(b)[lane] = alpha;  // the summers rescale by it before this tile
            if (more) {  // this tile's scales are spent: the next tile's take their place
#pragma unroll
                for (int t = 0; t < 2; ++t) v8_set_scales(x[t], nx[t]);
            }
            v9_arrive(1 + b);
            // does the reference maximum move (for the next tile)? one head a lane, the same answer in every warp
            v9_sync(5, 128);
            const bool move = __any_sync(0xffffffffu, v8_max4(((const float4*)mx)[lane & 15]) > mlane + SLACK);
            alpha = 1.0f;
            if (move) {
                float nm[4], nrow[2], n1;
                v8_read_maxima(mx, lane, nm, nrow, n1);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float m = fmaxf(mref[i], nm[i]);
                    l[i] *= v8_exp2(mref[i] - m);
                    mref[i] = m;
                }
                mrow[0] = fmaxf(mrow[0], nrow[0]);
                mrow[1] = fmaxf(mrow[1], nrow[1]);
                const float m1 = fmaxf(mlane, n1);
                alpha = v8_exp2(mlane - m1);
                mlane = m1;
            }
        }
        // the row sums over the 4 scorers (in the maxima of the parity no scorer still reads), then ml
        float* ls = mxs + (ntiles & 1) * H * 4;
        v8_write_row_sums(l, ls, w, g, q);
        v9_sync(5, 128);
        if (w == 0 && q == 0) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float4 v = ((const float4*)ls)[g + 8 * r];
                ml[((long long)blockIdx.x * H + g + 8 * r) * 2] = mrow[r];
                ml[((long long)blockIdx.x * H + g + 8 * r) * 2 + 1] = v.x + v.y + v.z + v.w;
            }
        }
    } else {
        // ---------------------------------------------------------------- the summers
        float o[NB][4], za[2][4];  // rows (heads) g, g + 8; positions 128 w + 8 n + 2 q (+ 1)
#pragma unroll
        for (int n = 0; n < NB; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
        za[0][0] = za[0][1] = za[0][2] = za[0][3] = za[1][0] = za[1][1] = za[1][2] = za[1][3] = 0.0f;
        for (int it = 0; it < ntiles; ++it) {
            const int b = it & 1;
            v9_sync(1 + b, 256);  // the scorers have filled buffer b with tile it
            const float* al = factors(b);
            const float a0 = al[g], a1 = al[g + 8];
            qmla_rescale_rows<true>(o, a0, a1);
            qmla_rescale_rows<true>(za, a0, a1);
#if V9_SKIP != 1
            v8_pv(o, za, addresses(b), w);
#endif
            if (it + 2 < ntiles) v9_arrive(3 + b);
        }
        v8_store_out(out + (long long)blockIdx.x * H * DC, o, za, w, lane);
    }
}
