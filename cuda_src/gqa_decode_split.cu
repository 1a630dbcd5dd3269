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

#define FX_THREADS 128
#define FX_WARPS (FX_THREADS / 32)
#define FX_TILE 64  // chunk sizes are multiples of this (tokens)
#define FX_MAX_SPLITS 1024
#define FX_LOG2E 1.4426950408889634f

__device__ __forceinline__ int fx_seq_len(int seq_len, const int* seq_len_dev) {
    return seq_len_dev != nullptr ? *seq_len_dev : seq_len;
}

// Tokens per chunk for this length: a multiple of FX_TILE, at most `splits` chunks.
__device__ __forceinline__ int fx_chunk(int seq, int splits) {
    int c = (seq + splits - 1) / splits;
    return (c + FX_TILE - 1) / FX_TILE * FX_TILE;
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
    int head_dim, int seq_len, const int* __restrict__ seq_len_dev, int splits, int lpt) {
    __shared__ float o_s[GT][256];
    __shared__ float m_s[FX_THREADS][GT];
    __shared__ float l_s[FX_THREADS][GT];

    const int seq = fx_seq_len(seq_len, seq_len_dev);
    const int chunk = fx_chunk(seq, splits);
    const int split = blockIdx.x;
    const int start = split * chunk;
    if (seq <= 0 || start >= seq) return;
    const int end = min(seq, start + chunk);

    const int g = blockIdx.y;
    const int group = n_heads / n_kv_heads;
    const int j0 = blockIdx.z * GT;  // first head of this tile, within the group
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
    __syncthreads();
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
    for (int w = 0; w < FX_WARPS; ++w) {
        if (warp == w && sub == 0 && active) {
#pragma unroll
            for (int j = 0; j < GT; ++j)
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    if (e < valid) o_s[j][d0 + e] = (w == 0 ? 0.f : o_s[j][d0 + e]) + acc[j][e];
        }
        __syncthreads();
    }
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
        ws_o[((long long)(h0 + j) * splits + split) * head_dim + d] = o_s[j][d];
    }
}

#define FX_GENERIC_ENTRY(NAME, T, GT, VEC)                                                  \
    extern "C" __global__ void __launch_bounds__(FX_THREADS, 1) NAME(                       \
        const T* q, const T* k, const T* v, float* ws_o, float* ws_ml, int n_heads,         \
        int n_kv_heads, int head_dim, int seq_len, const int* seq_len_dev, int splits,      \
        int lpt) {                                                                          \
        gqa_split_generic<T, GT, VEC>(q, k, v, ws_o, ws_ml, n_heads, n_kv_heads, head_dim,  \
                                      seq_len, seq_len_dev, splits, lpt);                   \
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
// Per 64-token tile each warp takes 16 tokens: S^T = K Q^T (mma m16n8k16: tokens x heads),
// a shared-memory softmax step per head, then O^T += V^T P^T (d x heads). The mma's K
// dimension is permuted to match 16-byte row loads (a dot product does not care about the
// order of its terms); V is transposed in registers with byte permutes.
template <class T> struct FxMma;
template <> struct FxMma<fx_half> {
    __device__ static __forceinline__ void run(float (&c)[4], unsigned a0, unsigned a1,
                                               unsigned a2, unsigned a3, unsigned b0,
                                               unsigned b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
            "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
};
template <> struct FxMma<fx_bf16> {
    __device__ static __forceinline__ void run(float (&c)[4], unsigned a0, unsigned a1,
                                               unsigned a2, unsigned a3, unsigned b0,
                                               unsigned b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
            "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
};

__device__ __forceinline__ uint4 fx_ldg16(const void* p, bool ok) {
    return ok ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0u, 0u, 0u, 0u);
}

template <class T, int D>
__device__ __forceinline__ void gqa_split_mma(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    float* __restrict__ ws_o, float* __restrict__ ws_ml, int n_heads, int n_kv_heads,
    int seq_len, const int* __restrict__ seq_len_dev, int splits) {
    __shared__ float s_s[8][FX_TILE];
    __shared__ __align__(16) T p_s[8][FX_TILE];
    __shared__ float alpha_s[8];
    __shared__ float o_s[8][D];

    const int seq = fx_seq_len(seq_len, seq_len_dev);
    const int chunk = fx_chunk(seq, splits);
    const int split = blockIdx.x;
    const int start = split * chunk;
    if (seq <= 0 || start >= seq) return;
    const int end = min(seq, start + chunk);

    const int g_kv = blockIdx.y;
    const int group = n_heads / n_kv_heads;  // <= 8 on this path
    const int h0 = g_kv * group;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;

    // Q^T as the B operand: head g, d = kb*32 + tig*8 .. +8 (zero rows for padded heads).
    uint4 qb[D / 32];
#pragma unroll
    for (int kb = 0; kb < D / 32; ++kb)
        qb[kb] = fx_ldg16(q + (long long)(h0 + g) * D + kb * 32 + tig * 8, g < group);

    const float sscale = rsqrtf((float)D) * FX_LOG2E;
    const long long row = (long long)n_kv_heads * D;
    const T* kg = k + (long long)g_kv * D;
    const T* vg = v + (long long)g_kv * D;

    float oacc[D / 64][4][4];
#pragma unroll
    for (int hb = 0; hb < D / 64; ++hb)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) oacc[hb][i][c] = 0.f;
    // Running max and sum of the two heads this warp owns in the softmax step.
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

    for (int tile = start; tile < end; tile += FX_TILE) {
        const int t0 = tile + warp * 16;  // this warp's 16 tokens
        // ---- scores: S^T[token][head] = K[token] . Q[head]
        {
            const int ta = t0 + g, tb = t0 + g + 8;
            uint4 ka[D / 32], kb_[D / 32];
#pragma unroll
            for (int kb = 0; kb < D / 32; ++kb) {
                ka[kb] = fx_ldg16(kg + ta * row + kb * 32 + tig * 8, ta < end);
                kb_[kb] = fx_ldg16(kg + tb * row + kb * 32 + tig * 8, tb < end);
            }
            float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int kb = 0; kb < D / 32; ++kb) {
                FxMma<T>::run(c, ka[kb].x, kb_[kb].x, ka[kb].y, kb_[kb].y, qb[kb].x, qb[kb].y);
                FxMma<T>::run(c, ka[kb].z, kb_[kb].z, ka[kb].w, kb_[kb].w, qb[kb].z, qb[kb].w);
            }
            const int la = warp * 16 + g, lb = la + 8;
            s_s[tig * 2][la] = ta < end ? c[0] * sscale : -INFINITY;
            s_s[tig * 2 + 1][la] = ta < end ? c[1] * sscale : -INFINITY;
            s_s[tig * 2][lb] = tb < end ? c[2] * sscale : -INFINITY;
            s_s[tig * 2 + 1][lb] = tb < end ? c[3] * sscale : -INFINITY;
        }
        __syncthreads();
        // ---- softmax step: warp w owns heads 2w and 2w+1
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int j = warp * 2 + r;
            const float s0 = s_s[j][lane], s1 = s_s[j][lane + 32];
            float mx = fmaxf(s0, s1);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float m_new = fmaxf(m_run[r], mx);
            const float a = m_run[r] == -INFINITY ? 0.f : fx_exp2(m_run[r] - m_new);
            const float p0 = s0 == -INFINITY ? 0.f : fx_exp2(s0 - m_new);
            const float p1 = s1 == -INFINITY ? 0.f : fx_exp2(s1 - m_new);
            p_s[j][lane] = fx_from_float<T>(p0);
            p_s[j][lane + 32] = fx_from_float<T>(p1);
            float ps = p0 + p1;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, off);
            l_run[r] = l_run[r] * a + ps;
            m_run[r] = m_new;
            if (lane == 0) alpha_s[j] = a;
        }
        __syncthreads();
        // ---- O^T[d][head] += V^T[d][token] P^T[token][head]
        {
            const float a0 = alpha_s[tig * 2], a1 = alpha_s[tig * 2 + 1];
#pragma unroll
            for (int hb = 0; hb < D / 64; ++hb)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    oacc[hb][i][0] *= a0;
                    oacc[hb][i][1] *= a1;
                    oacc[hb][i][2] *= a0;
                    oacc[hb][i][3] *= a1;
                }
            const int tA = t0 + tig * 2, tC = tA + 8;
            const int lt = warp * 16 + tig * 2;
            const unsigned b0 = *reinterpret_cast<const unsigned*>(&p_s[g][lt]);
            const unsigned b1 = *reinterpret_cast<const unsigned*>(&p_s[g][lt + 8]);
#pragma unroll
            for (int hb = 0; hb < D / 64; ++hb) {
                const int d = hb * 64 + g * 8;
                const uint4 va = fx_ldg16(vg + tA * row + d, tA < end);
                const uint4 vb = fx_ldg16(vg + (tA + 1) * row + d, tA + 1 < end);
                const uint4 vc = fx_ldg16(vg + tC * row + d, tC < end);
                const uint4 vd = fx_ldg16(vg + (tC + 1) * row + d, tC + 1 < end);
                const unsigned wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
                const unsigned wc[4] = {vc.x, vc.y, vc.z, vc.w}, wd[4] = {vd.x, vd.y, vd.z, vd.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    FxMma<T>::run(oacc[hb][i], __byte_perm(wa[i], wb[i], 0x5410),
                                  __byte_perm(wa[i], wb[i], 0x7632),
                                  __byte_perm(wc[i], wd[i], 0x5410),
                                  __byte_perm(wc[i], wd[i], 0x7632), b0, b1);
                }
            }
        }
        // The next tile's score writes happen after its own first barrier's predecessor:
        // every warp has finished reading s_s (softmax) before any warp passed the barrier
        // above, and p_s/alpha_s are rewritten only after the next tile's first barrier.
    }

    // Sum the warps' partial outputs (all relative to the same running max), warp by warp
    // in a fixed order so results are bitwise reproducible.
    for (int w = 0; w < FX_WARPS; ++w) {
        if (warp == w) {
#pragma unroll
            for (int hb = 0; hb < D / 64; ++hb)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int d = hb * 64 + g * 8 + 2 * i;
                    float* o0 = &o_s[tig * 2][d];
                    float* o1 = &o_s[tig * 2 + 1][d];
                    o0[0] = (w == 0 ? 0.f : o0[0]) + oacc[hb][i][0];
                    o1[0] = (w == 0 ? 0.f : o1[0]) + oacc[hb][i][1];
                    o0[1] = (w == 0 ? 0.f : o0[1]) + oacc[hb][i][2];
                    o1[1] = (w == 0 ? 0.f : o1[1]) + oacc[hb][i][3];
                }
        }
        __syncthreads();
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int j = warp * 2 + r;
            if (j < group) {
                float* ml = ws_ml + ((long long)(h0 + j) * splits + split) * 2;
                ml[0] = m_run[r];
                ml[1] = l_run[r];
            }
        }
    }
    for (int i = threadIdx.x; i < group * D; i += FX_THREADS) {
        const int j = i / D, d = i % D;
        ws_o[((long long)(h0 + j) * splits + split) * D + d] = o_s[j][d];
    }
}

#define FX_MMA_ENTRY(NAME, T, D)                                                            \
    extern "C" __global__ void __launch_bounds__(FX_THREADS, 1) NAME(                       \
        const T* q, const T* k, const T* v, float* ws_o, float* ws_ml, int n_heads,         \
        int n_kv_heads, int seq_len, const int* seq_len_dev, int splits) {                  \
        gqa_split_mma<T, D>(q, k, v, ws_o, ws_ml, n_heads, n_kv_heads, seq_len,             \
                            seq_len_dev, splits);                                           \
    }

FX_MMA_ENTRY(gqa_split_mma_f16_d64, fx_half, 64)
FX_MMA_ENTRY(gqa_split_mma_f16_d128, fx_half, 128)
FX_MMA_ENTRY(gqa_split_mma_f16_d256, fx_half, 256)
FX_MMA_ENTRY(gqa_split_mma_bf16_d64, fx_bf16, 64)
FX_MMA_ENTRY(gqa_split_mma_bf16_d128, fx_bf16, 128)
FX_MMA_ENTRY(gqa_split_mma_bf16_d256, fx_bf16, 256)

// ---------------------------------------------------------------------------------------
// Merge the chunks of each query head: out = sum_c w_c o_c / sum_c w_c l_c, with
// w_c = 2^(m_c - max m). One block per head. seq_len 0 writes zeros.
template <class T>
__device__ __forceinline__ void gqa_split_combine(
    T* __restrict__ out, const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
    int head_dim, int seq_len, const int* __restrict__ seq_len_dev, int splits) {
    __shared__ float w_s[FX_MAX_SPLITS];
    __shared__ float red[FX_WARPS];
    __shared__ float total_s;
    const int h = blockIdx.x;
    const int seq = fx_seq_len(seq_len, seq_len_dev);
    T* out_h = out + (long long)h * head_dim;
    if (seq <= 0) {
        for (int d = threadIdx.x; d < head_dim; d += FX_THREADS) out_h[d] = fx_from_float<T>(0.f);
        return;
    }
    const int chunk = fx_chunk(seq, splits);
    const int active = (seq + chunk - 1) / chunk;
    const float* ml = ws_ml + (long long)h * splits * 2;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    float mx = -INFINITY;
    for (int c = threadIdx.x; c < active; c += FX_THREADS) mx = fmaxf(mx, ml[2 * c]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    mx = red[0];
#pragma unroll
    for (int i = 1; i < FX_WARPS; ++i) mx = fmaxf(mx, red[i]);
    __syncthreads();

    float lsum = 0.f;
    for (int c = threadIdx.x; c < active; c += FX_THREADS) {
        const float mc = ml[2 * c];
        const float w = mc == -INFINITY ? 0.f : fx_exp2(mc - mx);
        w_s[c] = w;
        lsum += w * ml[2 * c + 1];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) lsum += __shfl_xor_sync(0xffffffffu, lsum, off);
    if (lane == 0) red[warp] = lsum;
    __syncthreads();
    if (threadIdx.x == 0) {
        float t = 0.f;
        for (int i = 0; i < FX_WARPS; ++i) t += red[i];
        total_s = t;
    }
    __syncthreads();
    const float inv = 1.f / total_s;
    const float* o = ws_o + (long long)h * splits * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += FX_THREADS) {
        float acc = 0.f;
        for (int c = 0; c < active; ++c) acc = fmaf(w_s[c], o[(long long)c * head_dim + d], acc);
        out_h[d] = fx_from_float<T>(acc * inv);
    }
}

#define FX_COMBINE_ENTRY(NAME, T)                                                           \
    extern "C" __global__ void __launch_bounds__(FX_THREADS, 1) NAME(                       \
        T* out, const float* ws_o, const float* ws_ml, int head_dim, int seq_len,           \
        const int* seq_len_dev, int splits) {                                               \
        gqa_split_combine<T>(out, ws_o, ws_ml, head_dim, seq_len, seq_len_dev, splits);     \
    }

FX_COMBINE_ENTRY(gqa_split_combine_f32, float)
FX_COMBINE_ENTRY(gqa_split_combine_f16, fx_half)
FX_COMBINE_ENTRY(gqa_split_combine_bf16, fx_bf16)
