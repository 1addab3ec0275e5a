// The gradient norm's sums of squares (sum_squares_multi in kernels.cu):
// each thread sums in f64 the squares of its elements, a grid's stride
// apart, in order. Its loads go 4 strides at a time, all issued before the
// first is summed: one 4-byte load a thread at a time kept too few bytes in
// flight (410m's 1.6 GB of gradients took 1.76 ms, about a fifth of the
// bandwidth). The additions are the same, in the same order. Included by
// kernels.cu and by the host emulator (emulate.cpp).

#pragma once

__device__ __forceinline__ double squares_of_stride(const float* x, size_t n, size_t first, size_t stride) {
    double acc = 0.0;
    size_t i = first;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const double v0 = x[i], v1 = x[i + stride], v2 = x[i + 2 * stride], v3 = x[i + 3 * stride];
        acc += v0 * v0;
        acc += v1 * v1;
        acc += v2 * v2;
        acc += v3 * v3;
    }
    for (; i < n; i += stride) {
        const double v = x[i];
        acc += v * v;
    }
    return acc;
}
