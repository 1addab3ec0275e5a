// Elementwise kernels (activations and their derivatives, a residual's or
// a parallel residual's sum, a gradient added into its f32 sum, casts between f32 and
// bf16, a scale in place) over 8 elements a
// thread in 16-byte loads and stores where every tensor starts on 16
// bytes. One 2-byte load a thread keeps too few bytes in flight to fill the
// memory's bandwidth: the GELU over an MLP's 42M bf16 elements ran at about
// a third of it. Elsewhere (a view that starts off 16 bytes) element by
// element; each element's value is the same either way, and the tail past
// the last 8 goes element by element. Launched with a thread per 8
// elements. Included by kernels.cu and by the host emulator (emulate.cpp),
// which define to_f32 and from_f32 first.

#pragma once

// `act`: 0 GELU (erf), 1 GELU (tanh), 2 SiLU, 3 ReLU, as `Activation`'s
// order in the op file.
__device__ __forceinline__ float activate(float x, int act) {
    switch (act) {
        case 0: return 0.5f * x * (1.f + erff(x * 0.70710678f));
        case 1: return 0.5f * x * (1.f + tanhf(0.7978846f * x * (1.f + 0.044715f * x * x)));
        case 2: return x / (1.f + expf(-x));
        default: return fmaxf(x, 0.f);
    }
}

__device__ __forceinline__ float activation_slope(float x, int act) {
    switch (act) {
        case 0: return 0.5f * (1.f + erff(x * 0.70710678f)) + x * expf(-0.5f * x * x) * 0.3989423f;
        case 1: {
            const float t = tanhf(0.7978846f * x * (1.f + 0.044715f * x * x));
            return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * 0.7978846f * (1.f + 3.f * 0.044715f * x * x);
        }
        case 2: {
            const float s = 1.f / (1.f + expf(-x));
            return s * (1.f + x * (1.f - s));
        }
        default: return x > 0.f ? 1.f : 0.f;
    }
}

namespace ew {

constexpr int PER_THREAD = 8;

__device__ __forceinline__ bool on16(const void* p) { return (reinterpret_cast<size_t>(p) & 15) == 0; }

// Eight elements as f32, loaded from and stored to the 8 from 8 c.
struct Eight {
    float v[PER_THREAD];
};

// 8 elements' bytes in 16-byte words, moved whole (memcpy: no pointer of
// one type reads what one of another wrote).
template <typename T>
struct Words {
    static constexpr int N = PER_THREAD * sizeof(T) / 16;
    uint4 w[N];
};

template <typename T>
__device__ __forceinline__ Eight load8(const T* p, size_t c) {
    Words<T> words;
    for (int w = 0; w < Words<T>::N; ++w) words.w[w] = reinterpret_cast<const uint4*>(p + c * PER_THREAD)[w];
    T e[PER_THREAD];
    memcpy(e, words.w, sizeof e);
    Eight out;
    for (int k = 0; k < PER_THREAD; ++k) out.v[k] = to_f32(e[k]);
    return out;
}

template <typename T>
__device__ __forceinline__ void store8(T* p, size_t c, const Eight& x) {
    T e[PER_THREAD];
    for (int k = 0; k < PER_THREAD; ++k) e[k] = from_f32<T>(x.v[k]);
    Words<T> words;
    memcpy(words.w, e, sizeof e);
    for (int w = 0; w < Words<T>::N; ++w) reinterpret_cast<uint4*>(p + c * PER_THREAD)[w] = words.w[w];
}

// Calls `eight(c)` for each 8 elements from 8 c where `vector`, then
// `each(i)` for the elements left (all of them where not), a thread's
// calls a grid's stride apart.
template <typename Eight8, typename Each>
__device__ __forceinline__ void over_elements(size_t n, bool vector, Eight8 eight, Each each) {
    const size_t first = blockIdx.x * (size_t)blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    size_t done = 0;
    if (vector) {
        for (size_t c = first; c < n / PER_THREAD; c += stride) eight(c);
        done = n / PER_THREAD * PER_THREAD;
    }
    for (size_t i = done + first; i < n; i += stride) each(i);
}

}  // namespace ew

template <typename T>
__device__ void activation_fwd(const T* x, T* y, size_t n, int act) {
    ew::over_elements(
        n, ew::on16(x) && ew::on16(y),
        [&](size_t c) {
            ew::Eight v = ew::load8(x, c);
            for (int k = 0; k < ew::PER_THREAD; ++k) v.v[k] = activate(v.v[k], act);
            ew::store8(y, c, v);
        },
        [&](size_t i) { y[i] = from_f32<T>(activate(to_f32(x[i]), act)); });
}

template <typename T>
__device__ void activation_bwd(const T* x, const T* g, T* dx, size_t n, int act) {
    ew::over_elements(
        n, ew::on16(x) && ew::on16(g) && ew::on16(dx),
        [&](size_t c) {
            const ew::Eight xv = ew::load8(x, c);
            ew::Eight v = ew::load8(g, c);
            for (int k = 0; k < ew::PER_THREAD; ++k) v.v[k] = v.v[k] * activation_slope(xv.v[k], act);
            ew::store8(dx, c, v);
        },
        [&](size_t i) { dx[i] = from_f32<T>(to_f32(g[i]) * activation_slope(to_f32(x[i]), act)); });
}

// (x + a) + b, rounded to T after each addition as two of candle's
// additions would be: a parallel residual's sum as one node.
template <typename T>
__device__ void sum3(const T* x, const T* a, const T* b, T* y, size_t n) {
    ew::over_elements(
        n, ew::on16(x) && ew::on16(a) && ew::on16(b) && ew::on16(y),
        [&](size_t c) {
            const ew::Eight av = ew::load8(a, c), bv = ew::load8(b, c);
            ew::Eight v = ew::load8(x, c);
            for (int k = 0; k < ew::PER_THREAD; ++k) v.v[k] = to_f32(from_f32<T>(v.v[k] + av.v[k])) + bv.v[k];
            ew::store8(y, c, v);
        },
        [&](size_t i) {
            const T xa = from_f32<T>(to_f32(x[i]) + to_f32(a[i]));
            y[i] = from_f32<T>(to_f32(xa) + to_f32(b[i]));
        });
}

// x + a, rounded to T: two gradients of one tensor summed by the
// backward, a residual's sum. The sum of two bf16 values in f32, rounded
// to bf16, is their exact sum rounded once, as candle's bf16 addition.
template <typename T>
__device__ void sum2(const T* x, const T* a, T* y, size_t n) {
    ew::over_elements(
        n, ew::on16(x) && ew::on16(a) && ew::on16(y),
        [&](size_t c) {
            const ew::Eight av = ew::load8(a, c);
            ew::Eight v = ew::load8(x, c);
            for (int k = 0; k < ew::PER_THREAD; ++k) v.v[k] = v.v[k] + av.v[k];
            ew::store8(y, c, v);
        },
        [&](size_t i) { y[i] = from_f32<T>(to_f32(x[i]) + to_f32(a[i])); });
}

// sum + g, g cast up to f32: a gradient added into its f32 sum in one pass
// (a bf16 one took candle's cast, then its addition, and a tensor between
// them). y may be sum: each thread stores only what it has loaded.
template <typename T>
__device__ void add_cast(const float* sum, const T* g, float* y, size_t n) {
    ew::over_elements(
        n, ew::on16(sum) && ew::on16(g) && ew::on16(y),
        [&](size_t c) {
            const ew::Eight gv = ew::load8(g, c);
            ew::Eight v = ew::load8(sum, c);
            for (int k = 0; k < ew::PER_THREAD; ++k) v.v[k] = v.v[k] + gv.v[k];
            ew::store8(y, c, v);
        },
        [&](size_t i) { y[i] = sum[i] + to_f32(g[i]); });
}

// x in D's dtype: bf16 widened to f32 (exact) or f32 rounded to bf16 (to
// nearest even, as candle's cast). candle's cast loads 2 bytes a thread: a
// gradient's first f32 sum, cast up from bf16, ran at about 0.6 TB/s.
template <typename S, typename D>
__device__ void cast(const S* x, D* y, size_t n) {
    ew::over_elements(
        n, ew::on16(x) && ew::on16(y), [&](size_t c) { ew::store8(y, c, ew::load8(x, c)); },
        [&](size_t i) { y[i] = from_f32<D>(to_f32(x[i])); });
}

// x * mul + add in place, the expression of candle's affine (a scalar
// product of an f32 tensor is its affine with add 0): a gradient sum
// scaled by clipping, without a second buffer.
__device__ void affine_in_place(float* x, size_t n, float mul, float add) {
    ew::over_elements(
        n, ew::on16(x),
        [&](size_t c) {
            ew::Eight v = ew::load8(x, c);
            for (int k = 0; k < ew::PER_THREAD; ++k) v.v[k] = v.v[k] * mul + add;
            ew::store8(x, c, v);
        },
        [&](size_t i) { x[i] = x[i] * mul + add; });
}
