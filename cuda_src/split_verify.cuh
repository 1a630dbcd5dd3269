// Split kernels (gqa_decode_split.cu), part 10: many query tokens at once (a speculative
// verify), on the split kernels as they are.
//
// n_q queries are the cache's last n_q tokens: query t sits at position p_t = base + t,
// base = seq - n_q, and sees every earlier token (its window's) and, of the n_q new ones,
// those the mask lets it (causal: u <= t; a tree mask: mask[t][u]). A verify is three
// launches on one workspace:
//  1. gqa_verify_tail: for each (KV head, query t, head of the group) -- a row of the
//     "virtual group" of n_q x group rows the split kernels see -- copies the query into
//     row order (q_rows: [KV head][t][head of the group]) and, with ALiBi, its slope
//     (slopes_rows); writes the prefix's length, base, for the split kernel; and attends,
//     on CUDA cores, to the tokens only some queries see: the new ones (masked) and, with
//     a window, the window's first tokens of the earlier queries. Its partial (o, m, l) per
//     row goes to tail_o / tail_ml.
//  2. the split kernel of a plan for n_q x n_heads heads, on q_rows, over the tokens every
//     query sees, [max(0, seq - window), base) (the window passed less n_q), its length
//     read from the prefix slot: unmasked, at the memory's speed, every row in the tile.
//  3. gqa_verify_combine: per row, the split kernel's chunks and the tail's partial merged
//     (fx_combine_chunks, EXTRA), written to out[t][head] (and the LSE to lse[t][head]).
// The split kernel and the tail score in one convention: ALiBi relative to base - 1 (the
// prefix's last token, as the split kernel sees it), which differs from query t's own by
// slope x (1 + t) for every token: a constant per row, which the combine takes off the
// sink's logit and the LSE (the softmax does not see it).
#define FX_VERIFY_ROWS 4  // rows per tail block, a warp each
#define FX_VERIFY_MAX_E 8  // a lane's elements of a row: head_dim up to 256 (_d512: 16)

// A cache element as a float: the element itself, or an fp8 byte widened (exact).
template <int Q8>
struct FxWiden {
    template <class KT>
    __device__ __forceinline__ static float at(const KT* row, int d) {
        return fx_to_float(row[d]);
    }
};
template <>
struct FxWiden<FX_E4M3> {
    __device__ __forceinline__ static float at(const unsigned char* row, int d) {
        unsigned r;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((unsigned short)row[d]));
        return fx_unpack2(r, fx_half{}).x;
    }
};
template <>
struct FxWiden<FX_E5M2> {
    __device__ __forceinline__ static float at(const unsigned char* row, int d) {
        unsigned r;
        asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(r) : "h"((unsigned short)row[d]));
        return fx_unpack2(r, fx_half{}).x;
    }
};

// Whether query t sees new token u: causal (mode 0), mask bytes (1: [n_q][n_q]) or bits
// (2: [n_q][(n_q + 7) / 8], token u at bit u % 8 of byte u / 8).
__device__ __forceinline__ bool fx_sees(const unsigned char* mask, int mode, int n_q, int t,
                                        int u) {
    if (mode == 0) return u <= t;
    if (mode == 1) return mask[(long long)t * n_q + u] != 0;
    return (mask[(long long)t * ((n_q + 7) >> 3) + (u >> 3)] >> (u & 7)) & 1;
}

// (E: a lane's elements of a row, FX_VERIFY_MAX_E or 16 for head_dims 257..512)
template <class QT, class KT, int Q8, int F, int E = FX_VERIFY_MAX_E>
__device__ __forceinline__ void gqa_verify_tail(
    const QT* __restrict__ q, const KT* __restrict__ k, const KT* __restrict__ v,
    float* __restrict__ tail_o, float* __restrict__ tail_ml, QT* __restrict__ q_rows,
    float* __restrict__ slopes_rows, int* __restrict__ prefix_len, int n_heads, int n_kv_heads,
    int head_dim, int n_q, int seq_len, const int* __restrict__ seq_len_dev,
    const unsigned char* __restrict__ mask, int mask_mode, const float* __restrict__ kv_scales,
    const FxFeat feat) {
    fx_let_dependents_start();  // the split kernel may launch; it waits for this grid's end
    const int group = n_heads / n_kv_heads, rows = n_q * group;
    const int lane = threadIdx.x & 31;
    const int i = blockIdx.y * FX_VERIFY_ROWS + (threadIdx.x >> 5);
    const int g_kv = blockIdx.x;
    const int seq = fx_seq_len(seq_len, seq_len_dev);
    const int base = max(seq - n_q, 0);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *prefix_len = base;
    if (i >= rows) return;  // (no block-wide synchronisation below)
    const int t = i / group, h = g_kv * group + i % group;
    const long long r = (long long)g_kv * rows + i;  // the row the split kernel sees
    const QT* qh = q + ((long long)t * n_heads + h) * head_dim;
    float qf[E], o[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = lane + 32 * e;
        qf[e] = 0.f;
        o[e] = 0.f;
        if (d < head_dim) {
            const QT x = qh[d];
            q_rows[r * head_dim + d] = x;
            qf[e] = fx_to_float(x);
        }
    }
    if ((F & FX_F_ALIBI) && lane == 0) slopes_rows[r] = feat.slopes[h];
    // the split kernel's convention: ALiBi relative to base - 1 (see the top)
    FxScore<F> sc = fx_scorer<F>(feat, head_dim, h, true, base, nullptr);
    if (Q8) sc.fold(kv_scales[g_kv]);
    const float v_scale = Q8 ? kv_scales[n_kv_heads + g_kv] : 1.f;

    const bool hnd = (F & FX_F_HND) != 0;
    const long long row = hnd ? head_dim : (long long)n_kv_heads * head_dim;
    const KT* kg = hnd ? k + g_kv * feat.head_stride : k + (long long)g_kv * head_dim;
    const KT* vg = hnd ? v + g_kv * feat.head_stride : v + (long long)g_kv * head_dim;
    const int p = seq - n_q + t;  // this query's position
    const int window = feat.window;
    const int lo = (F & FX_F_WINDOW) ? max(0, p - window + 1) : 0;
    const int shared_lo = (F & FX_F_WINDOW) ? max(0, seq - window) : 0;  // the split's first
    float m = -INFINITY, l = 0.f;
    // the window's first tokens the split kernel does not read, then the new tokens
    const int ranges[2][2] = {{lo, min(shared_lo, base)},
                              {max(lo, base), mask_mode == 0 ? p + 1 : seq}};
#pragma unroll 1
    for (int part = 0; part < 2; ++part) {
#pragma unroll 1
        for (int j = max(ranges[part][0], 0); j < ranges[part][1]; ++j) {
            if (part == 1 && !fx_sees(mask, mask_mode, n_q, t, j - base)) continue;
            const KT* kr = kg + j * row;
            float dot = 0.f;
#pragma unroll
            for (int e = 0; e < E; ++e) {
                const int d = lane + 32 * e;
                if (d < head_dim) dot = fmaf(qf[e], FxWiden<Q8>::at(kr, d), dot);
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
            const float s = sc(dot, j);
            const float m_new = fmaxf(m, s);
            const float alpha = m == -INFINITY ? 0.f : fx_exp2(m - m_new);
            const float pw = fx_exp2(s - m_new);
            l = l * alpha + pw;
            m = m_new;
            const KT* vr = vg + j * row;
#pragma unroll
            for (int e = 0; e < E; ++e) {
                const int d = lane + 32 * e;
                const float x = d < head_dim ? FxWiden<Q8>::at(vr, d) : 0.f;
                o[e] = fmaf(pw, x, o[e] * alpha);
            }
        }
    }
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = lane + 32 * e;
        if (d < head_dim) tail_o[r * head_dim + d] = o[e] * v_scale;
    }
    if (lane == 0) {
        tail_ml[2 * r] = m;
        tail_ml[2 * r + 1] = l;
    }
}

template <class T, int F>
__device__ __forceinline__ void gqa_verify_combine(
    T* __restrict__ out, const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
    const float* __restrict__ tail_o, const float* __restrict__ tail_ml, int head_dim,
    const int* __restrict__ prefix_len, int splits, int tile, int n_heads, int n_kv_heads,
    int n_q, const FxFeat feat) {
    __shared__ float w_s[FX_MAX_SPLITS];
    __shared__ float red_s[FX_COMBINE_WARPS][32];
    const int r = blockIdx.x;  // the split kernel's row: [KV head][t][head of the group]
    const int group = n_heads / n_kv_heads, rows = n_q * group;
    const int i = r % rows, t = i / group, h = (r / rows) * group + i % group;
    const int d = blockIdx.y * 32 + (threadIdx.x & 31);
    const int seq = *prefix_len;  // written before the split kernel ran
    fx_wait_for_split();
    const long long at = (long long)t * n_heads + h;
    T* out_h = out + at * head_dim;
    // ALiBi: the rows' scores are query t's own plus slope x (1 + t) (see the top)
    const float shift = (F & FX_F_ALIBI) ? feat.slopes[h] * (float)(1 + t) : 0.f;
    const float sink2 = (F & FX_F_SINKS) ? (feat.sinks[h] + shift) * FX_LOG2E : 0.f;
    float* lse_h = (F & FX_F_LSE) && blockIdx.y == 0 ? feat.lse + at : nullptr;
    const int first = fx_first_token<F>(seq, feat.window);
    const int n = seq - first;
    const int chunk = n > 0 ? fx_chunk(n, splits, tile) : 1;
    const int active = n > 0 ? (n + chunk - 1) / chunk : 0;
    const float* o = ws_o + (long long)r * splits * head_dim;
    const float* ml = ws_ml + (long long)r * splits * 2;
    const float* xo = tail_o + (long long)r * head_dim;
    const float* xml = tail_ml + 2LL * r;
    if (active > FX_COMBINE_WARPS * FX_COMBINE_BATCH)
        fx_combine_chunks<T, FX_COMBINE_MANY, F, true>(out_h, o, ml, head_dim, d, active, w_s,
                                                       red_s, sink2, lse_h, xo, xml, shift);
    else
        fx_combine_chunks<T, FX_COMBINE_BATCH, F, true>(out_h, o, ml, head_dim, d, active, w_s,
                                                        red_s, sink2, lse_h, xo, xml, shift);
}

// gqa_verify_tail_<dt>[_<fp8>]_x<F>: q of type QT, a cache of QT (Q8 0) or of fp8 bytes.
#define FX_VERIFY_TAIL_ENTRY(NAME, QT, KT, Q8, F)                                           \
    extern "C" __global__ void __launch_bounds__(FX_VERIFY_ROWS * 32) NAME(                 \
        const QT* q, const KT* k, const KT* v, float* tail_o, float* tail_ml, QT* q_rows,    \
        float* slopes_rows, int* prefix_len, int n_heads, int n_kv_heads, int head_dim,     \
        int n_q, int seq_len, const int* seq_len_dev, const unsigned char* mask,            \
        int mask_mode, const float* kv_scales, float scale, float cap, int window,          \
        const float* slopes, long long head_stride) {                                       \
        const FxFeat feat{scale, cap, window, slopes, nullptr, nullptr, head_stride};       \
        gqa_verify_tail<QT, KT, Q8, F>(q, k, v, tail_o, tail_ml, q_rows, slopes_rows,        \
                                       prefix_len, n_heads, n_kv_heads, head_dim, n_q,      \
                                       seq_len, seq_len_dev, mask, mask_mode, kv_scales,    \
                                       feat);                                               \
    }

// gqa_verify_tail_<dt>[_<fp8>]_d512_x<F>: the same for head_dims 257..512 (a minimum of one
// block in the launch bounds: without it ptxas spilled 8 bytes of the fp32 tail on sm_80)
#define FX_VERIFY_TAIL_D512_ENTRY(NAME, QT, KT, Q8, F)                                      \
    extern "C" __global__ void __launch_bounds__(FX_VERIFY_ROWS * 32, 1) NAME(              \
        const QT* q, const KT* k, const KT* v, float* tail_o, float* tail_ml, QT* q_rows,    \
        float* slopes_rows, int* prefix_len, int n_heads, int n_kv_heads, int head_dim,     \
        int n_q, int seq_len, const int* seq_len_dev, const unsigned char* mask,            \
        int mask_mode, const float* kv_scales, float scale, float cap, int window,          \
        const float* slopes, long long head_stride) {                                       \
        const FxFeat feat{scale, cap, window, slopes, nullptr, nullptr, head_stride};       \
        gqa_verify_tail<QT, KT, Q8, F, 16>(q, k, v, tail_o, tail_ml, q_rows, slopes_rows,    \
                                           prefix_len, n_heads, n_kv_heads, head_dim, n_q,  \
                                           seq_len, seq_len_dev, mask, mask_mode,           \
                                           kv_scales, feat);                                \
    }

// gqa_verify_combine_<dt>_x<F>: window (the split kernel's, less n_q), sinks, LSE, ALiBi.
#define FX_VERIFY_COMBINE_ENTRY(NAME, T, F)                                                 \
    extern "C" __global__ void __launch_bounds__(FX_COMBINE_THREADS) NAME(                  \
        T* out, const float* ws_o, const float* ws_ml, const float* tail_o,                 \
        const float* tail_ml, int head_dim, const int* prefix_len, int splits, int tile,    \
        int n_heads, int n_kv_heads, int n_q, int window, const float* sinks, float* lse,   \
        const float* slopes) {                                                              \
        const FxFeat feat{0.f, 0.f, window, slopes, sinks, lse, 0};                         \
        gqa_verify_combine<T, F>(out, ws_o, ws_ml, tail_o, tail_ml, head_dim, prefix_len,   \
                                 splits, tile, n_heads, n_kv_heads, n_q, feat);             \
    }
