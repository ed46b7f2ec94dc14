// QuantMLA CuPy backend: decode attention v5 (few query rows on Hopper: tokens as the wgmma M dimension).
//
// Serves what v3 serves (bf16 queries; 2/4-bit content and 4-bit RoPE codes; d_c/d_r 512/64 and
// 256/32), on sm_90a. The sink and local-window tokens are the last tiles of one split per row chunk (stage.cuh's
// qmla_protected_split): their bf16 rows are loaded straight into QK's A fragments, where packed tiles dequantize
// codes, and run the same QK, softmax and PV (attend_tile); with QMLA_V5_PROTECTED 0, protected.cu adds them.
//
// ================================================================ design note
// Why: at H = 16 a request has 16 query rows, too few for a wgmma M of 64, so v2/v3 convert codes
// into mma.sync fragments (v3: ~112 warp-instructions per token). Here the 64 tokens of a tile are
// M and the 16 rows are N of Hopper warpgroup MMAs, and each value is dequantized once, as a bf16
// cache stores it (bf16(s * (code - z)), common.cuh's pair conversions; with QMLA_V5_ROPE_FOLD the RoPE values
// enter QK as exact (code - z) and their float32 scale multiplies each score's RoPE part once):
//
//   grid (B * ceil(R / 16), KV splits), 2 worker warpgroups per CTA. Worker wg takes tiles wg, wg + 2,
//   wg + 4, ... of its CTA's split and runs flash-decoding over them on its own: its own key
//   tile, P tile, row statistics and partial slot (2 split + wg). The workers share only the query
//   tile, so they meet at no barrier after the prologue, and one's dequantization overlaps the other's
//   matmuls. Per tile:
//   1. Each lane has its share of its two tokens' codes, zero points and scales in registers, loaded
//      straight from the page a tile earlier (v5_load_tile), and issues the loads of the worker's next tile.
//   2. QK: S^T[64 tokens][16 rows] = K Q^T, (d_c + d_r) / 16 x m64n16k16 with A from registers: lanes
//      dequantize straight into A fragments (warp ww: tokens 16 ww .. 16 ww + 15) in chunks of 4 k-steps
//      (8 for 2-bit content), two chunks in flight; B = the queries, staged once per CTA in QK's channel
//      order (v5_qk_channel). Each content fragment also goes to the key tile by stmatrix (PV's operand).
//   3. Softmax in base 2 over the columns against a reference maximum per column that moves only when a
//      score passes it by QMLA_V5_MAX_SLACK: column maxima through shuffles, one barrier per tile (two
//      when the reference moves); row sums stay per thread until the end.
//   4. P^T to shared memory as [16 rows][64 tokens] by one stmatrix.trans per warp.
//   5. PV: O^T[d_c][16] += K^T P^T, d_c / 64 x 4 m64n16k16 (A = the key tile read MN-major, B = P^T,
//      K-major); 64 accumulators per thread. Its rows are in QK's channel order. The worker waits for it
//      only after step 1 of its next tile, so the MMAs run beside that tile's loads.
//   Partials (unnormalized output, row maximum, row sum) leave in v1's layout through the key tile,
//   each row's channels put back in place.
// Why A from registers for QK: with N = 16 a wgmma from shared memory reads 2 KB of A per 512 B of B.
// The first build read K from shared memory for both matmuls (H200, H16 B32 L32K C4R4, CUDA graphs:
// 270.6 us); reading QK's A from the registers the dequantization fills took it to 243 us.
// Stop 21 (H200 profile of stop 20's build, C4R4: 4-way bank conflicts on the stage reads, 29 % of all
// shared-memory wavefronts excess; ~120 instructions per warp and tile to issue the copies; the block-table
// load waited on at once): conflict-free reads, lean copies, .ca copies, the slack softmax and two stages
// took H16 C4R4 B32 L32K from 239.9 to 194.6 us and B32 L128K from 888.6 to 756.9 (CUDA graphs, forced v5,
// no protected tokens; the first number of each from one A/B call, the second from another). Stop 22: the
// lanes load their operands from the page themselves (no stage; see v5_load_tile).
// Shared memory (d_c 512): per worker 64 KB K + 2 KB P; 18 KB queries: 153 KB, one CTA per SM. A third worker
// (QMLA_V5_WORKERS 3, the launcher's QUANTMLA_CUPY_V5_WORKERS) fits shared memory (220 KB) but leaves 168
// registers a thread: with the loads issued after QK into the registers QK read and 2-k-step QK chunks it spills
// 16-24 B at d_c 512, and ran 4-15 % slower than two workers (H200, H16 B32-B128 L4K-L128K, stop 23; stop 22's
// build with this design's register use spilled 460 B and ran 1.7-2.1x slower). At d_c 256 four workers fit
// (QMLA_V5_WORKERS 4: 128 registers, 151 KB): 16 warps an SM with each warp's code nearly as with two (stop 41, offline).
// Halves (QMLA_V5_HALVES 2, the launcher's QUANTMLA_CUPY_V5_HALVES; d_c 512 / d_r 64, two workers): a worker is two
// warpgroups that take the same tiles, half h dequantizing and multiplying code bytes CBH h .. CBH h + CBH - 1 of each
// slice and RoPE bytes RBH h .. (256 + 32 channels: 16 PV accumulators a thread instead of 64), so four warpgroups fit
// the register file at 128 registers a thread: two warps a scheduler become four, where stop 33 measured v5's two
// mostly waiting on fixed-latency dependencies (56 % of issue slots used). Half 1 hands its QK scores to half 0 through
// shared memory (v5_send_scores); half 0 adds them, runs the softmax alone and publishes P^T and each column's
// rescale, with which both run PV over their channels. Each half has its own key tile, query tile (its channels in
// its QK order) and partial-output channels; the worker writes one partial. Offline (stop 41, nvcc 13), the packed
// tile loop issues 946 instructions a warp in half 0 and 708 in half 1 for C4R4 (979 / 651 for C2R4), against 1,307
// (1,218) in a v5 worker's warp: 27 % (34 %) more per tile, which the doubled warps must pay for (break-even near
// 71 % (75 %) of issue slots used, from v5's 56 %). On the H200 (stop 44) it ran 15-35 % slower than one warpgroup a
// worker at H16 L >= 32K: the four warps a scheduler issued only 13 % more often, each waiting 1.8x as long between
// instructions; racecheck reports RAW hazards between the halves (not traced; the conformance cases pass). Off by
// default, a measurement knob.
#include "common.cuh"

#ifndef QMLA_V5_MAX_SLACK
// log2 units a score may pass its column's reference maximum before the reference moves (see the softmax);
// H200, H16 C4R4/C2R4: 8 took 1-3 % off the time of an exact running maximum (0: every new maximum moves it)
#define QMLA_V5_MAX_SLACK 8.0f
#endif
#ifndef QMLA_V5_PROTECTED
// 1: the sink and local-window tokens are tiles of this kernel (stage.cuh's qmla_protected_split); 0: packed tokens
// only, for the launcher's protected-only launch (QUANTMLA_CUPY_V5_PROTECTED=separate, a measurement knob)
#define QMLA_V5_PROTECTED 1
#endif
#ifndef QMLA_V5_PROT_VEC
// how a protected tile's lanes load their A fragments from the bf16 rows (QUANTMLA_CUPY_V5_PROT_LOADS). 1 (vec): a
// chunk's pairs of one token and slice in one load of up to 16 bytes (36 loads per warp and tile at d_c 512, +138
// moves of words into fragments). 0 (pairs): one 4-byte load per register; at d_c 512 C4R4 each such load of a warp
// touches 32 lines (8 tokens x 4 lanes 128 bytes apart), 4,608 L1 wavefronts per warp and tile. H200, H16, CUDA
// graphs (stop 27):
// vec took C4R4 B32 L4K from 58.3 to 43.3 us and B32 L32K from 203.4 to 186.2 us; C2R4 (4-k-step chunks) B32 L4K
// from 46.0 to 41.5 us and B32 L32K from 194.2 to 188.2 us.
#define QMLA_V5_PROT_VEC 1
#endif
#ifndef QMLA_V5_ROPE_FOLD
// 1: the RoPE codes enter QK as (code - z), exact in bf16, in an accumulator of their own that the token's float32
// scale multiplies once per score (8 FFMA a thread and tile); 0: each RoPE value dequantized to bf16 through float32
// (two FMUL, two conversions and a pack per pair: ~80 instructions a warp and tile). The launcher's
// QUANTMLA_CUPY_V5_ROPE_FOLD (attention.py's v5_rope_fold: 2-bit content, 3-6 % faster on the H200; C4R4 1.5 % slower
// at B32 L32K (stop 29) until its codes were loaded a quad at a time, then 3-4 % faster (stop 32)), for two workers:
// with three, at 168 registers a thread, the second accumulator spilled 100 bytes (12 without)
#define QMLA_V5_ROPE_FOLD (NWG == 2 && NHV == 1 && (CBITS == 2 || QMLA_V5_QUAD_LOADS))
#endif
#ifndef QMLA_V5_LAZY_RESCALE
#define QMLA_V5_LAZY_RESCALE 1  // skip the output rescale while no column's maximum moves (bit-identical)
#endif
#ifndef QMLA_V5_DESC64
// 1: the packed loop advances its wgmma descriptors by wgmma.cuh's desc_advance64 (one 64-bit add, 56 fewer
// instructions a warp and tile), 0: by desc_advance. Which runs faster follows ptxas's schedule, not the count (H200,
// H16, CUDA graphs, stop 37, with the loads issued per operand): 2-bit content 2.3-2.8 % faster with 1, 4-bit content
// 0.5-1 % faster with 0 (two A/B calls). The protected loop always takes desc_advance: there ptxas split each 64-bit
// add into four instructions (+112 a tile)
#define QMLA_V5_DESC64 (CBITS == 2)
#endif

#define DC QMLA_DC
#define DR QMLA_DR
#define DT (QMLA_DC + QMLA_DR)
#define T 64                  // tokens per tile: wgmma M
#define RT 16                 // query rows per CTA: wgmma N
#ifndef QMLA_V5_WORKERS
#define QMLA_V5_WORKERS 2     // workers per CTA (2 or 3, 4 at d_c 256; the launcher's V5Knobs.workers)
#endif
#define NWG QMLA_V5_WORKERS
#ifndef QMLA_V5_HALVES
// warpgroups of one worker (the launcher's QUANTMLA_CUPY_V5_HALVES): 1, or 2 where each takes half of every tile's
// channels (see "halves" below)
#define QMLA_V5_HALVES 1
#endif
#define NHV QMLA_V5_HALVES
#define NWGS (NWG * NHV)      // warpgroups per CTA
#define NTH 128               // threads of one warpgroup (its loads and dequantization)
#define CBITS QMLA_CBITS
#define KCH (8 / CBITS)       // codes per byte
#define CB QMLA_CB
#define RB QMLA_RB
#define NCT (CB / 16)
#define NGC (DC / QMLA_GC)
#define CMASK ((CBITS == 4) ? 0x0f0f0f0fu : 0x03030303u)
#define CSZ (QMLA_CSCALE_BF16 ? 2 : 4)
#define RSZ (QMLA_RSCALE_BF16 ? 2 : 4)
#define DCH (DC / NHV)        // content channels of one warpgroup (half h: code bytes CBH h .. of each slice)
#define DRH (DR / NHV)        // RoPE channels of one warpgroup (RoPE code bytes RBH h ..)
#define DTH (DCH + DRH)
#define CBH (CB / NHV)
#define RBH (RB / NHV)
#define NCB ((DTH + 63) / 64) // 64-channel column blocks of a warpgroup's query tile
#define NCBK (DCH / 64)       // ... of its key tile (content only)
#define KSTEPS (DTH / 16)     // QK k-steps
#define NMB (DCH / 64)        // PV m-blocks (64 channels each)

#if !QMLA_IN_BF16 || !(QMLA_QUANT && (CBITS == 2 || CBITS == 4) && QMLA_RBITS == 4)
#error "attention_v5.cu serves bf16 queries over 2/4-bit content with 4-bit RoPE codes"
#endif
static_assert(CB == DC * CBITS / 8 && RB == DR / 2, "code bytes per token");
static_assert(CB % 64 == 0 && (RB == 16 || RB == 32), "d_c 256/512 and d_r 32/64");
static_assert(QMLA_GC % 16 == 0, "a 16-channel dequantized run must lie inside one scale group");
static_assert(QMLA_GR == DR, "one RoPE group per token");

#include "wgmma.cuh"
#include "stage.cuh"  // OT_STRIDE, qmla_store_partial_rows (the partials)

// ---------------------------------------------------------------- QK's operand order
// QK takes the key tile from registers (the wgmma A operand): lane (g8, q4) of warp ww holds tokens
// 16 ww + g8 (+ 8) and dequantizes BL bytes of their code rows, its share: BL q4 .. BL q4 + BL - 1, or with
// QMLA_V5_QUAD_LOADS the 16-byte runs 16 q4 + 64 v (v5_share_byte). K-step ks of QK's channel order is byte
// pair bp = ks / SPC of that share and slice pair sp = ks % SPC: k 2 q4 (+ 1) are slice 2 sp of share bytes
// 2 bp (+ 1), k 2 q4 + 8 (+ 1)
// slice 2 sp + 1 (RoPE likewise, after the content). The queries are staged in that order.
#define BL (CBH / 4)          // content code bytes of one lane of a quad, per token (of its warpgroup's half)
#define RBL (RBH / 4)         // RoPE code bytes ...
#define SPC (KCH / 2)         // slice pairs of a byte pair (k-steps per byte pair)
#define KSC (DCH / 16)        // content k-steps
#ifndef QMLA_V5_EARLY_LOADS
// 1: a lane loads its next tile's operands at the start of a tile, into a second set of registers;
// 0: after the tile's QK, into the registers QK has just read (V5Regs once, not twice: what three workers,
// at 168 registers a thread, can hold)
#define QMLA_V5_EARLY_LOADS (NWG == 2 && NHV == 1)
#endif
#ifndef QMLA_V5_KCHUNK
// QK k-steps per chunk of A fragments (double-buffered); 4 holds fewer registers than 8, 2 fewer still (three
// workers). Stop 21 measured 8 3-4 % faster for C2R4 (nothing for C4R4); since the lanes load their own operands
// (stop 22) and attend to the protected tiles (stop 26), C2R4 at 4 with vec loads was the fastest of the four builds
// from 32K tokens, 0.2-3 % ahead, and 3 % behind 8 with vec at B32 L4K (H200, H16 B32/B128, CUDA graphs, stop 27:
// 230 registers instead of 255)
#define QMLA_V5_KCHUNK ((NWG >= 3 || NHV > 1) ? 2 : 4)
#endif
#define KCK QMLA_V5_KCHUNK
#define NKC ((KSTEPS + KCK - 1) / KCK)  // QK chunks
#define NGL ((BL >= QMLA_GC) ? BL / QMLA_GC : 1)  // scale groups of one lane's share of a slice
#ifndef QMLA_V5_QUAD_LOADS
// 1: the four lanes of a quad load a token's content code row together, 64 contiguous bytes a load (lane q4's v-th
// 16 bytes at 16 q4 + 64 v), so a warp's load touches one 128-byte line a token; 0: each lane loads BL contiguous bytes
// of its own (BL q4 ..), which at 256 code bytes a token (4-bit d_c 512) spreads a warp's load over two lines a
// token. With 1 a lane's share holds every scale group of each slice, so it loads all of a token's zero points and
// scales (one 8- and one 16-byte load) and picks a group's at the k-step where it starts
#define QMLA_V5_QUAD_LOADS 0
#endif
#define QUAD QMLA_V5_QUAD_LOADS
static_assert(!QUAD || (CBITS == 4 && BL == 64 && QMLA_GC == 64 && QMLA_CSCALE_BF16),
              "QMLA_V5_QUAD_LOADS serves 4-bit d_c 512 with 64-channel groups and bf16 scales");
#ifndef QMLA_V5_PACKED_GROUPS
// 1: a lane loads all of a token's content zero points and scales (one 8- and one 16-byte load) and picks its groups'
// once a tile, instead of one load per slice and group (2-bit d_c 512: 8 loads a token, each touching a line for
// each of a warp's 8 tokens); the quad loads always do
#define QMLA_V5_PACKED_GROUPS 0
#endif
#define PACKED (QUAD || QMLA_V5_PACKED_GROUPS)
#ifndef QMLA_V5_PROBE
// measurement builds that skip a stage of every tile, to see what it costs (results are wrong; the launcher's
// QUANTMLA_CUPY_V5_PROBE, never a default): bit 1 PV's wgmma, bit 2 the key tile's stores (stmatrix), bit 4 the
// content dequantization's fma (A = the raw bf16 128 + code). 0: none
#define QMLA_V5_PROBE 0
#endif
#define PROBE QMLA_V5_PROBE
#ifndef QMLA_V5_ZFOLD
// 1: the zero points leave the per-value dequantization (the launcher's QUANTMLA_CUPY_V5_ZFOLD). A content value enters
// QK's A fragments and the key tile as bf16(s code), one fma a pair (s (128 + code) - 128 s, exact before its one
// rounding) in place of bf16(s (code - z)), two. What the zero points take away is added back through the matmuls:
// QK gets two more k-steps whose A columns are each token's s z of the 8 groups, split into a bf16 part and its exact
// rounding error, against the query sums of each group (-Q_g, likewise split) as B; PV gets one more 64-row block whose
// first 16 rows are the same s z columns, so O^T's block NMB accumulates sum_t P s z per group, subtracted from each
// group's channels when the partials are written. Protected (bf16) tiles run both over zeros. Offline it takes the
// packed loop from 1,307 to 1,216 instructions a warp and tile (C4R4; C2R4 1,218 -> 1,122), but on an H100 it ran 0.5 %
// (C4R4 B32 L32K) to 6 % (C2R4) slower (builds.py's V5_ZFOLD): the 6 more wgmma a tile cost more. A measurement knob.
#define QMLA_V5_ZFOLD 0
#endif
#define ZF QMLA_V5_ZFOLD
static_assert(!ZF || (PACKED && NHV == 1 && NGC == 8 && QMLA_CSCALE_BF16),
              "QMLA_V5_ZFOLD serves d_c 512 with 64-channel groups, bf16 scales and a token's groups loaded together");
static_assert(!QMLA_V5_PACKED_GROUPS || QUAD || (CBITS == 2 && BL == 32 && QMLA_GC == 64 && QMLA_CSCALE_BF16),
              "QMLA_V5_PACKED_GROUPS serves 2-bit d_c 512 with 64-channel groups and bf16 scales");
static_assert(BL >= 16 && BL <= 64 && (DR == 32 || DR == 64), "d_c 256/512, d_r 32/64");
static_assert(NWG == 2 || NWG == 3 || (NWG == 4 && DC == 256), "two or three workers (four at d_c 256)");
static_assert(NHV == 1 || (NHV == 2 && NWG == 2 && DC == 512 && DR == 64 && !QUAD && !QMLA_V5_PACKED_GROUPS),
              "halves serve d_c 512 / d_r 64 with two workers, without quad loads or packed groups");
static_assert((KCK == 2 || KCK == 4 || KCK == 8) && KSC % KCK == 0 && (4 * KCK) % (4 * SPC) == 0, "chunks of whole 8-channel stores");
static_assert(BL % QMLA_GC == 0 || QMLA_GC % BL == 0, "a lane's share of a slice holds whole groups or lies in one");

// byte of a content code row (of each slice) that byte i of lane q4's share is (QMLA_V5_QUAD_LOADS)
__device__ __forceinline__ constexpr int v5_share_byte(int i, int q4) {
    return QUAD ? 16 * q4 + 64 * (i >> 4) + (i & 15) : BL * q4 + i;
}

// physical channel ([d_c | d_r]) of QK's channel lc of half h (NHV 1: h = 0)
__device__ __forceinline__ int v5_qk_channel(int lc, int h) {
    const int ks = lc >> 4, k = lc & 15, q = (k & 7) >> 1, e = k & 1, hi = k >> 3;
    if (ks < KSC) return CB * (2 * (ks % SPC) + hi) + CBH * h + v5_share_byte(2 * (ks / SPC) + e, q);
    return DC + RB * hi + RBH * h + RBL * q + 2 * (ks - KSC) + e;
}

// The key tile for PV holds the content channels in QK's order: each warp stores its A fragments of a
// content k-step as they are (one stmatrix.x4: tokens 16 ww .. 16 ww + 15 x 16 channels), so PV's output
// rows come out in QK's order and the partials map them back through v5_qk_channel.

// bf16x2 (128 + code) of bytes 0, 1 (HI = 0) or 2, 3 (HI = 1) of a word of codes, as qmla_code2, with
// the 0x43 exponent byte the low byte of a run-time register (c43) and the selector immediate: with both
// constant, ptxas put the selector in a register and moved it there again before every prmt
template <int HI>
__device__ __forceinline__ u32 v5_code2(u32 x, u32 c43) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(c43), "n"(HI ? 0x4342 : 0x4140));
    return d;
}

#ifndef QMLA_CODES_IN_PLACE
// 1: 2-bit codes are converted where they lie in their byte (common.cuh's qmla_code2_in_place; the launcher's
// CODES_IN_PLACE, on for 2-bit content; the launcher always passes it); 0: each slice shifted to bit 0 first
#define QMLA_CODES_IN_PLACE 0
#endif
#if QMLA_CODES_IN_PLACE && CBITS != 2
#error "QMLA_CODES_IN_PLACE converts 2-bit codes"
#endif

// the W consecutive words at p, 4 W bytes aligned (W = 1, 2, 4), in one load
template <int W>
__device__ __forceinline__ void v5_load_words(u32 (&v)[W], const u16* p) {
    static_assert(W == 1 || W == 2 || W == 4, "one load of 4, 8 or 16 bytes");
    if constexpr (W == 4) {
        const uint4 x = __ldg((const uint4*)p);
        v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
    } else if constexpr (W == 2) {
        const uint2 x = __ldg((const uint2*)p);
        v[0] = x.x, v[1] = x.y;
    } else {
        v[0] = __ldg((const u32*)p);
    }
}

// the tokens this thread's columns (query rows rbase + 8 i + 2 q4 + e) attend to in a segment ending at hi:
// n < lm[i][e] = min(hi, the row's causal limit); returns the least of them
__device__ __forceinline__ int v5_column_limits(int (&lm)[2][2], int hi, int L, int S_q, int H, int rbase, int q4) {
    int lm_min = hi;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            lm[i][e] = min(hi, L - S_q + (rbase + 8 * i + 2 * q4 + e) / H + 1);
            lm_min = min(lm_min, lm[i][e]);
        }
    }
    return lm_min;
}

// ---------------------------------------------------------------- shared memory layout
// warpgroup wgi's area starts at wgi * WK_BYTES (1024-byte aligned, as the swizzled tiles need; a worker's halves are
// warpgroups NHV w .. NHV w + NHV - 1); the kernel rounds the dynamic shared memory base up to 1024 bytes, hence the
// extra 1 KB
#define W_KT 0                          // key tile (content channels, PV's A operand), bf16 [NCBK + ZF][T][64]
#define W_PT (T * (NCBK + ZF) * 128)    // P^T, bf16 [RT][T]: one swizzled 128-byte row per query row
#define W_RED (W_PT + RT * T * 2)       // float [4 warps][RT]: column maxima, then row sums
#define W_FLG (W_RED + 4 * RT * 4)      // u8 [4 warps]: a score of the tile passed its reference maximum + slack
#define W_CORR (W_FLG + 16)             // ZF: float [8 groups][RT], each group's sum_t P s z (the partials subtract it)
// NHV 2, half 1: float4 [2][NTH], its QK scores; half 0: float [RT], the rescale
#define W_XS (W_CORR + (ZF ? 8 * RT * 4 : 0))
#define XS_BYTES ((NHV > 1) ? 2 * NTH * 16 : 0)
#define WK_BYTES ((W_XS + XS_BYTES + 1023) / 1024 * 1024)
#define QT_OFF (NWGS * WK_BYTES)        // queries, bf16 [NHV][NCB][RT][64]: each half's in its QK order
#define QT_HALF ((NCB + ZF) * RT * 128)  // ZF: block NCB holds the zero-point k-steps' B (v5_stage_zero_queries)
#define SMEM_TOTAL (QT_OFF + NHV * QT_HALF + 1024)
#ifdef QMLA_V5_SMEM
static_assert(SMEM_TOTAL == QMLA_V5_SMEM, "launcher's v5_smem_bytes() disagrees with the kernel's layout");
#endif
static_assert(SMEM_TOTAL <= 227 * 1024, "shared memory per block");
// the partial-output tile reuses the key tile (NHV 2: half 0's key tile and P^T; its row sums stay in red[])
static_assert(RT * OT_STRIDE * 4 <= (NHV == 1 ? W_PT : W_RED), "a worker's partial-output tile reuses its key tile");

// barrier of warpgroup wgi's 128 threads (ids 1 .. NWGS)
__device__ __forceinline__ void v5_worker_sync(int wgi) { asm volatile("bar.sync %0, 128;" ::"r"(wgi + 1) : "memory"); }

// NHV 2: the barriers of worker w's two halves (ids NWGS + 1 + 2 w: half 1's scores; NWGS + 2 + 2 w: half 0's P^T and
// rescale), each met by one half's bar.arrive and the other's bar.sync, so the half that hands over does not wait
__device__ __forceinline__ int v5_bar_scores(int w) { return NWGS + 1 + 2 * w; }
__device__ __forceinline__ int v5_bar_p(int w) { return NWGS + 2 + 2 * w; }
__device__ __forceinline__ void v5_pair_arrive(int id) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(NHV * NTH) : "memory");
}
__device__ __forceinline__ void v5_pair_sync(int id) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(NHV * NTH) : "memory");
}

// How the halves of a worker meet per tile (NHV 2). Half 1 stores its QK scores (over its channels) and goes on; half
// 0 adds them to its own, runs the softmax alone, publishes P^T and each column's rescale, and both run PV over their
// channels with that P^T. Half 1 stores tile i + 1's scores only after taking tile i's P^T and rescale, which half 0
// publishes after reading tile i's scores; half 0 writes tile i + 1's P^T and rescale only once half 1's scores of tile
// i + 1 are in, which half 1 stores after its PV of tile i has retired: one area each suffices.

// half 1: its 8 scores to its exchange area (float4s at tid and NTH + tid: conflict-free), for half 0
__device__ __forceinline__ void v5_send_scores(const float (&S)[8], float* xs, int tid, int w) {
    float4* o = (float4*)xs + tid;
    o[0] = make_float4(S[0], S[1], S[2], S[3]);
    o[NTH] = make_float4(S[4], S[5], S[6], S[7]);
    v5_pair_arrive(v5_bar_scores(w));
}

// half 0: half 1's scores (xs: its exchange area) added to this thread's, for the softmax
__device__ __forceinline__ void v5_add_scores(float (&S)[8], const float* xs, int tid, int w) {
    v5_pair_sync(v5_bar_scores(w));
    const float4 a = ((const float4*)xs)[tid], b = ((const float4*)xs)[NTH + tid];
    S[0] += a.x, S[1] += a.y, S[2] += a.z, S[3] += a.w;
    S[4] += b.x, S[5] += b.y, S[6] += b.z, S[7] += b.w;
}

// half 0, once its P^T is visible to its own warps: each column's rescale al (xs: its exchange area, float [RT]), then
// P^T and the rescale released to half 1
__device__ __forceinline__ void v5_give_rescale(const float (&al)[2][2], float* xs, int ww, int g8, int q4, int w) {
    if (ww == 0 && g8 == 0) *(float4*)(xs + 4 * q4) = make_float4(al[0][0], al[0][1], al[1][0], al[1][1]);
    v5_pair_arrive(v5_bar_p(w));
}

// half 1: waits for half 0's P^T and takes the rescale of its columns (xs: half 0's exchange area)
__device__ __forceinline__ void v5_take_rescale(float (&al)[2][2], const float* xs, int q4, int w) {
    v5_pair_sync(v5_bar_p(w));
    const float4 a = *(const float4*)(xs + 4 * q4);
    al[0][0] = a.x, al[0][1] = a.y, al[1][0] = a.z, al[1][1] = a.w;
}

// P of this thread's 8 scores, 2^(S - m) over the columns' maxima m (-inf: 0 subtracted), to P^T in
// shared memory by one stmatrix.trans: matrix (i, h) holds tokens 16 ww + 8 h + g8, columns 8 i + 2 q4 (+ 1),
// stored as P^T rows 8 i + ...; ps: this thread's sum of its two tokens' p per column
__device__ __forceinline__ void v5_p_tile(const float (&S)[8], const float (&m)[2][2], float (&ps)[2][2], u32 p_lane) {
    float p[8];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float u = (m[i][e] == -QMLA_INF) ? 0.0f : m[i][e];
            p[4 * i + e] = exp2f(S[4 * i + e] - u);
            p[4 * i + 2 + e] = exp2f(S[4 * i + 2 + e] - u);
            ps[i][e] = p[4 * i + e] + p[4 * i + 2 + e];
        }
    }
    stsm_x4_t(p_lane, pack_bf16x2(p[0], p[1]), pack_bf16x2(p[2], p[3]), pack_bf16x2(p[4], p[5]), pack_bf16x2(p[6], p[7]));
}

#define QPAIRS (RT * (DT / 2))                            // query channel pairs of a CTA
#define QLD ((QPAIRS + NWGS * NTH - 1) / (NWGS * NTH))    // ... staged per thread
#define QEVEN (QPAIRS % (NWGS * NTH) == 0)                // every thread stages QLD (else: idx < QPAIRS)

// ---------------------------------------------------------------- a lane's operands, straight from the page
// Lane (g8, q4) of warp ww dequantizes tokens 16 ww + g8 (+ 8) of a tile, and only these bytes of them: content
// code bytes BL q4 .. BL q4 + BL - 1, RoPE code bytes RBL q4 .., the zero points and scales of the groups they
// lie in, the RoPE zero point and scale. It loads them from the page into registers itself, one tile of its
// worker ahead of their use (the loads run beside a whole tile's work). A stage in shared memory (stop 21: cp.async
// by page segment, then the lanes' reads) cost 65 of ~390 shared-memory wavefronts per warp and tile and a
// barrier; without it (H200, H16 B32/B128 L32K/L128K, CUDA graphs) C4R4 took 1-5 % less time, C2R4 ~1 %.
// Issued after QK into the same registers instead (no copy between tiles), the loads came too late: C2R4 +10 %.
struct V5Regs {
    u32 wc[2][BL / 4];         // the lane's share of its two tokens' content code rows (v5_share_byte)
    u32 wr[2][(RBL + 3) / 4];  // RoPE code bytes RBL q4 ..
#if PACKED
    u32 zw[2][NGC / 4];        // all the token's content zero points, a byte a group
    u32 sw[2][NGC / 2];        // its bf16 content scales, two a word
#else
    u32 cz[2][KCH][NGL];       // zero points of the groups of its content channels (slice c, group gl of the share)
    u32 cs[2][KCH][NGL];       // their scales (raw bits: bf16 or float)
#endif
    u32 rz[2], rs[2];          // RoPE zero point and scale (raw bits)
};

// page id of warp ww's 16 tokens of tile tt as the block table holds them (stage.cuh's qmla_table_page);
// 16 tokens never span two pages (P >= 16)
__device__ __forceinline__ int v5_warp_page(int tt, int ww, const int* __restrict__ bt_row, int L, int max_pages) {
    return qmla_table_page(tt + 16 * ww, bt_row, L, max_pages);
}

// where a lane's operands of tile tt lie: page pg's bytes (warp-uniform; page 0 outside the pool), the lane's first
// token slot s0 (t_lane: the lane's first token of a tile; the second is s0 + 8), whether each token is read and the
// half h of the channels the lane's warpgroup takes (NHV 1: 0).
// v5_load_tile issues the operands' loads through the helpers below, one per operand: the same loads, which ptxas
// schedules differently (H200, stop 37: with QMLA_V5_DESC64 C2R4 2.3-2.8 % faster than with the one-function loader,
// which ran 3.7 % slower with QMLA_V5_DESC64 than without; C4R4 without it 0.5-1.5 % faster)
struct V5Src {
    const u8* page;
    u32 s0;
    bool ok[2];
    int h;
};

__device__ __forceinline__ V5Src v5_src(const u8* __restrict__ pages, int pg, int num_pages, int tt, int L, int t_lane,
                                        int h) {
    const bool page_ok = pg >= 0 && pg < num_pages;
    V5Src q;
    // the lane's token slots s0 and s0 + 8 (a warp's 16 tokens lie in one page): one modulo, not one per token
    q.s0 = QMLA_SLOT(tt + t_lane);
    q.page = pages + (i64)(page_ok ? pg : 0) * QMLA_PAGE_BYTES;
    q.ok[0] = page_ok && tt + t_lane < L;
    q.ok[1] = page_ok && tt + t_lane + 8 < L;
    q.h = NHV == 1 ? 0 : h;
    return q;
}

// the 16 content code bytes v of token tk's share (words 4 v .. 4 v + 3 of wc[tk])
__device__ __forceinline__ void v5_load_codes(V5Regs& r, const V5Src& q, int tk, int v, int q4) {
    const u32 s = q.s0 + 8 * tk;
    const uint4 x = *(const uint4*)(q.page + QMLA_OFF_CC + s * CB + CBH * q.h + v5_share_byte(16 * v, q4));
    r.wc[tk][4 * v] = x.x, r.wc[tk][4 * v + 1] = x.y, r.wc[tk][4 * v + 2] = x.z, r.wc[tk][4 * v + 3] = x.w;
}

// token tk's RoPE code bytes of the lane
__device__ __forceinline__ void v5_load_rope_codes(V5Regs& r, const V5Src& q, int tk, int q4) {
    const u32 s = q.s0 + 8 * tk;
    if constexpr (RBL == 8) {
        const uint2 x = *(const uint2*)(q.page + QMLA_OFF_RC + s * RB + RBH * q.h + RBL * q4);
        r.wr[tk][0] = x.x, r.wr[tk][1] = x.y;
    } else {
        r.wr[tk][0] = *(const u32*)(q.page + QMLA_OFF_RC + s * RB + RBH * q.h + RBL * q4);
    }
}

// token tk's content zero points and scales the lane reads (0 for a token not read)
__device__ __forceinline__ void v5_load_groups(V5Regs& r, const V5Src& q, int tk, int q4) {
    const u32 s = q.s0 + 8 * tk;
    const bool ok = q.ok[tk];
#if PACKED
    const uint2 z = ok ? *(const uint2*)(q.page + QMLA_OFF_CZ + s * NGC) : make_uint2(0u, 0u);
    const uint4 sc = ok ? *(const uint4*)(q.page + QMLA_OFF_CS + s * NGC * 2) : make_uint4(0u, 0u, 0u, 0u);
    r.zw[tk][0] = z.x, r.zw[tk][1] = z.y;
    r.sw[tk][0] = sc.x, r.sw[tk][1] = sc.y, r.sw[tk][2] = sc.z, r.sw[tk][3] = sc.w;
#else
#pragma unroll
    for (int c = 0; c < KCH; ++c) {
#pragma unroll
        for (int gl = 0; gl < NGL; ++gl) {
            const int grp = (CB * c + CBH * q.h + BL * q4) / QMLA_GC + gl;
            r.cz[tk][c][gl] = ok ? (u32)q.page[QMLA_OFF_CZ + s * NGC + grp] : 0u;
#if QMLA_CSCALE_BF16
            r.cs[tk][c][gl] = ok ? (u32)((const u16*)(q.page + QMLA_OFF_CS))[s * NGC + grp] : 0u;
#else
            r.cs[tk][c][gl] = ok ? ((const u32*)(q.page + QMLA_OFF_CS))[s * NGC + grp] : 0u;
#endif
        }
    }
#endif
}

// token tk's RoPE zero point and scale (0 for a token not read)
__device__ __forceinline__ void v5_load_rope_group(V5Regs& r, const V5Src& q, int tk) {
    const u32 s = q.s0 + 8 * tk;
    const bool ok = q.ok[tk];
    r.rz[tk] = ok ? (u32)q.page[QMLA_OFF_RZ + s] : 0u;
#if QMLA_RSCALE_BF16
    r.rs[tk] = ok ? (u32)((const u16*)(q.page + QMLA_OFF_RS))[s] : 0u;
#else
    r.rs[tk] = ok ? ((const u32*)(q.page + QMLA_OFF_RS))[s] : 0u;
#endif
}

// this lane's operands of tile tt from page pg (warp-uniform). A token past L or on a page outside [0, num_pages)
// gets zero points and scales 0, so its keys dequantize to 0 (its scores are masked; 0 x a stale NaN scale could
// poison PV); its codes, finite whatever they are, are read from its slot of page pg or, outside the pool, of page 0
// (num_pages >= 1): unconditional loads, so the registers they fill need no zeroing first.
__device__ __forceinline__ void v5_load_tile(V5Regs& r, const u8* __restrict__ pages, int pg, int num_pages, int tt, int h,
                                             int L, int t_lane, int q4) {
    const V5Src q = v5_src(pages, pg, num_pages, tt, L, t_lane, h);
#pragma unroll
    for (int tk = 0; tk < 2; ++tk) {
#pragma unroll
        for (int v = 0; v < BL / 16; ++v) v5_load_codes(r, q, tk, v, q4);
        v5_load_rope_codes(r, q, tk, q4);
        v5_load_groups(r, q, tk, q4);
        v5_load_rope_group(r, q, tk);
    }
}

#if QUAD
// bf16x2 -(128 + z) and bf16x2 s of slice c's group v of the lane's token tk (QMLA_V5_QUAD_LOADS); cc3: 0xc3 in
// its low byte, a run-time register (with the byte a constant too, ptxas moved the selector into a register before
// every prmt, as v5_code2 says); the caller passes c43 | 0x80 in place: held in a variable of its own, it cost 3
// registers and 3 instructions a tile (nvcc 13.0)
__device__ __forceinline__ void v5_quad_group(u32& off2, u32& s2, const V5Regs& r, int tk, int c, int v, u32 cc3) {
    const int g = (CB / QMLA_GC) * c + v;
    off2 = __byte_perm(r.zw[tk][g >> 2], cc3, 0x4040 | (g & 3) | ((g & 3) << 8));
    s2 = __byte_perm(r.sw[tk][g >> 1], 0u, (g & 1) ? 0x3232 : 0x1010);
}
#endif

// attend_tile's zero-point fragment for tiles without zero points (bf16 rows; builds without QMLA_V5_ZFOLD): zeros,
// so their zero-point k-steps and PV block add nothing (skipping them there made ptxas serialize every wgmma)
__device__ __forceinline__ void v5_no_zero_fragment(u32 (&zx)[1][4]) { zx[0][0] = zx[0][1] = zx[0][2] = zx[0][3] = 0u; }

#if ZF
static_assert(NKC >= 3, "the zero-point k-steps' registers are released at chunk 2's wait");
// QMLA_V5_ZFOLD: the A fragment of the zero-point k-steps for this lane (columns 2 q4, 2 q4 + 1 are groups 2 q4,
// 2 q4 + 1; columns + 8 the same groups' rounding errors): zx[tk] = bf16x2 hi = bf16(s z) of token tk, zx[2 + tk] =
// hi - s z, exact (s z has at most 12 significant bits). The error's sign is undone by its B rows (+Q_g).
__device__ __forceinline__ void v5_zero_fragment(u32 (&zx)[4], const V5Regs& r, int q4, u32 c43) {
#pragma unroll
    for (int tk = 0; tk < 2; ++tk) {
        const u32 s2 = (q4 & 2) ? ((q4 & 1) ? r.sw[tk][3] : r.sw[tk][2]) : ((q4 & 1) ? r.sw[tk][1] : r.sw[tk][0]);
        const u32 zw = (q4 & 2) ? r.zw[tk][1] : r.zw[tk][0];
        const u32 z2 = (q4 & 1) ? v5_code2<1>(zw, c43) : v5_code2<0>(zw, c43);  // bf16x2 128 + z
        const u32 zz = fma_bf16x2(z2, 0x3f803f80u, 0xc300c300u);                 // z, exact
        zx[tk] = fma_bf16x2(zz, s2, 0x80008000u);
        zx[2 + tk] = fma_bf16x2(zz, s2 ^ 0x80008000u, zx[tk]);
    }
}

// QMLA_V5_ZFOLD: thread i < 128's query row h = i / 8 (query row rbase + h) content channels of group g = i % 8, for
// v5_stage_zero_queries (zeros for rows >= R and threads i >= 128); loaded with the query tile's, before its stores
__device__ __forceinline__ void v5_load_zero_queries(uint4 (&x)[QMLA_GC / 8], const u16* __restrict__ q_lat, int b,
                                                     int R, int rbase) {
    const int i = threadIdx.x, h = i >> 3, g = i & 7;
    const bool ok = i < 8 * RT && rbase + h < R;
    const uint4* p = (const uint4*)(q_lat + ((i64)b * R + rbase + (ok ? h : 0)) * DC + QMLA_GC * g);
#pragma unroll
    for (int v = 0; v < QMLA_GC / 8; ++v) x[v] = ok ? __ldg(p + v) : make_uint4(0u, 0u, 0u, 0u);
}

// QMLA_V5_ZFOLD: the zero-point k-steps' B in query block NCB, row h (query row rbase + h): channels g, 8 + g, 16 + g
// (g < 8) hold -hi, +hi, -lo of Q_g = the sum of the row's content queries of group g (hi = bf16(Q_g),
// lo = bf16(Q_g - hi)), channels 24 .. 63 zero; rows >= R zero. Thread i < 128 sums (h, g) = (i / 8, i % 8) from x
// (v5_load_zero_queries), 128 <= i < 256 zero the rest.
__device__ __forceinline__ void v5_stage_zero_queries(u8* qt, const uint4 (&x)[QMLA_GC / 8]) {
    const int i = threadIdx.x;
    const auto put = [&](int h, int ch, u32 v) {
        *(u16*)(qt + sw128_chunk(h, 8 * NCB + (ch >> 3), RT) + 2 * (ch & 7)) = (u16)v;
    };
    if (i < 8 * RT) {
        const int h = i >> 3, g = i & 7;
        float q = 0.0f;
#pragma unroll
        for (int v = 0; v < QMLA_GC / 8; ++v) {
            const u32 w[4] = {x[v].x, x[v].y, x[v].z, x[v].w};
#pragma unroll
            for (int k = 0; k < 4; ++k) q += bf16_bits_to_f32(w[k] & 0xffffu) + bf16_bits_to_f32(w[k] >> 16);
        }
        const u32 hi = f32_to_bf16_bits(q), lo = f32_to_bf16_bits(q - bf16_bits_to_f32(hi));
        put(h, g, hi ^ 0x8000u);
        put(h, 8 + g, hi);
        put(h, 16 + g, lo ^ 0x8000u);
        put(h, 24 + g, 0u);
    } else if (i < 16 * RT) {
        const int h = (i - 8 * RT) >> 3, c = (i & 7) * 4;  // channels 32 + c .. 32 + c + 3
#pragma unroll
        for (int k = 0; k < 4; ++k) put(h, 32 + c + k, 0u);
    }
}
#endif

extern "C" __global__ void __launch_bounds__(NWGS * NTH, 1) qmla_attn_v5(
    const u16* __restrict__ q_lat, const u16* __restrict__ q_rope, const u8* __restrict__ pages,
    const u16* __restrict__ sink_buf, const u16* __restrict__ local_buf, const int* __restrict__ block_table,
    const qmla_index_t* __restrict__ seq_lens, const qmla_index_t* __restrict__ seq_ids, float* __restrict__ o_part,
    float2* __restrict__ ml_part, int S_q, int H, int max_pages, int bt_stride, int num_pages, int max_seqs,
    int sink, int local, int tiles_per_split, int num_splits, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    u8* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);  // the swizzle needs 1024-byte tiles

    // the warpgroup through a shuffle is provably warp-uniform: the worker's loop, and the wgmma in it, are not
    // on a divergent path for ptxas
    const int wgi = __shfl_sync(0xffffffffu, (int)threadIdx.x >> 7, 0);
    const int wg = NHV == 1 ? wgi : wgi / NHV, hv = NHV == 1 ? 0 : wgi % NHV;  // worker, its half
    const int tid = threadIdx.x & (NTH - 1);
    const int ww = tid >> 5, lane = tid & 31;
    const int g8 = lane >> 2, q4 = lane & 3;
    u8* wk = smem + wgi * WK_BYTES;
    u8* kt = wk + W_KT;
    float* red = (float*)(wk + W_RED);
    u8* flg = wk + W_FLG;

    const int R = S_q * H;
    const int NCHK = (R + RT - 1) / RT;
    const int b = blockIdx.x / NCHK, rbase = (blockIdx.x % NCHK) * RT;
    const int L = (int)seq_lens[b];
    const i64 sid = seq_ids[b];
    const bool sid_ok = sid >= 0 && sid < max_seqs;
    // packed tokens: [keep_lo, keep_hi) = [sink_end, local_start), between the sink and the local window
    const int keep_lo = sid_ok ? min(sink, L) : 0;
    const int keep_hi = (sid_ok && local > 0) ? max(keep_lo, L - local) : L;
    const int split = blockIdx.y, slot = NWG * split + wg;
    const int t_begin = max(split * tiles_per_split * T, keep_lo / T * T);
    const int t_end = min(keep_hi, (split + 1) * tiles_per_split * T);
    // the CTA's tiles: np packed ones from t_begin, then, in the split that attends to the row chunk's protected
    // tokens (stage.cuh's qmla_protected_split), the ns tiles of the sink [0, keep_lo) and the nl tiles the local
    // window [keep_hi, L) touches
    const bool prot = QMLA_V5_PROTECTED && sid_ok &&
                      split == qmla_protected_split(keep_lo, keep_hi, tiles_per_split, T, (int)gridDim.y);
    const int np = t_begin < t_end ? (t_end - t_begin + T - 1) / T : 0;
    const int ns = prot ? (keep_lo + T - 1) / T : 0;
    const int nl = (prot && keep_hi < L) ? (L - 1) / T - keep_hi / T + 1 : 0;

    // this thread's columns (query rows rbase + 8 i + 2 q4 + e) and the tokens each attends to: n < lim
    int lim[2][2];
    const int lim_min = v5_column_limits(lim, keep_hi, L, S_q, H, rbase, q4);

    // O^T: acc[mb][4 i + 2 h + e] = channel 64 mb + 16 ww + g8 + 8 h, column 8 i + 2 q4 + e (ZF: block NMB, rows
    // 0 .. 15 of warp 0: sum_t P s z of group g8, then of its rounding errors, negated)
    float acc[NMB + ZF][8];
#pragma unroll
    for (int mb = 0; mb < NMB + ZF; ++mb) {
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[mb][k] = 0.0f;
    }
    float m_run[2][2] = {{-QMLA_INF, -QMLA_INF}, {-QMLA_INF, -QMLA_INF}};
    float l_run[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};  // this thread's share of the column sums

    if (np + ns + nl > 0) {
        // ------------------------------------------------------------ queries [RT][DT] in QK's channel order
        // (rows >= R: zeros), one pair of channels per load; a thread's loads all go out before its stores. Pair lp
        // of a row is pair lp - hq DTH / 2 of half hq's tile
        u32 qv[QLD];
#pragma unroll
        for (int k = 0; k < QLD; ++k) {
            const int idx = threadIdx.x + k * NWGS * NTH, row = idx / (DT / 2), lp = idx % (DT / 2);
            const int hq = NHV == 1 ? 0 : lp / (DTH / 2), pc = v5_qk_channel(2 * (lp - hq * (DTH / 2)), hq);
            qv[k] = 0u;
            if ((QEVEN || idx < QPAIRS) && rbase + row < R) {
                const i64 qrow = (i64)b * R + rbase + row;
                qv[k] = pc < DC ? *(const u32*)(q_lat + qrow * DC + pc) : *(const u32*)(q_rope + qrow * DR + (pc - DC));
            }
        }
#if ZF
        uint4 zq[QMLA_GC / 8];
        v5_load_zero_queries(zq, q_lat, b, R, rbase);
#endif
        // the worker's first tile's operands, also before the stores
        const int* bt_row = block_table + (i64)b * bt_stride;
        const int my_begin = t_begin + wg * T;
        const int tq[2] = {16 * ww + g8, 16 * ww + g8 + 8};  // this thread's tokens of a tile (A-fragment rows)
        V5Regs rg;
        if (my_begin < t_end) {
            v5_load_tile(rg, pages, v5_warp_page(my_begin, ww, bt_row, L, max_pages), num_pages, my_begin, hv, L, tq[0],
                         q4);
        }
        int pgn = v5_warp_page(my_begin + NWG * T, ww, bt_row, L, max_pages);  // page of the worker's next tile
#pragma unroll
        for (int k = 0; k < QLD; ++k) {
            const int idx = threadIdx.x + k * NWGS * NTH, row = idx / (DT / 2), lp = idx % (DT / 2);
            const int hq = NHV == 1 ? 0 : lp / (DTH / 2), lph = lp - hq * (DTH / 2);
            if (QEVEN || idx < QPAIRS) {
                *(u32*)(smem + QT_OFF + hq * QT_HALF + sw128_chunk(row, lph >> 2, RT) + 4 * (lph & 3)) = qv[k];
            }
        }
#if ZF
        v5_stage_zero_queries(smem + QT_OFF, zq);
        // the zero-point block of each key tile: rows 16 .. 63 stay zero (packed tiles store rows 0 .. 15)
        for (int k = threadIdx.x; k < NWGS * T * 8; k += NWGS * NTH) {
            *(uint4*)(smem + (k / (T * 8)) * WK_BYTES + W_KT + NCBK * (T * 128) + 16 * (k % (T * 8))) =
                make_uint4(0u, 0u, 0u, 0u);
        }
#endif
        fence_proxy_async();  // the query stores, for wgmma's reads
        __syncthreads();      // queries visible to every warpgroup

        // shared addresses as the block's base plus uniform offsets (the descriptors stay in uniform registers)
        const u32 smem_s = smem_addr(smem), kt_s = smem_s + wgi * WK_BYTES + W_KT;
        const u32 c43 = 0x43u | ((u32)L << 8);  // low byte 0x43 (all prmt reads); not a constant ptxas can fold
#if QMLA_CODES_IN_PLACE
        const u32 m43 = qmla_m43(c43);  // 0x43004300 in a register (qmla_code2_in_place)
#endif
        // stmatrix row address of this lane for content k-step 0: matrix lane / 8 = (token half, k half)
        // -> token 16 ww + 8 (m & 1) + lane % 8, chunk (k half) of the k-step's 16 channels
        const int st_t = 16 * ww + 8 * ((lane >> 3) & 1) + (lane & 7), st_x = (lane >> 4) ^ (st_t & 7);
        const u32 st_lane = kt_s + st_t * 128;
        // stmatrix row address of this lane: matrix lane / 8 = (column block i, token half h) -> P^T row
        // 8 i + lane % 8, tokens 16 ww + 8 h .. (16-byte chunk 2 ww + h)
        const int mi = lane >> 3;
        const u32 p_lane = smem_s + wgi * WK_BYTES + W_PT + sw128_chunk(8 * (mi >> 1) + (lane & 7), 2 * ww + (mi & 1), RT);

        // one tile of this worker at token t0: QK over the A fragments fill(a, kc) makes for chunk kc (packed
        // tiles dequantize their codes, protected ones load bf16 rows), after_qk() once QK is issued, then the mask
        // (tokens n in [lo, lm) attend; lm_min: the least lm), the softmax and PV. rsc: what the RoPE part of the
        // scores of this thread's tokens tq[0], tq[1] is multiplied by (QMLA_V5_ROPE_FOLD; 1 for bf16 rows). adv: how
        // the descriptors advance (adv_packed or adv_rows, QMLA_V5_DESC64)
        const auto adv_packed = [](u64 d, u32 bytes) {
            return QMLA_V5_DESC64 ? desc_advance64(d, bytes) : desc_advance(d, bytes);
        };
        const auto adv_rows = [](u64 d, u32 bytes) { return desc_advance(d, bytes); };
        auto attend_tile = [&](const int t0, const int lo, const int (&lm)[2][2], const int lm_min,
                               const float (&rsc)[2], auto&& fill, auto&& after_qk, auto&& adv, auto zfrag) {
            // zfrag(zx): the A fragment of the zero-point k-steps (QMLA_V5_ZFOLD; v5_no_zero_fragment for bf16 tiles)
            // descriptors: queries (QK's B, K-major), K (PV's A, MN-major) and P^T (PV's B, K-major), built here and
            // opaque: built once before both tile loops, ptxas took them out of uniform registers (+100 instructions)
            const u64 dq = desc_opaque(sw128_desc(smem_s + QT_OFF + hv * QT_HALF, 16, 1024));
            const u64 dv = desc_opaque(sw128_desc(kt_s, T * 128, 1024));
            const u64 dp = desc_opaque(sw128_desc(smem_s + (wgi - hv) * WK_BYTES + W_PT, 16, 1024));  // half 0's
            wgmma_wait<0>();  // the previous tile's PV (it ran beside the lines before this call)
#pragma unroll
            for (int mb = 0; mb < NMB + ZF; ++mb) wgmma_fence_operand(acc[mb]);
            v5_worker_sync(wgi);  // every thread is past the previous tile's PV (K, P free)

            // -------------------------------------------------------- QK: S^T[64 tokens][16 rows], A from registers
            // chunks of KCK k-steps: dequantize into one of two A-fragment buffers, store the content fragments to
            // the key tile (PV's operand), issue the chunk's wgmma; a buffer is refilled once its chunk has retired
            float S[8];
#if QMLA_V5_ROPE_FOLD
            float Sr[8];  // the RoPE k-steps' scores, before the scale
#endif
            u32 A[2][KCK][4];
            u32 zx[1][4];
            if constexpr (ZF) {  // the zero points' k-steps first (S starts there), their columns to key block NCBK
                zfrag(zx);
                stsm_x4(st_lane + NCBK * (T * 128) + (st_x << 4), zx[0][0], zx[0][1], zx[0][2], zx[0][3]);
                wgmma_fence_operand(zx);
                wgmma_fence_operand(S);
                wgmma_fence();
                wgmma_m64n16k16_rs(S, zx[0], adv(dq, NCB * (RT * 128)), 0);
                wgmma_m64n16k16_rs(S, zx[0], adv(dq, NCB * (RT * 128) + 32), 1);
                wgmma_commit();
            }
#pragma unroll
            for (int kc = 0; kc < NKC; ++kc) {
                u32(&a)[KCK][4] = A[kc & 1];
                if (kc >= 2) {
                    wgmma_wait<1>();
                    wgmma_fence_operand(a);
                    if constexpr (ZF) {
                        if (kc == 2) wgmma_fence_operand(zx);  // retired with chunk 0
                    }
                }
                fill(a, kc);
#pragma unroll
                for (int j = 0; j < KCK; ++j) {  // content k-step ks: chunks 2 ks, 2 ks + 1 of the key tile
                    const int ks = KCK * kc + j;
                    if (ks < KSC && !(PROBE & 2)) {
                        stsm_x4(st_lane + (ks >> 2) * (T * 128) + ((2 * (ks & 3) ^ st_x) << 4), a[j][0], a[j][1], a[j][2],
                                a[j][3]);
                    }
                }
                wgmma_fence_operand(a);
                wgmma_fence_operand(S);
#if QMLA_V5_ROPE_FOLD
                wgmma_fence_operand(Sr);
#endif
                wgmma_fence();
#pragma unroll
                for (int j = 0; j < KCK; ++j) {
                    const int ks = KCK * kc + j;
                    const u64 dqk = adv(dq, (ks >> 2) * (RT * 128) + 32 * (ks & 3));
#if QMLA_V5_ROPE_FOLD
                    if (ks >= KSC && ks < KSTEPS) wgmma_m64n16k16_rs(Sr, a[j], dqk, ks > KSC);
                    if (ks < KSC) wgmma_m64n16k16_rs(S, a[j], dqk, ks > 0 || ZF);
#else
                    if (ks < KSTEPS) wgmma_m64n16k16_rs(S, a[j], dqk, ks > 0 || ZF);
#endif
                }
                wgmma_commit();
            }
            after_qk();
            wgmma_wait<0>();
            wgmma_fence_operand(A[0]);
            wgmma_fence_operand(A[1]);
            wgmma_fence_operand(S);
#if QMLA_V5_ROPE_FOLD
            wgmma_fence_operand(Sr);
#pragma unroll
            for (int k = 0; k < 8; ++k) S[k] = fmaf(Sr[k], rsc[(k >> 1) & 1], S[k]);  // S[k]: token tq[(k >> 1) & 1]
#endif
            fence_proxy_async();  // this thread's key-tile stores, for PV's wgmma (published by the next barrier)
#if NHV > 1
            // the halves' softmax: half 1 hands its scores over and takes P^T and the rescale; half 0 runs it over the
            // pair's scores (the code below, unindented)
            float al[2][2];  // this tile's rescale of each column's output and sum
            if (hv == 1) {
                v5_send_scores(S, (float*)(wk + W_XS), tid, wg);
                v5_take_rescale(al, (const float*)(smem + (wgi - 1) * WK_BYTES + W_XS), q4, wg);
            } else {
                v5_add_scores(S, (const float*)(smem + (wgi + 1) * WK_BYTES + W_XS), tid, wg);
#endif

            // -------------------------------------------------------- mask, column maxima
            if (t0 >= lo && t0 + T <= lm_min) {  // this thread's columns attend to the whole tile
#pragma unroll
                for (int k = 0; k < 8; ++k) S[k] *= scale_log2;
            } else {
                const int n0 = t0 + 16 * ww + g8;  // this thread's tokens n0 and n0 + 8
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const int n = n0 + 8 * ((k >> 1) & 1);
                    S[k] = (n >= lo && n < lm[k >> 2][k & 1]) ? S[k] * scale_log2 : -QMLA_INF;
                }
            }
            float mx[2][2];
#pragma unroll
            for (int i = 0; i < 2; ++i) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float m = fmaxf(S[4 * i + e], S[4 * i + 2 + e]);
#pragma unroll
                    for (int o = 4; o <= 16; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
                    mx[i][e] = m;
                }
            }
            // a column's maximum passed its reference maximum by more than the slack in this warp (a first
            // finite score always does: -inf + slack)
            const bool moved = __any_sync(0xffffffffu, mx[0][0] > m_run[0][0] + QMLA_V5_MAX_SLACK ||
                                                           mx[0][1] > m_run[0][1] + QMLA_V5_MAX_SLACK ||
                                                           mx[1][0] > m_run[1][0] + QMLA_V5_MAX_SLACK ||
                                                           mx[1][1] > m_run[1][1] + QMLA_V5_MAX_SLACK);
            if (g8 == 0) {
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    red[ww * RT + 8 * i + 2 * q4] = mx[i][0];
                    red[ww * RT + 8 * i + 2 * q4 + 1] = mx[i][1];
                }
            }
            if (lane == 0) flg[ww] = moved ? 1 : 0;

            // -------------------------------------------------------- softmax (base 2), P^T to shared memory
            // m_run is each column's reference maximum, not always the running one: P = 2^(S - m_run) stays
            // below 2^QMLA_V5_MAX_SLACK, which float32 sums and bf16 P hold exactly as well as values <= 1. P is
            // first made from it, so one barrier publishes P^T and the warps' flags; only where some warp saw
            // a score past the slack (the first tiles) does every warp raise the reference to the maxima of the
            // four warps and redo P behind a second barrier.
#if NHV == 1
            float al[2][2];
#endif
            float ps[2][2];
            v5_p_tile(S, m_run, ps, p_lane);
            fence_proxy_async();
            v5_worker_sync(wgi);  // P^T, the flags and the maxima visible
            if (*(const u32*)flg != 0u) {  // the same word for every thread of the worker: a uniform branch
#pragma unroll
                for (int i = 0; i < 2; ++i) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = 8 * i + 2 * q4 + e;
                        const float mt = fmaxf(fmaxf(m_run[i][e], fmaxf(red[col], red[RT + col])),
                                               fmaxf(red[2 * RT + col], red[3 * RT + col]));
                        al[i][e] = exp2f(m_run[i][e] - ((mt == -QMLA_INF) ? 0.0f : mt));
                        m_run[i][e] = mt;
                    }
                }
                v5_p_tile(S, m_run, ps, p_lane);
                fence_proxy_async();
                v5_worker_sync(wgi);  // the new P^T visible; every warp has read the maxima and flags
            } else {
#pragma unroll
                for (int i = 0; i < 2; ++i) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) al[i][e] = (m_run[i][e] == -QMLA_INF) ? 0.0f : 1.0f;  // 2^(m - m), 2^-inf
                }
            }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
#pragma unroll
                for (int e = 0; e < 2; ++e) l_run[i][e] = l_run[i][e] * al[i][e] + ps[i][e];
            }
#if NHV > 1
                v5_give_rescale(al, (float*)(wk + W_XS), ww, g8, q4, wg);
            }
#endif

            // -------------------------------------------------------- PV: O^T[d_c][16] += K^T P^T
            if (!QMLA_V5_LAZY_RESCALE ||
                __any_sync(0xffffffffu, al[0][0] != 1.0f || al[0][1] != 1.0f || al[1][0] != 1.0f || al[1][1] != 1.0f)) {
#pragma unroll
                for (int mb = 0; mb < NMB + ZF; ++mb) {
#pragma unroll
                    for (int k = 0; k < 8; ++k) acc[mb][k] *= al[k >> 2][k & 1];
                }
            }
#pragma unroll
            for (int mb = 0; mb < NMB + ZF; ++mb) wgmma_fence_operand(acc[mb]);
            wgmma_fence();
#pragma unroll
            for (int mb = 0; mb < ((PROBE & 1) ? 0 : NMB); ++mb) {
#pragma unroll
                for (int kk = 0; kk < T / 16; ++kk) {
                    // A: K^T, channels of column block mb, tokens 16 kk .. (2048 bytes per 16 rows); B: P^T,
                    // tokens 16 kk .. (32 bytes into the rows)
                    wgmma_m64n16k16_ss<1, 0>(acc[mb], adv(dv, mb * (T * 128) + 2048 * kk),
                                             adv(dp, 32 * kk), 1);
                }
            }
            if constexpr (ZF) {  // sum_t P s z of each group (key block NCBK's rows 0 .. 15)
#pragma unroll
                for (int kk = 0; kk < T / 16; ++kk) {
                    wgmma_m64n16k16_ss<1, 0>(acc[NMB], adv(dv, NMB * (T * 128) + 2048 * kk), adv(dp, 32 * kk), 1);
                }
            }
            wgmma_commit();  // waited for in the next tile, or below
        };

        for (int t0 = my_begin; t0 < t_end; t0 += NWG * T) {
#if QMLA_V5_EARLY_LOADS
            const V5Regs cur = rg;  // tile t0's operands; the worker's next tile's load into rg beside this tile
            if (t0 + NWG * T < t_end) {
                v5_load_tile(rg, pages, pgn, num_pages, t0 + NWG * T, hv, L, tq[0], q4);
                pgn = v5_warp_page(t0 + 2 * NWG * T, ww, bt_row, L, max_pages);
            }
#else
            const V5Regs& cur = rg;  // tile t0's operands; the next tile's load into rg once QK has read them
#endif
            u32 off2[2][KCH][NGL], roff2[2];
#if QMLA_CSCALE_BF16
            u32 s2[2][KCH][NGL];  // bf16x2 content scales
#else
            float s2[2][KCH][NGL];
#endif
            float rs[2];
#pragma unroll
            for (int tk = 0; tk < 2; ++tk) {
#if !QUAD  // else each group's at the k-step where it starts (dequantize)
#pragma unroll
                for (int c = 0; c < KCH; ++c) {
#pragma unroll
                    for (int gl = 0; gl < NGL; ++gl) {
#if PACKED  // 2-bit d_c 512: the lane's group of slice c is 2 c + q4 / 2 (one a slice)
                        const u32 z = __byte_perm(cur.zw[tk][c >> 1], 0u, 0x4440 | (2 * (c & 1) + (q4 >> 1)));
                        const u32 cs = __byte_perm(cur.sw[tk][c], 0u, (q4 & 2) ? 0x4432 : 0x4410);
#else
                        const u32 z = cur.cz[tk][c][gl], cs = cur.cs[tk][c][gl];
#endif
#if QMLA_CODES_IN_PLACE
                        off2[tk][c][gl] = qmla_off2_in_place(z, c);
#if QMLA_CSCALE_BF16
                        s2[tk][c][gl] = qmla_s2_in_place(cs | (cs << 16), c);
#else
                        s2[tk][c][gl] = __uint_as_float(cs) * (1.0f / (float)(1 << qmla_code_pos(c)));
#endif
#else
                        off2[tk][c][gl] = 0xc300c300u | z | (z << 16);
#if QMLA_CSCALE_BF16
                        s2[tk][c][gl] = cs | (cs << 16);
#else
                        s2[tk][c][gl] = __uint_as_float(cs);
#endif
#endif
#if ZF  // -128 s (exact): the dequantization's fma makes bf16(s code)
                        off2[tk][c][gl] = fma_bf16x2(s2[tk][c][gl], 0xc300c300u, 0x80008000u);
#endif
                    }
                }
#endif
                roff2[tk] = 0xc300c300u | cur.rz[tk] | (cur.rz[tk] << 16);
#if QMLA_RSCALE_BF16
                rs[tk] = bf16_bits_to_f32((u16)cur.rs[tk]);
#else
                rs[tk] = __uint_as_float(cur.rs[tk]);
#endif
            }
            const auto dequantize = [&](u32 (&a)[KCK][4], const int kc) {
#pragma unroll
                for (int j = 0; j < KCK; ++j) {
                    const int ks = KCK * kc + j;
                    if (ks < KSC) {
                        const int bp = ks / SPC, sp = ks % SPC, gl = (BL >= QMLA_GC) ? 2 * bp / QMLA_GC : 0;
#if QUAD
                        if (ks % 8 == 0) {  // share bytes 2 ks .. are group ks / 8 of each slice
#pragma unroll
                            for (int r = 0; r < 4; ++r) {
                                v5_quad_group(off2[r & 1][r >> 1][0], s2[r & 1][r >> 1][0], cur, r & 1, r >> 1, ks / 8,
                                              c43 | 0x80u);
#if ZF
                                off2[r & 1][r >> 1][0] = fma_bf16x2(s2[r & 1][r >> 1][0], 0xc300c300u, 0x80008000u);
#endif
                            }
                        }
#endif
#pragma unroll
                        for (int r = 0; r < 4; ++r) {  // a[j][tk + 2 hi]: token tk, slice 2 sp + hi
                            const int tk = r & 1, c = 2 * sp + (r >> 1);
#if QMLA_CODES_IN_PLACE
                            const u32 w = cur.wc[tk][bp >> 1];
                            const u32 y = (bp & 1) ? qmla_pair_bytes<1>(w) : qmla_pair_bytes<0>(w);
                            const u32 c2 = qmla_code2_in_place(y, c, m43);
#else
                            const u32 x = (cur.wc[tk][bp >> 1] >> (CBITS * c)) & CMASK;
                            const u32 c2 = (bp & 1) ? v5_code2<1>(x, c43) : v5_code2<0>(x, c43);
#endif
#if PROBE & 4
                            a[j][r] = c2;
#elif ZF  // s (128 + code) - 128 s: bf16(s code)
                            a[j][r] = fma_bf16x2(c2, s2[tk][c][gl], off2[tk][c][gl]);
#elif QMLA_CSCALE_BF16
                            a[j][r] = qmla_dq2_bf16(c2, off2[tk][c][gl], s2[tk][c][gl]);
#else
                            a[j][r] = qmla_dq2_f32(c2, off2[tk][c][gl], s2[tk][c][gl]);
#endif
                        }
                    } else if (ks < KSTEPS) {
                        const int bp = ks - KSC;
#pragma unroll
                        for (int r = 0; r < 4; ++r) {
                            const int tk = r & 1, c = r >> 1;
                            const u32 x = (cur.wr[tk][bp >> 1] >> (4 * c)) & 0x0f0f0f0fu;
                            const u32 c2 = (bp & 1) ? v5_code2<1>(x, c43) : v5_code2<0>(x, c43);
#if QMLA_V5_ROPE_FOLD
                            a[j][r] = fma_bf16x2(c2, 0x3f803f80u, roff2[tk]);  // code - z, exact; rs[tk] scales the score
#else
                            a[j][r] = qmla_dq2_f32(c2, roff2[tk], rs[tk]);
#endif
                        }
                    }
                }
            };
            attend_tile(t0, keep_lo, lim, lim_min, rs, dequantize, [&]() {
#if !QMLA_V5_EARLY_LOADS  // the next tile's loads once QK has read this tile's registers
                if (t0 + NWG * T < t_end) {
                    v5_load_tile(rg, pages, pgn, num_pages, t0 + NWG * T, hv, L, tq[0], q4);
                    pgn = v5_warp_page(t0 + 2 * NWG * T, ww, bt_row, L, max_pages);
                }
#endif
            }, adv_packed,
#if ZF
            [&](u32 (&zx)[1][4]) { v5_zero_fragment(zx[0], cur, q4, c43); });
#else
            v5_no_zero_fragment);
#endif
        }

        // the protected tiles (ns + nl: none but in the split qmla_protected_split picks): the worker goes on with its
        // share of the CTA's tiles (np packed ones, then these), each tile's rows loaded as bf16 pairs straight into
        // the A fragments from the protection buffers
        const u16* sink_rows = sink_buf + (sid_ok ? sid : 0) * sink * DT;  // read only where sid_ok
        const u16* local_rows = local_buf + (sid_ok ? sid : 0) * local * DT;
        for (int j = (wg - np % NWG + NWG) % NWG; j < ns + nl; j += NWG) {
            const bool in_sink = j < ns;
            const int t0 = in_sink ? T * j : keep_hi / T * T + T * (j - ns);
            const int lo = in_sink ? 0 : keep_hi, hi = in_sink ? keep_lo : L;
            int lm[2][2];
            const int lm_min = v5_column_limits(lm, hi, L, S_q, H, rbase, q4);
            // the lane's content pairs (its share of each slice, v5_share_byte) and RoPE pairs of its two tokens' rows; a
            // token outside [lo, hi) reads a row inside (finite values; its scores are masked)
            const u16* crow[2];
            const u16* rrow[2];
#pragma unroll
            for (int tk = 0; tk < 2; ++tk) {
                const int nc = min(max(t0 + tq[tk], lo), hi - 1);
                const u16* row = in_sink ? sink_rows + (i64)nc * DT : local_rows + (i64)(nc % local) * DT;
                crow[tk] = row + CBH * hv;
                rrow[tk] = row + DC + RBH * hv + RBL * q4;
            }
#if QMLA_V5_PROT_VEC
            // per token and slice (RoPE: half), a chunk's k-steps are consecutive bf16 pairs of the row: one load each
            const auto load_rows = [&](u32 (&a)[KCK][4], const int kc) {
                if (KCK * kc < KSC) {  // chunks never straddle content and RoPE (KSC % KCK == 0)
                    constexpr int W = KCK / SPC;
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int tk = r & 1, kh = r >> 1;
#pragma unroll
                        for (int sp = 0; sp < SPC; ++sp) {
                            u32 v[W];
                            v5_load_words<W>(v, crow[tk] + CB * (2 * sp + kh) +
                                                    v5_share_byte(2 * (KCK * kc / SPC), q4));
#pragma unroll
                            for (int w = 0; w < W; ++w) a[SPC * w + sp][r] = v[w];  // k-step KCK kc + SPC w + sp
                        }
                    }
                } else if (KCK * kc < KSTEPS) {
                    constexpr int W = (KCK < DRH / 16) ? KCK : DRH / 16;
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int tk = r & 1, kh = r >> 1;
                        u32 v[W];
                        v5_load_words<W>(v, rrow[tk] + RB * kh + 2 * (KCK * kc - KSC));
#pragma unroll
                        for (int w = 0; w < W; ++w) a[w][r] = v[w];  // k-step KCK kc + w
                    }
                }
            };
#else
            const auto load_rows = [&](u32 (&a)[KCK][4], const int kc) {
#pragma unroll
                for (int jj = 0; jj < KCK; ++jj) {
                    const int ks = KCK * kc + jj;
#pragma unroll
                    for (int r = 0; r < 4; ++r) {  // a[jj][tk + 2 kh]: QK channels 16 ks + 8 kh + 2 q4 (+ 1) (v5_qk_channel)
                        const int tk = r & 1, kh = r >> 1;
                        if (ks < KSC) {
                            a[jj][r] = __ldg((const u32*)(crow[tk] + CB * (2 * (ks % SPC) + kh) +
                                                          v5_share_byte(2 * (ks / SPC), q4)));
                        } else if (ks < KSTEPS) {
                            a[jj][r] = __ldg((const u32*)(rrow[tk] + RB * kh + 2 * (ks - KSC)));
                        }
                    }
                }
            };
#endif
            const float unscaled[2] = {1.0f, 1.0f};
            attend_tile(t0, lo, lm, lm_min, unscaled, load_rows, [] {}, adv_rows, v5_no_zero_fragment);
        }
        wgmma_wait<0>();  // the last tile's PV
#pragma unroll
        for (int mb = 0; mb < NMB + ZF; ++mb) wgmma_fence_operand(acc[mb]);
    }

    // ---------------------------------------------------------------- partial results (v1 layout)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
#pragma unroll
            for (int o = 4; o <= 16; o <<= 1) l_run[i][e] += __shfl_xor_sync(0xffffffffu, l_run[i][e], o);
        }
    }
    if (g8 == 0) {  // the worker's last reads of red[] were before its last P^T barrier
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            red[ww * RT + 8 * i + 2 * q4] = l_run[i][0];
            red[ww * RT + 8 * i + 2 * q4 + 1] = l_run[i][1];
        }
    }
#if NHV > 1
    v5_pair_sync(v5_bar_scores(wg));  // both halves past their last PV (the key tiles free), row sums in red[]
    float* ot = (float*)(smem + NHV * wg * WK_BYTES);  // [RT][OT_STRIDE] in half 0's area
#else
#if ZF
    float* corr = (float*)(wk + W_CORR);
    if (ww == 0) {  // group g8's sum_t P s z: its bf16 parts' sum less its negated rounding errors' (rows g8, g8 + 8)
#pragma unroll
        for (int k = 0; k < 8; k += 4) {
            corr[g8 * RT + 2 * k + 2 * q4] = acc[NMB][k] - acc[NMB][k + 2];
            corr[g8 * RT + 2 * k + 2 * q4 + 1] = acc[NMB][k + 1] - acc[NMB][k + 3];
        }
    }
#endif
    v5_worker_sync(wgi);  // every warp is past its last PV (the key tile is free) and its row sums are in red[]
    float* ot = (float*)kt;  // [RT][OT_STRIDE]
#endif
#pragma unroll
    for (int mb = 0; mb < NMB; ++mb) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            // row 16 ww + g8 + 8 h of block mb is QK's channel 64 mb + 16 ww + g8 + 8 h
            const int col = 8 * (k >> 2) + 2 * q4 + (k & 1);
            const int ch = v5_qk_channel(64 * mb + 16 * ww + g8 + 8 * ((k >> 1) & 1), hv);
#if ZF
            ot[col * OT_STRIDE + ch] = acc[mb][k] - corr[(ch / QMLA_GC) * RT + col];
#else
            ot[col * OT_STRIDE + ch] = acc[mb][k];
#endif
        }
    }
    if ((NHV == 1 || hv == 0) && ww == 0 && g8 == 0) {  // the halves' statistics are the same
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = 8 * i + 2 * q4 + e;
                if (rbase + col < R) {
                    ml_part[((i64)b * R + rbase + col) * num_splits + slot] =
                        make_float2(m_run[i][e], red[col] + red[RT + col] + red[2 * RT + col] + red[3 * RT + col]);
                }
            }
        }
    }
#if NHV > 1
    v5_pair_sync(v5_bar_scores(wg));  // the output tile written
    qmla_store_partial_rows<NHV * NTH>(o_part, ot, b, R, rbase, num_splits, slot, hv * NTH + tid);
#else
    v5_worker_sync(wgi);  // the output tile written
    qmla_store_partial_rows(o_part, ot, b, R, rbase, num_splits, slot, tid);
#endif
}
