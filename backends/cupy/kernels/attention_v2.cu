// QuantMLA CuPy backend: decode attention v2 (register-direct dequantization).
//
// The launcher's default (QUANTMLA_CUPY_ATTENTION=auto, read per call) wherever it serves:
// bfloat16 queries and formats with 2- or 4-bit content codes and 4-bit RoPE codes
// (C4R4, C2R4) at d_c/d_r = 512/64 and 256/32, group sizes 64/128, every page size.
// Everything else (float32 queries, C8R8, C4R8, C2R2, BF16) runs v1 (attention.cu).
// The split-KV partials have v1's layout and are merged by v1's qmla_combine.
//
// ================================================================ design note
// Grid: x = B * ceil(R / (16 * RG)) (R = S_q * H query rows of one request), y = KV splits.
// Block: RG row groups x 4 warps (RG = QMLA_V2_RG, 1 or 2). Warp w: row group rg = w / 4
// (16 query rows, the MMA M dimension), channel quarter wc = w % 4. Tiles of T = 32 tokens
// (QMLA_V2_T = 64 with QUANTMLA_CUPY_V2_TILE=64: the same mappings repeated over 8 n-tiles / 4 k-steps).
//
// Per tile, for the whole block:
//  * cp.async copies the tile's *raw page sections* (content and RoPE codes, scales, zero
//    points: 317 B/token for C4R4) into an NSTAGE-deep ring (QMLA_V2_STAGES, default 4: copies
//    run 3 tiles ahead), 16-byte chunks by page segment; content code rows are XOR-swizzled per
//    token so both fragment read patterns below are bank-conflict free. Page ids are loaded one
//    tile before their copies are issued. A flag byte per token (packed / protected / past L)
//    is stored by the block; scales are selected through it (never multiplied by garbage).
//  * QK (tokens = MMA N, channels = K): lane (g, q) holds token 8j+g and reads LB = CB/16
//    contiguous code bytes of that token with ONE wide load (16 B for C4 d_c=512). The
//    order in which channels enter the K dimension is free (the query fragment is loaded in
//    the same permuted order once per CTA), so k-step (c, e) of warp wc uses channels
//    CBW*wc + LB*q + 4e + {0,1,2,3} + CB*c (c = nibble slice of the split-half packing).
//    A nibble pair becomes a bf16x2 B register with prmt ((code | 0x4300) = 128 + code)
//    and one fma.rn.bf16x2 that adds -(128 + z): exact (code - z). The per-group scale is
//    applied to the fp32 MMA result of each (16-row x 8-token, group) -- never per element.
//    Each warp's partial scores (its quarter of the channels, one RoPE k-step) go to a
//    double-buffered exchange; ONE __syncthreads per tile makes them (and the next tile's
//    staged bytes) visible; every warp of the row group sums the 4 partials in the same order
//    and runs the same online softmax (base 2).
//  * PV (tokens = K, channels = N): lane (g, q) needs tokens 16kt + {2q, 2q+1, 2q+8, 2q+9}
//    for channels CBW*wc + LBP*g + 4w + p + CB*c (LBP = CB/32 bytes: one 8-byte load per
//    token for C4 d_c=512). Each token's codes are unpacked to bf16 pairs (code - z) as in QK,
//    then two tokens are interleaved into one B register with prmt (0x5410 / 0x7632). The
//    per-group scale is folded into the probabilities (A operand = p * s, packed to bf16),
//    so again no per-element scaling. The dequantized values never touch shared memory.
//  * Protected tokens (sink / local ring) are read as bf16 pairs straight from the buffers
//    into the same fragment slots (scale 1). Tiles without protected tokens (all but ~5 per
//    request) run a specialization with no per-lane source branches.
// tests/test_cupy_fragments.py is a NumPy model of exactly these mappings (and of the copy
// plan and the swizzle) that reproduces a plain matmul of the dequantized cache.
//
// Resources (ptxas 13.0, sm_90, bf16 queries; tests/test_cupy_backend.py prints them):
// C4R4/C2R4 d_c=512: 251-255 registers, 0 spills -> 2 CTAs/SM at RG=1 (8 warps), 1 at RG=2;
// d_c=256: 186-195 registers. Shared memory 57,088 B (C4R4 512/64, RG=1, 4 stages),
// 73,472 B at RG=2. __launch_bounds__(128, 3) (QUANTMLA_CUPY_V2_MINB=3) gives 168 registers
// with ~260 B of spills: an A/B for the H200, not the default.
//
// Predicted gains (H200, C4R4 H=16 B=32 L=32K; v1 measured 659 us = 2.27x FlashInfer BF16):
//  1. Register-direct dequantization (no bf16 tile in shared memory, read twice by
//     ldmatrix): shared traffic falls from ~4.5 KB/token to ~0.64 KB/token of raw codes
//     plus ~0.5 KB/token of fp32 score exchange; ALU per token ~1.5 ops/value for QK and
//     ~1.9 for PV (~14 issue cycles per token per SM against the ~19-cycle bandwidth budget).
//     Expected 2-2.5x on its own.
//  2. One block-wide barrier per tile instead of two, copies 3 tiles ahead (v1: 1): 1.3-1.5x
//     on top (v1 stalled every warp behind the slowest warp's dequantization twice a tile and
//     had ~10 KB in flight per CTA; ~26 KB per SM is needed to cover HBM latency).
//     Together: ~200-250 us (0.7-0.85x FlashInfer BF16). Not yet the 0.35x target; see below.
//  3. RG = 2 row groups per CTA share one staged copy of the tile: at H=128 the tile is read
//     from L2 4x instead of 8x (unpacking stays per row group: the MMA work is 8x anyway).
//     Expected 1.0-1.2x at H=128 (compute-bound; occupancy is the same 8 warps/SM); measure
//     QUANTMLA_CUPY_V2_RG=1 against 2.
//  4. Host: cached SM count, compiled functions and ExternalStream objects, a reused
//     partials workspace, splits of >= 8 tiles. B=8 L=4K expected ~315 -> 40-70 us
//     (if the regression is host overhead, most of the gain comes from here; the kernel
//     itself at 4K x 8 requests is ~15 us of bandwidth).
// Measured (H200, C4R4 H=16 B=32 L=32K): 0.83x of v1's time with the old split rule, 443 us
// (1.5x FlashInfer BF16) with the wave-aware one; ncu: 54% issue-slot use, ~200 warp-instructions
// per token (the pure-tile loop was 1,933 SASS instructions per warp per tile, 68 of them MMAs;
// ~600 integer/address ops), so instruction count, not bytes, is the limit. The per-section copy
// plan and flag-free scales in pure tiles cut the loop to 1,414 instructions: 375 us
// (benchmarks/RESULTS.md).
// Next steps (not in v2): (a) fold (128 + z) into a per-(token, group) correction instead of
// the fma (QK: subtract s*(128+z)*sum(q_g) at the flush; PV: subtract sum_t(p s (128+z)) per
// group at the end; ~0.5 op/value, predicted 1.15-1.25x; the 128 offset amplifies fp32
// accumulation error ~17x, so it needs the same bf16-rounded p*s in the correction);
// (b) get under 168 registers for 3 CTAs/SM (Q fragments in shared memory, or 8 warps per
// row group with 64 channels each); (c) wgmma with tokens as M=64 on sm_90.
//
// Float32 queries, 8-bit codes and BF16 pages fall back to v1 (launcher).
#include "common.cuh"

#ifndef QMLA_V2_RG
#define QMLA_V2_RG 1
#endif
#ifndef QMLA_V2_MINB
#define QMLA_V2_MINB 1
#endif
#ifndef QMLA_V2_LAZY_RESCALE
#define QMLA_V2_LAZY_RESCALE 0  // 1: skip the accumulator rescale while no row's maximum moves (opt-in until timed)
#endif
#ifndef QMLA_V2_NO_PROTECTION
#define QMLA_V2_NO_PROTECTION 0  // 1: the cache keeps no protected tokens (sink = local = 0)
#endif
#ifndef QMLA_V2_PROT_MODE
// 0: protected (sink/local) tokens inline, from the bf16 buffers; 1: packed tokens only, protected
// ones masked (kernels/protected.cu adds them as more partials, which one combine merges).
#define QMLA_V2_PROT_MODE 0
#endif
static_assert(QMLA_V2_PROT_MODE == 0 || QMLA_V2_PROT_MODE == 1, "protected-token modes 0 (inline) and 1 (packed only)");

#define DC QMLA_DC
#define DR QMLA_DR
#define DT (QMLA_DC + QMLA_DR)
#ifndef QMLA_V2_T
#define QMLA_V2_T 32  // tokens per tile: 32 or 64 (QUANTMLA_CUPY_V2_TILE)
#endif
#define T QMLA_V2_T
#define NW 4
#define RG QMLA_V2_RG
#define NTH (NW * 32 * RG)
#define CBITS QMLA_CBITS
#define KCH (8 / CBITS)
#define CB QMLA_CB
#define RB QMLA_RB
#define NCT (CB / 16)
#define CBW (CB / NW)
#define LB (CBW / 4)
#define NE (LB / 4)
#define KSC (NE * KCH)
#define LBP (CBW / 8)
#define NPW ((LBP + 3) / 4)
#define PB ((LBP < 4) ? LBP : 4)
#define NTP (KCH * LBP)
#define KSR (DR / 16)
#define NTQ (T / 8)
#define NGC (DC / QMLA_GC)
#define NG (NGC + 1)
#define CMASK ((CBITS == 4) ? 0x0f0f0f0fu : 0x03030303u)
#ifndef QMLA_V2_STAGES
#define QMLA_V2_STAGES 4
#endif
#define NSTAGE QMLA_V2_STAGES
#define CSZ (QMLA_CSCALE_BF16 ? 2 : 4)
#define RSZ (QMLA_RSCALE_BF16 ? 2 : 4)

#if !QMLA_QUANT || !(CBITS == 2 || CBITS == 4) || QMLA_RBITS != 4 || !QMLA_IN_BF16
#error "attention_v2.cu serves bf16 queries with 2/4-bit content and 4-bit RoPE codes (the launcher uses v1 otherwise)"
#endif
static_assert(CB == DC * CBITS / 8 && RB == DR / 2, "code bytes per token");
static_assert(CB % 64 == 0 && LB >= 4 && LB <= 16 && LBP >= 2 && LBP <= 8, "content code row must split into lane loads");
static_assert(QMLA_GC % CBW == 0, "a warp's channel slice must lie inside one scale group");
static_assert(QMLA_GR == DR, "one RoPE group per token");
static_assert(DR % 16 == 0 && KSR <= NW && 8 * KSR == RB, "rope dim must be 32 or 64");
static_assert(NCT == 4 || NCT % 8 == 0, "swizzle needs 4 or a multiple of 8 chunks per token");
static_assert(NTP * 8 * NW == DC, "PV n-tiles must cover the latent");

// ---------------------------------------------------------------- shared memory layout
// One stage holds a tile's raw page sections, token-major like the page (content code rows
// chunk-swizzled), plus one flag byte per token written by the block itself.
// token flag SO_FL [T]: 0 packed, 1 protected (bf16 buffers), 2 past L
#define QMLA_STAGE_FLAGS 1
#include "stage.cuh"  // the stage layout (SO_*, STAGE_BYTES) and its copies
#define XCHG_BYTES (2 * RG * NW * NTQ * 32 * 16)
#define SMEM_TOTAL (NSTAGE * STAGE_BYTES + XCHG_BYTES)
static_assert(T == 32 || T == 64, "tiles of 32 or 64 tokens");
static_assert(NSTAGE >= 3 && NSTAGE <= 5, "3..5 stages");
#ifdef QMLA_V2_SMEM
static_assert(SMEM_TOTAL == QMLA_V2_SMEM, "launcher's v2_smem_bytes() disagrees with the kernel's layout");
#endif
static_assert(SMEM_TOTAL <= 227 * 1024, "shared memory per block");

static_assert(16 * OT_STRIDE * 4 <= SMEM_TOTAL, "one row group's partial-output tile reuses the shared memory");

template <bool B>
struct BoolC {
    static constexpr bool value = B;
};

// per-(token, group) scale from the staged raw bytes. FLAGS (tiles with protected tokens): selected
// by the token flag, so whatever bytes a protected or missing token has -- even NaN patterns --
// never reach the arithmetic. Pure tiles read the scale as staged: the copy zero-fills the scales
// of tokens past L (the only flagged tokens a pure tile can hold), and every other staged scale
// is a written token's or a zero from the prologue.
template <bool FLAGS>
__device__ __forceinline__ float v2_cscale(const u8* st, int t, int grp) {
#if QMLA_CSCALE_BF16
    const float s = bf16_bits_to_f32(((const u16*)(st + SO_CS))[t * NGC + grp]);
#else
    const float s = ((const float*)(st + SO_CS))[t * NGC + grp];
#endif
    if (!FLAGS) return s;
    const u32 fl = st[SO_FL + t];
    return fl == 0u ? s : (fl == 1u ? 1.0f : 0.0f);
}
template <bool FLAGS>
__device__ __forceinline__ float v2_rscale(const u8* st, int t) {
#if QMLA_RSCALE_BF16
    const float s = bf16_bits_to_f32(((const u16*)(st + SO_RS))[t]);
#else
    const float s = ((const float*)(st + SO_RS))[t];
#endif
    if (!FLAGS) return s;
    const u32 fl = st[SO_FL + t];
    return fl == 0u ? s : (fl == 1u ? 1.0f : 0.0f);
}
// bf16x2 of -(128 + z), both halves
__device__ __forceinline__ u32 v2_negz2(u32 z) {
    const u32 nz = 0xc300u | z;
    return nz | (nz << 16);
}

// 4 codes (one per byte, low bits) -> two bf16x2 (code - z) using (code | 0x4300) = 128 + code
__device__ __forceinline__ u32 v2_cvt_lo(u32 cv, u32 negz2) {
    return fma_bf16x2(__byte_perm(cv, 0x43u, 0x4140u), 0x3f803f80u, negz2);
}
__device__ __forceinline__ u32 v2_cvt_hi(u32 cv, u32 negz2) {
    return fma_bf16x2(__byte_perm(cv, 0x43u, 0x4342u), 0x3f803f80u, negz2);
}

extern "C" __global__ void __launch_bounds__(NTH, QMLA_V2_MINB) qmla_attn_v2(
    const u16* __restrict__ q_lat, const u16* __restrict__ q_rope, const u8* __restrict__ pages,
    const u16* __restrict__ sink_buf, const u16* __restrict__ local_buf, const int* __restrict__ block_table,
    const qmla_index_t* __restrict__ seq_lens, const qmla_index_t* __restrict__ seq_ids, float* __restrict__ o_part,
    float2* __restrict__ ml_part, int S_q, int H, int max_pages, int bt_stride, int num_pages, int max_seqs,
    int sink, int local, int tiles_per_split, int num_splits, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem[];
    float4* xchg = (float4*)(smem + NSTAGE * STAGE_BYTES);

    const int tid = threadIdx.x;
    const int w = tid >> 5, lane = tid & 31;
    const int rg = w / NW, wc = w % NW;
    const int g8 = lane >> 2, q4 = lane & 3;
    const int R = S_q * H;
    const int NCHK = (R + 16 * RG - 1) / (16 * RG);
    const int b = blockIdx.x / NCHK, chk = blockIdx.x % NCHK;
    const int L = (int)seq_lens[b];  // lengths < 2^31 (DESIGN: context up to 1M tokens)
    const i64 sid = seq_ids[b];
    const bool sid_ok = sid >= 0 && sid < max_seqs;
    const int r0 = (chk * RG + rg) * 16 + g8, r1 = r0 + 8;
    // The tokens this CTA attends to are [keep_lo, keep_hi). Mode 0: all of [0, L), protected ones
    // read from the bf16 buffers inline. Mode 1: the packed ones between the sink and the local
    // window (the protected kernel's partials are the last ones of each row: num_splits counts them).
    const int sink_end = sid_ok ? min(sink, L) : 0;
    const int local_start = (sid_ok && local > 0) ? max(sink_end, L - local) : L;
#if QMLA_V2_PROT_MODE == 1
    const int keep_lo = sink_end, keep_hi = local_start;
    const int split = blockIdx.y;
    const int t_end = min(keep_hi, (split + 1) * tiles_per_split * T);
    const int t_begin = max(split * tiles_per_split * T, keep_lo / T * T);
#else
    const int keep_lo = 0, keep_hi = L;
    const int split = blockIdx.y;
    const int t_begin = split * tiles_per_split * T;
    const int t_end = min(L, t_begin + tiles_per_split * T);
#endif
    const int lim0 = min(keep_hi, L - S_q + r0 / H + 1);
    const int lim1 = min(keep_hi, L - S_q + r1 / H + 1);
#if QMLA_V2_PROT_MODE == 1
    __shared__ int keep_lo_s;  // read back for the first tile only: keeps a register free in the loop
    if (tid == 0) keep_lo_s = keep_lo;  // visible after the prologue's __syncthreads
#endif

    // protected-buffer row of token n (nullptr: read the packed copy)
    auto prot_row = [&](int n) -> const u16* {
        if (!sid_ok || n >= L) return nullptr;
        if (n < sink) return sink_buf + (sid * sink + n) * DT;
        if (local > 0 && n >= L - local) return local_buf + (sid * local + n % local) * DT;
        return nullptr;
    };


    float m0 = -QMLA_INF, m1 = -QMLA_INF, l0 = 0.0f, l1 = 0.0f;
    float acc[NTP][4];
#pragma unroll
    for (int i = 0; i < NTP; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    if (t_begin < t_end) {
        // ------------------------------------------------------------ query fragments (permuted K order)
        u32 qa[KSC + 1][4];
        {
            const bool ok0 = r0 < R, ok1 = r1 < R;
            const u16* q0 = q_lat + ((i64)b * R + r0) * DC;
            const u16* q1 = q_lat + ((i64)b * R + r1) * DC;
#pragma unroll
            for (int c = 0; c < KCH; ++c) {
#pragma unroll
                for (int e = 0; e < NE; ++e) {
                    const int ch = CBW * wc + LB * q4 + 4 * e + CB * c;
                    u32* a = qa[c * NE + e];
                    a[0] = ok0 ? *(const u32*)(q0 + ch) : 0u;
                    a[1] = ok1 ? *(const u32*)(q1 + ch) : 0u;
                    a[2] = ok0 ? *(const u32*)(q0 + ch + 2) : 0u;
                    a[3] = ok1 ? *(const u32*)(q1 + ch + 2) : 0u;
                }
            }
            const bool has = wc < KSR;
            const u16* p0 = q_rope + ((i64)b * R + r0) * DR;
            const u16* p1 = q_rope + ((i64)b * R + r1) * DR;
            const int ch = 8 * wc + 2 * q4;
            qa[KSC][0] = (ok0 && has) ? *(const u32*)(p0 + ch) : 0u;
            qa[KSC][1] = (ok1 && has) ? *(const u32*)(p1 + ch) : 0u;
            qa[KSC][2] = (ok0 && has) ? *(const u32*)(p0 + ch + RB) : 0u;
            qa[KSC][3] = (ok1 && has) ? *(const u32*)(p1 + ch + RB) : 0u;
        }

        // ------------------------------------------------------------ staging
        // page ids of the NSEG page segments of tile tt (-1: none), loaded a tile ahead of use
        auto load_pages = [&](int tt, int (&pgs)[NSEG]) {
            qmla_load_pages(tt, pgs, block_table + (i64)b * bt_stride, L, max_pages, num_pages);
        };
        // Tile tt -> stage st (stage.cuh; stale bytes of a skipped segment are neutralized by the
        // flags), and the token flags by plain stores.
        auto issue_copy = [&](int tt, int st, const int (&pgs)[NSEG]) {
            u8* base = smem + st * STAGE_BYTES;
            qmla_issue_stage(base, pages, pgs, tt, L, tid);
            if (tid < T) {
                const int n = tt + tid;
                base[SO_FL + tid] = (u8)(n >= L ? 2 : (prot_row(n) != nullptr ? 1 : 0));
            }
        };

        // ------------------------------------------------------------ prologue
        {
            // zero the stages once: bytes never copied (missing pages) stay finite codes/scales
            uint4* z4 = (uint4*)smem;
            for (int k = tid; k < NSTAGE * STAGE_BYTES / 16; k += NTH) z4[k] = make_uint4(0u, 0u, 0u, 0u);
        }
        __syncthreads();
        int pg_next[NSEG];
#pragma unroll
        for (int s = 0; s < NSTAGE - 1; ++s) {
            load_pages(t_begin + s * T, pg_next);
            if (t_begin + s * T < t_end) issue_copy(t_begin + s * T, s, pg_next);
            cp_async_commit();
        }
        load_pages(t_begin + (NSTAGE - 1) * T, pg_next);
        qmla_wait_group<NSTAGE - 2>();  // this thread's copies of tile 0 landed
        __syncthreads();

        int i = 0;
        for (int t0 = t_begin; t0 < t_end; t0 += T, ++i) {
            const int st = i % NSTAGE;
            const u8* stg_c = smem + st * STAGE_BYTES;
            const u8* stg_r = stg_c + SO_R;
            const u8* czt = stg_c + SO_CZ;  // content zero points [T][NGC]
            float4* xw = xchg + (((i & 1) * RG + rg) * NW) * NTQ * 32;

            // tiles with no sink/local token take the specialization without per-lane branches
#if QMLA_V2_NO_PROTECTION || QMLA_V2_PROT_MODE == 1
            // sink = local = 0, or mode 1 (protected tokens masked, never read): every tile takes the
            // pure path and the protected path is not compiled
            const bool pure = true;
#else
            const bool pure = !sid_ok || (t0 >= sink && (local <= 0 || min(t0 + T, L) <= L - local));
#endif
            auto qk_tile = [&](auto prot_c) {
                constexpr bool PROT = decltype(prot_c)::value;
                // -------------------------------------------------------- QK partial over this warp's channels
#pragma unroll
                for (int j = 0; j < NTQ; ++j) {
                    const int tq = 8 * j + g8;  // this lane's B-operand token
                    const u16* prow = PROT ? prot_row(t0 + tq) : nullptr;
                    u32 W[NE];
#if LB == 16
                    {
                        const uint4 v = *(const uint4*)(stg_c + qmla_coff(tq, CBW * wc + LB * q4));
                        W[0] = v.x; W[1] = v.y; W[2] = v.z; W[3] = v.w;
                    }
#elif LB == 8
                    {
                        const uint2 v = *(const uint2*)(stg_c + qmla_coff(tq, CBW * wc + LB * q4));
                        W[0] = v.x; W[1] = v.y;
                    }
#else
                    W[0] = *(const u32*)(stg_c + qmla_coff(tq, CBW * wc + LB * q4));
#endif
                    float S4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    const int tc = 8 * j + 2 * q4;  // C-fragment tokens tc, tc + 1
#pragma unroll
                    for (int c = 0; c < KCH; ++c) {
                        const int grp = (CBW * wc + CB * c) / QMLA_GC;
                        const u32 negz2 = v2_negz2(czt[tq * NGC + grp]);
                        float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                        for (int e = 0; e < NE; ++e) {
                            u32 b0, b1;
                            if (prow != nullptr) {
                                const uint2 v = *(const uint2*)(prow + CBW * wc + LB * q4 + 4 * e + CB * c);
                                b0 = v.x;
                                b1 = v.y;
                            } else {
                                const u32 cv = (W[e] >> (CBITS * c)) & CMASK;
                                b0 = v2_cvt_lo(cv, negz2);
                                b1 = v2_cvt_hi(cv, negz2);
                            }
                            mma_bf16(tmp, qa[c * NE + e], b0, b1);
                        }
                        const float2 sc = make_float2(v2_cscale<PROT>(stg_c, tc, grp), v2_cscale<PROT>(stg_c, tc + 1, grp));
                        S4[0] += tmp[0] * sc.x;
                        S4[1] += tmp[1] * sc.y;
                        S4[2] += tmp[2] * sc.x;
                        S4[3] += tmp[3] * sc.y;
                    }
                    if (wc < KSR) {
                        u32 b0, b1;
                        if (prow != nullptr) {
                            b0 = *(const u32*)(prow + DC + 8 * wc + 2 * q4);
                            b1 = *(const u32*)(prow + DC + 8 * wc + 2 * q4 + RB);
                        } else {
                            const u32 x = *(const u16*)(stg_r + tq * RB + 8 * wc + 2 * q4);
                            const u32 negz2 = v2_negz2(stg_c[SO_RZ + tq]);
                            b0 = v2_cvt_lo(x & 0x0f0fu, negz2);
                            b1 = v2_cvt_lo((x >> 4) & 0x0f0fu, negz2);
                        }
                        float tmp[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                        mma_bf16(tmp, qa[KSC], b0, b1);
                        const float2 sc = make_float2(v2_rscale<PROT>(stg_c, tc), v2_rscale<PROT>(stg_c, tc + 1));
                        S4[0] += tmp[0] * sc.x;
                        S4[1] += tmp[1] * sc.y;
                        S4[2] += tmp[2] * sc.x;
                        S4[3] += tmp[3] * sc.y;
                    }
                    xw[(wc * NTQ + j) * 32 + lane] = make_float4(S4[0], S4[1], S4[2], S4[3]);
                }

            };
            if (pure) qk_tile(BoolC<false>()); else qk_tile(BoolC<true>());

            qmla_wait_group<NSTAGE - 3>();  // this thread's copies of tile i+1 landed
            __syncthreads();              // the only block barrier of the tile
            // refill the stage tile i-1 used (every warp is past its PV of tile i-1 now)
            if (t0 + (NSTAGE - 1) * T < t_end) {
                issue_copy(t0 + (NSTAGE - 1) * T, (i + NSTAGE - 1) % NSTAGE, pg_next);
                load_pages(t0 + NSTAGE * T, pg_next);  // consumed next iteration: its latency is hidden
            }
            cp_async_commit();

            // -------------------------------------------------------- sum partials, mask, online softmax
            float S[NTQ][4];
            qmla_sum_partials<NTQ, NW>(xw, lane, t0, q4, lim0, lim1, scale_log2, S);
#if QMLA_V2_PROT_MODE == 1
            if (i == 0) {  // only the first tile can start before this CTA's tokens (t_begin = keep_lo / T * T)
                const int klo = keep_lo_s;
#pragma unroll
                for (int j = 0; j < NTQ; ++j) {
                    const int n = t0 + 8 * j + 2 * q4;
                    if (n < klo) S[j][0] = S[j][2] = -QMLA_INF;
                    if (n + 1 < klo) S[j][1] = S[j][3] = -QMLA_INF;
                }
            }
#endif
            qmla_online_softmax<NTQ, NTP, (bool)QMLA_V2_LAZY_RESCALE>(S, m0, m1, l0, l1, acc);

            auto pv_tile = [&](auto prot_c) {
                constexpr bool PROT = decltype(prot_c)::value;
                // -------------------------------------------------------- PV over this warp's channels
#pragma unroll
                for (int kt = 0; kt < T / 16; ++kt) {
                    const int ta = 16 * kt + 2 * q4;  // A-operand tokens ta, ta+1, ta+8, ta+9
                    const int tk[4] = {ta, ta + 1, ta + 8, ta + 9};
                    const u16* prow[4];
                    u32 Wp[4][NPW];
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        prow[k] = PROT ? prot_row(t0 + tk[k]) : nullptr;
                        qmla_load_bytes<LBP>(stg_c + qmla_coff(tk[k], CBW * wc + LBP * g8), Wp[k]);
                    }
                    const float* pa = S[2 * kt];
                    const float* pb = S[2 * kt + 1];
#pragma unroll
                    for (int c = 0; c < KCH; ++c) {
                        const int grp = (CBW * wc + CB * c) / QMLA_GC;
                        const float2 sa = make_float2(v2_cscale<PROT>(stg_c, ta, grp), v2_cscale<PROT>(stg_c, ta + 1, grp));
                        const float2 sb = make_float2(v2_cscale<PROT>(stg_c, ta + 8, grp), v2_cscale<PROT>(stg_c, ta + 9, grp));
                        u32 a[4];
                        a[0] = pack_bf16x2(pa[0] * sa.x, pa[1] * sa.y);
                        a[1] = pack_bf16x2(pa[2] * sa.x, pa[3] * sa.y);
                        a[2] = pack_bf16x2(pb[0] * sb.x, pb[1] * sb.y);
                        a[3] = pack_bf16x2(pb[2] * sb.x, pb[3] * sb.y);
                        u32 negz2[4];
#pragma unroll
                        for (int k = 0; k < 4; ++k) {
                            negz2[k] = v2_negz2(czt[tk[k] * NGC + grp]);
                        }
#pragma unroll
                        for (int wd = 0; wd < NPW; ++wd) {
                            u32 U[4][2];
#pragma unroll
                            for (int k = 0; k < 4; ++k) {
                                const int ch = CBW * wc + LBP * g8 + 4 * wd + CB * c;
                                if (prow[k] != nullptr) {
#if PB == 4
                                    const uint2 v = *(const uint2*)(prow[k] + ch);
                                    U[k][0] = v.x;
                                    U[k][1] = v.y;
#else
                                    U[k][0] = *(const u32*)(prow[k] + ch);
                                    U[k][1] = 0u;
#endif
                                } else {
                                    const u32 cv = (Wp[k][wd] >> (CBITS * c)) & CMASK;
                                    U[k][0] = v2_cvt_lo(cv, negz2[k]);
                                    U[k][1] = (PB == 4) ? v2_cvt_hi(cv, negz2[k]) : 0u;
                                }
                            }
#pragma unroll
                            for (int p = 0; p < PB; ++p) {
                                const u32 sel = (p & 1) ? 0x7632u : 0x5410u;
                                const u32 b0 = __byte_perm(U[0][p >> 1], U[1][p >> 1], sel);
                                const u32 b1 = __byte_perm(U[2][p >> 1], U[3][p >> 1], sel);
                                mma_bf16(acc[(c * NPW + wd) * PB + p], a, b0, b1);
                            }
                        }
                    }
                }
            };
            if (pure) pv_tile(BoolC<false>()); else pv_tile(BoolC<true>());
        }
    }

    // ---------------------------------------------------------------- partial results (v1 layout)
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, o);
        l1 += __shfl_xor_sync(0xffffffffu, l1, o);
    }
    const i64 row0 = (i64)b * R + r0, row1 = (i64)b * R + r1;
    if (wc == 0 && q4 == 0) {
        if (r0 < R) ml_part[row0 * num_splits + split] = make_float2(m0, l0);
        if (r1 < R) ml_part[row1 * num_splits + split] = make_float2(m1, l1);
    }
    // The partial outputs through shared memory (free now), one row group at a time
    // (qmla_store_partial_rows; the scalar stores cost v2 at H16 B32 L4K 30 % of its time).
    cp_async_wait_all();
    float* ot = (float*)smem;
#pragma unroll 1
    for (int g = 0; g < RG; ++g) {
        __syncthreads();  // the stages, or the previous row group's rows, are no longer read
        if (rg == g) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int c = 0; c < KCH; ++c) {
#pragma unroll
                    for (int wd = 0; wd < NPW; ++wd) {
#pragma unroll
                        for (int p = 0; p < PB; ++p) {
                            const int nt = (c * NPW + wd) * PB + p;
                            const int ch = CBW * wc + LBP * (2 * q4) + 4 * wd + p + CB * c;
                            ot[(g8 + 8 * h) * OT_STRIDE + ch] = acc[nt][2 * h];
                            ot[(g8 + 8 * h) * OT_STRIDE + ch + LBP] = acc[nt][2 * h + 1];
                        }
                    }
                }
            }
        }
        __syncthreads();
        qmla_store_partial_rows(o_part, ot, b, R, (chk * RG + g) * 16, num_splits, split, tid);
    }
}
