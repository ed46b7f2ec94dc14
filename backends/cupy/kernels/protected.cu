// QuantMLA CuPy backend: attention over the protected (sink and local-window) tokens alone.
//
// The split kernels v2/v3 skip these tokens; this kernel adds them as the last partials of each
// row, which qmla_combine merges with the packed tokens' partials by log-sum-exp. The protected
// rows are plain bfloat16 [content | RoPE] vectors in the sink and local buffers, so this is a
// small bfloat16 flash-decoding step, not a dequantizing one:
//
//   grid (B * ceil(S_q * H / 16), protected_ctas(sink, local)), 4 warps. CTA (x, y) takes 16 query
//   rows and one 32-token tile: y < ceil(sink / 32) the sink tile y, else local-window tile
//   y - ceil(sink / 32) (the window need not start on a tile boundary; tokens outside it, or at or
//   past a row's causal limit, are masked). Same tile rule and partial slots as v2's
//   QMLA_V2_PROT_MODE 2 build, which it replaces.
//
//   1. cp.async: the 16 query rows [q_latent | q_rope] and the tile's 32 rows into shared memory
//      (rows padded by 16 bytes: ldmatrix reads them without bank conflicts); rows that are not
//      protected tokens of this tile are zero-filled.
//   2. QK: warp w scores tokens 8w..8w+7 of the 16 rows over all DC + DR channels (A = queries by
//      ldmatrix.x4, B = key rows by ldmatrix.x2: a key row holds its channels contiguously, as
//      the mma B operand wants them).
//   3. Softmax in base 2: row maxima and sums over the four warps through shared memory; P goes
//      to shared memory as bfloat16 [16][32].
//   4. PV: warp w accumulates channels DC/4 * w .. DC/4 * (w + 1) over all 32 tokens (A = P by
//      ldmatrix.x4, B = the same key rows' content by ldmatrix.x4.trans: tokens become the k pairs).
//   5. Unnormalized output, row maximum and sum go to the row's partial slot (v1's layout).
#include "common.cuh"

#define DC QMLA_DC
#define DR QMLA_DR
#define DT (QMLA_DC + QMLA_DR)
#define T QMLA_PROT_T      // tokens per CTA (attention.py PROTECTED_TILE: the protected_ctas() tiles)
#define NW QMLA_PROT_NW    // warps
#define LDS (DT + 8)      // shared row stride in bf16 elements: +16 bytes, conflict-free ldmatrix
#define KS (DT / 16)      // QK k-steps
#define CPW (DC / NW)     // PV channels per warp
#define NTPV (CPW / 8)    // PV n-tiles per warp

static_assert(DT % 16 == 0 && DC % 64 == 0, "channel counts must fill whole MMA tiles");
static_assert(NTPV % 2 == 0, "PV n-tiles come in pairs (ldmatrix.x4.trans)");
static_assert(T == 8 * NW, "each warp scores 8 tokens");

// shared memory: queries [16][LDS], keys [T][LDS] (bf16), P [16][T + 8] (bf16), row stats [NW][16] x 2
#define SO_K (16 * LDS * 2)
#define SO_P (SO_K + T * LDS * 2)
#define LDP (T + 8)
#define SO_RED (SO_P + 16 * LDP * 2)
#define QMLA_PROT_SMEM (SO_RED + 2 * NW * 16 * 4)
static_assert(QMLA_PROT_SMEM == QMLA_PROT_SMEM_EXPECTED, "attention.py protected_smem_bytes() disagrees");

extern "C" __global__ void __launch_bounds__(NW * 32, 1) qmla_attn_protected(
    const u16* __restrict__ q_lat, const u16* __restrict__ q_rope, const u8* __restrict__ pages,
    const u16* __restrict__ sink_buf, const u16* __restrict__ local_buf, const int* __restrict__ block_table,
    const qmla_index_t* __restrict__ seq_lens, const qmla_index_t* __restrict__ seq_ids, float* __restrict__ o_part,
    float2* __restrict__ ml_part, int S_q, int H, int max_pages, int bt_stride, int num_pages, int max_seqs,
    int sink, int local, int tiles_per_split, int num_splits, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem[];
    u16* qs = (u16*)smem;
    u16* ks = (u16*)(smem + SO_K);
    u16* ps = (u16*)(smem + SO_P);
    float* red_max = (float*)(smem + SO_RED);
    float* red_sum = red_max + NW * 16;

    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
    const int g8 = lane >> 2, q4 = lane & 3;
    const int R = S_q * H;
    const int NCHK = (R + 15) / 16;
    const int b = blockIdx.x / NCHK, chk = blockIdx.x % NCHK;
    const int L = (int)seq_lens[b];
    const i64 sid = seq_ids[b];
    const bool sid_ok = sid >= 0 && sid < max_seqs;
    const int sink_end = sid_ok ? min(sink, L) : 0;
    const int local_start = (sid_ok && local > 0) ? max(sink_end, L - local) : L;
    const int nsink = (sink + T - 1) / T;
    int keep_lo, keep_hi;
    if ((int)blockIdx.y < nsink) {
        keep_lo = min((int)blockIdx.y * T, sink_end);
        keep_hi = min(keep_lo + T, sink_end);
    } else {
        const int tt = (local_start / T + (int)blockIdx.y - nsink) * T;
        keep_lo = max(local_start, tt);
        keep_hi = max(keep_lo, min(L, tt + T));
    }
    const int t_begin = keep_lo / T * T;  // the tile's first token (keep_lo may sit inside it)
    const int split = num_splits - (int)gridDim.y + (int)blockIdx.y;

    // ------------------------------------------------------------ 1. stage queries and key rows
    constexpr int CHUNKS = DT / 8;  // 16-byte chunks per row
    for (int k = tid; k < 16 * CHUNKS; k += NW * 32) {
        const int i = k / CHUNKS, u = k % CHUNKS, r = chk * 16 + i;
        const u16* src = q_lat;
        int bytes = 0;
        if (r < R) {
            src = u * 8 < DC ? q_lat + ((i64)b * R + r) * DC + u * 8 : q_rope + ((i64)b * R + r) * DR + (u * 8 - DC);
            bytes = 16;
        }
        cp_async16_zfill(qs + i * LDS + u * 8, src, bytes);
    }
    for (int k = tid; k < T * CHUNKS; k += NW * 32) {
        const int i = k / CHUNKS, u = k % CHUNKS, n = t_begin + i;
        const u16* src = q_lat;  // any valid address: nothing is read when bytes == 0
        int bytes = 0;
        if (n >= keep_lo && n < keep_hi) {  // a protected token of this tile (sid_ok holds: keep_hi > keep_lo)
            src = (n < sink ? sink_buf + (sid * sink + n) * DT : local_buf + (sid * local + n % local) * DT) + u * 8;
            bytes = 16;
        }
        cp_async16_zfill(ks + i * LDS + u * 8, src, bytes);
    }
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();

    // ------------------------------------------------------------ 2. QK: rows x tokens 8w..8w+7
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    {
        const u32 qa = smem_addr(qs + (lane & 15) * LDS + (lane >> 4) * 8);
        const u32 kb = smem_addr(ks + (8 * w + (lane & 7)) * LDS + ((lane >> 3) & 1) * 8);
#pragma unroll 6
        for (int k = 0; k < KS; ++k) {
            u32 a[4], b0, b1;
            ldsm_x4(qa + 32 * k, a[0], a[1], a[2], a[3]);
            ldsm_x2(kb + 32 * k, b0, b1);
            mma_bf16(s, a, b0, b1);
        }
    }

    // ------------------------------------------------------------ 3. softmax over the 32 tokens
    // lane (g8, q4) holds rows g8 and g8 + 8, tokens 8w + 2q4 and 8w + 2q4 + 1
    const int r0 = chk * 16 + g8, r1 = r0 + 8;
    const int lim0 = min(keep_hi, L - S_q + r0 / H + 1), lim1 = min(keep_hi, L - S_q + r1 / H + 1);
    float mx[2];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const int n = t_begin + 8 * w + 2 * q4 + (e & 1);
        const bool ok = n >= keep_lo && n < (e < 2 ? lim0 : lim1);
        s[e] = ok ? s[e] * scale_log2 : -QMLA_INF;
    }
    mx[0] = fmaxf(s[0], s[1]);
    mx[1] = fmaxf(s[2], s[3]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    }
    if (q4 == 0) {
        red_max[w * 16 + g8] = mx[0];
        red_max[w * 16 + g8 + 8] = mx[1];
    }
    __syncthreads();
    float m[2], sum[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        m[h] = red_max[g8 + 8 * h];
#pragma unroll
        for (int ww = 1; ww < NW; ++ww) m[h] = fmaxf(m[h], red_max[ww * 16 + g8 + 8 * h]);
    }
    float p[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float mr = m[e >> 1];
        p[e] = mr == -QMLA_INF ? 0.0f : exp2f(s[e] - mr);  // a row with no visible token: all zero
    }
    // P as bf16, and the row sums of the rounded values (what PV multiplies)
    const u32 p01 = pack_bf16x2(p[0], p[1]), p23 = pack_bf16x2(p[2], p[3]);
    sum[0] = bf16_bits_to_f32(p01 & 0xffffu) + bf16_bits_to_f32(p01 >> 16);
    sum[1] = bf16_bits_to_f32(p23 & 0xffffu) + bf16_bits_to_f32(p23 >> 16);
    *(u32*)(ps + g8 * LDP + 8 * w + 2 * q4) = p01;
    *(u32*)(ps + (g8 + 8) * LDP + 8 * w + 2 * q4) = p23;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
    }
    if (q4 == 0) {
        red_sum[w * 16 + g8] = sum[0];
        red_sum[w * 16 + g8 + 8] = sum[1];
    }
    __syncthreads();

    // ------------------------------------------------------------ 4. PV: channels CPW*w ..
    float acc[NTPV][4];
#pragma unroll
    for (int j = 0; j < NTPV; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < T / 16; ++kk) {
        u32 a[4];
        ldsm_x4(smem_addr(ps + (lane & 15) * LDP + 16 * kk + (lane >> 4) * 8), a[0], a[1], a[2], a[3]);
        // matrices: tokens 16kk + 0..7 / 8..15 (lanes 0-7 / 8-15) at channels c, then at c + 8 (lanes 16-31)
        const u32 vb = smem_addr(ks + (16 * kk + (lane & 15)) * LDS + CPW * w + (lane >> 4) * 8);
#pragma unroll
        for (int j = 0; j < NTPV; j += 2) {
            u32 b0, b1, b2, b3;
            ldsm_x4_t(vb + 16 * j, b0, b1, b2, b3);
            mma_bf16(acc[j], a, b0, b1);
            mma_bf16(acc[j + 1], a, b2, b3);
        }
    }

    // ------------------------------------------------------------ 5. the row's partial slot
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = h ? r1 : r0;
        if (r < R) {
            const i64 row = (i64)b * R + r;
            float* dst = o_part + (row * num_splits + split) * DC + CPW * w + 2 * q4;
#pragma unroll
            for (int j = 0; j < NTPV; ++j) *(float2*)(dst + 8 * j) = make_float2(acc[j][2 * h], acc[j][2 * h + 1]);
            if (w == 0 && q4 == 0) {
                float l = 0.0f;
#pragma unroll
                for (int ww = 0; ww < NW; ++ww) l += red_sum[ww * 16 + g8 + 8 * h];
                ml_part[row * num_splits + split] = make_float2(m[h], l);
            }
        }
    }
}
