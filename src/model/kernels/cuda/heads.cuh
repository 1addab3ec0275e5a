// Attention's heads cut out of a fused q/k/v projection, and their gradients
// written back into one. Included by kernels.cu and by the host emulator
// (emulate.cpp), which checks the index logic against a reference; both
// define to_f32 and from_f32 first.
//
// The projection is (B, T, W), W = 3 H D: part p (q 0, k 1, v 2) of head h
// of token (b, t) starts at (b T + t) W + h head_stride + offset[p] (GPT-NeoX
// lays each head out as [q | k | v], GPT-2 the whole [Q | K | V]). The heads
// are (3, B, H, T, D) contiguous, q and k rotated over their first R features
// by the (B, T, R) f32 tables, in rotate-half layout (R = 0: no rotation).

// Feature j (< R) of a rotated head: `partner` is feature j + R/2 for the
// first half, j - R/2 for the second; c, s its table entries (s negated
// rotates back). Also the rotary kernels' in kernels.cu.
__device__ __forceinline__ float rotated(float x, float partner, int j, int half, float c, float s) {
    const float other = j < half ? -partner : partner;
    return x * c + other * s;
}

struct HeadsDims {
    int64_t width, head_stride, offset[3];
    int batch, h, t, d, r;
};

namespace heads {

// Element i of the heads: where its head's row of D features starts in the
// projection, its table row, its feature and its part.
struct At {
    size_t row, table;
    int e, part;
};

__device__ __forceinline__ At locate(size_t i, const HeadsDims& a) {
    const int e = (int)(i % a.d);
    size_t rest = i / a.d;
    const int ti = (int)(rest % a.t);
    rest /= a.t;
    const int hh = (int)(rest % a.h);
    rest /= a.h;
    const int bi = (int)(rest % a.batch), part = (int)(rest / a.batch);
    const size_t token = (size_t)bi * a.t + ti;
    // Selected, not indexed: an indexed parameter array goes to local memory.
    const int64_t offset = part == 0 ? a.offset[0] : part == 1 ? a.offset[1] : a.offset[2];
    return {token * a.width + hh * a.head_stride + offset, token * a.r, e, part};
}

// Feature e of the head row `x` rotated over its first r features (sign 1),
// or rotated back (sign -1: the rotation's transpose, its backward).
template <typename T>
__device__ __forceinline__ float turn(const T* x, int e, int r, const float* cos, const float* sin, float sign) {
    const float v = to_f32(x[e]);
    if (e >= r) return v;
    const int half = r / 2;
    return rotated(v, to_f32(e < half ? x[e + half] : x[e - half]), e, half, cos[e], sign * sin[e]);
}

}  // namespace heads

// fused (B, T, W) -> heads (3, B, H, T, D), n = 3 B H T D.
template <typename T>
__device__ void heads_split(const T* fused, const float* cos, const float* sin, T* heads_out, HeadsDims a,
                            size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const heads::At at = heads::locate(i, a);
        const int r = at.part < 2 ? a.r : 0;
        heads_out[i] = from_f32<T>(heads::turn(fused + at.row, at.e, r, cos + at.table, sin + at.table, 1.f));
    }
}

// The heads' gradients, d q (B, H, T, D) and d k, d v stacked (2, B, H, T,
// D), rotated back into the projection's gradient (B, T, W): each of its
// elements is written once (W = 3 H D and the parts tile the row).
template <typename T>
__device__ void heads_merge(const T* dq, const T* dkv, const float* cos, const float* sin, T* fused, HeadsDims a,
                            size_t n) {
    const size_t part_len = n / 3;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const heads::At at = heads::locate(i, a);
        const T* g = (at.part == 0 ? dq + i : dkv + (i - part_len)) - at.e;
        const int r = at.part < 2 ? a.r : 0;
        fused[at.row + at.e] = from_f32<T>(heads::turn(g, at.e, r, cos + at.table, sin + at.table, -1.f));
    }
}
