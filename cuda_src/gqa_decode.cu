// GQA decode, parity path: ferrox-cuda 0.15.2's kernel (attn::gqa_decode) with its
// defects fixed. One warp per query head, online softmax over the tokens in order.
//   - compiles under NVRTC (INFINITY comes from the prelude);
//   - the per-lane accumulator is indexed only by unrolled constants, so it stays in
//     registers (ferrox-cuda's run-time index put it on the stack);
//   - head_dim up to 256 (8 values per lane), or 512 (16: gqa_decode_<dt>_d512); the
//     host validates the range;
//   - seq_len 0 writes zeros; seq_len may come from device memory (seq_len_dev != nullptr),
//     so a captured graph stays valid as the cache grows.
// Layout: q [n_heads][head_dim], k/v [token][n_kv_heads][head_dim], out [n_heads][head_dim].

#define FX_MAX_PER_LANE 8  // 8 * 32 lanes = head_dim 256

template <class T, int E = FX_MAX_PER_LANE>
__device__ __forceinline__ void gqa_decode_warp(
    const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    T* __restrict__ out, int n_heads, int n_kv_heads, int head_dim, int seq_len,
    const int* __restrict__ seq_len_dev) {
    const int h = blockIdx.x;
    if (h >= n_heads) return;
    if (seq_len_dev != nullptr) seq_len = *seq_len_dev;
    const int lane = threadIdx.x;  // one warp per head: blockDim.x == 32
    const int kv_h = h / (n_heads / n_kv_heads);
    const float scale = rsqrtf((float)head_dim);
    const unsigned mask = 0xffffffffu;

    float qv[E];
    float acc[E];
#pragma unroll
    for (int i = 0; i < E; ++i) {
        const int d = lane + 32 * i;
        qv[i] = d < head_dim ? fx_to_float(q[(long long)h * head_dim + d]) * scale : 0.f;
        acc[i] = 0.f;
    }

    float m = -INFINITY;
    float s = 0.f;
    const long long row = (long long)n_kv_heads * head_dim;
    for (int t = 0; t < seq_len; ++t) {
        const T* k_t = k_cache + t * row + (long long)kv_h * head_dim;
        const T* v_t = v_cache + t * row + (long long)kv_h * head_dim;
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < E; ++i) {
            const int d = lane + 32 * i;
            if (d < head_dim) dot += qv[i] * fx_to_float(k_t[d]);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(mask, dot, off);
        const float m2 = fmaxf(m, dot);
        // -inf scores contribute nothing (no inf - inf); a NaN score still propagates.
        const float a = (m == -INFINITY) ? 0.f : expf(m - m2);
        const float b = (dot == -INFINITY) ? 0.f : expf(dot - m2);
        s = s * a + b;
#pragma unroll
        for (int i = 0; i < E; ++i) {
            const int d = lane + 32 * i;
            if (d < head_dim) acc[i] = acc[i] * a + b * fx_to_float(v_t[d]);
        }
        m = m2;
    }
    const float inv = (s > 0.f) ? (1.f / s) : 0.f;
#pragma unroll
    for (int i = 0; i < E; ++i) {
        const int d = lane + 32 * i;
        if (d < head_dim) out[(long long)h * head_dim + d] = fx_from_float<T>(acc[i] * inv);
    }
}

#define FX_GQA_DECODE_ENTRY(NAME, T, E)                                                     \
    extern "C" __global__ void __launch_bounds__(32) NAME(                                  \
        const T* q, const T* k_cache, const T* v_cache, T* out, int n_heads,                \
        int n_kv_heads, int head_dim, int seq_len, const int* seq_len_dev) {                \
        gqa_decode_warp<T, E>(q, k_cache, v_cache, out, n_heads, n_kv_heads, head_dim,     \
                              seq_len, seq_len_dev);                                        \
    }

FX_GQA_DECODE_ENTRY(gqa_decode_f32, float, FX_MAX_PER_LANE)
FX_GQA_DECODE_ENTRY(gqa_decode_f16, fx_half, FX_MAX_PER_LANE)
FX_GQA_DECODE_ENTRY(gqa_decode_bf16, fx_bf16, FX_MAX_PER_LANE)
// head_dims 257..512
FX_GQA_DECODE_ENTRY(gqa_decode_f32_d512, float, 16)
FX_GQA_DECODE_ENTRY(gqa_decode_f16_d512, fx_half, 16)
FX_GQA_DECODE_ENTRY(gqa_decode_bf16_d512, fx_bf16, 16)
