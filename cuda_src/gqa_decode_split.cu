// GQA decode at memory speed: split-KV ("flash-decoding") kernels.
//
// The sequence is cut into `splits` chunks so the grid fills the GPU. A block handles one
// chunk of one KV head and ALL the query heads of its group, so K and V are read once per
// group. Each block writes an unnormalised partial output with its running max and sum;
// gqa_split_combine merges the chunks with log-sum-exp rescaling.
//
// The chunk size is computed on the device from the sequence length (which may live in
// device memory), so a launch captured in a CUDA graph adapts to every length: blocks past
// the end leave at once.
//
// Scores are kept in the base-2 domain (q pre-multiplied by log2(e)/sqrt(head_dim)), so
// every exponential is one exp2.
//
// Workspace: ws_o [n_heads][splits][head_dim] f32, ws_ml [n_heads][splits][2] f32 (m, l).
// Layout: q [n_heads][head_dim]; k/v [token][n_kv_heads][head_dim]; out like q.

#ifndef FX_THREADS  // (overridable with -D for experiments, as the ring sizes below)
#define FX_THREADS 128
#endif
#define FX_WARPS (FX_THREADS / 32)
#define FX_TILE 64  // the largest chunk granularity (tokens): a block's tokens per iteration
#define FX_MAX_SPLITS 1024
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

// Tokens [start, end) of chunk `split` at the current length; false when it has none
// (the blocks past the end of a graph sized for the capacity leave at once).
__device__ __forceinline__ bool fx_chunk_bounds(int seq_len, const int* seq_len_dev,
                                                int splits, int tile, int split, int& start,
                                                int& end) {
    const int seq = fx_seq_len(seq_len, seq_len_dev);
    const int chunk = fx_chunk(seq, splits, tile);
    start = split * chunk;
    end = min(seq, start + chunk);
    return seq > 0 && start < seq;
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

__device__ __forceinline__ float fx_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---------------------------------------------------------------------------------------
// Eight consecutive elements as floats (vector load when aligned, masked scalars otherwise).
template <class T, bool VEC>
__device__ __forceinline__ void fx_load8(const T* p, int valid, float (&x)[8]);

template <>
__device__ __forceinline__ void fx_load8<float, true>(const float* p, int, float (&x)[8]) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

template <class H>
__device__ __forceinline__ void fx_load8_16bit(const H* p, float (&x)[8]) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
    const float2 a = fx_unpack2(u.x, H()), b = fx_unpack2(u.y, H());
    const float2 c = fx_unpack2(u.z, H()), d = fx_unpack2(u.w, H());
    x[0] = a.x; x[1] = a.y; x[2] = b.x; x[3] = b.y;
    x[4] = c.x; x[5] = c.y; x[6] = d.x; x[7] = d.y;
}
template <>
__device__ __forceinline__ void fx_load8<fx_half, true>(const fx_half* p, int, float (&x)[8]) {
    fx_load8_16bit(p, x);
}
template <>
__device__ __forceinline__ void fx_load8<fx_bf16, true>(const fx_bf16* p, int, float (&x)[8]) {
    fx_load8_16bit(p, x);
}

#define FX_SCALAR_LOAD8(T)                                                                  \
    template <>                                                                             \
    __device__ __forceinline__ void fx_load8<T, false>(const T* p, int valid, float (&x)[8]) { \
        _Pragma("unroll") for (int e = 0; e < 8; ++e) x[e] = e < valid ? fx_to_float(p[e]) : 0.f; \
    }
FX_SCALAR_LOAD8(float)
FX_SCALAR_LOAD8(fx_half)
FX_SCALAR_LOAD8(fx_bf16)

// ---------------------------------------------------------------------------------------
// Generic split kernel on CUDA cores: any head_dim 1..256, any group size (GT heads per
// block, grid.z tiles the group). Lanes split a token's row in groups of `lpt` lanes, eight
// elements each; each lane group keeps its own online softmax, merged at the block's end.
template <class T, int GT, bool VEC>
__device__ __forceinline__ void gqa_split_generic(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    float* __restrict__ ws_o, float* __restrict__ ws_ml, int n_heads, int n_kv_heads,
    int head_dim, int seq_len, const int* __restrict__ seq_len_dev, int splits, int lpt,
    int tile) {
    __shared__ __align__(16) float o_s[FX_WARPS][GT][256];  // each warp's sum, merged at the end
    __shared__ float m_s[FX_THREADS][GT];
    __shared__ float l_s[FX_THREADS][GT];

    // grid = (head tiles, splits, kv heads): the tiles of one chunk are neighbours in
    // launch order, so they run together and all but the first read K/V from L2.
    fx_let_combine_start<2>();
    const int split = blockIdx.y;
    int start, end;
    if (!fx_chunk_bounds(seq_len, seq_len_dev, splits, tile, split, start, end)) return;

    const int g = blockIdx.z;
    const int group = n_heads / n_kv_heads;
    const int j0 = blockIdx.x * GT;  // first head of this tile, within the group
    const int nh = min(GT, group - j0);
    const int h0 = g * group + j0;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tpw = 32 / lpt;  // token groups per warp
    const int sub = lane / lpt, l = lane % lpt;
    const int gid = warp * tpw + sub, n_groups = FX_WARPS * tpw;
    const int d0 = l * 8;
    const int valid = max(0, min(8, head_dim - d0));

    const float qscale = rsqrtf((float)head_dim) * FX_LOG2E;
    float qf[GT][8], acc[GT][8], m[GT], lsum[GT];
#pragma unroll
    for (int j = 0; j < GT; ++j) {
        float tmp[8];
        if (j < nh && valid > 0) {
            fx_load8<T, false>(q + (long long)(h0 + j) * head_dim + d0, valid, tmp);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) tmp[e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            qf[j][e] = tmp[e] * qscale;
            acc[j][e] = 0.f;
        }
        m[j] = -INFINITY;
        lsum[j] = 0.f;
    }

    const long long row = (long long)n_kv_heads * head_dim;
    const T* kg = k + (long long)g * head_dim + d0;
    const T* vg = v + (long long)g * head_dim + d0;
    const bool active = valid > 0;

    // Every lane runs the same iterations (the shuffles need the whole warp); tokens past
    // the end are loaded as zeros and leave the softmax state alone.
    for (int base = start; base < end; base += 2 * n_groups) {
        const int t0 = base + gid, t1 = t0 + n_groups;
        const bool has[2] = {t0 < end, t1 < end};
        float kx[2][8], vx[2][8];
        // Issue all four row loads before using any of them.
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int t = u == 0 ? t0 : t1;
            if (active && has[u]) {
                fx_load8<T, VEC>(kg + t * row, valid, kx[u]);
                fx_load8<T, VEC>(vg + t * row, valid, vx[u]);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) kx[u][e] = vx[u][e] = 0.f;
            }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            float s[GT];
#pragma unroll
            for (int j = 0; j < GT; ++j) {
                float d = 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) d = fmaf(qf[j][e], kx[u][e], d);
                s[j] = d;
            }
            for (int off = lpt >> 1; off > 0; off >>= 1) {
#pragma unroll
                for (int j = 0; j < GT; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], off);
            }
            if (!has[u]) continue;
#pragma unroll
            for (int j = 0; j < GT; ++j) {
                if (s[j] > m[j]) {  // rare after the first tokens: rescale only then
                    const float a = m[j] == -INFINITY ? 0.f : fx_exp2(m[j] - s[j]);
                    lsum[j] *= a;
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[j][e] *= a;
                    m[j] = s[j];
                }
                const float p = s[j] == -INFINITY ? 0.f : fx_exp2(s[j] - m[j]);
                lsum[j] += p;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[j][e] = fmaf(p, vx[u][e], acc[j][e]);
            }
        }
    }

    // Merge the lane groups: scale each to the block's max, sum them in a fixed order
    // (shuffles inside a warp, then warp by warp) so results are bitwise reproducible.
    if (l == 0) {
#pragma unroll
        for (int j = 0; j < GT; ++j) {
            m_s[gid][j] = m[j];
            l_s[gid][j] = lsum[j];
        }
    }
    __syncthreads();  // every warp is past its loop
    fx_let_combine_start<1>();
    float mb[GT];
#pragma unroll
    for (int j = 0; j < GT; ++j) {
        mb[j] = -INFINITY;
        for (int i = 0; i < n_groups; ++i) mb[j] = fmaxf(mb[j], m_s[i][j]);
        const float sc = (m[j] == -INFINITY) ? 0.f : fx_exp2(m[j] - mb[j]);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float x = acc[j][e] * sc;
            for (int off = lpt; off < 32; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
            acc[j][e] = x;
        }
    }
    if (sub == 0 && active) {  // past head_dim, acc holds zeros (q and the rows were 0)
#pragma unroll
        for (int j = 0; j < GT; ++j) {
            float4* dst = reinterpret_cast<float4*>(&o_s[warp][j][d0]);
            dst[0] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
            dst[1] = make_float4(acc[j][4], acc[j][5], acc[j][6], acc[j][7]);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll
        for (int j = 0; j < GT; ++j) {
            if (j >= nh) continue;
            float lb = 0.f;
            for (int i = 0; i < n_groups; ++i)
                if (m_s[i][j] != -INFINITY) lb += l_s[i][j] * fx_exp2(m_s[i][j] - mb[j]);
            float* ml = ws_ml + ((long long)(h0 + j) * splits + split) * 2;
            ml[0] = mb[j];
            ml[1] = lb;
        }
    }
    for (int i = threadIdx.x; i < nh * head_dim; i += FX_THREADS) {
        const int j = i / head_dim, d = i % head_dim;
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < FX_WARPS; ++w) sum += o_s[w][j][d];
        ws_o[((long long)(h0 + j) * splits + split) * head_dim + d] = sum;
    }
}

#define FX_GENERIC_ENTRY(NAME, T, GT, VEC)                                                  \
    extern "C" __global__ void __launch_bounds__(FX_THREADS, 1) NAME(                       \
        const T* q, const T* k, const T* v, float* ws_o, float* ws_ml, int n_heads,         \
        int n_kv_heads, int head_dim, int seq_len, const int* seq_len_dev, int splits,      \
        int lpt, int tile) {                                                                \
        gqa_split_generic<T, GT, VEC>(q, k, v, ws_o, ws_ml, n_heads, n_kv_heads, head_dim,  \
                                      seq_len, seq_len_dev, splits, lpt, tile);             \
    }

#define FX_GENERIC_FOR_TYPE(SUFFIX, T)                                \
    FX_GENERIC_ENTRY(gqa_split_##SUFFIX##_g1_vec, T, 1, true)         \
    FX_GENERIC_ENTRY(gqa_split_##SUFFIX##_g2_vec, T, 2, true)         \
    FX_GENERIC_ENTRY(gqa_split_##SUFFIX##_g4_vec, T, 4, true)         \
    FX_GENERIC_ENTRY(gqa_split_##SUFFIX##_g8_vec, T, 8, true)         \
    FX_GENERIC_ENTRY(gqa_split_##SUFFIX##_g1_any, T, 1, false)        \
    FX_GENERIC_ENTRY(gqa_split_##SUFFIX##_g2_any, T, 2, false)        \
    FX_GENERIC_ENTRY(gqa_split_##SUFFIX##_g4_any, T, 4, false)        \
    FX_GENERIC_ENTRY(gqa_split_##SUFFIX##_g8_any, T, 8, false)

FX_GENERIC_FOR_TYPE(f32, float)
FX_GENERIC_FOR_TYPE(f16, fx_half)
FX_GENERIC_FOR_TYPE(bf16, fx_bf16)

// ---------------------------------------------------------------------------------------
// Tensor-core split kernel for fp16/bf16 caches, head_dim 64/128/256, groups of up to 8.
// Each warp streams through its own 16-token steps with no block barrier in the loop:
//   K and V rows go global -> shared memory by cp.async into a ring of FxStages steps per
//   warp, so 2-7 steps (24-32 KB per warp) are in flight while one is computed;
//   S = Q K^T   (mma m16n8k16: 16 head rows, 8 of them padding, x 8 tokens x 16 d),
//   an online softmax in registers (a row's four lanes share its max),
//   O += P V    (the S accumulators are, repacked, exactly the A operand: no shuffles).
// The mma's K dimension is permuted so each lane feeds it from whole 16-byte row reads (a
// dot product does not care about the order of its terms); V is transposed in registers
// with byte permutes. The warps merge in a fixed order at the end.
//
// Shared-memory rows are XOR-swizzled in 16-byte units so the fragment reads are free of
// bank conflicts: K chunk c of row r sits at c ^ ((r & 1) << 2), V chunk c at c ^ (r & 6).
template <class T> struct FxMma;
// D(16x8, f32) += A(16x16) B(16x8); c0..c3 as in the PTX fragment layout.
#define FX_MMA_STRUCT(T, PTX_TYPE)                                                          \
    template <> struct FxMma<T> {                                                           \
        __device__ static __forceinline__ void run(float& c0, float& c1, float& c2,         \
                                                   float& c3, unsigned a0, unsigned a1,     \
                                                   unsigned a2, unsigned a3, unsigned b0,   \
                                                   unsigned b1) {                           \
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE    \
                         ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"       \
                         : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)                           \
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));           \
        }                                                                                   \
    };
FX_MMA_STRUCT(fx_half, "f16")
FX_MMA_STRUCT(fx_bf16, "bf16")

__device__ __forceinline__ uint4 fx_ldg16(const void* p, bool ok) {
    return ok ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0u, 0u, 0u, 0u);
}

// 16 bytes global -> shared without registers; ok == false writes zeros and reads nothing.
__device__ __forceinline__ void fx_cp_async16(void* dst, const void* src, bool ok) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src),
                 "r"(ok ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void fx_cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void fx_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

template <class T>
__device__ __forceinline__ unsigned fx_pack2(float lo, float hi) {
    return (unsigned)fx_from_float<T>(lo).bits | ((unsigned)fx_from_float<T>(hi).bits << 16);
}

// Per head_dim: warps per block and steps in each warp's ring (one fewer in flight). The
// host reads these defines (attention.py): a block has FX_WARPS_D<D> * 32 threads and
// FX_WARPS_D<D> * stages * 16 tokens * 2 (K, V) * head_dim * 2 bytes of ring in dynamic
// shared memory. (Overridable with -D for experiments: docs/perf-history/variants.py.)
// Chosen by measurement: head_dim 64 issues twice the instructions per byte of 128, and
// eight warps hide their latency better than a deeper ring. Head_dim 128 keeps one step
// in flight per warp while it computes another: 2-4% faster at 4096 tokens than 3 in
// flight, 0.1-0.5% at 32768-131072, 2% on MHA (ring-smem-variants-v16.log). Head_dim 64
// keeps two in flight: 4.8% faster at 32768 tokens on 16/2/64 than three, 0.2-0.3% slower
// at 131072 (ring-smem-variants-d64-d256-v16.log).
// FX_RESERVE_STAGES_D<D>: the launch reserves shared memory for this many steps where the
// ring has fewer, so that one block still fills a multiprocessor (the plans' one wave of
// one block per multiprocessor, and the clusters that fit, assume it).
#ifndef FX_WARPS_D64
#define FX_WARPS_D64 8
#endif
#ifndef FX_STAGES_D64
#define FX_STAGES_D64 3
#endif
#ifndef FX_WARPS_D128
#define FX_WARPS_D128 4
#endif
#ifndef FX_STAGES_D128
#define FX_STAGES_D128 2
#endif
#define FX_RESERVE_STAGES_D64 4
#define FX_RESERVE_STAGES_D128 4
#define FX_RESERVE_STAGES_D256 3
#ifndef FX_WARPS_D256
#define FX_WARPS_D256 4
#endif
#ifndef FX_STAGES_D256
#define FX_STAGES_D256 3  // 4 warps x 3 x 16 KB: as much as a block may have
#endif
template <int D> struct FxStages {
    static constexpr int value = D == 64 ? FX_STAGES_D64 : D == 128 ? FX_STAGES_D128 : FX_STAGES_D256;
};
template <int D> struct FxWarps {
    static constexpr int value = D == 64 ? FX_WARPS_D64 : D == 128 ? FX_WARPS_D128 : FX_WARPS_D256;
};

#define FX_OPAD 34  // floats per row of the merge area (32 lanes + 2: no bank conflicts)

// The largest of the W warps' maxima for head j.
template <int W>
__device__ __forceinline__ float mb_of(const float (*m_s)[8], int j) {
    float mb = -INFINITY;
#pragma unroll
    for (int w = 0; w < W; ++w) mb = fmaxf(mb, m_s[w][j]);
    return mb;
}

// The tensor-core kernels' shared pieces. Element type T (2 or 4 bytes), TOK tokens per
// step, S steps in each warp's ring.
//
// Queue step j of a warp: K and V rows t0..t0+TOK into stage j % S of its ring, 16 bytes per
// cp.async, rows XOR-swizzled in 16-byte units (K chunk c of row r at c ^ ((r & 1) << 2), V
// at c ^ (r & 6)); rows past `end` are zeros. One commit group per step, even an empty one,
// so the waits count steps.
template <class T, int D, int TOK, int S>
__device__ __forceinline__ void fx_issue_step(T* ring, int j, int t0, int start, int end,
                                              int lane, const T* kg, const T* vg,
                                              long long row) {
    constexpr int EPC = 16 / (int)sizeof(T);  // elements per 16-byte chunk
    constexpr int NCH = D / EPC, STEP = TOK * D;
    if (t0 < end) {
        T* ks = ring + (j % S) * 2 * STEP;
        T* vs = ks + STEP;
#pragma unroll
        for (int i = 0; i < TOK * NCH / 32; ++i) {
            const int idx = i * 32 + lane, r = idx / NCH, c = idx % NCH;
            const bool ok = t0 + r < end;
            const long long off = (long long)(ok ? t0 + r : start) * row + c * EPC;
            fx_cp_async16(ks + r * D + ((c ^ ((r & 1) << 2)) * EPC), kg + off, ok);
            fx_cp_async16(vs + r * D + ((c ^ (r & 6)) * EPC), vg + off, ok);
        }
    }
    fx_cp_async_commit();
}

// Refuse (trap) a launch with less dynamic shared memory than `bytes` (the ring would be
// written past its end) or with other than `threads` threads (fewer warps would skip their
// tokens).
__device__ __forceinline__ void fx_check_launch(unsigned bytes, unsigned threads) {
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < bytes) __trap();
    if (blockDim.x != threads) __trap();
}

// This warp's running max and sum of head g (lane = 4g + tig; the sum is split over the
// four lanes of a row) into m_s/l_s[warp][g].
__device__ __forceinline__ void fx_park_warp_stats(float m_run, float l_run, float (*m_s)[8],
                                                   float (*l_s)[8]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
    if ((lane & 3) == 0) {
        m_s[warp][lane >> 2] = m_run;
        l_s[warp][lane >> 2] = l_run;
    }
}

// This warp's O accumulators o[a][b][c] into the merge area in fragment order:
// [warp][slot][lane] with slot = (a * B + b) * 2 + c and rows of FX_OPAD floats.
template <int A, int B>
__device__ __forceinline__ void fx_park_fragments(float* o_f, const float (&o)[A][B][2],
                                                  int warp, int lane) {
#pragma unroll
    for (int a = 0; a < A; ++a)
#pragma unroll
        for (int b = 0; b < B; ++b)
#pragma unroll
            for (int c = 0; c < 2; ++c)
                o_f[(warp * (A * B * 2) + a * (B * 2) + b * 2 + c) * FX_OPAD + lane] = o[a][b][c];
}

// Each warp's weight in its block's merge: w_s[w][j] = 2^(m_w - max over warps) for head j,
// 0 for a warp that saw no tokens (m_w = -inf; its accumulators and sum are zeros), once
// per (warp, head) rather than per output column. Call after the barrier that completes
// m_s and before the one that precedes fx_write_partial.
template <int WARPS>
__device__ __forceinline__ void fx_warp_weights(const float (*m_s)[8], float (*w_s)[8]) {
    if (threadIdx.x < WARPS * 8) {
        const int w = threadIdx.x / 8, j = threadIdx.x % 8;
        const float mw = m_s[w][j];
        w_s[w][j] = mw == -INFINITY ? 0.f : fx_exp2(mw - mb_of<WARPS>(m_s, j));
    }
}

// The block's partial for its chunk, the warps merged in a fixed order (bitwise
// reproducible): o_f holds each warp's unscaled O in fragment order ([warp][slot][lane],
// rows of FX_OPAD floats), m_s/l_s each warp's max and sum per head, w_s its weight
// (fx_warp_weights); where(d, slot, tig) says which slot of lane 4 * head + tig holds
// column d. put_o(j, d, x) stores head j's output d, put_ml(j, max, sum) its max and sum
// (into the workspace, or pushed to the cluster's blocks for their merge).
//
// Thread t takes column d = t % D (and d + THREADS, ... where D > THREADS) of heads
// j = t / D, + HS, + 2 HS, ... (HS = THREADS / D heads side by side, at least 1), so the
// index arithmetic is done once, and it issues every read before its first store: a store
// is a compiler barrier for the reads after it (the cluster's pushes are asm volatile),
// and one column at a time, each waiting for its reads and a chain of integer divisions,
// cost ~140 cycles per column (1.3 us for the 2048 columns of 8/1/256: NOTES.md v10-v11).
template <int WARPS, int D, int SLOTS, class Where, class PutO, class PutMl>
__device__ __forceinline__ void fx_write_partial(const float* o_f, const float (*m_s)[8],
                                                 const float (*l_s)[8], const float (*w_s)[8],
                                                 int group, Where where, PutO put_o,
                                                 PutMl put_ml) {
    if (threadIdx.x < group) {
        const int j = threadIdx.x;
        float lb = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) lb += l_s[w][j] * w_s[w][j];
        put_ml(j, mb_of<WARPS>(m_s, j), lb);
    }
    constexpr int THREADS = WARPS * 32;
    static_assert(THREADS % D == 0 || D % THREADS == 0, "columns must tile the threads");
    constexpr int HS = THREADS >= D ? THREADS / D : 1;  // heads side by side
    constexpr int DC = THREADS >= D ? 1 : D / THREADS;  // columns of a head per thread
    constexpr int R = (8 + HS - 1) / HS;                // heads per thread (of 8)
    const int t = threadIdx.x;
    const int j0 = THREADS >= D ? t / D : 0, d0 = t % D;
    int at[DC];  // where column d0 + c * THREADS lies in a warp's area, less the head
#pragma unroll
    for (int c = 0; c < DC; ++c) {
        int slot, tig;
        where(d0 + c * THREADS, slot, tig);
        at[c] = slot * FX_OPAD + tig;
    }
    float o[R][DC][WARPS], wt[R][WARPS];  // rows past the group: neither read nor written
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int j = j0 + r * HS;  // the same in a whole warp (D >= 64)
        if (j >= group) break;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            wt[r][w] = w_s[w][j];
#pragma unroll
            for (int c = 0; c < DC; ++c) o[r][c][w] = o_f[w * SLOTS * FX_OPAD + at[c] + j * 4];
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int j = j0 + r * HS;
        if (j >= group) break;
#pragma unroll
        for (int c = 0; c < DC; ++c) {
            float acc = 0.f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) acc += o[r][c][w] * wt[r][w];
            put_o(j, d0 + c * THREADS, acc);
        }
    }
}

// ---- Thread block clusters (compute capability 9.0 and up): the blocks of one KV head's
// chunks form one cluster and merge their partials through distributed shared memory, so
// no combine kernel runs and no partial goes through global memory. Elsewhere the cluster
// kernels trap (the host never picks them there).
#define FX_MAX_CLUSTER 16  // the largest (non-portable) cluster of compute capability 9.0
// A cluster block's receive area, in dynamic shared memory past its ring: the partials the
// cluster's blocks push to it, [FX_MAX_CLUSTER][8][2] maxima and sums, then [blocks][slots]
// float4 outputs (slots * blocks <= 8 * D / 4 + FX_MAX_CLUSTER). The host adds its size
// (attention.cluster_recv_bytes) to the launch's dynamic shared memory.
#define FX_RECV_FLOATS(D) (FX_MAX_CLUSTER * 16 + (2 * (D) + FX_MAX_CLUSTER) * 4)

__device__ __forceinline__ unsigned fx_cluster_rank() {
    unsigned r = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}
__device__ __forceinline__ unsigned fx_cluster_blocks() {
    unsigned n = 1;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
    return n;
}
// Cluster barrier halves (every thread of every block arrives, then waits; a thread waits
// once per arrival). Relaxed arrival: no memory ordering, only "this block has started".
__device__ __forceinline__ void fx_cluster_arrive_relaxed() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
    __trap();
#endif
}
// Release arrival: this thread's earlier writes (to any block's shared memory) are visible
// to every thread of the cluster once the wait below returns there.
__device__ __forceinline__ void fx_cluster_arrive_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void fx_cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// Store x at shared-memory address `addr` (this block's layout) of cluster block `rank`.
__device__ __forceinline__ void fx_cluster_store(unsigned addr, unsigned rank, float x) {
#if __CUDA_ARCH__ >= 900
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(x) : "memory");
#endif
}

// Trap unless the launch made the `splits` blocks of a KV head one cluster (a launch
// without clusters would write each chunk's partial as the output).
__device__ __forceinline__ void fx_check_cluster(int splits) {
    if (fx_cluster_blocks() != (unsigned)splits || gridDim.x != (unsigned)splits) __trap();
}

// The tensor-core kernels' start: check the launch (dynamic shared memory: the ring's
// `ring_bytes`, and with CLUSTER the receive area past it; threads; and with CLUSTER that
// the `splits` blocks of a KV head form one cluster), then
// this block's tokens [start, end) of its chunk `split`. False: the block has none and
// leaves. A cluster's blocks all stay (an idle one with end = start: no tokens) to take
// part in the merge, and arrive at the cluster barrier that fx_finish waits on before any
// block writes into another's shared memory (which must have started by then).
template <bool CLUSTER, int D>
__device__ __forceinline__ bool fx_block_chunk(unsigned ring_bytes, unsigned threads,
                                               int seq_len, const int* seq_len_dev, int splits,
                                               int tile, int split, int& start, int& end) {
    fx_check_launch(ring_bytes + (CLUSTER ? FX_RECV_FLOATS(D) * 4 : 0), threads);
    if (CLUSTER) {
        fx_check_cluster(splits);
        fx_cluster_arrive_relaxed();
    }
    if (fx_chunk_bounds(seq_len, seq_len_dev, splits, tile, split, start, end)) return true;
    if (!CLUSTER) return false;
    end = start;
    return true;
}

// The cluster's merge, once every block has pushed its partial into the receive areas
// (`recv`, this block's): out = sum_c w_c o_c / sum_c w_c l_c over the cluster's blocks c
// in order (bitwise reproducible), w_c = 2^(m_c - max m); seq <= 0 writes zeros. Output
// unit u (head u / (D/4), columns 4(u % (D/4))..+3) belongs to block u % blocks, in its
// slot u / blocks; a thread takes one of this block's units and reads only local shared
// memory. The pushes (remote stores, no round trip) and one barrier replace reads of the
// other blocks' shared memory, a round trip, and the second barrier those needed to keep
// every block alive while read (NOTES.md, v9).
template <class T, int D, int THREADS>
__device__ __forceinline__ void fx_cluster_merge(const float* recv, T* __restrict__ out, int h0,
                                                 int group, int seq) {
    fx_cluster_arrive_release();
    fx_cluster_wait();  // every block's pushes have landed
    const unsigned blocks = fx_cluster_blocks(), rank = fx_cluster_rank();
    const int units = group * D / 4, slots = (units + (int)blocks - 1) / (int)blocks;
    const float4* o4 = reinterpret_cast<const float4*>(recv + FX_MAX_CLUSTER * 16);
    for (int sl = threadIdx.x; sl < slots; sl += THREADS) {
        const int u = sl * (int)blocks + (int)rank;
        if (u >= units) break;
        const int j = u / (D / 4), d = (u % (D / 4)) * 4;
        float m[FX_MAX_CLUSTER], l[FX_MAX_CLUSTER];
        float4 o[FX_MAX_CLUSTER];
#pragma unroll
        for (int c = 0; c < FX_MAX_CLUSTER; ++c) {
            m[c] = -INFINITY;
            l[c] = 0.f;
            o[c] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (c < (int)blocks) {
                m[c] = recv[(c * 8 + j) * 2];
                l[c] = recv[(c * 8 + j) * 2 + 1];
                o[c] = o4[c * slots + sl];
            }
        }
        float mx = -INFINITY;
#pragma unroll
        for (int c = 0; c < FX_MAX_CLUSTER; ++c) mx = fmaxf(mx, m[c]);
        float lsum = 0.f;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int c = 0; c < FX_MAX_CLUSTER; ++c) {
            const float w = m[c] == -INFINITY ? 0.f : fx_exp2(m[c] - mx);
            lsum += w * l[c];
            acc.x += w * o[c].x;
            acc.y += w * o[c].y;
            acc.z += w * o[c].z;
            acc.w += w * o[c].w;
        }
        const float inv = seq > 0 ? 1.f / lsum : 0.f;
        T* dst = out + (long long)(h0 + j) * D + d;
        dst[0] = fx_from_float<T>(acc.x * inv);
        dst[1] = fx_from_float<T>(acc.y * inv);
        dst[2] = fx_from_float<T>(acc.z * inv);
        dst[3] = fx_from_float<T>(acc.w * inv);
    }
}

// The block's result, after the warps have parked their fragments in the merge area o_f
// (the first floats of the ring, RING bytes): without CLUSTER its partial goes to the
// workspace for the combine kernel; with CLUSTER each value is pushed to the receive area
// (past the ring) of the block whose output unit it feeds, and the cluster's merge writes
// the output.
template <bool CLUSTER, int WARPS, int D, int SLOTS, int RING, class T, class Where>
__device__ __forceinline__ void fx_finish(float* o_f, const float (*m_s)[8],
                                          const float (*l_s)[8], const float (*w_s)[8],
                                          float* ws_o, float* ws_ml,
                                          T* out, int h0, int group, int splits, int split,
                                          int seq_len, const int* seq_len_dev, Where where) {
    if (!CLUSTER) {
        fx_write_partial<WARPS, D, SLOTS>(
            o_f, m_s, l_s, w_s, group, where,
            [&](int j, int d, float x) {
                ws_o[((long long)(h0 + j) * splits + split) * D + d] = x;
            },
            [&](int j, float m, float l) {
                float* ml = ws_ml + ((long long)(h0 + j) * splits + split) * 2;
                ml[0] = m;
                ml[1] = l;
            });
        return;
    }
    static_assert(RING % 16 == 0 && D % 4 == 0, "the receive area must be 16-byte aligned");
    float* recv = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(o_f) + RING);
    const unsigned recv_at = (unsigned)__cvta_generic_to_shared(recv);
    const unsigned blocks = fx_cluster_blocks(), rank = fx_cluster_rank();
    const int slots = (group * D / 4 + (int)blocks - 1) / (int)blocks;
    fx_cluster_wait();  // every block of the cluster has started: its shared memory exists
    fx_write_partial<WARPS, D, SLOTS>(
        o_f, m_s, l_s, w_s, group, where,
        [&](int j, int d, float x) {  // unit u: to block u % blocks, [rank][u / blocks]
            const unsigned u = (unsigned)(j * D + d) >> 2;  // unsigned: a shorter division
            const unsigned at = FX_MAX_CLUSTER * 16 + (rank * slots + u / blocks) * 4 + (d & 3);
            fx_cluster_store(recv_at + at * 4, u % blocks, x);
        },
        [&](int j, float m, float l) {  // every block needs every head's max and sum
            const int at = ((int)rank * 8 + j) * 2;
            for (unsigned c = 0; c < blocks; ++c) {
                fx_cluster_store(recv_at + at * 4, c, m);
                fx_cluster_store(recv_at + (at + 1) * 4, c, l);
            }
        });
    fx_cluster_merge<T, D, WARPS * 32>(recv, out, h0, group, fx_seq_len(seq_len, seq_len_dev));
}

// One warp's K/V ring in the block's dynamic shared memory (fx_issue_step): S stages of
// [K, V][TOK][D], the block's WARPS warps taking turns, so this warp's step j holds tokens
// t0(j) .. t0(j) + TOK of the block's [start, end). fx_warp_ring queues the first S - 1.
template <class T, int D, int TOK, int S, int WARPS>
struct FxWarpRing {
    T* ring;
    const T* kg;  // the block's KV head at token 0
    const T* vg;
    long long row;  // elements from one token to the next
    int start, end, warp, lane;
    __device__ __forceinline__ int t0(int j) const {
        return start + warp * TOK + j * (WARPS * TOK);
    }
    __device__ __forceinline__ void issue(int j) const {
        fx_issue_step<T, D, TOK, S>(ring, j, t0(j), start, end, lane, kg, vg, row);
    }
    // step j's K rows (its V rows follow, TOK * D elements on)
    __device__ __forceinline__ const T* k_stage(int j) const {
        return ring + (j % S) * 2 * (TOK * D);
    }
};
template <class T, int D, int TOK, int S, int WARPS>
__device__ __forceinline__ FxWarpRing<T, D, TOK, S, WARPS> fx_warp_ring(
    unsigned char* smem, const T* k, const T* v, int g_kv, int n_kv_heads, int start, int end,
    int warp, int lane) {
    const FxWarpRing<T, D, TOK, S, WARPS> r{
        reinterpret_cast<T*>(smem) + warp * S * 2 * (TOK * D), k + (long long)g_kv * D,
        v + (long long)g_kv * D, (long long)n_kv_heads * D, start, end, warp, lane};
#pragma unroll
    for (int j = 0; j < S - 1; ++j) r.issue(j);
    return r;
}

// The tensor-core kernels' ending, once the warp's loop is done: the warps merged in a
// fixed order (bitwise reproducible), then fx_finish. Each warp parks its running max and
// sum per head (park_stats(m_s, l_s): m_s/l_s[warp][head]), and, once every warp is past its
// loop (the rings are free), its unscaled O accumulators in the ring in fragment order
// (park_o(o_f)): [warp][slot][lane] with rows of FX_OPAD floats, SLOTS accumulators per
// lane. The writes are whole rows, and fx_write_partial's column-ordered reads hit 32
// different banks. (Serial warp-by-warp rounds over a row-major o_s cost 4 us, with 16-way
// bank conflicts: NOTES.md v6.) `where` maps an output column to its fragment slot and lane.
template <bool CLUSTER, int WARPS, int D, int SLOTS, int RING, class T, class ParkStats,
          class ParkO, class Where>
__device__ __forceinline__ void fx_merge_parked(unsigned char* smem, ParkStats park_stats,
                                                ParkO park_o, float* ws_o, float* ws_ml, T* out,
                                                int h0, int group, int splits, int split,
                                                int seq_len, const int* seq_len_dev,
                                                Where where) {
    static_assert(WARPS * SLOTS * FX_OPAD * 4 <= RING, "the merge area must fit in the ring");
    __shared__ float m_s[WARPS][8];
    __shared__ float l_s[WARPS][8];
    __shared__ float w_s[WARPS][8];
    park_stats(m_s, l_s);
    float* o_f = reinterpret_cast<float*>(smem);
    __syncthreads();  // every warp is past its loop: the rings are free; m_s complete
    fx_let_combine_start<1>();
    fx_warp_weights<WARPS>(m_s, w_s);
    park_o(o_f);
    __syncthreads();
    fx_finish<CLUSTER, WARPS, D, SLOTS, RING>(o_f, m_s, l_s, w_s, ws_o, ws_ml, out, h0, group,
                                              splits, split, seq_len, seq_len_dev, where);
}

// fx_merge_parked for the kernels whose rows are heads: lane 4g + tig holds head g's running
// max and a quarter of its sum, and O accumulators oacc[A][B][2] (fx_park_fragments).
template <bool CLUSTER, int WARPS, int D, int RING, class T, int A, int B, class Where>
__device__ __forceinline__ void fx_merge_warps(unsigned char* smem, float m_run, float l_run,
                                               const float (&oacc)[A][B][2], float* ws_o,
                                               float* ws_ml, T* out, int h0, int group,
                                               int splits, int split, int seq_len,
                                               const int* seq_len_dev, Where where) {
    auto park_stats = [&](float (*m_s)[8], float (*l_s)[8]) {
        fx_park_warp_stats(m_run, l_run, m_s, l_s);
    };
    auto park_o = [&](float* o_f) {
        fx_park_fragments(o_f, oacc, threadIdx.x >> 5, threadIdx.x & 31);
    };
    fx_merge_parked<CLUSTER, WARPS, D, A * B * 2, RING>(smem, park_stats, park_o, ws_o, ws_ml,
                                                        out, h0, group, splits, split, seq_len,
                                                        seq_len_dev, where);
}

// Q of the block's group for the fp16/bf16 mma kernels, as a lane reads it: head g, d =
// kb*32 + tig*8 .. +8 (row g of the A operand, or column g of the swapped B operand). Staged
// in shared memory (heads past the group are zero; rows padded by 16 bytes against bank
// conflicts) and, up to head_dim 128, kept in registers, read once; for head_dim 256 that
// would take 32 more registers than there are (sm_100 spills): there `at` reads shared
// memory at each step.
template <class T, int D>
struct FxQ {
    static constexpr bool IN_REGS = D <= 128;
    uint4 frag[IN_REGS ? D / 32 : 1];
    const T* row;  // head g's row in shared memory
    __device__ __forceinline__ uint4 at(int kb, int tig) const {
        return IN_REGS ? frag[IN_REGS ? kb : 0]
                       : *reinterpret_cast<const uint4*>(row + kb * 32 + tig * 8);
    }
};
template <class T, int D, int THREADS>
__device__ __forceinline__ FxQ<T, D> fx_load_q(const T* q, int h0, int group, int g, int tig) {
    __shared__ __align__(16) T q_s[8][D + 8];
    for (int i = threadIdx.x; i < 8 * (D / 8); i += THREADS) {
        const int j = i / (D / 8), c = (i % (D / 8)) * 8;
        *reinterpret_cast<uint4*>(&q_s[j][c]) = fx_ldg16(q + (long long)(h0 + j) * D + c, j < group);
    }
    __syncthreads();  // q_s complete; the first steps' loads are already in flight
    FxQ<T, D> r;
    r.row = q_s[g];
    if (FxQ<T, D>::IN_REGS) {
#pragma unroll
        for (int kb = 0; kb < D / 32; ++kb)
            r.frag[kb] = *reinterpret_cast<const uint4*>(&q_s[g][kb * 32 + tig * 8]);
    }
    return r;
}

template <class T, int D, bool CLUSTER>
__device__ __forceinline__ void gqa_split_mma(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    float* __restrict__ ws_o, float* __restrict__ ws_ml, T* __restrict__ out, int n_heads,
    int n_kv_heads, int seq_len, const int* __restrict__ seq_len_dev, int splits, int tile) {
    constexpr int S = FxStages<D>::value;
    constexpr int WARPS = FxWarps<D>::value, THREADS = WARPS * 32;
    constexpr int STEP = 16 * D;          // elements of one step's K (or V)
    extern __shared__ __align__(16) unsigned char fx_dyn_smem[];

    fx_let_combine_start<2>();
    const int split = blockIdx.x;
    int start, end;
    if (!fx_block_chunk<CLUSTER, D>(WARPS * S * 2 * STEP * sizeof(T), THREADS, seq_len,
                                    seq_len_dev, splits, tile, split, start, end))
        return;

    const int g_kv = blockIdx.y;
    const int group = n_heads / n_kv_heads;  // <= 8 on this path
    const int h0 = g_kv * group;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;

    // this warp's ring of 16-token steps, the first S - 1 queued
    const auto wr = fx_warp_ring<T, D, 16, S, WARPS>(fx_dyn_smem, k, v, g_kv, n_kv_heads,
                                                      start, end, warp, lane);

    // Q as the A operand (rows = heads; rows 8..15 are zero)
    const FxQ<T, D> qf = fx_load_q<T, D, THREADS>(q, h0, group, g, tig);

    const float sscale = rsqrtf((float)D) * FX_LOG2E;

    // O accumulators: [64-d block][e]: c0 -> d = hb*64 + (2 tig)*8 + e, c1 -> +8. The
    // padding rows' outputs (c2, c3) only ever add zero rows: a scratch pair per chain of
    // mmas takes them (PADS short chains per 64-d block instead of 2 registers per mma).
    constexpr int PADS = D <= 128 ? 4 : 2;
    float oacc[D / 64][8][2], pad[D / 64][PADS][2];
#pragma unroll
    for (int hb = 0; hb < D / 64; ++hb) {
#pragma unroll
        for (int i = 0; i < PADS; ++i) pad[hb][i][0] = pad[hb][i][1] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) oacc[hb][e][0] = oacc[hb][e][1] = 0.f;
    }
    float m_run = -INFINITY, l_run = 0.f;  // head g; l_run is this lane's partial sum

    for (int j = 0; wr.t0(j) < end; ++j) {
        wr.issue(j + S - 1);
        fx_cp_async_wait<S - 1>();  // step j has landed (this lane's copies) ...
        __syncwarp();               // ... and every lane's
        const int t0 = wr.t0(j);
        const T* ks = wr.k_stage(j);
        const T* vs = ks + STEP;
        const int ta = t0 + tig * 2, tc = ta + 8;
        // ---- S = Q K^T for tokens t0..t0+7 (n = 0) and t0+8..t0+15 (n = 1)
        // (two accumulator chains per n, the 16-byte reads' halves, added at the end: the
        // mmas' latency is this loop's critical path at short lengths)
        float s[2][4], s2[2][4];
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            const int r = n * 8 + g;
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
            s2[n][0] = s2[n][1] = s2[n][2] = s2[n][3] = 0.f;
#pragma unroll
            for (int kb = 0; kb < D / 32; ++kb) {
                const int c = (kb * 4 + tig) ^ ((r & 1) << 2);
                const uint4 kv = *reinterpret_cast<const uint4*>(ks + r * D + c * 8);
                const uint4 qv = qf.at(kb, tig);
                FxMma<T>::run(s[n][0], s[n][1], s[n][2], s[n][3], qv.x, 0u, qv.y, 0u, kv.x, kv.y);
                FxMma<T>::run(s2[n][0], s2[n][1], s2[n][2], s2[n][3], qv.z, 0u, qv.w, 0u, kv.z,
                              kv.w);
            }
            s[n][0] += s2[n][0];
            s[n][1] += s2[n][1];
        }
        // ---- online softmax for head g over this lane's 4 scores (tokens of c0, c1)
        float x[4];
        x[0] = ta < end ? s[0][0] * sscale : -INFINITY;
        x[1] = ta + 1 < end ? s[0][1] * sscale : -INFINITY;
        x[2] = tc < end ? s[1][0] * sscale : -INFINITY;
        x[3] = tc + 1 < end ? s[1][1] * sscale : -INFINITY;
        float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run, mx);
        const float alpha = m_run == -INFINITY ? 0.f : fx_exp2(m_run - m_new);
        float p[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) p[i] = x[i] == -INFINITY ? 0.f : fx_exp2(x[i] - m_new);
        l_run = l_run * alpha + ((p[0] + p[1]) + (p[2] + p[3]));
        m_run = m_new;
        const unsigned pa0 = fx_pack2<T>(p[0], p[1]);  // P[g][tokens 2tig, 2tig+1]
        const unsigned pa2 = fx_pack2<T>(p[2], p[3]);  // P[g][tokens 8+2tig, 9+2tig]
        // ---- O = O * alpha + P V; this lane's V rows are 2tig, 2tig+1, 2tig+8, 2tig+9
#pragma unroll
        for (int hb = 0; hb < D / 64; ++hb) {
            const int c = (hb * 8 + g) ^ (tig * 2);  // (r & 6) == 2 tig for all four rows
            const uint4 va = *reinterpret_cast<const uint4*>(vs + (tig * 2) * D + c * 8);
            const uint4 vb = *reinterpret_cast<const uint4*>(vs + (tig * 2 + 1) * D + c * 8);
            const uint4 vc = *reinterpret_cast<const uint4*>(vs + (tig * 2 + 8) * D + c * 8);
            const uint4 vd = *reinterpret_cast<const uint4*>(vs + (tig * 2 + 9) * D + c * 8);
            const unsigned wa[4] = {va.x, va.y, va.z, va.w};
            const unsigned wb[4] = {vb.x, vb.y, vb.z, vb.w};
            const unsigned wc[4] = {vc.x, vc.y, vc.z, vc.w};
            const unsigned wd[4] = {vd.x, vd.y, vd.z, vd.w};
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const unsigned sel = (e & 1) ? 0x7632u : 0x5410u;
                const unsigned b0 = __byte_perm(wa[e >> 1], wb[e >> 1], sel);
                const unsigned b1 = __byte_perm(wc[e >> 1], wd[e >> 1], sel);
                oacc[hb][e][0] *= alpha;
                oacc[hb][e][1] *= alpha;
                FxMma<T>::run(oacc[hb][e][0], oacc[hb][e][1], pad[hb][e % PADS][0],
                              pad[hb][e % PADS][1], pa0, 0u, pa2, 0u, b0, b1);
            }
        }
        __syncwarp();  // every lane is done with this stage before it is refilled
    }
    fx_cp_async_wait<0>();  // no copy may land after the block has left

    // ---- the warps' merge and the block's result. Output column d = hb*64 + tig*16 +
    // c*8 + e is slot hb*16 + e*2 + c of lane 4*head + tig (see oacc).
    auto where = [](int d, int& slot, int& t) {
        slot = (d / 64) * 16 + (d % 8) * 2 + (d / 8) % 2;
        t = (d % 64) / 16;
    };
    fx_merge_warps<CLUSTER, WARPS, D, WARPS * S * 2 * STEP * (int)sizeof(T)>(
        fx_dyn_smem, m_run, l_run, oacc, ws_o, ws_ml, out, h0, group, splits, split, seq_len,
        seq_len_dev, where);
}

// The same decode with the mma's operands swapped (head_dim 128; FX_MMA_SWAPPED_D<D>,
// docs/perf-history/mma_swapped_compare.py). gqa_split_mma gives the heads the mma's 16
// rows, of which a group fills at most 8; here the rows are 16 tokens (S^T = K Q^T) and 16
// columns of d (O^T += V^T P^T), the heads are the 8 columns, and every row is used: half
// the mmas. The scores come out as (token, head) and P^T is needed as (head, tokens): each
// 8x8 block of P is transposed in registers (movmatrix). A lane keeps the running max and
// sum of heads 2tig and 2tig + 1.
__device__ __forceinline__ unsigned fx_movmatrix_trans(unsigned x) {
    unsigned y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

template <class T, int D, bool CLUSTER>
__device__ __forceinline__ void gqa_split_mma_swapped(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    float* __restrict__ ws_o, float* __restrict__ ws_ml, T* __restrict__ out, int n_heads,
    int n_kv_heads, int seq_len, const int* __restrict__ seq_len_dev, int splits, int tile) {
    constexpr int S = FxStages<D>::value;
    constexpr int WARPS = FxWarps<D>::value, THREADS = WARPS * 32;
    constexpr int STEP = 16 * D;  // elements of one step's K (or V)
    constexpr int RING = WARPS * S * 2 * STEP * (int)sizeof(T);
    extern __shared__ __align__(16) unsigned char fx_dyn_smem[];

    fx_let_combine_start<2>();
    const int split = blockIdx.x;
    int start, end;
    if (!fx_block_chunk<CLUSTER, D>(RING, THREADS, seq_len, seq_len_dev, splits, tile, split,
                                    start, end))
        return;

    const int g_kv = blockIdx.y;
    const int group = n_heads / n_kv_heads;  // <= 8 on this path
    const int h0 = g_kv * group;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;

    const auto wr = fx_warp_ring<T, D, 16, S, WARPS>(fx_dyn_smem, k, v, g_kv, n_kv_heads,
                                                      start, end, warp, lane);

    // Q as the B operand (n = heads), read as gqa_split_mma reads it for its A operand
    const FxQ<T, D> qf = fx_load_q<T, D, THREADS>(q, h0, group, g, tig);

    const float sscale = rsqrtf((float)D) * FX_LOG2E;

    // O^T accumulators [64-d block][i][c]: d = hb*64 + g*8 + 2i + (c >> 1), head
    // 2tig + (c & 1).
    float oacc[D / 64][4][4];
#pragma unroll
    for (int hb = 0; hb < D / 64; ++hb)
#pragma unroll
        for (int i = 0; i < 4; ++i) oacc[hb][i][0] = oacc[hb][i][1] = oacc[hb][i][2] = oacc[hb][i][3] = 0.f;
    // heads 2tig (a) and 2tig + 1 (b): running max, and this lane's share of the sum
    float ma = -INFINITY, mb = -INFINITY, la = 0.f, lb = 0.f;

    for (int j = 0; wr.t0(j) < end; ++j) {
        wr.issue(j + S - 1);
        fx_cp_async_wait<S - 1>();
        __syncwarp();
        const int t0 = wr.t0(j);
        const T* ks = wr.k_stage(j);
        const T* vs = ks + STEP;
        // ---- S^T = K Q^T: rows = tokens t0 + g (c0, c1) and t0 + g + 8 (c2, c3), columns
        // = heads 2tig, 2tig + 1; two chains (the 16-byte reads' halves)
        float s[4] = {0.f, 0.f, 0.f, 0.f}, s2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int kb = 0; kb < D / 32; ++kb) {
            const int cg = (kb * 4 + tig) ^ ((g & 1) << 2);  // rows g and g + 8: same parity
            const uint4 ka = *reinterpret_cast<const uint4*>(ks + g * D + cg * 8);
            const uint4 kc = *reinterpret_cast<const uint4*>(ks + (g + 8) * D + cg * 8);
            const uint4 qv = qf.at(kb, tig);
            FxMma<T>::run(s[0], s[1], s[2], s[3], ka.x, kc.x, ka.y, kc.y, qv.x, qv.y);
            FxMma<T>::run(s2[0], s2[1], s2[2], s2[3], ka.z, kc.z, ka.w, kc.w, qv.z, qv.w);
        }
        const int ta = t0 + g, tc = ta + 8;
        float x[4];
        x[0] = ta < end ? (s[0] + s2[0]) * sscale : -INFINITY;  // head a
        x[1] = ta < end ? (s[1] + s2[1]) * sscale : -INFINITY;  // head b
        x[2] = tc < end ? (s[2] + s2[2]) * sscale : -INFINITY;  // head a
        x[3] = tc < end ? (s[3] + s2[3]) * sscale : -INFINITY;  // head b
        float mxa = fmaxf(x[0], x[2]), mxb = fmaxf(x[1], x[3]);
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
            mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, o));
            mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, o));
        }
        const float na = fmaxf(ma, mxa), nb = fmaxf(mb, mxb);
        const float alpha_a = ma == -INFINITY ? 0.f : fx_exp2(ma - na);
        const float alpha_b = mb == -INFINITY ? 0.f : fx_exp2(mb - nb);
        float p[4];
        p[0] = x[0] == -INFINITY ? 0.f : fx_exp2(x[0] - na);
        p[1] = x[1] == -INFINITY ? 0.f : fx_exp2(x[1] - nb);
        p[2] = x[2] == -INFINITY ? 0.f : fx_exp2(x[2] - na);
        p[3] = x[3] == -INFINITY ? 0.f : fx_exp2(x[3] - nb);
        la = la * alpha_a + (p[0] + p[2]);
        lb = lb * alpha_b + (p[1] + p[3]);
        ma = na;
        mb = nb;
        // P^T as the B operand: (tokens 2tig, 2tig + 1; head g) and (tokens 2tig + 8, + 9;
        // head g), each 8x8 block of P (token g; heads 2tig, 2tig + 1) transposed
        const unsigned pb0 = fx_movmatrix_trans(fx_pack2<T>(p[0], p[1]));
        const unsigned pb1 = fx_movmatrix_trans(fx_pack2<T>(p[2], p[3]));
        // ---- O^T = O^T * alpha + V^T P^T; this lane's V rows are 2tig, 2tig+1, 2tig+8,
        // 2tig+9, at d = hb*64 + g*8 .. +8 (rows g and g + 8 of the mma: elements 2i, 2i+1)
#pragma unroll
        for (int hb = 0; hb < D / 64; ++hb) {
            const int c = (hb * 8 + g) ^ (tig * 2);
            const uint4 va = *reinterpret_cast<const uint4*>(vs + (tig * 2) * D + c * 8);
            const uint4 vb = *reinterpret_cast<const uint4*>(vs + (tig * 2 + 1) * D + c * 8);
            const uint4 vc = *reinterpret_cast<const uint4*>(vs + (tig * 2 + 8) * D + c * 8);
            const uint4 vd = *reinterpret_cast<const uint4*>(vs + (tig * 2 + 9) * D + c * 8);
            const unsigned wa[4] = {va.x, va.y, va.z, va.w};
            const unsigned wb[4] = {vb.x, vb.y, vb.z, vb.w};
            const unsigned wc[4] = {vc.x, vc.y, vc.z, vc.w};
            const unsigned wd[4] = {vd.x, vd.y, vd.z, vd.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const unsigned a0 = __byte_perm(wa[i], wb[i], 0x5410u);  // d element 2i
                const unsigned a1 = __byte_perm(wa[i], wb[i], 0x7632u);  // d element 2i+1
                const unsigned a2 = __byte_perm(wc[i], wd[i], 0x5410u);
                const unsigned a3 = __byte_perm(wc[i], wd[i], 0x7632u);
                float* o = oacc[hb][i];
                o[0] *= alpha_a;
                o[1] *= alpha_b;
                o[2] *= alpha_a;
                o[3] *= alpha_b;
                FxMma<T>::run(o[0], o[1], o[2], o[3], a0, a1, a2, a3, pb0, pb1);
            }
        }
        __syncwarp();
    }
    fx_cp_async_wait<0>();

    // ---- the warps' merge, as gqa_split_mma's, from this layout: the sums over the lanes
    // of a column (xor 4, 8, 16), then head 2tig's max and sum from lane tig
    la += __shfl_xor_sync(0xffffffffu, la, 4);
    lb += __shfl_xor_sync(0xffffffffu, lb, 4);
    la += __shfl_xor_sync(0xffffffffu, la, 8);
    lb += __shfl_xor_sync(0xffffffffu, lb, 8);
    la += __shfl_xor_sync(0xffffffffu, la, 16);
    lb += __shfl_xor_sync(0xffffffffu, lb, 16);
    auto park_stats = [&](float (*m_s)[8], float (*l_s)[8]) {
        if (g == 0) {
            m_s[warp][2 * tig] = ma;
            m_s[warp][2 * tig + 1] = mb;
            l_s[warp][2 * tig] = la;
            l_s[warp][2 * tig + 1] = lb;
        }
    };
    // column d = hb*64 + g*8 + e of head h: slot hb*16 + (g >> 2)*8 + e of lane 4h + (g & 3)
    constexpr int SLOTS = D / 4;
    auto park_o = [&](float* o_f) {
#pragma unroll
        for (int hb = 0; hb < D / 64; ++hb)
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int slot = hb * 16 + (g >> 2) * 8 + 2 * i + (c >> 1);
                    const int ln = 4 * (2 * tig + (c & 1)) + (g & 3);
                    o_f[(warp * SLOTS + slot) * FX_OPAD + ln] = oacc[hb][i][c];
                }
    };
    auto where = [](int d, int& slot, int& t) {
        const int gg = (d % 64) / 8;
        slot = (d / 64) * 16 + (gg >> 2) * 8 + d % 8;
        t = gg & 3;
    };
    fx_merge_parked<CLUSTER, WARPS, D, SLOTS, RING>(fx_dyn_smem, park_stats, park_o, ws_o, ws_ml,
                                                    out, h0, group, splits, split, seq_len,
                                                    seq_len_dev, where);
}

// Which head_dims take the swapped operands: measured against gqa_split_mma on the same
// plans (mma-swapped-compare-v17.log), head_dim 128 was 0.1-2.3% faster (2% at 512 tokens,
// 0.3-0.5% at 32768-131072) and 64 and 256 0.2-2.1% slower at 512-32768: halving the
// mmas did not speed up the small shapes, so they were not bound by the tensor cores.
#ifndef FX_MMA_SWAPPED_D64
#define FX_MMA_SWAPPED_D64 0
#endif
#ifndef FX_MMA_SWAPPED_D128
#define FX_MMA_SWAPPED_D128 1
#endif
#ifndef FX_MMA_SWAPPED_D256
#define FX_MMA_SWAPPED_D256 0
#endif
template <class T, int D, bool CLUSTER>
__device__ __forceinline__ void fx_mma_body(const T* q, const T* k, const T* v, float* ws_o,
                                            float* ws_ml, T* out, int n_heads, int n_kv_heads,
                                            int seq_len, const int* seq_len_dev, int splits,
                                            int tile) {
    constexpr bool SWAPPED = D == 64    ? FX_MMA_SWAPPED_D64
                             : D == 128 ? FX_MMA_SWAPPED_D128
                                        : FX_MMA_SWAPPED_D256;
    if (SWAPPED)
        gqa_split_mma_swapped<T, D, CLUSTER>(q, k, v, ws_o, ws_ml, out, n_heads, n_kv_heads,
                                             seq_len, seq_len_dev, splits, tile);
    else
        gqa_split_mma<T, D, CLUSTER>(q, k, v, ws_o, ws_ml, out, n_heads, n_kv_heads, seq_len,
                                     seq_len_dev, splits, tile);
}

// Each kernel twice: with a combine kernel (partials to the workspace), and "_cluster"
// (launched in clusters of `splits` blocks per KV head, writes the output). Chunks are
// multiples of `tile` tokens (16 to FX_TILE; the host picks it per plan).
#define FX_MMA_ENTRY(NAME, T, D)                                                            \
    extern "C" __global__ void __launch_bounds__(FX_WARPS_D##D * 32, 1) NAME(               \
        const T* q, const T* k, const T* v, float* ws_o, float* ws_ml, int n_heads,         \
        int n_kv_heads, int seq_len, const int* seq_len_dev, int splits, int tile) {        \
        fx_mma_body<T, D, false>(q, k, v, ws_o, ws_ml, nullptr, n_heads, n_kv_heads,        \
                                 seq_len, seq_len_dev, splits, tile);                       \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(FX_WARPS_D##D * 32, 1) NAME##_cluster(     \
        const T* q, const T* k, const T* v, T* out, int n_heads, int n_kv_heads,            \
        int seq_len, const int* seq_len_dev, int splits, int tile) {                        \
        fx_mma_body<T, D, true>(q, k, v, nullptr, nullptr, out, n_heads, n_kv_heads,        \
                                seq_len, seq_len_dev, splits, tile);                        \
    }

FX_MMA_ENTRY(gqa_split_mma_f16_d64, fx_half, 64)
FX_MMA_ENTRY(gqa_split_mma_f16_d128, fx_half, 128)
FX_MMA_ENTRY(gqa_split_mma_f16_d256, fx_half, 256)
FX_MMA_ENTRY(gqa_split_mma_bf16_d64, fx_bf16, 64)
FX_MMA_ENTRY(gqa_split_mma_bf16_d128, fx_bf16, 128)
FX_MMA_ENTRY(gqa_split_mma_bf16_d256, fx_bf16, 256)

// ---------------------------------------------------------------------------------------
// Tensor-core split kernel for fp32 caches (head_dim 64/128/256, groups of up to 8): the same
// design as gqa_split_mma, on mma m16n8k8 with TF32 inputs split in two: each fp32 x is
// split into hi = tf32(x) and lo = tf32(x - hi), and a*b = al*bl + ah*bl + al*bh + ah*bh,
// which keeps fp32 accuracy. Rows 0..7 of A (the heads) carry the high part and rows 8..15
// the low part, so two mmas give the four terms (fx_mma_2xtf32; "3xTF32" on rows 0..7 alone
// took three for three terms).
//   S = Q K^T: rows = heads (+ 8: low parts), k = d, n = tokens. A lane reads 4 consecutive
//     d of its row (16 bytes) and feeds them to two mmas (k slots tig and tig+4 of each);
//     Q is read the same way, so the dot products pair up the same d.
//   O += P V: k = tokens, n = d. The S accumulators give this lane P for tokens 2tig and
//     2tig+1 of each 8: they are k slots tig and tig+4, so V rows 2tig and 2tig+1 are read.
//     The n dimension is permuted too: for each 32 d, lane g reads the 16 bytes at
//     d = 4g..4g+3 of both rows and block j (0..3) takes element j, so n = g <-> d = 4g + j
//     and the accumulators c0/c1 of block (q, j) hold d = 32q + 4(2tig) + j and +4.
// Shared-memory rows are swizzled in 16-byte units as in gqa_split_mma.
// Per head_dim: warps per block, steps in each warp's ring and tokens per step (8 or 16:
// 8-token steps fit more warps or a wider head_dim into shared memory). The host reads
// these defines (attention.py); overridable with -D for experiments
// (docs/perf-history/tc32_variants.py). Head_dim 64 and 128 keep one step in flight per warp
// while they compute another: 8-12% faster at 4096 tokens than two in flight, 1-7% at
// 32768 but for 64/8/128 (0.5% slower there, 1.2% at 131072); head_dim 256 keeps two, as
// one was 1.1% slower at 512-4096 (tc32-ring-variants-v17.log). FX_TC32_RESERVE_STAGES_D<D>:
// the launch's shared memory in steps, as measured (as FX_RESERVE_STAGES_D<D>).
template <int D> struct FxTc32Shape;
#define FX_TC32_RESERVE_STAGES_D64 3
#define FX_TC32_RESERVE_STAGES_D128 3
#define FX_TC32_RESERVE_STAGES_D256 3
#ifndef FX_TC32_WARPS_D64
#define FX_TC32_WARPS_D64 8
#endif
#ifndef FX_TC32_STAGES_D64
#define FX_TC32_STAGES_D64 2
#endif
#ifndef FX_TC32_TOKENS_D64
#define FX_TC32_TOKENS_D64 16
#endif
#ifndef FX_TC32_WARPS_D128
#define FX_TC32_WARPS_D128 8
#endif
#ifndef FX_TC32_STAGES_D128
#define FX_TC32_STAGES_D128 2
#endif
#ifndef FX_TC32_TOKENS_D128
#define FX_TC32_TOKENS_D128 8
#endif
#ifndef FX_TC32_WARPS_D256
#define FX_TC32_WARPS_D256 4
#endif
#ifndef FX_TC32_STAGES_D256
#define FX_TC32_STAGES_D256 3
#endif
#ifndef FX_TC32_TOKENS_D256
#define FX_TC32_TOKENS_D256 8
#endif
template <> struct FxTc32Shape<64> {
    static constexpr int warps = FX_TC32_WARPS_D64, stages = FX_TC32_STAGES_D64;
    static constexpr int tokens = FX_TC32_TOKENS_D64;
};
template <> struct FxTc32Shape<128> {
    static constexpr int warps = FX_TC32_WARPS_D128, stages = FX_TC32_STAGES_D128;
    static constexpr int tokens = FX_TC32_TOKENS_D128;
};
template <> struct FxTc32Shape<256> {
    static constexpr int warps = FX_TC32_WARPS_D256, stages = FX_TC32_STAGES_D256;
    static constexpr int tokens = FX_TC32_TOKENS_D256;
};

// x = hi + lo, both TF32 (as bit patterns for the mma).
__device__ __forceinline__ void fx_split_tf32(float x, unsigned& hi, unsigned& lo) {
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(hi) : "f"(x));
    const float rest = x - __uint_as_float(hi);
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(lo) : "f"(rest));
}

// D(16x8) += A(16x8) B(8x8), TF32 in, f32 accumulate. A's rows g and g + 8 of this lane:
// a0 (k = tig), a1 (row g + 8, k = tig), a2 (k = tig + 4), a3 (row g + 8, k = tig + 4).
__device__ __forceinline__ void fx_mma_tf32(float& c0, float& c1, float& c2, float& c3,
                                            unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                            unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// a*b in split TF32 on two mmas: A's 8 rows (heads) carry a's high part and rows 8..15 (which
// the group leaves empty) its low part, so the mma with b's low part gives a_hi b_lo and
// a_lo b_lo, the one with its high part a_hi b_hi and a_lo b_hi. The product of row g is
// then c0 + c2 (c1 + c3): all four terms, where 3xTF32 on rows 0..7 alone took three mmas
// for three of them.
__device__ __forceinline__ void fx_mma_2xtf32(float& c0, float& c1, float& c2, float& c3,
                                              unsigned ah0, unsigned al0, unsigned ah2,
                                              unsigned al2, unsigned bh0, unsigned bl0,
                                              unsigned bh1, unsigned bl1) {
    fx_mma_tf32(c0, c1, c2, c3, ah0, al0, ah2, al2, bl0, bl1);  // small terms first
    fx_mma_tf32(c0, c1, c2, c3, ah0, al0, ah2, al2, bh0, bh1);
}

template <int D, bool CLUSTER>  // CLUSTER: as gqa_split_mma
__device__ __forceinline__ void gqa_split_tc32(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    float* __restrict__ ws_o, float* __restrict__ ws_ml, float* __restrict__ out, int n_heads,
    int n_kv_heads, int seq_len, const int* __restrict__ seq_len_dev, int splits, int tile) {
    constexpr int S = FxTc32Shape<D>::stages;
    constexpr int WARPS = FxTc32Shape<D>::warps, THREADS = WARPS * 32;
    constexpr int TOK = FxTc32Shape<D>::tokens, NB = TOK / 8;  // tokens per step, 8-blocks
    static_assert(TOK == 8 || TOK == 16, "steps of 8 or 16 tokens");
    constexpr int NCH = D / 4;     // 16-byte chunks per row
    constexpr int STEP = TOK * D;  // floats of one step's K (or V)
    extern __shared__ __align__(16) unsigned char fx_dyn_smem[];

    fx_let_combine_start<2>();
    const int split = blockIdx.x;
    int start, end;
    if (!fx_block_chunk<CLUSTER, D>(WARPS * S * 2 * STEP * sizeof(float), THREADS, seq_len,
                                    seq_len_dev, splits, tile, split, start, end))
        return;

    const int g_kv = blockIdx.y;
    const int group = n_heads / n_kv_heads;  // <= 8 on this path
    const int h0 = g_kv * group;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;

    const auto wr = fx_warp_ring<float, D, TOK, S, WARPS>(fx_dyn_smem, k, v, g_kv, n_kv_heads,
                                                          start, end, warp, lane);

    // Q, pre-scaled into the base-2 domain and split into TF32 pairs, in shared memory
    // (in registers it would take 2 * D / 4 of them): rows = heads, padded by 16 bytes.
    __shared__ __align__(16) unsigned qh_s[8][D + 4];
    __shared__ __align__(16) unsigned ql_s[8][D + 4];
    const float sscale = rsqrtf((float)D) * FX_LOG2E;
    for (int i = threadIdx.x; i < 8 * NCH; i += THREADS) {
        const int j = i / NCH, c = (i % NCH) * 4;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (j < group) x = __ldg(reinterpret_cast<const float4*>(q + (long long)(h0 + j) * D + c));
        uint4 hi, lo;
        fx_split_tf32(x.x * sscale, hi.x, lo.x);
        fx_split_tf32(x.y * sscale, hi.y, lo.y);
        fx_split_tf32(x.z * sscale, hi.z, lo.z);
        fx_split_tf32(x.w * sscale, hi.w, lo.w);
        *reinterpret_cast<uint4*>(&qh_s[j][c]) = hi;
        *reinterpret_cast<uint4*>(&ql_s[j][c]) = lo;
    }
    __syncthreads();  // Q complete; the first steps' loads are already in flight

    // O accumulators [q][j][c0, c1] (d = 32q + 4(2tig + c) + j, head g); each step's low
    // parts (rows 8..15, fx_mma_2xtf32) are added in.
    float oacc[D / 32][4][2];
#pragma unroll
    for (int qq = 0; qq < D / 32; ++qq)
#pragma unroll
        for (int j = 0; j < 4; ++j) oacc[qq][j][0] = oacc[qq][j][1] = 0.f;
    float m_run = -INFINITY, l_run = 0.f;

    for (int j = 0; wr.t0(j) < end; ++j) {
        wr.issue(j + S - 1);
        fx_cp_async_wait<S - 1>();
        __syncwarp();
        const int t0 = wr.t0(j);
        const float* ks = wr.k_stage(j);
        const float* vs = ks + STEP;
        // ---- S = Q K^T, tokens t0 + 8n .. +7 for each n < NB; two chains each. Lane
        // (g, tig) takes head g, d = 16p + 4tig .. +3 of Q and of token rows 8n + g.
        float s[NB][4], s2[NB][4];
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[n][i] = s2[n][i] = 0.f;
#pragma unroll
        for (int p = 0; p < D / 16; ++p) {
            const uint4 qh = *reinterpret_cast<const uint4*>(&qh_s[g][16 * p + 4 * tig]);
            const uint4 ql = *reinterpret_cast<const uint4*>(&ql_s[g][16 * p + 4 * tig]);
#pragma unroll
            for (int n = 0; n < NB; ++n) {
                const int r = n * 8 + g;
                const int c = (p * 4 + tig) ^ ((r & 1) << 2);
                const float4 kv = *reinterpret_cast<const float4*>(ks + r * D + c * 4);
                unsigned kh[4], kl[4];
                fx_split_tf32(kv.x, kh[0], kl[0]);
                fx_split_tf32(kv.y, kh[1], kl[1]);
                fx_split_tf32(kv.z, kh[2], kl[2]);
                fx_split_tf32(kv.w, kh[3], kl[3]);
                fx_mma_2xtf32(s[n][0], s[n][1], s[n][2], s[n][3], qh.x, ql.x, qh.y, ql.y, kh[0],
                              kl[0], kh[1], kl[1]);
                fx_mma_2xtf32(s2[n][0], s2[n][1], s2[n][2], s2[n][3], qh.z, ql.z, qh.w, ql.w,
                              kh[2], kl[2], kh[3], kl[3]);
            }
        }
        // ---- online softmax for head g over this lane's scores: tokens t0 + 8n + 2tig + e
        float x[2 * NB];
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                x[2 * n + e] =
                    t0 + 8 * n + 2 * tig + e < end
                        ? (s[n][e] + s[n][e + 2]) + (s2[n][e] + s2[n][e + 2])
                        : -INFINITY;
        float mx = x[0];
#pragma unroll
        for (int i = 1; i < 2 * NB; ++i) mx = fmaxf(mx, x[i]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run, mx);
        const float alpha = m_run == -INFINITY ? 0.f : fx_exp2(m_run - m_new);
        float p[2 * NB];
#pragma unroll
        for (int i = 0; i < 2 * NB; ++i) p[i] = x[i] == -INFINITY ? 0.f : fx_exp2(x[i] - m_new);
        float psum = p[0] + p[1];
#pragma unroll
        for (int n = 1; n < NB; ++n) psum += p[2 * n] + p[2 * n + 1];
        l_run = l_run * alpha + psum;
        m_run = m_new;
#pragma unroll
        for (int qq = 0; qq < D / 32; ++qq)
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                oacc[qq][jj][0] *= alpha;
                oacc[qq][jj][1] *= alpha;
            }
        // ---- O += P V, tokens of S block kb: k slot tig <-> token 8kb + 2tig, slot tig+4
        // <-> 8kb + 2tig + 1
#pragma unroll
        for (int kb = 0; kb < NB; ++kb) {
            unsigned ph0, pl0, ph2, pl2;
            fx_split_tf32(p[2 * kb], ph0, pl0);
            fx_split_tf32(p[2 * kb + 1], ph2, pl2);
            const int ra = kb * 8 + tig * 2;  // rows ra, ra + 1: (r & 6) == 2 tig for both
#pragma unroll
            for (int qq = 0; qq < D / 32; ++qq) {
                const int c = (qq * 8 + g) ^ (tig * 2);
                const float4 va = *reinterpret_cast<const float4*>(vs + ra * D + c * 4);
                const float4 vb = *reinterpret_cast<const float4*>(vs + (ra + 1) * D + c * 4);
                const float wa[4] = {va.x, va.y, va.z, va.w};
                const float wb[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    unsigned bh0, bl0, bh1, bl1;
                    fx_split_tf32(wa[jj], bh0, bl0);
                    fx_split_tf32(wb[jj], bh1, bl1);
                    float lo0 = 0.f, lo1 = 0.f;
                    fx_mma_2xtf32(oacc[qq][jj][0], oacc[qq][jj][1], lo0, lo1, ph0, pl0, ph2,
                                  pl2, bh0, bl0, bh1, bl1);
                    oacc[qq][jj][0] += lo0;
                    oacc[qq][jj][1] += lo1;
                }
            }
        }
        __syncwarp();  // every lane is done with this stage before it is refilled
    }
    fx_cp_async_wait<0>();

    // ---- the warps' merge and the block's result, as gqa_split_mma. Output column
    // d = 32q + 4n + j with n = 2tig + c is slot q*8 + j*2 + c of lane 4*head + tig.
    auto where = [](int d, int& slot, int& t) {
        const int n = (d % 32) / 4;
        slot = (d / 32) * 8 + (d % 4) * 2 + (n & 1);
        t = n >> 1;
    };
    fx_merge_warps<CLUSTER, WARPS, D, WARPS * S * 2 * STEP * (int)sizeof(float)>(
        fx_dyn_smem, m_run, l_run, oacc, ws_o, ws_ml, out, h0, group, splits, split, seq_len,
        seq_len_dev, where);
}

#define FX_TC32_ENTRY(NAME, D)                                                              \
    extern "C" __global__ void __launch_bounds__(FX_TC32_WARPS_D##D * 32, 1) NAME(          \
        const float* q, const float* k, const float* v, float* ws_o, float* ws_ml,          \
        int n_heads, int n_kv_heads, int seq_len, const int* seq_len_dev, int splits,       \
        int tile) {                                                                         \
        gqa_split_tc32<D, false>(q, k, v, ws_o, ws_ml, nullptr, n_heads, n_kv_heads,        \
                                 seq_len, seq_len_dev, splits, tile);                       \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(FX_TC32_WARPS_D##D * 32, 1) NAME##_cluster( \
        const float* q, const float* k, const float* v, float* out, int n_heads,            \
        int n_kv_heads, int seq_len, const int* seq_len_dev, int splits, int tile) {        \
        gqa_split_tc32<D, true>(q, k, v, nullptr, nullptr, out, n_heads, n_kv_heads,        \
                                seq_len, seq_len_dev, splits, tile);                        \
    }

FX_TC32_ENTRY(gqa_split_tc32_f32_d64, 64)
FX_TC32_ENTRY(gqa_split_tc32_f32_d128, 128)
FX_TC32_ENTRY(gqa_split_tc32_f32_d256, 256)

// ---------------------------------------------------------------------------------------
// Merge the chunks of each query head: out = sum_c w_c o_c / sum_c w_c l_c, with
// w_c = 2^(m_c - max m). One block per (head, 32 columns): lanes are columns, the four
// warps take every fourth chunk (BATCH loads in flight each) and add up in a fixed order,
// so results are reproducible bit for bit. seq_len 0 writes zeros.
// (Eight warps cost 0.3 us more at 16 chunks: more threads to synchronise. 40 loads in
// flight instead of 16 made 132-chunk plans 1-3% faster and 16- and 64-chunk ones 2-3%
// slower: NOTES.md v11. So up to 64 chunks take 16 per lane, more take FX_COMBINE_MANY.)
#define FX_COMBINE_THREADS 128
#define FX_COMBINE_BATCH 16  // chunk loads in flight per lane, up to 64 chunks
#define FX_COMBINE_MANY 33   // ... and past 64: 132 chunks in one trip to L2
#define FX_COMBINE_WARPS (FX_COMBINE_THREADS / 32)
template <class T, int BATCH>
__device__ __forceinline__ void fx_combine_chunks(T* __restrict__ out_h,
                                                  const float* __restrict__ ws_o,
                                                  const float* __restrict__ ml, int head_dim,
                                                  int d, int active, float* w_s,
                                                  float (*red_s)[32]) {
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
        out_h[d] = fx_from_float<T>(total / lsum);
    }
}

template <class T>
__device__ __forceinline__ void gqa_split_combine(
    T* __restrict__ out, const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
    int head_dim, int seq_len, const int* __restrict__ seq_len_dev, int splits, int tile) {
    __shared__ float w_s[FX_MAX_SPLITS];
    __shared__ float red_s[FX_COMBINE_WARPS][32];
    const int h = blockIdx.x;
    const int d = blockIdx.y * 32 + (threadIdx.x & 31);
    const int seq = fx_seq_len(seq_len, seq_len_dev);  // written before the split kernel ran
    fx_wait_for_split();  // every block, so the combine ends after the split kernel
    T* out_h = out + (long long)h * head_dim;
    if (seq <= 0) {
        if (threadIdx.x < 32 && d < head_dim) out_h[d] = fx_from_float<T>(0.f);
        return;
    }
    const int chunk = fx_chunk(seq, splits, tile);
    const int active = (seq + chunk - 1) / chunk;
    const float* o = ws_o + (long long)h * splits * head_dim;
    const float* ml = ws_ml + (long long)h * splits * 2;
    if (active > FX_COMBINE_WARPS * FX_COMBINE_BATCH)
        fx_combine_chunks<T, FX_COMBINE_MANY>(out_h, o, ml, head_dim, d, active, w_s, red_s);
    else
        fx_combine_chunks<T, FX_COMBINE_BATCH>(out_h, o, ml, head_dim, d, active, w_s, red_s);
}

#define FX_COMBINE_ENTRY(NAME, T)                                                           \
    extern "C" __global__ void __launch_bounds__(FX_COMBINE_THREADS) NAME(                  \
        T* out, const float* ws_o, const float* ws_ml, int head_dim, int seq_len,           \
        const int* seq_len_dev, int splits, int tile) {                                     \
        gqa_split_combine<T>(out, ws_o, ws_ml, head_dim, seq_len, seq_len_dev, splits, tile); \
    }

FX_COMBINE_ENTRY(gqa_split_combine_f32, float)
FX_COMBINE_ENTRY(gqa_split_combine_f16, fx_half)
FX_COMBINE_ENTRY(gqa_split_combine_bf16, fx_bf16)
