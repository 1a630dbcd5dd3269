// Split kernels (gqa_decode_split.cu), part 1: what every split kernel and the combine
// share: chunk bounds from the length (which may live on the device), the combine's early
// launch, exp2.

// FX_THREADS, FX_TILE, FX_MAX_SPLITS and the other launch constants: split_traits.h, which
// the host writes from ferrox_driver/kernels/traits.py (its SPLIT_TRAITS)
#define FX_WARPS (FX_THREADS / 32)
#define FX_LOG2E 1.4426950408889634f

__device__ __forceinline__ int fx_seq_len(int seq_len, const int* seq_len_dev) {
    return seq_len_dev != nullptr ? *seq_len_dev : seq_len;
}

// Tokens per chunk for this length: a multiple of `tile`, at most `splits` chunks. (`tile`
// is 8 to FX_TILE tokens, chosen by the host: short chunks cut the serial trips to memory
// of short sequences.)
__device__ __forceinline__ int fx_chunk(int seq, int splits, int tile) {
    int c = (seq + splits - 1) / splits;
    return (c + tile - 1) / tile * tile;
}

// ---- Features (decode/checks.py; each a compile-time switch, bits of the kernels' F): a
// decode without one compiles to the kernel it has without features. The bits, FX_F_WINDOW
// to FX_F_HND: split_traits.h, written from ferrox_driver/kernels/traits.py (its FEATURES).
// The run-time values of a decode's features (the kernels' last arguments).
struct FxFeat {
    float scale, cap;
    int window;
    const float* slopes;  // [n_heads]
    const float* sinks;   // [n_heads]
    float* lse;           // [n_heads]
    long long head_stride;  // FX_F_HND: elements from one KV head's rows to the next's
};

// The first token a decode reads at length `seq`: seq - window with a window, else 0.
template <int F>
__device__ __forceinline__ int fx_first_token(int seq, int window) {
    return (F & FX_F_WINDOW) ? max(0, seq - window) : 0;
}

// Tokens [start, end) of chunk `split` at the current length (of its last `window` tokens
// with FX_F_WINDOW); false when it has none (the blocks past the end of a graph sized for
// the capacity leave at once).
template <int F = 0>
__device__ __forceinline__ bool fx_chunk_bounds(int seq_len, const int* seq_len_dev,
                                                int splits, int tile, int split, int& start,
                                                int& end, int window = 0) {
    const int seq = fx_seq_len(seq_len, seq_len_dev);
    const int first = fx_first_token<F>(seq, window);
    const int chunk = fx_chunk(seq - first, splits, tile);
    start = first + split * chunk;
    end = min(seq, start + chunk);
    return seq > 0 && start < seq;
}

// Where a block of HT query rows stands (the rows kernels, split_rows.cuh, and the latent
// ones: blockIdx.y = KV head x blocks of HT of its n_q x group rows, query-major;
// blockIdx.x = its chunk): its KV head
// g_kv and first row r0, the length, query 0's place (query t sits at base + t) and its
// chunk [start, end) of the tokens from query 0's first (FX_F_WINDOW: base + 1 - window);
// idle() where it has none.
template <int F, int HT>
struct FxRowBlock {
    int group, rows_kv, g_kv, r0, seq, base, start, end;
    // none of its own work (the combine reads none of it)
    __device__ __forceinline__ bool idle() const { return base < 0 || start >= end; }
    __device__ __forceinline__ FxRowBlock(int n_heads, int n_kv_heads, int n_q, int seq_len,
                                          const int* seq_len_dev, int splits, int tile,
                                          int window) {
        group = n_heads / n_kv_heads;
        rows_kv = n_q * group;
        const int row_blocks = (rows_kv + HT - 1) / HT;
        g_kv = blockIdx.y / row_blocks;
        r0 = blockIdx.y % row_blocks * HT;
        seq = fx_seq_len(seq_len, seq_len_dev);
        base = seq - n_q;
        const int first = (F & FX_F_WINDOW) ? max(0, base + 1 - window) : 0;
        const int chunk = fx_chunk(seq - first, splits, tile);
        const int split = blockIdx.x;
        start = first + split * chunk;
        end = min(seq, start + chunk);
    }
};

__device__ __forceinline__ float fx_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float fx_rcp(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// v's max over the lanes whose index differs from this one's in the bits FIRST .. END / 2
// (a head's lanes in a tensor-core body's fragments: 1..2 for the heads as rows, 4..16
// for the heads as columns).
template <int FIRST, int END>
__device__ __forceinline__ float fx_lanes_max(float v) {
#pragma unroll
    for (int o = FIRST; o < END; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// One query head's online softmax in a tensor-core body: m its running max, l this lane's
// share of its running sum (the lanes' shares are added at the end). step() takes this
// lane's N scores of a step (-INFINITY where masked) and mx, their max over all the head's
// lanes (fx_lanes_max), sets p = 2^(x - the new max) and returns alpha, the factor that
// rescales what came before (0 before the first score).
struct FxRunning {
    float m = -INFINITY, l = 0.f;
    template <int N>
    __device__ __forceinline__ float step(float mx, const float (&x)[N], float (&p)[N]) {
        static_assert(N % 2 == 0, "scores in pairs");
        const float m_new = fmaxf(m, mx);
        const float alpha = m == -INFINITY ? 0.f : fx_exp2(m - m_new);
#pragma unroll
        for (int i = 0; i < N; ++i) p[i] = x[i] == -INFINITY ? 0.f : fx_exp2(x[i] - m_new);
        float sum = p[0] + p[1];  // pair by pair, in order
#pragma unroll
        for (int i = 2; i < N; i += 2) sum += p[i] + p[i + 1];
        l = l * alpha + sum;
        m = m_new;
        return alpha;
    }
};

// A score in the kernels' base-2 domain from q.k (`dot`) of token j: dot * sscale (sscale =
// scale * log2 e), or with a soft-cap or ALiBi, in natural units first (capped, then the
// head's slope times j - last, last = seq - 1), all folded into constants: capped,
// s = cap * tanh(dot * scale / cap) with tanh(y) = 1 - 2 / (1 + e^2y), e^2y = 2^(dot * k2)
// (k2 = 2 log2 e * scale / cap; ex2 and rcp approximate, on the special-function units),
// so in base 2 s * log2 e = c1 - c2 / (1 + 2^(dot * k2)), c1 = cap log2 e = c2 / 2.
// (tanhf and an IEEE division per score made a capped 32/8/128 bf16 decode 44-74% slower
// than the plain one; this form costs two special-function ops.) |dot| large: 2^(...) is
// 0 or inf, the score -cap or cap; NaN stays NaN.
template <int F>
struct FxScore {
    float sscale, k2, c1, c2, slope2;  // slope2: the slope times log2 e
    int last;
    __device__ __forceinline__ float operator()(float dot, int j) const {
        if (!(F & (FX_F_CAP | FX_F_ALIBI))) return dot * sscale;
        float s = dot * sscale;
        if (F & FX_F_CAP) s = c1 - c2 * fx_rcp(1.f + fx_exp2(dot * k2));
        if (F & FX_F_ALIBI) s += slope2 * (float)(j - last);
        return s;
    }
    // scores of q.k * f for q.k (an fp8 cache's scale, a power of two q was scaled by)
    __device__ __forceinline__ void fold(float f) {
        sscale *= f;
        k2 *= f;
    }
};
// The scale a kernel that pre-scales Q applies (the CUDA-core and fp32 tensor-core ones):
// into the base-2 domain, or with a soft-cap or ALiBi in natural units (FxScore finishes).
template <int F>
__device__ __forceinline__ float fx_q_scale(const FxFeat& f, int head_dim) {
    const float scale = (F & FX_F_SCALE) ? f.scale : rsqrtf((float)head_dim);
    return (F & (FX_F_CAP | FX_F_ALIBI)) ? scale : scale * FX_LOG2E;
}
// The score of a pre-scaled q.k (fx_q_scale): as it is, or capped and with ALiBi.
template <int F, class Scorer>
__device__ __forceinline__ float fx_prescaled(const Scorer& sc, float x, int j) {
    return (F & (FX_F_CAP | FX_F_ALIBI)) ? sc(x, j) : x;
}

// The scorer of query head h (`real`: not a padding row) for a kernel whose plain scale is
// 1/sqrt(dr) (with pre-scaled Q: dr = 1, no FX_F_SCALE: scale 1).
template <int F>
__device__ __forceinline__ FxScore<F> fx_scorer(const FxFeat& f, int dr, int h, bool real,
                                                int seq_len, const int* seq_len_dev) {
    FxScore<F> sc;
    const float scale = (F & FX_F_SCALE) ? f.scale : rsqrtf((float)dr);
    const float cap = (F & FX_F_CAP) ? f.cap : 1.f;
    sc.sscale = scale * FX_LOG2E;
    sc.k2 = 2.f * FX_LOG2E * scale / cap;
    sc.c1 = cap * FX_LOG2E;
    sc.c2 = 2.f * sc.c1;
    sc.slope2 = (F & FX_F_ALIBI) && real ? f.slopes[h] * FX_LOG2E : 0.f;
    sc.last = (F & FX_F_ALIBI) ? fx_seq_len(seq_len, seq_len_dev) - 1 : 0;
    return sc;
}

// Programmatic dependent launch (compute capability 9.0 and up): the combine kernel is
// launched with the programmatic-serialization attribute, so it may start once every split
// block has called fx_let_combine_start (or left), and it waits in fx_wait_for_split,
// before its first read of the workspace, until the split kernel has finished and its
// writes are visible. Without the attribute both are no-ops. FX_PDL_TRIGGER: where the
// split kernels let it start (0: at their end, 1: once all their warps are past their main
// loops, 2: at entry; a block counts from its first thread's call).
#ifndef FX_PDL_TRIGGER
#define FX_PDL_TRIGGER 1
#endif
template <int WHERE>
__device__ __forceinline__ void fx_let_combine_start() {
#if __CUDA_ARCH__ >= 900
    if (WHERE == FX_PDL_TRIGGER) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void fx_wait_for_split() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// A verify's chain (split_verify.cuh): the tail kernel lets the split kernel start at once
// (fx_let_dependents_start); the split kernel, launched early there, waits in fx_tc_block
// (fx_wait_for_split: a no-op for a launch without the attribute) before it reads the
// queries and the prefix's length the tail writes.
__device__ __forceinline__ void fx_let_dependents_start() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

