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

// Head row `row` of the heads (3 B H T rows of D features): where it starts
// in the projection, its table row and its part. Worked out once a row, in
// 32-bit arithmetic (3 B H T fits), not once an element in 64-bit, whose
// divisions are long sequences of instructions on a GPU.
struct At {
    size_t row, table;
    int part;
};

__device__ __forceinline__ At locate(int row, const HeadsDims& a) {
    const int ti = row % a.t;
    int rest = row / a.t;
    const int hh = rest % a.h;
    rest /= a.h;
    const int bi = rest % a.batch, part = rest / a.batch;
    const size_t token = (size_t)bi * a.t + ti;
    // Selected, not indexed: an indexed parameter array goes to local memory.
    const int64_t offset = part == 0 ? a.offset[0] : part == 1 ? a.offset[1] : a.offset[2];
    return {token * a.width + hh * a.head_stride + offset, token * a.r, part};
}

// The head rows this thread's warp takes (a warp a row, in turn), and its lane.
struct WarpRows {
    int first, step, lane;
};

__device__ __forceinline__ WarpRows warp_rows() {
    const size_t thread = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    return {(int)(thread / 32), (int)((size_t)gridDim.x * blockDim.x / 32), (int)(threadIdx.x % 32)};
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

// Eight features of T from (to) `p`, 16 bytes at a time: p on 16 bytes.
// The registers pass between the two types by memcpy, which the compiler
// may not reorder as it may a cast pointer's reads.
template <typename T>
__device__ __forceinline__ void load8(float (&out)[8], const T* p) {
    uint4 raw[sizeof(T) / 2];
    for (int c = 0; c < (int)sizeof(T) / 2; ++c) raw[c] = reinterpret_cast<const uint4*>(p)[c];
    T x[8];
    memcpy(x, raw, sizeof x);
    for (int i = 0; i < 8; ++i) out[i] = to_f32(x[i]);
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&in)[8]) {
    T x[8];
    for (int i = 0; i < 8; ++i) x[i] = from_f32<T>(in[i]);
    uint4 raw[sizeof(T) / 2];
    memcpy(raw, x, sizeof raw);
    for (int c = 0; c < (int)sizeof(T) / 2; ++c) reinterpret_cast<uint4*>(p)[c] = raw[c];
}

// Features e .. e + 7 of the head row `x` turned as `turn` turns each (e
// and r / 2 whole 8s, so the eight lie in one half).
template <typename T>
__device__ __forceinline__ void turn8(float (&y)[8], const T* x, int e, int r, const float* cos, const float* sin,
                                      float sign) {
    load8(y, x + e);
    if (e >= r) return;
    const int half = r / 2;
    float partner[8], c[8], s[8];
    load8(partner, x + (e < half ? e + half : e - half));
    load8(c, cos + e), load8(s, sin + e);
    for (int i = 0; i < 8; ++i) y[i] = rotated(y[i], partner[i], e + i, half, c[i], sign * s[i]);
}

}  // namespace heads

// fused (B, T, W) -> heads (3, B, H, T, D), n = 3 B H T D: a warp a head
// row, a lane a feature (and the features 32 on).
template <typename T>
__device__ void heads_split(const T* fused, const float* cos, const float* sin, T* heads_out, HeadsDims a,
                            size_t n) {
    const heads::WarpRows w = heads::warp_rows();
    for (int row = w.first; row < (int)(n / a.d); row += w.step) {
        const heads::At at = heads::locate(row, a);
        const int r = at.part < 2 ? a.r : 0;
        for (int e = w.lane; e < a.d; e += 32)
            heads_out[(size_t)row * a.d + e] =
                from_f32<T>(heads::turn(fused + at.row, e, r, cos + at.table, sin + at.table, 1.f));
    }
}

// The heads' gradients, d q (B, H, T, D) and d k, d v stacked (2, B, H, T,
// D), rotated back into the projection's gradient (B, T, W): each of its
// elements is written once (W = 3 H D and the parts tile the row).
template <typename T>
__device__ void heads_merge(const T* dq, const T* dkv, const float* cos, const float* sin, T* fused, HeadsDims a,
                            size_t n) {
    const int rows = (int)(n / a.d), part_rows = rows / 3;
    const heads::WarpRows w = heads::warp_rows();
    for (int row = w.first; row < rows; row += w.step) {
        const heads::At at = heads::locate(row, a);
        const T* g = at.part == 0 ? dq + (size_t)row * a.d : dkv + (size_t)(row - part_rows) * a.d;
        const int r = at.part < 2 ? a.r : 0;
        for (int e = w.lane; e < a.d; e += 32)
            fused[at.row + e] = from_f32<T>(heads::turn(g, e, r, cos + at.table, sin + at.table, -1.f));
    }
}

// heads_split and heads_merge eight features a thread, 16 bytes a load and
// a store, where D and R / 2 are whole 8s and every row of the projection,
// the heads and the tables starts on 16 bytes (the host checks): a lane a
// feature kept each warp to one row's few loads at a time, waiting out a
// memory round trip for each.
template <typename T>
__device__ void heads_split_wide(const T* fused, const float* cos, const float* sin, T* heads_out, HeadsDims a,
                                 size_t n) {
    const int per_row = a.d / 8;
    for (size_t c = blockIdx.x * (size_t)blockDim.x + threadIdx.x; c < n / 8; c += (size_t)gridDim.x * blockDim.x) {
        const int row = (int)(c / per_row), e = (int)(c % per_row) * 8;
        const heads::At at = heads::locate(row, a);
        float y[8];
        heads::turn8(y, fused + at.row, e, at.part < 2 ? a.r : 0, cos + at.table, sin + at.table, 1.f);
        heads::store8(heads_out + (size_t)row * a.d + e, y);
    }
}

template <typename T>
__device__ void heads_merge_wide(const T* dq, const T* dkv, const float* cos, const float* sin, T* fused,
                                 HeadsDims a, size_t n) {
    const int per_row = a.d / 8, part_rows = (int)(n / a.d) / 3;
    for (size_t c = blockIdx.x * (size_t)blockDim.x + threadIdx.x; c < n / 8; c += (size_t)gridDim.x * blockDim.x) {
        const int row = (int)(c / per_row), e = (int)(c % per_row) * 8;
        const heads::At at = heads::locate(row, a);
        const T* g = at.part == 0 ? dq + (size_t)row * a.d : dkv + (size_t)(row - part_rows) * a.d;
        float y[8];
        heads::turn8(y, g, e, at.part < 2 ? a.r : 0, cos + at.table, sin + at.table, -1.f);
        heads::store8(fused + at.row + e, y);
    }
}
