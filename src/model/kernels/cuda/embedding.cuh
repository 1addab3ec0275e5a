// The gradient of an embedding table (V, H) from its lookups' gradient
// (N, H) at token ids (N). Included by kernels.cu and by the host emulator
// (emulate.cpp); both define to_f32 and from_f32 first.
//
// Row v is the sum, in position order and in f32, of the lookups' gradients
// at the positions that read v; a row no position reads is zero. A block
// takes one row of the table and a slab of EMBEDDING_COLUMNS x blockDim
// columns; its threads read the ids a chunk of blockDim at a time and skip
// a chunk none of whose positions reads the row. No atomics: every sum is
// in one order whatever the schedule, where an index_add over the positions
// (one thread per column walking all N of them) leaves most of the GPU idle.

#define EMBEDDING_COLUMNS 4

template <typename T>
__device__ void embedding_grad(const T* grad, const uint32_t* ids, T* out, int n, int h) {
    const uint32_t row = blockIdx.x;
    const int first = blockIdx.y * blockDim.x * EMBEDDING_COLUMNS + threadIdx.x;
    float acc[EMBEDDING_COLUMNS];
    for (int c = 0; c < EMBEDDING_COLUMNS; c++) acc[c] = 0.f;
    for (int base = 0; base < n; base += blockDim.x) {
        const int j = base + threadIdx.x;
        if (!__syncthreads_or(j < n && ids[j] == row)) continue;
        const int end = min(n, base + (int)blockDim.x);
        for (int p = base; p < end; p++) {
            if (ids[p] != row) continue;
            const T* g = grad + (size_t)p * h;
            for (int c = 0; c < EMBEDDING_COLUMNS; c++) {
                const int col = first + c * blockDim.x;
                if (col < h) acc[c] += to_f32(g[col]);
            }
        }
    }
    for (int c = 0; c < EMBEDDING_COLUMNS; c++) {
        const int col = first + c * blockDim.x;
        if (col < h) out[(size_t)row * h + col] = from_f32<T>(acc[c]);
    }
}
