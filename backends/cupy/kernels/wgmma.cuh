// QuantMLA CuPy backend: Hopper warpgroup MMA (wgmma) helpers, sm_90a only.
//
// Operands come from shared memory through 64-bit matrix descriptors (PTX ISA, "Matrix Descriptor
// Format"). Every tile here uses the 128-byte swizzle: a tile is stored as column blocks of 64
// bf16 channels; within a block, row r holds its 64 values in 128 bytes, and the 16-byte chunk j of
// row r sits at chunk position j ^ (r % 8). Blocks and tiles start 1024-byte aligned, so the
// swizzle, which the hardware applies to address bits [4:6] ^ [7:9], is the one written here.
//   K-major operand (rows = M or N, 16-channel k-steps inside the 128-byte rows): SBO = 1024 bytes
//   between 8-row groups; a k-step advances the start address by 32 bytes inside the row.
//   MN-major operand (the same storage read with rows as K): LBO = bytes between 64-wide column
//   blocks along N, SBO = 1024 bytes between 8-row groups along K.
// Included after common.cuh (u32); nothing about the page layout is typed here.
#pragma once

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "wgmma.cuh needs sm_90a (the launcher compiles these builds with -arch=sm_90a)"
#endif

typedef unsigned long long u64;

// byte offset of 16-byte chunk `chunk` (8 bf16 channels) of row `row` in a 128-byte-swizzled tile
// of `rows` rows
__device__ __forceinline__ int sw128_chunk(int row, int chunk, int rows) {
    return (chunk >> 3) * rows * 128 + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

// descriptor of a 128-byte-swizzled operand at shared address `addr` (LBO, SBO in bytes)
__device__ __forceinline__ u64 sw128_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (1ull << 62);
}

// descriptor d with its start address advanced by `bytes` (a multiple of 16): a 32-bit add to the low
// word (the address field, bits 0-13, never carries: shared tiles lie below 256 KB)
__device__ __forceinline__ u64 desc_advance(u64 d, u32 bytes) {
    return (d & 0xFFFFFFFF00000000ull) | (u32)((u32)d + (bytes >> 4));
}

// the same advance as one 64-bit add (equal, as the low word never carries): ptxas makes it one UIADD3.64, where
// desc_advance takes a UIADD3 and a UMOV of the high word before each wgmma. Which form runs faster depends on the
// rest of the kernel's schedule, not the count: only v5's 2-bit builds take it (QMLA_V5_DESC64 says what was measured;
// v6's C2R4 ran 1.5 % slower with it, H200 stop 37)
__device__ __forceinline__ u64 desc_advance64(u64 d, u32 bytes) { return d + (bytes >> 4); }

// descriptor d, hidden from ptxas's algebra: built from it inside a loop, the descriptors stay in uniform registers
// and advance by one uniform add each, where ptxas would otherwise hoist them into registers (or, with the fields
// visible, split each advance into an add and an or)
__device__ __forceinline__ u64 desc_opaque(u64 d) {
    asm("mov.b64 %0, %0;" : "+l"(d));
    return d;
}

// orders this thread's earlier register and shared-memory accesses before the next wgmma
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// shared-memory writes of the generic proxy (st.shared, cp.async) made visible to wgmma's reads
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// keeps the compiler from moving accumulator accesses across the asynchronous MMA
template <int N>
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
    }
}

// the same for A fragments in registers (wgmma ..._rs): the compiler must not reuse them while an
// asynchronous MMA may still read them
template <int N>
__device__ __forceinline__ void wgmma_fence_operand(u32 (&a)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
    }
}

// flat accumulator variant of wgmma_fence_operand (the m64n16 tiles: 8 floats per thread)
template <int N>
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D[64 x 16] (+)= A[64 x 16] B[16 x 16], both from shared memory; TNSP_A / TNSP_B 1: that operand is
// MN-major. Thread t holds d[4 i + 2 h + e] = D[16 (t / 32) + (t % 32) / 4 + 8 h][8 i + 2 (t % 4) + e].
template <int TNSP_A, int TNSP_B>
__device__ __forceinline__ void wgmma_m64n16k16_ss(float (&d)[8], u64 da, u64 db, int scale_d) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, "
        "%11, %12; }\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db), "r"(scale_d), "n"(TNSP_A), "n"(TNSP_B));
}

// the same with A from registers: a[0..3] = A[16 (t / 32) + (t % 32) / 4 (+ 8)][2 (t % 4) (+ 1)] and the same
// rows at columns + 8, mma.sync's A fragment of the warp's 16 rows (rows + 8 in a[1], a[3]; columns + 8 in
// a[2], a[3]). The registers must stay unchanged until the MMA has retired (wgmma_wait).
__device__ __forceinline__ void wgmma_m64n16k16_rs(float (&d)[8], const u32 (&a)[4], u64 db, int scale_d) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, "
        "%12, p, 1, 1, 0; }\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

// four 8x8 bf16 matrices of mma fragments stored as they are (stmatrix): lane l holds row l / 4, columns
// 2 (l % 4) (+ 1) of matrix i in r_i and gives the address of row l % 8 of matrix l / 8 (16 contiguous bytes)
__device__ __forceinline__ void stsm_x4(u32 row_addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(row_addr), "r"(r0), "r"(r1),
                 "r"(r2), "r"(r3)
                 : "memory");
}

// four 8x8 bf16 matrices of mma fragments stored transposed (stmatrix.trans): lane l holds row l / 4,
// columns 2 (l % 4) (+ 1) of matrix i in r_i and gives the address of row l % 8 of the transposed
// matrix l / 8 (16 contiguous bytes)
__device__ __forceinline__ void stsm_x4_t(u32 row_addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(row_addr), "r"(r0),
                 "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

// D[64 x N] (+)= A[64 x 16] B[16 x N] with bf16 inputs and float32 accumulation, A and B read from
// shared memory through descriptors. TNSP_B 1: B is MN-major. scale_d 0: D = A B (D's values
// ignored). Thread t of the warpgroup holds rows 16 (t / 32) + (t % 32) / 4 (+ 8) and columns
// 8 i + 2 (t % 4) (+ 1): d[i][2 h + e] = D[16 (t / 32) + (t % 32) / 4 + 8 h][8 i + 2 (t % 4) + e].
template <int TNSP_B>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[8][4], u64 da, u64 db, int scale_d) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, 0, %35; }\n"
        :
          "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
        : "l"(da), "l"(db), "r"(scale_d), "n"(TNSP_B));
}

template <int TNSP_B>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[16][4], u64 da, u64 db, int scale_d) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
        "%59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, 0, %67; }\n"
        :
          "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
          "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
          "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]),
          "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(da), "l"(db), "r"(scale_d), "n"(TNSP_B));
}

template <int TNSP_B>
__device__ __forceinline__ void wgmma_m64n256k16_ss(float (&d)[32][4], u64 da, u64 db, int scale_d) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
        "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
        "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
        "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, "
        "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, "
        "%97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, "
        "%113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, 0, %131; }\n"
        :
          "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
          "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
          "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
          "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
          "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]),
          "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]),
          "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]),
          "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]),
          "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]),
          "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]),
          "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]),
          "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]),
          "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]),
          "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]),
          "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), "+f"(d[28][0]), "+f"(d[28][1]),
          "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]),
          "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]),
          "+f"(d[31][2]), "+f"(d[31][3])
        : "l"(da), "l"(db), "r"(scale_d), "n"(TNSP_B));
}

// O[64 rows][8 NB channels] += P[64][16 KS tokens] V[16 KS tokens][8 NB channels] (NB 16 or 32: m64n128k16 or
// m64n256k16), committed as one group: A = P, K-major (a k-step 32 bytes into its 128-byte rows); B = V read
// MN-major (a k-step 2048 bytes on: 16 rows of 128 bytes). The many-row kernels' PV (attention_v4.cu, _v6.cu).
template <int NB, int KS>
__device__ __forceinline__ void wgmma_pv_rows64(float (&acc)[NB][4], u64 dp, u64 dv) {
    static_assert(NB == 16 || NB == 32, "128 or 256 channels");
    wgmma_fence_operand(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        const u64 da = desc_advance(dp, 32 * kk), db = desc_advance(dv, 2048 * kk);
        if constexpr (NB == 32) {
            wgmma_m64n256k16_ss<1>(acc, da, db, 1);
        } else {
            wgmma_m64n128k16_ss<1>(acc, da, db, 1);
        }
    }
    wgmma_commit();
}
