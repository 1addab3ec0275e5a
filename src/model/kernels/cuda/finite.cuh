// Whether a tensor holds NaN or an infinity, for the check of a model's
// weights as they load: each block sets flags[blockIdx.x] to 1 if any of
// the elements its threads read is not finite, else 0, and the host reads
// the few KB of flags. One pass at the memory's rate (8 elements a thread,
// as elementwise.cuh), where `x * 0` summed made a copy and ran candle's
// sum in one block (about a second of a Qwen3-8B's load). After reduce.cuh
// and elementwise.cuh.

template <typename T>
__device__ void non_finite_flags(const T* x, size_t n, float* flags) {
    __shared__ float scratch[32];
    float found = 0.f;
    ew::over_elements(
        n, ew::on16(x),
        [&](size_t c) {
            const ew::Eight v = ew::load8(x, c);
            for (int k = 0; k < ew::PER_THREAD; ++k) found = isfinite(v.v[k]) ? found : 1.f;
        },
        [&](size_t i) { found = isfinite(to_f32(x[i])) ? found : 1.f; });
    found = block_max(found, scratch);
    if (threadIdx.x == 0) flags[blockIdx.x] = found;
}
