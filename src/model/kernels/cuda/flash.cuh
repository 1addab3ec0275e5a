// Attention on tensor cores with the scores kept in registers (bf16, head
// sizes 64, 128 and 256), flash style: a block of four warps takes 64
// queries (forward, d q) or 64 keys (d k, d v) and walks the other side
// tile by tile through shared memory; each warp owns 16 of the block's rows
// and holds their scores, probabilities and output as mma.sync fragments,
// so no (T, S) tensor reaches shared or global memory. Probabilities and d
// scores enter the second product rounded to bf16; accumulations are f32.
// Tiles whose bias masks every pair are skipped before their operands load.
// d q and (d k, d v) are separate kernels, each summing in a fixed order.
//
// Inputs and outputs are the bias-attention kernels' in kernels.cu. The
// warp-level primitives (ldmatrix, mma, shuffles) are defined here for the
// GPU; emulate.cpp beside this file defines them on the host, one thread
// per lane, and runs these kernels against a reference
// (scripts/cuda/emulate.sh).

#pragma once

struct AttnDims {
    int h, h_kv, t, s, d;
    long long kv_stride;
    float scale;
};

namespace fa {

#ifdef __CUDACC__
// Four 8 x 8 bf16 matrices whose rows lanes 8i..8i+7 address (matrix i);
// lane l receives row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of each.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* p) {
    const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}

// The same, transposed: lane l receives column l / 4, rows 2 (l % 4) and
// 2 (l % 4) + 1.
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const bf16* p) {
    const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}

// c (16 x 8, f32) += a (16 x 16) b (16 x 8), bf16 operands in the
// m16n8k16 fragment layouts.
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float shfl_xor(float x, int mask) { return __shfl_xor_sync(0xffffffff, x, mask); }

__device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 x = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&x);
}

__device__ __forceinline__ void store_pair(bf16* at, float lo, float hi) {
    *reinterpret_cast<__nv_bfloat162*>(at) = __floats2bfloat162_rn(lo, hi);
}

// Stops the kernel if it was launched with less shared memory than it lays
// out, or another block size, rather than let it read out of bounds.
__device__ __forceinline__ void expect_launch(size_t bytes, int threads) {
    unsigned dynamic;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic));
    if (dynamic < bytes || blockDim.x != (unsigned)threads) __trap();
}
#endif

// Row strides in shared memory, padded against bank conflicts: rows start
// 16 bytes apart modulo 128, so the eight row addresses of an ldmatrix
// (and a WMMA load) fall in distinct banks.
__host__ __device__ constexpr int ld_bf(int cols) { return cols + 8; }

// Rows [r0, r0 + n) of a (rows, D) matrix into shared memory, zeros past
// `rows`: 16 bytes (8 features) per load where the matrix is 16-byte aligned,
// as its rows then are (D is a multiple of 16), else feature by feature.
template <int D>
__device__ __forceinline__ void stage(bf16* dst, const bf16* src, int r0, int n, int rows) {
    if ((reinterpret_cast<size_t>(src) & 15) == 0) {
        constexpr int PER_ROW = D / 8;
        for (int i = threadIdx.x; i < n * PER_ROW; i += blockDim.x) {
            const int r = i / PER_ROW, c = i % PER_ROW * 8;
            uint4 x = make_uint4(0, 0, 0, 0);
            if (r0 + r < rows) x = *reinterpret_cast<const uint4*>(src + (size_t)(r0 + r) * D + c);
            *reinterpret_cast<uint4*>(dst + r * ld_bf(D) + c) = x;
        }
        return;
    }
    for (int i = threadIdx.x; i < n * D; i += blockDim.x) {
        const int r = i / D, c = i % D;
        dst[r * ld_bf(D) + c] = r0 + r < rows ? src[(size_t)(r0 + r) * D + c] : __float2bfloat16(0.f);
    }
}

constexpr int WARPS = 4, ROWS = 16 * WARPS;

// The tiles by head size: the key tile of the forward and d q kernels, the
// query tile of the d k, d v kernel, and whether d k and d v take blocks of
// their own (together their accumulators overflow the registers at 256).
// cuda/mod.rs's flash_tiles repeats them for the launches.
template <int D> struct Tiles;
template <> struct Tiles<64> {
    static constexpr int KEYS = 64, QUERIES = 64;
    static constexpr bool SPLIT = false;
};
template <> struct Tiles<128> {
    static constexpr int KEYS = 64, QUERIES = 32;
    static constexpr bool SPLIT = false;
};
template <> struct Tiles<256> {
    static constexpr int KEYS = 32, QUERIES = 16;
    static constexpr bool SPLIT = true;
};
constexpr float LOG2E = 1.4426950408889634f;

// s (16 x 8 NT) = a (16 x D) b^T, b holding 8 NT rows of D: both row-major
// in shared memory, ld_bf(D) apart. Lane l holds rows l / 4 and l / 4 + 8,
// columns 8 n + 2 (l % 4) + {0, 1} of tile n.
template <int D, int NT>
__device__ __forceinline__ void product_t(float (&s)[NT][4], const bf16* a, const bf16* b, int lane) {
    constexpr int LD = ld_bf(D);
    for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t fa[4];
        ldsm_x4(fa, a + (lane & 15) * LD + kk * 16 + (lane >> 4) * 8);
        for (int n2 = 0; n2 < NT / 2; ++n2) {
            uint32_t fb[4];
            ldsm_x4(fb, b + (n2 * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
            mma(s[2 * n2], fa, fb[0], fb[1]);
            mma(s[2 * n2 + 1], fa, fb[2], fb[3]);
        }
    }
}

// acc (16 x D) += p (16 x 8 NT, fragments as product_t leaves them, already
// rounded to bf16) b, b holding 8 NT rows of D in shared memory.
template <int D, int NT>
__device__ __forceinline__ void accumulate(float (&acc)[D / 8][4], const float (&p)[NT][4], const bf16* b, int lane) {
    constexpr int LD = ld_bf(D);
    for (int kk = 0; kk < NT / 2; ++kk) {
        const uint32_t fa[4] = {pack(p[2 * kk][0], p[2 * kk][1]), pack(p[2 * kk][2], p[2 * kk][3]),
                                pack(p[2 * kk + 1][0], p[2 * kk + 1][1]), pack(p[2 * kk + 1][2], p[2 * kk + 1][3])};
        for (int n2 = 0; n2 < D / 16; ++n2) {
            uint32_t fb[4];
            ldsm_x4_t(fb, b + (kk * 16 + (lane & 15)) * LD + n2 * 16 + (lane >> 4) * 8);
            mma(acc[2 * n2], fa, fb[0], fb[1]);
            mma(acc[2 * n2 + 1], fa, fb[2], fb[3]);
        }
    }
}

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// This lane's bias entries for a tile in fragment order, scaled by log2 e,
// -inf where masked or out of range. Queries run down the fragment's rows
// and keys across, or the other way round when `keys_first`; `r` is the
// lane's first row (its second is r + 8), `c0` the tile's first column.
// Returns whether any entry is unmasked.
template <int NT>
__device__ __forceinline__ int load_bias(float (&bv)[NT][4], const float* bias, const AttnDims& a, int r, int c0,
                                         int lane, bool keys_first) {
    int live = 0;
    for (int n = 0; n < NT; ++n)
        for (int i = 0; i < 4; ++i) {
            const int row = r + (i >> 1) * 8, col = c0 + n * 8 + (lane & 3) * 2 + (i & 1);
            const int query = keys_first ? col : row, key = keys_first ? row : col;
            float x = -INFINITY;
            if (query < a.t && key < a.s) {
                const float v = bias[(size_t)query * a.s + key];
                if (v >= -1e29f) x = v * LOG2E, live = 1;
            }
            bv[n][i] = x;
        }
    return live;
}

// What a block of 64 queries of one head (blockIdx.x the tile, blockIdx.y
// the sequence and head) reads: its queries' first row of (B, H, T) rows,
// its key/value head and its sequence's bias; and this lane's first query
// (its second is r + 8).
struct QueryBlock {
    size_t row0;
    int t0, r;
    const bf16 *k, *v;
    const float* bias;

    __device__ __forceinline__ QueryBlock(const bf16* keys, const bf16* values, const float* biases,
                                          const AttnDims& a) {
        const int bh = blockIdx.y, b = bh / a.h, hk = bh % a.h / (a.h / a.h_kv);
        row0 = (size_t)bh * a.t, t0 = blockIdx.x * ROWS;
        r = t0 + (threadIdx.x >> 5) * 16 + (threadIdx.x & 31) / 4;
        k = keys + ((size_t)b * a.h_kv + hk) * a.kv_stride;
        v = values + ((size_t)b * a.h_kv + hk) * a.kv_stride;
        bias = biases + (size_t)b * a.t * a.s;
    }
};

template <int D, int BK>
__host__ __device__ constexpr size_t fwd_bytes() {
    return (size_t)(ROWS + 2 * BK) * ld_bf(D) * 2;
}

template <int D, int BK>
__device__ void fwd(const bf16* q, const bf16* k, const bf16* v, const float* bias, bf16* o, float* lse, AttnDims a) {
    constexpr int LD = ld_bf(D), NT = BK / 8, ND = D / 8;
    expect_launch(fwd_bytes<D, BK>(), 32 * WARPS);
    extern __shared__ __align__(128) unsigned char smem[];
    bf16* qs = (bf16*)smem;
    bf16* ks = qs + ROWS * LD;
    bf16* vs = ks + BK * LD;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const QueryBlock blk(k, v, bias, a);
    const int r = blk.r;
    const float scale = a.scale * LOG2E;
    stage<D>(qs, q + blk.row0 * D, blk.t0, ROWS, a.t);
    float acc[ND][4];
    for (int n = 0; n < ND; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    // Per row (r, r + 8): the running max (log2 units) and this lane's part of the sum.
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    for (int s0 = 0; s0 < a.s; s0 += BK) {
        float s[NT][4];
        if (!__syncthreads_or(load_bias(s, blk.bias, a, r, s0, lane, false))) continue;
        stage<D>(ks, blk.k, s0, BK, a.s);
        stage<D>(vs, blk.v, s0, BK, a.s);
        __syncthreads();
        float x[NT][4];
        product_t<D, NT>(x, qs + warp * 16 * LD, ks, lane);
        float top[2] = {-INFINITY, -INFINITY};
        for (int n = 0; n < NT; ++n)
            for (int i = 0; i < 4; ++i) {
                s[n][i] = s[n][i] == -INFINITY ? -INFINITY : x[n][i] * scale + s[n][i];
                top[i >> 1] = fmaxf(top[i >> 1], s[n][i]);
            }
        float keep[2];
        for (int h = 0; h < 2; ++h) {
            top[h] = fmaxf(top[h], shfl_xor(top[h], 1));
            top[h] = fmaxf(top[h], shfl_xor(top[h], 2));
            const float m_new = fmaxf(m[h], top[h]);
            keep[h] = m_new == -INFINITY ? 1.f : exp2f(m[h] - m_new);
            m[h] = m_new;
            l[h] *= keep[h];
        }
        for (int n = 0; n < NT; ++n)
            for (int i = 0; i < 4; ++i) {
                const int h = i >> 1;
                const float p = s[n][i] == -INFINITY ? 0.f : round_bf16(exp2f(s[n][i] - m[h]));
                s[n][i] = p;
                l[h] += p;
            }
        for (int n = 0; n < ND; ++n)
            for (int i = 0; i < 4; ++i) acc[n][i] *= keep[i >> 1];
        accumulate<D, NT>(acc, s, vs, lane);
    }
    for (int h = 0; h < 2; ++h) {
        l[h] += shfl_xor(l[h], 1);
        l[h] += shfl_xor(l[h], 2);
        const int row = r + 8 * h;
        if (row >= a.t) continue;
        const size_t at = blk.row0 + row;
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        for (int n = 0; n < ND; ++n)
            store_pair(o + at * D + n * 8 + (lane & 3) * 2, acc[n][2 * h] * inv, acc[n][2 * h + 1] * inv);
        if ((lane & 3) == 0) lse[at] = l[h] > 0.f ? (m[h] + log2f(l[h])) / LOG2E : 0.f;
    }
}

template <int D, int BK>
__host__ __device__ constexpr size_t bwd_q_bytes() {
    return (size_t)(2 * ROWS + 2 * BK) * ld_bf(D) * 2;
}

// d q of 64 queries: ds_j = p_j (d o . v_j - di), d q = scale sum_j ds_j k_j.
template <int D, int BK>
__device__ void bwd_q(const bf16* q, const bf16* k, const bf16* v, const float* bias, const float* lse,
                      const bf16* dout, const float* di, bf16* dq, AttnDims a) {
    constexpr int LD = ld_bf(D), NT = BK / 8, ND = D / 8;
    expect_launch(bwd_q_bytes<D, BK>(), 32 * WARPS);
    extern __shared__ __align__(128) unsigned char smem[];
    bf16* qs = (bf16*)smem;
    bf16* dos = qs + ROWS * LD;
    bf16* ks = dos + ROWS * LD;
    bf16* vs = ks + BK * LD;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const QueryBlock blk(k, v, bias, a);
    const int r = blk.r;
    const float scale = a.scale * LOG2E;
    stage<D>(qs, q + blk.row0 * D, blk.t0, ROWS, a.t);
    stage<D>(dos, dout + blk.row0 * D, blk.t0, ROWS, a.t);
    float row_lse[2], row_di[2];
    for (int h = 0; h < 2; ++h) {
        const bool in = r + 8 * h < a.t;
        row_lse[h] = in ? lse[blk.row0 + r + 8 * h] * LOG2E : 0.f;
        row_di[h] = in ? di[blk.row0 + r + 8 * h] : 0.f;
    }
    float acc[ND][4];
    for (int n = 0; n < ND; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    for (int s0 = 0; s0 < a.s; s0 += BK) {
        float s[NT][4];
        if (!__syncthreads_or(load_bias(s, blk.bias, a, r, s0, lane, false))) continue;
        stage<D>(ks, blk.k, s0, BK, a.s);
        stage<D>(vs, blk.v, s0, BK, a.s);
        __syncthreads();
        float x[NT][4], dp[NT][4];
        product_t<D, NT>(x, qs + warp * 16 * LD, ks, lane);
        product_t<D, NT>(dp, dos + warp * 16 * LD, vs, lane);
        for (int n = 0; n < NT; ++n)
            for (int i = 0; i < 4; ++i) {
                const int h = i >> 1;
                const float p = s[n][i] == -INFINITY ? 0.f : exp2f(x[n][i] * scale + s[n][i] - row_lse[h]);
                s[n][i] = round_bf16(p * (dp[n][i] - row_di[h]));
            }
        accumulate<D, NT>(acc, s, ks, lane);
    }
    for (int h = 0; h < 2; ++h) {
        const int row = r + 8 * h;
        if (row >= a.t) continue;
        const size_t at = (blk.row0 + row) * D;
        for (int n = 0; n < ND; ++n)
            store_pair(dq + at + n * 8 + (lane & 3) * 2, acc[n][2 * h] * a.scale, acc[n][2 * h + 1] * a.scale);
    }
}

template <int D, int BQ>
__host__ __device__ constexpr size_t bwd_kv_bytes() {
    return (size_t)(2 * ROWS + 2 * BQ) * ld_bf(D) * 2 + 2 * BQ * sizeof(float);
}

// Which of d k and d v a d k, d v block sums: both where their
// accumulators fit the registers together (head sizes up to 128), else one
// each, in blocks side by side (blockIdx.z).
enum KvPart { BOTH, KEYS, VALUES };

// d k and d v of 64 keys of one key/value head, summed over the query
// heads of its group and every query tile: d v = sum_i p_i d o_i,
// d k = scale sum_i ds_i q_i. out: d k (B, Hkv, S, D), then d v.
template <int D, int BQ, KvPart PART>
__device__ void bwd_kv_part(const bf16* q, const bf16* k, const bf16* v, const float* bias, const float* lse,
                            const bf16* dout, const float* di, bf16* out, AttnDims a) {
    constexpr int LD = ld_bf(D), NT = BQ / 8, ND = D / 8;
    constexpr bool KEYS_TOO = PART != VALUES, VALUES_TOO = PART != KEYS;
    extern __shared__ __align__(128) unsigned char smem[];
    bf16* ks = (bf16*)smem;
    bf16* vs = ks + ROWS * LD;
    bf16* qs = vs + ROWS * LD;
    bf16* dos = qs + BQ * LD;
    float* lse_s = (float*)(dos + BQ * LD);
    float* di_s = lse_s + BQ;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int b = blockIdx.y / a.h_kv, hk = blockIdx.y % a.h_kv, j0 = blockIdx.x * ROWS, n_rep = a.h / a.h_kv;
    const int r = j0 + warp * 16 + (lane >> 2);
    const float* bias_b = bias + (size_t)b * a.t * a.s;
    const float scale = a.scale * LOG2E;
    stage<D>(ks, k + ((size_t)b * a.h_kv + hk) * a.kv_stride, j0, ROWS, a.s);
    stage<D>(vs, v + ((size_t)b * a.h_kv + hk) * a.kv_stride, j0, ROWS, a.s);
    float dk[KEYS_TOO ? ND : 1][4], dv[VALUES_TOO ? ND : 1][4];
    for (int n = 0; n < (KEYS_TOO ? ND : 1); ++n) dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.f;
    for (int n = 0; n < (VALUES_TOO ? ND : 1); ++n) dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.f;
    for (int rep = 0; rep < n_rep; ++rep) {
        const size_t head = (size_t)b * a.h + hk * n_rep + rep;
        for (int t0 = 0; t0 < a.t; t0 += BQ) {
            float s[NT][4];
            if (!__syncthreads_or(load_bias(s, bias_b, a, r, t0, lane, true))) continue;
            stage<D>(qs, q + head * a.t * D, t0, BQ, a.t);
            stage<D>(dos, dout + head * a.t * D, t0, BQ, a.t);
            for (int i = threadIdx.x; i < BQ; i += blockDim.x) {
                lse_s[i] = t0 + i < a.t ? lse[head * a.t + t0 + i] * LOG2E : 0.f;
                di_s[i] = t0 + i < a.t ? di[head * a.t + t0 + i] : 0.f;
            }
            __syncthreads();
            // Scores transposed: this warp's 16 keys down, the tile's queries across.
            float x[NT][4];
            product_t<D, NT>(x, ks + warp * 16 * LD, qs, lane);
            for (int n = 0; n < NT; ++n)
                for (int i = 0; i < 4; ++i) {
                    const int c = n * 8 + (lane & 3) * 2 + (i & 1);
                    x[n][i] = s[n][i] == -INFINITY ? 0.f : exp2f(x[n][i] * scale + s[n][i] - lse_s[c]);
                }
            if constexpr (VALUES_TOO) {
                float p[NT][4];
                for (int n = 0; n < NT; ++n)
                    for (int i = 0; i < 4; ++i) p[n][i] = round_bf16(x[n][i]);
                accumulate<D, NT>(dv, p, dos, lane);
            }
            if constexpr (KEYS_TOO) {
                float dp[NT][4];
                product_t<D, NT>(dp, vs + warp * 16 * LD, dos, lane);
                for (int n = 0; n < NT; ++n)
                    for (int i = 0; i < 4; ++i) {
                        const int c = n * 8 + (lane & 3) * 2 + (i & 1);
                        dp[n][i] = round_bf16(x[n][i] * (dp[n][i] - di_s[c]));
                    }
                accumulate<D, NT>(dk, dp, qs, lane);
            }
        }
    }
    for (int h = 0; h < 2; ++h) {
        const int key = r + 8 * h;
        if (key >= a.s) continue;
        const size_t at = (((size_t)b * a.h_kv + hk) * a.s + key) * D + (lane & 3) * 2;
        const size_t dv_at = (size_t)gridDim.y * a.s * D;
        for (int n = 0; n < ND; ++n) {
            if constexpr (KEYS_TOO) store_pair(out + at + n * 8, dk[n][2 * h] * a.scale, dk[n][2 * h + 1] * a.scale);
            if constexpr (VALUES_TOO) store_pair(out + dv_at + at + n * 8, dv[n][2 * h], dv[n][2 * h + 1]);
        }
    }
}

// Launched with gridDim.z 1 (BOTH) or 2 (blockIdx.z 0 d k, 1 d v).
template <int D, int BQ, bool SPLIT>
__device__ void bwd_kv(const bf16* q, const bf16* k, const bf16* v, const float* bias, const float* lse,
                       const bf16* dout, const float* di, bf16* out, AttnDims a) {
    expect_launch(bwd_kv_bytes<D, BQ>(), 32 * WARPS);
    if (!SPLIT)
        bwd_kv_part<D, BQ, BOTH>(q, k, v, bias, lse, dout, di, out, a);
    else if (blockIdx.z == 0)
        bwd_kv_part<D, BQ, KEYS>(q, k, v, bias, lse, dout, di, out, a);
    else
        bwd_kv_part<D, BQ, VALUES>(q, k, v, bias, lse, dout, di, out, a);
}

}  // namespace fa
