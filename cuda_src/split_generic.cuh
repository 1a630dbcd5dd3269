// Split kernels (gqa_decode_split.cu), part 2: the CUDA-core kernels (any head_dim 1..256,
// any group; their _d512 twins 257..512, fp8 caches too), with their entry points.

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

// An fp8 cache's format, the kernels' Q8 (the same values as split_mma_swapped.cuh's)
#define FX_E4M3 1  // Q8: float8_e4m3fn
#define FX_E5M2 2  // Q8: float8_e5m2

// Two fp8 values (the low byte first) as floats (exact: both formats are fp16 values).
template <int Q8>
__device__ __forceinline__ float2 fx_widen_fp8x2(unsigned short pair) {
    unsigned r;
    if (Q8 == FX_E4M3)
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(pair));
    else
        asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(r) : "h"(pair));
    return fx_unpack2(r, fx_half{});
}

// Eight elements of a cache row as floats: fx_load8, or (Q8) eight fp8 bytes widened (one
// 8-byte load when aligned, masked bytes otherwise).
template <class KT, bool VEC, int Q8>
__device__ __forceinline__ void fx_load8_kv(const KT* p, int valid, float (&x)[8]) {
    if constexpr (Q8 == 0) {
        fx_load8<KT, VEC>(p, valid, x);
    } else if constexpr (VEC) {
        const uint2 w = __ldg(reinterpret_cast<const uint2*>(p));
        const unsigned ws[2] = {w.x, w.y};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const float2 a = fx_widen_fp8x2<Q8>((unsigned short)(ws[i] & 0xffffu));
            const float2 b = fx_widen_fp8x2<Q8>((unsigned short)(ws[i] >> 16));
            x[4 * i] = a.x; x[4 * i + 1] = a.y; x[4 * i + 2] = b.x; x[4 * i + 3] = b.y;
        }
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e)
            x[e] = e < valid ? fx_widen_fp8x2<Q8>((unsigned short)p[e]).x : 0.f;
    }
}

// ---------------------------------------------------------------------------------------
// Generic split kernel on CUDA cores: any head_dim 1..256, any group size (GT heads per
// block, grid.z tiles the group). Lanes split a token's row in groups of `lpt` lanes, eight
// elements each; each lane group keeps its own online softmax, merged at the block's end.
template <class T, int GT, bool VEC, int F = 0>
__device__ __forceinline__ void gqa_split_generic(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    float* __restrict__ ws_o, float* __restrict__ ws_ml, int n_heads, int n_kv_heads,
    int head_dim, int seq_len, const int* __restrict__ seq_len_dev, int splits, int lpt,
    int tile, const FxFeat feat = FxFeat{}) {
    __shared__ __align__(16) float o_s[FX_WARPS][GT][256];  // each warp's sum, merged at the end
    __shared__ float m_s[FX_THREADS][GT];
    __shared__ float l_s[FX_THREADS][GT];

    // grid = (head tiles, splits, kv heads): the tiles of one chunk are neighbours in
    // launch order, so they run together and all but the first read K/V from L2.
    fx_let_combine_start<2>();
    const int split = blockIdx.y;
    int start, end;
    if (!fx_chunk_bounds<F>(seq_len, seq_len_dev, splits, tile, split, start, end, feat.window))
        return;

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

    const float qscale = fx_q_scale<F>(feat, head_dim);
    // with a soft-cap or ALiBi, Q is scaled in natural units and sc[j] finishes head j's
    // scores
    constexpr bool NAT = (F & (FX_F_CAP | FX_F_ALIBI)) != 0;
    FxScore<F & ~FX_F_SCALE> sc[NAT ? GT : 1];
    if constexpr (NAT) {
#pragma unroll
        for (int j = 0; j < GT; ++j)
            sc[j] = fx_scorer<F & ~FX_F_SCALE>(feat, 1, h0 + j, j < nh, seq_len, seq_len_dev);
    }
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

    // token-major rows of n_kv_heads * head_dim, or head-major (FX_F_HND)
    const long long row = (F & FX_F_HND) ? head_dim : (long long)n_kv_heads * head_dim;
    const T* kg = (F & FX_F_HND) ? k + g * feat.head_stride + d0
                                 : k + (long long)g * head_dim + d0;
    const T* vg = (F & FX_F_HND) ? v + g * feat.head_stride + d0
                                 : v + (long long)g * head_dim + d0;
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
                if constexpr (NAT) s[j] = sc[j](s[j], u == 0 ? t0 : t1);
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

// Generic split kernel for head_dims 257..512 on CUDA cores (gqa_split_generic's twin, the
// same algorithm): lanes split a token's row in groups of `lpt` (32) lanes, C = 2 chunks of
// eight elements each (chunk c of lane l: elements (c * lpt + l) * 8 on, so each chunk's
// loads are contiguous across the lanes). Q8 (an fp8 cache, KT bytes): the rows widened as
// they are read, the KV head's scales (kv_scales: n_kv_heads K scales, then the V ones)
// folded into q's scale and applied to the partial output once. (A twin, not a template
// parameter of gqa_split_generic: making its chunk a parameter moved instructions of the
// cap and ALiBi kernels of head_dims up to 256 (PTX equal up to order), and their machine
// code is kept as measured.)
template <class T, int GT, bool VEC, int F, int Q8, class KT, int C = 2>
__device__ __forceinline__ void fx_split_generic_d512_body(
    const T* __restrict__ q, const KT* __restrict__ k, const KT* __restrict__ v,
    float* __restrict__ ws_o, float* __restrict__ ws_ml, int n_heads, int n_kv_heads,
    int head_dim, int seq_len, const int* __restrict__ seq_len_dev, int splits, int lpt,
    int tile, const FxFeat feat, const float* __restrict__ kv_scales,
    float (&o_s)[FX_WARPS][GT][256 * C], float (&m_s)[FX_THREADS][GT],
    float (&l_s)[FX_THREADS][GT]) {
    // grid = (head tiles, splits, kv heads): the tiles of one chunk are neighbours in
    // launch order, so they run together and all but the first read K/V from L2.
    fx_let_combine_start<2>();
    const int split = blockIdx.y;
    int start, end;
    if (!fx_chunk_bounds<F>(seq_len, seq_len_dev, splits, tile, split, start, end, feat.window))
        return;

    const int g = blockIdx.z;
    const int group = n_heads / n_kv_heads;
    const int j0 = blockIdx.x * GT;  // first head of this tile, within the group
    const int nh = min(GT, group - j0);
    const int h0 = g * group + j0;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tpw = 32 / lpt;  // token groups per warp
    const int sub = lane / lpt, l = lane % lpt;
    const int gid = warp * tpw + sub, n_groups = FX_WARPS * tpw;
    int d0[C], valid[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
        d0[c] = (c * lpt + l) * 8;
        valid[c] = max(0, min(8, head_dim - d0[c]));
    }

    float qscale = fx_q_scale<F>(feat, head_dim);
    if constexpr (Q8 != 0) qscale *= kv_scales[g];  // K's scale
    // with a soft-cap or ALiBi, Q is scaled in natural units and sc[j] finishes head j's
    // scores
    constexpr bool NAT = (F & (FX_F_CAP | FX_F_ALIBI)) != 0;
    FxScore<F & ~FX_F_SCALE> sc[NAT ? GT : 1];
    if constexpr (NAT) {
#pragma unroll
        for (int j = 0; j < GT; ++j)
            sc[j] = fx_scorer<F & ~FX_F_SCALE>(feat, 1, h0 + j, j < nh, seq_len, seq_len_dev);
    }
    float qf[GT][C][8], acc[GT][C][8], m[GT], lsum[GT];
#pragma unroll
    for (int j = 0; j < GT; ++j) {
#pragma unroll
        for (int c = 0; c < C; ++c) {
            float tmp[8];
            if (j < nh && valid[c] > 0) {
                fx_load8<T, false>(q + (long long)(h0 + j) * head_dim + d0[c], valid[c], tmp);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) tmp[e] = 0.f;
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                qf[j][c][e] = tmp[e] * qscale;
                acc[j][c][e] = 0.f;
            }
        }
        m[j] = -INFINITY;
        lsum[j] = 0.f;
    }

    // token-major rows of n_kv_heads * head_dim, or head-major (FX_F_HND)
    const long long row = (F & FX_F_HND) ? head_dim : (long long)n_kv_heads * head_dim;
    const KT* kg = (F & FX_F_HND) ? k + g * feat.head_stride + d0[0]
                                  : k + (long long)g * head_dim + d0[0];
    const KT* vg = (F & FX_F_HND) ? v + g * feat.head_stride + d0[0]
                                  : v + (long long)g * head_dim + d0[0];
    bool active[C];
#pragma unroll
    for (int c = 0; c < C; ++c) active[c] = valid[c] > 0;

    // Every lane runs the same iterations (the shuffles need the whole warp); tokens past
    // the end are loaded as zeros and leave the softmax state alone.
    for (int base = start; base < end; base += 2 * n_groups) {
        const int t0 = base + gid, t1 = t0 + n_groups;
        const bool has[2] = {t0 < end, t1 < end};
        float kx[2][C][8], vx[2][C][8];
        // Issue all the row loads before using any of them.
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int t = u == 0 ? t0 : t1;
#pragma unroll
            for (int c = 0; c < C; ++c) {
                if (active[c] && has[u]) {
                    const long long at = t * row + c * lpt * 8;
                    fx_load8_kv<KT, VEC, Q8>(kg + at, valid[c], kx[u][c]);
                    fx_load8_kv<KT, VEC, Q8>(vg + at, valid[c], vx[u][c]);
                } else {
#pragma unroll
                    for (int e = 0; e < 8; ++e) kx[u][c][e] = vx[u][c][e] = 0.f;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            float s[GT];
#pragma unroll
            for (int j = 0; j < GT; ++j) {
                float d = 0.f;
#pragma unroll
                for (int c = 0; c < C; ++c) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) d = fmaf(qf[j][c][e], kx[u][c][e], d);
                }
                s[j] = d;
            }
            for (int off = lpt >> 1; off > 0; off >>= 1) {
#pragma unroll
                for (int j = 0; j < GT; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], off);
            }
            if (!has[u]) continue;
#pragma unroll
            for (int j = 0; j < GT; ++j) {
                if constexpr (NAT) s[j] = sc[j](s[j], u == 0 ? t0 : t1);
                if (s[j] > m[j]) {  // rare after the first tokens: rescale only then
                    const float a = m[j] == -INFINITY ? 0.f : fx_exp2(m[j] - s[j]);
                    lsum[j] *= a;
#pragma unroll
                    for (int c = 0; c < C; ++c) {
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[j][c][e] *= a;
                    }
                    m[j] = s[j];
                }
                const float p = s[j] == -INFINITY ? 0.f : fx_exp2(s[j] - m[j]);
                lsum[j] += p;
#pragma unroll
                for (int c = 0; c < C; ++c) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[j][c][e] = fmaf(p, vx[u][c][e], acc[j][c][e]);
                }
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
        float sc = (m[j] == -INFINITY) ? 0.f : fx_exp2(m[j] - mb[j]);
        if constexpr (Q8 != 0) sc *= kv_scales[n_kv_heads + g];  // V's scale
#pragma unroll
        for (int c = 0; c < C; ++c) {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float x = acc[j][c][e] * sc;
                for (int off = lpt; off < 32; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
                acc[j][c][e] = x;
            }
        }
    }
    // past head_dim, acc holds zeros (q and the rows were 0)
#pragma unroll
    for (int c = 0; c < C; ++c) {
        if (sub == 0 && active[c]) {
#pragma unroll
            for (int j = 0; j < GT; ++j) {
                float4* dst = reinterpret_cast<float4*>(&o_s[warp][j][d0[c]]);
                dst[0] = make_float4(acc[j][c][0], acc[j][c][1], acc[j][c][2], acc[j][c][3]);
                dst[1] = make_float4(acc[j][c][4], acc[j][c][5], acc[j][c][6], acc[j][c][7]);
            }
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

// Head_dims 257..512: two chunks of eight a lane (lpt 32), GT up to 4 (registers and the
// 48 KiB of static shared memory); Q8: an fp8 cache of bytes.
template <class T, int GT, bool VEC, int F = 0, int Q8 = 0, class KT = T>
__device__ __forceinline__ void gqa_split_generic_d512(
    const T* __restrict__ q, const KT* __restrict__ k, const KT* __restrict__ v,
    float* __restrict__ ws_o, float* __restrict__ ws_ml, int n_heads, int n_kv_heads,
    int head_dim, int seq_len, const int* __restrict__ seq_len_dev, int splits, int lpt,
    int tile, const FxFeat feat = FxFeat{}, const float* __restrict__ kv_scales = nullptr) {
    __shared__ __align__(16) float o_s[FX_WARPS][GT][512];
    __shared__ float m_s[FX_THREADS][GT];
    __shared__ float l_s[FX_THREADS][GT];
    fx_split_generic_d512_body<T, GT, VEC, F, Q8, KT>(
        q, k, v, ws_o, ws_ml, n_heads, n_kv_heads, head_dim, seq_len, seq_len_dev, splits, lpt,
        tile, feat, kv_scales, o_s, m_s, l_s);
}

#define FX_GENERIC_ENTRY(NAME, T, GT, VEC)                                                  \
    extern "C" __global__ void __launch_bounds__(FX_THREADS, 1) NAME(                       \
        const T* q, const T* k, const T* v, float* ws_o, float* ws_ml, int n_heads,         \
        int n_kv_heads, int head_dim, int seq_len, const int* seq_len_dev, int splits,      \
        int lpt, int tile) {                                                                \
        gqa_split_generic<T, GT, VEC>(q, k, v, ws_o, ws_ml, n_heads, n_kv_heads, head_dim,  \
                                      seq_len, seq_len_dev, splits, lpt, tile);             \
    }

// With features F: gqa_split_<dt>_g<GT>_<vec|any>_x<F> (the combine kernel merges it).
#define FX_GENERIC_FEAT_ENTRY(NAME, T, GT, VEC, F)                                          \
    extern "C" __global__ void __launch_bounds__(FX_THREADS, 1) NAME(                       \
        const T* q, const T* k, const T* v, float* ws_o, float* ws_ml, int n_heads,         \
        int n_kv_heads, int head_dim, int seq_len, const int* seq_len_dev, int splits,      \
        int lpt, int tile, float scale, float cap, int window, const float* slopes,         \
        long long head_stride) {                                                            \
        const FxFeat feat{scale, cap, window, slopes, nullptr, nullptr, head_stride};       \
        gqa_split_generic<T, GT, VEC, F>(q, k, v, ws_o, ws_ml, n_heads, n_kv_heads,         \
                                         head_dim, seq_len, seq_len_dev, splits, lpt, tile, \
                                         feat);                                             \
    }

// Head_dims 257..512 (two chunks of eight a lane, 32 lanes a token; GT up to 4):
// gqa_split_<dt>_g<GT>_<vec|any>_d512[_x<F>], the same arguments as the kernels above.
#define FX_GENERIC_D512_ENTRY(NAME, T, GT, VEC)                                             \
    extern "C" __global__ void __launch_bounds__(FX_THREADS, 1) NAME(                       \
        const T* q, const T* k, const T* v, float* ws_o, float* ws_ml, int n_heads,         \
        int n_kv_heads, int head_dim, int seq_len, const int* seq_len_dev, int splits,      \
        int lpt, int tile) {                                                                \
        gqa_split_generic_d512<T, GT, VEC>(q, k, v, ws_o, ws_ml, n_heads, n_kv_heads,       \
                                           head_dim, seq_len, seq_len_dev, splits, lpt,     \
                                           tile);                                           \
    }
#define FX_GENERIC_D512_FEAT_ENTRY(NAME, T, GT, VEC, F)                                     \
    extern "C" __global__ void __launch_bounds__(FX_THREADS, 1) NAME(                       \
        const T* q, const T* k, const T* v, float* ws_o, float* ws_ml, int n_heads,         \
        int n_kv_heads, int head_dim, int seq_len, const int* seq_len_dev, int splits,      \
        int lpt, int tile, float scale, float cap, int window, const float* slopes,         \
        long long head_stride) {                                                            \
        const FxFeat feat{scale, cap, window, slopes, nullptr, nullptr, head_stride};       \
        gqa_split_generic_d512<T, GT, VEC, F>(q, k, v, ws_o, ws_ml, n_heads, n_kv_heads,    \
                                              head_dim, seq_len, seq_len_dev, splits, lpt,  \
                                              tile, feat);                                  \
    }
// ... over an fp8 cache (Q8: FX_E4M3, FX_E5M2; q fp16/bf16), every feature's value passed
// as the fp8 tensor-core kernels take them: gqa_split_<dt>_<fp8>_g<GT>_<vec|any>_d512_x<F>
#define FX_GENERIC8_D512_ENTRY(NAME, T, Q8, GT, VEC, F)                                     \
    extern "C" __global__ void __launch_bounds__(FX_THREADS, 1) NAME(                       \
        const T* q, const unsigned char* k, const unsigned char* v, float* ws_o,            \
        float* ws_ml, int n_heads, int n_kv_heads, int head_dim, int seq_len,               \
        const int* seq_len_dev, int splits, int lpt, int tile, const float* kv_scales,      \
        float scale, float cap, int window, const float* slopes, long long head_stride) {   \
        const FxFeat feat{scale, cap, window, slopes, nullptr, nullptr, head_stride};       \
        gqa_split_generic_d512<T, GT, VEC, F, Q8, unsigned char>(                           \
            q, k, v, ws_o, ws_ml, n_heads, n_kv_heads, head_dim, seq_len, seq_len_dev,      \
            splits, lpt, tile, feat, kv_scales);                                            \
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

#ifndef FX_SELECTED  // the host compiles one entry at a time (attention.split_entry)
FX_GENERIC_FOR_TYPE(f32, float)
FX_GENERIC_FOR_TYPE(f16, fx_half)
FX_GENERIC_FOR_TYPE(bf16, fx_bf16)
#endif
