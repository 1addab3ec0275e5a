// Attention's heads cut out of a fused q/k/v projection, and their gradients
// written back into one; a decoding step's heads rotated and appended to its
// cache. Included by kernels.cu and by the host emulator
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

// A decoding step's rotary and cache append in one launch. q, k, v: one
// token per row, (B, 1, heads, D) views with their own (row, head) strides
// and unit feature stride (cut from the fused projection, not copied); cos,
// sin: (B, R) f32, R <= D (R = 0: no rotation). q is written rotated to
// q_out (B, H, 1, D); k rotated, and v as it is, to slot `slot` of the
// cache's (B, Hkv, capacity, D) buffers, in place, or to slot *slot_at when
// slot_at is given (a step replayed from a CUDA graph reads it there). One
// block per head of q then of k (blockIdx.x) and row (blockIdx.y), a thread
// per feature.

struct AppendDims {
    int64_t q_row, q_head, k_row, k_head, v_row, v_head;
    int h, h_kv, d, r, capacity, slot;
};

template <typename T>
__device__ void rotary_append(const T* q, const T* k, const T* v, const float* cos, const float* sin, T* q_out,
                              T* k_cache, T* v_cache, const uint32_t* slot_at, AppendDims a) {
    const int b = blockIdx.y, head = blockIdx.x;
    const bool is_q = head < a.h;
    const int hh = is_q ? head : head - a.h;
    const T* x = is_q ? q + b * a.q_row + hh * a.q_head : k + b * a.k_row + hh * a.k_head;
    const size_t slot = ((size_t)b * a.h_kv + hh) * a.capacity + (slot_at ? *slot_at : a.slot);
    T* y = is_q ? q_out + ((size_t)b * a.h + hh) * a.d : k_cache + slot * a.d;
    const int half = a.r / 2;
    for (int j = threadIdx.x; j < a.d; j += blockDim.x) {
        if (j < a.r) {
            const float partner = to_f32(j < half ? x[j + half] : x[j - half]);
            y[j] = from_f32<T>(rotated(to_f32(x[j]), partner, j, half, cos[b * a.r + j], sin[b * a.r + j]));
        } else {
            y[j] = x[j];
        }
        if (!is_q) v_cache[slot * a.d + j] = v[b * a.v_row + hh * a.v_head + j];
    }
}

// rotary_append eight features a thread, 16 bytes a load and a store, where
// D and R / 2 are whole 8s and every head row of q, k and v, the tables,
// q_out and the cache's buffers lie on 16 bytes (the host checks): a thread
// a chunk of 8 features of a row's head of q, then of k (and v), over the
// whole grid. A block a head and a thread a feature loaded 2 bytes at a
// time in 8,192 blocks of 64 threads at 256 rows of Pythia-410m. The same
// values as rotary_append's, feature by feature.
template <typename T>
__device__ void rotary_append_wide(const T* q, const T* k, const T* v, const float* cos, const float* sin, T* q_out,
                                   T* k_cache, T* v_cache, const uint32_t* slot_at, AppendDims a, int rows) {
    const int per_head = a.d / 8, heads_per_row = a.h + a.h_kv;
    const size_t n = (size_t)rows * heads_per_row * per_head;
    for (size_t c = blockIdx.x * (size_t)blockDim.x + threadIdx.x; c < n; c += (size_t)gridDim.x * blockDim.x) {
        const int e = (int)(c % per_head) * 8, head = (int)(c / per_head % heads_per_row);
        const int b = (int)(c / per_head / heads_per_row);
        const bool is_q = head < a.h;
        const int hh = is_q ? head : head - a.h;
        const T* x = is_q ? q + b * a.q_row + hh * a.q_head : k + b * a.k_row + hh * a.k_head;
        const size_t slot = ((size_t)b * a.h_kv + hh) * a.capacity + (slot_at ? *slot_at : a.slot);
        T* y = is_q ? q_out + ((size_t)b * a.h + hh) * a.d : k_cache + slot * a.d;
        float out[8];
        heads::turn8(out, x, e, a.r, cos + (size_t)b * a.r, sin + (size_t)b * a.r, 1.f);
        heads::store8(y + e, out);
        if (is_q) continue;
        // v's bits as they are, 16 bytes at a time.
        const uint4* from = reinterpret_cast<const uint4*>(v + b * a.v_row + hh * a.v_head + e);
        uint4* to = reinterpret_cast<uint4*>(v_cache + slot * a.d + e);
        for (int i = 0; i < (int)sizeof(T) / 2; ++i) to[i] = from[i];
    }
}
