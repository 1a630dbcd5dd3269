// Split kernels (gqa_decode_split.cu), part 9: the combine kernel, which merges the chunks
// of the plans without clusters.

// Merge the chunks of each query head: out = sum_c w_c o_c / sum_c w_c l_c, with
// w_c = 2^(m_c - max m). One block per (head, 32 columns): lanes are columns, the four
// warps take every fourth chunk (BATCH loads in flight each) and add up in a fixed order,
// so results are reproducible bit for bit. seq_len 0 writes zeros.
// (Eight warps cost 0.3 us more at 16 chunks: more threads to synchronise. 40 loads in
// flight instead of 16 made 132-chunk plans 1-3% faster and 16- and 64-chunk ones 2-3%
// slower: docs/design.md. So up to 64 chunks take 16 per lane, more take FX_COMBINE_MANY.)
// (FX_COMBINE_THREADS: split_traits.h)
#define FX_COMBINE_BATCH 16  // chunk loads in flight per lane, up to 64 chunks
#define FX_COMBINE_MANY 33   // ... and past 64: 132 chunks in one trip to L2
#define FX_COMBINE_WARPS (FX_COMBINE_THREADS / 32)
// EXTRA (a verify's combine, split_verify.cuh): one more partial, (x_ml[0], x_ml[1]) and
// x_o, merged with the chunks; the LSE written less lse_shift (natural log).
template <class T, int BATCH, int F = 0, bool EXTRA = false>
__device__ __forceinline__ void fx_combine_chunks(T* __restrict__ out_h,
                                                  const float* __restrict__ ws_o,
                                                  const float* __restrict__ ml, int head_dim,
                                                  int d, int active, float* w_s,
                                                  float (*red_s)[32], float sink2 = 0.f,
                                                  float* lse_h = nullptr,
                                                  const float* x_o = nullptr,
                                                  const float* x_ml = nullptr,
                                                  float lse_shift = 0.f) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // This warp's first chunk outputs do not depend on the weights: load them now, so the
    // loads of the maxima below and these share one trip to L2.
    constexpr int W = FX_COMBINE_WARPS;
    const bool col = d < head_dim;
    const float* o = ws_o + (col ? d : 0);
    float x[BATCH];
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
        const int c = warp + i * W;
        x[i] = col && c < active ? o[(long long)c * head_dim] : 0.f;
    }

    // ---- the largest chunk maximum, then the chunk weights and the total sum
    float mx = -INFINITY;
    for (int c = threadIdx.x; c < active; c += FX_COMBINE_THREADS) mx = fmaxf(mx, ml[2 * c]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    if (lane == 0) red_s[warp][0] = mx;
    __syncthreads();
    mx = red_s[0][0];
#pragma unroll
    for (int w = 1; w < W; ++w) mx = fmaxf(mx, red_s[w][0]);
    if (F & FX_F_SINKS) mx = fmaxf(mx, sink2);  // the sink's logit (base 2) counts too
    const float xm = EXTRA ? x_ml[0] : -INFINITY;
    if (EXTRA) mx = fmaxf(mx, xm);
    float lsum = 0.f;
    for (int c = threadIdx.x; c < active; c += FX_COMBINE_THREADS) {
        const float mc = ml[2 * c];
        const float w = mc == -INFINITY ? 0.f : fx_exp2(mc - mx);
        w_s[c] = w;
        lsum += w * ml[2 * c + 1];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) lsum += __shfl_xor_sync(0xffffffffu, lsum, off);
    __syncthreads();  // every warp has read red_s[.][0] (the maxima) before it is reused
    if (lane == 0) red_s[warp][1] = lsum;
    __syncthreads();  // w_s and the partial sums complete
    lsum = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) lsum += red_s[w][1];
    if (F & FX_F_SINKS) lsum += sink2 == -INFINITY ? 0.f : fx_exp2(sink2 - mx);
    const float xw = EXTRA && xm != -INFINITY ? fx_exp2(xm - mx) : 0.f;
    if (EXTRA) lsum += xw * x_ml[1];
    if ((F & FX_F_LSE) && lse_h != nullptr && threadIdx.x == 0)
        *lse_h = (mx + log2f(lsum)) * 0.69314718055994531f - lse_shift;  // natural log

    // ---- weighted sum of the chunk outputs: warp w takes chunks w, w+4, w+8, ... in order
    float acc = 0.f;
    for (int c = warp;;) {
#pragma unroll
        for (int i = 0; i < BATCH; ++i)
            if (c + i * W < active) acc = fmaf(w_s[c + i * W], x[i], acc);
        c += BATCH * W;
        if (c >= active) break;
#pragma unroll
        for (int i = 0; i < BATCH; ++i)
            x[i] = col && c + i * W < active ? o[(long long)(c + i * W) * head_dim] : 0.f;
    }
    __syncthreads();  // red_s[.][1] read by every warp
    red_s[warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && d < head_dim) {
        float total = red_s[0][lane];
#pragma unroll
        for (int w = 1; w < W; ++w) total += red_s[w][lane];
        if (EXTRA) total = fmaf(xw, x_o[d], total);
        out_h[d] = fx_from_float<T>(EXTRA && lsum == 0.f ? 0.f : total / lsum);
    }
}

// Row `r`'s chunks of tokens [first, seq) (seq > first), as many as a plan of `splits`
// chunks of whole `tile` tokens made, merged into out_h (ws_o, ws_ml: every row's partials).
template <class T, int F>
__device__ __forceinline__ void fx_combine_row(T* __restrict__ out_h,
                                               const float* __restrict__ ws_o,
                                               const float* __restrict__ ws_ml, long long r,
                                               int head_dim, int d, int first, int seq,
                                               int splits, int tile, float* w_s,
                                               float (*red_s)[32], float sink2, float* lse_h) {
    const int chunk = fx_chunk(seq - first, splits, tile);
    const int active = (seq - first + chunk - 1) / chunk;
    const float* o = ws_o + r * splits * head_dim;
    const float* ml = ws_ml + r * splits * 2;
    if (active > FX_COMBINE_WARPS * FX_COMBINE_BATCH)
        fx_combine_chunks<T, FX_COMBINE_MANY, F>(out_h, o, ml, head_dim, d, active, w_s, red_s,
                                                 sink2, lse_h);
    else
        fx_combine_chunks<T, FX_COMBINE_BATCH, F>(out_h, o, ml, head_dim, d, active, w_s, red_s,
                                                  sink2, lse_h);
}

template <class T, int F = 0>
__device__ __forceinline__ void gqa_split_combine(
    T* __restrict__ out, const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
    int head_dim, int seq_len, const int* __restrict__ seq_len_dev, int splits, int tile,
    const FxFeat feat = FxFeat{}) {
    __shared__ float w_s[FX_MAX_SPLITS];
    __shared__ float red_s[FX_COMBINE_WARPS][32];
    const int h = blockIdx.x;
    const int d = blockIdx.y * 32 + (threadIdx.x & 31);
    const int seq = fx_seq_len(seq_len, seq_len_dev);  // written before the split kernel ran
    fx_wait_for_split();  // every block, so the combine ends after the split kernel
    T* out_h = out + (long long)h * head_dim;
    // with sinks, head h's sink logit in base 2; with LSE, where head h's goes (once)
    const float sink2 = (F & FX_F_SINKS) ? feat.sinks[h] * FX_LOG2E : 0.f;
    float* lse_h = (F & FX_F_LSE) && blockIdx.y == 0 ? feat.lse + h : nullptr;
    if (seq <= 0) {
        if (threadIdx.x < 32 && d < head_dim) out_h[d] = fx_from_float<T>(0.f);
        if ((F & FX_F_LSE) && lse_h != nullptr && threadIdx.x == 0)  // the sink alone, or none
            *lse_h = (F & FX_F_SINKS) ? feat.sinks[h] : -INFINITY;
        return;
    }
    const int first = fx_first_token<F>(seq, feat.window);
    fx_combine_row<T, F>(out_h, ws_o, ws_ml, h, head_dim, d, first, seq, splits, tile, w_s,
                         red_s, sink2, lse_h);
}

#define FX_COMBINE_ENTRY(NAME, T)                                                           \
    extern "C" __global__ void __launch_bounds__(FX_COMBINE_THREADS) NAME(                  \
        T* out, const float* ws_o, const float* ws_ml, int head_dim, int seq_len,           \
        const int* seq_len_dev, int splits, int tile) {                                     \
        gqa_split_combine<T>(out, ws_o, ws_ml, head_dim, seq_len, seq_len_dev, splits, tile); \
    }

// With the features that reach the combine (FX_F_WINDOW, FX_F_SINKS, FX_F_LSE in F):
// gqa_split_combine_<dt>_x<F>.
#define FX_COMBINE_FEAT_ENTRY(NAME, T, F)                                                   \
    extern "C" __global__ void __launch_bounds__(FX_COMBINE_THREADS) NAME(                  \
        T* out, const float* ws_o, const float* ws_ml, int head_dim, int seq_len,           \
        const int* seq_len_dev, int splits, int tile, int window, const float* sinks,       \
        float* lse) {                                                                       \
        const FxFeat feat{0.f, 0.f, window, nullptr, sinks, lse};                           \
        gqa_split_combine<T, F>(out, ws_o, ws_ml, head_dim, seq_len, seq_len_dev, splits,   \
                                tile, feat);                                                \
    }

#ifndef FX_SELECTED  // the host compiles one entry at a time (attention.split_entry)
FX_COMBINE_ENTRY(gqa_split_combine_f32, float)
FX_COMBINE_ENTRY(gqa_split_combine_f16, fx_half)
FX_COMBINE_ENTRY(gqa_split_combine_bf16, fx_bf16)
#endif
