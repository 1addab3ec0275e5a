// Sampling by an exponential race (generate/race.rs states the rule and
// holds its CPU reference): one block per row of logits (R, V), f32 or
// bf16 (a bf16 run's head writes bf16; read as it is, each entry is its f32
// cast, so the picks are those of the cast to the bit, at half the bytes
// and without the cast's pass). `params` (R, 9) words as
// `RaceRow::to_words`; `seen` (R, width) bits, read only for rows whose
// penalty is not 1; out (R, 3): token, log-prob bits, entropy bits.
//
// Two passes over a row where nothing truncates it (temperature alone, and
// greedy): the maximum, then the sums of the log-prob and the entropy
// together with the race. A thread takes the row's entries 4 at a time, the
// group one Philox counter draws for, in one load (16 bytes of f32, 8 of
// bf16) where the row lies on that many bytes, and issues the loads of
// RACE_AHEAD groups together: 32 KB of f32 loads in flight per block of
// 1,024 threads, where three passes of a 4-byte load a thread took about
// 0.17 ms of a 256-row decoding step over Pythia's 50,304 words (H200).
// Top-k and top-p add their thresholds' search between the two passes.
// Included by kernels.cu and by the host emulator (emulate.cpp), which
// define to_f32 and the CUDA intrinsics it uses first.

#pragma once

struct RaceParams {
    uint32_t key0, key1, step, greedy;
    float inv_t;
    uint32_t top_k;
    float top_p, min_p, penalty;
};

// Philox4x32-10 in place on the counter.
__device__ __forceinline__ void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const uint32_t lo0 = 0xD2511F53u * c[0], hi0 = __umulhi(0xD2511F53u, c[0]);
        const uint32_t lo1 = 0xCD9E8D57u * c[2], hi1 = __umulhi(0xCD9E8D57u, c[2]);
        const uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = lo1;
        c[2] = n2;
        c[3] = lo0;
    }
}

// Above every -ln E (E >= 2^-33): entries this far below the best score
// cannot win.
#define MAX_GUMBEL 23.f

__device__ __forceinline__ float race_exponential(uint32_t word) {
    const float v = (__uint2float_rn(word) + 0.5f) * (1.f / 4294967296.f);
    return -log1pf(-v);
}

__device__ __forceinline__ uint32_t ordered_bits(float u) {
    const uint32_t b = __float_as_uint(u);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ bool race_beats(float s, int j, float best, int at) {
    return s > best || (s == best && j < at);
}

// Entries at .. at + 3 (on 4 entries' bytes) in one load.
__device__ __forceinline__ void race_load4(const float* at, float (&l)[4]) {
    const uint4 w = *reinterpret_cast<const uint4*>(at);
    l[0] = __uint_as_float(w.x), l[1] = __uint_as_float(w.y);
    l[2] = __uint_as_float(w.z), l[3] = __uint_as_float(w.w);
}
__device__ __forceinline__ void race_load4(const bf16* at, float (&l)[4]) {
    const uint2 w = *reinterpret_cast<const uint2*>(at);
    l[0] = __uint_as_float(w.x << 16), l[1] = __uint_as_float(w.x & 0xffff0000u);
    l[2] = __uint_as_float(w.y << 16), l[3] = __uint_as_float(w.y & 0xffff0000u);
}

// A row's penalised logits, read a group of 4 entries at a time.
template <typename T>
struct RaceLogits {
    const T* z;
    const uint32_t* bits;  // null: no penalty
    float penalty;
    int v;
    bool wide;  // the row starts on 4 entries' bytes

    __device__ __forceinline__ float penalised(int j, float l) const {
        if (bits && ((bits[j >> 5] >> (j & 31)) & 1u)) l = l < 0.f ? l * penalty : l / penalty;
        return l;
    }
    __device__ __forceinline__ float operator()(int j) const { return penalised(j, to_f32(z[j])); }

    // Entries 4 g .. 4 g + 3 below v into `l` (0 past v); how many there
    // are. Every index is a constant, so that `l` stays in registers.
    __device__ __forceinline__ int group(int g, float (&l)[4]) const {
        const int first = 4 * g, n = min(4, v - first);
        if (wide && n == 4) {
            race_load4(z + first, l);
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) l[i] = i < n ? to_f32(z[first + i]) : 0.f;
        }
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (i < n) l[i] = penalised(first + i, l[i]);
        return n;
    }
    __device__ __forceinline__ int groups() const { return (v + 3) / 4; }
};

// The block's best (score, index), ties to the lower index; every thread
// gets it. Scratch: 32 floats and 32 ints.
__device__ int block_argmax(float s, int j, float* fs, int* is) {
    for (int o = 16; o > 0; o >>= 1) {
        const float s2 = __shfl_xor_sync(0xffffffff, s, o);
        const int j2 = __shfl_xor_sync(0xffffffff, j, o);
        if (race_beats(s2, j2, s, j)) s = s2, j = j2;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) fs[warp] = s, is[warp] = j;
    __syncthreads();
    const bool live = lane < (int)(blockDim.x >> 5);
    s = live ? fs[lane] : -INFINITY;
    j = live ? is[lane] : INT_MAX;
    for (int o = 16; o > 0; o >>= 1) {
        const float s2 = __shfl_xor_sync(0xffffffff, s, o);
        const int j2 = __shfl_xor_sync(0xffffffff, j, o);
        if (race_beats(s2, j2, s, j)) s = s2, j = j2;
    }
    return j;
}

// Groups whose loads a thread issues together: 2 fit the 64 registers a
// thread of a block of 1,024 has (sm_90: 63 and 64, where 4 spill).
constexpr int RACE_AHEAD = 2;

// Calls f(g, entries, n) for this thread's groups g = threadIdx.x,
// + blockDim.x, ..., in that order, the loads of A groups issued before the
// first of them is used: one group's load at a time kept a thread waiting
// out a memory round trip per group. The order, and so every sum, is the
// same whatever A.
template <int A, typename T, typename F>
__device__ __forceinline__ void race_groups(const RaceLogits<T>& l, F f) {
    const int step = blockDim.x, groups = l.groups();
    for (int g0 = threadIdx.x; g0 < groups; g0 += A * step) {
        float x[A][4];
        int n[A];
#pragma unroll
        for (int a = 0; a < A; a++) n[a] = g0 + a * step < groups ? l.group(g0 + a * step, x[a]) : 0;
#pragma unroll
        for (int a = 0; a < A; a++)
            if (n[a] > 0) f(g0 + a * step, x[a], n[a]);
    }
}

// How many entries (or how much mass e^u) have u's ordered bits >= tau.
template <int A, typename T>
__device__ float race_upper(const RaceLogits<T>& l, float m, float inv_t, uint32_t tau, bool mass, float* scratch) {
    float acc = 0.f;
    race_groups<A>(l, [&](int, const float(&z)[4], int n) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float u = (z[i] - m) * inv_t;
            if (i < n && ordered_bits(u) >= tau) acc += mass ? expf(u) : 1.f;
        }
    });
    return block_sum(acc, scratch);
}

// The largest tau >= floor whose upper count (or mass) reaches `target`,
// one bit at a time from the top (the count and mass fall as tau rises).
template <int A, typename T>
__device__ uint32_t race_search(const RaceLogits<T>& l, float m, float inv_t, uint32_t floor, bool mass, float target,
                                float* scratch) {
    uint32_t tau = 0;
    for (int bit = 31; bit >= 0; bit--) {
        const uint32_t cand = tau | (1u << bit);
        if (race_upper<A>(l, m, inv_t, max(cand, floor), mass, scratch) >= target) tau = cand;
    }
    return max(tau, floor);
}

// Row blockIdx.x's pick, launched with a multiple of 32 threads, A groups'
// loads in flight a thread.
template <int A, typename T>
__device__ void race_pick_row(const T* logits, const uint32_t* params, const uint32_t* seen, int width,
                              uint32_t* out, int v) {
    __shared__ float scratch[32];
    __shared__ int iscratch[32];
    const size_t r = blockIdx.x;
    const uint32_t* w = params + 9 * r;
    const RaceParams p = {w[0], w[1], w[2], w[3], __uint_as_float(w[4]), w[5], __uint_as_float(w[6]),
                          __uint_as_float(w[7]), __uint_as_float(w[8])};
    const T* z = logits + r * v;
    const RaceLogits<T> l = {z, p.penalty != 1.f ? seen + r * width : nullptr, p.penalty, v,
                             reinterpret_cast<size_t>(z) % (4 * sizeof(T)) == 0};

    float best = -INFINITY;
    int at = INT_MAX;
    race_groups<A>(l, [&](int g, const float(&x)[4], int n) {
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (i < n && race_beats(x[i], 4 * g + i, best, at)) best = x[i], at = 4 * g + i;
    });
    const int top = block_argmax(best, at, scratch, iscratch);
    const float m = l(top);

    uint32_t floor = 0;
    if (!p.greedy && p.top_k > 0 && p.top_k < (uint32_t)v) floor = race_search<A>(l, m, p.inv_t, 0, false, (float)p.top_k, scratch);
    if (!p.greedy && p.top_p < 1.f) {
        const float total = race_upper<A>(l, m, p.inv_t, floor, true, scratch);
        floor = race_search<A>(l, m, p.inv_t, floor, true, p.top_p * total, scratch);
    }

    // The sums over every entry, and the race over the kept ones.
    float s0 = 0.f, s1 = 0.f;
    best = -INFINITY;
    at = INT_MAX;
    race_groups<A>(l, [&](int g, const float(&x)[4], int n) {
        uint32_t c[4] = {(uint32_t)g, p.step, 0u, 0u};
        bool drawn = false;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (i >= n) break;
            const float u = (x[i] - m) * p.inv_t, e = expf(u);
            if (e > 0.f) s0 += e, s1 += u * e;
            if (p.greedy) continue;
            const bool kept = ordered_bits(u) >= floor && (p.min_p <= 0.f || e >= p.min_p);
            if (!kept || u + MAX_GUMBEL < best) continue;
            if (!drawn) philox4x32_10(c, p.key0, p.key1), drawn = true;
            const float s = u - logf(race_exponential(c[i]));
            if (race_beats(s, 4 * g + i, best, at)) best = s, at = 4 * g + i;
        }
    });
    s0 = block_sum(s0, scratch);
    s1 = block_sum(s1, scratch);
    int token = top;
    if (!p.greedy) {
        const int won = block_argmax(best, at, scratch, iscratch);
        if (won != INT_MAX) token = won;
    }
    if (threadIdx.x == 0) {
        const float log_s0 = logf(s0);
        out[3 * r] = (uint32_t)token;
        out[3 * r + 1] = __float_as_uint((l(token) - m) * p.inv_t - log_s0);
        out[3 * r + 2] = __float_as_uint(log_s0 - s1 / s0);
    }
}
