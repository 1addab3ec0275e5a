// ---- Attention of one decoding step over a KV cache read where it lies:
// each row's shared slots (row `shared_rows[b]` of the shared buffers, the
// prompt its k completions share) and then its own. One block per (row,
// query head) of DECODE_WARPS warps. Each warp keeps an online softmax over
// its keys; the warps are combined in a fixed order. Keys whose mask is 0
// are skipped. The mask's rows are mask_row apart; with slot_at given, a
// row's own slots are the first *slot_at + 1 (a step replayed from a CUDA
// graph), else s_own. Included by kernels.cu and by the host emulator.
//
// With chunk > 0 the keys are split too: block (x, y) takes slots
// [y chunk, (y + 1) chunk) and writes its part of the softmax (maximum, sum
// and the unnormalised sums of values, d + 2 floats) to `parts`, which
// decode_splits combines in split order. A few rows over a long cache then
// fill the GPU, where a block per (row, head) would leave most of it idle.
//
// Two ways to split the keys (RLOO_DECODE_ATTENTION, decode_attention.rs):
// - decode_attention: warp w takes keys w, w + DECODE_WARPS, ..., a lane
//   holding E = D / 32 features, so each key and value row is read whole by
//   one warp; each key costs a warp-wide sum, one key after another.
// - decode_attention_lanes: lane i of warp w scores key 32 w + i (then
//   32 (w + DECODE_WARPS) + i, ...), reading its key row in 16-byte loads,
//   so a warp has 32 keys in flight; then the warp takes those keys' values
//   one after another, a lane holding E features. Any head size of whole
//   16-byte loads up to 32 E. A block takes G query heads of one key/value
//   head (grouped-query attention), so that each key and value it reads
//   serves all G: the cache is read once per step, not once per query head.
//   It also takes R rows that continue one shared row (the k completions of
//   a prompt): each shared key and value it reads serves all R, so that a
//   prompt's slots are read once per step, not once per completion; each
//   row's own slots serve that row alone.

#define DECODE_WARPS 8

struct DecodeDims {
    int h, h_kv, d, p, s_own;              // query heads, key/value heads, head size, shared and own slots
    long long mask_row;                    // the key mask's row stride, at least p + own slots
    long long own_row, own_head;           // strides of the own buffers between rows and heads
    long long shared_row, shared_head;     // the same of the shared buffers; slots are d apart in both
    float scale;
    int chunk;                             // slots per split of the keys (blockIdx.y); 0: not split
};

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// The slots the block's (row, query head) attends over: `count` of them,
// the shared ones first, then the row's own, with the row's key mask; the
// block takes [begin, end) of them. `first`: the (row, query head) the
// block starts at, b h + head (its other query heads share the key/value head).
template <typename T>
struct DecodeSlots {
    const T *k, *v, *shared_k, *shared_v;
    const float* mask;
    size_t own_at, shared_at;
    int p, d, count, begin, end;

    __device__ __forceinline__ DecodeSlots() {}
    __device__ __forceinline__ DecodeSlots(const T* k, const T* v, const T* shared_k, const T* shared_v,
                                           const uint32_t* shared_rows, const float* mask,
                                           const uint32_t* slot_at, int first, const DecodeDims& a) {
        const int b = first / a.h, kv_head = first % a.h / (a.h / a.h_kv);
        this->k = k, this->v = v, this->shared_k = shared_k, this->shared_v = shared_v;
        this->mask = mask + (size_t)b * a.mask_row;
        own_at = (size_t)b * a.own_row + (size_t)kv_head * a.own_head;
        shared_at = a.p ? (size_t)shared_rows[b] * a.shared_row + (size_t)kv_head * a.shared_head : 0;
        p = a.p, d = a.d, count = a.p + (slot_at ? (int)*slot_at + 1 : a.s_own);
        begin = a.chunk ? (int)blockIdx.y * a.chunk : 0;
        end = a.chunk ? min(count, begin + a.chunk) : count;
    }
    __device__ __forceinline__ size_t at(int j) const {
        return j < p ? shared_at + (size_t)j * d : own_at + (size_t)(j - p) * d;
    }
    __device__ __forceinline__ const T* key(int j) const { return (j < p ? shared_k : k) + at(j); }
    __device__ __forceinline__ const T* value(int j) const { return (j < p ? shared_v : v) + at(j); }
};

// The 16 bytes of one load as the f32 values of the elements they hold.
__device__ __forceinline__ void unpack(uint4 raw, float (&x)[4]) {
    x[0] = __uint_as_float(raw.x), x[1] = __uint_as_float(raw.y);
    x[2] = __uint_as_float(raw.z), x[3] = __uint_as_float(raw.w);
}

__device__ __forceinline__ void unpack(uint4 raw, float (&x)[8]) {  // bf16: the high half of an f32
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    for (int i = 0; i < 4; i++) x[2 * i] = __uint_as_float(words[i] << 16), x[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
}

// The warps' partial softmaxes, combined in a fixed order into the row's
// output, or with the keys split into the block's part at `split`.
template <typename T, int E>
__device__ __forceinline__ void decode_combine(const float* part_max, const float* part_sum,
                                               const float (*part_acc)[32 * E], int d, T* o, float* split) {
    for (int f = threadIdx.x; f < d; f += blockDim.x) {
        float top = -INFINITY;
        for (int w = 0; w < DECODE_WARPS; w++) top = fmaxf(top, part_max[w]);
        float total = 0.f, out = 0.f;
        if (top != -INFINITY) {  // else no real key (cannot happen for a real token): output 0
            for (int w = 0; w < DECODE_WARPS; w++) {
                const float c = part_max[w] == -INFINITY ? 0.f : expf(part_max[w] - top);
                total += part_sum[w] * c;
                out += part_acc[w][f] * c;
            }
            if (!split) out /= total;
        }
        if (!split) {
            o[f] = from_f32<T>(out);
            continue;
        }
        if (f == 0) split[0] = top, split[1] = total;
        split[2 + f] = out;
    }
}

// Where the part of (row, query head) `at` from split blockIdx.y goes with
// the keys split, else null.
__device__ __forceinline__ float* decode_part(float* parts, int at, int d) {
    return parts ? parts + ((size_t)at * gridDim.y + blockIdx.y) * (d + 2) : nullptr;
}

// The parts of each (row, query head), `splits` of them, combined in split
// order into its output: a block per (row, head).
template <typename T>
__device__ void decode_splits(const float* parts, int splits, int d, T* o) {
    const float* part = parts + (size_t)blockIdx.x * splits * (d + 2);
    float top = -INFINITY;
    for (int y = 0; y < splits; y++) top = fmaxf(top, part[(size_t)y * (d + 2)]);
    for (int f = threadIdx.x; f < d; f += blockDim.x) {
        float total = 0.f, out = 0.f;
        if (top != -INFINITY) {
            for (int y = 0; y < splits; y++) {
                const float* at = part + (size_t)y * (d + 2);
                const float c = at[0] == -INFINITY ? 0.f : expf(at[0] - top);
                total += at[1] * c;
                out += at[2 + f] * c;
            }
            out /= total;
        }
        o[(size_t)blockIdx.x * d + f] = from_f32<T>(out);
    }
}

template <typename T, int E>
__device__ void decode_attention(const T* q, const T* k, const T* v, const T* shared_k, const T* shared_v,
                                 const uint32_t* shared_rows, const float* mask, const uint32_t* slot_at, T* o,
                                 float* parts, DecodeDims a) {
    __shared__ float part_max[DECODE_WARPS], part_sum[DECODE_WARPS];
    __shared__ float part_acc[DECODE_WARPS][32 * E];
    const int row = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const DecodeSlots<T> slots(k, v, shared_k, shared_v, shared_rows, mask, slot_at, row, a);
    float qv[E], acc[E];
    for (int e = 0; e < E; e++) qv[e] = to_f32(q[(size_t)row * a.d + lane * E + e]) * a.scale, acc[e] = 0.f;
    float run_max = -INFINITY, run_sum = 0.f;
    for (int j = slots.begin + warp; j < slots.end; j += DECODE_WARPS) {
        if (slots.mask[j] == 0.f) continue;
        const T* kj = slots.key(j) + lane * E;
        const T* vj = slots.value(j) + lane * E;
        float dot = 0.f;
        for (int e = 0; e < E; e++) dot += qv[e] * to_f32(kj[e]);
        const float score = warp_sum(dot);
        const float new_max = fmaxf(run_max, score);
        const float keep = expf(run_max - new_max), p = expf(score - new_max);
        run_sum = run_sum * keep + p;
        for (int e = 0; e < E; e++) acc[e] = acc[e] * keep + p * to_f32(vj[e]);
        run_max = new_max;
    }
    if (lane == 0) part_max[warp] = run_max, part_sum[warp] = run_sum;
    for (int e = 0; e < E; e++) part_acc[warp][lane * E + e] = acc[e];
    __syncthreads();
    decode_combine<T, E>(part_max, part_sum, part_acc, a.d, o + (size_t)row * a.d, decode_part(parts, row, a.d));
}

// A key row's products with N queries (rows of q_row), read in 16-byte
// loads, 4 of them issued before the first is used: a loop over a head size
// known only at run time left each load waiting for the last one's products,
// a memory round trip per 16 bytes of the key. (8 at once took 78 registers
// a thread where 4 take 58, at a head size of 64 and a block per row.)
template <typename T, int N, int W>
__device__ __forceinline__ void decode_dots(const T* key, const float (*q_row)[W], int d, float (&dot)[N]) {
    constexpr int VEC = 16 / sizeof(T), MOST = W / VEC, BATCH = MOST < 4 ? MOST : 4;
    const uint4* kj = reinterpret_cast<const uint4*>(key);
    const int chunks = d / VEC;
#pragma unroll
    for (int i = 0; i < N; i++) dot[i] = 0.f;
    for (int c0 = 0; c0 < chunks; c0 += BATCH) {
        uint4 raw[BATCH];
#pragma unroll
        for (int k = 0; k < BATCH; k++)
            if (c0 + k < chunks) raw[k] = kj[c0 + k];
#pragma unroll
        for (int k = 0; k < BATCH; k++) {
            if (c0 + k >= chunks) break;
            float x[VEC];
            unpack(raw[k], x);
#pragma unroll
            for (int i = 0; i < N; i++)
#pragma unroll
                for (int e = 0; e < VEC; e++) dot[i] += q_row[i][(c0 + k) * VEC + e] * x[e];
        }
    }
}

// A lane's E adjacent features from p (on E elements' bytes when they are
// 4, 8 or a multiple of 16), in one load where the E x 2 or 4 bytes make
// one, where a load an element kept each lane's loads waiting in line (8
// a value row at a head size of 256). Kept as loaded: `lane_values`
// widens them where they are used, so that a batch of rows stays in flight
// in as few registers as their bytes take.
template <typename T, int E>
__device__ __forceinline__ void lane_load(const T* p, T (&e)[E]) {
    constexpr int BYTES = E * sizeof(T);
    if constexpr (BYTES % 16 == 0) {
        uint4 words[BYTES / 16];
        for (int w = 0; w < BYTES / 16; w++) words[w] = reinterpret_cast<const uint4*>(p)[w];
        memcpy(e, words, BYTES);
    } else if constexpr (BYTES == 8) {
        const unsigned long long word = *reinterpret_cast<const unsigned long long*>(p);
        memcpy(e, &word, BYTES);
    } else if constexpr (BYTES == 4) {
        const uint32_t word = *reinterpret_cast<const uint32_t*>(p);
        memcpy(e, &word, BYTES);
    } else {
        for (int k = 0; k < E; k++) e[k] = p[k];
    }
}

// A lane's E features of the value row vj (0 past the row's d).
template <typename T, int E>
__device__ __forceinline__ void lane_values(const T* vj, int lane, int d, T (&e)[E]) {
    if (lane * E + E <= d) {
        lane_load<T, E>(vj + lane * E, e);
    } else {  // a lane past the row's end, or over its last features
        for (int k = 0; k < E; k++) e[k] = lane * E + k < d ? vj[lane * E + k] : from_f32<T>(0.f);
    }
}

// F features of a value row, weighted by pi into N queries' sums of them.
template <int F, int N>
__device__ __forceinline__ void decode_add_weighted(const float (&x)[F], const float* pi, float (*acc)[F]) {
    for (int e = 0; e < F; e++) {
        // A masked slot's value is never read into the sum, whatever it holds.
#pragma unroll
        for (int i = 0; i < N; i++) acc[i][e] += pi[i] != 0.f ? pi[i] * x[e] : 0.f;
    }
}

// A lane's E features of a value row, weighted by pi into N queries' sums.
template <typename T, int E, int N>
__device__ __forceinline__ void decode_add_value(const T (&v)[E], const float* pi, float (*acc)[E]) {
    float x[E];
    for (int e = 0; e < E; e++) x[e] = to_f32(v[e]);
    decode_add_weighted<E, N>(x, pi, acc);
}

// Value rows a lane holds in flight at once, R of them a key where the R
// rows read their own: 32 registers' worth, up to 8 keys.
template <typename T, int E, int R>
__device__ constexpr int value_batch() {
    constexpr int words = (E * (int)sizeof(T) + 3) / 4, fit = 32 / (words * R);
    return fit > 8 ? 8 : fit < 1 ? 1 : fit;
}

// A 16-byte piece of a value row (16 / sizeof(T) features), weighted by pi
// into N queries' sums of those features.
template <typename T, int N>
__device__ __forceinline__ void decode_add_piece(uint4 raw, const float* pi, float (*acc)[16 / sizeof(T)]) {
    constexpr int VEC = 16 / sizeof(T);
    float x[VEC];
    unpack(raw, x);
    decode_add_weighted<VEC, N>(x, pi, acc);
}

// With PACKED, a warp reads the values of 32 / (d / VEC) keys a load, each
// key's row in 16-byte pieces over d / VEC adjacent lanes, so that a
// pass's 32 rows take a few wide loads where a row a load took 32 narrow
// ones; a lane sums its piece's VEC features of every such key, and the
// lanes holding a piece add up at the end. The host picks it only where
// d / VEC divides 32 (a head size of 8 to 256 in bf16, 4 to 128 in f32).
template <typename T, int E, int G, int R, bool PACKED = false>
__device__ void decode_attention_lanes(const T* q, const T* k, const T* v, const T* shared_k, const T* shared_v,
                                       const uint32_t* shared_rows, const float* mask, const uint32_t* slot_at, T* o,
                                       float* parts, DecodeDims a) {
    constexpr int Q = R * G;             // the block's queries: G heads of each of R rows
    static_assert(Q * 32 * E <= 512, "a block's shared partial sums stay within 16 KB");
    static_assert(!PACKED || E * sizeof(T) <= 16, "a row's 16-byte pieces fit a warp's lanes");
    __shared__ float q_row[Q][32 * E];
    __shared__ float part_max[Q][DECODE_WARPS], part_sum[Q][DECODE_WARPS];
    __shared__ float part_acc[Q][DECODE_WARPS][32 * E];
    // Query r G + g is row row0 + r's query head head0 + g.
    const int groups = a.h / G, row0 = blockIdx.x / groups * R, head0 = blockIdx.x % groups * G;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    auto query = [&](int i) { return (size_t)(row0 + i / G) * a.h + head0 + i % G; };
    DecodeSlots<T> slots[R];
#pragma unroll
    for (int r = 0; r < R; r++)
        slots[r] = DecodeSlots<T>(k, v, shared_k, shared_v, shared_rows, mask, slot_at, (int)query(r * G), a);
    // The R rows continue one shared row (the host checks), and have as many own slots.
    const int s = slots[0].end, p_shared = slots[0].p;
    for (int i = threadIdx.x; i < Q * a.d; i += blockDim.x)
        q_row[i / a.d][i % a.d] = to_f32(q[query(i / a.d) * a.d + i % a.d]) * a.scale;
    __syncthreads();
    // A lane's features of the sums: E of one value row, or with PACKED
    // the VEC of piece `piece` of each row it reads.
    constexpr int VEC = 16 / sizeof(T), A = PACKED ? VEC : E;
    const int pieces = a.d / VEC, piece = lane % pieces;
    float acc[Q][A], run_max[Q], run_sum[Q];
    for (int i = 0; i < Q; i++) {
        run_max[i] = -INFINITY, run_sum[i] = 0.f;
        for (int e = 0; e < A; e++) acc[i][e] = 0.f;
    }
    for (int start = slots[0].begin + warp * 32; start < s; start += DECODE_WARPS * 32) {
        const int j = start + lane;
        float score[Q];
        for (int i = 0; i < Q; i++) score[i] = -INFINITY;
        // The mask and the key are read together, the key whatever its mask
        // (a slot below s is in the buffers): a masked key's score is dropped.
        // (The masks read once before the two branches took more registers:
        // 96 to 120 a thread with 4 grouped heads.)
        if (j < s && j < p_shared) {  // a shared slot: one key row for all R rows
            float seen[R], dot[Q];
            for (int r = 0; r < R; r++) seen[r] = slots[r].mask[j];
            decode_dots<T, Q>(slots[0].key(j), q_row, a.d, dot);
            for (int i = 0; i < Q; i++) score[i] = seen[i / G] != 0.f ? dot[i] : -INFINITY;
        } else if (j < s) {  // an own slot: each row's own key row
            float seen[R];
            for (int r = 0; r < R; r++) seen[r] = slots[r].mask[j];
#pragma unroll
            for (int r = 0; r < R; r++) {
                float dot[G];
                decode_dots<T, G>(slots[r].key(j), q_row + r * G, a.d, dot);
                for (int g = 0; g < G; g++) score[r * G + g] = seen[r] != 0.f ? dot[g] : -INFINITY;
            }
        }
        float top[Q], p[Q];
        bool any = false;
        for (int i = 0; i < Q; i++) top[i] = warp_max(score[i]), any |= top[i] != -INFINITY;
        // All 32 keys masked for every query: the same for the whole warp.
        if (!any) continue;
        for (int i = 0; i < Q; i++) {
            p[i] = 0.f;
            if (top[i] == -INFINITY) continue;  // the same for the whole warp
            const float new_max = fmaxf(run_max[i], top[i]);
            const float keep = expf(run_max[i] - new_max);
            p[i] = expf(score[i] - new_max);  // 0 where masked
            run_sum[i] = run_sum[i] * keep + warp_sum(p[i]);
            for (int e = 0; e < A; e++) acc[i][e] *= keep;
            run_max[i] = new_max;
        }
        // The 32 keys' values in batches: a batch's rows are all read before
        // the first is summed, so that their loads are in flight together.
        const int n = min(32, s - start);
        if constexpr (PACKED) {
            // Loads of 32 / pieces keys each: a lane reads piece `piece` of
            // key first + b keys_a_load + lane / pieces. Up to 4 loads in flight
            // (8 took 103 registers a thread at 410m, a block per row; 4, 79).
            constexpr int BATCH = 4 / R > 0 ? 4 / R : 1;
            const int keys_a_load = 32 / pieces;
            for (int first = 0; first < n; first += BATCH * keys_a_load) {
                uint4 held[BATCH][R];
#pragma unroll
                for (int b = 0; b < BATCH; b++) {
                    const int l = first + b * keys_a_load + lane / pieces, slot = start + l;
#pragma unroll
                    for (int r = 0; r < R; r++)
                        if (l < n && (r == 0 || slot >= p_shared))
                            held[b][r] = reinterpret_cast<const uint4*>(slots[r].value(slot))[piece];
                }
#pragma unroll
                for (int b = 0; b < BATCH; b++) {
                    if (first + b * keys_a_load >= n) break;  // the same for the whole warp
                    // Below 32: a load's first key is a multiple of keys_a_load below n <= 32.
                    const int l = first + b * keys_a_load + lane / pieces, slot = start + l;
                    float pi[Q];
                    for (int i = 0; i < Q; i++) pi[i] = __shfl_sync(0xffffffff, p[i], l);
                    if (l >= n) continue;
                    if (slot < p_shared) {
                        decode_add_piece<T, Q>(held[b][0], pi, acc);
                    } else {
#pragma unroll
                        for (int r = 0; r < R; r++) decode_add_piece<T, G>(held[b][r], pi + r * G, acc + r * G);
                    }
                }
            }
        } else {
            constexpr int BATCH = value_batch<T, E, R>();
            for (int l0 = 0; l0 < n; l0 += BATCH) {
                T held[BATCH][R][E];
#pragma unroll
                for (int k = 0; k < BATCH; k++) {
                    const int slot = start + l0 + k;
#pragma unroll
                    for (int r = 0; r < R; r++)
                        if (l0 + k < n && (r == 0 || slot >= p_shared))
                            lane_values<T, E>(slots[r].value(slot), lane, a.d, held[k][r]);
                }
#pragma unroll
                for (int k = 0; k < BATCH; k++) {
                    float pi[Q];
                    for (int i = 0; i < Q; i++) pi[i] = __shfl_sync(0xffffffff, p[i], l0 + k);
                    const int slot = start + l0 + k;
                    if (l0 + k >= n) break;  // the same for the whole warp
                    if (slot < p_shared) {
                        decode_add_value<T, E, Q>(held[k][0], pi, acc);
                    } else {
#pragma unroll
                        for (int r = 0; r < R; r++) decode_add_value<T, E, G>(held[k][r], pi + r * G, acc + r * G);
                    }
                }
            }
        }
    }
    if constexpr (PACKED) {  // the lanes holding each piece, added in a fixed order
        for (int offset = pieces; offset < 32; offset <<= 1)
            for (int i = 0; i < Q; i++)
                for (int e = 0; e < VEC; e++) acc[i][e] += __shfl_xor_sync(0xffffffff, acc[i][e], offset);
    }
    for (int i = 0; i < Q; i++) {
        if (lane == 0) part_max[i][warp] = run_max[i], part_sum[i][warp] = run_sum[i];
        if constexpr (PACKED) {
            if (lane < pieces)
                for (int e = 0; e < VEC; e++) part_acc[i][warp][lane * VEC + e] = acc[i][e];
        } else {
            for (int e = 0; e < E; e++) part_acc[i][warp][lane * E + e] = acc[i][e];
        }
    }
    __syncthreads();
    for (int i = 0; i < Q; i++)
        decode_combine<T, E>(part_max[i], part_sum[i], part_acc[i], a.d, o + query(i) * a.d,
                             decode_part(parts, (int)query(i), a.d));
}
