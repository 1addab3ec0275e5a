// RMSNorm and LayerNorm over rows of H features, forward and backward, a
// warp a row: each lane takes features lane, lane + 32, ..., so that it has
// H / 32 loads in flight at once, and a row's sums reduce over the warp's
// shuffles, with no barrier; a block's NORM_WARPS warps take as many rows.
// (A block a row, a thread a feature, waited at two or three barriers a
// row and on one load at a time.) Sums run in a fixed order, so the results
// do not depend on scheduling. Arithmetic is f32 whatever T. Included by
// kernels.cu and by the host emulator (emulate.cpp), both defining to_f32,
// from_f32 and __shfl_xor_sync first.

#include "elementwise.cuh"

constexpr int NORM_WARPS = 8;

namespace norms {

// The sum over the warp, the same in every lane (each step adds pairs that
// hold the same values, and addition commutes).
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

// This warp's row and lane; the row is `rows` or more when there is none.
struct Row {
    size_t row;
    int lane;
};

__device__ __forceinline__ Row my_row() {
    return {(size_t)blockIdx.x * NORM_WARPS + threadIdx.x / 32, (int)(threadIdx.x % 32)};
}

// A backward's row of x and d y, and of its outputs d x and d w's part.
template <typename T>
struct BwdRow {
    const T *x, *g;
    T* dx;
    float* dw;
    int lane;
    bool any;
};

template <typename T>
__device__ __forceinline__ BwdRow<T> bwd_row(const T* x, const T* g, T* dx, float* dw, int rows, int h) {
    const Row at = my_row();
    if (at.row >= (size_t)rows) return {x, g, dx, dw, at.lane, false};
    const size_t o = at.row * h;
    return {x + o, g + o, dx + o, dw + o, at.lane, true};
}

// 1 / sqrt(mean(x^2) + eps) of a row.
template <typename T>
__device__ __forceinline__ float inv_rms(const T* xr, int h, int lane, float eps) {
    float sq = 0.f;
    for (int j = lane; j < h; j += 32) {
        const float v = to_f32(xr[j]);
        sq += v * v;
    }
    return rsqrtf(warp_sum(sq) / h + eps);
}

// A row's mean and 1 / sqrt(variance + eps), two passes.
template <typename T>
__device__ __forceinline__ void moments(const T* xr, int h, int lane, float eps, float* mean, float* rstd) {
    float s = 0.f;
    for (int j = lane; j < h; j += 32) s += to_f32(xr[j]);
    const float m = warp_sum(s) / h;
    float v = 0.f;
    for (int j = lane; j < h; j += 32) {
        const float d = to_f32(xr[j]) - m;
        v += d * d;
    }
    *mean = m;
    *rstd = rsqrtf(warp_sum(v) / h + eps);
}

}  // namespace norms

// y = x / sqrt(mean(x^2) + eps) * w.
template <typename T>
__device__ void rms_norm_fwd(const T* x, const T* w, T* y, int rows, int h, float eps) {
    const norms::Row at = norms::my_row();
    if (at.row >= (size_t)rows) return;
    const T* xr = x + at.row * h;
    T* yr = y + at.row * h;
    const float r = norms::inv_rms(xr, h, at.lane, eps);
    for (int j = at.lane; j < h; j += 32) yr[j] = from_f32<T>(to_f32(xr[j]) * r * to_f32(w[j]));
}

// d x (N, H) in T, and each row's part of d w in f32 (N, H), g x r (summed
// over rows by the caller).
template <typename T>
__device__ void rms_norm_bwd(const T* x, const T* w, const T* g, T* dx_out, float* dw_out, int rows, int h,
                             float eps) {
    const norms::BwdRow<T> at = norms::bwd_row(x, g, dx_out, dw_out, rows, h);
    if (!at.any) return;
    const float r = norms::inv_rms(at.x, h, at.lane, eps);
    float gx = 0.f;
    for (int j = at.lane; j < h; j += 32) gx += to_f32(at.g[j]) * to_f32(w[j]) * to_f32(at.x[j]) * r;
    const float mean_gx = norms::warp_sum(gx) / h;
    for (int j = at.lane; j < h; j += 32) {
        const float xv = to_f32(at.x[j]), gv = to_f32(at.g[j]);
        at.dx[j] = from_f32<T>(r * (gv * to_f32(w[j]) - xv * r * mean_gx));
        at.dw[j] = gv * xv * r;
    }
}

// y = (x - mean) / sqrt(var + eps) * w + b.
template <typename T>
__device__ void layer_norm_fwd(const T* x, const T* w, const T* b, T* y, int rows, int h, float eps) {
    const norms::Row at = norms::my_row();
    if (at.row >= (size_t)rows) return;
    const T* xr = x + at.row * h;
    T* yr = y + at.row * h;
    float mean, rstd;
    norms::moments(xr, h, at.lane, eps, &mean, &rstd);
    for (int j = at.lane; j < h; j += 32)
        yr[j] = from_f32<T>((to_f32(xr[j]) - mean) * rstd * to_f32(w[j]) + to_f32(b[j]));
}

// d x (N, H) in T, and each row's part of d w in f32 (N, H), g x^ (d b is
// the sum of g).
template <typename T>
__device__ void layer_norm_bwd(const T* x, const T* w, const T* g, T* dx_out, float* dw_out, int rows, int h,
                               float eps) {
    const norms::BwdRow<T> at = norms::bwd_row(x, g, dx_out, dw_out, rows, h);
    if (!at.any) return;
    float mean, rstd;
    norms::moments(at.x, h, at.lane, eps, &mean, &rstd);
    float sg = 0.f, sgx = 0.f;
    for (int j = at.lane; j < h; j += 32) {
        const float xh = (to_f32(at.x[j]) - mean) * rstd, gh = to_f32(at.g[j]) * to_f32(w[j]);
        sg += gh;
        sgx += gh * xh;
    }
    const float mean_g = norms::warp_sum(sg) / h;
    const float mean_gx = norms::warp_sum(sgx) / h;
    for (int j = at.lane; j < h; j += 32) {
        const float xh = (to_f32(at.x[j]) - mean) * rstd, gv = to_f32(at.g[j]);
        at.dx[j] = from_f32<T>(rstd * (gv * to_f32(w[j]) - mean_g - xh * mean_gx));
        at.dw[j] = gv * xh;
    }
}

// The forwards over rows of whole 16-byte loads (the features a multiple of
// 8, every row on 16 bytes): a lane takes the row's chunks of 8 features
// lane, lane + 32, ..., at most C of them, read once, in loads issued
// together, and held, where the loops above wait out a load's round trip
// for every 32 features of each pass: a LayerNorm row of 1,024 bf16
// features about 24 round trips, here 2. Decoding, with a few hundred rows
// (a block a multiprocessor), waits on nothing else. The same sums, over
// the features in another order.
namespace norms {

template <typename T, int C>
struct HeldRow {
    ew::Eight x[C];
    int chunks, lane;

    __device__ __forceinline__ HeldRow(const T* xr, int h, int lane) : chunks(h / ew::PER_THREAD), lane(lane) {
#pragma unroll
        for (int i = 0; i < C; i++)
            if (has(i)) x[i] = ew::load8(xr, chunk(i));
    }
    __device__ __forceinline__ bool has(int i) const { return chunk(i) < chunks; }
    __device__ __forceinline__ int chunk(int i) const { return lane + 32 * i; }

    // The lane's sum of f(x) over its features.
    template <typename F>
    __device__ __forceinline__ float sum(F f) const {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < C; i++)
            if (has(i))
                for (int k = 0; k < ew::PER_THREAD; k++) s += f(x[i].v[k]);
        return s;
    }
};

}  // namespace norms

template <typename T, int C>
__device__ void rms_norm_fwd_wide(const T* x, const T* w, T* y, int rows, int h, float eps) {
    const norms::Row at = norms::my_row();
    if (at.row >= (size_t)rows) return;
    const norms::HeldRow<T, C> row(x + at.row * h, h, at.lane);
    const float r = rsqrtf(norms::warp_sum(row.sum([](float v) { return v * v; })) / h + eps);
#pragma unroll
    for (int i = 0; i < C; i++) {
        if (!row.has(i)) continue;
        const ew::Eight wv = ew::load8(w, row.chunk(i));
        ew::Eight out;
        for (int k = 0; k < ew::PER_THREAD; k++) out.v[k] = row.x[i].v[k] * r * wv.v[k];
        ew::store8(y + at.row * h, row.chunk(i), out);
    }
}

namespace norms {

// A held row's mean and variance.
template <typename T, int C>
__device__ __forceinline__ void held_moments(const HeldRow<T, C>& row, int h, float* mean, float* var) {
    const float m = warp_sum(row.sum([](float v) { return v; })) / h;
    *mean = m;
    *var = warp_sum(row.sum([m](float v) { return (v - m) * (v - m); })) / h;
}

// (x - mean) * rstd * w + b of a held row, written to its row of y.
template <typename T, int C>
__device__ __forceinline__ void layer_norm_out(const HeldRow<T, C>& row, const T* w, const T* b, T* yr, float mean,
                                               float rstd) {
#pragma unroll
    for (int i = 0; i < C; i++) {
        if (!row.has(i)) continue;
        const ew::Eight wv = ew::load8(w, row.chunk(i)), bv = ew::load8(b, row.chunk(i));
        ew::Eight out;
        for (int k = 0; k < ew::PER_THREAD; k++) out.v[k] = (row.x[i].v[k] - mean) * rstd * wv.v[k] + bv.v[k];
        ew::store8(yr, row.chunk(i), out);
    }
}

}  // namespace norms

template <typename T, int C>
__device__ void layer_norm_fwd_wide(const T* x, const T* w, const T* b, T* y, int rows, int h, float eps) {
    const norms::Row at = norms::my_row();
    if (at.row >= (size_t)rows) return;
    const norms::HeldRow<T, C> row(x + at.row * h, h, at.lane);
    float mean, var;
    norms::held_moments(row, h, &mean, &var);
    norms::layer_norm_out(row, w, b, y + at.row * h, mean, rsqrtf(var + eps));
}

// Two LayerNorms of the same rows, as a parallel-residual layer takes
// before its attention and its MLP: each row read once and its moments
// taken once, then each norm's output with its own weight, bias and eps,
// the same bits as layer_norm_fwd_wide's. y holds the two outputs one
// after the other, (2, rows, h).
template <typename T, int C>
__device__ void layer_norm_pair_fwd_wide(const T* x, const T* w1, const T* b1, const T* w2, const T* b2, T* y,
                                         int rows, int h, float eps1, float eps2) {
    const norms::Row at = norms::my_row();
    if (at.row >= (size_t)rows) return;
    const norms::HeldRow<T, C> row(x + at.row * h, h, at.lane);
    float mean, var;
    norms::held_moments(row, h, &mean, &var);
    norms::layer_norm_out(row, w1, b1, y + at.row * h, mean, rsqrtf(var + eps1));
    norms::layer_norm_out(row, w2, b2, y + ((size_t)rows + at.row) * h, mean, rsqrtf(var + eps2));
}
