// AdamW over many parameters in one launch: blockIdx.y picks the parameter
// from the table. A parameter's master is f32, or split
// (src/model/kernels/split_master.rs): its bf16 rounding, which the
// networks compute with; its low 16 bits; and whether the rounding went
// up, a bit an element, 32 to a word, which a warp writes from one ballot.
// Both ways the arithmetic is adamw_step's, so a split master takes the
// f32 master's bits and its rounding those of the cast after it.

struct AdamWTensor {
    void* w;                // float*, or the split master's bf16*
    unsigned short* low;    // split: the master's low 16 bits
    unsigned* up;           // split: whether its rounding went up, a bit an element
    float* m;
    float* v;
    const float* g;
    unsigned long long n;
    float decay, pad;
};

__device__ __forceinline__ float adamw_step(float w, float g, float* m_at, float* v_at, float beta1, float beta2,
                                           float step, float inv_sqrt_bias2, float eps, float decay) {
    const float m = beta1 * *m_at + (1.f - beta1) * g;
    const float v = beta2 * *v_at + (1.f - beta2) * (g * g);
    *m_at = m;
    *v_at = v;
    return decay * w - step * m / (sqrtf(v) * inv_sqrt_bias2 + eps);
}

// The master of a split weight: the rounding's carry taken back off its
// top half, its low half below.
__device__ __forceinline__ float join_master(bf16 hi, unsigned short low, bool up) {
    const unsigned top = (unsigned)__bfloat16_as_ushort(hi) - (up ? 1u : 0u);
    return __uint_as_float(top << 16 | low);
}

template <bool SPLIT>
__device__ __forceinline__ void adamw_multi_body(const AdamWTensor* table, float beta1, float beta2, float step,
                                                 float inv_sqrt_bias2, float eps) {
    const AdamWTensor t = table[blockIdx.y];
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    if (!SPLIT) {
        float* w = static_cast<float*>(t.w);
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < t.n; i += stride)
            w[i] = adamw_step(w[i], t.g[i], &t.m[i], &t.v[i], beta1, beta2, step, inv_sqrt_bias2, eps, t.decay);
        return;
    }
    bf16* hi = static_cast<bf16*>(t.w);
    const unsigned lane = threadIdx.x % 32;
    // A warp's 32 elements are one word of `up` (blocks and strides are
    // whole warps), and its first bounds the loop, so that every lane
    // reaches each ballot.
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i - lane < t.n; i += stride) {
        bool up = false;
        if (i < t.n) {
            const float w = join_master(hi[i], t.low[i], t.up[i / 32] >> lane & 1);
            const float next = adamw_step(w, t.g[i], &t.m[i], &t.v[i], beta1, beta2, step, inv_sqrt_bias2, eps, t.decay);
            const bf16 rounded = __float2bfloat16(next);
            const unsigned bits = __float_as_uint(next);
            up = __bfloat16_as_ushort(rounded) != bits >> 16;
            hi[i] = rounded;
            t.low[i] = (unsigned short)(bits & 0xffff);
        }
        // Every lane has read the word before the ballot returns.
        const unsigned word = __ballot_sync(0xffffffffu, up);
        if (lane == 0) t.up[i / 32] = word;
    }
}
