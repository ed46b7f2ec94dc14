// QuantMLA CuPy backend: decode attention v4 (many query rows: one dequantized tile for 64 rows).
//
// Serves what v3 serves (bf16 queries; 2/4-bit content and 4-bit RoPE codes; d_c/d_r 512/64 and
// 256/32), and bf16 pages (QMLA_QUANT 0: each tile's rows are copied into the key tile as they
// are, with the next tile's rows prefetched to L2). It is meant for requests with many query rows
// R = S_q * H (DeepSeek-V3/R1 and Kimi-K2 at H = 128, or H = 64 under 2-way tensor parallelism).
// The sink and local-window tokens: with QMLA_V4_PROTECTED 1 the last values of blockIdx.y take one
// protected 64-token tile each, copying its bf16 rows from the protection buffers straight into the
// key tile (no dequantization), and write the last partial slots; with 0 (packed tokens only)
// protected.cu adds them. v1's qmla_combine merges the partials by log-sum-exp.
//
// ================================================================ design note
// Why: v2 and v3 take 16 query rows per CTA and convert codes straight into MMA fragments, so at
// H = 128 every token is converted 8 times (v3: 112 warp-instructions per token and 16 rows).
// Here one CTA takes 64 rows, converts each tile once into a bf16 tile in shared memory and runs
// flash-decoding on it (the layout of protected.cu, at 64 rows):
//
//   grid (B * ceil(R / 64), KV splits [+ protected tiles]), 8 warps. Tiles of T = 64 tokens staged raw
//   by cp.async (stage.cuh), NSTAGE - 1 tiles ahead. A protected CTA takes one 64-token tile of the
//   sink or one the local window touches (attention.py protected_ctas(sink, local, 64)). Per tile:
//   1. Dequantize: every thread converts 16-byte chunks of code rows to bf16 (s * (code - z),
//      rounded once: the bf16 FMAs take exact integers) into K [T][DC + DR] (rows padded by 16
//      bytes, conflict-free ldmatrix). Block barrier.
//   2. QK: warp (rg = w % 4, hh = w / 4) scores 16 rows (row group rg) against all 64 tokens over
//      channel half hh (A = queries [64][DC + DR] staged once per CTA, by ldmatrix.x4; B = key rows
//      by ldmatrix.x4), then the pair (rg, 0) / (rg, 1) swaps partial scores through shared memory
//      (named barrier of 64 threads): warp (rg, hh) keeps the sum for tokens 32 hh .. 32 hh + 31.
//   3. Softmax in base 2: the pair meets its row maxima in shared memory (second pair barrier); P
//      goes to shared memory as bf16 [64][T], the rescale factors as float [64].
//   4. PV: warp w accumulates rows 32 rh .. 32 rh + 31 (rh = (w / 2) % 2, two m-tiles), channels
//      DC/4 * dq .. DC/4 * (dq + 1) (dq = w % 2 + 2 (w / 4)) over all 64 tokens (A = P by
//      ldmatrix.x4, B = the same K rows by ldmatrix.x4.trans). The four warps that wrote P rows
//      32 rh .. 32 rh + 31 are the four that read them (named barrier of 128 threads).
//   Partials (unnormalized output, row maximum, the pair's summed row sums) leave in v1's layout.
// Why these shapes: the kernel is bound by shared-memory wavefronts (ncu, first build: L1 82 %,
// tensor pipe 35 %). A warp's QK over 16 rows x 64 tokens x half the channels and its PV over 32
// rows x DC/4 channels read 552 wavefronts per tile, against 704 for 16 rows x 32 tokens x all
// channels and 16 rows x DC/2 channels.
// Shared memory (C4R4, 2 stages): 2 x 20.3 KB staged pages + 73 KB K + 73 KB queries + 9 KB P +
// 16 KB score exchange: one CTA (8 warps) per SM.
//
// QMLA_V4_WGMMA 1 (sm_90a; the launcher's default on sm_90): the same tiles, softmax and partials, but
// both matmuls are Hopper warpgroup MMAs reading their operands straight from shared memory (no
// ldmatrix, no per-warp re-reads of the key tile). The K, query and P tiles are stored in the
// 128-byte swizzle of wgmma.cuh. Warpgroup hh (warps 4 hh .. 4 hh + 3):
//   QK: S[64 rows][64 tokens] over the even (hh = 0) or odd 16-channel runs, m64n64k16 (A = queries,
//       B = K, both K-major); warp rg holds rows 16 rg .. 16 rg + 15 in mma.sync's fragment layout, so
//       the pair exchange and the softmax above are unchanged.
//   PV: O[64 rows][channels DC / 2 hh ..] += P[64][64] K[64][DC / 2], m64n256k16 (m64n128k16 at d_c
//       256): A = P (K-major), B = the same K tile read MN-major. A thread's output rows are its QK
//       rows, so it rescales with its own factors; a block barrier publishes P (each warpgroup reads
//       all of it).
#include "common.cuh"

#ifndef QMLA_V4_STAGES
#define QMLA_V4_STAGES 2
#endif
#ifndef QMLA_V4_PROTECTED
#define QMLA_V4_PROTECTED 0  // 1: the last blockIdx.y values attend to the protected tiles (see above)
#endif
#ifndef QMLA_V4_LAZY_RESCALE
#define QMLA_V4_LAZY_RESCALE 1  // skip the output rescale while no row's maximum moves (bit-identical)
#endif
#ifndef QMLA_V4_WGMMA
#define QMLA_V4_WGMMA 0  // 1: QK and PV by wgmma from 128-byte-swizzled tiles (sm_90a; see the note below)
#endif

#define DC QMLA_DC
#define DR QMLA_DR
#define DT (QMLA_DC + QMLA_DR)
#define T 64
#define NW 8
#define NTH (NW * 32)
#define RT 64                 // query rows per CTA
#define QLOADS (RT * (DT / 8) / NTH)  // 16-byte query loads per thread
static_assert(RT * (DT / 8) % NTH == 0, "the threads load the queries in equal shares");
#ifndef QMLA_V4_QBATCH
// query loads a thread has in flight at once: all of them where registers allow (the wgmma build); the mma.sync build,
// whose 128 PV accumulators are live already, spilled 8 bytes with all 18 (d_c 512) and keeps 6
#define QMLA_V4_QBATCH (QMLA_V4_WGMMA ? QLOADS : (QLOADS % 6 == 0 ? 6 : QLOADS / 3))
#endif
#define QBATCH QMLA_V4_QBATCH
static_assert(QLOADS % QBATCH == 0, "equal batches of query loads");
#define CBITS QMLA_CBITS
#define KCH (8 / CBITS)       // codes per byte
#define CB QMLA_CB
#define RB QMLA_RB
#define NCT (CB / 16)
#define NGC (DC / QMLA_GC)
#define CMASK ((CBITS == 4) ? 0x0f0f0f0fu : 0x03030303u)
#define NSTAGE QMLA_V4_STAGES
#define CSZ (QMLA_CSCALE_BF16 ? 2 : 4)
#define RSZ (QMLA_RSCALE_BF16 ? 2 : 4)
#define KST (DT * 2 + 16)     // bytes per row of the K and query tiles
#define PST (T * 2 + 16)      // bytes per row of the P tile
#define KSTEPS (DT / 16)
#define KSH (KSTEPS / 2)      // QK k-steps of one channel half
#define DQ (DC / 4)           // PV channels per warp
#define NTP (DQ / 8)          // PV n-tiles per warp and 16-row m-tile

#if !QMLA_IN_BF16 || !((QMLA_QUANT && (CBITS == 2 || CBITS == 4) && QMLA_RBITS == 4) || \
                       (!QMLA_QUANT && CBITS == 16 && QMLA_RBITS == 16))
#error "attention_v4.cu serves bf16 queries over 2/4-bit content with 4-bit RoPE codes, or over bf16 pages"
#endif
#if QMLA_QUANT
static_assert(CB == DC * CBITS / 8 && RB == DR / 2, "code bytes per token");
static_assert(CB % 64 == 0 && (RB == 16 || RB == 32), "d_c 256/512 and d_r 32/64");
static_assert(QMLA_GC % 16 == 0, "a 16-channel dequantized run must lie inside one scale group");
static_assert(QMLA_GR == DR, "one RoPE group per token");
#else
// bf16 pages: each tile's rows are copied into the key tile as they are (no staging, no dequantization)
static_assert(CB == 2 * DC && RB == 2 * DR && (DC == 256 || DC == 512) && (DR == 32 || DR == 64), "bf16 page rows");
#endif
static_assert(NTP % 2 == 0, "PV n-tiles come in pairs (ldmatrix.x4.trans)");
static_assert(KSTEPS % 2 == 0, "QK channel halves of whole k-steps");
static_assert(NSTAGE == 2 || NSTAGE == 3, "2 or 3 stages");
#if QMLA_V4_WGMMA
#include "wgmma.cuh"
static_assert(T == 64 && RT == 64 && NW == 8, "wgmma build: two warpgroups, 64 rows x 64 tokens, P rows of 128 bytes");
#endif

// ---------------------------------------------------------------- shared memory layout
#include "stage.cuh"  // the stage layout (SO_*, STAGE_BYTES) and its copies
#define STAGE_AREA (QMLA_QUANT ? NSTAGE * STAGE_BYTES : 0)  // bf16 pages are copied straight into K
#if QMLA_V4_WGMMA
// the K, query and P tiles in wgmma.cuh's 128-byte swizzle (NCB column blocks of 64 channels), 1024-byte
// aligned; the kernel rounds the dynamic shared memory base up to 1024 bytes, hence the extra 1 KB
#define NCB ((DT + 63) / 64)
#define KT_OFF ((STAGE_AREA + 1023) / 1024 * 1024)  // dequantized tile, bf16 [NCB][T][64]
#define QT_OFF (KT_OFF + T * NCB * 128)                        // queries, bf16 [NCB][RT][64]
#define PT_OFF (QT_OFF + RT * NCB * 128)                       // P, bf16 [RT][T]
#define XS_OFF (PT_OFF + RT * T * 2)
#define SMEM_ALIGN_SLACK 1024
#else
#define KT_OFF STAGE_AREA             // dequantized tile, bf16 [T][KST / 2]
#define QT_OFF (KT_OFF + T * KST)      // queries, bf16 [RT][KST / 2]
#define PT_OFF (QT_OFF + RT * KST)     // P, bf16 [RT][PST / 2]
#define XS_OFF (PT_OFF + RT * PST)     // QK partial scores for the pair partner, float4 [NW][4][32]
#define SMEM_ALIGN_SLACK 0
#endif
#define RED_OFF (XS_OFF + NW * 4 * 32 * 16)  // float [4][RT]: row maxima / sums of both halves, alpha, final maxima
#define SMEM_TOTAL (RED_OFF + 4 * RT * 4 + SMEM_ALIGN_SLACK)
#ifdef QMLA_V4_SMEM
static_assert(SMEM_TOTAL == QMLA_V4_SMEM, "launcher's v4_smem_bytes() disagrees with the kernel's layout");
#endif
static_assert(SMEM_TOTAL <= 227 * 1024, "shared memory per block");

static_assert(RT * OT_STRIDE * 4 <= RED_OFF, "the partial-output tile reuses everything below the row stats");

// barrier of the two warps (64 threads) that share QK row group rg (ids 1-4)
__device__ __forceinline__ void v4_pair_sync(int rg) { asm volatile("bar.sync %0, 64;" ::"r"(rg + 1) : "memory"); }
// barrier of the four warps (128 threads) that write and read P rows 32 rh .. 32 rh + 31 (ids 5-6)
__device__ __forceinline__ void v4_quad_sync(int rh) { asm volatile("bar.sync %0, 128;" ::"r"(rh + 5) : "memory"); }

#define QMLA_KT_SW128 QMLA_V4_WGMMA
#include "tile_dequant.cuh"  // qmla_kt_chunk, qmla_dequantize_tile

#if !QMLA_QUANT
// bf16 pages: tile t0's rows [d_c | d_r] (page segments pgs, from qmla_load_pages) into the key tile by
// cp.async, 16 bytes at a time; rows past L or on a missing page are zero-filled (P is 0 there, and
// 0 x a stale row could be NaN).
__device__ __forceinline__ void v4_copy_bf16_tile(u8* kt, const u8* __restrict__ pages, const int (&pgs)[NSEG], int t0,
                                                  int L, int tid) {
#pragma unroll
    for (int sg = 0; sg < NSEG; ++sg) {
        const int pg = pgs[sg];  // the same in every thread
        const u8* page = pages + (i64)max(pg, 0) * QMLA_PAGE_BYTES;
        const int slot0 = (t0 + sg * SEGT) % QMLA_P;
        for (int k = tid; k < SEGT * (DT / 8); k += NTH) {
            const int r = k / (DT / 8), u = k % (DT / 8), t = sg * SEGT + r;
            const u8* src = u < DC / 8 ? page + QMLA_OFF_CC + (slot0 + r) * CB + 16 * u
                                       : page + QMLA_OFF_RC + (slot0 + r) * RB + 16 * (u - DC / 8);
            cp_async16_zfill(kt + qmla_kt_chunk(t, u, T), src, (pg >= 0 && t0 + t < L) ? 16 : 0);
        }
    }
}

// the page rows of tile t0 into L2 (prefetch.global.L2, one 128-byte line per request), so that its
// copy into the key tile, which must wait for the previous tile's PV, finds them close
__device__ __forceinline__ void v4_prefetch_bf16_tile(const u8* __restrict__ pages, const int (&pgs)[NSEG], int t0,
                                                      int tid) {
#pragma unroll
    for (int sg = 0; sg < NSEG; ++sg) {
        if (pgs[sg] < 0) continue;
        const u8* page = pages + (i64)pgs[sg] * QMLA_PAGE_BYTES;
        const int slot0 = (t0 + sg * SEGT) % QMLA_P;
        for (int l = tid; l < SEGT * (CB + RB) / 128; l += NTH) {
            const u8* p = l < SEGT * CB / 128 ? page + QMLA_OFF_CC + slot0 * CB + 128 * l
                                              : page + QMLA_OFF_RC + slot0 * RB + 128 * (l - SEGT * CB / 128);
            asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
        }
    }
}
#endif

extern "C" __global__ void __launch_bounds__(NTH, 1) qmla_attn_v4(
    const u16* __restrict__ q_lat, const u16* __restrict__ q_rope, const u8* __restrict__ pages,
    const u16* __restrict__ sink_buf, const u16* __restrict__ local_buf, const int* __restrict__ block_table,
    const qmla_index_t* __restrict__ seq_lens, const qmla_index_t* __restrict__ seq_ids, float* __restrict__ o_part,
    float2* __restrict__ ml_part, int S_q, int H, int max_pages, int bt_stride, int num_pages, int max_seqs,
    int sink, int local, int tiles_per_split, int num_splits, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
#if QMLA_V4_WGMMA
    u8* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);  // the swizzle needs 1024-byte tiles
#else
    u8* smem = smem_raw;
#endif
    u8* kt = smem + KT_OFF;
    float* red = (float*)(smem + RED_OFF);

    const int tid = threadIdx.x;
    const int w = tid >> 5, lane = tid & 31;
    const int g8 = lane >> 2, q4 = lane & 3;
    const int rg = w & 3, hh = w >> 2;                     // QK / softmax: row group, token (and channel) half
#if !QMLA_V4_WGMMA
    const int rh = (w >> 1) & 1, dq = (w & 1) + 2 * (w >> 2);  // PV: 32-row half, channel quarter
#endif
    const int R = S_q * H;
    const int NCHK = (R + RT - 1) / RT;
    const int b = blockIdx.x / NCHK, chk = blockIdx.x % NCHK;
    const int rbase = chk * RT;
    const int L = (int)seq_lens[b];
    const i64 sid = seq_ids[b];
    const bool sid_ok = sid >= 0 && sid < max_seqs;
    // packed splits: [keep_lo, keep_hi) = [sink_end, local_start), between the sink and the local window
    const int sink_end = sid_ok ? min(sink, L) : 0;
    const int local_start = (sid_ok && local > 0) ? max(sink_end, L - local) : L;
    int keep_lo = sink_end, keep_hi = local_start;
    const int split = blockIdx.y;
#if QMLA_V4_PROTECTED
    // the last nprot values of blockIdx.y: one protected tile each (protected_ctas(sink, local, T) in
    // attention.py), protected.cu's rule at T tokens: sink tile y, else a tile the local window touches
    const int nsink = (sink + T - 1) / T;
    const int nprot = nsink + (local > 0 ? (local + T - 1) / T + 1 : 0);
    const bool prot = split >= (int)gridDim.y - nprot;
#else
    constexpr int nsink = 0, nprot = 0;
    constexpr bool prot = false;
#endif
    if (prot) {
        const int y = split - ((int)gridDim.y - nprot);
        if (y < nsink) {
            keep_lo = min(y * T, sink_end);
            keep_hi = min(keep_lo + T, sink_end);
        } else {
            const int tt = (local_start / T + y - nsink) * T;
            keep_lo = max(local_start, tt);
            keep_hi = max(keep_lo, min(L, tt + T));
        }
    }
    const int t_begin = prot ? keep_lo / T * T : max(split * tiles_per_split * T, keep_lo / T * T);
    const int t_end = prot ? keep_hi : min(keep_hi, (split + 1) * tiles_per_split * T);

    // this lane's rows: rw0 = 16 rg + g8 and rw0 + 8 of the CTA's 64
    const int rw0 = 16 * rg + g8;
    int lim[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) lim[k] = min(keep_hi, L - S_q + (rbase + rw0 + 8 * k) / H + 1);

#if QMLA_V4_WGMMA
    float acc[DC / 16][4];  // PV, wgmma layout: rows 16 rg + g8 (+ 8) x channels DC / 2 * hh + 8 i + 2 q4 (+ 1)
#pragma unroll
    for (int i = 0; i < DC / 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#else
    float acc[2][NTP][4];  // PV: [m-tile][n-tile]
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int i = 0; i < NTP; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.0f;
    }
#endif
    float m_run[2] = {-QMLA_INF, -QMLA_INF};
    float l_run[2] = {0.0f, 0.0f};  // this lane's share of the row sums over this warp's tokens

    if (t_begin < t_end) {
        // ------------------------------------------------------------ queries [RT][DT] (rows >= R: zeros)
        // a batch of QBATCH loads of a thread goes out before its first store: QLOADS / QBATCH round trips to memory
#pragma unroll 1
        for (int kb = 0; kb < QLOADS; kb += QBATCH) {
            uint4 qv[QBATCH];
            qmla_load_query_chunks(qv, q_lat, q_rope, b, R, rbase, tid, NTH, kb);
#pragma unroll
            for (int k = 0; k < QBATCH; ++k) {
                const int idx = tid + (kb + k) * NTH;
                *(uint4*)(smem + QT_OFF + qmla_kt_chunk(idx / (DT / 8), idx % (DT / 8), RT)) = qv[k];
            }
        }
        auto load_pages = [&](int tt, int (&pgs)[NSEG]) {
            qmla_load_pages(tt, pgs, block_table + (i64)b * bt_stride, L, max_pages, num_pages);
        };
        int pg_next[NSEG];
        if (!prot) {
#if QMLA_QUANT
            // zero the stages once: bytes never copied (missing pages) stay finite codes/scales
            uint4* z4 = (uint4*)smem;
            for (int k = tid; k < NSTAGE * STAGE_BYTES / 16; k += NTH) z4[k] = make_uint4(0u, 0u, 0u, 0u);
            __syncthreads();
#pragma unroll
            for (int s = 0; s < NSTAGE - 1; ++s) {
                load_pages(t_begin + s * T, pg_next);
                if (t_begin + s * T < t_end) qmla_issue_stage(smem + s * STAGE_BYTES, pages, pg_next, t_begin + s * T, L, tid);
                cp_async_commit();
            }
            load_pages(t_begin + (NSTAGE - 1) * T, pg_next);
#else
            load_pages(t_begin, pg_next);  // bf16 pages: the pages of the tile to copy next
#endif
        }

#if QMLA_V4_WGMMA
        // descriptors of this warpgroup's first operands: queries and K from 16-channel run hh (K-major, QK),
        // P (K-major) and K from the first column block of channel half hh (MN-major, PV); hh through a
        // shuffle is provably warp-uniform, so they live in uniform registers and each k-step adds a constant
        const u32 hu = __shfl_sync(0xffffffffu, hh, 0), qt_s = smem_addr(smem + QT_OFF), kt_s = smem_addr(kt);
        const u64 dq = sw128_desc(qt_s + 32 * hu, 16, 1024), dk = sw128_desc(kt_s + 32 * hu, 16, 1024);
        const u64 dp = sw128_desc(smem_addr(smem + PT_OFF), 16, 1024);
        const u64 dv = sw128_desc(kt_s + hu * (DC / 128) * T * 128, T * 128, 1024);
#else
        // ldmatrix lane addresses: queries (A, 16 rows of this row group, channel half hh), key rows
        // (B, tokens 16 p + ...), P (A, rows 32 rh + ...), value rows (B, transposed: tokens are the k pairs)
        const u32 q_lane = smem_addr(smem + QT_OFF) + (16 * rg + (lane & 15)) * KST + 16 * (lane >> 4) + 32 * KSH * hh;
        const u32 k_lane = smem_addr(kt) + ((lane & 7) + 8 * (lane >> 4)) * KST + 16 * ((lane >> 3) & 1) + 32 * KSH * hh;
        const u32 p_lane = smem_addr(smem + PT_OFF) + (32 * rh + (lane & 15)) * PST + 16 * (lane >> 4);
        const u32 v_lane = smem_addr(kt) + ((lane & 7) + 8 * ((lane >> 3) & 1)) * KST + 2 * DQ * dq + 16 * (lane >> 4);
#endif
        float4* xs = (float4*)(smem + XS_OFF);

        int i = 0;
        for (int t0 = t_begin; t0 < t_end; t0 += T, ++i) {
            if (prot) {
                // the tile's protected rows, bf16 [d_c | d_r] as the key tile holds them; other rows zero
                for (int k = tid; k < T * (DT / 8); k += NTH) {
                    const int r = k / (DT / 8), u = k % (DT / 8), n = t0 + r;
                    const u16* src = q_lat;  // any valid address: nothing is read when 0 bytes are copied
                    int bytes = 0;
                    if (n >= keep_lo && n < keep_hi) {  // sid_ok holds: the range is empty otherwise
                        src = (n < sink ? sink_buf + (sid * sink + n) * DT : local_buf + (sid * local + n % local) * DT) + 8 * u;
                        bytes = 16;
                    }
                    cp_async16_zfill(kt + qmla_kt_chunk(r, u, T), src, bytes);
                }
                cp_async_commit();
                cp_async_wait_all();
            } else {
#if QMLA_QUANT
                qmla_wait_group<NSTAGE - 2>();  // this thread's copies of tile i landed
                __syncthreads();  // tile i staged by all; every warp is past the previous tile's PV (K, P free)
                if (t0 + (NSTAGE - 1) * T < t_end) {
                    qmla_issue_stage(smem + ((i + NSTAGE - 1) % NSTAGE) * STAGE_BYTES, pages, pg_next,
                                     t0 + (NSTAGE - 1) * T, L, tid);
                    load_pages(t0 + NSTAGE * T, pg_next);
                }
                cp_async_commit();
                qmla_dequantize_tile(smem + (i % NSTAGE) * STAGE_BYTES, kt, tid);
#else
                __syncthreads();  // every warp is past the previous tile's PV (K, P free)
                v4_copy_bf16_tile(kt, pages, pg_next, t0, L, tid);
                cp_async_commit();
                load_pages(t0 + T, pg_next);
                if (t0 + T < t_end) v4_prefetch_bf16_tile(pages, pg_next, t0 + T, tid);
                cp_async_wait_all();
#endif
            }
#if QMLA_V4_WGMMA
            fence_proxy_async();  // this thread's K (and, the first time, query) stores, for wgmma's reads
#endif
            __syncthreads();  // K visible

            // -------------------------------------------------------- QK: 16 rows x 64 tokens x half the channels
            float S2[8][4];
#pragma unroll
            for (int j = 0; j < 8; ++j) S2[j][0] = S2[j][1] = S2[j][2] = S2[j][3] = 0.0f;
#if QMLA_V4_WGMMA
            // warpgroup hh: all 64 rows x 64 tokens over the odd (hh = 1) or even 16-channel runs, k-step
            // 2 ks + hh (column block ks / 2, 64 bytes per pair of runs): a constant offset from its first,
            // so no branch on hh reaches the wgmma (ptxas serializes wgmma on divergent paths). Warp rg
            // holds rows 16 rg .. 16 rg + 15, the same fragment layout as the mma.sync loop below
            wgmma_fence_operand(S2);
            wgmma_fence();
#pragma unroll
            for (int ks = 0; ks < KSH; ++ks) {
                const u32 off = (ks >> 1) * (T * 128) + 64 * (ks & 1);
                wgmma_m64n64k16_ss<0>(S2, desc_advance(dq, off), desc_advance(dk, off), ks > 0);
            }
            wgmma_commit();
            wgmma_wait<0>();
            wgmma_fence_operand(S2);
#else
#pragma unroll
            for (int ks = 0; ks < KSH; ++ks) {
                u32 a[4];
                ldsm_x4(q_lane + 32 * ks, a[0], a[1], a[2], a[3]);
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4(k_lane + 16 * p * KST + 32 * ks, b0, b1, b2, b3);
                    mma_bf16(S2[2 * p], a, b0, b1);
                    mma_bf16(S2[2 * p + 1], a, b2, b3);
                }
            }
#endif
            // the partner's tokens go to it, its partial scores of ours come back; both add own + other
            // in the same order, so the pair's sums are the sums of one fixed pair of partials
            // (selects, not S2[4 * hh + j]: a register array indexed by a run-time value would live in local memory)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float4 o;
                o.x = hh ? S2[j][0] : S2[4 + j][0];
                o.y = hh ? S2[j][1] : S2[4 + j][1];
                o.z = hh ? S2[j][2] : S2[4 + j][2];
                o.w = hh ? S2[j][3] : S2[4 + j][3];
                xs[(w * 4 + j) * 32 + lane] = o;
            }
            v4_pair_sync(rg);
            float S[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float4 o = xs[(((w + 4) & 7) * 4 + j) * 32 + lane];
                const float ov[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
                for (int k = 0; k < 4; ++k) S[j][k] = hh ? ov[k] + S2[4 + j][k] : S2[j][k] + ov[k];
            }

            // -------------------------------------------------------- mask, row maxima of the pair
            // the wgmma build skips the masks where both rows attend to the whole tile (the mma.sync build,
            // with fewer registers to spare, always masks)
            float mx[2];
            qmla_mask_row_max(S, t0 + 32 * hh, q4, keep_lo, lim, scale_log2,
                              QMLA_V4_WGMMA && t0 >= keep_lo && t0 + T <= min(lim[0], lim[1]), mx);
#pragma unroll
            for (int o = 1; o <= 2; o <<= 1) {
                mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], o));
                mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], o));
            }
            if (q4 == 0) {
                red[hh * RT + rw0] = mx[0];
                red[hh * RT + rw0 + 8] = mx[1];
            }
            v4_pair_sync(rg);  // both halves' maxima of these 16 rows (and the partner's partials read)

            float al[2];
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                qmla_rows_exp(S, fmaxf(m_run[k], fmaxf(red[rw0 + 8 * k], red[RT + rw0 + 8 * k])), k, m_run, l_run, al);
                if (!QMLA_V4_WGMMA && hh == 0 && q4 == 0) red[2 * RT + rw0 + 8 * k] = al[k];  // for the mma.sync PV's warps
            }
#if QMLA_V4_WGMMA
            // P [64 rows][64 tokens], one swizzled 128-byte row per query row; this warp's tokens
            // 32 hh + 8 j + 2 q4 (+ 1) are bytes 4 q4 of chunk 4 hh + j
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                *(u32*)(smem + PT_OFF + sw128_chunk(rw0, 4 * hh + j, RT) + 4 * q4) = pack_bf16x2(S[j][0], S[j][1]);
                *(u32*)(smem + PT_OFF + sw128_chunk(rw0 + 8, 4 * hh + j, RT) + 4 * q4) = pack_bf16x2(S[j][2], S[j][3]);
            }
            fence_proxy_async();
            __syncthreads();  // all of P visible: each warpgroup multiplies every row by every token

            // -------------------------------------------------------- PV: all 64 rows x channel half hh (wgmma)
            qmla_rescale_rows<QMLA_V4_LAZY_RESCALE>(acc, al[0], al[1]);
            // A: P, tokens 16 kk .. 16 kk + 15 per k-step; B: K read MN-major, column blocks DC / 128 * hh ..
            // (LBO 8192 bytes apart)
            wgmma_pv_rows64<DC / 16, T / 16>(acc, dp, dv);
            wgmma_wait<0>();
            wgmma_fence_operand(acc);
#else
            u8* prow = smem + PT_OFF + rw0 * PST + 2 * (32 * hh + 2 * q4);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                *(u32*)(prow + 16 * j) = pack_bf16x2(S[j][0], S[j][1]);
                *(u32*)(prow + 8 * PST + 16 * j) = pack_bf16x2(S[j][2], S[j][3]);
            }
            v4_quad_sync(rh);  // P rows 32 rh .. 32 rh + 31 and their rescale factors visible

            // -------------------------------------------------------- PV: 32 rows x this warp's channel quarter
            float pa[4];  // rescale factors of rows 32 rh + 16 mt + g8 (+ 8)
#pragma unroll
            for (int k = 0; k < 4; ++k) pa[k] = red[2 * RT + 32 * rh + 8 * k + g8];
            if (!QMLA_V4_LAZY_RESCALE ||
                __any_sync(0xffffffffu, pa[0] != 1.0f || pa[1] != 1.0f || pa[2] != 1.0f || pa[3] != 1.0f)) {
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
                    for (int nt = 0; nt < NTP; ++nt) {
                        acc[mt][nt][0] *= pa[2 * mt];
                        acc[mt][nt][1] *= pa[2 * mt];
                        acc[mt][nt][2] *= pa[2 * mt + 1];
                        acc[mt][nt][3] *= pa[2 * mt + 1];
                    }
                }
            }
#pragma unroll
            for (int kk = 0; kk < T / 16; ++kk) {
                u32 a0[4], a1[4];
                ldsm_x4(p_lane + 32 * kk, a0[0], a0[1], a0[2], a0[3]);
                ldsm_x4(p_lane + 16 * PST + 32 * kk, a1[0], a1[1], a1[2], a1[3]);
#pragma unroll
                for (int np = 0; np < NTP / 2; ++np) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4_t(v_lane + 16 * KST * kk + 32 * np, b0, b1, b2, b3);
                    mma_bf16(acc[0][2 * np], a0, b0, b1);
                    mma_bf16(acc[0][2 * np + 1], a0, b2, b3);
                    mma_bf16(acc[1][2 * np], a1, b0, b1);
                    mma_bf16(acc[1][2 * np + 1], a1, b2, b3);
                }
            }
#endif
        }
    }

    // ---------------------------------------------------------------- partial results (v1 layout)
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
        l_run[0] += __shfl_xor_sync(0xffffffffu, l_run[0], o);
        l_run[1] += __shfl_xor_sync(0xffffffffu, l_run[1], o);
    }
    __syncthreads();  // every warp is past its last read of the tiles and of red[]
    if (q4 == 0) {
        red[hh * RT + rw0] = l_run[0];
        red[hh * RT + rw0 + 8] = l_run[1];
        if (hh == 0) {  // both halves hold the same maxima
            red[3 * RT + rw0] = m_run[0];
            red[3 * RT + rw0 + 8] = m_run[1];
        }
    }
    float* ot = (float*)smem;  // [RT][OT_STRIDE]
#if QMLA_V4_WGMMA
#pragma unroll
    for (int n = 0; n < DC / 16; ++n) {
        const int ch = DC / 2 * hh + 8 * n + 2 * q4;
        *(float2*)(ot + rw0 * OT_STRIDE + ch) = make_float2(acc[n][0], acc[n][1]);
        *(float2*)(ot + (rw0 + 8) * OT_STRIDE + ch) = make_float2(acc[n][2], acc[n][3]);
    }
#else
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        const int r0 = 32 * rh + 16 * mt + g8;
#pragma unroll
        for (int nt = 0; nt < NTP; ++nt) {
            const int ch = DQ * dq + 8 * nt + 2 * q4;
            *(float2*)(ot + r0 * OT_STRIDE + ch) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
            *(float2*)(ot + (r0 + 8) * OT_STRIDE + ch) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
        }
    }
#endif
    __syncthreads();
    if (tid < RT && rbase + tid < R) {
        ml_part[((i64)b * R + rbase + tid) * num_splits + split] =
            make_float2(red[3 * RT + tid], red[tid] + red[RT + tid]);
    }
#pragma unroll
    for (int j = 0; j < RT / 16; ++j) {
        qmla_store_partial_rows(o_part, ot + 16 * j * OT_STRIDE, b, R, rbase + 16 * j, num_splits, split, tid);
    }
}
