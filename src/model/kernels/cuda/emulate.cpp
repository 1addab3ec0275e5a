// Runs the register-resident attention kernels of flash.cuh, the heads
// kernels of heads.cuh, the norms of norms.cuh, the elementwise kernels of
// elementwise.cuh, the decoding-attention kernels of decode.cuh, the LM
// head's log-prob kernels of logprobs.cuh, the non-finite check of
// finite.cuh, the race sampler of race.cuh, the product of few rows of
// rows_gemm.cuh and AdamW over split masters of adamw.cuh on the host and
// compares them with a reference, so their fragment and index logic is
// checked where no GPU is: every CUDA thread
// is a host thread, the warp-level primitives (ldmatrix, mma.sync,
// shuffles) exchange lane values through per-warp slots between barriers,
// as the PTX ISA lays the fragments out, and blocks run one after another.
// Built and run by scripts/cuda/emulate.sh, also under ThreadSanitizer
// (`races`); exits non-zero on a mismatch.

#include <algorithm>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

// ---- The CUDA surface the kernels use.

#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __align__(n)  // the host buffer below is aligned

struct bf16 {
    uint16_t bits;
};

inline float __bfloat162float(bf16 x) {
    const uint32_t u = uint32_t(x.bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Round to nearest even, as the device's conversion.
inline bf16 __float2bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (std::isnan(f)) return {0x7fc0};
    u += 0x7fff + ((u >> 16) & 1);
    return {uint16_t(u >> 16)};
}

struct uint2 {
    uint32_t x, y;
};
struct uint4 {
    uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }

struct Dim3 {
    unsigned x = 0, y = 0, z = 0;
};
thread_local Dim3 threadIdx, blockIdx;
Dim3 blockDim, gridDim;
size_t launched_smem = 0;
namespace fa {
// The kernels' `extern __shared__` buffer, for the block that runs.
alignas(128) unsigned char smem[256 * 1024];
}  // namespace fa

// A barrier for `n` threads that also ORs a value over them.
struct Barrier {
    std::mutex mu;
    std::condition_variable cv;
    int n = 0, count = 0, acc = 0, result = 0;
    long gen = 0;

    int arrive(int v) {
        std::unique_lock<std::mutex> lock(mu);
        acc |= v;
        if (++count == n) {
            result = acc, acc = 0, count = 0, ++gen;
            cv.notify_all();
            return result;
        }
        const long g = gen;
        cv.wait(lock, [&] { return gen != g; });
        return result;
    }
};

struct Warp {
    Barrier bar;
    const void* ptr[32];
    float f[32];
    uint32_t a[32][4], b[32][2];
};

Barrier block_bar;
std::vector<Warp> warps;

inline int __syncthreads_or(int v) { return block_bar.arrive(v != 0); }
inline void __syncthreads() { block_bar.arrive(0); }

namespace fa {

inline Warp& my_warp() { return warps[threadIdx.x / 32]; }
inline int my_lane() { return threadIdx.x % 32; }
inline uint16_t bits_at(const void* row, int e) { return static_cast<const bf16*>(row)[e].bits; }

void ldsm_x4(uint32_t (&r)[4], const bf16* p) {
    Warp& w = my_warp();
    const int lane = my_lane();
    w.ptr[lane] = p;
    w.bar.arrive(0);
    for (int i = 0; i < 4; ++i) {
        const void* row = w.ptr[i * 8 + lane / 4];
        r[i] = bits_at(row, 2 * (lane % 4)) | uint32_t(bits_at(row, 2 * (lane % 4) + 1)) << 16;
    }
    w.bar.arrive(0);
}

void ldsm_x4_t(uint32_t (&r)[4], const bf16* p) {
    Warp& w = my_warp();
    const int lane = my_lane();
    w.ptr[lane] = p;
    w.bar.arrive(0);
    for (int i = 0; i < 4; ++i) {
        const uint16_t lo = bits_at(w.ptr[i * 8 + 2 * (lane % 4)], lane / 4);
        const uint16_t hi = bits_at(w.ptr[i * 8 + 2 * (lane % 4) + 1], lane / 4);
        r[i] = lo | uint32_t(hi) << 16;
    }
    w.bar.arrive(0);
}

inline float half_of(uint32_t reg, int half) {
    return __bfloat162float(bf16{uint16_t(half ? reg >> 16 : reg & 0xffff)});
}

// m16n8k16: A (row, k) sits in lane (row % 8) * 4 + (k % 8) / 2, register
// (row >= 8) + 2 (k >= 8), half k % 2; B (k, n) in lane n * 4 + (k % 8) / 2,
// register k >= 8, half k % 2; C (row, n) in lane (row % 8) * 4 + (n / 2),
// element 2 (row >= 8) + n % 2.
void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    Warp& w = my_warp();
    const int lane = my_lane();
    std::memcpy(w.a[lane], a, sizeof a);
    w.b[lane][0] = b0, w.b[lane][1] = b1;
    w.bar.arrive(0);
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const int row = lane / 4 + (i >> 1) * 8, col = (lane % 4) * 2 + (i & 1);
        float acc = c[i];
        for (int k = 0; k < 16; ++k) {
            const float x = half_of(w.a[(row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k % 2);
            const float y = half_of(w.b[col * 4 + (k % 8) / 2][k >= 8], k % 2);
            acc += x * y;
        }
        out[i] = acc;
    }
    w.bar.arrive(0);
    std::memcpy(c, out, sizeof out);
}

float shfl_xor(float x, int mask) {
    Warp& w = my_warp();
    const int lane = my_lane();
    w.f[lane] = x;
    w.bar.arrive(0);
    const float y = w.f[lane ^ mask];
    w.bar.arrive(0);
    return y;
}

inline uint32_t pack(float lo, float hi) { return __float2bfloat16(lo).bits | uint32_t(__float2bfloat16(hi).bits) << 16; }

inline void store_pair(bf16* at, float lo, float hi) { at[0] = __float2bfloat16(lo), at[1] = __float2bfloat16(hi); }

// cp.async: a thread's copies wait, in the groups it commits, until it
// waits for them, so that a kernel reading a buffer before its wait reads
// stale bytes, and one whose copy lands while another thread still reads
// the buffer races (ThreadSanitizer sees it).
struct AsyncCopy {
    void* dst;
    const void* src;
    int bytes;
    bool valid;
};
thread_local std::vector<AsyncCopy> open_group;
thread_local std::vector<std::vector<AsyncCopy>> committed;

inline void copy16_async(void* dst, const void* src, bool valid) { open_group.push_back({dst, src, 16, valid}); }
inline void copy4_async(void* dst, const void* src, bool valid) { open_group.push_back({dst, src, 4, valid}); }
inline void commit_async() { committed.push_back(std::move(open_group)), open_group.clear(); }

inline void wait_async_leaving(size_t newest) {
    while (committed.size() > newest) {
        for (const AsyncCopy& c : committed.front())
            c.valid ? (void)std::memcpy(c.dst, c.src, c.bytes) : (void)std::memset(c.dst, 0, c.bytes);
        committed.erase(committed.begin());
    }
}
inline void wait_async_but_newest() { wait_async_leaving(1); }
inline void wait_async_all() { wait_async_leaving(0); }
inline bool copies_pending() { return !open_group.empty() || !committed.empty(); }

// Lane l's x in bit l, for every lane.
inline uint32_t ballot(bool x) {
    Warp& w = my_warp();
    w.f[my_lane()] = x ? 1.f : 0.f;
    w.bar.arrive(0);
    uint32_t word = 0;
    for (int l = 0; l < 32; ++l) word |= uint32_t(w.f[l] != 0.f) << l;
    w.bar.arrive(0);
    return word;
}

inline bool warp_any(bool x) { return ballot(x) != 0; }

inline void expect_launch(size_t bytes, int threads) {
    if (launched_smem < bytes || blockDim.x != (unsigned)threads) {
        std::fprintf(stderr, "launched with %zu bytes and %u threads; the kernel wants %zu and %d\n", launched_smem,
                     blockDim.x, bytes, threads);
        std::abort();
    }
}

}  // namespace fa

#include "flash.cuh"

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return __bfloat162float(x); }
template <typename T> T from_f32(float x);
template <> float from_f32<float>(float x) { return x; }
template <> bf16 from_f32<bf16>(float x) { return __float2bfloat16(x); }

#include "heads.cuh"
#include "elementwise.cuh"

inline float __shfl_xor_sync(unsigned, float x, int mask) { return fa::shfl_xor(x, mask); }
inline float __shfl_sync(unsigned, float x, int from) {
    Warp& w = fa::my_warp();
    w.f[fa::my_lane()] = x;
    w.bar.arrive(0);
    const float y = w.f[from];
    w.bar.arrive(0);
    return y;
}
using std::min;
inline float __uint_as_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

#include "embedding.cuh"

inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
#include "norms.cuh"

// A block's __shared__ arrays: one per kernel, shared by its threads (blocks run one at a time).
#undef __shared__
#define __shared__ static
#include "decode.cuh"
#include "reduce.cuh"
#include "logprobs.cuh"
using std::isfinite;
#include "finite.cuh"
#include "squares.cuh"
inline int __shfl_xor_sync(unsigned, int x, int mask) {
    float f, y;
    std::memcpy(&f, &x, 4);
    y = fa::shfl_xor(f, mask);
    std::memcpy(&x, &y, 4);
    return x;
}
inline uint32_t __umulhi(uint32_t a, uint32_t b) { return uint32_t((uint64_t)a * b >> 32); }
inline float __uint2float_rn(uint32_t u) { return (float)u; }
inline uint32_t __float_as_uint(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
using std::max;
#include "race.cuh"
#undef __shared__
#define __shared__
// Blocks run one at a time: a fence orders nothing more, and an atomic is a plain update.
inline void __threadfence() {}
inline unsigned atomicAdd(unsigned* at, unsigned v) {
    const unsigned old = *at;
    *at += v;
    return old;
}
inline float __ldcg(const float* at) { return *at; }
#include "rows_gemm.cuh"
inline unsigned short __bfloat16_as_ushort(bf16 x) { return x.bits; }
inline unsigned __ballot_sync(unsigned, bool x) { return fa::ballot(x); }
#include "adamw.cuh"

// ---- Launching: blocks in turn, each a host thread per CUDA thread.

// `backwards`: the blocks in the other order, for a kernel whose result
// must not depend on which block comes last.
void launch(Dim3 grid, size_t smem_bytes, const std::function<void()>& kernel, unsigned threads = 32 * fa::WARPS,
            bool backwards = false) {
    if (smem_bytes > sizeof fa::smem) std::abort();
    gridDim = grid, blockDim = {threads, 1, 1}, launched_smem = smem_bytes;
    warps = std::vector<Warp>(threads / 32);
    for (Warp& w : warps) w.bar.n = 32;
    block_bar.n = blockDim.x;
    const unsigned blocks = grid.x * grid.y * grid.z;
    for (unsigned i = 0; i < blocks; ++i) {
        const unsigned at = backwards ? blocks - 1 - i : i;
        const unsigned x = at % grid.x, y = at / grid.x % grid.y, z = at / grid.x / grid.y;
        // Stale shared memory must not matter, and none past the launch's may be written.
        std::memset(fa::smem, 0xcd, sizeof fa::smem);
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < blockDim.x; ++t)
            threads.emplace_back([&, t] {
                threadIdx = {t, 0, 0};
                blockIdx = {x, y, z};
                kernel();
                if (fa::copies_pending()) {
                    std::fprintf(stderr, "a thread ended with background copies it never waited for\n");
                    std::abort();
                }
            });
        for (auto& th : threads) th.join();
        for (size_t b = smem_bytes; b < sizeof fa::smem; ++b)
            if (fa::smem[b] != 0xcd) {
                std::fprintf(stderr, "shared memory written at byte %zu, past the %zu launched\n", b, smem_bytes);
                std::abort();
            }
    }
}

// ---- The reference, in f64 over the bf16 inputs.

struct Case {
    const char* name;
    int b, h, h_kv, t, s, d, capacity;  // capacity: key slots per head (>= s)
    enum Mask { CAUSAL, SHARED_PREFIX } mask;
};

struct Problem {
    Case c;
    AttnDims a;
    std::vector<bf16> q, k, v, dout;
    std::vector<float> bias;
};

bf16 random_bf16(std::mt19937& rng) { return __float2bfloat16(std::normal_distribution<float>(0.f, 1.f)(rng)); }

Problem make(const Case& c, std::mt19937& rng) {
    const AttnDims a{c.h, c.h_kv, c.t, c.s, c.d, (long long)c.capacity * c.d, 1.f / std::sqrt(float(c.d)),
                     c.d, (long long)c.t * c.d};
    Problem p{c, a, {}, {}, {}, {}, {}};
    for (auto* x : {&p.q, &p.dout}) {
        x->resize((size_t)c.b * c.h * c.t * c.d);
        for (auto& e : *x) e = random_bf16(rng);
    }
    for (auto* x : {&p.k, &p.v}) {
        x->resize((size_t)c.b * c.h_kv * c.capacity * c.d);
        for (auto& e : *x) e = random_bf16(rng);
    }
    p.bias.assign((size_t)c.b * c.t * c.s, -1e30f);
    for (int bi = 0; bi < c.b; ++bi) {
        const int pad = bi == 0 ? 0 : 5 + bi;  // left padding of keys in later rows
        for (int i = 0; i < c.t; ++i)
            for (int j = 0; j < c.s; ++j) {
                bool see;
                if (c.mask == Case::CAUSAL) {
                    see = j >= pad && j <= c.s - c.t + i;
                } else {
                    // A prompt of 24 slots, then completions of 19 each: a query sees
                    // the prompt and the earlier slots of its own completion.
                    auto seg = [](int x) { return x < 24 ? 0 : 1 + (x - 24) / 19; };
                    see = j <= i && (seg(j) == 0 || seg(j) == seg(i));
                }
                // The last query of the last row sees nothing.
                if (bi == c.b - 1 && i == c.t - 1) see = false;
                if (see) p.bias[((size_t)bi * c.t + i) * c.s + j] = 0.01f * float((i * 7 + j * 3) % 11 - 5);
            }
    }
    return p;
}

struct Grads {
    std::vector<double> o, lse, dq, dk, dv;
};

Grads reference(const Problem& p) {
    const Case& c = p.c;
    auto f = [](bf16 x) { return (double)__bfloat162float(x); };
    Grads g;
    g.o.assign(p.q.size(), 0), g.lse.assign((size_t)c.b * c.h * c.t, 0), g.dq.assign(p.q.size(), 0);
    g.dk.assign((size_t)c.b * c.h_kv * c.s * c.d, 0), g.dv.assign(g.dk.size(), 0);
    std::vector<double> pr(c.s);
    for (int bi = 0; bi < c.b; ++bi)
        for (int hi = 0; hi < c.h; ++hi) {
            const int hk = hi / (c.h / c.h_kv);
            const size_t qh = ((size_t)bi * c.h + hi) * c.t, kh = ((size_t)bi * c.h_kv + hk) * c.capacity;
            const size_t gh = ((size_t)bi * c.h_kv + hk) * c.s;
            for (int i = 0; i < c.t; ++i) {
                double top = -INFINITY;
                for (int j = 0; j < c.s; ++j) {
                    const float bv = p.bias[((size_t)bi * c.t + i) * c.s + j];
                    if (bv < -1e29f) {
                        pr[j] = -INFINITY;
                        continue;
                    }
                    double dot = 0;
                    for (int e = 0; e < c.d; ++e) dot += f(p.q[(qh + i) * c.d + e]) * f(p.k[(kh + j) * c.d + e]);
                    pr[j] = dot * p.a.scale + bv;
                    top = std::max(top, pr[j]);
                }
                double sum = 0;
                for (int j = 0; j < c.s; ++j) sum += pr[j] == -INFINITY ? 0 : std::exp(pr[j] - top);
                g.lse[qh + i] = sum > 0 ? top + std::log(sum) : 0;
                for (int j = 0; j < c.s; ++j) pr[j] = pr[j] == -INFINITY ? 0 : std::exp(pr[j] - top) / sum;
                double di = 0;
                for (int e = 0; e < c.d; ++e) {
                    double o = 0;
                    for (int j = 0; j < c.s; ++j) o += pr[j] * f(p.v[(kh + j) * c.d + e]);
                    g.o[(qh + i) * c.d + e] = o;
                    di += o * f(p.dout[(qh + i) * c.d + e]);
                }
                for (int j = 0; j < c.s; ++j) {
                    if (pr[j] == 0) continue;
                    double dp = 0;
                    for (int e = 0; e < c.d; ++e) dp += f(p.dout[(qh + i) * c.d + e]) * f(p.v[(kh + j) * c.d + e]);
                    const double ds = pr[j] * (dp - di);
                    for (int e = 0; e < c.d; ++e) {
                        g.dq[(qh + i) * c.d + e] += ds * p.a.scale * f(p.k[(kh + j) * c.d + e]);
                        g.dk[(gh + j) * c.d + e] += ds * p.a.scale * f(p.q[(qh + i) * c.d + e]);
                        g.dv[(gh + j) * c.d + e] += pr[j] * f(p.dout[(qh + i) * c.d + e]);
                    }
                }
            }
        }
    return g;
}

// ---- Running the kernels and comparing.

template <typename T>
double relative_error(const std::vector<T>& got, const std::vector<double>& want, size_t from = 0) {
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        double x;
        if constexpr (std::is_same_v<T, bf16>)
            x = __bfloat162float(got[from + i]);
        else
            x = got[from + i];
        if (!std::isfinite(x)) return INFINITY;
        num += (x - want[i]) * (x - want[i]), den += want[i] * want[i];
    }
    return std::sqrt(num / std::max(den, 1e-30));
}

// Each query's visible keys as at most two runs, and each block of ROWS
// keys' range of queries that see it, from the bias, as batch.rs's
// attention_spans gives them (a whole-sequence pass: S == T).
struct SpanInputs {
    std::vector<fa::Span> spans;
    std::vector<fa::QueryRange> ranges;
};

SpanInputs spans_of(const Problem& p) {
    const Case& c = p.c;
    const int blocks = (c.s + fa::ROWS - 1) / fa::ROWS;
    SpanInputs out{std::vector<fa::Span>((size_t)c.b * c.t), std::vector<fa::QueryRange>((size_t)c.b * blocks)};
    for (int bi = 0; bi < c.b; ++bi)
        for (int i = 0; i < c.t; ++i) {
            int runs[2][2] = {{0, 0}, {0, 0}}, n = 0;
            for (int j = 0; j < c.s; ++j) {
                if (p.bias[((size_t)bi * c.t + i) * c.s + j] < -1e29f) continue;
                if (n > 0 && runs[n - 1][1] == j) {
                    runs[n - 1][1] = j + 1;
                    continue;
                }
                if (n == 2) std::abort();  // three runs: no spans
                runs[n][0] = j, runs[n][1] = j + 1, ++n;
            }
            out.spans[(size_t)bi * c.t + i] = {runs[0][0], runs[0][1], runs[1][0], runs[1][1]};
            for (auto& run : runs)
                for (int blk = run[0] / fa::ROWS; run[0] < run[1] && blk <= (run[1] - 1) / fa::ROWS; ++blk) {
                    fa::QueryRange& r = out.ranges[(size_t)bi * blocks + blk];
                    if (r.end == 0) r.first = i;
                    r.end = i + 1;
                }
        }
    return out;
}

// (B, H, T, D) rows as (B, T, H, D), or back (`back`).
template <typename T>
std::vector<T> by_token(const std::vector<T>& x, const Case& c, bool back = false) {
    std::vector<T> out(x.size());
    for (int bi = 0; bi < c.b; ++bi)
        for (int hi = 0; hi < c.h; ++hi)
            for (int i = 0; i < c.t; ++i)
                for (int e = 0; e < c.d; ++e) {
                    const size_t head_major = (((size_t)bi * c.h + hi) * c.t + i) * c.d + e;
                    const size_t token_major = (((size_t)bi * c.t + i) * c.h + hi) * c.d + e;
                    if (back)
                        out[head_major] = x[token_major];
                    else
                        out[token_major] = x[head_major];
                }
    return out;
}

// The kernels over the bias, or (`spans`) over each query's runs of keys,
// their bias 0 where visible; the output and its gradient in (B, H, T, D)
// rows, or in (B, T, H, D) (`token_rows`).
template <int D>
bool run(const Case& c, std::mt19937& rng, bool spans = false, bool token_rows = false) {
    constexpr int BK = fa::Tiles<D>::KEYS, BQ_KV = fa::Tiles<D>::QUERIES;
    constexpr bool SPLIT = fa::Tiles<D>::SPLIT;
    Problem p = make(c, rng);
    if (spans)
        for (float& x : p.bias) x = x < -1e29f ? x : 0.f;
    Grads want = reference(p);
    const SpanInputs si = spans ? spans_of(p) : SpanInputs{};
    AttnDims a = p.a;
    if (token_rows) a.o_row = (long long)c.h * c.d, a.o_head = c.d;
    // What the kernels read of the output's gradient, as they lay it.
    const std::vector<bf16> dout = token_rows ? by_token(p.dout, c) : p.dout;
    const int rows = c.b * c.h * c.t;
    std::vector<bf16> o(p.q.size(), bf16{0xffff}), dq(p.q.size(), bf16{0xffff});
    std::vector<float> lse(rows, NAN), di(rows);
    const Dim3 query_blocks{unsigned((c.t + fa::ROWS - 1) / fa::ROWS), unsigned(c.b * c.h), 1};
    if (spans)
        launch(query_blocks, fa::fwd_spans_bytes<D, BK>(), [&] {
            fa::fwd_spans<D, BK>(p.q.data(), p.k.data(), p.v.data(), si.spans.data(), o.data(), lse.data(), a);
        });
    else
        launch(query_blocks, fa::fwd_bytes<D, BK>(),
               [&] { fa::fwd<D, BK>(p.q.data(), p.k.data(), p.v.data(), p.bias.data(), o.data(), lse.data(), a); });
    if (token_rows) o = by_token(o, c, true);
    for (int r = 0; r < rows; ++r) {
        double x = 0;
        for (int e = 0; e < D; ++e) x += __bfloat162float(o[(size_t)r * D + e]) * __bfloat162float(p.dout[(size_t)r * D + e]);
        di[r] = float(x);
    }
    if (spans)
        launch(query_blocks, fa::bwd_q_spans_bytes<D, BK>(), [&] {
            fa::bwd_q_spans<D, BK>(p.q.data(), p.k.data(), p.v.data(), si.spans.data(), lse.data(), dout.data(),
                                   di.data(), dq.data(), a);
        });
    else
        launch(query_blocks, fa::bwd_q_bytes<D, BK>(), [&] {
            fa::bwd_q<D, BK>(p.q.data(), p.k.data(), p.v.data(), p.bias.data(), lse.data(), dout.data(), di.data(),
                             dq.data(), a);
        });
    std::vector<bf16> kv(2 * want.dk.size(), bf16{0xffff});
    const Dim3 key_blocks{unsigned((c.s + fa::ROWS - 1) / fa::ROWS), unsigned(c.b * c.h_kv), SPLIT ? 2u : 1u};
    if (spans)
        launch(key_blocks, fa::bwd_kv_spans_bytes<D, BQ_KV>(), [&] {
            fa::bwd_kv_spans<D, BQ_KV, SPLIT>(p.q.data(), p.k.data(), p.v.data(), si.spans.data(), si.ranges.data(),
                                              lse.data(), dout.data(), di.data(), kv.data(), a);
        });
    else
        launch(key_blocks, fa::bwd_kv_bytes<D, BQ_KV>(), [&] {
            fa::bwd_kv<D, BQ_KV, SPLIT>(p.q.data(), p.k.data(), p.v.data(), p.bias.data(), lse.data(), dout.data(),
                                        di.data(), kv.data(), a);
        });
    const double errs[5] = {relative_error(o, want.o), relative_error(lse, want.lse), relative_error(dq, want.dq),
                            relative_error(kv, want.dk), relative_error(kv, want.dv, want.dk.size())};
    // The log-sum-exp sums probabilities rounded to bf16: about 1e-4 off in short rows.
    const bool ok = errs[0] < 1e-2 && errs[1] < 2e-4 && errs[2] < 2e-2 && errs[3] < 2e-2 && errs[4] < 2e-2;
    std::printf("%-4s %-5s %-6s %-34s o %.1e  lse %.1e  dq %.1e  dk %.1e  dv %.1e\n", ok ? "ok" : "FAIL",
                spans ? "spans" : "bias", token_rows ? "tokens" : "heads", c.name, errs[0], errs[1], errs[2], errs[3],
                errs[4]);
    std::fflush(stdout);
    return ok;
}

// ---- The heads cut from a fused projection and their gradients put back
// (heads.cuh), in f32 on one host thread, against a direct reference.

// The larger error, NaN (an element never written) the largest.
double worse(double err, double diff) { return std::isnan(diff) || diff > err ? diff : err; }

// Head h's part p of token (b, t), feature e, rotated over r features by
// angle `theta` (b t r + e) per feature: what heads_split must give.
bool heads_case(const char* name, bool per_head, int r, int d = 8, bool wide = false) {
    const int b = 2, t = 5, h = 3, width = 3 * h * d;
    HeadsDims a{width, per_head ? 3 * d : d, {0, 0, 0}, b, h, t, d, r};
    for (int p = 0; p < 3; ++p) a.offset[p] = per_head ? p * d : p * h * d;
    std::mt19937 rng(3);
    std::normal_distribution<float> normal;
    std::vector<float> fused((size_t)b * t * width), cos((size_t)b * t * std::max(r, 1)), sin(cos.size());
    for (auto& x : fused) x = normal(rng);
    for (int bt = 0; bt < b * t; ++bt)
        for (int e = 0; e < r; ++e) {
            const float theta = 0.3f * float(bt + 1) * float(e % (r / 2) + 1);
            cos[bt * r + e] = std::cos(theta), sin[bt * r + e] = std::sin(theta);
        }
    const size_t n = (size_t)3 * b * h * t * d;
    std::vector<float> heads_out(n, NAN), back((size_t)b * t * width, NAN);
    // One warp, its lanes in turn (the kernels share nothing between them).
    gridDim = {1, 1, 1}, blockDim = {32, 1, 1}, blockIdx = {0, 0, 0};
    auto each_lane = [](const std::function<void()>& kernel) {
        for (unsigned lane = 0; lane < 32; ++lane) threadIdx = {lane, 0, 0}, kernel();
    };
    each_lane([&] {
        if (wide)
            heads_split_wide<float>(fused.data(), cos.data(), sin.data(), heads_out.data(), a, n);
        else
            heads_split<float>(fused.data(), cos.data(), sin.data(), heads_out.data(), a, n);
    });
    double err = 0;
    for (int p = 0; p < 3; ++p)
        for (int bi = 0; bi < b; ++bi)
            for (int hh = 0; hh < h; ++hh)
                for (int ti = 0; ti < t; ++ti) {
                    const float* x = &fused[((size_t)bi * t + ti) * width + hh * a.head_stride + a.offset[p]];
                    const int bt = bi * t + ti, half = r / 2;
                    for (int e = 0; e < d; ++e) {
                        double want = x[e];
                        if (p < 2 && e < half)
                            want = x[e] * cos[bt * r + e] - x[e + half] * sin[bt * r + e];
                        else if (p < 2 && e < r)
                            want = x[e] * cos[bt * r + e] + x[e - half] * sin[bt * r + e];
                        const size_t at = ((((size_t)p * b + bi) * h + hh) * t + ti) * d + e;
                        err = worse(err, std::abs(heads_out[at] - want));
                    }
                }
    // The gradients of the heads themselves give back the projection: the
    // rotation's transpose undoes it.
    each_lane([&] {
        if (wide)
            heads_merge_wide<float>(heads_out.data(), heads_out.data() + n / 3, cos.data(), sin.data(), back.data(), a,
                                    n);
        else
            heads_merge<float>(heads_out.data(), heads_out.data() + n / 3, cos.data(), sin.data(), back.data(), a, n);
    });
    double round_trip = 0;
    for (size_t i = 0; i < fused.size(); ++i) round_trip = worse(round_trip, std::abs(back[i] - fused[i]));
    const bool ok = err < 1e-5 && round_trip < 1e-5;
    std::printf("%-4s heads: %-29s %s split %.1e  merged back %.1e\n", ok ? "ok" : "FAIL", name,
                wide ? "8 a thread" : "a lane each", err, round_trip);
    return ok;
}


// ---- One decoding step's attention over shared and own slots (decode.cuh),
// both ways of dividing the keys among a block's warps, whole or split in
// `chunk` slots across blocks, with a key per lane G query heads of a
// key/value head per block (of h query heads over 2), against an f64
// reference. Spare and masked slots hold NaN: a kernel that reads them
// into a sum fails.

template <typename T>
T nan_of() {
    if constexpr (std::is_same_v<T, bf16>)
        return bf16{0x7fc0};
    else
        return NAN;
}

template <typename T, int E, int G = 1, int R = 1, bool PACKED = false>
bool decode_case(int d, bool lanes, bool fixed, int chunk = 0, int h = 4) {
    // 290 keys: more than one pass of the lanes kernel's 8 x 32. With R rows a
    // block, the rows of a prompt lie together, R or 2 R of them.
    const int b = R == 1 ? 5 : 2 * R, h_kv = 2, p = 200, s_own = 90, capacity = 100, s = p + s_own;
    std::vector<uint32_t> rows = {0, 1, 1, 0, 1};
    if (R > 1) {
        rows.assign(b, 1);
        std::fill(rows.begin(), rows.begin() + R, 0);
    }
    const int width = fixed ? p + capacity : s;
    std::mt19937 rng(11);
    auto fill = [&](std::vector<T>& x, size_t n) {
        x.resize(n);
        for (auto& e : x) e = from_f32<T>(std::normal_distribution<float>(0.f, 1.f)(rng));
    };
    std::vector<T> q, shared_k, shared_v, own_k, own_v;
    fill(q, (size_t)b * h * d);
    fill(shared_k, (size_t)2 * h_kv * p * d), fill(shared_v, shared_k.size());
    fill(own_k, (size_t)b * h_kv * capacity * d), fill(own_v, own_k.size());
    // Padding where a row's prompt is short, a padded own slot, and in row 2 a whole warp's 32 keys (its
    // own shared slots' mask, which the other rows of its prompt do not have).
    auto masked = [&](int r, int j) {
        return (rows[r] == 1 && j < 4) || (r == 4 && j == p + 7) || (r == 2 && j >= 32 && j < 64);
    };
    std::vector<float> mask((size_t)b * width);
    for (int r = 0; r < b; ++r)
        for (int j = 0; j < width; ++j) mask[(size_t)r * width + j] = masked(r, j) ? 0.f : 1.f;
    for (int r = 0; r < b; ++r)
        for (int kh = 0; kh < h_kv; ++kh)
            for (int j = 0; j < p + capacity; ++j) {
                const bool spare = j >= s;
                if (!spare && !masked(r, j)) continue;
                for (int e = 0; e < d; ++e) {
                    if (j >= p) {
                        const size_t at = (((size_t)r * h_kv + kh) * capacity + (j - p)) * d + e;
                        own_k[at] = own_v[at] = nan_of<T>();
                    } else if (rows[r] == 1 && j < 4) {  // only prompt 1's padding is masked in every row that reads it
                        const size_t at = (((size_t)1 * h_kv + kh) * p + j) * d + e;
                        shared_k[at] = shared_v[at] = nan_of<T>();
                    }
                }
            }
    DecodeDims a{h, h_kv, d, p, fixed ? 1 : s_own, width, (long long)h_kv * capacity * d, (long long)capacity * d,
                 (long long)h_kv * p * d, (long long)p * d, 1.f / std::sqrt(float(d)), chunk};
    const uint32_t slot_at = s_own - 1;
    // Split over every slot a replayed step could read: with fixed slots the last splits hold none.
    const int splits = chunk ? (width + chunk - 1) / chunk : 1;
    std::vector<T> o((size_t)b * h * d, nan_of<T>());
    std::vector<float> parts(chunk ? (size_t)b * h * splits * (d + 2) : 0, NAN);
    float* part_at = chunk ? parts.data() : nullptr;
    launch({unsigned(b * h / (lanes ? G * R : 1)), unsigned(splits), 1}, 0, [&] {
        const uint32_t* at = fixed ? &slot_at : nullptr;
        if (lanes)
            decode_attention_lanes<T, E, G, R, PACKED>(q.data(), own_k.data(), own_v.data(), shared_k.data(), shared_v.data(),
                                               rows.data(), mask.data(), at, o.data(), part_at, a);
        else
            decode_attention<T, E>(q.data(), own_k.data(), own_v.data(), shared_k.data(), shared_v.data(), rows.data(),
                                   mask.data(), at, o.data(), part_at, a);
    }, 32 * DECODE_WARPS);
    if (chunk) launch({unsigned(b * h), 1, 1}, 0, [&] { decode_splits<T>(parts.data(), splits, d, o.data()); }, 128);
    std::vector<double> want(o.size());
    for (int r = 0; r < b; ++r)
        for (int hh = 0; hh < h; ++hh) {
            const int kh = hh / (h / h_kv);
            auto key = [&](int j, int e) -> double {
                return to_f32(j < p ? shared_k[(((size_t)rows[r] * h_kv + kh) * p + j) * d + e]
                                    : own_k[(((size_t)r * h_kv + kh) * capacity + (j - p)) * d + e]);
            };
            auto value = [&](int j, int e) -> double {
                return to_f32(j < p ? shared_v[(((size_t)rows[r] * h_kv + kh) * p + j) * d + e]
                                    : own_v[(((size_t)r * h_kv + kh) * capacity + (j - p)) * d + e]);
            };
            std::vector<double> w(s, 0);
            double top = -INFINITY, total = 0;
            for (int j = 0; j < s; ++j) {
                if (masked(r, j)) continue;
                double dot = 0;
                for (int e = 0; e < d; ++e) dot += to_f32(q[((size_t)r * h + hh) * d + e]) * key(j, e);
                w[j] = dot * a.scale, top = std::max(top, w[j]);
            }
            for (int j = 0; j < s; ++j) total += masked(r, j) ? 0 : (w[j] = std::exp(w[j] - top));
            for (int e = 0; e < d; ++e) {
                double out = 0;
                for (int j = 0; j < s; ++j)
                    if (!masked(r, j)) out += w[j] / total * value(j, e);
                want[((size_t)r * h + hh) * d + e] = out;
            }
        }
    const double err = relative_error(o, want);
    const bool ok = err < (std::is_same_v<T, bf16> ? 1e-2 : 1e-5);
    std::printf("%-4s decode: %-16s %d of %d heads, %d rows  d %3d %-5s %s %s  %.1e\n", ok ? "ok" : "FAIL",
                lanes ? (PACKED ? "packed values" : "a key per lane") : "a key per warp", lanes ? G : 1, h, lanes ? R : 1, d,
                std::is_same_v<T, bf16> ? "bf16" : "f32", fixed ? "fixed slots" : "own slots  ", chunk ? "split" : "whole",
                err);
    std::fflush(stdout);
    return ok;
}

// A decoding step's rotary and cache append 8 features a thread against a
// thread a feature, to the bit: q rotated, k rotated and v as it is in their
// slot of the cache, whose other slots keep their NaN; GPT-NeoX's fused
// projection ([q | k | v] a head) and separate projections with 2 query heads
// a key/value head, part of the features rotated or none, the slot given or
// read from the device (a recorded step's).
template <typename T>
bool append_case(bool fused, int d, int r, bool slot_at) {
    const int rows = 3, h = 4, h_kv = fused ? h : 2, capacity = 5, slot = 3;
    std::mt19937 rng(23);
    std::normal_distribution<float> normal;
    AppendDims a{};
    std::vector<T> q, k, v;
    auto fill = [&](std::vector<T>& x, size_t n) {
        x.resize(n);
        for (auto& e : x) e = from_f32<T>(normal(rng));
    };
    if (fused) {
        const int width = 3 * h * d;
        fill(q, (size_t)rows * width);
        k = v = q;
        a.q_row = a.k_row = a.v_row = width, a.q_head = a.k_head = a.v_head = 3 * d;
    } else {
        fill(q, (size_t)rows * h * d), fill(k, (size_t)rows * h_kv * d), fill(v, k.size());
        a.q_row = h * d, a.k_row = a.v_row = h_kv * d, a.q_head = a.k_head = a.v_head = d;
    }
    // With the fused projection k and v start d and 2 d into each head.
    const T *qp = q.data(), *kp = k.data() + (fused ? d : 0), *vp = v.data() + (fused ? 2 * d : 0);
    a.h = h, a.h_kv = h_kv, a.d = d, a.r = r, a.capacity = capacity, a.slot = slot_at ? 0 : slot;
    std::vector<float> cos((size_t)rows * std::max(r, 1)), sin(cos.size());
    for (size_t i = 0; i < cos.size(); ++i) cos[i] = std::cos(0.1f * i), sin[i] = std::sin(0.1f * i);
    const uint32_t at[1] = {uint32_t(slot)};
    const size_t cache = (size_t)rows * h_kv * capacity * d;
    struct Out {
        std::vector<T> q, k, v;
    };
    auto poisoned = [&] { return Out{std::vector<T>((size_t)rows * h * d, nan_of<T>()), std::vector<T>(cache, nan_of<T>()),
                                     std::vector<T>(cache, nan_of<T>())}; };
    Out one = poisoned(), wide = poisoned();
    launch({unsigned(h + h_kv), unsigned(rows), 1}, 0, [&] {
        rotary_append<T>(qp, kp, vp, cos.data(), sin.data(), one.q.data(), one.k.data(), one.v.data(),
                         slot_at ? at : nullptr, a);
    }, unsigned((d + 31) / 32 * 32));
    const unsigned chunks = unsigned(rows * (h + h_kv) * d / 8);
    launch({(chunks + 63) / 64, 1, 1}, 0, [&] {
        rotary_append_wide<T>(qp, kp, vp, cos.data(), sin.data(), wide.q.data(), wide.k.data(), wide.v.data(),
                              slot_at ? at : nullptr, a, rows);
    }, 64);
    auto same = [](const std::vector<T>& x, const std::vector<T>& y) {
        return std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0;
    };
    // The narrow kernel wrote the slot: its values are there, not NaN.
    const size_t written = ((size_t)0 * h_kv * capacity + slot) * d;
    const bool ok = same(one.q, wide.q) && same(one.k, wide.k) && same(one.v, wide.v) &&
                    !std::isnan(to_f32(one.k[written])) && !std::isnan(to_f32(one.q[0]));
    std::printf("%-4s append: %-5s %-28s d %3d rotated %3d, %s, 8 a thread against a thread a feature\n",
                ok ? "ok" : "FAIL", std::is_same_v<T, bf16> ? "bf16" : "f32",
                fused ? "fused [q | k | v] a head" : "separate, 2 heads a k/v head", d, r,
                slot_at ? "slot on the device" : "slot given");
    return ok;
}

// The forward with a row's chunks held, C at most a lane (C = 0: the loops).
template <typename T, int C>
void norm_fwd(bool layer, const T* x, const T* w, const T* b, T* y, int rows, int h, float eps) {
    if constexpr (C == 0) {
        if (layer)
            layer_norm_fwd<T>(x, w, b, y, rows, h, eps);
        else
            rms_norm_fwd<T>(x, w, y, rows, h, eps);
    } else {
        if (layer)
            layer_norm_fwd_wide<T, C>(x, w, b, y, rows, h, eps);
        else
            rms_norm_fwd_wide<T, C>(x, w, y, rows, h, eps);
    }
}

// RMSNorm and LayerNorm, forward and backward, a warp a row, against f64:
// rows that do not fill the last block, a width that is not a whole number
// of warps, and one narrower than a warp; the forward with chunks held
// (C > 0) where lanes hold unequal numbers of chunks, one, or fewer than C.
template <typename T, int C = 0>
bool norms_case(bool layer, int rows, int h) {
    std::mt19937 rng(13);
    std::normal_distribution<float> normal;
    auto fill = [&](std::vector<T>& x, size_t n, float mean) {
        x.resize(n);
        for (auto& e : x) e = from_f32<T>(mean + normal(rng));
    };
    std::vector<T> x, w, b, g;
    fill(x, (size_t)rows * h, 0.5f), fill(w, h, 1.f), fill(b, h, 0.f), fill(g, (size_t)rows * h, 0.f);
    std::vector<T> y(x.size(), nan_of<T>()), dx(x.size(), nan_of<T>());
    std::vector<float> dw(x.size(), NAN);
    const float eps = 1e-5f;
    const Dim3 grid{unsigned((rows + NORM_WARPS - 1) / NORM_WARPS), 1, 1};
    launch(grid, 0, [&] { norm_fwd<T, C>(layer, x.data(), w.data(), b.data(), y.data(), rows, h, eps); }, 32 * NORM_WARPS);
    launch(grid, 0, [&] {
        if (layer)
            layer_norm_bwd<T>(x.data(), w.data(), g.data(), dx.data(), dw.data(), rows, h, eps);
        else
            rms_norm_bwd<T>(x.data(), w.data(), g.data(), dx.data(), dw.data(), rows, h, eps);
    }, 32 * NORM_WARPS);
    std::vector<double> want_y(x.size()), want_dx(x.size()), want_dw(x.size());
    for (int r = 0; r < rows; ++r) {
        auto at = [&](const std::vector<T>& v, int j) { return (double)to_f32(v[(size_t)r * h + j]); };
        double mean = 0, sq = 0;
        for (int j = 0; j < h; ++j) mean += at(x, j) / h, sq += at(x, j) * at(x, j) / h;
        double var = 0;
        for (int j = 0; j < h; ++j) var += (at(x, j) - mean) * (at(x, j) - mean) / h;
        // x^: the normalised input; the gradient of y = x^ w (+ b) through x^.
        const double scale = layer ? 1 / std::sqrt(var + eps) : 1 / std::sqrt(sq + eps);
        auto xh = [&](int j) { return ((layer ? at(x, j) - mean : at(x, j))) * scale; };
        double mean_g = 0, mean_gx = 0;
        for (int j = 0; j < h; ++j) {
            const double gh = at(g, j) * to_f32(w[j]);
            mean_g += gh / h, mean_gx += gh * xh(j) / h;
        }
        for (int j = 0; j < h; ++j) {
            const size_t i = (size_t)r * h + j;
            want_y[i] = xh(j) * to_f32(w[j]) + (layer ? to_f32(b[j]) : 0.0);
            want_dx[i] = scale * (at(g, j) * to_f32(w[j]) - (layer ? mean_g : 0.0) - xh(j) * mean_gx);
            want_dw[i] = at(g, j) * xh(j);
        }
    }
    const double errs[3] = {relative_error(y, want_y), relative_error(dx, want_dx), relative_error(dw, want_dw)};
    const double tol = std::is_same_v<T, bf16> ? 1e-2 : 1e-5;
    const bool ok = errs[0] < tol && errs[1] < tol && errs[2] < tol;
    std::printf("%-4s norms: %-10s %-5s %3d rows of %4d, held %2d  y %.1e  dx %.1e  dw %.1e\n", ok ? "ok" : "FAIL",
                layer ? "LayerNorm" : "RMSNorm", std::is_same_v<T, bf16> ? "bf16" : "f32", rows, h, C, errs[0],
                errs[1], errs[2]);
    return ok;
}

// Two LayerNorms of the same rows in one launch against each alone, to the
// bit: each norm's own weight, bias and eps, rows that do not fill the last
// block, lanes holding unequal numbers of chunks.
template <typename T, int C>
bool norm_pair_case(int rows, int h) {
    std::mt19937 rng(17);
    std::normal_distribution<float> normal;
    auto fill = [&](size_t n, float mean) {
        std::vector<T> v(n);
        for (auto& e : v) e = from_f32<T>(mean + normal(rng));
        return v;
    };
    const std::vector<T> x = fill((size_t)rows * h, 0.5f), w1 = fill(h, 1.f), b1 = fill(h, 0.f), w2 = fill(h, 1.f),
                         b2 = fill(h, 0.f);
    const float eps1 = 1e-5f, eps2 = 1e-3f;
    std::vector<T> pair(2 * x.size(), nan_of<T>()), first(x.size(), nan_of<T>()), second(x.size(), nan_of<T>());
    const Dim3 grid{unsigned((rows + NORM_WARPS - 1) / NORM_WARPS), 1, 1};
    launch(grid, 0, [&] {
        layer_norm_pair_fwd_wide<T, C>(x.data(), w1.data(), b1.data(), w2.data(), b2.data(), pair.data(), rows, h,
                                       eps1, eps2);
    }, 32 * NORM_WARPS);
    launch(grid, 0, [&] { layer_norm_fwd_wide<T, C>(x.data(), w1.data(), b1.data(), first.data(), rows, h, eps1); },
           32 * NORM_WARPS);
    launch(grid, 0, [&] { layer_norm_fwd_wide<T, C>(x.data(), w2.data(), b2.data(), second.data(), rows, h, eps2); },
           32 * NORM_WARPS);
    const size_t bytes = x.size() * sizeof(T);
    const bool ok = std::memcmp(pair.data(), first.data(), bytes) == 0 &&
                    std::memcmp(pair.data() + x.size(), second.data(), bytes) == 0;
    std::printf("%-4s norms: a LayerNorm pair %-5s %3d rows of %4d, held %2d, against each alone to the bit\n",
                ok ? "ok" : "FAIL", std::is_same_v<T, bf16> ? "bf16" : "f32", rows, h, C);
    return ok;
}

// An embedding table's gradient against sums in position order in f64:
// ids that repeat, rows that none reads (zero), a last chunk of ids and a
// last slab of columns that are partial. Every element starts as NaN.
bool embedding_case() {
    const int v = 37, n = 300, h = 300, threads = 32;
    std::mt19937 rng(5);
    std::normal_distribution<float> normal;
    std::vector<uint32_t> ids(n);
    for (auto& id : ids) id = rng() % (v - 7);  // rows v - 7 .. v - 1 unread
    std::vector<float> grad((size_t)n * h), out((size_t)v * h, NAN);
    for (auto& g : grad) g = normal(rng);
    const unsigned slabs = (h + threads * EMBEDDING_COLUMNS - 1) / (threads * EMBEDDING_COLUMNS);
    launch({unsigned(v), slabs, 1}, 0, [&] { embedding_grad<float>(grad.data(), ids.data(), out.data(), n, h); }, threads);
    double err = 0;
    for (int r = 0; r < v; ++r)
        for (int c = 0; c < h; ++c) {
            double want = 0;
            for (int p = 0; p < n; ++p)
                if (ids[p] == uint32_t(r)) want += grad[(size_t)p * h + c];
            err = worse(err, std::abs(out[(size_t)r * h + c] - want));
        }
    const bool ok = err < 1e-4;
    std::printf("embedding gradient, %d rows of %d, %d ids: max error %.2e %s\n", v, h, n, err, ok ? "ok" : "MISMATCH");
    return ok;
}

// The elementwise kernels (elementwise.cuh) over tensors that start on 16
// bytes (8 elements a thread) and one element past that (element by
// element), against each element's formula: the same bits, the tail past
// the last 8 and a thread's several strides included.
template <typename T>
bool elementwise_case(size_t offset) {
    const size_t n = 8 * 250 + 5;
    std::mt19937 rng(5);
    std::normal_distribution<float> normal;
    auto tensor = [&](float scale) {
        std::vector<T> v(n + offset);
        for (auto& e : v) e = from_f32<T>(scale * normal(rng));
        return v;
    };
    std::vector<T> x = tensor(2.f), a = tensor(1.f), b = tensor(1.f), y(n + offset), dx(n + offset), s(n + offset);
    std::vector<float> sum(n + offset), added(n + offset);
    for (auto& e : sum) e = normal(rng);
    const T *xs = x.data() + offset, *as = a.data() + offset, *bs = b.data() + offset;
    const float* sums = sum.data() + offset;
    auto bits_equal = [](const auto& got, const auto& want) { return std::memcmp(&got, &want, sizeof got) == 0; };
    bool ok = true;
    const Dim3 grid{3, 1, 1};
    for (int act = 0; act < 4; ++act) {
        launch(grid, 0, [&] { activation_fwd<T>(xs, y.data() + offset, n, act); }, 32);
        launch(grid, 0, [&] { activation_bwd<T>(xs, as, dx.data() + offset, n, act); }, 32);
        for (size_t i = 0; i < n; ++i) {
            const T fwd = from_f32<T>(activate(to_f32(xs[i]), act));
            const T bwd = from_f32<T>(to_f32(as[i]) * activation_slope(to_f32(xs[i]), act));
            ok &= bits_equal(y[offset + i], fwd) && bits_equal(dx[offset + i], bwd);
        }
    }
    std::vector<T> s2(n + offset);
    launch(grid, 0, [&] { sum2<T>(xs, as, s2.data() + offset, n); }, 32);
    launch(grid, 0, [&] { sum3<T>(xs, as, bs, s.data() + offset, n); }, 32);
    launch(grid, 0, [&] { add_cast<T>(sums, xs, added.data() + offset, n); }, 32);
    std::vector<float> into = sum;  // add_cast_into's: the sum written over
    launch(grid, 0, [&] { add_cast<T>(into.data() + offset, xs, into.data() + offset, n); }, 32);
    std::vector<float> wide(n + offset);
    std::vector<T> narrow(n + offset);
    launch(grid, 0, [&] { cast<T, float>(xs, wide.data() + offset, n); }, 32);
    launch(grid, 0, [&] { cast<float, T>(sums, narrow.data() + offset, n); }, 32);
    std::vector<float> scaled = sum;
    const float mul = -0.37f, add = 0.f;
    launch(grid, 0, [&] { affine_in_place(scaled.data() + offset, n, mul, add); }, 32);
    for (size_t i = 0; i < n; ++i) {
        const T xa = from_f32<T>(to_f32(xs[i]) + to_f32(as[i]));
        ok &= bits_equal(s2[offset + i], xa) && bits_equal(s[offset + i], from_f32<T>(to_f32(xa) + to_f32(bs[i])));
        ok &= bits_equal(added[offset + i], sums[i] + to_f32(xs[i]));
        ok &= bits_equal(into[offset + i], added[offset + i]);
        ok &= bits_equal(wide[offset + i], to_f32(xs[i])) && bits_equal(narrow[offset + i], from_f32<T>(sums[i]));
        ok &= bits_equal(scaled[offset + i], sums[i] * mul + add);
    }
    std::printf("%-4s elementwise %-4s %zu elements from %s: activations, their slopes, sum2, sum3, add_cast (in place too), "
                "casts to and from f32, a scale in place\n",
                ok ? "ok" : "FAIL", sizeof(T) == 2 ? "bf16" : "f32", n, offset == 0 ? "16 bytes (8 a thread)" : "off 16 bytes");
    return ok;
}

// The non-finite check (finite.cuh): no block flags a clean tensor; a
// NaN or an infinity at the first element, in the middle or in the tail
// past the last 8 is flagged, from 16 bytes (8 a thread) and off them
// (element by element), over blocks that stride.
template <typename T>
bool finite_case(size_t offset) {
    const size_t n = 8 * 300 + 5;
    const unsigned blocks = 2;
    std::vector<T> x(n + offset);
    for (size_t i = 0; i < x.size(); ++i) x[i] = from_f32<T>(std::sin(0.37f * i) * 1e4f);
    std::vector<float> flags(blocks);
    auto flagged = [&] {
        std::fill(flags.begin(), flags.end(), NAN);
        launch({blocks, 1, 1}, 0, [&] { non_finite_flags<T>(x.data() + offset, n, flags.data()); }, 64);
        bool any = false, set = true;
        for (float f : flags) any |= f == 1.f, set &= f == 0.f || f == 1.f;
        return set ? int(any) : -1;
    };
    bool ok = flagged() == 0;
    for (float bad : {NAN, INFINITY, -INFINITY})
        for (size_t at : {size_t(0), n / 2 + 3, n - 1}) {
            const T kept = x[offset + at];
            x[offset + at] = from_f32<T>(bad);
            ok &= flagged() == 1;
            x[offset + at] = kept;
        }
    std::printf("%-4s finite %-4s %zu elements from %s: NaN, +inf and -inf at the first, a middle and the last\n",
                ok ? "ok" : "FAIL", sizeof(T) == 2 ? "bf16" : "f32", n, offset == 0 ? "16 bytes" : "off 16 bytes");
    return ok;
}

// The gradient norm's sums of squares (squares.cuh): each thread's sum, its
// loads 4 strides at a time, has the bits of the loop it replaced (a load,
// then its square added, one stride after another), for lengths that leave
// every remainder of 4 strides and a thread with no element.
bool squares_case() {
    std::mt19937 rng(3);
    std::normal_distribution<float> normal;
    std::vector<float> x(8 * 300 + 5);
    for (auto& e : x) e = normal(rng) * 1e3f;
    bool ok = true;
    for (size_t stride : {size_t(1), size_t(7), size_t(64), size_t(5000)})
        for (size_t n : {size_t(0), size_t(1), size_t(3 * 64 + 5), size_t(4 * 64), x.size()})
            for (size_t first = 0; first < std::min(stride, n + 1); ++first) {
                double want = 0.0;
                for (size_t i = first; i < n; i += stride) {
                    const double v = x[i];
                    want += v * v;
                }
                const double got = squares_of_stride(x.data(), n, first, stride);
                ok &= std::memcmp(&got, &want, sizeof got) == 0;
            }
    std::printf("%-4s squares: a thread's sum of squares, 4 strides a load, as one at a time\n", ok ? "ok" : "FAIL");
    return ok;
}

// The LM head's log-probs and entropies (logprobs.cuh) against f64, and d
// logits written over the logits: rows wider than a block (a thread's
// several strides, a partial last one) and narrower. From bf16 logits, the
// bits of the f32 kernels on them cast up, with d logits rounded to bf16
// after (the casts the bf16 kernels replace).
template <typename T>
bool logprobs_case(int rows, int v) {
    std::mt19937 rng(11);
    std::normal_distribution<float> normal;
    const float inv_t = 1.f / 0.7f;
    const unsigned threads = std::min(1024, (v + 31) / 32 * 32);
    std::vector<T> logits((size_t)rows * v);
    for (auto& e : logits) e = from_f32<T>(3.f * normal(rng));
    std::vector<uint32_t> targets(rows);
    for (auto& t : targets) t = rng() % v;
    std::vector<float> grad(2 * rows), out(2 * rows, NAN);
    for (auto& g : grad) g = normal(rng);
    std::vector<T> dlogits = logits;
    launch({unsigned(rows), 1, 1}, 0, [&] { token_logprobs_fwd<T>(logits.data(), targets.data(), out.data(), v, inv_t); }, threads);
    launch({unsigned(rows), 1, 1}, 0, [&] { token_logprobs_bwd<T>(dlogits.data(), targets.data(), grad.data(), v, inv_t); }, threads);
    std::vector<double> want_out(2 * rows), want_d((size_t)rows * v);
    for (int r = 0; r < rows; ++r) {
        auto z = [&](int j) { return (double)to_f32(logits[(size_t)r * v + j]) * inv_t; };
        double top = -INFINITY, total = 0, weighted = 0;
        for (int j = 0; j < v; ++j) top = std::max(top, z(j));
        for (int j = 0; j < v; ++j) total += std::exp(z(j) - top), weighted += std::exp(z(j) - top) * z(j);
        const double lse = top + std::log(total);
        want_out[2 * r] = z(targets[r]) - lse;
        want_out[2 * r + 1] = lse - weighted / total;
        for (int j = 0; j < v; ++j)
            want_d[(size_t)r * v + j] = grad[2 * r] * inv_t * ((j == (int)targets[r]) - std::exp(z(j) - lse));
    }
    const double errs[2] = {relative_error(out, want_out), relative_error(dlogits, want_d)};
    const double tol = std::is_same_v<T, bf16> ? 1e-2 : 1e-5;
    bool ok = errs[0] < 1e-5 && errs[1] < tol;
    if constexpr (std::is_same_v<T, bf16>) {
        std::vector<float> wide(logits.size()), wide_out(2 * rows);
        for (size_t i = 0; i < logits.size(); ++i) wide[i] = to_f32(logits[i]);
        launch({unsigned(rows), 1, 1}, 0, [&] { token_logprobs_fwd<float>(wide.data(), targets.data(), wide_out.data(), v, inv_t); }, threads);
        launch({unsigned(rows), 1, 1}, 0, [&] { token_logprobs_bwd<float>(wide.data(), targets.data(), grad.data(), v, inv_t); }, threads);
        ok &= std::memcmp(out.data(), wide_out.data(), out.size() * sizeof(float)) == 0;
        for (size_t i = 0; i < wide.size(); ++i) ok &= from_f32<bf16>(wide[i]).bits == dlogits[i].bits;
    }
    std::printf("%-4s logprobs %-5s %d rows of %5d, %4u threads  out %.1e  d logits %.1e%s\n", ok ? "ok" : "FAIL",
                std::is_same_v<T, bf16> ? "bf16" : "f32", rows, v, threads, errs[0], errs[1],
                std::is_same_v<T, bf16> ? ", the f32 kernels' bits" : "");
    return ok;
}

// ---- The race sampler against generate/race.rs's rule (pick_row), in f64
// sums over the same f32 scores.

struct Pick {
    uint32_t token;
    float logprob, entropy;
};

Pick race_reference(const float* z, int v, const uint32_t* seen, const RaceParams& p) {
    auto l = [&](int j) {
        float x = z[j];
        if (p.penalty != 1.f && ((seen[j >> 5] >> (j & 31)) & 1u)) x = x < 0.f ? x * p.penalty : x / p.penalty;
        return x;
    };
    int top = 0;
    for (int j = 1; j < v; ++j)
        if (race_beats(l(j), j, l(top), top)) top = j;
    std::vector<float> u(v);
    double s0 = 0, s1 = 0;
    for (int j = 0; j < v; ++j) {
        u[j] = (l(j) - l(top)) * p.inv_t;
        const float e = std::exp(u[j]);
        if (e > 0.f) s0 += e, s1 += double(u[j] * e);
    }
    int token = top;
    if (!p.greedy) {
        // The thresholds: top-k's k-th largest u, then top-p's among those.
        std::vector<float> desc(u);
        std::sort(desc.begin(), desc.end(), [](float a, float b) { return a > b; });
        uint32_t floor = 0;
        if (p.top_k > 0 && p.top_k < (uint32_t)v) floor = ordered_bits(desc[p.top_k - 1]);
        if (p.top_p < 1.f) {
            double total = 0, mass = 0;
            for (float x : desc)
                if (ordered_bits(x) >= floor) total += std::exp(x);
            for (float x : desc) {
                if (ordered_bits(x) < floor) break;
                mass += std::exp(x);
                if (mass >= p.top_p * total) {
                    floor = std::max(floor, ordered_bits(x));
                    break;
                }
            }
        }
        float best = -INFINITY;
        int at = INT_MAX;
        for (int j = 0; j < v; ++j) {
            const bool kept = ordered_bits(u[j]) >= floor && (p.min_p <= 0.f || std::exp(u[j]) >= p.min_p);
            if (!kept) continue;
            uint32_t c[4] = {uint32_t(j / 4), p.step, 0u, 0u};
            philox4x32_10(c, p.key0, p.key1);
            const float s = u[j] - std::log(race_exponential(c[j % 4]));
            if (race_beats(s, j, best, at)) best = s, at = j;
        }
        if (at != INT_MAX) token = at;
    }
    const double log_s0 = std::log(s0);
    return {uint32_t(token), float(u[token] - log_s0), float(log_s0 - s1 / s0)};
}

// Rows of `v` logits in T from `offset` entries into their buffer (off the
// kernel's wide loads when not a multiple of 4, as are the rows when v is
// not), each with its own settings: greedy (with tied maxima), temperature,
// top-k, top-p, both, min-p and a repetition penalty. bf16 logits must give
// the f32 kernel's picks on their cast to the bit.
template <typename T>
bool race_case(int v, size_t offset, unsigned threads) {
    std::mt19937 rng(13);
    std::normal_distribution<float> normal;
    std::vector<RaceParams> rows = {
        {1, 2, 0, 1, 1.f, 0, 1.f, 0.f, 1.f},         {3, 4, 5, 0, 1.f, 0, 1.f, 0.f, 1.f},
        {5, 6, 9, 0, 1.f / 0.7f, 50, 1.f, 0.f, 1.f}, {7, 8, 2, 0, 1.f / 1.3f, 0, 0.9f, 0.f, 1.f},
        {9, 1, 7, 0, 1.f, 20, 0.8f, 0.f, 1.f},        {2, 3, 4, 0, 1.f, 0, 1.f, 0.05f, 1.f},
        {4, 5, 6, 0, 1.f, 0, 1.f, 0.f, 1.3f},         {6, 7, 8, 1, 1.f, 0, 1.f, 0.f, 1.3f},
    };
    const int n = rows.size(), width = (v + 31) / 32;
    std::vector<T> buffer(offset + (size_t)n * v);
    T* logits = buffer.data() + offset;
    for (size_t i = 0; i < (size_t)n * v; ++i) logits[i] = from_f32<T>(3.f * normal(rng));
    logits[5] = logits[v - 2] = from_f32<T>(20.f);  // row 0's maximum twice: the lower index wins
    std::vector<float> cast((size_t)n * v);  // the values the kernel reads
    for (size_t i = 0; i < cast.size(); ++i) cast[i] = to_f32(logits[i]);
    std::vector<uint32_t> params, seen((size_t)n * width);
    for (const RaceParams& p : rows)
        params.insert(params.end(), {p.key0, p.key1, p.step, p.greedy, __float_as_uint(p.inv_t), p.top_k,
                                     __float_as_uint(p.top_p), __float_as_uint(p.min_p), __float_as_uint(p.penalty)});
    for (auto& w : seen) w = rng() & rng();
    // The kernel as kernels.cu builds it, RACE_AHEAD groups' loads issued together, or a group at a time.
    auto picks = [&](const auto* z, bool one_at_a_time) {
        std::vector<uint32_t> out(3 * n, 0xffffffffu);
        launch({unsigned(n), 1, 1}, 0,
               [&] {
                   if (one_at_a_time) race_pick_row<1>(z, params.data(), seen.data(), width, out.data(), v);
                   else race_pick_row<RACE_AHEAD>(z, params.data(), seen.data(), width, out.data(), v);
               },
               threads);
        return out;
    };
    const std::vector<uint32_t> out = picks(logits, false);
    bool ok = out[0] == 5;
    double worst = 0;
    for (int r = 0; r < n; ++r) {
        const Pick want = race_reference(cast.data() + (size_t)r * v, v, seen.data() + (size_t)r * width, rows[r]);
        const float got_lp = __uint_as_float(out[3 * r + 1]), got_h = __uint_as_float(out[3 * r + 2]);
        ok &= out[3 * r] == want.token;
        worst = std::max({worst, std::abs((double)got_lp - want.logprob), std::abs((double)got_h - want.entropy)});
    }
    ok &= worst < 1e-4;
    const bool bf = sizeof(T) == 2;
    // The same words a group at a time, and for bf16 as the f32 kernel's on the cast.
    const bool ahead = picks(logits, true) == out, cast_same = !bf || picks(cast.data(), false) == out;
    std::printf("%-4s race %d rows of %4d %-5s from entry %zu, %4u threads  tokens %s, log-prob and entropy %.1e; "
                "a group at a time %s%s\n",
                ok && ahead && cast_same ? "ok" : "FAIL", n, v, bf ? "bf16" : "float", offset, threads,
                ok ? "equal" : "checked", worst, ahead ? "to the bit" : "DIFFERS",
                !bf ? "" : cast_same ? ", the f32 kernel on the cast to the bit" : ", NOT the f32 kernel on the cast");
    return ok && ahead && cast_same;
}

// A product of few rows (rows_gemm.cuh) in `splits` slices of k, of x or
// of its activation `act` (-1: none), against an f64 reference over the
// bf16 operands: within the output's rounding, the same bits with its
// blocks in the other order (another block last to finish a tile), and
// with an activation the same bits as the product of x activated first
// (as the activation kernel writes it).
bool rows_gemm_case(int m, int n, int k, int splits, bool bias, int act = -1) {
    std::mt19937 rng(m * 131 + n * 7 + k + splits);
    std::normal_distribution<float> normal;
    std::vector<bf16> x((size_t)m * k), w((size_t)n * k), b(n);
    for (auto& e : x) e = __float2bfloat16(normal(rng));
    for (auto& e : w) e = __float2bfloat16(normal(rng) * 0.1f);
    for (auto& e : b) e = __float2bfloat16(normal(rng));
    std::vector<bf16> activated(x);
    if (act >= 0)
        for (auto& e : activated) e = __float2bfloat16(activate(to_f32(e), act));
    using namespace fa::rows;
    const Dim3 grid{unsigned((m + BM - 1) / BM), unsigned((n + BN - 1) / BN), unsigned(splits)};
    auto product = [&](const std::vector<bf16>& input, int its_act, bool backwards) {
        std::vector<bf16> y((size_t)m * n, bf16{0x7fc0});
        std::vector<float> ws((size_t)splits * m * n, NAN);
        std::vector<unsigned> counts(grid.x * grid.y, 0);
        const RowsGemmDims d{m, n, k, splits, its_act};
        const bf16* bp = bias ? b.data() : nullptr;
        launch(grid, SMEM, [&] { fa::rows_gemm(input.data(), w.data(), bp, y.data(), ws.data(), counts.data(), d); },
               THREADS, backwards);
        return y;
    };
    const std::vector<bf16> y = product(x, act, false), y_back = product(x, act, true);
    double worst = 0;
    bool ok = true;
    for (int r = 0; r < m; ++r)
        for (int c = 0; c < n; ++c) {
            double want = bias ? to_f32(b[c]) : 0.0;
            for (int i = 0; i < k; ++i)
                want += (double)to_f32(activated[(size_t)r * k + i]) * to_f32(w[(size_t)c * k + i]);
            const double got = to_f32(y[(size_t)r * n + c]), err = std::abs(got - want);
            worst = std::max(worst, err);
            ok &= err <= std::abs(want) / 128 + 1e-3;  // bf16's rounding of the output, 2^-9 of it, and the sums'
        }
    auto same = [](const std::vector<bf16>& a, const std::vector<bf16>& b) {
        for (size_t i = 0; i < a.size(); ++i)
            if (a[i].bits != b[i].bits) return false;
        return true;
    };
    const bool backwards = same(y, y_back), composed = act < 0 || same(y, product(activated, -1, false));
    std::printf("%-4s rows product %3d x %4d by %4d, %d slices%s%s  max err %.1e; blocks backwards %s%s\n",
                ok && backwards && composed ? "ok" : "FAIL", m, n, k, splits, bias ? ", bias" : "      ",
                act >= 0 ? ", activated" : "", worst, backwards ? "to the bit" : "DIFFER",
                act < 0 ? "" : composed ? "; x activated first to the bit" : "; NOT x activated first");
    return ok && backwards && composed;
}

// AdamW over several parameters (adamw.cuh) with split masters against the
// same steps on f32 masters: the joined masters must be their bits and the
// copies their rounding. Masters that start at ties both ways (the carry
// only the bit tells), lengths that end inside a warp's word, and a grid
// whose blocks stride over a parameter several times.
bool adamw_case(unsigned blocks, size_t n) {
    std::mt19937 rng(11);
    std::normal_distribution<float> normal;
    const std::vector<size_t> sizes = {n, 5, 192};
    const size_t params = sizes.size();
    std::vector<std::vector<float>> w(params), g(params), m(params), v(params), m2(params), v2(params);
    std::vector<std::vector<bf16>> hi(params);
    std::vector<std::vector<unsigned short>> low(params);
    std::vector<std::vector<unsigned>> up(params);
    for (size_t p = 0; p < params; ++p) {
        for (size_t i = 0; i < sizes[p]; ++i) {
            uint32_t bits = __float_as_uint(normal(rng));
            if (i % 5 == 0) bits = (bits & 0xffff0000u) | 0x8000u;  // a tie, rounding to the even side
            w[p].push_back(__uint_as_float(bits));
        }
        m[p] = v[p] = m2[p] = v2[p] = std::vector<float>(sizes[p], 0.f);
        up[p] = std::vector<unsigned>((sizes[p] + 31) / 32, 0u);
        for (size_t i = 0; i < sizes[p]; ++i) {
            const bf16 h = __float2bfloat16(w[p][i]);
            hi[p].push_back(h);
            low[p].push_back(uint16_t(__float_as_uint(w[p][i]) & 0xffff));
            if (h.bits != __float_as_uint(w[p][i]) >> 16) up[p][i / 32] |= 1u << (i % 32);
        }
    }
    for (int t = 1; t <= 3; ++t) {
        std::vector<AdamWTensor> whole(params), split(params);
        for (size_t p = 0; p < params; ++p) {
            g[p].clear();
            for (size_t i = 0; i < sizes[p]; ++i) g[p].push_back(normal(rng) + 0.1f);
            const float decay = p % 2 == 0 ? 1.f - 1e-3f : 1.f;
            whole[p] = {w[p].data(), nullptr, nullptr, m[p].data(), v[p].data(), g[p].data(), sizes[p], decay, 0.f};
            split[p] = {hi[p].data(), low[p].data(), up[p].data(), m2[p].data(), v2[p].data(), g[p].data(), sizes[p],
                        decay, 0.f};
        }
        const float bias1 = 1.f - std::pow(0.9f, t), bias2 = 1.f - std::pow(0.999f, t);
        const float step = 1e-2f / bias1, inv_sqrt_bias2 = 1.f / std::sqrt(bias2);
        const Dim3 grid{blocks, unsigned(params), 1};
        launch(grid, 0, [&] { adamw_multi_body<false>(whole.data(), 0.9f, 0.999f, step, inv_sqrt_bias2, 1e-8f); }, 256);
        launch(grid, 0, [&] { adamw_multi_body<true>(split.data(), 0.9f, 0.999f, step, inv_sqrt_bias2, 1e-8f); }, 256);
    }
    bool ok = true;
    size_t carries = 0;
    for (size_t p = 0; p < params; ++p)
        for (size_t i = 0; i < sizes[p]; ++i) {
            const bool carry = up[p][i / 32] >> (i % 32) & 1;
            carries += carry;
            ok &= __float_as_uint(join_master(hi[p][i], low[p][i], carry)) == __float_as_uint(w[p][i]);
            ok &= hi[p][i].bits == __float2bfloat16(w[p][i]).bits;
            ok &= m[p][i] == m2[p][i] && v[p][i] == v2[p][i];
        }
    // Bits past a parameter's end in its last word stay clear.
    for (size_t p = 0; p < params; ++p)
        if (sizes[p] % 32) ok &= up[p].back() >> (sizes[p] % 32) == 0;
    ok &= carries > 0;
    std::printf("%-4s adamw: split masters as f32 ones, %zu elements, %u blocks, %zu carries\n", ok ? "ok" : "FAIL", n,
                blocks, carries);
    return ok;
}

int main(int argc, char** argv) {
    std::mt19937 rng(7);
    bool ok = true;
    // `races`: two small cases, for a build under ThreadSanitizer, which
    // sees a read of shared memory that no barrier orders after its write.
    if (argc > 1 && std::strcmp(argv[1], "races") == 0) {
        ok &= run<64>({"d64 causal, padding", 2, 2, 1, 70, 70, 64, 70, Case::CAUSAL}, rng);
        ok &= run<256>({"d256 past slots in a cache", 1, 1, 1, 20, 40, 256, 48, Case::CAUSAL}, rng);
        ok &= run<64>({"d64 shared prefix", 1, 2, 1, 150, 150, 64, 150, Case::SHARED_PREFIX}, rng, true);
        ok &= run<256>({"d256 causal, padding", 2, 1, 1, 70, 70, 256, 70, Case::CAUSAL}, rng, true);
        ok &= run<64>({"d64 shared prefix", 1, 2, 1, 150, 150, 64, 150, Case::SHARED_PREFIX}, rng, true, true);
        ok &= decode_case<bf16, 2>(64, false, true);
        ok &= decode_case<bf16, 2>(64, true, true);
        ok &= decode_case<bf16, 2>(64, true, true, 96);
        ok &= decode_case<bf16, 2, 4>(64, true, true, 96, 8);
        ok &= decode_case<bf16, 2, 1, 4>(64, true, true, 96);
        ok &= decode_case<bf16, 2, 1, 4, true>(64, true, true, 96);
        ok &= logprobs_case<bf16>(2, 300);
        ok &= race_case<float>(1003, 0, 64);
        ok &= rows_gemm_case(40, 70, 200, 3, true, 0);
        ok &= adamw_case(2, 1003);
        std::printf(ok ? "all match\n" : "MISMATCH\n");
        return ok ? 0 : 1;
    }
    for (bool fixed : {false, true}) {
        ok &= decode_case<bf16, 2>(64, false, fixed);
        ok &= decode_case<bf16, 2>(64, true, fixed);
        ok &= decode_case<float, 4>(128, true, fixed);
        ok &= decode_case<bf16, 1>(8, true, fixed);
        ok &= decode_case<float, 1>(16, true, fixed);
        // Splits of 96 slots: a split that starts in the shared slots and ends in the own, the first
        // lanes pass of a split past its start, and with fixed slots splits past the filled ones.
        ok &= decode_case<bf16, 2>(64, false, fixed, 96);
        ok &= decode_case<bf16, 2>(64, true, fixed, 96);
        ok &= decode_case<float, 4>(128, true, fixed, 64);
        ok &= decode_case<bf16, 1>(8, true, fixed, 288);
        // A block per key/value head (2 or 4 query heads), and half of one (2 of 4), whole and split.
        ok &= decode_case<bf16, 2, 2>(64, true, fixed);
        ok &= decode_case<float, 4, 4>(128, true, fixed, 0, 8);
        ok &= decode_case<bf16, 8, 2>(256, true, fixed, 0, 8);
        ok &= decode_case<bf16, 1, 8>(8, true, fixed, 96, 16);
        ok &= decode_case<bf16, 2, 4>(64, true, fixed, 96, 8);
        // The rows of a prompt in one block (4 or 2), with grouped heads too, whole and split.
        ok &= decode_case<bf16, 2, 1, 4>(64, true, fixed);
        ok &= decode_case<bf16, 2, 1, 4>(64, true, fixed, 96);
        ok &= decode_case<float, 4, 2, 2>(128, true, fixed, 0, 8);
        ok &= decode_case<bf16, 8, 1, 2>(256, true, fixed, 64);
        ok &= decode_case<bf16, 1, 4, 4>(8, true, fixed, 96, 16);
        // Value rows packed into a warp's loads: 8, 16, 32, 2 and 1 pieces a row (4, 2, 1, 16 and 32 keys a
        // load), with grouped heads and a prompt's rows, whole and split.
        ok &= decode_case<bf16, 2, 1, 1, true>(64, true, fixed);
        ok &= decode_case<bf16, 2, 1, 1, true>(64, true, fixed, 96);
        ok &= decode_case<bf16, 4, 4, 1, true>(128, true, fixed, 0, 8);
        ok &= decode_case<bf16, 8, 1, 2, true>(256, true, fixed, 64);
        ok &= decode_case<float, 4, 2, 2, true>(128, true, fixed, 0, 8);
        ok &= decode_case<bf16, 1, 1, 1, true>(16, true, fixed);
        ok &= decode_case<bf16, 1, 4, 4, true>(8, true, fixed, 96, 16);
        ok &= decode_case<bf16, 2, 1, 4, true>(64, true, fixed);
        ok &= decode_case<bf16, 2, 1, 4, true>(64, true, fixed, 96);
    }
    ok &= embedding_case();
    ok &= squares_case();
    ok &= logprobs_case<float>(3, 2500);
    ok &= logprobs_case<bf16>(3, 2500);
    ok &= logprobs_case<float>(2, 40);
    ok &= logprobs_case<bf16>(2, 300);
    // Rows on 4 entries' bytes, a buffer off them, rows off them but the first, a tail group of
    // 3; a thread with several groups, and one with at most one; in f32 and bf16.
    ok &= race_case<float>(1000, 0, 96);
    ok &= race_case<float>(1000, 1, 64);
    ok &= race_case<float>(1003, 0, 96);
    ok &= race_case<float>(90, 0, 32);
    ok &= race_case<bf16>(1000, 0, 96);
    ok &= race_case<bf16>(1000, 2, 64);
    ok &= race_case<bf16>(1003, 0, 96);
    ok &= race_case<bf16>(90, 1, 32);
    // Whole tiles; rows, outputs and k past them (k = 264 ends in a partial chunk); a few rows (warps
    // with none); many slices; each activation on x.
    ok &= rows_gemm_case(256, 128, 256, 1, false);
    ok &= rows_gemm_case(200, 100, 264, 3, true);
    ok &= rows_gemm_case(5, 64, 64, 2, true);
    ok &= rows_gemm_case(130, 70, 1000, 7, false);
    for (int act = 0; act < 4; ++act) ok &= rows_gemm_case(130, 70, 264, 2, act % 2 == 0, act);
    ok &= adamw_case(3, 37003);
    ok &= adamw_case(40, 3003);
    for (size_t offset : {0, 1}) {
        ok &= elementwise_case<bf16>(offset);
        ok &= elementwise_case<float>(offset);
        ok &= finite_case<bf16>(offset);
        ok &= finite_case<float>(offset);
    }
    for (bool layer : {false, true}) {
        ok &= norms_case<float>(layer, 21, 300);
        ok &= norms_case<bf16>(layer, 21, 1024);
        ok &= norms_case<float>(layer, 3, 8);
        ok &= norms_case<bf16, 4>(layer, 21, 1024);
        ok &= norms_case<float, 4>(layer, 10, 1000);
        ok &= norms_case<bf16, 8>(layer, 9, 1032);
        ok &= norms_case<float, 1>(layer, 3, 8);
        ok &= norms_case<bf16, 16>(layer, 17, 2048);
    }
    ok &= norm_pair_case<bf16, 4>(21, 1024);
    ok &= norm_pair_case<float, 4>(10, 1000);
    ok &= norm_pair_case<bf16, 8>(9, 2048);
    ok &= norm_pair_case<float, 1>(3, 8);
    ok &= heads_case("per head [q | k | v], rotary", true, 4);
    ok &= heads_case("[Q | K | V], rotary", false, 8);
    ok &= heads_case("per head, no rotary", true, 0);
    ok &= heads_case("per head, 40 features", true, 16, 40);
    ok &= heads_case("per head [q | k | v], rotary", true, 16, 32, true);
    ok &= heads_case("[Q | K | V], rotary", false, 32, 64, true);
    ok &= heads_case("per head, no rotary", true, 0, 16, true);
    ok &= append_case<bf16>(true, 64, 16, false);
    ok &= append_case<bf16>(true, 64, 64, true);
    ok &= append_case<float>(false, 32, 0, true);
    ok &= append_case<bf16>(false, 128, 128, false);
    ok &= append_case<float>(true, 16, 16, false);
    ok &= run<64>({"d64 causal, padding, gqa", 2, 4, 2, 70, 70, 64, 70, Case::CAUSAL}, rng);
    ok &= run<64>({"d64 shared prefix", 2, 2, 2, 100, 100, 64, 100, Case::SHARED_PREFIX}, rng);
    ok &= run<64>({"d64 past slots in a cache", 2, 2, 1, 20, 90, 64, 96, Case::CAUSAL}, rng);
    ok &= run<128>({"d128 causal, padding, gqa", 2, 4, 2, 70, 70, 128, 70, Case::CAUSAL}, rng);
    ok &= run<128>({"d128 shared prefix", 1, 2, 1, 100, 100, 128, 100, Case::SHARED_PREFIX}, rng);
    ok &= run<256>({"d256 causal, padding, gqa", 2, 2, 1, 70, 70, 256, 70, Case::CAUSAL}, rng);
    ok &= run<256>({"d256 past slots in a cache", 1, 2, 2, 20, 90, 256, 96, Case::CAUSAL}, rng);
    // Over spans: tiles the runs skip (a prompt of 24, parts of 19 over 200 keys), partial last tiles.
    ok &= run<64>({"d64 causal, padding, gqa", 2, 4, 2, 70, 70, 64, 70, Case::CAUSAL}, rng, true);
    ok &= run<64>({"d64 shared prefix", 2, 2, 2, 200, 200, 64, 200, Case::SHARED_PREFIX}, rng, true);
    ok &= run<128>({"d128 shared prefix, gqa", 1, 4, 2, 200, 200, 128, 200, Case::SHARED_PREFIX}, rng, true);
    ok &= run<128>({"d128 causal, padding", 2, 2, 2, 70, 70, 128, 70, Case::CAUSAL}, rng, true);
    ok &= run<256>({"d256 shared prefix, gqa", 1, 2, 1, 100, 100, 256, 100, Case::SHARED_PREFIX}, rng, true);
    // The output and its gradient as the output projection has them, (B, T, H, D).
    for (bool spans : {false, true}) {
        ok &= run<64>({"d64 shared prefix, gqa", 2, 4, 2, 100, 100, 64, 100, Case::SHARED_PREFIX}, rng, spans, true);
        ok &= run<128>({"d128 causal, padding", 2, 2, 2, 70, 70, 128, 70, Case::CAUSAL}, rng, spans, true);
        ok &= run<256>({"d256 causal, padding, gqa", 2, 2, 1, 70, 70, 256, 70, Case::CAUSAL}, rng, spans, true);
    }
    std::printf(ok ? "all match\n" : "MISMATCH\n");
    return ok ? 0 : 1;
}
