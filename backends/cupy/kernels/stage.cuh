// QuantMLA CuPy backend: staging of a tile's raw page sections, shared by attention_v2.cu,
// attention_v3.cu and attention_v4.cu (attention_v5.cu has no stage and takes only the partial-row store).
//
// Included once the kernel has defined its tile: T (tokens per tile), NTH (threads per CTA), DC
// (latent width), CB/RB (content/RoPE code bytes per token), NCT (16-byte chunks of a content code
// row), NGC, CSZ and RSZ; QMLA_STAGE_FLAGS 1 adds v2's token-flag byte. It defines the stage layout
// (SO_* offsets, STAGE_BYTES; mirrored by stage_bytes() in attention.py) and the copies into it.
//
// A stage holds a tile token-major like the page, content code rows chunk-swizzled per token.
#pragma once

#ifndef QMLA_STAGE_FLAGS
#define QMLA_STAGE_FLAGS 0
#endif
#define SO_R (T * CB)                  // RoPE codes [T][RB]
#define SO_CS (SO_R + T * RB)          // content scales [T][NGC] (raw, CSZ bytes each)
#define SO_CZ (SO_CS + T * NGC * CSZ)  // content zeros [T][NGC]
#define SO_RS (SO_CZ + T * NGC)        // RoPE scale [T] (raw, RSZ bytes)
#define SO_RZ (SO_RS + T * RSZ)        // RoPE zero [T]
#define SO_FL (SO_RZ + T)              // QMLA_STAGE_FLAGS: token flag [T]
#define STAGE_BYTES ((SO_FL + (QMLA_STAGE_FLAGS ? T : 0) + 15) / 16 * 16)

// copies go by page segment: SEGT consecutive tokens of a tile share one page; CH_*: the
// 16-byte chunks of each page section in one segment
#define SEGT ((QMLA_P < T) ? QMLA_P : T)
#define NSEG (T / SEGT)
#define CH_C (SEGT * CB / 16)
#define CH_R (SEGT * RB / 16)
#define CH_CS (SEGT * NGC * CSZ / 16)
#define CH_CZ (SEGT * NGC / 16)
#define CH_RS (SEGT * RSZ / 16)
#define CH_RZ (SEGT / 16)
#define CH_SMALL (CH_R + CH_CS + CH_CZ + CH_RS + CH_RZ)
static_assert(T % SEGT == 0 && SEGT % 16 == 0, "page size must be a multiple of 16");
static_assert((SEGT * NGC) % 16 == 0, "zero-point run of a segment must be 16-byte chunks");
static_assert(QMLA_OFF_CC % 16 == 0 && QMLA_OFF_RC % 16 == 0 && QMLA_OFF_CS % 16 == 0 && QMLA_OFF_CZ % 16 == 0 &&
                  QMLA_OFF_RS % 16 == 0 && QMLA_OFF_RZ % 16 == 0 && QMLA_PAGE_BYTES % 16 == 0,
              "page sections must be 16-byte aligned");

// 16-byte chunk swizzle of a content code row: with >= 8 chunks per token, tokens t and t + 1
// land in different 64-byte halves of a bank window and tokens 2q of four lanes in different
// 32-byte quarters, so the kernels' fragment reads are conflict-free
__device__ __forceinline__ int qmla_swz(int t) {
#if NCT >= 8
    return ((t & 1) << 2) ^ (t & 6);
#else
    return (t >> 1) & 3;
#endif
}

// byte offset of code byte `off` of token t in a stage's content area
__device__ __forceinline__ int qmla_coff(int t, int off) {
    return t * CB + ((((off >> 4) ^ qmla_swz(t))) << 4) + (off & 15);
}

// N = 2, 4 or 8 code bytes at src (one aligned load) as 32-bit words
template <int N>
__device__ __forceinline__ void qmla_load_bytes(const u8* src, u32 (&w)[(N + 3) / 4]) {
    static_assert(N == 2 || N == 4 || N == 8, "2, 4 or 8 bytes");
    if constexpr (N == 8) {
        const uint2 v = *(const uint2*)src;
        w[0] = v.x;
        w[1] = v.y;
    } else if constexpr (N == 4) {
        w[0] = *(const u32*)src;
    } else {
        w[0] = *(const u16*)src;
    }
}

template <int N>
__device__ __forceinline__ void qmla_wait_group() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// N 16-byte chunks of a CTA's bf16 query tile [rows][DT] (rows at or past R: zeros): chunk k of thread tid is
// idx = tid + (k0 + k) * nth, row idx / (DT / 8), channels 8 (idx % (DT / 8)) .. + 7 of [q_lat | q_rope]. All N loads are
// issued before the caller stores any (one round trip to memory; one per chunk cost v6 6-8 us a CTA, stop 38)
template <int N>
__device__ __forceinline__ void qmla_load_query_chunks(uint4 (&qv)[N], const u16* __restrict__ q_lat,
                                                       const u16* __restrict__ q_rope, int b, int R, int rbase,
                                                       int tid, int nth, int k0) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const int idx = tid + (k0 + k) * nth, row = idx / (DT / 8), ck = idx % (DT / 8);
        qv[k] = make_uint4(0u, 0u, 0u, 0u);
        if (rbase + row < R) {
            const i64 qrow = (i64)b * R + rbase + row;
            qv[k] = ck < DC / 8 ? *(const uint4*)(q_lat + qrow * DC + 8 * ck)
                                : *(const uint4*)(q_rope + qrow * DR + 8 * (ck - DC / 8));
        }
    }
}

// Page id of token n as the block table holds it (-1 past L or past the table; not checked against the
// pool). bt_row: the request's row of the block table. n >= 0; its page index is taken unsigned (a shift, where a
// signed one costs a sign fix-up).
__device__ __forceinline__ int qmla_table_page(int n, const int* __restrict__ bt_row, int L, int max_pages) {
    const u32 j = (u32)n / QMLA_P;
    return (n < L && j < (u32)max_pages) ? bt_row[j] : -1;
}

// Slot of token n (>= 0) in its page, unsigned: a signed slot costs every address built from it a sign fix-up. A macro:
// as an inline function it changed v6's dequantizer code (6-8 more instructions a tile, nvcc 13.0)
#define QMLA_SLOT(n) ((u32)(n) % QMLA_P)

// The split that attends to a row chunk's sink and local-window tokens (kernels v5, v6, which take them as tiles
// of their own after the packed ones): the first split past the packed tokens [keep_lo, keep_hi) (an empty split of
// a request shorter than the batch's longest), else the last (it holds the remainder of the packed run).
__device__ __forceinline__ int qmla_protected_split(int keep_lo, int keep_hi, int tiles_per_split, int tile,
                                                    int splits) {
    const int last = keep_hi > keep_lo ? (keep_hi - 1) / (tiles_per_split * tile) : -1;
    return min(last + 1, splits - 1);
}

// Page ids of the NSEG page segments of tile tt (-1: none: past L, past the table, or a page id
// past the pool).
__device__ __forceinline__ void qmla_load_pages(int tt, int (&pgs)[NSEG], const int* __restrict__ bt_row, int L,
                                                int max_pages, int num_pages) {
#pragma unroll
    for (int sg = 0; sg < NSEG; ++sg) {
        const int pg = qmla_table_page(tt + sg * SEGT, bt_row, L, max_pages);
        pgs[sg] = pg < num_pages ? pg : -1;
    }
}

// One 16-byte chunk r (< CH_SMALL) of a page segment's small sections (RoPE codes, scales, zero points),
// in stage.cuh's order: its offsets in the stage and the page for segment row 0 and page slot 0, the
// bytes per token of its section (each further segment row / page slot adds that much), and for scales
// the zero fill of tokens past L: copied bytes = clamp((L - n0) wz - zoff, 0, 16) for a segment starting
// at token n0 (wz = 0, zoff = -16: all 16).
struct QmlaChunk {
    int dst;   // byte offset in the stage
    int src;   // byte offset in the page
    int wtok;  // bytes per token of its section
    int wz;    // scale bytes per token (0: copied whole)
    int zoff;
};

__device__ __forceinline__ QmlaChunk qmla_small_chunk(int r) {
    QmlaChunk c;
    c.wz = 0;
    c.zoff = -16;
    if (r < CH_R) {
        c.dst = SO_R + 16 * r, c.src = QMLA_OFF_RC + 16 * r, c.wtok = RB;
    } else if ((r -= CH_R) < CH_CS) {
        c.dst = SO_CS + 16 * r, c.src = QMLA_OFF_CS + 16 * r, c.wtok = NGC * CSZ;
        c.wz = NGC * CSZ, c.zoff = 16 * r;  // scales past L read 0
    } else if ((r -= CH_CS) < CH_CZ) {
        c.dst = SO_CZ + 16 * r, c.src = QMLA_OFF_CZ + 16 * r, c.wtok = NGC;
    } else if ((r -= CH_CZ) < CH_RS) {
        c.dst = SO_RS + 16 * r, c.src = QMLA_OFF_RS + 16 * r, c.wtok = RSZ;
        c.wz = RSZ, c.zoff = 16 * r;
    } else {
        r -= CH_RS;
        c.dst = SO_RZ + 16 * r, c.src = QMLA_OFF_RZ + 16 * r, c.wtok = 1;
    }
    return c;
}

// copied bytes of chunk c for a segment starting at token n0
__device__ __forceinline__ int qmla_chunk_bytes(const QmlaChunk& c, int L, int n0) {
    return min(max((L - n0) * c.wz - c.zoff, 0), 16);
}

// Tile tt -> stage `base`: cp.async of every raw page section of the tile, by page segment, in
// 16-byte chunks. A segment whose page is missing is skipped (the caller keeps its stale bytes
// harmless); the scales of tokens past L are zero-filled.
__device__ __forceinline__ void qmla_issue_stage(u8* base, const u8* __restrict__ pages, const int (&pgs)[NSEG],
                                                 int tt, int L, int tid) {
#pragma unroll
    for (int sg = 0; sg < NSEG; ++sg) {
        const int pg = pgs[sg];  // the same in every thread: a uniform branch
        if (pg >= 0) {
            const int n0 = tt + sg * SEGT;  // first token of the segment
            const int t0s = sg * SEGT;      // ... and its row in the stage
            const u8* page = pages + (i64)pg * QMLA_PAGE_BYTES;
            const int slot0 = n0 % QMLA_P;
            // content codes: NCT chunks per token, a whole number per thread (shifts only)
#pragma unroll
            for (int k = 0; k < (CH_C + NTH - 1) / NTH; ++k) {
                const int r = tid + k * NTH;
                if (CH_C % NTH == 0 || r < CH_C) {
                    const int t = t0s + r / NCT, u = r % NCT;
                    cp_async16(base + t * CB + ((u ^ qmla_swz(t)) << 4), page + QMLA_OFF_CC + slot0 * CB + 16 * r);
                }
            }
            // the small sections (RoPE codes, scales, zero points): one chunk per thread; the rest of a
            // chunk past its copied bytes is zero-filled
#pragma unroll
            for (int k = 0; k < (CH_SMALL + NTH - 1) / NTH; ++k) {
                const int r = tid + k * NTH;
                if (r < CH_SMALL) {
                    const QmlaChunk c = qmla_small_chunk(r);
                    cp_async16_zfill(base + c.dst + t0s * c.wtok, page + c.src + slot0 * c.wtok, qmla_chunk_bytes(c, L, n0));
                }
            }
        }
    }
}

// The partial outputs leave through shared memory: 16 rows of OT_STRIDE floats (rows 4 banks
// apart), written from the MMA fragments, then stored as whole rows of float4. Stored straight
// from the fragments, every value would touch its own 32-byte sector.
#define OT_STRIDE (DC + 4)

// Rows row0 .. row0 + 15 of request b's partials (staged at `ot`) into o_part [B * R][num_splits][DC],
// split `split`; rows >= R are skipped. All NT threads (tid 0 .. NT - 1) take part.
template <int NT = NTH>
__device__ __forceinline__ void qmla_store_partial_rows(float* __restrict__ o_part, const float* ot, int b, int R,
                                                        int row0, int num_splits, int split, int tid) {
    for (int idx = tid; idx < 16 * (DC / 4); idx += NT) {
        const int row = idx / (DC / 4), c4 = idx % (DC / 4);
        if (row0 + row < R) {
            *(float4*)(o_part + (((i64)b * R + row0 + row) * num_splits + split) * DC + 4 * c4) =
                *(const float4*)(ot + row * OT_STRIDE + 4 * c4);
        }
    }
}
