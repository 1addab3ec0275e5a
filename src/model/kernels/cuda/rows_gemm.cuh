// Products of few rows, y = x w^T (+ b) in bf16 with f32 sums, for a
// decoding step's batch (a few hundred rows against thousands of weight
// rows): cuBLAS covers 256 rows with a few large tiles, each walking the
// whole of k, so a 410m layer's product takes about 10 us where its weights
// take 1 to 2 at the bandwidth. Here a block takes 128 rows by 64 outputs
// over one slice of k, with as many slices as fill the GPU. A block whose
// tile has other slices writes its f32 sums to a workspace and counts itself
// in (an atomic count per tile); the block that counts last adds the
// slices' sums in slice order, then the bias, and writes the output: the
// same bits whichever block comes last. x may enter as its activation (the
// MLP's down projection of its wide input): each thread activates the
// pieces of x it copied, as the activation kernel would. Operands reach
// shared memory by cp.async, three stages deep, and the tensor cores by
// ldmatrix and mma.sync (flash.cuh's primitives, hence its namespace). x
// and w rows lie on 16 bytes (k a multiple of 8).

#pragma once

struct RowsGemmDims {
    int m, n, k;  // x (m, k), w (n, k) row-major, y (m, n)
    int splits;   // slices of k, gridDim.z
    int act;      // the activation of x (elementwise.cuh's `activate`), -1 for none
};

namespace fa {
namespace rows {

constexpr int BM = 128, BN = 64, BK = 32, STAGES = 3, THREADS = 256;
// Warps as 4 (rows) x 2 (outputs), each 32 x 32: 2 x 4 fragments of 16 x 8.
constexpr int WARPS_M = 4;
constexpr int LD = ld_bf(BK);
constexpr int A_ELEMS = BM * LD, B_ELEMS = BN * LD;
constexpr size_t SMEM = (size_t)STAGES * (A_ELEMS + B_ELEMS) * sizeof(bf16);

// Calls f(r, p, col) for each 16-byte piece this thread moves of chunk `c`
// of k for ROWS rows: the piece's row r, its place p in the stage's row and
// its column col in k. The copy and the activation walk the same pieces, so
// a thread activates only what it copied itself.
template <int ROWS, typename F>
__device__ __forceinline__ void for_pieces(int c, F f) {
    constexpr int PIECES = BK / 8;
    for (int i = threadIdx.x; i < ROWS * PIECES; i += THREADS) f(i / PIECES, i % PIECES * 8, c * BK + i % PIECES * 8);
}

// Chunk `c` of k (BK wide) of the tile's rows of x and of w into a stage,
// 16 bytes a copy, zeros past the matrices' edges.
__device__ __forceinline__ void load_chunk(bf16* a, bf16* b, const bf16* x, const bf16* w, int m0, int n0, int c,
                                           const RowsGemmDims& d) {
    for_pieces<BM>(c, [&](int r, int p, int col) {
        const bool ok = m0 + r < d.m && col < d.k;
        copy16_async(a + r * LD + p, ok ? x + (size_t)(m0 + r) * d.k + col : x, ok);
    });
    for_pieces<BN>(c, [&](int r, int p, int col) {
        const bool ok = n0 + r < d.n && col < d.k;
        copy16_async(b + r * LD + p, ok ? w + (size_t)(n0 + r) * d.k + col : w, ok);
    });
}

// The pieces of x this thread copied into a stage, each element its
// activation as the activation kernel writes it (bf16 of the f32 value):
// the product of the MLP's wide input without a pass over it first.
__device__ __forceinline__ void activate_chunk(bf16* a, int m0, int c, const RowsGemmDims& d) {
    for_pieces<BM>(c, [&](int r, int p, int col) {
        if (m0 + r >= d.m || col >= d.k) return;
        bf16* e = a + r * LD + p;
        for (int j = 0; j < 8; ++j) e[j] = __float2bfloat16(activate(__bfloat162float(e[j]), d.act));
    });
}

// The warp's 32 x 32 sums over one stage, where any of its rows is in x.
__device__ __forceinline__ void multiply_stage(float (&acc)[2][4][4], const bf16* a, const bf16* b, int wm, int wn,
                                               int lane) {
    for (int kk = 0; kk < BK; kk += 16) {
        uint32_t af[2][4], bf[4][2];
        for (int mi = 0; mi < 2; ++mi) ldsm_x4(af[mi], a + (wm * 32 + mi * 16 + lane % 16) * LD + kk + lane / 16 * 8);
        for (int nj = 0; nj < 2; ++nj) {
            uint32_t r[4];
            // Matrices (outputs 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15).
            ldsm_x4(r, b + (wn * 32 + nj * 16 + lane / 16 * 8 + lane % 8) * LD + kk + lane / 8 % 2 * 8);
            bf[2 * nj][0] = r[0], bf[2 * nj][1] = r[1], bf[2 * nj + 1][0] = r[2], bf[2 * nj + 1][1] = r[3];
        }
        for (int mi = 0; mi < 2; ++mi)
            for (int ni = 0; ni < 4; ++ni) mma(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
    }
}

}  // namespace rows

// One block: the tile (blockIdx.x, blockIdx.y) of y (rows first, so that
// the blocks that read the same weights run together) over slice
// blockIdx.z of k. Where d.splits > 1, `ws` holds splits x m x n f32 sums
// and `counts` a zeroed count per tile; neither is read otherwise.
__device__ __forceinline__ void rows_gemm(const bf16* x, const bf16* w, const bf16* b, bf16* y, float* ws,
                                          unsigned* counts, RowsGemmDims d) {
    using namespace rows;
    expect_launch(SMEM, THREADS);
    extern __shared__ __align__(128) unsigned char smem[];
    bf16* a_st = reinterpret_cast<bf16*>(smem);
    bf16* b_st = a_st + STAGES * A_ELEMS;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN, s = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wm = warp % WARPS_M, wn = warp / WARPS_M;
    const int chunks = (d.k + BK - 1) / BK;
    const int c0 = (int)((long long)chunks * s / d.splits), count = (int)((long long)chunks * (s + 1) / d.splits) - c0;
    const bool rows_here = m0 + wm * 32 < d.m;

    float acc[2][4][4] = {};
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < count) load_chunk(a_st + i * A_ELEMS, b_st + i * B_ELEMS, x, w, m0, n0, c0 + i, d);
        commit_async();
    }
    for (int i = 0; i < count; ++i) {
        wait_async_but_newest();  // this thread's copies of chunk i have landed (STAGES - 1 == 2 groups ahead)
        if (d.act >= 0) activate_chunk(a_st + i % STAGES * A_ELEMS, m0, c0 + i, d);
        __syncthreads();  // every thread's, and chunk i - 1's stage is free
        const int next = i + STAGES - 1;
        if (next < count) load_chunk(a_st + next % STAGES * A_ELEMS, b_st + next % STAGES * B_ELEMS, x, w, m0, n0,
                                     c0 + next, d);
        commit_async();
        if (rows_here) multiply_stage(acc, a_st + i % STAGES * A_ELEMS, b_st + i % STAGES * B_ELEMS, wm, wn, lane);
    }
    wait_async_all();

    // acc[mi][ni][e] is row wm 32 + mi 16 + lane / 4 (+ 8 for e >= 2), output wn 32 + ni 8 + 2 (lane % 4) + e % 2.
    const int row0 = m0 + wm * 32 + lane / 4, col0 = n0 + wn * 32 + 2 * (lane % 4);
    auto each_sum = [&](auto f) {
        for (int mi = 0; mi < 2; ++mi)
            for (int ni = 0; ni < 4; ++ni)
                for (int e = 0; e < 4; ++e) {
                    const int row = row0 + mi * 16 + e / 2 * 8, col = col0 + ni * 8 + e % 2;
                    if (row < d.m && col < d.n) f(row, col, acc[mi][ni][e]);
                }
    };
    // An output from its sum over all of k.
    auto write = [&](int row, int col, float sum) {
        y[(size_t)row * d.n + col] = __float2bfloat16(sum + (b ? to_f32(b[col]) : 0.f));
    };
    if (d.splits == 1) {
        each_sum(write);
        return;
    }
    const size_t slice = (size_t)d.m * d.n;
    each_sum([&](int row, int col, float sum) { ws[((size_t)s * d.m + row) * d.n + col] = sum; });
    // Every thread's sums reach memory before the block counts itself in;
    // the last block reads them only after its count.
    __threadfence();
    __syncthreads();
    const unsigned tile = blockIdx.y * gridDim.x + blockIdx.x;
    int last = 0;
    if (threadIdx.x == 0) last = atomicAdd(counts + tile, 1u) == (unsigned)d.splits - 1;
    if (!__syncthreads_or(last)) return;
    __threadfence();
    for (int e = threadIdx.x; e < BM * BN; e += THREADS) {
        const int row = m0 + e / BN, col = n0 + e % BN;
        if (row >= d.m || col >= d.n) continue;
        const float* at = ws + (size_t)row * d.n + col;
        float sum = __ldcg(at);
        for (int q = 1; q < d.splits; ++q) sum += __ldcg(at + q * slice);
        write(row, col, sum);
    }
}

}  // namespace fa
