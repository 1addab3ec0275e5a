// CUDA counterparts of the fused CPU kernels (see the op files beside this
// directory). Rows are reduced by one block (a norm's by one warp) each, in
// a fixed order, so the results do not depend on scheduling. Arithmetic is f32 whatever the
// storage dtype (f32 or bf16).

#include <cuda_bf16.h>
#include <limits.h>
#include <mma.h>
#include <stdint.h>

using namespace nvcuda;

typedef __nv_bfloat16 bf16;

#include "flash.cuh"

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) { return __float2bfloat16(x); }

#include "reduce.cuh"

// ---- RMSNorm and LayerNorm, a warp a row (norms.cuh).

#include "norms.cuh"

#define NORMS(T, S)                                                                                        \
    extern "C" __global__ void rms_norm_fwd_##S(const T* x, const T* w, T* y, int rows, int h, float eps) { \
        rms_norm_fwd<T>(x, w, y, rows, h, eps);                                                            \
    }                                                                                                      \
    extern "C" __global__ void rms_norm_bwd_##S(const T* x, const T* w, const T* g, T* dx, float* dw,       \
                                                int rows, int h, float eps) {                              \
        rms_norm_bwd<T>(x, w, g, dx, dw, rows, h, eps);                                                    \
    }                                                                                                      \
    extern "C" __global__ void layer_norm_fwd_##S(const T* x, const T* w, const T* b, T* y, int rows,      \
                                                  int h, float eps) {                                      \
        layer_norm_fwd<T>(x, w, b, y, rows, h, eps);                                                       \
    }                                                                                                      \
    extern "C" __global__ void layer_norm_bwd_##S(const T* x, const T* w, const T* g, T* dx, float* dw,     \
                                                  int rows, int h, float eps) {                            \
        layer_norm_bwd<T>(x, w, g, dx, dw, rows, h, eps);                                                  \
    }

NORMS(float, f32)
NORMS(bf16, bf16)

// The forwards with a row's chunks of 8 held, at most C a lane (features up to 256 C), and two
// LayerNorms of the same rows.
#define NORMS_WIDE(T, S, C)                                                                                     \
    extern "C" __global__ void rms_norm_fwd_wide##C##_##S(const T* x, const T* w, T* y, int rows, int h,        \
                                                          float eps) {                                          \
        rms_norm_fwd_wide<T, C>(x, w, y, rows, h, eps);                                                         \
    }                                                                                                           \
    extern "C" __global__ void layer_norm_fwd_wide##C##_##S(const T* x, const T* w, const T* b, T* y, int rows, \
                                                            int h, float eps) {                                 \
        layer_norm_fwd_wide<T, C>(x, w, b, y, rows, h, eps);                                                    \
    }                                                                                                           \
    extern "C" __global__ void layer_norm_pair_fwd_wide##C##_##S(const T* x, const T* w1, const T* b1,          \
                                                                 const T* w2, const T* b2, T* y, int rows,      \
                                                                 int h, float eps1, float eps2) {               \
        layer_norm_pair_fwd_wide<T, C>(x, w1, b1, w2, b2, y, rows, h, eps1, eps2);                              \
    }
#define NORMS_WIDE_ALL(T, S) NORMS_WIDE(T, S, 1) NORMS_WIDE(T, S, 2) NORMS_WIDE(T, S, 4) NORMS_WIDE(T, S, 8) NORMS_WIDE(T, S, 16)
NORMS_WIDE_ALL(float, f32)
NORMS_WIDE_ALL(bf16, bf16)

// ---- The log-prob of each row's target and the entropy from logits (N, V),
// and d logits in place of the logits (logprobs.cuh).

#include "logprobs.cuh"

#define LOGPROBS(T, S)                                                                                      \
    extern "C" __global__ void token_logprobs_fwd_##S(const T* logits, const uint32_t* targets, float* out, \
                                                      int v, float inv_t) {                                \
        token_logprobs_fwd<T>(logits, targets, out, v, inv_t);                                              \
    }                                                                                                       \
    extern "C" __global__ void token_logprobs_bwd_##S(T* logits, const uint32_t* targets, const float* grad, \
                                                      int v, float inv_t) {                                \
        token_logprobs_bwd<T>(logits, targets, grad, v, inv_t);                                             \
    }

LOGPROBS(float, f32)
LOGPROBS(bf16, bf16)

// ---- AdamW, in place: the moments, then the weight.

extern "C" __global__ void adamw_moment(float* x, const float* g, size_t n, float beta, int squared) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float gv = squared ? g[i] * g[i] : g[i];
        x[i] = beta * x[i] + (1.f - beta) * gv;
    }
}

extern "C" __global__ void adamw_update(float* w, const float* m, const float* v, size_t n, float step,
                                        float inv_sqrt_bias2, float eps, float decay) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        w[i] = decay * w[i] - step * m[i] / (sqrtf(v[i]) * inv_sqrt_bias2 + eps);
}

// AdamW over many parameters in one launch, their masters f32 or split
// (adamw.cuh); the arithmetic is adamw_moment's and adamw_update's.

#include "adamw.cuh"

extern "C" __global__ void adamw_multi(const AdamWTensor* table, float beta1, float beta2, float step,
                                       float inv_sqrt_bias2, float eps) {
    adamw_multi_body<false>(table, beta1, beta2, step, inv_sqrt_bias2, eps);
}

extern "C" __global__ void adamw_multi_split(const AdamWTensor* table, float beta1, float beta2, float step,
                                             float inv_sqrt_bias2, float eps) {
    adamw_multi_body<true>(table, beta1, beta2, step, inv_sqrt_bias2, eps);
}

// ---- Sums of squares of many f32 tensors in one launch, for the gradient
// norm: blockIdx.y picks the tensor; each of the gridDim.x blocks of 256
// threads sums its stride of it in f64, in a fixed order (squares.cuh), into
// out[tensor * gridDim.x + block], which the host adds up in order.

#include "squares.cuh"

struct SquaresTensor {
    const float* x;
    unsigned long long n;
};

extern "C" __global__ void sum_squares_multi(const SquaresTensor* table, double* out) {
    __shared__ double part[256];
    const SquaresTensor t = table[blockIdx.y];
    part[threadIdx.x] =
        squares_of_stride(t.x, t.n, blockIdx.x * (size_t)blockDim.x + threadIdx.x, (size_t)gridDim.x * blockDim.x);
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = part[0];
}

// ---- Activations and their derivatives, residuals' sums, a
// gradient added into its f32 sum, casts between f32 and bf16, a scale in
// place: 8 elements a thread (elementwise.cuh);
// whether a tensor holds values that are not finite (finite.cuh).

#include "elementwise.cuh"
#include "finite.cuh"

#define ELEMENTWISE(T, S)                                                                                   \
    extern "C" __global__ void activation_fwd_##S(const T* x, T* y, size_t n, int act) {                    \
        activation_fwd<T>(x, y, n, act);                                                                    \
    }                                                                                                       \
    extern "C" __global__ void activation_bwd_##S(const T* x, const T* g, T* dx, size_t n, int act) {       \
        activation_bwd<T>(x, g, dx, n, act);                                                                \
    }                                                                                                       \
    extern "C" __global__ void sum2_##S(const T* x, const T* a, T* y, size_t n) {                           \
        sum2<T>(x, a, y, n);                                                                                \
    }                                                                                                       \
    extern "C" __global__ void sum3_##S(const T* x, const T* a, const T* b, T* y, size_t n) {               \
        sum3<T>(x, a, b, y, n);                                                                             \
    }                                                                                                       \
    extern "C" __global__ void add_cast_##S(const float* sum, const T* g, float* y, size_t n) {             \
        add_cast<T>(sum, g, y, n);                                                                          \
    }                                                                                                       \
    extern "C" __global__ void add_cast_into_##S(float* sum, const T* g, size_t n) {                        \
        add_cast<T>(sum, g, sum, n);                                                                        \
    }                                                                                                       \
    extern "C" __global__ void non_finite_##S(const T* x, size_t n, float* flags) {                         \
        non_finite_flags<T>(x, n, flags);                                                                   \
    }

ELEMENTWISE(float, f32)
ELEMENTWISE(bf16, bf16)

extern "C" __global__ void widen_bf16(const bf16* x, float* y, size_t n) { cast<bf16, float>(x, y, n); }
extern "C" __global__ void narrow_bf16(const float* x, bf16* y, size_t n) { cast<float, bf16>(x, y, n); }
extern "C" __global__ void affine_in_place_f32(float* x, size_t n, float mul, float add) {
    affine_in_place(x, n, mul, add);
}

// ---- A dense layer's bias added to every row of its product y (rows, n):
// a block of columns, each thread one column down a stride of rows, so the
// bias is read once per thread and no index goes through a division.

#define BIAS_ROWS(T, S)                                                                                     \
    extern "C" __global__ void bias_rows_##S(const T* y, const T* b, T* out, size_t rows, int n) {          \
        const int c = blockIdx.x * blockDim.x + threadIdx.x;                                                \
        if (c >= n) return;                                                                                 \
        const float bias = to_f32(b[c]);                                                                    \
        for (size_t r = blockIdx.y; r < rows; r += gridDim.y)                                               \
            out[r * n + c] = from_f32<T>(to_f32(y[r * n + c]) + bias);                                      \
    }

BIAS_ROWS(float, f32)
BIAS_ROWS(bf16, bf16)

// ---- Rotary embeddings (rotate-half) on x (B, H, T, D) with f32 tables
// (B, 1, T, R), R <= D: features past R pass through. The inverse rotation
// (sign -1) is the backward pass: rotations are orthogonal.

// `rotated` (a rotated feature), and the heads of a fused projection below.
#include "heads.cuh"

#define ROTARY(T, S)                                                                                        \
    extern "C" __global__ void rotary_##S(const T* x, const float* cos, const float* sin, T* y, int h, int t, \
                                          int d, int r, float sign, size_t n) {                             \
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) { \
            const int j = (int)(i % d);                                                                     \
            if (j >= r) {                                                                                   \
                y[i] = x[i];                                                                                \
                continue;                                                                                   \
            }                                                                                               \
            const size_t token = i / d, bi = token / ((size_t)h * t), ti = token % t;                      \
            const size_t at = (bi * t + ti) * r + j;                                                        \
            const int half = r / 2;                                                                         \
            const float partner = to_f32(j < half ? x[i + half] : x[i - half]);                            \
            y[i] = from_f32<T>(rotated(to_f32(x[i]), partner, j, half, cos[at], sign * sin[at]));           \
        }                                                                                                   \
    }

ROTARY(float, f32)
ROTARY(bf16, bf16)

// ---- Attention's heads cut out of a fused q/k/v projection and their
// gradients written back (heads.cuh).

#define HEADS(T, S)                                                                                           \
    extern "C" __global__ void heads_split_##S(const T* fused, const float* cos, const float* sin, T* out,    \
                                               HeadsDims a, size_t n) {                                       \
        heads_split<T>(fused, cos, sin, out, a, n);                                                           \
    }                                                                                                         \
    extern "C" __global__ void heads_merge_##S(const T* dq, const T* dkv, const float* cos, const float* sin, \
                                               T* fused, HeadsDims a, size_t n) {                             \
        heads_merge<T>(dq, dkv, cos, sin, fused, a, n);                                                       \
    }                                                                                                         \
    extern "C" __global__ void heads_split_wide_##S(const T* fused, const float* cos, const float* sin,       \
                                                    T* out, HeadsDims a, size_t n) {                          \
        heads_split_wide<T>(fused, cos, sin, out, a, n);                                                      \
    }                                                                                                         \
    extern "C" __global__ void heads_merge_wide_##S(const T* dq, const T* dkv, const float* cos,              \
                                                    const float* sin, T* fused, HeadsDims a, size_t n) {      \
        heads_merge_wide<T>(dq, dkv, cos, sin, fused, a, n);                                                  \
    }
HEADS(float, f32)
HEADS(bf16, bf16)

// ---- A decoding step's rotary and cache append in one launch (heads.cuh).

#define ROTARY_APPEND(T, S)                                                                                    \
    extern "C" __global__ void rotary_append_##S(const T* q, const T* k, const T* v, const float* cos,         \
                                                 const float* sin, T* q_out, T* k_cache, T* v_cache,           \
                                                 const uint32_t* slot_at, AppendDims a) {                       \
        rotary_append<T>(q, k, v, cos, sin, q_out, k_cache, v_cache, slot_at, a);                               \
    }                                                                                                          \
    extern "C" __global__ void rotary_append_wide_##S(const T* q, const T* k, const T* v, const float* cos,    \
                                                      const float* sin, T* q_out, T* k_cache, T* v_cache,      \
                                                      const uint32_t* slot_at, AppendDims a, int rows) {        \
        rotary_append_wide<T>(q, k, v, cos, sin, q_out, k_cache, v_cache, slot_at, a, rows);                    \
    }
ROTARY_APPEND(float, f32)
ROTARY_APPEND(bf16, bf16)

// ---- Scaled dot-product attention with an additive bias, whole rows in
// shared memory (no (T, S) tensor in global memory). q, o: (B, H, T, D)
// contiguous; k, v: (B, Hkv, *, D) whose heads lie `kv_stride` elements
// apart (a cache's capacity x D), S keys used; bias: (B, T, S) f32, a key
// with bias below -1e29 is masked (probability exactly 0; a row that sees
// no key gives 0); lse: (B, H, T) f32 log-sum-exp of each row's scores, for
// the backward pass. One block per query row; dynamic shared memory holds
// the row's S scores and 32 floats of scratch.

template <typename T>
__device__ __forceinline__ float dot(const T* a, const T* b, int d) {
    float acc = 0.f;
    for (int e = 0; e < d; ++e) acc += to_f32(a[e]) * to_f32(b[e]);
    return acc;
}

// Fills p[0..S) with the row's probabilities; returns the log-sum-exp (0 for
// a row that sees no key), or uses the given one (`lse_in` not NaN).
template <typename T>
__device__ float row_probs(const T* qr, const T* kb, const float* br, const AttnDims& a, float* p, float* scratch,
                           float lse_in) {
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < a.s; j += blockDim.x) {
        const float sc = br[j] < -1e29f ? -INFINITY : dot(qr, kb + (size_t)j * a.d, a.d) * a.scale + br[j];
        p[j] = sc;
        mx = fmaxf(mx, sc);
    }
    float lse = lse_in;
    if (isnan(lse_in)) {
        mx = block_max(mx, scratch);
        float sum = 0.f;
        for (int j = threadIdx.x; j < a.s; j += blockDim.x) sum += p[j] == -INFINITY ? 0.f : expf(p[j] - mx);
        sum = block_sum(sum, scratch);
        lse = sum > 0.f ? mx + logf(sum) : 0.f;
    }
    for (int j = threadIdx.x; j < a.s; j += blockDim.x) p[j] = p[j] == -INFINITY ? 0.f : expf(p[j] - lse);
    __syncthreads();
    return lse;
}

template <typename T>
__device__ void attention_fwd(const T* q, const T* k, const T* v, const float* bias, T* o, float* lse, AttnDims a) {
    extern __shared__ float smem[];
    float* p = smem;
    float* scratch = smem + a.s;
    const size_t row = blockIdx.x;
    const int ti = row % a.t, bh = row / a.t, hi = bh % a.h, b = bh / a.h, hk = hi / (a.h / a.h_kv);
    const T* kb = k + ((size_t)b * a.h_kv + hk) * a.kv_stride;
    const T* vb = v + ((size_t)b * a.h_kv + hk) * a.kv_stride;
    const float l = row_probs(q + row * a.d, kb, bias + ((size_t)b * a.t + ti) * a.s, a, p, scratch, NAN);
    for (int e = threadIdx.x; e < a.d; e += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < a.s; ++j) acc += p[j] * to_f32(vb[(size_t)j * a.d + e]);
        o[row * a.d + e] = from_f32<T>(acc);
    }
    if (threadIdx.x == 0) lse[row] = l;
}

// d q of each query row, from d o and di = rowsum(d o * o) (B, H, T) f32:
// ds_j = p_j (d o . v_j - di), d q = scale sum_j ds_j k_j.
template <typename T>
__device__ void attention_bwd_q(const T* q, const T* k, const T* v, const float* bias, const float* lse,
                                const T* dout, const float* di, T* dq, AttnDims a) {
    extern __shared__ float smem[];
    float* p = smem;
    float* scratch = smem + a.s;
    const size_t row = blockIdx.x;
    const int ti = row % a.t, bh = row / a.t, hi = bh % a.h, b = bh / a.h, hk = hi / (a.h / a.h_kv);
    const T* kb = k + ((size_t)b * a.h_kv + hk) * a.kv_stride;
    const T* vb = v + ((size_t)b * a.h_kv + hk) * a.kv_stride;
    row_probs(q + row * a.d, kb, bias + ((size_t)b * a.t + ti) * a.s, a, p, scratch, lse[row]);
    const T* gr = dout + row * a.d;
    for (int j = threadIdx.x; j < a.s; j += blockDim.x)
        if (p[j] != 0.f) p[j] *= dot(gr, vb + (size_t)j * a.d, a.d) - di[row];
    __syncthreads();
    for (int e = threadIdx.x; e < a.d; e += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < a.s; ++j) acc += p[j] * to_f32(kb[(size_t)j * a.d + e]);
        dq[row * a.d + e] = from_f32<T>(acc * a.scale);
    }
}

// d k and d v of each key (block per (b, kv head, key j)), over the query
// heads of its group and every query: out holds d k (B, Hkv, S, D), then
// d v. Dynamic shared memory: 2 T + 2 D floats.
template <typename T>
__device__ void attention_bwd_kv(const T* q, const T* k, const T* v, const float* bias, const float* lse,
                                 const T* dout, const float* di, T* out, AttnDims a) {
    extern __shared__ float smem[];
    float* ds = smem;
    float* pr = smem + a.t;
    float* acc_k = smem + 2 * a.t;
    float* acc_v = acc_k + a.d;
    const int j = blockIdx.x % a.s, bk = blockIdx.x / a.s, hk = bk % a.h_kv, b = bk / a.h_kv;
    const int n_rep = a.h / a.h_kv;
    const T* kj = k + ((size_t)b * a.h_kv + hk) * a.kv_stride + (size_t)j * a.d;
    const T* vj = v + ((size_t)b * a.h_kv + hk) * a.kv_stride + (size_t)j * a.d;
    for (int e = threadIdx.x; e < a.d; e += blockDim.x) acc_k[e] = acc_v[e] = 0.f;
    for (int rep = 0; rep < n_rep; ++rep) {
        const size_t head = (size_t)b * a.h + hk * n_rep + rep;
        for (int ti = threadIdx.x; ti < a.t; ti += blockDim.x) {
            const size_t row = head * a.t + ti;
            const float bias_tj = bias[((size_t)b * a.t + ti) * a.s + j];
            float p = 0.f, d = 0.f;
            if (bias_tj >= -1e29f) {
                p = expf(dot(q + row * a.d, kj, a.d) * a.scale + bias_tj - lse[row]);
                d = p * (dot(dout + row * a.d, vj, a.d) - di[row]);
            }
            pr[ti] = p;
            ds[ti] = d;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < a.d; e += blockDim.x) {
            float gk = 0.f, gv = 0.f;
            for (int ti = 0; ti < a.t; ++ti) {
                const size_t row = head * a.t + ti;
                gk += ds[ti] * to_f32(q[row * a.d + e]);
                gv += pr[ti] * to_f32(dout[row * a.d + e]);
            }
            acc_k[e] += gk * a.scale;
            acc_v[e] += gv;
        }
        __syncthreads();
    }
    const size_t at = (((size_t)b * a.h_kv + hk) * a.s + j) * a.d;
    const size_t half = (size_t)gridDim.x * a.d;
    for (int e = threadIdx.x; e < a.d; e += blockDim.x) {
        out[at + e] = from_f32<T>(acc_k[e]);
        out[half + at + e] = from_f32<T>(acc_v[e]);
    }
}

#define ATTENTION(T, S)                                                                                      \
    extern "C" __global__ void attention_fwd_##S(const T* q, const T* k, const T* v, const float* bias, T* o,  \
                                                 float* lse, AttnDims a) {                                   \
        attention_fwd<T>(q, k, v, bias, o, lse, a);                                                          \
    }                                                                                                        \
    extern "C" __global__ void attention_bwd_q_##S(const T* q, const T* k, const T* v, const float* bias,     \
                                                   const float* lse, const T* dout, const float* di, T* dq,  \
                                                   AttnDims a) {                                             \
        attention_bwd_q<T>(q, k, v, bias, lse, dout, di, dq, a);                                             \
    }                                                                                                        \
    extern "C" __global__ void attention_bwd_kv_##S(const T* q, const T* k, const T* v, const float* bias,    \
                                                    const float* lse, const T* dout, const float* di, T* out, \
                                                    AttnDims a) {                                            \
        attention_bwd_kv<T>(q, k, v, bias, lse, dout, di, out, a);                                           \
    }

ATTENTION(float, f32)
ATTENTION(bf16, bf16)

// ---- The same attention on tensor cores (bf16, head sizes 64, 128, 256),
// flash style: a block takes a tile of queries (forward, d q) or of keys
// (d k, d v) and walks the other side tile by tile through shared memory,
// so no (T, S) tensor reaches global memory. Products run as 16 x 16 x 16
// WMMA tiles with f32 accumulators, each warp owning 16 rows of the block's
// tile; softmax rows are worked by pairs of lanes. Probabilities (and d
// scores) enter the second product rounded to bf16. Tiles whose bias masks
// every pair are skipped. Same inputs and outputs as the kernels above.

namespace tc {

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> RowA;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> RowB;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> ColB;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> Acc;

// Float rows in shared memory padded likewise (WMMA wants multiples of 4
// floats, tiles starting 32 bytes apart); bf16 rows as fa::ld_bf.
__host__ __device__ constexpr int ld_f(int cols) { return cols + 4; }
using fa::expect_launch;
using fa::ld_bf;
using fa::stage;

// out (16 x 16 tiles, `n` of them across) = a (16 x K) b^T, with b's rows as
// the output's columns: a's and b's rows are K long, in shared memory.
template <int K>
__device__ __forceinline__ void product_t(float* out, int ld_out, const bf16* a, const bf16* b, int ld, int n) {
    for (int j = 0; j < n; ++j) {
        Acc acc;
        wmma::fill_fragment(acc, 0.f);
        for (int kk = 0; kk < K / 16; ++kk) {
            RowA fa;
            ColB fb;
            wmma::load_matrix_sync(fa, a + kk * 16, ld);
            wmma::load_matrix_sync(fb, b + j * 16 * ld + kk * 16, ld);
            wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(out + j * 16, acc, ld_out, wmma::mem_row_major);
    }
}

// acc (16 x D, f32 in shared memory) += a (16 x K) b (K x D).
template <int K, int D>
__device__ __forceinline__ void accumulate(float* acc, const bf16* a, int ld_a, const bf16* b) {
    for (int j = 0; j < D / 16; ++j) {
        Acc c;
        wmma::load_matrix_sync(c, acc + j * 16, ld_f(D), wmma::mem_row_major);
        for (int kk = 0; kk < K / 16; ++kk) {
            RowA fa;
            RowB fb;
            wmma::load_matrix_sync(fa, a + kk * 16, ld_a);
            wmma::load_matrix_sync(fb, b + kk * 16 * ld_bf(D) + j * 16, ld_bf(D));
            wmma::mma_sync(c, fa, fb, c);
        }
        wmma::store_matrix_sync(acc + j * 16, c, ld_f(D), wmma::mem_row_major);
    }
}

// The bias of queries [t0, t0 + nq) against keys [s0, s0 + nk) into
// shared memory, -inf where masked or out of range, transposed (keys as
// rows) when `keys_first`; whether any pair is unmasked, for the block.
// Four keys per thread (nk and s0 are multiples of 4), in one 16-byte load
// where the bias's rows are 16-byte aligned.
__device__ __forceinline__ bool stage_bias(float* dst, int ld, const float* bias, const AttnDims& a, int t0, int nq,
                                           int s0, int nk, bool keys_first) {
    const bool wide = (a.s & 3) == 0 && (reinterpret_cast<size_t>(bias) & 15) == 0;
    int live = 0;
    for (int i = threadIdx.x; i < nq * nk / 4; i += blockDim.x) {
        const int qi = i / (nk / 4), kj = i % (nk / 4) * 4;
        float b[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
        if (t0 + qi < a.t) {
            const float* row = bias + (size_t)(t0 + qi) * a.s + s0 + kj;
            if (wide && s0 + kj < a.s) {
                const float4 x = *reinterpret_cast<const float4*>(row);
                b[0] = x.x, b[1] = x.y, b[2] = x.z, b[3] = x.w;
            } else {
                for (int e = 0; e < 4; ++e)
                    if (s0 + kj + e < a.s) b[e] = row[e];
            }
        }
        for (int e = 0; e < 4; ++e) {
            float v = b[e];
            if (v < -1e29f) v = -INFINITY;
            else live = 1;
            dst[keys_first ? (kj + e) * ld + qi : qi * ld + kj + e] = v;
        }
    }
    return __syncthreads_or(live);
}

template <int D, int W, int BK>
__host__ __device__ constexpr size_t fwd_bytes() {
    return 2 * (16 * W + 2 * BK) * ld_bf(D) + 8 * 16 * W * ld_f(BK) + 2 * 16 * W * ld_bf(BK) + 4 * 16 * W * ld_f(D);
}

template <int D, int W, int BK>
__device__ void fwd(const bf16* q, const bf16* k, const bf16* v, const float* bias, bf16* o, float* lse, AttnDims a) {
    constexpr int BQ = 16 * W, LD = ld_bf(D), LS = ld_f(BK), LP = ld_bf(BK), LO = ld_f(D);
    expect_launch(fwd_bytes<D, W, BK>(), 32 * W);
    extern __shared__ __align__(128) unsigned char smem[];
    bf16* qs = (bf16*)smem;
    bf16* ks = qs + BQ * LD;
    bf16* vs = ks + BK * LD;
    float* ss = (float*)(vs + BK * LD);
    float* bs = ss + BQ * LS;
    bf16* ps = (bf16*)(bs + BQ * LS);
    float* os = (float*)(ps + BQ * LP);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, half = lane & 1;
    const int row = warp * 16 + (lane >> 1);
    const int bh = blockIdx.y, b = bh / a.h, hk = bh % a.h / (a.h / a.h_kv), t0 = blockIdx.x * BQ;
    const bf16* kh = k + ((size_t)b * a.h_kv + hk) * a.kv_stride;
    const bf16* vh = v + ((size_t)b * a.h_kv + hk) * a.kv_stride;
    stage<D>(qs, q + (size_t)bh * a.t * D, t0, BQ, a.t);
    for (int i = threadIdx.x; i < BQ * D; i += blockDim.x) os[i / D * LO + i % D] = 0.f;
    float m = -INFINITY, l = 0.f;  // the running max and sum of this lane's row
    for (int s0 = 0; s0 < a.s; s0 += BK) {
        __syncthreads();
        // Tiles the bias masks whole are skipped before their keys and values are read.
        if (!stage_bias(bs, LS, bias + (size_t)b * a.t * a.s, a, t0, BQ, s0, BK, false)) continue;
        stage<D>(ks, kh, s0, BK, a.s);
        stage<D>(vs, vh, s0, BK, a.s);
        __syncthreads();
        product_t<D>(ss + warp * 16 * LS, LS, qs + warp * 16 * LD, ks, LD, BK / 16);
        __syncwarp();
        float* sr = ss + row * LS;
        const float* br = bs + row * LS;
        float top = -INFINITY;
        for (int c = half * BK / 2; c < (half + 1) * BK / 2; ++c) {
            sr[c] = br[c] == -INFINITY ? -INFINITY : sr[c] * a.scale + br[c];
            top = fmaxf(top, sr[c]);
        }
        const float m_new = fmaxf(m, fmaxf(top, __shfl_xor_sync(0xffffffff, top, 1)));
        const float keep = m_new == -INFINITY ? 1.f : expf(m - m_new);
        float sum = 0.f;
        for (int c = half * BK / 2; c < (half + 1) * BK / 2; ++c) {
            const bf16 p = __float2bfloat16(sr[c] == -INFINITY ? 0.f : expf(sr[c] - m_new));
            ps[row * LP + c] = p;
            sum += __bfloat162float(p);
        }
        l = l * keep + sum + __shfl_xor_sync(0xffffffff, sum, 1);
        m = m_new;
        for (int c = half * D / 2; c < (half + 1) * D / 2; ++c) os[row * LO + c] *= keep;
        __syncwarp();
        accumulate<BK, D>(os + warp * 16 * LO, ps + warp * 16 * LP, LP, vs);
    }
    __syncwarp();
    if (t0 + row < a.t) {
        const size_t at = (size_t)bh * a.t + t0 + row;
        const float inv = l > 0.f ? 1.f / l : 0.f;
        for (int c = half * D / 2; c < (half + 1) * D / 2; ++c) o[at * D + c] = __float2bfloat16(os[row * LO + c] * inv);
        if (half == 0) lse[at] = l > 0.f ? m + logf(l) : 0.f;
    }
}

template <int D, int W, int BK>
__host__ __device__ constexpr size_t bwd_q_bytes() {
    return 2 * (2 * 16 * W + 2 * BK) * ld_bf(D) + 12 * 16 * W * ld_f(BK) + 2 * 16 * W * ld_bf(BK) +
           4 * 16 * W * ld_f(D);
}

template <int D, int W, int BK>
__device__ void bwd_q(const bf16* q, const bf16* k, const bf16* v, const float* bias, const float* lse,
                      const bf16* dout, const float* di, bf16* dq, AttnDims a) {
    constexpr int BQ = 16 * W, LD = ld_bf(D), LS = ld_f(BK), LP = ld_bf(BK), LO = ld_f(D);
    expect_launch(bwd_q_bytes<D, W, BK>(), 32 * W);
    extern __shared__ __align__(128) unsigned char smem[];
    bf16* qs = (bf16*)smem;
    bf16* dos = qs + BQ * LD;
    bf16* ks = dos + BQ * LD;
    bf16* vs = ks + BK * LD;
    float* ss = (float*)(vs + BK * LD);
    float* dps = ss + BQ * LS;
    float* bs = dps + BQ * LS;
    bf16* dss = (bf16*)(bs + BQ * LS);
    float* dqs = (float*)(dss + BQ * LP);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, half = lane & 1;
    const int row = warp * 16 + (lane >> 1);
    const int bh = blockIdx.y, b = bh / a.h, hk = bh % a.h / (a.h / a.h_kv), t0 = blockIdx.x * BQ;
    const bf16* kh = k + ((size_t)b * a.h_kv + hk) * a.kv_stride;
    const bf16* vh = v + ((size_t)b * a.h_kv + hk) * a.kv_stride;
    stage<D>(qs, q + (size_t)bh * a.t * D, t0, BQ, a.t);
    stage<D>(dos, dout + (size_t)bh * a.t * D, t0, BQ, a.t);
    for (int i = threadIdx.x; i < BQ * D; i += blockDim.x) dqs[i / D * LO + i % D] = 0.f;
    const size_t at = (size_t)bh * a.t + t0 + row;
    const float row_lse = t0 + row < a.t ? lse[at] : 0.f, row_di = t0 + row < a.t ? di[at] : 0.f;
    for (int s0 = 0; s0 < a.s; s0 += BK) {
        __syncthreads();
        // Tiles the bias masks whole are skipped before their keys and values are read.
        if (!stage_bias(bs, LS, bias + (size_t)b * a.t * a.s, a, t0, BQ, s0, BK, false)) continue;
        stage<D>(ks, kh, s0, BK, a.s);
        stage<D>(vs, vh, s0, BK, a.s);
        __syncthreads();
        product_t<D>(ss + warp * 16 * LS, LS, qs + warp * 16 * LD, ks, LD, BK / 16);
        product_t<D>(dps + warp * 16 * LS, LS, dos + warp * 16 * LD, vs, LD, BK / 16);
        __syncwarp();
        for (int c = half * BK / 2; c < (half + 1) * BK / 2; ++c) {
            const float bv = bs[row * LS + c];
            const float p = bv == -INFINITY ? 0.f : expf(ss[row * LS + c] * a.scale + bv - row_lse);
            dss[row * LP + c] = __float2bfloat16(p * (dps[row * LS + c] - row_di));
        }
        __syncwarp();
        accumulate<BK, D>(dqs + warp * 16 * LO, dss + warp * 16 * LP, LP, ks);
    }
    __syncwarp();
    if (t0 + row < a.t)
        for (int c = half * D / 2; c < (half + 1) * D / 2; ++c)
            dq[at * D + c] = __float2bfloat16(dqs[row * LO + c] * a.scale);
}

template <int D, int W, int BQ>
__host__ __device__ constexpr size_t bwd_kv_bytes() {
    return 2 * (2 * 16 * W + 2 * BQ) * ld_bf(D) + 12 * 16 * W * ld_f(BQ) + 4 * 16 * W * ld_bf(BQ) +
           8 * 16 * W * ld_f(D) + 8 * BQ;
}

// Block per (tile of 16 W keys, b, kv head): d k and d v summed over the
// query heads of the group and every query tile. out: d k (B, Hkv, S, D),
// then d v.
template <int D, int W, int BQ>
__device__ void bwd_kv(const bf16* q, const bf16* k, const bf16* v, const float* bias, const float* lse,
                       const bf16* dout, const float* di, bf16* out, AttnDims a) {
    constexpr int BKV = 16 * W, LD = ld_bf(D), LT = ld_f(BQ), LP = ld_bf(BQ), LO = ld_f(D);
    expect_launch(bwd_kv_bytes<D, W, BQ>(), 32 * W);
    extern __shared__ __align__(128) unsigned char smem[];
    bf16* ks = (bf16*)smem;
    bf16* vs = ks + BKV * LD;
    bf16* qs = vs + BKV * LD;
    bf16* dos = qs + BQ * LD;
    float* sts = (float*)(dos + BQ * LD);
    float* dpts = sts + BKV * LT;
    float* bts = dpts + BKV * LT;
    bf16* pts = (bf16*)(bts + BKV * LT);
    bf16* dsts = pts + BKV * LP;
    float* dks = (float*)(dsts + BKV * LP);
    float* dvs = dks + BKV * LO;
    float* lse_s = dvs + BKV * LO;
    float* di_s = lse_s + BQ;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, half = lane & 1;
    const int key = warp * 16 + (lane >> 1);
    const int b = blockIdx.y / a.h_kv, hk = blockIdx.y % a.h_kv, j0 = blockIdx.x * BKV, n_rep = a.h / a.h_kv;
    stage<D>(ks, k + ((size_t)b * a.h_kv + hk) * a.kv_stride, j0, BKV, a.s);
    stage<D>(vs, v + ((size_t)b * a.h_kv + hk) * a.kv_stride, j0, BKV, a.s);
    for (int i = threadIdx.x; i < BKV * D; i += blockDim.x) dks[i / D * LO + i % D] = dvs[i / D * LO + i % D] = 0.f;
    for (int rep = 0; rep < n_rep; ++rep) {
        const size_t head = (size_t)b * a.h + hk * n_rep + rep;
        for (int t0 = 0; t0 < a.t; t0 += BQ) {
            __syncthreads();
            if (!stage_bias(bts, LT, bias + (size_t)b * a.t * a.s, a, t0, BQ, j0, BKV, true)) continue;
            stage<D>(qs, q + head * a.t * D, t0, BQ, a.t);
            stage<D>(dos, dout + head * a.t * D, t0, BQ, a.t);
            for (int i = threadIdx.x; i < BQ; i += blockDim.x) {
                lse_s[i] = t0 + i < a.t ? lse[head * a.t + t0 + i] : 0.f;
                di_s[i] = t0 + i < a.t ? di[head * a.t + t0 + i] : 0.f;
            }
            __syncthreads();
            product_t<D>(sts + warp * 16 * LT, LT, ks + warp * 16 * LD, qs, LD, BQ / 16);
            product_t<D>(dpts + warp * 16 * LT, LT, vs + warp * 16 * LD, dos, LD, BQ / 16);
            __syncwarp();
            for (int c = half * BQ / 2; c < (half + 1) * BQ / 2; ++c) {
                const float bv = bts[key * LT + c];
                const float p = bv == -INFINITY ? 0.f : expf(sts[key * LT + c] * a.scale + bv - lse_s[c]);
                pts[key * LP + c] = __float2bfloat16(p);
                dsts[key * LP + c] = __float2bfloat16(p * (dpts[key * LT + c] - di_s[c]));
            }
            __syncwarp();
            accumulate<BQ, D>(dvs + warp * 16 * LO, pts + warp * 16 * LP, LP, dos);
            accumulate<BQ, D>(dks + warp * 16 * LO, dsts + warp * 16 * LP, LP, qs);
        }
    }
    __syncwarp();
    if (j0 + key < a.s) {
        const size_t at = (((size_t)b * a.h_kv + hk) * a.s + j0 + key) * D;
        const size_t dv_at = (size_t)gridDim.y * a.s * D;
        for (int c = half * D / 2; c < (half + 1) * D / 2; ++c) {
            out[at + c] = __float2bfloat16(dks[key * LO + c] * a.scale);
            out[dv_at + at + c] = __float2bfloat16(dvs[key * LO + c]);
        }
    }
}

}  // namespace tc

// Per head size: warps and key tile of the forward and d q kernels, warps
// and query tile of the d k, d v kernel (within 227 KB of shared memory).
#define ATTENTION_TC(D, W, BK, W_KV, BQ_KV)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * W)                                                       \
        attention_tc_fwd_##D(const bf16* q, const bf16* k, const bf16* v, const float* bias, bf16* o,          \
                             float* lse, AttnDims a) {                                                         \
        tc::fwd<D, W, BK>(q, k, v, bias, o, lse, a);                                                           \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * W)                                                       \
        attention_tc_bwd_q_##D(const bf16* q, const bf16* k, const bf16* v, const float* bias,                 \
                               const float* lse, const bf16* dout, const float* di, bf16* dq, AttnDims a) {    \
        tc::bwd_q<D, W, BK>(q, k, v, bias, lse, dout, di, dq, a);                                              \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * W_KV)                                                    \
        attention_tc_bwd_kv_##D(const bf16* q, const bf16* k, const bf16* v, const float* bias,                \
                                const float* lse, const bf16* dout, const float* di, bf16* out, AttnDims a) {  \
        tc::bwd_kv<D, W_KV, BQ_KV>(q, k, v, bias, lse, dout, di, out, a);                                      \
    }

ATTENTION_TC(64, 4, 64, 4, 64)
ATTENTION_TC(128, 4, 64, 4, 64)
ATTENTION_TC(256, 4, 32, 2, 32)

// The register-resident kernels at each head size, with fa::Tiles<D>'s tiles.
#define ATTENTION_FA(D)                                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * fa::WARPS)                                               \
        attention_fa_fwd_##D(const bf16* q, const bf16* k, const bf16* v, const float* bias, bf16* o,          \
                             float* lse, AttnDims a) {                                                         \
        fa::fwd<D, fa::Tiles<D>::KEYS>(q, k, v, bias, o, lse, a);                                              \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * fa::WARPS)                                               \
        attention_fa_bwd_q_##D(const bf16* q, const bf16* k, const bf16* v, const float* bias,                 \
                               const float* lse, const bf16* dout, const float* di, bf16* dq, AttnDims a) {    \
        fa::bwd_q<D, fa::Tiles<D>::KEYS>(q, k, v, bias, lse, dout, di, dq, a);                                 \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * fa::WARPS)                                               \
        attention_fa_bwd_kv_##D(const bf16* q, const bf16* k, const bf16* v, const float* bias,                \
                                const float* lse, const bf16* dout, const float* di, bf16* out, AttnDims a) {  \
        fa::bwd_kv<D, fa::Tiles<D>::QUERIES, fa::Tiles<D>::SPLIT>(q, k, v, bias, lse, dout, di, out, a);       \
    }

ATTENTION_FA(64)
ATTENTION_FA(128)
ATTENTION_FA(256)

// The same over each query's runs of keys (fa::Span, batch.rs's
// attention_spans), pipelined.
#define ATTENTION_FS(D)                                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * fa::WARPS)                                               \
        attention_fs_fwd_##D(const bf16* q, const bf16* k, const bf16* v, const fa::Span* spans, bf16* o,      \
                             float* lse, AttnDims a) {                                                         \
        fa::fwd_spans<D, fa::Tiles<D>::KEYS>(q, k, v, spans, o, lse, a);                                       \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * fa::WARPS)                                               \
        attention_fs_bwd_q_##D(const bf16* q, const bf16* k, const bf16* v, const fa::Span* spans,             \
                               const float* lse, const bf16* dout, const float* di, bf16* dq, AttnDims a) {    \
        fa::bwd_q_spans<D, fa::Tiles<D>::KEYS>(q, k, v, spans, lse, dout, di, dq, a);                          \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * fa::WARPS)                                               \
        attention_fs_bwd_kv_##D(const bf16* q, const bf16* k, const bf16* v, const fa::Span* spans,            \
                                const fa::QueryRange* ranges, const float* lse, const bf16* dout,              \
                                const float* di, bf16* out, AttnDims a) {                                      \
        fa::bwd_kv_spans<D, fa::Tiles<D>::QUERIES, fa::Tiles<D>::SPLIT>(q, k, v, spans, ranges, lse, dout, di, \
                                                                        out, a);                               \
    }

ATTENTION_FS(64)
ATTENTION_FS(128)
ATTENTION_FS(256)

#include "decode.cuh"

// ---- out[r] = sum_e a[r, e] b[r, e] in f32 over rows of d: a warp per row,
// lanes in a fixed order (the attention backward's rowsum(d out * out)).

#define ROW_DOTS(T, S)                                                                                      \
    extern "C" __global__ void row_dots_##S(const T* a, const T* b, float* out, size_t rows, int d) {       \
        const size_t r = blockIdx.x * (size_t)(blockDim.x / 32) + threadIdx.x / 32;                         \
        if (r >= rows) return;                                                                              \
        float acc = 0.f;                                                                                    \
        for (int e = threadIdx.x % 32; e < d; e += 32) acc += to_f32(a[r * d + e]) * to_f32(b[r * d + e]); \
        acc = warp_sum(acc);                                                                                \
        if (threadIdx.x % 32 == 0) out[r] = acc;                                                            \
    }

ROW_DOTS(float, f32)
ROW_DOTS(bf16, bf16)

#define DECODE_ATTENTION(T, S, E)                                                                              \
    extern "C" __global__ void decode_attention_##E##_##S(const T* q, const T* k, const T* v, const T* shared_k, \
                                                          const T* shared_v, const uint32_t* shared_rows,       \
                                                          const float* mask, const uint32_t* slot_at, T* o,     \
                                                          float* parts, DecodeDims a) {                         \
        decode_attention<T, E>(q, k, v, shared_k, shared_v, shared_rows, mask, slot_at, o, parts, a);           \
    }
DECODE_ATTENTION(float, f32, 1)
DECODE_ATTENTION(float, f32, 2)
DECODE_ATTENTION(float, f32, 4)
DECODE_ATTENTION(float, f32, 8)
DECODE_ATTENTION(bf16, bf16, 1)
DECODE_ATTENTION(bf16, bf16, 2)
DECODE_ATTENTION(bf16, bf16, 4)
DECODE_ATTENTION(bf16, bf16, 8)

// A key per lane, G query heads of a key/value head and R rows of one
// shared row per block: every G and R of 1, 2 or 4 that keep a block's
// partial sums within 16 KB (R G x 32 E <= 512); each with its value rows
// read a row a load, and packed into loads (_packed).
#define DECODE_LANES_AS(T, S, E, G, R, PACKED, NAME)                                                           \
    extern "C" __global__ void decode_attention_lanes_##E##_g##G##_r##R##NAME##_##S(                           \
        const T* q, const T* k, const T* v, const T* shared_k, const T* shared_v, const uint32_t* shared_rows,   \
        const float* mask, const uint32_t* slot_at, T* o, float* parts, DecodeDims a) {                        \
        decode_attention_lanes<T, E, G, R, PACKED>(q, k, v, shared_k, shared_v, shared_rows, mask, slot_at, o,  \
                                                   parts, a);                                                  \
    }
#define DECODE_LANES(T, S, E, G, R) DECODE_LANES_AS(T, S, E, G, R, false, ) DECODE_LANES_AS(T, S, E, G, R, true, _packed)
// f32 rows of 256 are 64 pieces, more than a warp's lanes: not packed.
#define DECODE_LANES_UNPACKED(T, S, E, G, R) DECODE_LANES_AS(T, S, E, G, R, false, )
#define DECODE_LANES_ROWS(T, S, E, G) DECODE_LANES(T, S, E, G, 1) DECODE_LANES(T, S, E, G, 2) DECODE_LANES(T, S, E, G, 4)
#define DECODE_LANES_ALL(T, S, E8)                                                                             \
    DECODE_LANES_ROWS(T, S, 1, 1) DECODE_LANES_ROWS(T, S, 1, 2) DECODE_LANES_ROWS(T, S, 1, 4)                  \
    DECODE_LANES(T, S, 1, 8, 1) DECODE_LANES(T, S, 1, 8, 2)                                                    \
    DECODE_LANES_ROWS(T, S, 2, 1) DECODE_LANES_ROWS(T, S, 2, 2)                                                \
    DECODE_LANES(T, S, 2, 4, 1) DECODE_LANES(T, S, 2, 4, 2) DECODE_LANES(T, S, 2, 8, 1)                        \
    DECODE_LANES_ROWS(T, S, 4, 1) DECODE_LANES(T, S, 4, 2, 1) DECODE_LANES(T, S, 4, 2, 2)                      \
    DECODE_LANES(T, S, 4, 4, 1)                                                                                \
    E8(T, S, 8, 1, 1) E8(T, S, 8, 1, 2) E8(T, S, 8, 2, 1)
DECODE_LANES_ALL(float, f32, DECODE_LANES_UNPACKED)
DECODE_LANES_ALL(bf16, bf16, DECODE_LANES)

#define DECODE_SPLITS(T, S)                                                                                    \
    extern "C" __global__ void decode_splits_##S(const float* parts, int splits, int d, T* o) {              \
        decode_splits<T>(parts, splits, d, o);                                                                 \
    }
DECODE_SPLITS(float, f32)
DECODE_SPLITS(bf16, bf16)

// ---- Sampling by an exponential race (race.cuh), one block per row; its
// Philox also draws dropout's masks below.

#include "race.cuh"

// A block of 1,024 threads a row: at most 64 registers a thread.
#define RACE_PICK(T, S)                                                                                       \
    extern "C" __global__ void __launch_bounds__(1024) race_pick_##S(const T* logits, const uint32_t* params, \
                                                                     const uint32_t* seen, int width,         \
                                                                     uint32_t* out, int v) {                  \
        race_pick_row<RACE_AHEAD, T>(logits, params, seen, width, out, v);                                    \
    }

RACE_PICK(float, f32)
RACE_PICK(bf16, bf16)

// ---- Products of few rows, split along k (rows_gemm.cuh), bf16.

#include "rows_gemm.cuh"

extern "C" __global__ void __launch_bounds__(fa::rows::THREADS)
    rows_gemm_bf16(const bf16* x, const bf16* w, const bf16* b, bf16* y, float* ws, unsigned* counts, RowsGemmDims d) {
    fa::rows_gemm(x, w, b, y, ws, counts, d);
}

// ---- An embedding table's gradient, a block per row (embedding.cuh).

#include "embedding.cuh"

#define EMBEDDING(T, S)                                                                                     \
    extern "C" __global__ void embedding_grad_##S(const T* grad, const uint32_t* ids, T* out, int n, int h) { \
        embedding_grad<T>(grad, ids, out, n, h);                                                            \
    }

EMBEDDING(float, f32)
EMBEDDING(bf16, bf16)

// ---- Dropout by counter (LoRA's inputs): element i is kept when word i % 4
// of Philox at counter (i / 4, i / 2^34, 0, 0) is below `threshold`, and then
// scaled; as `Mask::kept` on the CPU. A thread takes four elements, one draw.

#define DROPOUT(T, S)                                                                                       \
    extern "C" __global__ void dropout_##S(const T* x, T* y, size_t n, uint32_t k0, uint32_t k1,            \
                                           unsigned long long threshold, float scale) {                     \
        const size_t blocks = (n + 3) / 4;                                                                  \
        for (size_t b = blockIdx.x * (size_t)blockDim.x + threadIdx.x; b < blocks;                          \
             b += (size_t)gridDim.x * blockDim.x) {                                                         \
            uint32_t c[4] = {(uint32_t)b, (uint32_t)(b >> 32), 0u, 0u};                                     \
            philox4x32_10(c, k0, k1);                                                                       \
            for (int j = 0; j < 4 && 4 * b + j < n; j++)                                                    \
                y[4 * b + j] = from_f32<T>((unsigned long long)c[j] < threshold ? to_f32(x[4 * b + j]) * scale : 0.f); \
        }                                                                                                   \
    }

DROPOUT(float, f32)
DROPOUT(bf16, bf16)

