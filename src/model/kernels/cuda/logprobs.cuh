// The log-prob of each row's target and the entropy, from logits (N, V) in
// T (f32, or bf16 as the LM head's product wrote them, read as they are
// where a cast to f32 made a copy twice their size) at temperature
// 1 / inv_t: out (N, 2) f32 = [log-prob, entropy]; a block a row.

template <typename T>
__device__ void softmax_stats(const T* z, int v, float inv_t, float* scratch, float* m, float* s, float* sz) {
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < v; j += blockDim.x) mx = fmaxf(mx, to_f32(z[j]) * inv_t);
    *m = block_max(mx, scratch);
    float se = 0.f, sez = 0.f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        const float d = to_f32(z[j]) * inv_t - *m, e = expf(d);
        se += e;
        sez += e * d;
    }
    *s = block_sum(se, scratch);
    *sz = block_sum(sez, scratch);
}

template <typename T>
__device__ void token_logprobs_fwd(const T* logits, const uint32_t* targets, float* out, int v, float inv_t) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const T* z = logits + row * v;
    float m, s, sz;
    softmax_stats(z, v, inv_t, scratch, &m, &s, &sz);
    if (threadIdx.x == 0) {
        const float log_s = logf(s);
        out[2 * row] = to_f32(z[targets[row]]) * inv_t - m - log_s;
        // H = -sum p (d - log s) with d = z / T - max.
        out[2 * row + 1] = log_s - sz / s;
    }
}

// d logits = g inv_t (1[j = target] - p_j), g the gradient of the log-prob,
// written over the logits, rounded to T: the training backward's chunk of
// logits becomes its gradient with no second (N, V) buffer. Each thread
// writes only the elements it reads last, after the block's sums.
template <typename T>
__device__ void token_logprobs_bwd(T* logits, const uint32_t* targets, const float* grad, int v, float inv_t) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    T* z = logits + row * v;
    float m, s, sz;
    softmax_stats(z, v, inv_t, scratch, &m, &s, &sz);
    const float g = grad[2 * row] * inv_t, inv_s = 1.f / s;
    const uint32_t t = targets[row];
    for (int j = threadIdx.x; j < v; j += blockDim.x)
        z[j] = from_f32<T>(g * ((j == (int)t ? 1.f : 0.f) - expf(to_f32(z[j]) * inv_t - m) * inv_s));
}
