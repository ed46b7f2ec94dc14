// Hopper wgmma throughput with both operands in shared memory, alone and in v6's mix (benchmarks/wgmma_rates.py).
//
// One CTA per SM; each warpgroup times its own loop with clock64 (its first thread writes cycles per iteration to
// cyc[blockIdx.x * WGS + warpgroup]). Operand values do not matter for throughput: every bf16 is 1/64, and a loop
// re-reads the same 128-byte-swizzled 64-channel k range (the shared-memory traffic is that of a real tile).
//   WR_MODE 0 (QK): WGS warpgroups each issue 36 m64nWR_Nk16 an iteration (v6's QK: 576 channels / 16) and wait.
//   WR_MODE 1 (v6's mix, WGS 2): warpgroup 0 runs QK (36 m64n64k16) then its half of PV (4 m64n256k16, B MN-major),
//     waiting for each; warpgroup 1 repeats the other PV half plus WR_STORES 16-byte st.shared a thread (36: a
//     72 KB dequantized key tile) until warpgroup 0 is done, and writes its iteration count to cyc[gridDim.x * 2 +
//     blockIdx.x].
//   WR_MODE 2 (QK, A from registers): 36 m64n64k16 with A in registers, one warpgroup.
//   WR_MODE 3 (kernel v5's matmuls, WR_N 16): each of WGS warpgroups (v5's workers) runs a tile's QK (36
//     m64n16k16, A from registers), WR_STORES stmatrix.x4 a warp (32: v5's 64 KB key tile), then PV (8 m-blocks x 4
//     k-steps of m64n16k16, A = the key tile MN-major, B = P^T K-major), waiting for each: v5 without its
//     dequantization, softmax and loads.
//   WR_MODE 4 (mma.sync, WR_N 8): every warp of WGS warpgroups issues 136 m16n8k16 an iteration (72 + 64: a 64-token
//     tile's QK and PV for a warp that owns a quarter of the channels at H 16) into 16 accumulators in turn.
//   WR_MODE 5 (mode 4 fed from shared memory): each pair of mma.sync takes its B operands from one ldmatrix.x4.
//   WR_MODE 6 (8-bit mma.sync, WR_N 8): every warp issues 104 m16n8k32 u8 x s8 -> s32 an iteration (72 + 32: the
//     same warp's QK with the queries split in two 8-bit halves as 32 columns, and its PV) into 16 accumulators.
//   WR_MODE 7 (8-bit wgmma, WR_N 16 or 32): each of WGS warpgroups issues 18 m64nWR_Nk32 u8 x s8 -> s32 an iteration
//     (a 64-token tile's QK over 576 channels, A = the codes from registers, B = the queries K-major) and waits.
//   WR_MODE 8 (the matmuls of an 8-bit design at H 16, WR_N 32): each of WGS warpgroups (workers) runs a tile's QK (18
//     m64n32k32, A = the 4-bit codes as u8 from registers, B = the queries split in two s8 halves), WR_STORES
//     stmatrix.x4 a warp (16: a 36 KB u8 key tile), then PV (8 content groups x 2 k-steps of m64n16k32 u8 x u8, A =
//     the tile's channels x tokens K-major, B = the group's probabilities times its scales as u8), waiting for each.
#define QMLA_DC 512  // common.cuh wants a layout; nothing here reads it
#include "common.cuh"
#include "wgmma.cuh"

#ifndef WR_MODE
#define WR_MODE 0
#endif
#ifndef WR_N
#define WR_N 64
#endif
#ifndef WR_WGS
#define WR_WGS 1
#endif
#ifndef WR_STORES
#define WR_STORES 0
#endif
static_assert(WR_N == 64 || WR_N == 128 || WR_N == 256 || (WR_MODE == 3 && WR_N == 16) ||
                  ((WR_MODE == 4 || WR_MODE == 5 || WR_MODE == 6) && WR_N == 8) ||
                  (WR_MODE == 7 && (WR_N == 16 || WR_N == 32)) || (WR_MODE == 8 && WR_N == 32),
              "WR_N: 64, 128 or 256 (mode 3: 16, modes 4 to 6: 8, mode 7: 16 or 32, mode 8: 32)");
static_assert(WR_MODE != 1 || (WR_WGS == 2 && WR_N == 64), "mode 1 is v6's two warpgroups with QK at N = 64");
static_assert(WR_MODE != 2 || (WR_WGS == 1 && WR_N == 64), "mode 2 is one warpgroup at N = 64");
static_assert(WR_MODE != 3 || (WR_N == 16 && WR_WGS <= 4 && WR_STORES <= 32),
              "mode 3: v5's N = 16, one to four workers");
static_assert((WR_MODE != 4 && WR_MODE != 5 && WR_MODE != 6) || (WR_N == 8 && WR_STORES == 0),
              "modes 4 to 6: mma.sync's N = 8, no stores");
static_assert(WR_MODE != 7 || ((WR_N == 16 || WR_N == 32) && WR_WGS <= 2 && WR_STORES == 0),
              "mode 7: N = 16 or 32, one or two warpgroups, no stores");
static_assert(WR_MODE != 8 || (WR_N == 32 && WR_WGS <= 4 && WR_STORES <= 16),
              "mode 8: N = 32, one to four workers, at most 16 stores");
static_assert(WR_MODE >= 0 && WR_MODE <= 8, "WR_MODE: 0 to 8");
#define V5_PV_BLOCKS 8               // mode 3: d_c 512 / 64 rows
#define SYNC_MMAS 136                // mode 4: m16n8k16 a warp and iteration
#define SYNC_MMAS8 104               // mode 6: m16n8k32 a warp and iteration
#define QK_STEPS8 18                 // modes 7, 8: 576 channels in k-steps of 32
#define PV_GROUPS8 8                 // mode 8: content groups of 64 channels (PV's m-blocks)

#define QK_STEPS 36
#define A_OFF 0                      // A (queries / P): 16 KB
#define B_OFF (16 * 1024)            // B (keys / V): 64 KB
#define S_OFF (B_OFF + 64 * 1024)    // the stores' target: 80 KB, its last 16 bytes the stop flag
#define S_CHUNKS (79 * 64)           // 16-byte chunks the stores cycle through (below the flag)
#define FLAG_OFF (S_OFF + 80 * 1024 - 16)
#define SMEM_USED (S_OFF + 80 * 1024)

// D[64 x 64] += A[64 x 16] B[16 x 64], A from registers (wgmma_m64n16k16_rs's A fragment), B K-major
__device__ __forceinline__ void wr_m64n64k16_rs(float (&d)[8][4], const u32 (&a)[4], u64 db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0; }\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// D[16 x 8] += A[16 x 32] B[32 x 8], u8 x s8 -> s32 (mma.sync's integer fragments: 4 and 2 registers of 4 bytes)
__device__ __forceinline__ void wr_mma_u8s8(int (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// D[64 x N] += A[64 x 32] B[32 x N], u8 x s8 -> s32, A from registers (4 of 4 bytes), B K-major from shared memory
template <int N>
__device__ __forceinline__ void wr_wgmma_u8s8(int (&d)[N / 2], const u32 (&a)[4], u64 db) {
    if constexpr (N == 16) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n16k32.s32.u8.s8 {%0, %1, %2, %3, %4, %5, %6, %7}, "
                     "{%8, %9, %10, %11}, %12, 1;\n"
                     : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
    } else {
        asm volatile("wgmma.mma_async.sync.aligned.m64n32k32.s32.u8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, "
                     "%10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, 1;\n"
                     : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]),
                       "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]),
                       "+r"(d[15])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
    }
}

// D[64 x 16] += A[64 x 32] B[32 x 16], u8 x u8 -> s32, both K-major from shared memory
__device__ __forceinline__ void wr_wgmma_u8u8_ss(int (&d)[8], u64 da, u64 db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n16k32.s32.u8.u8 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, 1;\n"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7])
                 : "l"(da), "l"(db));
}

// keeps the compiler from moving integer accumulators across the wgmma fence and wait (wgmma.cuh's float version)
template <int N>
__device__ __forceinline__ void wr_fence_int(int (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

template <int N>
__device__ __forceinline__ void wr_zero(float (&d)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n) d[n][0] = d[n][1] = d[n][2] = d[n][3] = 0.0f;
}
template <int N>
__device__ __forceinline__ float wr_sum(const float (&d)[N][4]) {
    float s = 0.0f;
#pragma unroll
    for (int n = 0; n < N; ++n) s += d[n][0] + d[n][1] + d[n][2] + d[n][3];
    return s;
}

// one QK: 36 k-steps of m64nNk16 from shared memory, committed as one group and waited for
template <int N>
__device__ __forceinline__ void wr_qk(float (&s)[N / 8][4], u64 da, u64 db) {
    wgmma_fence_operand(s);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < QK_STEPS; ++ks) {
        const u64 a = desc_advance(da, 32 * (ks & 3)), b = desc_advance(db, 32 * (ks & 3));
        if constexpr (N == 64) {
            wgmma_m64n64k16_ss<0>(s, a, b, 1);
        } else if constexpr (N == 128) {
            wgmma_m64n128k16_ss<0>(s, a, b, 1);
        } else {
            wgmma_m64n256k16_ss<0>(s, a, b, 1);
        }
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(s);
}

// one half of PV: 4 m64n256k16 (A = P, K-major; B = V, MN-major), waited for
__device__ __forceinline__ void wr_pv(float (&o)[32][4], u64 dp, u64 dv) {
    wgmma_pv_rows64<32, 4>(o, dp, dv);
    wgmma_wait<0>();
    wgmma_fence_operand(o);
}

extern "C" __global__ void __launch_bounds__(WR_WGS * 128, 1) wgmma_rates(float* out, long long* cyc, int iters) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
    for (int i = threadIdx.x; i < SMEM_USED / 16; i += blockDim.x) {
        *(uint4*)(smem + 16 * i) = make_uint4(0x3c803c80u, 0x3c803c80u, 0x3c803c80u, 0x3c803c80u);
    }
    fence_proxy_async();
    __syncthreads();
    if (threadIdx.x == 0) *(int*)(smem + FLAG_OFF) = 0;  // after the fill, which covers it
    __syncthreads();
    const int wg = threadIdx.x / 128;
    const u32 base = smem_addr(smem);
    const u64 da = sw128_desc(base + A_OFF, 16, 1024), db = sw128_desc(base + B_OFF, 16, 1024);
    const u64 dv = sw128_desc(base + B_OFF, 64 * 128, 1024);
    float r = 0.0f;
    const long long t0 = clock64();
#if WR_MODE == 0
    float s[WR_N / 8][4];
    wr_zero(s);
    for (int it = 0; it < iters; ++it) wr_qk<WR_N>(s, da, db);
    r = wr_sum(s);
#elif WR_MODE == 2
    float s[8][4];
    wr_zero(s);
    const u32 a[4] = {0x3c803c80u, 0x3c803c80u, 0x3c803c80u, 0x3c803c80u};
    for (int it = 0; it < iters; ++it) {
        wgmma_fence_operand(s);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < QK_STEPS; ++ks) wr_m64n64k16_rs(s, a, desc_advance(db, 32 * (ks & 3)));
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operand(s);
    }
    r = wr_sum(s);
#elif WR_MODE == 3
    float s[8], o[V5_PV_BLOCKS][8];
    for (int i = 0; i < 8; ++i) s[i] = 0.0f;
    for (int mb = 0; mb < V5_PV_BLOCKS; ++mb) for (int i = 0; i < 8; ++i) o[mb][i] = 0.0f;
    const u32 a[4] = {0x3c803c80u, 0x3c803c80u, 0x3c803c80u, 0x3c803c80u};
    const u32 st = base + S_OFF + (threadIdx.x % 32) * 16;
    for (int it = 0; it < iters; ++it) {
        wgmma_fence_operand(s);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < QK_STEPS; ++ks) wgmma_m64n16k16_rs(s, a, desc_advance(da, 32 * (ks & 3)), 1);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operand(s);
#pragma unroll
        for (int k = 0; k < WR_STORES; ++k) {
            const int chunk = ((threadIdx.x / 32) * WR_STORES + k) % (S_CHUNKS / 32);
            stsm_x4(st + chunk * 512, __float_as_uint(s[0]), __float_as_uint(s[1]), __float_as_uint(s[2]), it);
        }
        fence_proxy_async();
        asm volatile("bar.sync %0, 128;" ::"r"(wg + 1) : "memory");
#pragma unroll
        for (int mb = 0; mb < V5_PV_BLOCKS; ++mb) wgmma_fence_operand(o[mb]);
        wgmma_fence();
#pragma unroll
        for (int mb = 0; mb < V5_PV_BLOCKS; ++mb) {
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                wgmma_m64n16k16_ss<1, 0>(o[mb], desc_advance(dv, mb * 8192 + 2048 * kk), desc_advance(da, 32 * kk), 1);
            }
        }
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int mb = 0; mb < V5_PV_BLOCKS; ++mb) wgmma_fence_operand(o[mb]);
    }
    r = s[0] + s[7];
    for (int mb = 0; mb < V5_PV_BLOCKS; ++mb) r += o[mb][0] + o[mb][7];
#elif WR_MODE == 4 || WR_MODE == 5
    float o[16][4];
    wr_zero(o);
    const u32 a[4] = {0x3c803c80u, 0x3c803c80u, 0x3c803c80u, 0x3c803c80u};
#if WR_MODE == 5
    const u32 rows = base + B_OFF + (threadIdx.x % 32) * 16;
    const u32 warp_off = (threadIdx.x / 32) * 4096;
#endif
    for (int it = 0; it < iters; ++it) {
#if WR_MODE == 4
#pragma unroll
        for (int i = 0; i < SYNC_MMAS; ++i) mma_bf16(o[i % 16], a, 0x3c803c80u, 0x3c803c80u);
#else
        // each pair of mma.sync fed by one ldmatrix.x4 (16-byte rows, 128 contiguous bytes a matrix: no bank
        // conflicts), plain for the first half of a warp's iteration (QK's key rows), transposed for the second (PV)
#pragma unroll
        for (int i = 0; i < SYNC_MMAS; i += 2) {
            u32 b0, b1, b2, b3;
            const u32 addr = rows + ((warp_off + i * 256u) & 0xffffu);
            if (i < SYNC_MMAS / 2) ldsm_x4(addr, b0, b1, b2, b3);
            else ldsm_x4_t(addr, b0, b1, b2, b3);
            mma_bf16(o[i % 16], a, b0, b1);
            mma_bf16(o[(i + 1) % 16], a, b2, b3);
        }
#endif
    }
    r = wr_sum(o);
#elif WR_MODE == 6
    int o[16][4] = {};
    const u32 a[4] = {0x0f0f0f0fu, 0x0f0f0f0fu, 0x0f0f0f0fu, 0x0f0f0f0fu};
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int i = 0; i < SYNC_MMAS8; ++i) wr_mma_u8s8(o[i % 16], a, 0x01010101u, 0x01010101u);
    }
    for (int n = 0; n < 16; ++n) r += (float)(o[n][0] + o[n][1] + o[n][2] + o[n][3]);
#elif WR_MODE == 7
    int s[WR_N / 2] = {};
    const u32 a[4] = {0x0f0f0f0fu, 0x0f0f0f0fu, 0x0f0f0f0fu, 0x0f0f0f0fu};
    for (int it = 0; it < iters; ++it) {
        wr_fence_int(s);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < QK_STEPS8; ++ks) wr_wgmma_u8s8<WR_N>(s, a, desc_advance(db, 32 * (ks & 3)));
        wgmma_commit();
        wgmma_wait<0>();
        wr_fence_int(s);
    }
    for (int i = 0; i < WR_N / 2; ++i) r += (float)s[i];
#elif WR_MODE == 8
    int s[16] = {}, o[PV_GROUPS8][8] = {};
    const u32 a[4] = {0x0f0f0f0fu, 0x0f0f0f0fu, 0x0f0f0f0fu, 0x0f0f0f0fu};
    const u32 st = base + S_OFF + (threadIdx.x % 32) * 16;
    for (int it = 0; it < iters; ++it) {
        wr_fence_int(s);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < QK_STEPS8; ++ks) wr_wgmma_u8s8<32>(s, a, desc_advance(db, 32 * (ks & 3)));
        wgmma_commit();
        wgmma_wait<0>();
        wr_fence_int(s);
#pragma unroll
        for (int k = 0; k < WR_STORES; ++k) {
            const int chunk = ((threadIdx.x / 32) * WR_STORES + k) % (S_CHUNKS / 32);
            stsm_x4(st + chunk * 512, (u32)s[0], (u32)s[1], (u32)s[2], it);
        }
        fence_proxy_async();
        asm volatile("bar.sync %0, 128;" ::"r"(wg + 1) : "memory");
#pragma unroll
        for (int g = 0; g < PV_GROUPS8; ++g) wr_fence_int(o[g]);
        wgmma_fence();
#pragma unroll
        for (int g = 0; g < PV_GROUPS8; ++g) {
#pragma unroll
            for (int kk = 0; kk < 2; ++kk) {
                wr_wgmma_u8u8_ss(o[g], desc_advance(db, g * 8192 + 32 * kk), desc_advance(da, g * 1024 + 32 * kk));
            }
        }
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int g = 0; g < PV_GROUPS8; ++g) wr_fence_int(o[g]);
    }
    r = (float)(s[0] + s[15]);
    for (int g = 0; g < PV_GROUPS8; ++g) r += (float)(o[g][0] + o[g][7]);
#else
    float o[32][4];
    wr_zero(o);
    volatile int* done = (volatile int*)(smem + FLAG_OFF);
    if (wg == 0) {
        float s[8][4];
        wr_zero(s);
        for (int it = 0; it < iters; ++it) {
            wr_qk<64>(s, da, db);
            wr_pv(o, da, dv);
        }
        r = wr_sum(s);
        __syncwarp();
        if (threadIdx.x == 0) *done = 1;
    } else {
        // the flag is read by one thread and shared through a 128-thread barrier, so all four warps of the
        // warpgroup leave together (a wgmma issued by some of its warps only is an illegal instruction)
        volatile int* seen = done + 1;
        int it = 0;
        for (;; ++it) {
            if (threadIdx.x == 128) *seen = *done;
            asm volatile("bar.sync 1, 128;" ::: "memory");
            const int stop = *seen;
            asm volatile("bar.sync 1, 128;" ::: "memory");
            if (stop) break;
            wgmma_pv_rows64<32, 4>(o, da, dv);
#pragma unroll
            for (int k = 0; k < WR_STORES; ++k) {
                const int idx = (k * 128 + (threadIdx.x - 128)) % S_CHUNKS;
                *(uint4*)(smem + S_OFF + 16 * idx) = make_uint4(it, k, idx, 0);
            }
            wgmma_wait<0>();
            wgmma_fence_operand(o);
        }
        if (threadIdx.x == 128) cyc[gridDim.x * WR_WGS + blockIdx.x] = it;
    }
    r += wr_sum(o);
#endif
    const long long t1 = clock64();
    out[blockIdx.x * blockDim.x + threadIdx.x] = r;
    if (threadIdx.x % 128 == 0) cyc[blockIdx.x * WR_WGS + wg] = (t1 - t0) / iters;
}
