// QuantMLA CuPy backend: codes -> a bf16 key tile in shared memory (attention_v4.cu from its stage,
// attention_v6.cu from registers through qmla_store16 and qmla_store_rope_chunk), made of common.cuh's pair
// conversions (qmla_code2, qmla_dq2_bf16, qmla_dq2_f32).
//
// Included after stage.cuh by a kernel that defines T, NTH (threads that dequantize together), DC,
// CB/RB, CBITS, KCH, CMASK, NCT, NGC and QMLA_KT_SW128: 1 for the 128-byte-swizzled tile of wgmma.cuh
// ([NCB][T][64], included before), 0 for rows of KST bytes. Every value is dequantized as a bf16 cache
// would store it: bf16(s * (code - z)), rounded once.
#pragma once

// byte offset of 16-byte chunk `chunk` (8 channels) of row `row` of a key (rows = T) or query tile
__device__ __forceinline__ int qmla_kt_chunk(int row, int chunk, int rows) {
#if QMLA_KT_SW128
    return sw128_chunk(row, chunk, rows);
#else
    return row * KST + 16 * chunk;
#endif
}

// 16 dequantized channels (4 words of codes, one per byte, in channel order) as 8 bf16x2 words, channels 0..7 in
// o[0..3] and 8..15 in o[4..7]; F32: a float32 scale s (products and one rounding), else bf16x2 s2
template <bool F32>
__device__ __forceinline__ void qmla_dq16(const u32 (&x)[4], u32 off2, u32 s2, float s, u32 (&o)[8]) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        if constexpr (F32) {
            o[2 * e] = qmla_dq2_f32(qmla_code2<0>(x[e]), off2, s);
            o[2 * e + 1] = qmla_dq2_f32(qmla_code2<1>(x[e]), off2, s);
        } else {
            o[2 * e] = qmla_dq2_bf16(qmla_code2<0>(x[e]), off2, s2);
            o[2 * e + 1] = qmla_dq2_bf16(qmla_code2<1>(x[e]), off2, s2);
        }
    }
}

// the same stored as two 16-byte halves, channels 0..7 at lo and 8..15 at hi. upper_first: the first store
// takes channels 8..15 (see qmla_dequantize_tile).
template <bool F32>
__device__ __forceinline__ void qmla_store16(u8* lo, u8* hi, const u32 (&x)[4], u32 off2, u32 s2, float s,
                                           bool upper_first) {
    const u32 xs[4] = {upper_first ? x[2] : x[0], upper_first ? x[3] : x[1], upper_first ? x[0] : x[2],
                       upper_first ? x[1] : x[3]};
    u32 o[8];
    qmla_dq16<F32>(xs, off2, s2, s, o);
    *(uint4*)(upper_first ? hi : lo) = make_uint4(o[0], o[1], o[2], o[3]);
    *(uint4*)(upper_first ? lo : hi) = make_uint4(o[4], o[5], o[6], o[7]);
}

// RoPE code chunk u (16 bytes, 32 4-bit codes: 16-channel runs from the low and the high nibbles, split-half
// order) of token t -> the key tile kt as bf16 s * (code - z), s a float: products and one rounding
__device__ __forceinline__ void qmla_store_rope_chunk(u8* kt, int t, int u, uint4 v, u32 z, float s) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    const u32 off2 = 0xc300c300u | z | (z << 16);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const u32 x[4] = {(w[0] >> (4 * c)) & 0x0f0f0f0fu, (w[1] >> (4 * c)) & 0x0f0f0f0fu,
                          (w[2] >> (4 * c)) & 0x0f0f0f0fu, (w[3] >> (4 * c)) & 0x0f0f0f0fu};
        const int chunk = (DC + RB * c + 16 * u) / 8;
        qmla_store16<true>(kt + qmla_kt_chunk(t, chunk, T), kt + qmla_kt_chunk(t, chunk + 1, T), x, off2, 0u, s, false);
    }
}

// the same chunk as exact bf16 (code - z), for a kernel that multiplies each score's RoPE part by the token's scale
// instead (attention_v6.cu's QMLA_V6_ROPE_FOLD)
__device__ __forceinline__ void qmla_store_rope_chunk_exact(u8* kt, int t, int u, uint4 v, u32 z) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    const u32 off2 = 0xc300c300u | z | (z << 16);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        u32 o[8];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const u32 x = (w[e] >> (4 * c)) & 0x0f0f0f0fu;
            o[2 * e] = fma_bf16x2(qmla_code2<0>(x), 0x3f803f80u, off2);  // (128 + code) * 1 - (128 + z), exact
            o[2 * e + 1] = fma_bf16x2(qmla_code2<1>(x), 0x3f803f80u, off2);
        }
        const int chunk = (DC + RB * c + 16 * u) / 8;
        *(uint4*)(kt + qmla_kt_chunk(t, chunk, T)) = make_uint4(o[0], o[1], o[2], o[3]);
        *(uint4*)(kt + qmla_kt_chunk(t, chunk + 1, T)) = make_uint4(o[4], o[5], o[6], o[7]);
    }
}

#if QMLA_QUANT
// Stage `stg` (raw page sections of one tile) -> the K tile as bf16 s * (code - z). Content: 16-byte
// chunks u of token t's code row; byte j of a row holds channels j + CB c for slice c (split-half
// order), so a chunk gives KCH runs of 16 channels. RoPE likewise.
// Lanes 32 bytes apart in one row would put lanes u and u + 4 of a quarter warp on one 16-byte bank
// group:
//   wgmma build: a thread keeps token t = p / 4 and chunk column uu = p % 4 (chunks uu, uu + 4, ...) in
//     every round, so its stores sit at two fixed offsets plus a constant per round (column block) and
//     no index arithmetic repeats; eight consecutive lanes (two adjacent tokens x four columns) store to
//     8 different 16-byte groups (chunk positions are XORed with the row), and so do their reads of the
//     staged codes (qmla_swz puts tokens 2p and 2p + 1 in different 64-byte halves);
//   mma.sync build: lanes take consecutive chunks of one token and every other four store their upper
//     half first (this build has no registers to spare for the other mapping's pointers).
__device__ __forceinline__ void qmla_dequantize_tile(const u8* stg, u8* kt, int tid) {
#if QMLA_KT_SW128
    static_assert(NCT % 4 == 0 && (4 * T) % NTH == 0, "code rows of whole 64-byte groups, 4 T chunk columns per pass");
#pragma unroll
    for (int k = 0; k < 4 * T / NTH; ++k) {
        const int p = tid + k * NTH, t = p >> 2, uu = p & 3;
        // chunk 4 r + uu of the staged row sits at position (4 r + uu) ^ qmla_swz(t)
        const int sw = qmla_swz(t);
        const u8* src = stg + t * CB + 16 * ((uu ^ sw) & 3);
        u8* lo = kt + sw128_chunk(t, 2 * uu, T);  // channels 16 uu .. 16 uu + 7 of column block 0
        u8* hi = kt + sw128_chunk(t, 2 * uu + 1, T);
#pragma unroll
        for (int r = 0; r < NCT / 4; ++r) {
            const uint4 v = *(const uint4*)(src + 64 * (r ^ (sw >> 2)));
            const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int c = 0; c < KCH; ++c) {
                // channels CB c + 64 r + 16 uu ..: column block CB c / 64 + r
                const int blk = CB * c / 64 + r, grp = (CB * c + 64 * r + 16 * uu) / QMLA_GC;
                const u32 x[4] = {(w[0] >> (CBITS * c)) & CMASK, (w[1] >> (CBITS * c)) & CMASK,
                                  (w[2] >> (CBITS * c)) & CMASK, (w[3] >> (CBITS * c)) & CMASK};
                const u32 z = stg[SO_CZ + t * NGC + grp];
                const u32 off2 = 0xc300c300u | z | (z << 16);
#if QMLA_CSCALE_BF16
                const u32 sb = ((const u16*)(stg + SO_CS))[t * NGC + grp];
                qmla_store16<false>(lo + blk * (T * 128), hi + blk * (T * 128), x, off2, sb | (sb << 16), 0.0f, false);
#else
                qmla_store16<true>(lo + blk * (T * 128), hi + blk * (T * 128), x, off2, 0u,
                                   ((const float*)(stg + SO_CS))[t * NGC + grp], false);
#endif
            }
        }
    }
#else
#pragma unroll
    for (int k = 0; k < (T * NCT + NTH - 1) / NTH; ++k) {
        const int idx = tid + k * NTH;
        if ((T * NCT) % NTH == 0 || idx < T * NCT) {
            const int t = idx / NCT, u = idx % NCT;
            const bool upper_first = (u >> 2) & 1;
            const uint4 v = *(const uint4*)(stg + qmla_coff(t, 16 * u));
            const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int c = 0; c < KCH; ++c) {
                const int ch = CB * c + 16 * u, grp = ch / QMLA_GC;
                const u32 x[4] = {(w[0] >> (CBITS * c)) & CMASK, (w[1] >> (CBITS * c)) & CMASK,
                                  (w[2] >> (CBITS * c)) & CMASK, (w[3] >> (CBITS * c)) & CMASK};
                const u32 z = stg[SO_CZ + t * NGC + grp];
                const u32 off2 = 0xc300c300u | z | (z << 16);
                u8* lo = kt + qmla_kt_chunk(t, ch / 8, T);
                u8* hi = kt + qmla_kt_chunk(t, ch / 8 + 1, T);
#if QMLA_CSCALE_BF16
                const u32 sb = ((const u16*)(stg + SO_CS))[t * NGC + grp];
                qmla_store16<false>(lo, hi, x, off2, sb | (sb << 16), 0.0f, upper_first);
#else
                qmla_store16<true>(lo, hi, x, off2, 0u, ((const float*)(stg + SO_CS))[t * NGC + grp], upper_first);
#endif
            }
        }
    }
#endif
    constexpr int RCH = RB / 16;  // 16-byte chunks of a RoPE code row
    if (tid < T * RCH) {
        const int t = tid / RCH, u = tid % RCH;
#if QMLA_RSCALE_BF16
        const float s = bf16_bits_to_f32(((const u16*)(stg + SO_RS))[t]);
#else
        const float s = ((const float*)(stg + SO_RS))[t];
#endif
        qmla_store_rope_chunk(kt, t, u, *(const uint4*)(stg + SO_R + t * RB + 16 * u), stg[SO_RZ + t], s);
    }
}
#endif  // QMLA_QUANT
