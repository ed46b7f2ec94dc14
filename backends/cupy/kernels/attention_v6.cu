// QuantMLA CuPy backend: decode attention v6 (many query rows on Hopper: one warpgroup dequantizes
// the next tile while the other attends to this one).
//
// Serves what v4 serves over packed pages (bf16 queries; 2/4-bit content and 4-bit RoPE codes; d_c/d_r
// 512/64 and 256/32), sm_90a. The sink and local-window tokens are the last tiles of one split per row chunk
// (stage.cuh's qmla_protected_split), copied as bf16 rows from the protection buffers into the key tile; no other
// kernel adds them, so v1's qmla_combine merges one partial per split.
//
// ================================================================ design note
// Why: v4 runs each 64-token tile in phases that wait for each other (dequantize, barrier, QK, score
// exchange, softmax, barrier, PV), so the tensor cores idle while the codes are converted and the softmax
// runs (H200, H128 B32 L32K C4R4: 1.43-1.50x FlashInfer BF16).
// Here the two warpgroups of a CTA (64 query rows) split the work by kind and meet at named barriers:
//
//   grid (B * ceil(R / 64), KV splits), or (pieces * ceil(R / 64)) with a piece table (QMLA_V6_PIECES), 256 threads;
//   two key tiles (double buffer), the queries, P:
//   attender (warpgroup 0)                       dequantizer (warpgroup 1)
//                                                codes of tile i + 1 -> registers (global loads), earlier
//   wait FULL[i % 2]; retire its PV(i - 1),      wait EMPTY[(i + 1) % 2] (tile i - 1 is done with it)
//     arrive EMPTY[(i + 1) % 2]                  dequantize tile i + 1 into K[(i + 1) % 2]
//   QK(i): S[64 rows][64 tokens], all channels,  arrive FULL[(i + 1) % 2]; load the codes of tile i + 2
//     36 m64n64k16 (A = queries, B = K)          wait PREADY
//   softmax of its 64 rows (no exchange: a warp  rescale its half of O by alpha(i) (from shared memory)
//     holds whole rows), wait PFREE (PV(i - 1)   PV(i): O[64][d_c/2 ..] += P K, m64n256k16, then waits for it
//     of the dequantizer), P(i), alpha -> smem   arrive PFREE
//   arrive PREADY; rescale its half of O
//   PV(i): O[64][0 .. d_c/2) += P K (async)
// So the dequantization of tile i + 1 runs beside QK(i) and the softmax (and PV(i) when it takes longer). Both halves of O take 128
// accumulators a thread. The barriers are bar.arrive / bar.sync pairs of 256 threads, each used in
// strict alternation (every arrive of one side is matched by the other side's sync before its next one).
// H200 (stop 23, CUDA graphs, sink 4 + local 128, FlashInfer BF16 in the same process): H128 B32 L32K C4R4
// 834.9 us (v4) -> 672.6 (1.43x -> 1.15x FlashInfer), C2R4 802.9 -> 621.7 (1.37x -> 1.06x); H64 B32 L32K C2R4
// 0.99x. Not kept: an L2 prefetch of tile i + 3 by the dequantizer (prefetch.global.L2 of its lines) ran 23-25 %
// slower; reloading each half of the code registers as soon as it was converted (the first half's loads half a
// dequantization earlier), 5-10 % slower; the attender converting the next tile's RoPE block while its QK ran
// (only QK reads it), 0-4 % slower; issuing the dequantizer's PV after 1 or 2 of the next tile's 3 parts
// (QMLA_V6_PV_AT) and reading page ids a tile ahead (QMLA_V6_PAGE_AHEAD), none faster, up to 10 % slower (stop 24).
// Stop 25: the protected tiles inside v6 instead of protected.cu's launch: H128 B32 L32K C4R4 655.7 -> 618.7 us,
// C2R4 620.1 -> 577.7 (0.98x FlashInfer), B8 L4K 54.7 -> 46.4 (CUDA graphs, sink 4 + local 128).
// The attender retires its PV before issuing the next QK: issued while that PV ran, ptxas serialized every
// wgmma of the kernel (C7514: it saw the accumulators read inside the PV's pipeline stage).
// Shared memory (d_c 512): 2 x 72 KB key tiles + 72 KB queries + 8 KB P + 1 KB row factors + 1 KB
// alignment: 226 KB, one CTA per SM; there is no room for a stage, so the dequantizer loads the codes
// straight from the pages into registers.
#include "common.cuh"

#ifndef QMLA_V6_PROBE
// measurement builds (benchmarks/run_h200_kernels.sh v6, never the launcher): 1 skips the dequantization
// (the key tiles keep whatever they hold), 2 skips the code loads (zeros); both give wrong outputs. H200,
// H128 B32 L32K, sink 4 + local 128, CUDA graphs (stop 23): C4R4 664.6 us, 514.4 without the dequantization,
// 547.4 without the loads; C2R4 623.9 / 511.8 / 562.6; FlashInfer BF16 ~585
#define QMLA_V6_PROBE 0
#endif

#ifndef QMLA_V6_PV_AT
// the dequantizer issues its PV of tile i once it has converted this many of tile i + 1's three parts (its two
// tokens' content, then RoPE); 3: after the whole tile (stop 23's order), so its PV and the conversion serialize
#define QMLA_V6_PV_AT 3
#endif
#ifndef QMLA_V6_PAGE_AHEAD
// 1: the page ids of a tile are read from the block table one tile before its codes are loaded
#define QMLA_V6_PAGE_AHEAD 0
#endif
#ifndef QMLA_V6_PROTECTED
// 1: the sink and local-window tokens are tiles of this kernel (stage.cuh's qmla_protected_split); 0: packed tokens
// only, for the launcher's protected-only launch (QUANTMLA_CUPY_V6_PROTECTED=separate, a measurement knob)
#define QMLA_V6_PROTECTED 1
#endif
#ifndef QMLA_V6_PIECES
// 1: each CTA takes its piece of work from the launcher's piece table (a balanced plan, QUANTMLA_CUPY_V6_BALANCE);
// 0: equal splits, split blockIdx.y of request blockIdx.x / (row chunks). Two builds, so that the equal splits' code
// is the kernel as it was before the table (C4R4 at 255 registers: one build serving both spilled more, 4 % slower)
#define QMLA_V6_PIECES 0
#endif
#ifndef QMLA_V6_PAIR
// 1: the two CTAs of a cluster (row chunks 2 c and 2 c + 1 of a request; the launcher pads the chunks to an even
// count) share each packed key tile: each dequantizer converts half of its tokens and stores them into both CTAs'
// key tiles (distributed shared memory), and the key-tile handoffs become cluster mbarriers (see "pair" below)
#define QMLA_V6_PAIR 0
#endif
#ifndef QMLA_V6_MAX_SLACK
// log2 units a row's score may pass the row's reference maximum before the reference moves (v5's QMLA_V5_MAX_SLACK):
// P = 2^(S - reference) stays below 2^slack, which float32 sums and bf16 P hold as well as values <= 1, and while
// no row of a warp moves its factors are 1, so both warpgroups skip their O rescale; 0: every new maximum moves it
// (the launcher's QUANTMLA_CUPY_V6_SLACK passes 0 or V6_MAX_SLACK, 8 by default: H200, H128, CUDA graphs, stop 31,
// 0-2.5 % faster at B8-B128, L4K-128K: C2R4 at every shape, C4R4 but at B32 L32K, where it changed nothing)
#define QMLA_V6_MAX_SLACK 0
#endif
#ifndef QMLA_V6_ROPE_FOLD
// 1: the key tile holds the RoPE channels as exact bf16 (code - z) and the attender multiplies the RoPE part of each
// score (its own accumulator) by the token's float32 scale, which the dequantizer leaves beside the tile; 0: each
// RoPE value dequantized through float32 (two FMUL, two unpacks and a pack per pair). The launcher's
// QUANTMLA_CUPY_V6_ROPE_FOLD (by default for 4-bit content, attention.py's V6_ROPE_FOLD_CONTENT_BITS: with the slack,
// H200 stop 31, C4R4 1-4 % faster from 32K tokens, C2R4 0.5-1.5 % slower; offline SASS, C4R4: the dequantizer's loop
// 1,064 -> 995 instructions a warp and tile, the attender's 861 -> 911); not with QMLA_V6_PAIR
#define QMLA_V6_ROPE_FOLD 0
#endif
#ifndef QMLA_V6_PLAIN_LOADS
// 1: the dequantizer loads every code without a predicate (a token not read takes page 0's bytes, its zero points and
// scales 0) and looks a tile's page up once where pages hold whole tiles (see V6Pages); 0: a token not read loads
// nothing and its registers are zeroed. H200, H128, CUDA graphs, stop 31: C2R4 1.7-2.2 % faster with 1 from 32K
// tokens; with the RoPE fold the registers it takes made ptxas spill into the attender's loop and C4R4 ran 3-4 %
// slower, so the default leaves folding builds at 0
#define QMLA_V6_PLAIN_LOADS (!QMLA_V6_ROPE_FOLD)
#endif
#ifndef QMLA_V6_MERGE
// C >= 1: the CTA writes the attention output and lse itself, with no partials and no combine kernel. The C splits of
// a row chunk (gridDim.y == C) form a cluster (C > 1) and merge their partials through distributed shared memory
// (v6_merge_rows); 0: each CTA writes a partial for qmla_combine (the launcher's QUANTMLA_CUPY_V6_MERGE, plans.py's
// v6_merge_reason)
#define QMLA_V6_MERGE 0
#endif
static_assert(QMLA_V6_PV_AT >= 1 && QMLA_V6_PV_AT <= 3, "QMLA_V6_PV_AT: 1, 2 or 3 parts converted before the PV");
static_assert(QMLA_V6_MAX_SLACK >= 0 && QMLA_V6_MAX_SLACK <= 16, "QMLA_V6_MAX_SLACK: 0 to 16 (P < 2^16 in bf16)");
static_assert(!(QMLA_V6_ROPE_FOLD && QMLA_V6_PAIR), "the RoPE fold is not built into pair kernels");
static_assert(QMLA_V6_MERGE >= 0 && QMLA_V6_MERGE <= 8, "QMLA_V6_MERGE: 0, or 1 to 8 splits (a portable cluster)");
static_assert(!QMLA_V6_MERGE || (QMLA_V6_PROTECTED && !QMLA_V6_PAIR && !QMLA_V6_PIECES),
              "QMLA_V6_MERGE: equal splits without pairs, attending to the sink and local tokens itself");

#define DC QMLA_DC
#define DR QMLA_DR
#define DT (QMLA_DC + QMLA_DR)
#define T 64                  // tokens per tile
#define RT 64                 // query rows per CTA
#define NTH 256               // threads per CTA (stage.cuh's partial-row store)
#define WGT 128               // threads per warpgroup
#define CBITS QMLA_CBITS
#define KCH (8 / CBITS)
#define CB QMLA_CB
#define RB QMLA_RB
#define NCT (CB / 16)         // 16-byte chunks of a content code row
#define NGC (DC / QMLA_GC)
#define CMASK ((CBITS == 4) ? 0x0f0f0f0fu : 0x03030303u)
#define CSZ (QMLA_CSCALE_BF16 ? 2 : 4)
#define RSZ (QMLA_RSCALE_BF16 ? 2 : 4)
#define NCB ((DT + 63) / 64)  // 64-channel column blocks of the key and query tiles
#define KSTEPS (DT / 16)
#define RCK (RB / 16)         // 16-byte chunks of a RoPE code row

#if !QMLA_IN_BF16 || !(QMLA_QUANT && (CBITS == 2 || CBITS == 4) && QMLA_RBITS == 4)
#error "attention_v6.cu serves bf16 queries over 2/4-bit content with 4-bit RoPE codes"
#endif
static_assert(CB == DC * CBITS / 8 && RB == DR / 2, "code bytes per token");
static_assert(CB % 64 == 0 && (RB == 16 || RB == 32), "d_c 256/512 and d_r 32/64");
static_assert(QMLA_GC % 16 == 0, "a 16-channel dequantized run must lie inside one scale group");
static_assert(QMLA_GR == DR, "one RoPE group per token");
static_assert(NCT % 4 == 0 && T * RCK <= WGT, "code rows of whole 64-byte groups; one RoPE chunk per thread at most");

#include "wgmma.cuh"
#include "stage.cuh"  // qmla_table_page, OT_STRIDE, qmla_store_partial_rows
#define QMLA_KT_SW128 1
#include "tile_dequant.cuh"  // qmla_dq16, qmla_store16, qmla_store_rope_chunk
#if QMLA_V6_PAIR || QMLA_V6_MERGE > 1
#include "cluster.cuh"
#endif
#if QMLA_V6_PAIR
#define V6_CLUSTER __cluster_dims__(2, 1, 1)
#elif QMLA_V6_MERGE > 1
#define V6_CLUSTER __cluster_dims__(1, QMLA_V6_MERGE, 1)
#else
#define V6_CLUSTER
#endif

// ---------------------------------------------------------------- shared memory layout (1024-byte aligned base)
#define KT_BYTES (T * NCB * 128)         // one key tile, bf16 [NCB][T][64], 128-byte swizzle
#define QT_OFF (2 * KT_BYTES)            // queries, bf16 [NCB][RT][64]
#define PT_OFF (QT_OFF + RT * NCB * 128)  // P, bf16 [RT][T]: one swizzled 128-byte row per query row
#define AL_OFF (PT_OFF + RT * T * 2)     // float [RT]: the rows' rescale factors of the current tile
#define RED_OFF (AL_OFF + RT * 4)        // float [2][RT]: row maxima and sums, for the partials
#define RS_OFF (RED_OFF + 2 * RT * 4)     // QMLA_V6_ROPE_FOLD: float [2][T], the RoPE scales of each key tile's tokens
#define MB_OFF (RS_OFF + (QMLA_V6_ROPE_FOLD ? 2 * T * 4 : 0))  // pair builds: u64 mbarriers FULL[2], EMPTY[2]
#define SMEM_TOTAL (MB_OFF + (QMLA_V6_PAIR ? 32 : 0) + 1024)
#ifdef QMLA_V6_SMEM
static_assert(SMEM_TOTAL == QMLA_V6_SMEM, "launcher's v6_smem_bytes() disagrees with the kernel's layout");
#endif
static_assert(SMEM_TOTAL <= 227 * 1024, "shared memory per block");
static_assert(RT * OT_STRIDE * 4 <= QT_OFF, "the partial-output tile reuses the key tiles");

// named barriers (ids 1-6), each of both warpgroups: one side arrives, the other waits. compute-sanitizer's racecheck
// does not take an arrive -> sync pair as ordering: it reports the rescale factors' handoff (PREADY / PFREE) as RAW
// hazards, as it does for a race-free 30-line kernel with the same handoff (RESULTS.md, stop 39)
#define BAR_FULL 1    // + buffer: key tile dequantized (dequantizer -> attender)
#define BAR_EMPTY 3   // + buffer: the attender is done with a key tile (attender -> dequantizer)
#define BAR_PREADY 5  // P and the rescale factors of the tile written (attender -> dequantizer)
#define BAR_PFREE 6   // the dequantizer's PV of the tile retired: P may be rewritten (dequantizer -> attender)
#define QLOADS (RT * (DT / 8) / NTH)  // 16-byte query loads per thread
static_assert(RT * (DT / 8) % NTH == 0, "the threads load the queries in equal shares");
__device__ __forceinline__ void v6_arrive(int id) { asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void v6_wait(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }

// ---------------------------------------------------------------- the dequantizer's codes of one tile
// Thread p of the dequantizer takes tokens p / 4 and p / 4 + 32 of a tile and, of each, the content chunks
// uu + 4 r (uu = p % 4) and the token's zero points and scales; and RoPE chunk p % RCK of token p / RCK.
// Eight consecutive threads (two tokens x four chunk columns) store to eight different 16-byte groups of
// the swizzled key tile (tile_dequant.cuh's mapping).
#define ZW ((NGC + 3) / 4)         // words of a token's content zero points
#define SW ((NGC * CSZ + 3) / 4)   // words of its content scales
struct V6Rope {
    uint4 c;    // RoPE chunk p % RCK of token p / RCK
    u32 z, s;   // its zero point and scale (raw bits)
};
struct V6Codes {
    uint4 c[2][NCT / 4];  // content chunks uu + 4 r of the thread's two tokens
    u32 z[2][ZW];         // their zero points (all groups)
    u32 s[2][SW];         // their scales (raw bits)
    V6Rope r;             // the RoPE chunk
};

// N bytes (2 to 32, a power of two, N-aligned) at p as words
template <int N>
__device__ __forceinline__ void v6_load_row(const u8* p, u32* w) {
    if constexpr (N >= 16) {
#pragma unroll
        for (int k = 0; k < N / 16; ++k) {
            const uint4 v = ((const uint4*)p)[k];
            w[4 * k] = v.x, w[4 * k + 1] = v.y, w[4 * k + 2] = v.z, w[4 * k + 3] = v.w;
        }
    } else if constexpr (N == 8) {
        const uint2 v = *(const uint2*)p;
        w[0] = v.x, w[1] = v.y;
    } else if constexpr (N == 4) {
        w[0] = *(const u32*)p;
    } else {
        static_assert(N == 2, "2 to 32 bytes");
        w[0] = *(const u16*)p;
    }
}

// page and slot of token n of request row bt_row, or page < 0 where it is not read (past L, past the
// table, a page outside the pool)
__device__ __forceinline__ const u8* v6_token_page(int n, const u8* __restrict__ pages, const int* __restrict__ bt_row,
                                                   int L, int max_pages, int num_pages) {
    const int pg = qmla_table_page(n, bt_row, L, max_pages);
    return (pg >= 0 && pg < num_pages) ? pages + (i64)pg * QMLA_PAGE_BYTES : nullptr;
}

// the pages thread p reads its codes of tile tt from, and whether each of its tokens is read (inside L, on a page of
// the pool). QMLA_V6_PLAIN_LOADS: a token not read still loads its codes, finite whatever they are, from its slot of
// page 0 (num_pages >= 1), so the code loads need no predicate and their registers no zeroing; its zero points and
// scales are 0, so its keys dequantize to 0 (P is 0 there, and 0 x a stale NaN could poison PV); where pages hold whole
// tiles (P a multiple of T) one lookup of the block table serves the thread's three tokens. Else a page not read is
// nullptr (v6_token_page) and the loads zero its registers.
struct V6Pages {
    const u8* c[2];  // tokens tt + p / 4 and tt + p / 4 + 32
    const u8* r;     // token tt + p / RCK (its RoPE chunk)
    bool ok[2], rok;
};
// page id pg's base, or page 0's where pg is not in the pool (ok: it is)
__device__ __forceinline__ const u8* v6_page_or_0(int pg, const u8* __restrict__ pages, int num_pages, bool& ok) {
    ok = QMLA_V6_PROBE != 2 && pg >= 0 && pg < num_pages;  // probe 2: every token past L, nothing read
    return pages + (i64)(ok ? pg : 0) * QMLA_PAGE_BYTES;
}
__device__ __forceinline__ V6Pages v6_pages(int tt, const u8* __restrict__ pages, const int* __restrict__ bt_row, int L,
                                            int max_pages, int num_pages, int p) {
    V6Pages g;
    if constexpr (!QMLA_V6_PLAIN_LOADS) {
        if (QMLA_V6_PROBE == 2) {  // every token past L: nothing read
            g.c[0] = g.c[1] = g.r = nullptr;
            return g;
        }
#pragma unroll
        for (int k = 0; k < 2; ++k) g.c[k] = v6_token_page(tt + (p >> 2) + 32 * k, pages, bt_row, L, max_pages, num_pages);
        g.r = p < T * RCK ? v6_token_page(tt + p / RCK, pages, bt_row, L, max_pages, num_pages) : nullptr;
        return g;
    }
    const int n[3] = {tt + (p >> 2), tt + (p >> 2) + 32, tt + p / RCK};
    if constexpr (QMLA_P % T == 0) {
        bool ok;
        g.c[0] = g.c[1] = g.r = v6_page_or_0(qmla_table_page(tt, bt_row, L, max_pages), pages, num_pages, ok);
        g.ok[0] = ok && n[0] < L;
        g.ok[1] = ok && n[1] < L;
        g.rok = ok && n[2] < L;
    } else {
#pragma unroll
        for (int k = 0; k < 2; ++k) g.c[k] = v6_page_or_0(qmla_table_page(n[k], bt_row, L, max_pages), pages, num_pages, g.ok[k]);
        g.r = v6_page_or_0(qmla_table_page(n[2], bt_row, L, max_pages), pages, num_pages, g.rok);
    }
    g.rok = g.rok && p < T * RCK;
    return g;
}

// ---------------------------------------------------------------- a CTA's tiles: packed, then protected
// A CTA's tiles come in up to three segments: its run of packed tiles, then, in the split stage.cuh's
// qmla_protected_split picks, the tiles of the sink [0, sink_end) and those the local window [local_start, L)
// touches, whose rows come from the bf16 protection buffers. [lo, hi): the tokens a segment's tiles attend to (a
// row's causal limit comes on top). Each role runs the packed tiles in a loop of their own (loop-invariant masks;
// no protected copy in the dequantizer's): on the H200 one loop over all tiles ran 7 % slower over packed tiles
// (stop 25).
struct V6Seg {
    int t0, n, lo, hi;  // first tile's token, tiles, attended tokens [lo, hi)
};
struct V6Span {
    int t_begin, np, ns, nl;  // the first packed tile's token; packed, sink and local tiles
    int keep_lo, keep_hi, L;  // packed tokens [keep_lo, keep_hi) = [sink_end, local_start); L
};
__device__ __forceinline__ V6Seg v6_segment(const V6Span& s, int k) {
    if (k == 0) return {s.t_begin, s.np, s.keep_lo, s.keep_hi};
    if (k == 1) return {0, s.ns, 0, s.keep_lo};
    return {s.keep_hi / T * T, s.nl, s.keep_hi, s.L};
}
// protected tile j (0 .. ns + nl - 1) as a one-tile segment
__device__ __forceinline__ V6Seg v6_protected_tile(const V6Span& s, int j) {
    const V6Seg g = v6_segment(s, j < s.ns ? 1 : 2);
    return {g.t0 + (j < s.ns ? j : j - s.ns) * T, 1, g.lo, g.hi};
}

// where the protected rows live: token n < sink at sink[n], else local[n % local] (a ring), bf16 [d_c | d_r]
struct V6Prot {
    const u16* sink;   // this request's sink rows
    const u16* local;  // its local-window ring
    int nsink, nlocal;
};

// 16-byte cp.async from global address g + GOFF to shared address s + SOFF (bytes 0 or 16; the rest zero-filled):
// the offsets are immediates of the instruction
template <int SOFF, int GOFF>
__device__ __forceinline__ void v6_cp16(u32 s, u64 g, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0+%3], [%1+%4], 16, %2;" ::"r"(s), "l"(g), "r"(bytes), "n"(SOFF), "n"(GOFF)
                 : "memory");
}
// chunks 8 m + 2 k + h (J = 4 m + k) of a protected row: column block m of the key tile, swizzled place dst[k]
template <int J>
__device__ __forceinline__ void v6_copy_row_chunks(const u32 (&dst)[4], u64 g, int bytes) {
    if constexpr (J < DT / 16) {
        v6_cp16<(J >> 2) * T * 128, 32 * J>(dst[J & 3], g, bytes);
        v6_copy_row_chunks<J + 1>(dst, g, bytes);
    }
}

// the protected rows of tile tl (a one-tile segment) -> the key tile kt by cp.async, two threads a row (16-byte
// chunks p % 2 + 2 j; rows outside [lo, hi): zeros, their copies read 0 bytes of a row inside [lo, hi), which
// every protected tile overlaps); waits for this thread's copies. QMLA_V6_ROPE_FOLD: the rows' RoPE scales rsc[] are
// 1 (their RoPE values are bf16 already)
static_assert(DT % 16 == 0 && WGT == 2 * T, "two threads per protected row, 16-byte chunks");
__device__ __forceinline__ void v6_copy_protected(u8* kt, const V6Seg& tl, const V6Prot& pr, int p, float* rsc) {
    if (QMLA_V6_ROPE_FOLD && (p & 1) == 0) rsc[p >> 1] = 1.0f;
    const int r = p >> 1, n = tl.t0 + r, h = p & 1;
    const int nc = min(max(n, tl.lo), tl.hi - 1);  // a protected row of the tile (lo < hi)
    const u16* src = (nc < pr.nsink ? pr.sink + (i64)nc * DT : pr.local + (i64)(nc % pr.nlocal) * DT) + 8 * h;
    u64 g;
    asm("cvta.to.global.u64 %0, %1;" : "=l"(g) : "l"(src));
    u32 dst[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) dst[k] = smem_addr(kt) + r * 128 + (((2 * k + h) ^ (r & 7)) << 4);
    v6_copy_row_chunks<0>(dst, g, n >= tl.lo && n < tl.hi ? 16 : 0);
    cp_async_commit();
    cp_async_wait_all();
}

// thread p's RoPE chunk of tile tt from page pg (its zero point and scale 0 where not read, as v6_load_codes)
__device__ __forceinline__ void v6_load_rope(V6Rope& r, const u8* pg, bool ok, int tt, int p) {
    if constexpr (!QMLA_V6_PLAIN_LOADS) {
        r.c = make_uint4(0u, 0u, 0u, 0u);
        r.z = r.s = 0u;
        if (pg) {
            const u32 s = QMLA_SLOT(tt + p / RCK);
            r.c = *(const uint4*)(pg + QMLA_OFF_RC + s * RB + 16 * (p % RCK));
            r.z = pg[QMLA_OFF_RZ + s];
            r.s = QMLA_RSCALE_BF16 ? (u32)((const u16*)(pg + QMLA_OFF_RS))[s] : ((const u32*)(pg + QMLA_OFF_RS))[s];
        }
        return;
    }
    const u32 s = QMLA_SLOT(tt + p / RCK);
    r.c = *(const uint4*)(pg + QMLA_OFF_RC + s * RB + 16 * (p % RCK));
    r.z = r.s = 0u;
    if (ok) {
        r.z = pg[QMLA_OFF_RZ + s];
        r.s = QMLA_RSCALE_BF16 ? (u32)((const u16*)(pg + QMLA_OFF_RS))[s] : ((const u32*)(pg + QMLA_OFF_RS))[s];
    }
}

// thread p's RoPE chunk -> column block DC / 64 of the key tile kt as bf16 s * (code - z) (float scale: products and
// one rounding) or, with QMLA_V6_ROPE_FOLD, as exact (code - z) with the token's scale to rsc[token]
__device__ __forceinline__ void v6_dequantize_rope(const V6Rope& r, u8* kt, float* rsc, int p) {
    if (QMLA_V6_PROBE == 1) return;
    if (p < T * RCK) {
        const float s = QMLA_RSCALE_BF16 ? bf16_bits_to_f32(r.s) : __uint_as_float(r.s);
#if QMLA_V6_ROPE_FOLD
        qmla_store_rope_chunk_exact(kt, p / RCK, p % RCK, r.c, r.z);
        if (p % RCK == 0) rsc[p / RCK] = s;
#else
        qmla_store_rope_chunk(kt, p / RCK, p % RCK, r.c, r.z, s);
#endif
    }
}

// the thread's codes of tile tt from the pages g (tokens not read: zero points and scales 0 and, without
// QMLA_V6_PLAIN_LOADS, codes 0, see V6Pages; probe 2: no loads, every register 0)
__device__ __forceinline__ void v6_load_codes(V6Codes& r, const V6Pages& g, int tt, int p) {
    if (QMLA_V6_PLAIN_LOADS && QMLA_V6_PROBE == 2) {
        r = V6Codes{};
        return;
    }
    const int uu = p & 3;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const u32 s = QMLA_SLOT(tt + (p >> 2) + 32 * k);
        const u8* page = g.c[k];
#pragma unroll
        for (int q = 0; q < NCT / 4; ++q) {
            r.c[k][q] = (QMLA_V6_PLAIN_LOADS || page) ? *(const uint4*)(page + QMLA_OFF_CC + s * CB + 16 * (uu + 4 * q))
                                                      : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int q = 0; q < ZW; ++q) r.z[k][q] = 0u;
#pragma unroll
        for (int q = 0; q < SW; ++q) r.s[k][q] = 0u;
        if (QMLA_V6_PLAIN_LOADS ? g.ok[k] : page != nullptr) {
            v6_load_row<NGC>(page + QMLA_OFF_CZ + s * NGC, r.z[k]);
            v6_load_row<NGC * CSZ>(page + QMLA_OFF_CS + s * NGC * CSZ, r.s[k]);
        }
    }
    v6_load_rope(r.r, g.r, QMLA_V6_PLAIN_LOADS && g.rok, tt, p);
}

// loads the thread's codes of tile tt; g: their pages, looked up here or, with QMLA_V6_PAGE_AHEAD, by the previous
// call (then it looks up tile tt + T's for the next one)
__device__ __forceinline__ void v6_next_codes(V6Codes& r, V6Pages& g, int tt, const u8* __restrict__ pages,
                                              const int* __restrict__ bt_row, int L, int max_pages, int num_pages, int p) {
    if (!QMLA_V6_PAGE_AHEAD) g = v6_pages(tt, pages, bt_row, L, max_pages, num_pages, p);
    v6_load_codes(r, g, tt, p);
    if (QMLA_V6_PAGE_AHEAD) g = v6_pages(tt + T, pages, bt_row, L, max_pages, num_pages, p);
}

// element i of BITS bits (8, 16 or 32) of the words w, by selects (a register array indexed at run time
// would live in local memory; a compile-time i folds to one shift)
template <int BITS, int N>
__device__ __forceinline__ u32 v6_pick(const u32 (&w)[N], int i) {
    constexpr int PER = 32 / BITS;
    u32 v = w[0];
#pragma unroll
    for (int q = 1; q < N; ++q) v = (i / PER == q) ? w[q] : v;
    return BITS == 32 ? v : (v >> (BITS * (i % PER))) & ((1u << BITS) - 1u);
}

// part k (0, 1) of the thread's codes, its token k's content, -> the key tile kt as bf16 s * (code - z), rounded
// once (qmla_store16); part 2 is its RoPE chunk
__device__ __forceinline__ void v6_dequantize_token(const V6Codes& r, u8* kt, int p, int k) {
    if (QMLA_V6_PROBE == 1) return;
    const int uu = p & 3;
    const int t = (p >> 2) + 32 * k;
    u8* lo = kt + sw128_chunk(t, 2 * uu, T);  // channels 16 uu .. 16 uu + 7 of column block 0
    u8* hi = kt + sw128_chunk(t, 2 * uu + 1, T);
#pragma unroll
    for (int q = 0; q < NCT / 4; ++q) {
        const uint4 v = r.c[k][q];
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int c = 0; c < KCH; ++c) {
            // channels CB c + 64 q + 16 uu ..: column block CB c / 64 + q; their group (16 | GC, 16 uu < 64)
            const int blk = CB * c / 64 + q;
            const u32 x[4] = {(w[0] >> (CBITS * c)) & CMASK, (w[1] >> (CBITS * c)) & CMASK,
                              (w[2] >> (CBITS * c)) & CMASK, (w[3] >> (CBITS * c)) & CMASK};
            // their group: a compile-time index where groups are 64 channels or wider, else uu picks it
            const int grp = (CB * c + 64 * q) / QMLA_GC + (16 * uu) / QMLA_GC;
            const u32 z = v6_pick<8>(r.z[k], grp);
            const u32 off2 = 0xc300c300u | z | (z << 16);
#if QMLA_CSCALE_BF16
            const u32 sb = v6_pick<16>(r.s[k], grp);
            qmla_store16<false>(lo + blk * (T * 128), hi + blk * (T * 128), x, off2, sb | (sb << 16), 0.0f, false);
#else
            qmla_store16<true>(lo + blk * (T * 128), hi + blk * (T * 128), x, off2, 0u,
                               __uint_as_float(v6_pick<32>(r.s[k], grp)), false);
#endif
        }
    }
}

// parts [P0, P1) of the thread's codes -> the key tile kt (rsc: its RoPE scales, QMLA_V6_ROPE_FOLD)
template <int P0, int P1>
__device__ __forceinline__ void v6_dequantize(const V6Codes& r, u8* kt, float* rsc, int p) {
#pragma unroll
    for (int part = P0; part < P1; ++part) {
        if (part < 2) {
            v6_dequantize_token(r, kt, p, part);
        } else {
            v6_dequantize_rope(r.r, kt, rsc, p);
        }
    }
}

#if QMLA_V6_PAIR
// ---------------------------------------------------------------- pair: two CTAs share each packed key tile
// CTA rank k of the cluster dequantizes tokens 32 k .. 32 k + 31 of every packed tile: thread p takes token
// 32 k + p / 4, its content chunks uu + 4 r (uu = p % 4) and nibble plane p % 2 of its RoPE chunk (p / 2) % 2,
// and stores them into its own key tile; then one lane of each warp sends the warp's 8 rows of every column block
// (1 KB each, contiguous in the swizzled tile) to the same place in the peer's key tile by bulk copies. Protected
// tiles are copied by each CTA for itself. The handoffs of a key tile buffer b are mbarriers of each CTA:
//   FULL[b]  (4 arrivals): the own dequantizer warps, once their stores are fenced; for a packed tile each also
//            expects the bytes the peer's warp sends (V6_PEER_BYTES), which the peer's bulk copies count off as they
//            land. The attender waits on its own.
//   EMPTY[b] (12 arrivals): tile b + 2 j is done with in both CTAs: the own attender's 4 warps, the peer
//            attender's 4 and the peer dequantizer's 4 (its PV); the dequantizer waits on its own before it writes
//            both CTAs' buffer b. Its own PV is behind it in program order.
// Each phase is awaited before the next can start (a buffer is rewritten only after its waiter has seen it), so
// parities do not alias.
struct V6Half {
    uint4 c[NCT / 4];  // content chunks uu + 4 r of the thread's token
    u32 z[ZW];         // its zero points (all groups)
    u32 s[SW];         // its scales (raw bits)
    uint4 r;           // its RoPE chunk (p / 2) % 2 (zeros where the chunk does not exist)
    u32 rz, rs;        // the RoPE zero point and scale
};

// thread p's codes of tile tt in CTA rank k (a token not read: zeros, see v6_load_codes)
__device__ __forceinline__ void v6_half_load(V6Half& h, int tt, int k, const u8* __restrict__ pages,
                                             const int* __restrict__ bt_row, int L, int max_pages, int num_pages, int p) {
    const int n = tt + 32 * k + (p >> 2), uu = p & 3, u = (p >> 1) & 1, s = n % QMLA_P;
    const u8* page = QMLA_V6_PROBE == 2 ? nullptr : v6_token_page(n, pages, bt_row, L, max_pages, num_pages);
#pragma unroll
    for (int q = 0; q < NCT / 4; ++q) {
        h.c[q] = page ? *(const uint4*)(page + QMLA_OFF_CC + s * CB + 16 * (uu + 4 * q)) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int q = 0; q < ZW; ++q) h.z[q] = 0u;
#pragma unroll
    for (int q = 0; q < SW; ++q) h.s[q] = 0u;
    h.r = make_uint4(0u, 0u, 0u, 0u);
    h.rz = h.rs = 0u;
    if (page) {
        v6_load_row<NGC>(page + QMLA_OFF_CZ + s * NGC, h.z);
        v6_load_row<NGC * CSZ>(page + QMLA_OFF_CS + s * NGC * CSZ, h.s);
        if (u < RCK) {
            h.r = *(const uint4*)(page + QMLA_OFF_RC + s * RB + 16 * u);
            h.rz = page[QMLA_OFF_RZ + s];
            h.rs = QMLA_RSCALE_BF16 ? (u32)((const u16*)(page + QMLA_OFF_RS))[s] : ((const u32*)(page + QMLA_OFF_RS))[s];
        }
    }
}

// bytes one dequantizer warp sends its peer per packed tile: its 8 rows (1 KB) of every column block
#define V6_PEER_BYTES (NCB * 8 * 128)

// 16 dequantized channels at bytes lo (channels 0..7) and hi (8..15) of the key tile at shared address kts
__device__ __forceinline__ void v6_put16(u32 kts, int lo, int hi, const u32 (&o)[8]) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(kts + lo), "r"(o[0]), "r"(o[1]), "r"(o[2]), "r"(o[3])
                 : "memory");
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(kts + hi), "r"(o[4]), "r"(o[5]), "r"(o[6]), "r"(o[7])
                 : "memory");
}

// thread p's half-tile codes -> the key tile at shared address kts, as v6_dequantize_token and
// qmla_store_rope_chunk convert them
__device__ __forceinline__ void v6_half_dequantize(const V6Half& h, u32 kts, int k, int p) {
    if (QMLA_V6_PROBE == 1) return;
    const int uu = p & 3, t = 32 * k + (p >> 2);
    const int lo = sw128_chunk(t, 2 * uu, T), hi = sw128_chunk(t, 2 * uu + 1, T);
#pragma unroll
    for (int q = 0; q < NCT / 4; ++q) {
        const u32 w[4] = {h.c[q].x, h.c[q].y, h.c[q].z, h.c[q].w};
#pragma unroll
        for (int c = 0; c < KCH; ++c) {
            const int blk = CB * c / 64 + q;
            const u32 x[4] = {(w[0] >> (CBITS * c)) & CMASK, (w[1] >> (CBITS * c)) & CMASK,
                              (w[2] >> (CBITS * c)) & CMASK, (w[3] >> (CBITS * c)) & CMASK};
            const int grp = (CB * c + 64 * q) / QMLA_GC + (16 * uu) / QMLA_GC;
            const u32 z = v6_pick<8>(h.z, grp);
            const u32 off2 = 0xc300c300u | z | (z << 16);
            u32 o[8];
#if QMLA_CSCALE_BF16
            const u32 sb = v6_pick<16>(h.s, grp);
            qmla_dq16<false>(x, off2, sb | (sb << 16), 0.0f, o);
#else
            qmla_dq16<true>(x, off2, 0u, __uint_as_float(v6_pick<32>(h.s, grp)), o);
#endif
            v6_put16(kts, lo + blk * (T * 128), hi + blk * (T * 128), o);
        }
    }
    const int u = (p >> 1) & 1, c = p & 1;
    if (u < RCK) {
        const u32 w[4] = {h.r.x, h.r.y, h.r.z, h.r.w};
        const u32 x[4] = {(w[0] >> (4 * c)) & 0x0f0f0f0fu, (w[1] >> (4 * c)) & 0x0f0f0f0fu,
                          (w[2] >> (4 * c)) & 0x0f0f0f0fu, (w[3] >> (4 * c)) & 0x0f0f0f0fu};
        const int chunk = (DC + RB * c + 16 * u) / 8;
        u32 o[8];
        qmla_dq16<true>(x, 0xc300c300u | h.rz | (h.rz << 16), 0u,
                        QMLA_RSCALE_BF16 ? bf16_bits_to_f32(h.rs) : __uint_as_float(h.rs), o);
        v6_put16(kts, qmla_kt_chunk(t, chunk, T), qmla_kt_chunk(t, chunk + 1, T), o);
    }
}

// the mbarriers of this CTA (shared addresses): FULL[b] at full + 8 b, EMPTY[b] at full + 16 + 8 b; the peer's at
// the same addresses + delta
#define V6_FULL(mb, b) ((mb) + 8u * (b))
#define V6_EMPTY(mb, b) ((mb) + 16u + 8u * (b))

// the dequantizer: its stores to key tile buffer b (at shared address kt) fenced; packed: the peer's bytes expected,
// and this warp's rows (32 k + 8 w ..) of every column block sent to the peer (its FULL[b] counts them)
__device__ __forceinline__ void v6_pair_full(u32 mb, u32 delta, u32 kt, int b, bool packed, int k, int w, int lane) {
    fence_proxy_async();  // the stores, for the bulk copies' and the attender's wgmma reads (async proxy)
    __syncwarp();
    if (lane == 0) {
        if (packed) {
            mbar_arrive_expect_tx(V6_FULL(mb, b), V6_PEER_BYTES);
            const u32 rows = kt + (32 * k + 8 * w) * 128;
#pragma unroll
            for (int cb = 0; cb < NCB; ++cb) {
                bulk_copy_to_peer(rows + cb * (T * 128) + delta, rows + cb * (T * 128), 8 * 128, V6_FULL(mb, b) + delta);
            }
        } else {
            mbar_arrive(V6_FULL(mb, b));
        }
    }
}
// the attender: done with the tile in buffer b (its QK and PV retired), in both CTAs' EMPTY[b]
__device__ __forceinline__ void v6_pair_attender_done(u32 mb, u32 delta, int b, int lane) {
    __syncwarp();
    if (lane == 0) {
        mbar_arrive(V6_EMPTY(mb, b));
        mbar_arrive(V6_EMPTY(mb, b) + delta);
    }
}
// the dequantizer: its PV of the tile in buffer b retired, in the peer's EMPTY[b] (its own waits follow it)
__device__ __forceinline__ void v6_pair_pv_done(u32 mb, u32 delta, int b, int lane) {
    __syncwarp();
    if (lane == 0) mbar_arrive(V6_EMPTY(mb, b) + delta);
}
// phase parity of "tile j written" (FULL[j % 2]) and of "tile j done" (EMPTY[j % 2])
__device__ __forceinline__ u32 v6_parity(int j) { return (u32)(j >> 1) & 1u; }
#endif

// O[64 rows][this warpgroup's half of d_c] += P K (A = P, K-major; B = the key tile read MN-major)
__device__ __forceinline__ void v6_pv(float (&acc)[DC / 16][4], u64 dp, u64 dv) { wgmma_pv_rows64<DC / 16, T / 16>(acc, dp, dv); }

// The CTA's piece of work (see qmla_attn_v6): from the piece table (QMLA_V6_PIECES), or with equal splits split
// blockIdx.y of request blockIdx.x / nchk. The table entry is read by an instruction the compiler may not merge with
// another read, so that the kernel reads it again at its end instead of keeping it across the tiles.
__device__ __forceinline__ int4 v6_piece(const int4* __restrict__ pieces, int nchk, int tiles_per_split) {
    if (!QMLA_V6_PIECES) {
        return make_int4((int)blockIdx.x / nchk, (int)blockIdx.y * tiles_per_split, ((int)blockIdx.y + 1) * tiles_per_split,
                         (int)blockIdx.y);
    }
    int4 e;
    asm volatile("ld.global.nc.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(e.x), "=r"(e.y), "=r"(e.z), "=r"(e.w) : "l"(pieces + blockIdx.x / nchk));
    return e;
}

#if QMLA_V6_MERGE
#define V6_MERGE_ROWS ((RT + QMLA_V6_MERGE - 1) / QMLA_V6_MERGE)  // rows each CTA of a merging cluster writes
__host__ __device__ constexpr int v6_pow2_at_least(int n) { return n <= 1 ? 1 : 2 * v6_pow2_at_least((n + 1) / 2); }
__host__ __device__ constexpr int v6_pow2_at_most(int n) { return n <= 1 ? 1 : 2 * v6_pow2_at_most(n / 2); }
// The output rows and lse of request b's row chunk at rbase, from the partials its C = QMLA_V6_MERGE splits staged in
// their shared memory (ot: [RT][OT_STRIDE] unnormalized outputs, red: [2][RT] row maxima then sums). CTA k of the
// cluster (split k) merges rows k V6_MERGE_ROWS .. of all C, in split order (common.cuh's merge: bit-identical to
// qmla_combine over the same partials); rows >= R are skipped. All NTH threads take part, in one pass: TPR threads a
// row, each 4 channels of every TPR-th 16-byte chunk, with the loads of MQ chunks of all C partials in flight at
// once (distributed shared memory answers in about a global load's time: the first build, a row per 128 threads in
// four dependent passes at C = 8, cost what the combine saved; H100, stop 62)
__device__ __forceinline__ void v6_merge_rows(const float* ot, const float* red, u16* __restrict__ out,
                                              float* __restrict__ lse, int b, int R, int rbase, int tid) {
    constexpr int C = QMLA_V6_MERGE;
    constexpr int TPR = NTH / v6_pow2_at_least(V6_MERGE_ROWS), NQ = DC / 4 / TPR;
    constexpr int MQ = v6_pow2_at_most(NQ < 32 / C ? NQ : 32 / C);  // <= 32 chunks: 128 registers of loads
    static_assert(TPR >= 1 && (DC / 4) % TPR == 0 && NQ % MQ == 0, "whole chunks a thread, whole batches");
#if QMLA_V6_MERGE > 1
    cluster_sync_all();  // every split's partial staged (release / acquire across the cluster)
    const int rank = (int)cluster_ctarank();
    const u32 ot_s = smem_addr(ot), red_s = smem_addr(red);
    u32 delta[C];
#pragma unroll
    for (int k = 0; k < C; ++k) delta[k] = cluster_peer_delta(ot_s, (u32)k);
#else
    __syncthreads();
    const int rank = 0;
#endif
    const int rr = tid / TPR, j = tid % TPR, row = rank * V6_MERGE_ROWS + rr;
    if (rr < V6_MERGE_ROWS && row < RT && rbase + row < R) {
        float2 ml[C];
#pragma unroll
        for (int k = 0; k < C; ++k) {
#if QMLA_V6_MERGE > 1
            ml[k] = make_float2(ld_cluster_f32(red_s + 4 * row + delta[k]),
                                ld_cluster_f32(red_s + 4 * (RT + row) + delta[k]));
#else
            ml[k] = make_float2(red[row], red[RT + row]);
#endif
        }
        const float2 st = qmla_merge_stats(ml, C);
        const i64 orow = (i64)b * R + rbase + row;
        if (j == 0) lse[orow] = qmla_merged_lse(st);
#pragma unroll
        for (int q0 = 0; q0 < NQ; q0 += MQ) {
            float4 o[MQ][C];
#pragma unroll
            for (int q = 0; q < MQ; ++q) {
                const int c4 = j + TPR * (q0 + q);
#pragma unroll
                for (int k = 0; k < C; ++k) {
#if QMLA_V6_MERGE > 1
                    o[q][k] = ld_cluster_f32x4(ot_s + 4 * (row * OT_STRIDE + 4 * c4) + delta[k]);
#else
                    o[q][k] = *(const float4*)(ot + row * OT_STRIDE + 4 * c4);
#endif
                }
            }
#pragma unroll
            for (int q = 0; q < MQ; ++q) {
                float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                for (int k = 0; k < C; ++k) qmla_combine_add(a, ml[k], st.x, o[q][k]);
                *(uint2*)(out + orow * DC + 4 * (j + TPR * (q0 + q))) = qmla_merged_bf16x4(a, st.y);
            }
        }
    }
#if QMLA_V6_MERGE > 1
    cluster_sync_all();  // no CTA leaves while a peer still reads its shared memory
#endif
}
#endif

extern "C" __global__ void V6_CLUSTER __launch_bounds__(NTH, 1) qmla_attn_v6(
    const u16* __restrict__ q_lat, const u16* __restrict__ q_rope, const u8* __restrict__ pages,
    const u16* __restrict__ sink_buf, const u16* __restrict__ local_buf, const int* __restrict__ block_table,
    const qmla_index_t* __restrict__ seq_lens, const qmla_index_t* __restrict__ seq_ids, float* __restrict__ o_part,
    float2* __restrict__ ml_part, int S_q, int H, int max_pages, int bt_stride, int num_pages, int max_seqs,
    int sink, int local, int tiles_per_split, int num_splits, float scale_log2, const int4* __restrict__ pieces,
    int unit_tiles, u16* __restrict__ out, float* __restrict__ lse) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    u8* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);  // the swizzle needs 1024-byte tiles
    float* al_s = (float*)(smem + AL_OFF);
    float* red = (float*)(smem + RED_OFF);
    float* rs_s = (float*)(smem + RS_OFF);  // QMLA_V6_ROPE_FOLD: [2][T]

    // wg through a shuffle is provably warp-uniform: the wgmma on each side are not on a divergent path for ptxas
    const int wg = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);
    const int tid = threadIdx.x, p = tid & (WGT - 1);
    const int w = p >> 5, lane = tid & 31;
    const int g8 = lane >> 2, q4 = lane & 3;
    const int rw0 = 16 * w + g8;  // this thread's rows of the CTA's 64: rw0 and rw0 + 8 (both warpgroups)

    const int R = S_q * H;
    // pair builds: an even number of row chunks (the last one past R where R needs an odd number: its rows are
    // zeros and it stores nothing, but it dequantizes its half of the tiles for its peer)
    const int NCHK = QMLA_V6_PAIR ? 2 * ((R + 2 * RT - 1) / (2 * RT)) : (R + RT - 1) / RT;
    // The CTA's piece of work: request pc.x's tiles [pc.y, pc.z) of 64 tokens, as partial pc.w & 0xffff of its rows.
    // Equal splits: split blockIdx.y. A balanced plan (QMLA_V6_PIECES, the launcher's v6_balanced): entry blockIdx.x / NCHK
    // of the piece table, whose row chunks run side by side (reading the same codes, the second from L2); bit 16 of
    // pc.w marks the request's last piece.
    const int4 pc = v6_piece(pieces, NCHK, tiles_per_split);
    const int b = pc.x, rbase = (blockIdx.x % NCHK) * RT;
    const int L = (int)seq_lens[b];
    const i64 sid = seq_ids[b];
    const bool sid_ok = sid >= 0 && sid < max_seqs;
    // packed tokens: [keep_lo, keep_hi) = [sink_end, local_start), between the sink and the local window
    const int keep_lo = sid_ok ? min(sink, L) : 0;
    const int keep_hi = (sid_ok && local > 0) ? max(keep_lo, L - local) : L;
    const int split = pc.w & 0xffff;
    V6Span sp;
    sp.t_begin = max(pc.y * T, keep_lo / T * T);
    const int t_end = min(keep_hi, pc.z * T);
    sp.np = sp.t_begin < t_end ? (t_end - sp.t_begin + T - 1) / T : 0;
    sp.keep_lo = keep_lo, sp.keep_hi = keep_hi, sp.L = L;
    // the sink/local tiles: with equal splits in stage.cuh's qmla_protected_split, in a balanced plan in the piece
    // holding the tile after the last packed one (or the request's last tile)
    const int prot_tile = keep_hi > keep_lo ? min((keep_hi - 1) / T + 1, unit_tiles - 1) : 0;
    const bool prot = QMLA_V6_PROTECTED && sid_ok &&
                      (QMLA_V6_PIECES ? pc.y <= prot_tile && prot_tile < pc.z
                                         : split == qmla_protected_split(keep_lo, keep_hi, tiles_per_split, T, (int)gridDim.y));
    sp.ns = prot ? (keep_lo + T - 1) / T : 0;
    sp.nl = prot && keep_hi < L ? (L - 1) / T - keep_hi / T + 1 : 0;
    const int ntiles = sp.np + sp.ns + sp.nl;

#if QMLA_V6_PAIR
    const u32 mb = smem_addr(smem + MB_OFF);
    const int rank = (int)cluster_ctarank();
    const u32 delta = cluster_peer_delta(smem_addr(smem), (u32)rank ^ 1u);
    if (tid == 0) {
        mbar_init(V6_FULL(mb, 0), 4u);
        mbar_init(V6_FULL(mb, 1), 4u);
        mbar_init(V6_EMPTY(mb, 0), 12u);
        mbar_init(V6_EMPTY(mb, 1), 12u);
        mbar_init_fence();
    }
    cluster_sync_all();  // both CTAs' mbarriers initialized before either arrives on the other's
#endif

    float acc[DC / 16][4];  // this warpgroup's half of O: rows rw0 (+ 8) x channels DC / 2 * wg + 8 n + 2 q4 (+ 1)
#pragma unroll
    for (int n = 0; n < DC / 16; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float m_run[2] = {-QMLA_INF, -QMLA_INF};
    float l_run[2] = {0.0f, 0.0f};  // the attender's share of the row sums

    if (ntiles > 0) {
        // ------------------------------------------------------------ queries [RT][DT] (rows >= R: zeros)
        // every load of a thread goes out before its first store (before stop 38, each load was stored before the
        // next went out: 18 round trips a thread before either role began; H200, H128 B8 L32K 6-8 us). Not kept
        // (stop 38): cp.async copies by all 256 threads (an illegal address in one conformance case, H1 S3, that
        // memcheck did not show); by the attender alone, the dequantizer starting at once (conformant, C2R4
        // 1.5-1.8 % slower than this form, whose 72 registers make ptxas keep two words in local memory outside
        // the tile loops)
        uint4 qv[QLOADS];
        qmla_load_query_chunks(qv, q_lat, q_rope, b, R, rbase, tid, NTH, 0);
#pragma unroll
        for (int k = 0; k < QLOADS; ++k) {
            const int idx = tid + k * NTH, row = idx / (DT / 8), ck = idx % (DT / 8);
            *(uint4*)(smem + QT_OFF + sw128_chunk(row, ck, RT)) = qv[k];
        }
        fence_proxy_async();
        __syncthreads();  // queries visible to wgmma

        const u32 smem_s = smem_addr(smem);
        const u64 dp = sw128_desc(smem_s + PT_OFF, 16, 1024);
        // PV's B: this warpgroup's column blocks (DC / 128) of key tile 0 (+ KT_BYTES for tile 1), MN-major
        const u64 dv = sw128_desc(smem_s + wg * (DC / 128) * T * 128, T * 128, 1024);
        const int* bt_row = block_table + (i64)b * bt_stride;

        if (wg == 0) {
            // ======================================================== attender
            const u64 dq = sw128_desc(smem_s + QT_OFF, 16, 1024), dk = sw128_desc(smem_s, 16, 1024);
            const int causal[2] = {L - S_q + (rbase + rw0) / H + 1, L - S_q + (rbase + rw0 + 8) / H + 1};
            int i = 0;  // tiles so far: the key buffer's parity and the handoffs count them
#pragma unroll 1
            for (int seg = 0; seg < 3; ++seg) {
              const V6Seg sg = v6_segment(sp, seg);
              const int lim[2] = {min(sg.hi, causal[0]), min(sg.hi, causal[1])};
              for (int j = 0; j < sg.n; ++j, ++i) {
                const int t0 = sg.t0 + j * T, buf = i & 1;
#if QMLA_V6_PAIR
                mbar_wait(V6_FULL(mb, buf), v6_parity(i));
#else
                v6_wait(BAR_FULL + buf);
#endif
                // its PV of the previous tile retired (issuing QK first, while that PV runs, made ptxas serialize
                // every wgmma: it then sees the accumulators read inside the PV's pipeline stage)
                wgmma_wait<0>();
                wgmma_fence_operand(acc);
                if (i >= 1 && i + 1 < ntiles) {  // that key tile is done
#if QMLA_V6_PAIR
                    v6_pair_attender_done(mb, delta, buf ^ 1, lane);
#else
                    v6_arrive(BAR_EMPTY + (buf ^ 1));
#endif
                }
                float S[8][4];  // rows rw0 (+ 8) x tokens 8 j + 2 q4 (+ 1)
                wgmma_fence_operand(S);
#if QMLA_V6_ROPE_FOLD
                float Sr[8][4];  // the RoPE k-steps' scores, before the tokens' scales
                wgmma_fence_operand(Sr);
#endif
                wgmma_fence();
                // this tile's key buffer, once: advanced per k-step from buf * KT_BYTES + off, each descriptor took a
                // shift and an add after the offset's own add (ptxas does not split the sum of the two multiples of 16)
                const u64 dkb = desc_advance(dk, buf * KT_BYTES);
#if QMLA_V6_ROPE_FOLD
                // the queries' descriptors rebuilt each tile, in uniform registers, rather than 36 held in registers:
                // the folding build is at the register limit (C4R4: 251 registers, no spills; H200 ~1 % faster, stop
                // 36); C2R4 ran 0.5-1.5 % slower with it (stops 34, 36), so only the folding builds take it
                const u64 dqt = desc_opaque(dq);
#else
                const u64 dqt = dq;
#endif
#pragma unroll
                for (int ks = 0; ks < KSTEPS; ++ks) {
                    const u32 off = (ks >> 2) * (T * 128) + 32 * (ks & 3);
                    const u64 da = desc_advance(dqt, off), db = desc_advance(dkb, off);
                    if (QMLA_V6_ROPE_FOLD && ks >= DC / 16) {
#if QMLA_V6_ROPE_FOLD
                        wgmma_m64n64k16_ss<0>(Sr, da, db, ks > DC / 16);
#endif
                    } else {
                        wgmma_m64n64k16_ss<0>(S, da, db, ks > 0);
                    }
                }
                wgmma_commit();
                wgmma_wait<0>();
                wgmma_fence_operand(S);
#if QMLA_V6_ROPE_FOLD
                wgmma_fence_operand(Sr);
                const float* rsc = rs_s + buf * T;
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float2 r = *(const float2*)(rsc + 8 * j + 2 * q4);  // tokens 8 j + 2 q4 (+ 1)
                    S[j][0] = fmaf(Sr[j][0], r.x, S[j][0]);
                    S[j][1] = fmaf(Sr[j][1], r.y, S[j][1]);
                    S[j][2] = fmaf(Sr[j][2], r.x, S[j][2]);
                    S[j][3] = fmaf(Sr[j][3], r.y, S[j][3]);
                }
#endif

                // ---------------------------------------------------- mask, row maxima (a quad holds a row's 64 tokens)
                float mx[2];
                qmla_mask_row_max(S, t0, q4, sg.lo, lim, scale_log2, t0 >= sg.lo && t0 + T <= min(lim[0], lim[1]), mx);
#pragma unroll
                for (int o = 1; o <= 2; o <<= 1) {
                    mx[0] = fmaxf(mx[0], __shfl_xor_sync(0xffffffffu, mx[0], o));
                    mx[1] = fmaxf(mx[1], __shfl_xor_sync(0xffffffffu, mx[1], o));
                }
                // each row's reference maximum moves only when a score passes it by more than the slack (a first finite
                // score always does: -inf + slack)
                float al[2];
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    qmla_rows_exp(S, mx[k] > m_run[k] + (float)QMLA_V6_MAX_SLACK ? mx[k] : m_run[k], k, m_run, l_run, al);
                }
                // ---------------------------------------------------- P and the rescale factors, once the previous P is read
                if (i >= 1) v6_wait(BAR_PFREE);
#pragma unroll
                for (int c = 0; c < 8; ++c) {
                    *(u32*)(smem + PT_OFF + sw128_chunk(rw0, c, RT) + 4 * q4) = pack_bf16x2(S[c][0], S[c][1]);
                    *(u32*)(smem + PT_OFF + sw128_chunk(rw0 + 8, c, RT) + 4 * q4) = pack_bf16x2(S[c][2], S[c][3]);
                }
                if (q4 == 0) {
                    al_s[rw0] = al[0];
                    al_s[rw0 + 8] = al[1];
                }
                fence_proxy_async();
                v6_arrive(BAR_PREADY);
                qmla_rescale_rows<true>(acc, al[0], al[1]);  // skipped while every factor is 1
                v6_pv(acc, dp, desc_advance(dv, buf * KT_BYTES));  // retired by the next tile's wait, or below
              }
            }
            wgmma_wait<0>();
            wgmma_fence_operand(acc);
            v6_wait(BAR_PFREE);  // the dequantizer's last PV retired (and every arrive matched)
        } else {
            // ======================================================== dequantizer
            // Its PV of tile i is issued after QMLA_V6_PV_AT parts of tile i + 1 are converted, and the rest of the
            // conversion runs beside it; the next tile's codes are loaded once the conversion is done.
            // (read only in the protected split, where sid_ok holds)
            const V6Prot pr = {sid_ok ? sink_buf + sid * sink * DT : sink_buf, sid_ok ? local_buf + sid * local * DT : local_buf,
                               sink, local};
            const int t_begin = sp.t_begin;
#if QMLA_V6_PAIR
            V6Half cd;
            if (sp.np > 0) {
                v6_half_load(cd, t_begin, rank, pages, bt_row, L, max_pages, num_pages, p);
                v6_half_dequantize(cd, smem_s, rank, p);
            } else {
                v6_copy_protected(smem, v6_protected_tile(sp, 0), pr, p, rs_s);
            }
            v6_pair_full(mb, delta, smem_s, 0, sp.np > 0, rank, w, lane);
            if (sp.np > 1) v6_half_load(cd, t_begin + T, rank, pages, bt_row, L, max_pages, num_pages, p);
            int i = 0;
            for (; i + 1 < sp.np; ++i) {  // the next tile packed
                const int buf = i & 1;
                if (i + 1 >= 2) mbar_wait(V6_EMPTY(mb, buf ^ 1), v6_parity(i - 1));
                v6_half_dequantize(cd, smem_s + (buf ^ 1) * KT_BYTES, rank, p);
                v6_pair_full(mb, delta, smem_s + (buf ^ 1) * KT_BYTES, buf ^ 1, true, rank, w, lane);
                if (i + 2 < sp.np) v6_half_load(cd, t_begin + (i + 2) * T, rank, pages, bt_row, L, max_pages, num_pages, p);
                v6_wait(BAR_PREADY);
                qmla_rescale_rows<true>(acc, al_s[rw0], al_s[rw0 + 8]);
                v6_pv(acc, dp, desc_advance(dv, buf * KT_BYTES));
                wgmma_wait<0>();
                wgmma_fence_operand(acc);
                v6_arrive(BAR_PFREE);
                if (i + 2 < ntiles) v6_pair_pv_done(mb, delta, buf, lane);
            }
            for (; i < ntiles; ++i) {  // the next tile, if any, protected
                const int buf = i & 1;
                if (i + 1 < ntiles) {
                    if (i + 1 >= 2) mbar_wait(V6_EMPTY(mb, buf ^ 1), v6_parity(i - 1));
                    v6_copy_protected(smem + (buf ^ 1) * KT_BYTES, v6_protected_tile(sp, i + 1 - sp.np), pr, p, rs_s);
                    v6_pair_full(mb, delta, smem_s + (buf ^ 1) * KT_BYTES, buf ^ 1, false, rank, w, lane);
                }
                v6_wait(BAR_PREADY);
                qmla_rescale_rows<true>(acc, al_s[rw0], al_s[rw0 + 8]);
                v6_pv(acc, dp, desc_advance(dv, buf * KT_BYTES));
                wgmma_wait<0>();
                wgmma_fence_operand(acc);
                v6_arrive(BAR_PFREE);
                if (i + 2 < ntiles) v6_pair_pv_done(mb, delta, buf, lane);
            }
#else
            V6Codes cd;
            V6Pages pg;
            if (QMLA_V6_PAGE_AHEAD) pg = v6_pages(t_begin, pages, bt_row, L, max_pages, num_pages, p);
            if (sp.np > 0) {
                v6_next_codes(cd, pg, t_begin, pages, bt_row, L, max_pages, num_pages, p);
                v6_dequantize<0, 3>(cd, smem, rs_s, p);
            } else {
                v6_copy_protected(smem, v6_protected_tile(sp, 0), pr, p, rs_s);
            }
            fence_proxy_async();  // the key-tile stores, for wgmma's reads
            v6_arrive(BAR_FULL);
            if (sp.np > 1) v6_next_codes(cd, pg, t_begin + T, pages, bt_row, L, max_pages, num_pages, p);
            int i = 0;
            for (; i + 1 < sp.np; ++i) {  // the next tile packed
                const int buf = i & 1;
                u8* kn = smem + (buf ^ 1) * KT_BYTES;  // tile i + 1's key tile
                float* rn = rs_s + (buf ^ 1) * T;      // ... and its RoPE scales (QMLA_V6_ROPE_FOLD)
                if (i + 1 >= 2) v6_wait(BAR_EMPTY + (buf ^ 1));  // the attender is done with tile i - 1
                v6_dequantize<0, QMLA_V6_PV_AT>(cd, kn, rn, p);
                if (QMLA_V6_PV_AT == 3) {
                    fence_proxy_async();
                    v6_arrive(BAR_FULL + (buf ^ 1));
                    if (i + 2 < sp.np) v6_next_codes(cd, pg, t_begin + (i + 2) * T, pages, bt_row, L, max_pages, num_pages, p);
                }
                v6_wait(BAR_PREADY);
                qmla_rescale_rows<true>(acc, al_s[rw0], al_s[rw0 + 8]);
                v6_pv(acc, dp, desc_advance(dv, buf * KT_BYTES));
                if (QMLA_V6_PV_AT < 3) {
                    v6_dequantize<QMLA_V6_PV_AT, 3>(cd, kn, rn, p);
                    fence_proxy_async();
                    v6_arrive(BAR_FULL + (buf ^ 1));
                    if (i + 2 < sp.np) v6_next_codes(cd, pg, t_begin + (i + 2) * T, pages, bt_row, L, max_pages, num_pages, p);
                }
                wgmma_wait<0>();
                wgmma_fence_operand(acc);
                v6_arrive(BAR_PFREE);
            }
            for (; i < ntiles; ++i) {  // the next tile, if any, protected
                const int buf = i & 1;
                if (i + 1 < ntiles) {
                    u8* kn = smem + (buf ^ 1) * KT_BYTES;
                    float* rn = rs_s + (buf ^ 1) * T;
                    if (i + 1 >= 2) v6_wait(BAR_EMPTY + (buf ^ 1));
                    v6_copy_protected(kn, v6_protected_tile(sp, i + 1 - sp.np), pr, p, rn);
                    fence_proxy_async();
                    v6_arrive(BAR_FULL + (buf ^ 1));
                }
                v6_wait(BAR_PREADY);
                qmla_rescale_rows<true>(acc, al_s[rw0], al_s[rw0 + 8]);
                v6_pv(acc, dp, desc_advance(dv, buf * KT_BYTES));
                wgmma_wait<0>();
                wgmma_fence_operand(acc);
                v6_arrive(BAR_PFREE);
            }
#endif
        }
    }

    // ---------------------------------------------------------------- partial results (v1 layout)
    if (wg == 0) {
#pragma unroll
        for (int o = 1; o <= 2; o <<= 1) {
            l_run[0] += __shfl_xor_sync(0xffffffffu, l_run[0], o);
            l_run[1] += __shfl_xor_sync(0xffffffffu, l_run[1], o);
        }
    }
#if QMLA_V6_PAIR
    cluster_sync_all();  // every wgmma has retired and the peer writes and arrives no more here: the key tiles are free
#else
    __syncthreads();  // every wgmma has retired: the key tiles are free
#endif
    if (wg == 0 && q4 == 0) {
        red[rw0] = m_run[0];
        red[rw0 + 8] = m_run[1];
        red[RT + rw0] = l_run[0];
        red[RT + rw0 + 8] = l_run[1];
    }
    float* ot = (float*)smem;  // [RT][OT_STRIDE]
#pragma unroll
    for (int n = 0; n < DC / 16; ++n) {
        const int ch = DC / 2 * wg + 8 * n + 2 * q4;
        *(float2*)(ot + rw0 * OT_STRIDE + ch) = make_float2(acc[n][0], acc[n][1]);
        *(float2*)(ot + (rw0 + 8) * OT_STRIDE + ch) = make_float2(acc[n][2], acc[n][3]);
    }
#if QMLA_V6_MERGE
    // the request and row chunk from blockIdx again (equal splits), rather than registers held across the tiles
    v6_merge_rows(ot, red, out, lse, (int)blockIdx.x / NCHK, S_q * H, (int)(blockIdx.x % NCHK) * RT, tid);
#else
    __syncthreads();
    const int4 pe = v6_piece(pieces, NCHK, tiles_per_split);  // read again: held from the start, C4R4 spilled it
    const int slot = pe.w & 0xffff;
    if (tid < RT && rbase + tid < R) {
        ml_part[((i64)pe.x * R + rbase + tid) * num_splits + slot] = make_float2(red[tid], red[RT + tid]);
        // a balanced plan gives requests different numbers of pieces: the last marks the slots past its own empty
        for (int k = slot + 1; (pe.w >> 16) != 0 && k < num_splits; ++k) {
            ml_part[((i64)pe.x * R + rbase + tid) * num_splits + k] = make_float2(-QMLA_INF, 0.0f);
        }
    }
#pragma unroll
    for (int j = 0; j < RT / 16; ++j) {
        qmla_store_partial_rows(o_part, ot + 16 * j * OT_STRIDE, pe.x, R, rbase + 16 * j, num_splits, slot, tid);
    }
#endif
}
