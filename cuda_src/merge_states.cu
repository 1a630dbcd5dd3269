// The exact merge of attention over disjoint parts of one sequence (fd.merge_states on
// device arrays): out[h] = sum_p w_p out_p[h] / sum_p w_p, lse[h] = log(sum_p w_p) + m,
// w_p = exp(lse_p[h] - m), m = max_p lse_p[h]. A part with lse -inf adds nothing; a head
// whose parts are all empty gets zeros and -inf. One block per head, a thread per column
// (and every blockDim.x-th after it); parts summed in order (reproducible bit for bit).
template <class T>
__device__ __forceinline__ void fx_merge_states(const T* __restrict__ outs,
                                                const float* __restrict__ lses,
                                                T* __restrict__ out, float* __restrict__ lse,
                                                int parts, int n_heads, int head_dim) {
    const int h = blockIdx.x;
    float m = -INFINITY;
    for (int p = 0; p < parts; ++p) m = fmaxf(m, lses[(long long)p * n_heads + h]);
    float total = 0.f;
    for (int p = 0; p < parts; ++p) {
        const float l = lses[(long long)p * n_heads + h];
        total += l == -INFINITY ? 0.f : expf(l - m);
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.f;
        for (int p = 0; p < parts; ++p) {
            const float l = lses[(long long)p * n_heads + h];
            if (l == -INFINITY) continue;
            acc += expf(l - m) * fx_to_float(outs[((long long)p * n_heads + h) * head_dim + d]);
        }
        out[(long long)h * head_dim + d] = fx_from_float<T>(total > 0.f ? acc / total : 0.f);
    }
    if (threadIdx.x == 0) lse[h] = total > 0.f ? m + logf(total) : -INFINITY;
}

#define FX_MERGE_ENTRY(NAME, T)                                                             \
    extern "C" __global__ void NAME(const T* outs, const float* lses, T* out, float* lse,   \
                                    int parts, int n_heads, int head_dim) {                 \
        fx_merge_states<T>(outs, lses, out, lse, parts, n_heads, head_dim);                 \
    }
FX_MERGE_ENTRY(merge_states_f32, float)
FX_MERGE_ENTRY(merge_states_f16, fx_half)
FX_MERGE_ENTRY(merge_states_bf16, fx_bf16)
