// The pieces of the v8 and v9 probes (benchmarks/v8_probe.cu, v9_probe.cu): v7_probe's synthetic token-major C4R4
// layout, the lanes' code pairs (128 + code as bf16, no scale), QK with one accumulator a scale group, the P' tiles
// and PV over an unscaled key tile. A warp owns 16 tokens of a 64-token tile for QK (rows g, g + 8 a lane) and 128
// channels for PV. Include after common.cuh and wgmma.cuh.
#pragma once

#define H 16
#define DC 512
#define DR 64
#define CROW 256   // content code bytes a token (4-bit)
#define RROW 32    // RoPE code bytes a token
#define NGC 8      // content groups of 64 channels
#define T 64       // tokens a tile
#define NB 16      // 8-channel output blocks a warp (128 channels)
#define SLACK 8.0f
#define VT_BYTES (T * DC * 2)        // [token][512 positions] bf16, 16-byte chunks swizzled by token % 8
#define PT_BYTES (NGC * H * T * 2)   // [group][head][token] bf16, 16-byte chunks swizzled by head % 8
#define ZT_BYTES (T * 16)            // [token][8 groups] bf16 128 + z

template <bool B>
struct V8Flag {
    static constexpr bool value = B;
};

// bf16x2 128 + code of the nibbles at bits SH and SH + 16 of x: one LOP3 ((a & b) | c, both constants in
// registers: a LOP3 takes one immediate, so the compiler would split it in two)
template <int SH>
__device__ __forceinline__ u32 v8_pair(u32 x) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(x >> SH), "r"(0x000f000fu), "r"(0x43004300u));
    return d;
}

struct V8Token {
    uint4 c[4];   // content bytes 64 gp + 16 q .. + 15 (gp = 0..3)
    uint2 r;      // RoPE bytes 8 q .. 8 q + 7
    uint4 cs;     // the 8 content scales (bf16 bits)
    uint2 cz;     // the 8 content zero points
    u32 rs, rz;   // RoPE scale bits, zero point
};

// a token's scales and zero points (the rest of V8Token), loaded ahead of its codes
struct V8Scales {
    uint4 cs;
    uint2 cz;
    u32 rs, rz;
};
__device__ __forceinline__ void v8_load_scales(V8Scales& x, const u16* __restrict__ csc, const u8* __restrict__ cze,
                                               const u16* __restrict__ rsc, const u8* __restrict__ rze, long long t) {
    x.cs = *(const uint4*)(csc + t * NGC);
    x.cz = *(const uint2*)(cze + t * NGC);
    x.rs = rsc[t];
    x.rz = rze[t];
}
__device__ __forceinline__ void v8_set_scales(V8Token& x, const V8Scales& n) {
    x.cs = n.cs;
    x.cz = n.cz;
    x.rs = n.rs;
    x.rz = n.rz;
}
// group pair step's content codes (step 0..3) or the RoPE codes (step 4) of token t
__device__ __forceinline__ void v8_load_codes(V8Token& x, const u8* __restrict__ cc, const u8* __restrict__ rc,
                                              long long t, int step, int q) {
    if (step < 4) x.c[step] = *(const uint4*)(cc + t * CROW + 64 * step + 16 * q);
    else x.r = *(const uint2*)(rc + t * RROW + 8 * q);
}

// all of token t's codes, scales and zero points (lane q's share of the codes)
__device__ __forceinline__ void v8_load(V8Token& x, const u8* __restrict__ cc, const u8* __restrict__ rc,
                                        const u16* __restrict__ csc, const u8* __restrict__ cze,
                                        const u16* __restrict__ rsc, const u8* __restrict__ rze, long long t, int q) {
#pragma unroll
    for (int step = 0; step < 5; ++step) v8_load_codes(x, cc, rc, t, step, q);
    V8Scales sc;
    v8_load_scales(sc, csc, cze, rsc, rze, t);
    v8_set_scales(x, sc);
}

__device__ __forceinline__ u32 v8_word(const uint4& v, int e) {
    return e == 0 ? v.x : e == 1 ? v.y : e == 2 ? v.z : v.w;
}
// float of content scale g (bf16 bits in cs)
__device__ __forceinline__ float v8_scale(const uint4& cs, int g) {
    const u32 w = v8_word(cs, g >> 1);
    return __uint_as_float((g & 1) ? (w & 0xffff0000u) : (w << 16));
}
// bf16x2 (s, s) of content scale g
__device__ __forceinline__ u32 v8_scale2(const uint4& cs, int g) {
    return __byte_perm(v8_word(cs, g >> 1), 0u, (g & 1) ? 0x3232 : 0x1010);
}
__device__ __forceinline__ float v8_zero(const uint2& cz, int g) {
    return (float)(((g < 4 ? cz.x : cz.y) >> (8 * (g & 3))) & 0xffu);
}
// s (128 + z) of content group g (g < 8) or of the RoPE group (g = 8)
__device__ __forceinline__ float v8_w(const V8Token& x, int g) {
    const float s = g < 8 ? v8_scale(x.cs, g) : __uint_as_float(x.rs << 16);
    return s * (128.0f + (g < 8 ? v8_zero(x.cz, g) : (float)x.rz));
}
// bf16x2 high and low parts of (w0, w1)
__device__ __forceinline__ void v8_split(float w0, float w1, u32& hi, u32& lo) {
    hi = pack_bf16x2(w0, w1);
    lo = pack_bf16x2(w0 - __uint_as_float(hi << 16), w1 - __uint_as_float(hi & 0xffff0000u));
}
__device__ __forceinline__ float v8_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ u32 v8_mul_bf16x2(u32 a, u32 b) { return fma_bf16x2(a, b, 0x80008000u); }
__device__ __forceinline__ void v8_sts128(u32 addr, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
// scores += a group's accumulators times its scale: sa for token g (elements 0, 1), sb for token g + 8 (2, 3)
__device__ __forceinline__ void v8_add_group(float (&s)[2][4], const float (&acc)[2][4], float sa, float sb) {
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
        s[nb][0] = fmaf(sa, acc[nb][0], s[nb][0]);
        s[nb][1] = fmaf(sa, acc[nb][1], s[nb][1]);
        s[nb][2] = fmaf(sb, acc[nb][2], s[nb][2]);
        s[nb][3] = fmaf(sb, acc[nb][3], s[nb][3]);
    }
}
__device__ __forceinline__ float v8_max4(float4 v) { return fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)); }
// the content channel at value i (0..7) of key-tile chunk c (0..63): chunk 32 half + 8 gp + 2 e + odd holds QK's
// k-slots 8 odd .. 8 odd + 7 of k-step (gp, half, e), k-slot 2 q + el being channel 256 half + 64 gp + 16 q + 4 e +
// odd + 2 el (v8_pair's nibbles)
__device__ __forceinline__ int v8_channel(int c, int i) {
    return 256 * (c >> 5) + 64 * ((c >> 3) & 3) + 16 * (i >> 1) + 4 * ((c >> 1) & 3) + (c & 1) + 2 * (i & 1);
}

// A lane's fixed shared-memory addresses (16-byte chunks swizzled by row % 8: 8 rows of a matrix never share a bank)
// for warp w's QK stores (key tile, P') and PV loads, given a tile's key tile vt, P' tiles pt and 128 + z rows zt.
struct V8Addr {
    u32 vst, pst, pld, vld, zld;
    u32 vsw[4];  // (2 e + l / 16) ^ (token % 8), in bytes, for e = 0..3
    int sw16, hi16;
};

__device__ __forceinline__ V8Addr v8_addresses(u32 vt, u32 pt, u32 zt, int w, int lane) {
    V8Addr a;
    // QK's A fragments stored as they are (stmatrix): lane l gives row l % 8 (token 16 w + l % 8 + 8 ((l / 8) % 2))
    // of matrix l / 8, whose 16 bytes are chunk 32 half + 8 gp + 2 e + l / 16 of that token's row
    const int sr = lane & 7, stok = 16 * w + sr + 8 * ((lane >> 3) & 1);
    a.vst = vt + stok * (DC * 2);
#pragma unroll
    for (int e = 0; e < 4; ++e) a.vsw[e] = (u32)(((2 * e + (lane >> 4)) ^ sr) * 16);
    const int mi = lane >> 3, hrow = (lane & 7) + 8 * (mi >> 1);  // P' stores (stmatrix.trans)
    a.pst = pt + hrow * (T * 2) + (u32)(((2 * w + (mi & 1)) ^ (hrow & 7)) * 16);
    const int r16 = (lane & 7) + 8 * ((lane >> 3) & 1);           // ldmatrix rows
    a.hi16 = lane >> 4;                                             // second chunk
    a.pld = pt + r16 * (T * 2);
    a.vld = vt + r16 * (DC * 2);
    a.zld = zt + (r16 + 16 * a.hi16) * 16;
    a.sw16 = r16 & 7;
    return a;
}

// Scores S[token g, g + 8][head 2q (+1) + 8 nb] of a warp's 16 tokens, started at -W Q (zero points and the 128),
// and the tile's content stored as PV's key tile. qb(ks) gives k-step ks's B fragments (uint4: nb 0's b0, b1, nb 1's
// b0, b1; ks 36..38: the zero-point sums' three parts); after(step) runs once group pair step (0..3) or the RoPE group
// (4) is done with its codes (a caller may reload them there).
template <class QB, class AFTER>
__device__ __forceinline__ void v8_scores(float (&s)[2][4], const V8Token& c0, const V8Token& c1, int q,
                                          const V8Addr& ad, QB qb, AFTER after) {
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
    {
        u32 wh[4], wl[4];  // A of W: rows g, g + 8; slots 2q, 2q + 1 (groups) and 2q + 8, 2q + 9 (group 8 at q 0)
        v8_split(v8_w(c0, 2 * q), v8_w(c0, 2 * q + 1), wh[0], wl[0]);
        v8_split(v8_w(c1, 2 * q), v8_w(c1, 2 * q + 1), wh[1], wl[1]);
        v8_split(q == 0 ? v8_w(c0, 8) : 0.0f, 0.0f, wh[2], wl[2]);
        v8_split(q == 0 ? v8_w(c1, 8) : 0.0f, 0.0f, wh[3], wl[3]);
        // W (16 significant bits) is exact as wh + wl; the sums, in three bf16 parts, to float32's 24 bits
#pragma unroll
        for (int part = 0; part < 3; ++part) {
            const uint4 qz = qb(36 + part);
            mma_bf16(s[0], wh, qz.x, qz.y);
            mma_bf16(s[1], wh, qz.z, qz.w);
            mma_bf16(s[0], wl, qz.x, qz.y);
            mma_bf16(s[1], wl, qz.z, qz.w);
        }
    }
#pragma unroll
    for (int gp = 0; gp < 4; ++gp) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float acc[2][4] = {};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                // A: rows (tokens) g, g + 8; P0/P2 at k-slots 2q, 2q + 1, P1/P3 at 2q + 8, 2q + 9
                const u32 x0 = v8_word(c0.c[gp], e), x1 = v8_word(c1.c[gp], e);
                const u32 a[4] = {half ? v8_pair<4>(x0) : v8_pair<0>(x0), half ? v8_pair<4>(x1) : v8_pair<0>(x1),
                                  half ? v8_pair<12>(x0) : v8_pair<8>(x0), half ? v8_pair<12>(x1) : v8_pair<8>(x1)};
                const uint4 b = qb(8 * gp + 4 * half + e);
                mma_bf16(acc[0], a, b.x, b.y);
                mma_bf16(acc[1], a, b.z, b.w);
                stsm_x4(ad.vst + (u32)((32 * half + 8 * gp) * 16) + ad.vsw[e], a[0], a[1], a[2], a[3]);
            }
            const int grp = gp + 4 * half;
            v8_add_group(s, acc, v8_scale(c0.cs, grp), v8_scale(c1.cs, grp));
        }
        after(gp);
    }
    float acc[2][4] = {};  // the RoPE group: 4 k-steps (low nibbles of words 0, 1, then high)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int half = k >> 1, e = k & 1;
        const u32 x0 = e ? c0.r.y : c0.r.x, x1 = e ? c1.r.y : c1.r.x;
        const u32 a[4] = {half ? v8_pair<4>(x0) : v8_pair<0>(x0), half ? v8_pair<4>(x1) : v8_pair<0>(x1),
                          half ? v8_pair<12>(x0) : v8_pair<8>(x0), half ? v8_pair<12>(x1) : v8_pair<8>(x1)};
        const uint4 b = qb(32 + k);
        mma_bf16(acc[0], a, b.x, b.y);
        mma_bf16(acc[1], a, b.z, b.w);
    }
    v8_add_group(s, acc, __uint_as_float(c0.rs << 16), __uint_as_float(c1.rs << 16));
    after(4);
}

// the tokens' 128 + z rows (PV's zero points), written by lane q 0 of each of the warp's tokens
__device__ __forceinline__ void v8_store_zero_rows(u32 zt, const V8Token& c0, const V8Token& c1, int w, int g, int q) {
    if (q == 0) {
        const u32 k43 = 0x43434343u, zrow = zt + (16 * w + g) * 16;
        v8_sts128(zrow, __byte_perm(c0.cz.x, k43, 0x5140), __byte_perm(c0.cz.x, k43, 0x7362),
                  __byte_perm(c0.cz.y, k43, 0x5140), __byte_perm(c0.cz.y, k43, 0x7362));
        v8_sts128(zrow + 8 * 16, __byte_perm(c1.cz.x, k43, 0x5140), __byte_perm(c1.cz.x, k43, 0x7362),
                  __byte_perm(c1.cz.y, k43, 0x5140), __byte_perm(c1.cz.y, k43, 0x7362));
    }
}

// Scale the warp's scores to log2 units and write its per-head maxima over its 16 tokens to mx[head][warp] (lanes
// with g 0). mx: [16][4] floats.
__device__ __forceinline__ void v8_tile_maxima(float (&s)[2][4], float scale_log2, float* mx, int w, int g, int q) {
    float tm[4];  // heads 2q, 2q + 1, 8 + 2q, 9 + 2q
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            s[nb][e] *= scale_log2;
            s[nb][2 + e] *= scale_log2;
            tm[2 * nb + e] = fmaxf(s[nb][e], s[nb][2 + e]);
        }
    }
#pragma unroll
    for (int d = 4; d < 32; d <<= 1) {
#pragma unroll
        for (int i = 0; i < 4; ++i) tm[i] = fmaxf(tm[i], __shfl_xor_sync(0xffffffffu, tm[i], d));
    }
    if (g == 0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) mx[4 * (2 * q + (i & 1) + 8 * (i >> 1)) + w] = tm[i];
    }
}

// The 4 warps' maxima (mx[head][warp]) of heads 2q (+1) (+8) (m4), g and g + 8 (m2), lane % 16 (m1)
__device__ __forceinline__ void v8_read_maxima(const float* mx, int lane, float (&m4)[4], float (&m2)[2], float& m1) {
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int i = 0; i < 4; ++i) m4[i] = v8_max4(((const float4*)mx)[2 * q + (i & 1) + 8 * (i >> 1)]);
    m2[0] = v8_max4(((const float4*)mx)[g]);
    m2[1] = v8_max4(((const float4*)mx)[g + 8]);
    m1 = v8_max4(((const float4*)mx)[lane & 15]);
}

// The row sums of heads 2q, 2q + 1, 8 + 2q, 9 + 2q summed over the warp's lanes and written to ls[head][warp]
__device__ __forceinline__ void v8_write_row_sums(float (&l)[4], float* ls, int w, int g, int q) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int d = 4; d < 32; d <<= 1) l[i] += __shfl_xor_sync(0xffffffffu, l[i], d);
    }
    if (g == 0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) ls[4 * (2 * q + (i & 1) + 8 * (i >> 1)) + w] = l[i];
    }
}

// p = 2^(x - mref) of tokens g, g + 8 (x: the scaled scores, log2 units), added to the row sums l (heads 2q, 2q + 1,
// 8 + 2q, 9 + 2q), and P'_grp = bf16(bf16(p) s_grp) stored transposed: [grp][head][token]
__device__ __forceinline__ void v8_store_weights(const float (&x)[2][4], const float (&mref)[4], float (&l)[4],
                                                 const V8Token& c0, const V8Token& c1, u32 pst) {
    u32 pp[4];  // (token g | g + 8) x (heads 2q, 2q + 1 | 8 + 2q, 9 + 2q): stmatrix's 4 matrices
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
        const float e0 = v8_exp2(x[nb][0] - mref[2 * nb]), e1 = v8_exp2(x[nb][1] - mref[2 * nb + 1]);
        const float e2 = v8_exp2(x[nb][2] - mref[2 * nb]), e3 = v8_exp2(x[nb][3] - mref[2 * nb + 1]);
        l[2 * nb] += e0 + e2;
        l[2 * nb + 1] += e1 + e3;
        pp[2 * nb] = pack_bf16x2(e0, e1);
        pp[2 * nb + 1] = pack_bf16x2(e2, e3);
    }
#pragma unroll
    for (int grp = 0; grp < NGC; ++grp) {
        const u32 sa = v8_scale2(c0.cs, grp), sb = v8_scale2(c1.cs, grp);
        stsm_x4_t(pst + grp * (H * T * 2), v8_mul_bf16x2(pp[0], sa), v8_mul_bf16x2(pp[1], sb),
                  v8_mul_bf16x2(pp[2], sa), v8_mul_bf16x2(pp[3], sb));
    }
}

// PV of one tile over warp w's 128 positions (groups 2 w, 2 w + 1): o[n] (rows g, g + 8) += P'_g (128 + code), and
// za[j] += P'_{2w+j} (128 + z) (column 2 w + j holds what comes off group 2 w + j at the end)
__device__ __forceinline__ void v8_pv(float (&o)[NB][4], float (&za)[2][4], const V8Addr& ad, int w) {
    u32 zb[2];  // the 128 + z fragments of the odd k-steps, loaded with the even ones
#pragma unroll
    for (int kk = 0; kk < T / 16; ++kk) {
        u32 a[2][4];
        const u32 achunk = (u32)(((2 * kk + ad.hi16) ^ ad.sw16) * 16);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            ldsm_x4(ad.pld + (2 * w + j) * (H * T * 2) + achunk, a[j][0], a[j][1], a[j][2], a[j][3]);
        }
        const u32 vrowk = ad.vld + 16 * kk * (DC * 2);
#pragma unroll
        for (int n = 0; n < NB; n += 2) {
            u32 b0, b1, b2, b3;
            // chunk 16 w + n + hi16 = (16 w + 8 (n / 8)) + ((n % 8 + hi16) ^ sw16) after the swizzle
            ldsm_x4_t(vrowk + (u32)((16 * w + 8 * (n / 8) + (((n % 8) + ad.hi16) ^ ad.sw16)) * 16), b0, b1, b2, b3);
            mma_bf16(o[n], a[n / 8], b0, b1);
            mma_bf16(o[n + 1], a[n / 8], b2, b3);
        }
        if ((kk & 1) == 0) {
            u32 z0, z1;  // 128 + z of tokens 16 kk .. 16 kk + 31, all 8 groups as columns
            ldsm_x4_t(ad.zld + 16 * kk * 16, z0, z1, zb[0], zb[1]);
            mma_bf16(za[0], a[0], z0, z1);
            mma_bf16(za[1], a[1], z0, z1);
        } else {
            mma_bf16(za[0], a[0], zb[0], zb[1]);
            mma_bf16(za[1], a[1], zb[0], zb[1]);
        }
    }
}

// out[16][512] of warp w's positions: O - the zero-point sums of group 2 w + j (column 2 w + j of za[j], held by
// lane q = w), at channel v8_channel
__device__ __forceinline__ void v8_store_out(float* op, const float (&o)[NB][4], const float (&za)[2][4], int w,
                                             int lane) {
    const int g = lane >> 2, q = lane & 3;
    float zr[2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int src = (lane & ~3) | w;
        zr[j][0] = __shfl_sync(0xffffffffu, za[j][j], src);
        zr[j][1] = __shfl_sync(0xffffffffu, za[j][2 + j], src);
    }
#pragma unroll
    for (int n = 0; n < NB; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int ch = v8_channel(16 * w + n, 2 * q + e);
            op[g * DC + ch] = o[n][e] - zr[n / 8][0];
            op[(g + 8) * DC + ch] = o[n][2 + e] - zr[n / 8][1];
        }
    }
}
