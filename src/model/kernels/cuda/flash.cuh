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
// Inputs and outputs are the bias-attention kernels' in kernels.cu, but
// the output and its gradient may also lie by token (AttnDims::o_row). The
// warp-level primitives (ldmatrix, mma, shuffles) are defined here for the
// GPU; emulate.cpp beside this file defines them on the host, one thread
// per lane, and runs these kernels against a reference
// (scripts/cuda/emulate.sh).

#pragma once

struct AttnDims {
    int h, h_kv, t, s, d;
    long long kv_stride;
    float scale;
    // Elements between the output's consecutive queries and heads, its
    // gradient's too (the flash kernels; the others take the first): D and
    // T D in (B, H, T, D) rows, or H D and D in (B, T, H, D), the output
    // projection's input as it lies. A sequence's rows are H T D long in both.
    long long o_row, o_head;
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

// 16 (or 4) bytes from global into shared memory in the background
// (cp.async), zeros where not `valid`; a thread's copies since its last
// commit are one group.
__device__ __forceinline__ void copy16_async(void* dst, const void* src, bool valid) {
    const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(at), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void copy4_async(void* dst, const void* src, bool valid) {
    const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(at), "l"(src), "r"(valid ? 4 : 0) : "memory");
}

__device__ __forceinline__ void commit_async() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits for this thread's groups but the newest, or for all.
__device__ __forceinline__ void wait_async_but_newest() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
__device__ __forceinline__ void wait_async_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }

__device__ __forceinline__ bool warp_any(bool x) { return __any_sync(0xffffffff, x); }

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

// Whether rows `ld` elements apart from `src` all start on 16 bytes.
__device__ __forceinline__ bool rows_aligned(const bf16* src, long long ld) {
    return (reinterpret_cast<size_t>(src) & 15) == 0 && ld % 8 == 0;
}

// Rows [r0, r0 + n) of a matrix of `rows` rows of D features, `ld` elements
// apart, into shared memory, zeros past `rows`: 16 bytes (8 features) per
// load where the rows are 16-byte aligned, else feature by feature.
template <int D>
__device__ __forceinline__ void stage(bf16* dst, const bf16* src, int r0, int n, int rows, long long ld = D) {
    if (rows_aligned(src, ld)) {
        constexpr int PER_ROW = D / 8;
        for (int i = threadIdx.x; i < n * PER_ROW; i += blockDim.x) {
            const int r = i / PER_ROW, c = i % PER_ROW * 8;
            uint4 x = make_uint4(0, 0, 0, 0);
            if (r0 + r < rows) x = *reinterpret_cast<const uint4*>(src + (r0 + r) * ld + c);
            *reinterpret_cast<uint4*>(dst + r * ld_bf(D) + c) = x;
        }
        return;
    }
    for (int i = threadIdx.x; i < n * D; i += blockDim.x) {
        const int r = i / D, c = i % D;
        dst[r * ld_bf(D) + c] = r0 + r < rows ? src[(r0 + r) * ld + c] : __float2bfloat16(0.f);
    }
}

// Where query t of sequence-and-head bh (sequence bh / H, head bh % H)
// lies in the output and its gradient.
__device__ __forceinline__ size_t out_at(const AttnDims& a, size_t bh, int t) {
    return bh / a.h * ((size_t)a.h * a.t * a.d) + bh % a.h * a.o_head + (size_t)t * a.o_row;
}

constexpr int WARPS = 4, ROWS = 16 * WARPS;

// The tiles by head size: the key tile of the forward and d q kernels, the
// query tile of the d k, d v kernel, and whether d k and d v take blocks of
// their own (together their accumulators overflow the registers at 256).
// cuda/attention.rs's flash_tiles repeats them for the launches.
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
// the sequence and head, bh) reads: its queries' first row of (B, H, T)
// rows, its sequence and key/value head; and this lane's first query (its
// second is r + 8).
struct QueryBlock {
    size_t bh, row0, seq;
    int t0, r;
    const bf16 *k, *v;

    __device__ __forceinline__ QueryBlock(const bf16* keys, const bf16* values, const AttnDims& a) {
        bh = blockIdx.y;
        const int hk = bh % a.h / (a.h / a.h_kv);
        seq = bh / a.h, row0 = bh * a.t, t0 = blockIdx.x * ROWS;
        r = t0 + (threadIdx.x >> 5) * 16 + (threadIdx.x & 31) / 4;
        k = keys + (seq * a.h_kv + hk) * a.kv_stride;
        v = values + (seq * a.h_kv + hk) * a.kv_stride;
    }
};

// One tile of the forward for a warp's 16 queries `qw` against BK = 8 NT
// keys and values in shared memory: s holds the tile's bias in fragment
// order (-inf masked) and leaves with the probabilities; the running max
// m, sum l (this lane's part) and output acc are rescaled and summed into.
template <int D, int NT>
__device__ __forceinline__ void fwd_tile(float (&acc)[D / 8][4], float (&m)[2], float (&l)[2], float (&s)[NT][4],
                                         const bf16* qw, const bf16* ks, const bf16* vs, float scale, int lane) {
    float x[NT][4];
    product_t<D, NT>(x, qw, ks, lane);
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
    for (int n = 0; n < D / 8; ++n)
        for (int i = 0; i < 4; ++i) acc[n][i] *= keep[i >> 1];
    accumulate<D, NT>(acc, s, vs, lane);
}

// The forward's output rows and log-sum-exp from a warp's sums.
template <int D>
__device__ __forceinline__ void fwd_store(const float (&acc)[D / 8][4], const float (&m)[2], float (&l)[2],
                                          const QueryBlock& blk, bf16* o, float* lse, const AttnDims& a, int lane) {
    for (int h = 0; h < 2; ++h) {
        l[h] += shfl_xor(l[h], 1);
        l[h] += shfl_xor(l[h], 2);
        const int row = blk.r + 8 * h;
        if (row >= a.t) continue;
        bf16* o_row = o + out_at(a, blk.bh, row);
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        for (int n = 0; n < D / 8; ++n)
            store_pair(o_row + n * 8 + (lane & 3) * 2, acc[n][2 * h] * inv, acc[n][2 * h + 1] * inv);
        if ((lane & 3) == 0) lse[blk.row0 + row] = l[h] > 0.f ? (m[h] + log2f(l[h])) / LOG2E : 0.f;
    }
}

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
    const QueryBlock blk(k, v, a);
    const float* bias_b = bias + blk.seq * a.t * a.s;
    stage<D>(qs, q + blk.row0 * D, blk.t0, ROWS, a.t);
    float acc[ND][4];
    for (int n = 0; n < ND; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    // Per row (r, r + 8): the running max (log2 units) and this lane's part of the sum.
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    for (int s0 = 0; s0 < a.s; s0 += BK) {
        float s[NT][4];
        if (!__syncthreads_or(load_bias(s, bias_b, a, blk.r, s0, lane, false))) continue;
        stage<D>(ks, blk.k, s0, BK, a.s);
        stage<D>(vs, blk.v, s0, BK, a.s);
        __syncthreads();
        fwd_tile<D, NT>(acc, m, l, s, qs + warp * 16 * LD, ks, vs, a.scale * LOG2E, lane);
    }
    fwd_store<D>(acc, m, l, blk, o, lse, a, lane);
}

template <int D, int BK>
__host__ __device__ constexpr size_t bwd_q_bytes() {
    return (size_t)(2 * ROWS + 2 * BK) * ld_bf(D) * 2;
}

// This lane's rows' log-sum-exp (log2 units) and di, 0 past the queries.
__device__ __forceinline__ void row_stats(float (&row_lse)[2], float (&row_di)[2], const float* lse, const float* di,
                                          const QueryBlock& blk, const AttnDims& a) {
    for (int h = 0; h < 2; ++h) {
        const bool in = blk.r + 8 * h < a.t;
        row_lse[h] = in ? lse[blk.row0 + blk.r + 8 * h] * LOG2E : 0.f;
        row_di[h] = in ? di[blk.row0 + blk.r + 8 * h] : 0.f;
    }
}

// One tile of d q for a warp's 16 queries `qw` (their output gradients
// `dow`) against BK = 8 NT keys and values: s holds the tile's bias in
// fragment order (-inf masked).
template <int D, int NT>
__device__ __forceinline__ void bwd_q_tile(float (&acc)[D / 8][4], float (&s)[NT][4], const bf16* qw, const bf16* dow,
                                           const bf16* ks, const bf16* vs, const float (&row_lse)[2],
                                           const float (&row_di)[2], float scale, int lane) {
    float x[NT][4], dp[NT][4];
    product_t<D, NT>(x, qw, ks, lane);
    product_t<D, NT>(dp, dow, vs, lane);
    for (int n = 0; n < NT; ++n)
        for (int i = 0; i < 4; ++i) {
            const int h = i >> 1;
            const float p = s[n][i] == -INFINITY ? 0.f : exp2f(x[n][i] * scale + s[n][i] - row_lse[h]);
            s[n][i] = round_bf16(p * (dp[n][i] - row_di[h]));
        }
    accumulate<D, NT>(acc, s, ks, lane);
}

template <int D>
__device__ __forceinline__ void bwd_q_store(const float (&acc)[D / 8][4], const QueryBlock& blk, bf16* dq,
                                            const AttnDims& a, int lane) {
    for (int h = 0; h < 2; ++h) {
        const int row = blk.r + 8 * h;
        if (row >= a.t) continue;
        const size_t at = (blk.row0 + row) * D;
        for (int n = 0; n < D / 8; ++n)
            store_pair(dq + at + n * 8 + (lane & 3) * 2, acc[n][2 * h] * a.scale, acc[n][2 * h + 1] * a.scale);
    }
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
    const QueryBlock blk(k, v, a);
    const float* bias_b = bias + blk.seq * a.t * a.s;
    stage<D>(qs, q + blk.row0 * D, blk.t0, ROWS, a.t);
    stage<D>(dos, dout + out_at(a, blk.bh, 0), blk.t0, ROWS, a.t, a.o_row);
    float row_lse[2], row_di[2];
    row_stats(row_lse, row_di, lse, di, blk, a);
    float acc[ND][4];
    for (int n = 0; n < ND; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    for (int s0 = 0; s0 < a.s; s0 += BK) {
        float s[NT][4];
        if (!__syncthreads_or(load_bias(s, bias_b, a, blk.r, s0, lane, false))) continue;
        stage<D>(ks, blk.k, s0, BK, a.s);
        stage<D>(vs, blk.v, s0, BK, a.s);
        __syncthreads();
        bwd_q_tile<D, NT>(acc, s, qs + warp * 16 * LD, dos + warp * 16 * LD, ks, vs, row_lse, row_di,
                          a.scale * LOG2E, lane);
    }
    bwd_q_store<D>(acc, blk, dq, a, lane);
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
// One tile of d k, d v for a warp's 16 keys `kw` (values `vw`) against
// BQ = 8 NT queries `qs` (output gradients `dos`) and their log-sum-exp
// (times lse_scale, log2 units) and di: s holds the tile's bias
// transposed, keys down and queries across (-inf masked).
template <int D, int NT, KvPart PART>
__device__ __forceinline__ void bwd_kv_tile(float (&dk)[PART != VALUES ? D / 8 : 1][4],
                                            float (&dv)[PART != KEYS ? D / 8 : 1][4], const float (&s)[NT][4],
                                            const bf16* kw, const bf16* vw, const bf16* qs, const bf16* dos,
                                            const float* lse_s, const float* di_s, float lse_scale, float scale,
                                            int lane) {
    // Scores transposed: this warp's 16 keys down, the tile's queries across.
    float x[NT][4];
    product_t<D, NT>(x, kw, qs, lane);
    for (int n = 0; n < NT; ++n)
        for (int i = 0; i < 4; ++i) {
            const int c = n * 8 + (lane & 3) * 2 + (i & 1);
            x[n][i] = s[n][i] == -INFINITY ? 0.f : exp2f(x[n][i] * scale + s[n][i] - lse_s[c] * lse_scale);
        }
    if constexpr (PART != KEYS) {
        float p[NT][4];
        for (int n = 0; n < NT; ++n)
            for (int i = 0; i < 4; ++i) p[n][i] = round_bf16(x[n][i]);
        accumulate<D, NT>(dv, p, dos, lane);
    }
    if constexpr (PART != VALUES) {
        float dp[NT][4];
        product_t<D, NT>(dp, vw, dos, lane);
        for (int n = 0; n < NT; ++n)
            for (int i = 0; i < 4; ++i) {
                const int c = n * 8 + (lane & 3) * 2 + (i & 1);
                dp[n][i] = round_bf16(x[n][i] * (dp[n][i] - di_s[c]));
            }
        accumulate<D, NT>(dk, dp, qs, lane);
    }
}

// d k (B, Hkv, S, D) then d v into `out` from a warp's sums, this lane's
// keys r and r + 8 of sequence b, key/value head hk.
template <int D, KvPart PART>
__device__ __forceinline__ void bwd_kv_store(const float (&dk)[PART != VALUES ? D / 8 : 1][4],
                                             const float (&dv)[PART != KEYS ? D / 8 : 1][4], bf16* out, int b, int hk,
                                             int r, const AttnDims& a, int lane) {
    for (int h = 0; h < 2; ++h) {
        const int key = r + 8 * h;
        if (key >= a.s) continue;
        const size_t at = (((size_t)b * a.h_kv + hk) * a.s + key) * D + (lane & 3) * 2;
        const size_t dv_at = (size_t)gridDim.y * a.s * D;
        for (int n = 0; n < D / 8; ++n) {
            if constexpr (PART != VALUES)
                store_pair(out + at + n * 8, dk[n][2 * h] * a.scale, dk[n][2 * h + 1] * a.scale);
            if constexpr (PART != KEYS) store_pair(out + dv_at + at + n * 8, dv[n][2 * h], dv[n][2 * h + 1]);
        }
    }
}

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
            stage<D>(dos, dout + out_at(a, head, 0), t0, BQ, a.t, a.o_row);
            for (int i = threadIdx.x; i < BQ; i += blockDim.x) {
                lse_s[i] = t0 + i < a.t ? lse[head * a.t + t0 + i] * LOG2E : 0.f;
                di_s[i] = t0 + i < a.t ? di[head * a.t + t0 + i] : 0.f;
            }
            __syncthreads();
            bwd_kv_tile<D, NT, PART>(dk, dv, s, ks + warp * 16 * LD, vs + warp * 16 * LD, qs, dos, lse_s, di_s, 1.f,
                                     scale, lane);
        }
    }
    bwd_kv_store<D, PART>(dk, dv, out, b, hk, r, a, lane);
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

// ---- The same kernels over spans, pipelined.
//
// Where every query sees at most two runs of keys (batch.rs's
// attention_spans: its prompt and its own part, or one causal run), these
// kernels read the runs, 16 bytes a query, in place of the bias's floats,
// which every block read for every tile it considered (twice the bytes of
// the tile's keys and values at head size 64, and again for the tiles it
// then skipped). A block visits only the tiles its queries' runs cover (d k,
// d v: the query tiles between the first and the last query that sees one
// of its keys), a warp skips the products of a tile none of its rows sees,
// and the next tile's operands are copied into shared memory (cp.async)
// while the current one's are multiplied.

// A query's keys [a0, a1) and [b0, b1) (empty: a0 == a1); u32 on the host.
struct alignas(16) Span {
    int a0, a1, b0, b1;
};

// The queries [first, end) between which lie all that see a key of a block
// of ROWS keys (batch.rs's key_blocks; [0, 0): none).
struct alignas(8) QueryRange {
    int first, end;
};

__device__ __forceinline__ bool sees(const Span& s, int key) {
    return (s.a0 <= key && key < s.a1) || (s.b0 <= key && key < s.b1);
}

// The bias of this lane's entries of the tile of keys from c0, as load_bias
// gives it, from its rows' spans (r, r + 8); whether the warp's rows see
// any key of it.
template <int NT>
__device__ __forceinline__ bool span_mask(float (&bv)[NT][4], const Span (&rows)[2], int c0, int lane) {
    bool live = false;
    for (int n = 0; n < NT; ++n)
        for (int i = 0; i < 4; ++i) {
            const bool in = sees(rows[i >> 1], c0 + n * 8 + (lane & 3) * 2 + (i & 1));
            bv[n][i] = in ? 0.f : -INFINITY;
            live |= in;
        }
    return warp_any(live);
}

// The same transposed: this lane's keys r and r + 8 down, the tile's
// queries across, their spans staged in `qspans`.
template <int NT>
__device__ __forceinline__ bool span_mask_keys(float (&bv)[NT][4], const Span* qspans, int r, int lane) {
    bool live = false;
    for (int n = 0; n < NT; ++n)
        for (int e = 0; e < 2; ++e) {
            const Span sp = qspans[n * 8 + (lane & 3) * 2 + e];
            for (int h = 0; h < 2; ++h) {
                const bool in = sees(sp, r + 8 * h);
                bv[n][2 * h + e] = in ? 0.f : -INFINITY;
                live |= in;
            }
        }
    return warp_any(live);
}

// The key tiles of BK that a block's queries visit, in order: the tiles of
// the hull of their first runs, then those of the hull of their second
// runs that the first did not cover (one range where they meet).
struct TileWalk {
    int first1, n1, first2, n;

    __device__ __forceinline__ int tile(int it) const { return it < n1 ? first1 + it : first2 + it - n1; }
};

template <int BK>
__device__ __forceinline__ TileWalk walk_tiles(const Span* spans) {
    int lo[2] = {0x7fffffff, 0x7fffffff}, hi[2] = {0, 0};
    for (int i = 0; i < ROWS; ++i) {
        const Span s = spans[i];
        if (s.a0 < s.a1) lo[0] = s.a0 < lo[0] ? s.a0 : lo[0], hi[0] = s.a1 > hi[0] ? s.a1 : hi[0];
        if (s.b0 < s.b1) lo[1] = s.b0 < lo[1] ? s.b0 : lo[1], hi[1] = s.b1 > hi[1] ? s.b1 : hi[1];
    }
    // Tile ranges [x, y), empty as [0, 0), the first starting first.
    int x[2], y[2];
    for (int p = 0; p < 2; ++p) {
        const bool any = lo[p] < hi[p];
        x[p] = any ? lo[p] / BK : 0, y[p] = any ? (hi[p] - 1) / BK + 1 : 0;
    }
    if (x[0] == y[0] || (x[1] < y[1] && x[1] < x[0])) {
        const int x0 = x[0], y0 = y[0];
        x[0] = x[1], y[0] = y[1], x[1] = x0, y[1] = y0;
    }
    if (x[1] < y[1] && x[1] <= y[0]) y[0] = y[1] > y[0] ? y[1] : y[0], x[1] = y[1] = 0;
    return TileWalk{x[0], y[0] - x[0], x[1], y[0] - x[0] + y[1] - x[1]};
}

// Rows [r0, r0 + n) of a (rows, D) matrix into shared memory as `stage`
// lays them, zeros past `rows`: copied in the background where the matrix
// is 16-byte aligned, else at once.
template <int D>
__device__ __forceinline__ void stage_async(bf16* dst, const bf16* src, int r0, int n, int rows, long long ld = D) {
    if (!rows_aligned(src, ld)) return stage<D>(dst, src, r0, n, rows, ld);
    constexpr int PER_ROW = D / 8;
    for (int i = threadIdx.x; i < n * PER_ROW; i += blockDim.x) {
        const int r = i / PER_ROW, c = i % PER_ROW * 8;
        const bool in = r0 + r < rows;
        copy16_async(dst + r * ld_bf(D) + c, src + (in ? r0 + r : 0) * ld + c, in);
    }
}

// A block of 64 queries' spans into shared memory, and this lane's rows'.
__device__ __forceinline__ void stage_spans(Span* ss, Span (&mine)[2], const Span* spans, const QueryBlock& blk,
                                            const AttnDims& a) {
    for (int i = threadIdx.x; i < ROWS; i += blockDim.x)
        ss[i] = blk.t0 + i < a.t ? spans[blk.seq * a.t + blk.t0 + i] : Span{0, 0, 0, 0};
    __syncthreads();
    mine[0] = ss[blk.r - blk.t0], mine[1] = ss[blk.r + 8 - blk.t0];
}

// Both the forward and d q: 64 query rows (and d q's output gradients),
// keys and values of BK in two buffers, the block's spans.
template <int D, int BK>
__host__ __device__ constexpr size_t spans_q_bytes(int row_sets) {
    return (size_t)(row_sets * ROWS + 4 * BK) * ld_bf(D) * 2 + ROWS * sizeof(Span);
}

// The key tiles a block of queries visits, each one's keys and values
// copied into buffer it % 2 of `kv` (BK keys, then BK values) while the
// one before is multiplied: `body(s, keys, values)` for each tile this
// warp's rows see, s its bias in fragment order. The block's spans are
// staged in `ss`; copies the caller began (its queries) land with the
// first tile's.
template <int D, int BK, typename Body>
__device__ __forceinline__ void over_key_tiles(bf16* kv, Span* ss, const Span* spans, const QueryBlock& blk,
                                               const AttnDims& a, int lane, Body body) {
    constexpr int LD = ld_bf(D), NT = BK / 8;
    Span mine[2];
    stage_spans(ss, mine, spans, blk, a);
    const TileWalk walk = walk_tiles<BK>(ss);
    auto fetch = [&](int it) {
        bf16* ks = kv + (it & 1) * 2 * BK * LD;
        stage_async<D>(ks, blk.k, walk.tile(it) * BK, BK, a.s);
        stage_async<D>(ks + BK * LD, blk.v, walk.tile(it) * BK, BK, a.s);
    };
    if (walk.n > 0) fetch(0);
    commit_async();
    for (int it = 0; it < walk.n; ++it) {
        if (it + 1 < walk.n) fetch(it + 1);
        commit_async();
        wait_async_but_newest();
        __syncthreads();
        const bf16* ks = kv + (it & 1) * 2 * BK * LD;
        float s[NT][4];
        if (span_mask(s, mine, walk.tile(it) * BK, lane)) body(s, ks, ks + BK * LD);
        // The next fetch overwrites this buffer.
        __syncthreads();
    }
    wait_async_all();
}

template <int D, int BK>
__host__ __device__ constexpr size_t fwd_spans_bytes() {
    return spans_q_bytes<D, BK>(1);
}

template <int D, int BK>
__device__ void fwd_spans(const bf16* q, const bf16* k, const bf16* v, const Span* spans, bf16* o, float* lse,
                          AttnDims a) {
    constexpr int LD = ld_bf(D), NT = BK / 8, ND = D / 8;
    expect_launch(fwd_spans_bytes<D, BK>(), 32 * WARPS);
    extern __shared__ __align__(128) unsigned char smem[];
    bf16* qs = (bf16*)smem;
    bf16* kv = qs + ROWS * LD;
    Span* ss = (Span*)(kv + 4 * BK * LD);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const QueryBlock blk(k, v, a);
    stage_async<D>(qs, q + blk.row0 * D, blk.t0, ROWS, a.t);
    float acc[ND][4];
    for (int n = 0; n < ND; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    over_key_tiles<D, BK>(kv, ss, spans, blk, a, lane, [&](float(&s)[NT][4], const bf16* ks, const bf16* vs) {
        fwd_tile<D, NT>(acc, m, l, s, qs + warp * 16 * LD, ks, vs, a.scale * LOG2E, lane);
    });
    fwd_store<D>(acc, m, l, blk, o, lse, a, lane);
}

template <int D, int BK>
__host__ __device__ constexpr size_t bwd_q_spans_bytes() {
    return spans_q_bytes<D, BK>(2);
}

template <int D, int BK>
__device__ void bwd_q_spans(const bf16* q, const bf16* k, const bf16* v, const Span* spans, const float* lse,
                            const bf16* dout, const float* di, bf16* dq, AttnDims a) {
    constexpr int LD = ld_bf(D), NT = BK / 8, ND = D / 8;
    expect_launch(bwd_q_spans_bytes<D, BK>(), 32 * WARPS);
    extern __shared__ __align__(128) unsigned char smem[];
    bf16* qs = (bf16*)smem;
    bf16* dos = qs + ROWS * LD;
    bf16* kv = dos + ROWS * LD;
    Span* ss = (Span*)(kv + 4 * BK * LD);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const QueryBlock blk(k, v, a);
    stage_async<D>(qs, q + blk.row0 * D, blk.t0, ROWS, a.t);
    stage_async<D>(dos, dout + out_at(a, blk.bh, 0), blk.t0, ROWS, a.t, a.o_row);
    float row_lse[2], row_di[2];
    row_stats(row_lse, row_di, lse, di, blk, a);
    float acc[ND][4];
    for (int n = 0; n < ND; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    over_key_tiles<D, BK>(kv, ss, spans, blk, a, lane, [&](float(&s)[NT][4], const bf16* ks, const bf16* vs) {
        bwd_q_tile<D, NT>(acc, s, qs + warp * 16 * LD, dos + warp * 16 * LD, ks, vs, row_lse, row_di,
                          a.scale * LOG2E, lane);
    });
    bwd_q_store<D>(acc, blk, dq, a, lane);
}

// The block's keys and values, then two buffers of a query tile's rows,
// output gradients, log-sum-exp, di and spans.
template <int D, int BQ>
__host__ __device__ constexpr size_t bwd_kv_spans_bytes() {
    return (size_t)(2 * ROWS + 4 * BQ) * ld_bf(D) * 2 + 2 * BQ * (2 * sizeof(float) + sizeof(Span));
}

template <int D, int BQ, KvPart PART>
__device__ void bwd_kv_spans_part(const bf16* q, const bf16* k, const bf16* v, const Span* spans,
                                  const QueryRange* ranges, const float* lse, const bf16* dout, const float* di,
                                  bf16* out, AttnDims a) {
    constexpr int LD = ld_bf(D), NT = BQ / 8, ND = D / 8;
    extern __shared__ __align__(128) unsigned char smem[];
    bf16* ks = (bf16*)smem;
    bf16* vs = ks + ROWS * LD;
    bf16* rows = vs + ROWS * LD;  // buffer i: BQ queries, then BQ output gradients, at rows + 2 BQ LD i
    float* sides = (float*)(rows + 4 * BQ * LD);  // buffer i: BQ lse, BQ di, BQ spans at sides + 6 BQ i
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int b = blockIdx.y / a.h_kv, hk = blockIdx.y % a.h_kv, j0 = blockIdx.x * ROWS, n_rep = a.h / a.h_kv;
    const int r = j0 + warp * 16 + (lane >> 2);
    const QueryRange range = ranges[(size_t)b * gridDim.x + blockIdx.x];
    const int first = range.first / BQ, tiles = range.first < range.end ? (range.end - 1) / BQ + 1 - first : 0;
    auto fetch = [&](int it) {
        const int t0 = (first + it % tiles) * BQ;
        const size_t head = (size_t)b * a.h + hk * n_rep + it / tiles;
        bf16* qs = rows + (it & 1) * 2 * BQ * LD;
        float* side = sides + (it & 1) * 6 * BQ;
        stage_async<D>(qs, q + head * a.t * D, t0, BQ, a.t);
        stage_async<D>(qs + BQ * LD, dout + out_at(a, head, 0), t0, BQ, a.t, a.o_row);
        for (int i = threadIdx.x; i < BQ; i += blockDim.x) {
            const bool in = t0 + i < a.t;
            const int query = in ? t0 + i : 0;
            copy4_async(side + i, lse + head * a.t + query, in);
            copy4_async(side + BQ + i, di + head * a.t + query, in);
            copy16_async((Span*)(side + 2 * BQ) + i, spans + (size_t)b * a.t + query, in);
        }
    };
    stage_async<D>(ks, k + ((size_t)b * a.h_kv + hk) * a.kv_stride, j0, ROWS, a.s);
    stage_async<D>(vs, v + ((size_t)b * a.h_kv + hk) * a.kv_stride, j0, ROWS, a.s);
    const int n = n_rep * tiles;
    if (n > 0) fetch(0);
    commit_async();
    float dk[PART != VALUES ? ND : 1][4], dv[PART != KEYS ? ND : 1][4];
    for (int e = 0; e < (PART != VALUES ? ND : 1); ++e) dk[e][0] = dk[e][1] = dk[e][2] = dk[e][3] = 0.f;
    for (int e = 0; e < (PART != KEYS ? ND : 1); ++e) dv[e][0] = dv[e][1] = dv[e][2] = dv[e][3] = 0.f;
    for (int it = 0; it < n; ++it) {
        if (it + 1 < n) fetch(it + 1);
        commit_async();
        wait_async_but_newest();
        __syncthreads();
        const bf16* qs = rows + (it & 1) * 2 * BQ * LD;
        const float* side = sides + (it & 1) * 6 * BQ;
        float s[NT][4];
        if (span_mask_keys<NT>(s, (const Span*)(side + 2 * BQ), r, lane))
            bwd_kv_tile<D, NT, PART>(dk, dv, s, ks + warp * 16 * LD, vs + warp * 16 * LD, qs, qs + BQ * LD, side,
                                     side + BQ, LOG2E, a.scale * LOG2E, lane);
        __syncthreads();
    }
    wait_async_all();
    bwd_kv_store<D, PART>(dk, dv, out, b, hk, r, a, lane);
}

// Launched with gridDim.z 1 (BOTH) or 2 (blockIdx.z 0 d k, 1 d v), and
// gridDim.x the key blocks of a sequence.
template <int D, int BQ, bool SPLIT>
__device__ void bwd_kv_spans(const bf16* q, const bf16* k, const bf16* v, const Span* spans, const QueryRange* ranges,
                             const float* lse, const bf16* dout, const float* di, bf16* out, AttnDims a) {
    expect_launch(bwd_kv_spans_bytes<D, BQ>(), 32 * WARPS);
    if (!SPLIT)
        bwd_kv_spans_part<D, BQ, BOTH>(q, k, v, spans, ranges, lse, dout, di, out, a);
    else if (blockIdx.z == 0)
        bwd_kv_spans_part<D, BQ, KEYS>(q, k, v, spans, ranges, lse, dout, di, out, a);
    else
        bwd_kv_spans_part<D, BQ, VALUES>(q, k, v, spans, ranges, lse, dout, di, out, a);
}

}  // namespace fa
