// Split kernels (gqa_decode_split.cu), part 7: fp16/bf16 caches on tensor cores with the
// mma's operands swapped (tokens as the rows), which body each head_dim takes, and the
// fp16/bf16 entry points.

// The same decode with the mma's operands swapped (head_dim 128; FX_MMA_SWAPPED_D<D>,
// measured in docs/design.md). gqa_split_mma gives the heads the mma's 16
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

// Q8 (an fp8 cache: FX_E4M3, FX_E5M2): K and V bytes, q and the output of type QT (fp16 or
// bf16), the mmas in fp16: q converted (fx_load_q8, each head scaled by a power of two
// where it would pass fp16's range), the cache's bytes widened as they are read from the
// ring (exact: both formats are fp16 values), twice the ring's steps in the same bytes;
// the KV head's scales (kv_scales: n_kv_heads K scales, then the V ones) folded into the
// score scale and applied to the output once.
#define FX_E4M3 1  // Q8: float8_e4m3fn
#define FX_E5M2 2  // Q8: float8_e5m2
// (any quantized format, fp8 or 4-bit, is stored as bytes)
template <class T, int Q8>
struct FxStore {
    using type = unsigned char;
};
template <class T>
struct FxStore<T, 0> {
    using type = T;
};
// Eight elements of a ring row from offset `off`: 16 bytes as they are, or (Q8) eight fp8
// values, 8 bytes, as eight fp16 ones (exact).
template <int Q8>
struct FxRead {
    template <class KT>
    __device__ __forceinline__ static uint4 at(const KT* row, int off) {
        return *reinterpret_cast<const uint4*>(row + off);
    }
};
template <int Q8>
struct FxRead8 {
    __device__ __forceinline__ static uint4 at(const unsigned char* row, int off) {
        const uint2 w = *reinterpret_cast<const uint2*>(row + off);
        const unsigned short h[4] = {(unsigned short)(w.x & 0xffffu),
                                     (unsigned short)(w.x >> 16),
                                     (unsigned short)(w.y & 0xffffu),
                                     (unsigned short)(w.y >> 16)};
        unsigned r[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (Q8 == FX_E4M3)
                asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r[i]) : "h"(h[i]));
            else
                asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(r[i]) : "h"(h[i]));
        }
        return make_uint4(r[0], r[1], r[2], r[3]);
    }
};
template <>
struct FxRead<FX_E4M3> : FxRead8<FX_E4M3> {};
template <>
struct FxRead<FX_E5M2> : FxRead8<FX_E5M2> {};
// q for an fp8 cache's fp16 mmas, eight elements (16 bytes of QT: fp16, bf16) at a time:
// their largest magnitude; e, where 2^-e brings a row whose largest |q| has the bits `top`
// within fp16's range (0 where it is, or is inf or NaN); the elements as fp16, times `down`.
template <class QT>
__device__ __forceinline__ float fx_top8(uint4 w) {
    const unsigned ws[4] = {w.x, w.y, w.z, w.w};
    float top = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float2 f = fx_unpack2(ws[e], QT{});
        top = fmaxf(top, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
    return top;
}
__device__ __forceinline__ int fx_q8_shift(int top) {
    const int ex = ((top >> 23) & 0xff) - 127;
    return top >= 0x7f800000 || ex < 15 ? 0 : ex - 14;
}
template <class QT>
__device__ __forceinline__ uint4 fx_half8(uint4 w, float down) {
    const unsigned ws[4] = {w.x, w.y, w.z, w.w};
    unsigned h[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float2 f = fx_unpack2(ws[e], QT{});
        h[e] = fx_pack2<fx_half>(f.x * down, f.y * down);
    }
    return make_uint4(h[0], h[1], h[2], h[3]);
}

// fx_load_q for an fp8 cache: q of type QT (fp16, bf16) as fp16, head j scaled by 2^-e_j,
// e_j > 0 only where its largest |q| would pass 2^15 (so fp16 holds every bf16 q exactly
// but for the tiniest); mul_a / mul_b: 2^e of heads 2tig and 2tig + 1, to undo it.
template <int D, int THREADS, int DR, class QT>
__device__ __forceinline__ FxQ<fx_half, D> fx_load_q8(const QT* q, int h0, int group, int g,
                                                      int tig, float& mul_a, float& mul_b) {
    __shared__ __align__(16) fx_half q_s[8][D + 8];
    __shared__ int q_top[8];  // the bits of each head's largest |q|
    if (threadIdx.x < 8) q_top[threadIdx.x] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < 8 * (D / 8); i += THREADS) {
        const int j = i / (D / 8), c = (i % (D / 8)) * 8;
        const uint4 w = fx_ldg16(q + (long long)(h0 + j) * DR + c, j < group && c < DR);
        atomicMax(&q_top[j], __float_as_int(fx_top8<QT>(w)));
    }
    __syncthreads();
    auto shift = [&](int j) { return fx_q8_shift(q_top[j]); };  // e_j
    for (int i = threadIdx.x; i < 8 * (D / 8); i += THREADS) {
        const int j = i / (D / 8), c = (i % (D / 8)) * 8;
        const uint4 w = fx_ldg16(q + (long long)(h0 + j) * DR + c, j < group && c < DR);
        const float down = __int_as_float((127 - shift(j)) << 23);
        *reinterpret_cast<uint4*>(&q_s[j][c]) = fx_half8<QT>(w, down);
    }
    __syncthreads();
    mul_a = __int_as_float((127 + shift(2 * tig)) << 23);
    mul_b = __int_as_float((127 + shift(2 * tig + 1)) << 23);
    return FxQ<fx_half, D>::of(q_s[g], tig);
}

template <int F, int Q8>
__device__ __forceinline__ FxScore<F> fx_folded(FxScore<F> sc, float f) {
    if (Q8) sc.fold(f);
    return sc;
}

template <class T, int D, bool CLUSTER, int WARPS, int DR = D, int TILED = 0, int F = 0,
          int PAIR = 1, int Q8 = 0, class QT = T>
__device__ __forceinline__ void gqa_split_mma_swapped(
    const QT* __restrict__ q, const typename FxStore<T, Q8>::type* __restrict__ k,
    const typename FxStore<T, Q8>::type* __restrict__ v, float* __restrict__ ws_o,
    float* __restrict__ ws_ml, QT* __restrict__ out, int n_heads, int n_kv_heads, int seq_len,
    const int* __restrict__ seq_len_dev, int splits, int tile, const FxFeat feat = FxFeat{},
    const float* __restrict__ kv_scales = nullptr) {
    using KT = typename FxStore<T, Q8>::type;  // the cache's element
    // (an fp8 ring: twice the kernel's steps of bytes; a pair's: the kernel's)
    constexpr int S = Q8 ? 2 * FxStages<D>::value : FxStages<D, PAIR == 1 ? DR : D>::value;
    constexpr int THREADS = WARPS * 32;
    constexpr int STEP = 16 * D;  // elements of one step's K (or V)
    constexpr int RING = WARPS * S * 2 * STEP * (int)sizeof(KT);
    extern __shared__ __align__(16) unsigned char fx_dyn_smem[];

    FxTcBlock blk;  // this block's chunk, KV head and query heads
    if (!fx_tc_block<CLUSTER, TILED, D, F>(blk, RING, THREADS, n_heads, n_kv_heads, seq_len,
                                           seq_len_dev, splits, tile, feat.window))
        return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;  // mma fragment coordinates: lane = 4g + tig
    const auto wr = fx_warp_ring<KT, D, 16, S, WARPS, DR, F>(
        fx_dyn_smem, k, v, blk.g_kv, n_kv_heads, feat.head_stride, blk.start, blk.end, warp, lane);

    // TILED = 2, 4 (a verify's rows): NT = TILED tiles of 8 heads, tile u's heads h0 + 8u
    // .., each K and V fragment read once for every tile's mmas
    constexpr int NT = TILED >= 2 ? TILED : 1;
    static_assert(NT == 1 || (PAIR == 1 && D <= 128), "two tiles: one KV head, q in registers");
    int h0[NT], group[NT];
#pragma unroll
    for (int u = 0; u < NT; ++u) {
        h0[u] = blk.h0 + 8 * u;
        group[u] = NT == 1 ? blk.group : max(0, min(8, blk.group - 8 * u));
    }

    // Q as the B operand (n = heads), read as gqa_split_mma reads it for its A operand
    const int a_heads = PAIR == 1 ? 0 : max(0, min(blk.group, blk.heads_per_kv / 2 - blk.tile_h));
    float q_mul_a[NT], q_mul_b[NT];  // (Q8: the heads' power-of-two scales undone)
    FxQ<T, D> qf[NT];
#pragma unroll
    for (int u = 0; u < NT; ++u) {
        q_mul_a[u] = q_mul_b[u] = 1.f;
        if (u) __syncthreads();  // (the staging is reused: every warp has read tile u - 1's)
        if constexpr (Q8 != 0)
            qf[u] = fx_load_q8<D, THREADS, DR>(q, h0[u], group[u], g, tig, q_mul_a[u], q_mul_b[u]);
        else
            qf[u] = fx_load_q<T, D, THREADS, DR, PAIR>(q, h0[u], group[u], g, tig, a_heads);
    }

    // heads 2tig (a) and 2tig + 1 (b); Q8: the K scale and q's folded in
    const float k_scale = Q8 ? kv_scales[blk.g_kv] : 1.f;
    FxScore<F> sca[NT], scb[NT];
#pragma unroll
    for (int u = 0; u < NT; ++u) {
        sca[u] = fx_folded<F, Q8>(fx_scorer<F>(feat, DR / PAIR, h0[u] + 2 * tig,
                                                2 * tig < group[u], seq_len, seq_len_dev),
                                   k_scale * q_mul_a[u]);
        scb[u] = fx_folded<F, Q8>(fx_scorer<F>(feat, DR / PAIR, h0[u] + 2 * tig + 1,
                                                2 * tig + 1 < group[u], seq_len, seq_len_dev),
                                   k_scale * q_mul_b[u]);
    }

    // O^T accumulators [tile][64-d block][i][c]: d = hb*64 + g*8 + 2i + (c >> 1), head
    // 2tig + (c & 1).
    float oacc[NT][D / 64][4][4];
#pragma unroll
    for (int u = 0; u < NT; ++u)
#pragma unroll
        for (int hb = 0; hb < D / 64; ++hb)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                oacc[u][hb][i][0] = oacc[u][hb][i][1] = oacc[u][hb][i][2] = oacc[u][hb][i][3] = 0.f;
    FxRunning ra[NT], rb[NT];  // heads 2tig (a) and 2tig + 1 (b): their online softmax

    for (int j = 0; wr.t0(j) < blk.end; ++j) {
        wr.issue(j + S - 1);
        fx_cp_async_wait<S - 1>();
        __syncwarp();
        const int t0 = wr.t0(j);
        const KT* ks = wr.k_stage(j);
        const KT* vs = ks + STEP;
        // ---- S^T = K Q^T: rows = tokens t0 + g (c0, c1) and t0 + g + 8 (c2, c3), columns
        // = heads 2tig, 2tig + 1; two chains (the 16-byte reads' halves)
        float s[NT][4], s2[NT][4];
#pragma unroll
        for (int u = 0; u < NT; ++u)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[u][e] = s2[u][e] = 0.f;
#pragma unroll
        for (int kb = 0; kb < D / 32; ++kb) {
            const int cg = (kb * 4 + tig) ^ ((g & 1) << 2);  // rows g and g + 8: same parity
            const int c8 = (kb * 4 + tig) >> 1, h8 = (tig & 1) * 8;  // (Q8: half a chunk)
            const int k8 = ((c8 ^ fx_swz_k<KT, D>(g)) << 4) + h8;  // (g, g + 8: same swizzle)
            const uint4 ka = Q8 ? FxRead<Q8>::at(ks + g * D, k8)
                                : *reinterpret_cast<const uint4*>(ks + g * D + cg * 8);
            const uint4 kc = Q8 ? FxRead<Q8>::at(ks + (g + 8) * D, k8)
                                : *reinterpret_cast<const uint4*>(ks + (g + 8) * D + cg * 8);
#pragma unroll
            for (int u = 0; u < NT; ++u) {
                const uint4 qv = qf[u].at(kb, tig);
                FxMma<T>::run(s[u][0], s[u][1], s[u][2], s[u][3], ka.x, kc.x, ka.y, kc.y, qv.x,
                              qv.y);
                FxMma<T>::run(s2[u][0], s2[u][1], s2[u][2], s2[u][3], ka.z, kc.z, ka.w, kc.w,
                              qv.z, qv.w);
            }
        }
        const int ta = t0 + g, tc = ta + 8;
        float alpha_a[NT], alpha_b[NT];
        unsigned pb0[NT], pb1[NT];
#pragma unroll
        for (int u = 0; u < NT; ++u) {
            float x[4];
            x[0] = ta < blk.end ? sca[u](s[u][0] + s2[u][0], ta) : -INFINITY;  // head a
            x[1] = ta < blk.end ? scb[u](s[u][1] + s2[u][1], ta) : -INFINITY;  // head b
            x[2] = tc < blk.end ? sca[u](s[u][2] + s2[u][2], tc) : -INFINITY;  // head a
            x[3] = tc < blk.end ? scb[u](s[u][3] + s2[u][3], tc) : -INFINITY;  // head b
            const float xa[2] = {x[0], x[2]}, xb[2] = {x[1], x[3]};
            float pa[2], pb[2];
            alpha_a[u] = ra[u].step(fx_lanes_max<4, 32>(fmaxf(x[0], x[2])), xa, pa);
            alpha_b[u] = rb[u].step(fx_lanes_max<4, 32>(fmaxf(x[1], x[3])), xb, pb);
            // P^T as the B operand: (tokens 2tig, 2tig + 1; head g) and (tokens 2tig + 8,
            // + 9; head g), each 8x8 block of P (token g; heads 2tig, 2tig + 1) transposed
            pb0[u] = fx_movmatrix_trans(fx_pack2<T>(pa[0], pb[0]));
            pb1[u] = fx_movmatrix_trans(fx_pack2<T>(pa[1], pb[1]));
        }
        // ---- O^T = O^T * alpha + V^T P^T; this lane's V rows are 2tig, 2tig+1, 2tig+8,
        // 2tig+9, at d = hb*64 + g*8 .. +8 (rows g and g + 8 of the mma: elements 2i, 2i+1)
#pragma unroll
        for (int hb = 0; hb < D / 64; ++hb) {
            const int c = (hb * 8 + g) ^ (tig * 2);
            // (Q8: rows 2tig, 2tig + 1, + 8, + 9 share the swizzle)
            const int v8 = ((((hb * 8 + g) >> 1) ^ fx_swz_v<KT, D>(tig * 2)) << 4) + (g & 1) * 8;
            const uint4 va = Q8 ? FxRead<Q8>::at(vs + (tig * 2) * D, v8)
                                : *reinterpret_cast<const uint4*>(vs + (tig * 2) * D + c * 8);
            const uint4 vb = Q8 ? FxRead<Q8>::at(vs + (tig * 2 + 1) * D, v8)
                                : *reinterpret_cast<const uint4*>(vs + (tig * 2 + 1) * D + c * 8);
            const uint4 vc = Q8 ? FxRead<Q8>::at(vs + (tig * 2 + 8) * D, v8)
                                : *reinterpret_cast<const uint4*>(vs + (tig * 2 + 8) * D + c * 8);
            const uint4 vd = Q8 ? FxRead<Q8>::at(vs + (tig * 2 + 9) * D, v8)
                                : *reinterpret_cast<const uint4*>(vs + (tig * 2 + 9) * D + c * 8);
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
#pragma unroll
                for (int u = 0; u < NT; ++u) {
                    float* o = oacc[u][hb][i];
                    o[0] *= alpha_a[u];
                    o[1] *= alpha_b[u];
                    o[2] *= alpha_a[u];
                    o[3] *= alpha_b[u];
                    FxMma<T>::run(o[0], o[1], o[2], o[3], a0, a1, a2, a3, pb0[u], pb1[u]);
                }
            }
        }
        __syncwarp();
    }
    fx_cp_async_wait<0>();
    if (Q8) {  // the V scale, once
        const float v_scale = kv_scales[n_kv_heads + blk.g_kv];
#pragma unroll
        for (int u = 0; u < NT; ++u)
#pragma unroll
            for (int hb = 0; hb < D / 64; ++hb)
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int c = 0; c < 4; ++c) oacc[u][hb][i][c] *= v_scale;
    }

    // ---- the warps' merge, as gqa_split_mma's, from this layout: the sums over the lanes
    // of a column (xor 4, 8, 16), then head 2tig's max and sum from lane tig; tile by tile
    // (the merge's shared memory reused: a barrier between)
    constexpr int SLOTS = D / 4;
    auto where = [](int d, int& slot, int& t) {
        const int gg = (d % 64) / 8;
        slot = (d / 64) * 16 + (gg >> 2) * 8 + d % 8;
        t = gg & 3;
    };
#pragma unroll
    for (int u = 0; u < NT; ++u) {
        if (u && group[u] == 0) break;  // (an odd count of tiles: the block's last is empty)
        if (u) __syncthreads();
        FxRunning& wa = ra[u];
        FxRunning& wb = rb[u];
        wa.l += __shfl_xor_sync(0xffffffffu, wa.l, 4);
        wb.l += __shfl_xor_sync(0xffffffffu, wb.l, 4);
        wa.l += __shfl_xor_sync(0xffffffffu, wa.l, 8);
        wb.l += __shfl_xor_sync(0xffffffffu, wb.l, 8);
        wa.l += __shfl_xor_sync(0xffffffffu, wa.l, 16);
        wb.l += __shfl_xor_sync(0xffffffffu, wb.l, 16);
        auto park_stats = [&](float (*m_s)[8], float (*l_s)[8]) {
            if (g == 0) {
                m_s[warp][2 * tig] = wa.m;
                m_s[warp][2 * tig + 1] = wb.m;
                l_s[warp][2 * tig] = wa.l;
                l_s[warp][2 * tig + 1] = wb.l;
            }
        };
        // column d = hb*64 + g*8 + e of head h: slot hb*16 + (g >> 2)*8 + e of lane 4h +
        // (g & 3)
        auto park_o = [&](float* o_f) {
#pragma unroll
            for (int hb = 0; hb < D / 64; ++hb)
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const int slot = hb * 16 + (g >> 2) * 8 + 2 * i + (c >> 1);
                        const int ln = 4 * (2 * tig + (c & 1)) + (g & 3);
                        o_f[(warp * SLOTS + slot) * FX_OPAD + ln] = oacc[u][hb][i][c];
                    }
        };
        fx_merge_parked<CLUSTER, WARPS, D, SLOTS, RING, DR, F, PAIR>(
            fx_dyn_smem, park_stats, park_o, ws_o, ws_ml, out, h0[u], group[u], splits,
            blk.split, seq_len, seq_len_dev, where, &feat, a_heads);
    }
}

// Which head_dims take the swapped operands: FX_MMA_SWAPPED_D<D> (split_traits.h, from
// ferrox_driver/kernel_traits.py, where the measurement is noted).
template <class T, int D, bool CLUSTER, int WARPS = FxWarps<D>::value, int DR = D,
          int TILED = 0, int F = 0, int PAIR = 1>
__device__ __forceinline__ void fx_mma_body(const T* q, const T* k, const T* v, float* ws_o,
                                            float* ws_ml, T* out, int n_heads, int n_kv_heads,
                                            int seq_len, const int* seq_len_dev, int splits,
                                            int tile, const FxFeat feat = FxFeat{}) {
    constexpr bool SWAPPED = D == 64    ? FX_MMA_SWAPPED_D64
                             : D == 128 ? FX_MMA_SWAPPED_D128
                                        : FX_MMA_SWAPPED_D256;
    if constexpr (SWAPPED)
        gqa_split_mma_swapped<T, D, CLUSTER, WARPS, DR, TILED, F, PAIR>(
            q, k, v, ws_o, ws_ml, out, n_heads, n_kv_heads, seq_len, seq_len_dev, splits, tile,
            feat);
    else
        gqa_split_mma<T, D, CLUSTER, WARPS, DR, TILED, F, PAIR>(q, k, v, ws_o, ws_ml, out, n_heads,
                                                          n_kv_heads, seq_len, seq_len_dev,
                                                          splits, tile, feat);
}

// Each kernel twice: with a combine kernel (partials to the workspace), and "_cluster"
// (launched in clusters of `splits` blocks per KV head, writes the output). Chunks are
// multiples of `tile` tokens (16 to FX_TILE; the host picks it per plan).
#define FX_MMA_KERNELS(NAME, T, D, DR, TILED)                                               \
    extern "C" __global__ void __launch_bounds__(FX_WARPS_D##D * 32, 1) NAME(               \
        const T* q, const T* k, const T* v, float* ws_o, float* ws_ml, int n_heads,         \
        int n_kv_heads, int seq_len, const int* seq_len_dev, int splits, int tile) {        \
        fx_mma_body<T, D, false, FX_WARPS_D##D, DR, TILED>(                                 \
            q, k, v, ws_o, ws_ml, nullptr, n_heads, n_kv_heads, seq_len, seq_len_dev,       \
            splits, tile);                                                                  \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(FX_WARPS_D##D * 32, 1) NAME##_cluster(     \
        const T* q, const T* k, const T* v, T* out, int n_heads, int n_kv_heads,            \
        int seq_len, const int* seq_len_dev, int splits, int tile) {                        \
        fx_mma_body<T, D, true, FX_WARPS_D##D, DR, TILED>(                                  \
            q, k, v, nullptr, nullptr, out, n_heads, n_kv_heads, seq_len, seq_len_dev,      \
            splits, tile);                                                                  \
    }
#define FX_MMA_ENTRY(NAME, T, D) FX_MMA_KERNELS(NAME, T, D, D, false)

#ifndef FX_SELECTED  // the host compiles one entry at a time (attention.split_entry)
FX_MMA_ENTRY(gqa_split_mma_f16_d64, fx_half, 64)
FX_MMA_ENTRY(gqa_split_mma_f16_d128, fx_half, 128)
FX_MMA_ENTRY(gqa_split_mma_f16_d256, fx_half, 256)
FX_MMA_ENTRY(gqa_split_mma_bf16_d64, fx_bf16, 64)
FX_MMA_ENTRY(gqa_split_mma_bf16_d128, fx_bf16, 128)
FX_MMA_ENTRY(gqa_split_mma_bf16_d256, fx_bf16, 256)
#endif

// The "wide" cluster kernels (head_dim 128, attention.py's wide plans): FX_WIDE_WARPS warps
// per block, twice the others', for grids of 8 chunks per KV head, merged on chip in
// clusters of 8, where the other plans take 16 chunks and the combine kernel. Half the
// multiprocessors stream the cache as fast (docs/design.md), no combine kernel runs, and
// twice the warps share each block's doubled products (with 4 warps the same plans were
// 3-32% slower: docs/design.md). FX_WIDE_WARPS: split_traits.h.
#define FX_MMA_WIDE_ENTRY(NAME, T)                                                          \
    extern "C" __global__ void __launch_bounds__(FX_WIDE_WARPS * 32, 1) NAME(               \
        const T* q, const T* k, const T* v, T* out, int n_heads, int n_kv_heads,            \
        int seq_len, const int* seq_len_dev, int splits, int tile) {                        \
        fx_mma_body<T, 128, true, FX_WIDE_WARPS>(q, k, v, nullptr, nullptr, out, n_heads,   \
                                                 n_kv_heads, seq_len, seq_len_dev, splits,  \
                                                 tile);                                     \
    }

// Any other head_dim DR (a multiple of 8) on the kernel of the next head_dim D up, the
// columns past DR zeros (never read from memory): gqa_split_mma_<dt>_d<D>_r<DR> and its
// _cluster twin (merged on chip where the plan's clusters fit), instantiated by the host
// for the call that needs them.
#define FX_MMA_PAD_ENTRY(NAME, T, D, DR) FX_MMA_KERNELS(NAME, T, D, DR, false)

// Groups of 9-16 query heads per KV head in two tiles of 8 (a block each, the grid's y
// 2 x KV heads), head_dim DR on the kernel of D (DR = D: not padded):
// gqa_split_mma_<dt>_d<D>[_r<DR>]_t2 and its _cluster twin.
#define FX_MMA_TILED_ENTRY(NAME, T, D, DR) FX_MMA_KERNELS(NAME, T, D, DR, true)

// With features F (FX_F_*; their values the last arguments): gqa_split_mma_<dt>_d<D>
// [_r<DR>][_t2]_x<F>, merged by the combine kernel (gqa_split_combine_<dt>_x<F'>), and its
// cluster twin <name>_cluster (which applies sinks and the LSE in the cluster's merge).
#define FX_MMA_FEAT_ENTRY(NAME, T, D, DR, TILED, F)                                         \
    extern "C" __global__ void __launch_bounds__(FX_WARPS_D##D * 32, 1) NAME(               \
        const T* q, const T* k, const T* v, float* ws_o, float* ws_ml, int n_heads,         \
        int n_kv_heads, int seq_len, const int* seq_len_dev, int splits, int tile,          \
        float scale, float cap, int window, const float* slopes, long long head_stride) {   \
        const FxFeat feat{scale, cap, window, slopes, nullptr, nullptr, head_stride};       \
        fx_mma_body<T, D, false, FX_WARPS_D##D, DR, TILED, F>(                              \
            q, k, v, ws_o, ws_ml, nullptr, n_heads, n_kv_heads, seq_len, seq_len_dev,       \
            splits, tile, feat);                                                            \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(FX_WARPS_D##D * 32, 1) NAME##_cluster(     \
        const T* q, const T* k, const T* v, T* out, int n_heads, int n_kv_heads,            \
        int seq_len, const int* seq_len_dev, int splits, int tile, float scale, float cap,  \
        int window, const float* slopes, long long head_stride, const float* sinks,         \
        float* lse) {                                                                       \
        const FxFeat feat{scale, cap, window, slopes, sinks, lse, head_stride};             \
        fx_mma_body<T, D, true, FX_WARPS_D##D, DR, TILED, F>(                               \
            q, k, v, nullptr, nullptr, out, n_heads, n_kv_heads, seq_len, seq_len_dev,      \
            splits, tile, feat);                                                            \
    }
// ... and the wide cluster kernel (head_dim 128): gqa_split_mma_<dt>_d128_wide_x<F>_cluster
#define FX_MMA_WIDE_FEAT_ENTRY(NAME, T, F)                                                  \
    extern "C" __global__ void __launch_bounds__(FX_WIDE_WARPS * 32, 1) NAME(               \
        const T* q, const T* k, const T* v, T* out, int n_heads, int n_kv_heads,            \
        int seq_len, const int* seq_len_dev, int splits, int tile, float scale, float cap,  \
        int window, const float* slopes, long long head_stride, const float* sinks,         \
        float* lse) {                                                                       \
        const FxFeat feat{scale, cap, window, slopes, sinks, lse, head_stride};             \
        fx_mma_body<T, 128, true, FX_WIDE_WARPS, 128, false, F>(                            \
            q, k, v, nullptr, nullptr, out, n_heads, n_kv_heads, seq_len, seq_len_dev,      \
            splits, tile, feat);                                                            \
    }

// Two adjacent KV heads of head_dim DR/2 read as one row of DR elements (their rows lie side
// by side in the cache): n_kv_heads / 2 "KV heads" of DR, query heads in the same order, Q
// block-diagonal (fx_load_q), each query head's output its own half (fx_finish), merged by
// the combine kernel: gqa_split_mma_<dt>_d<D>_r<DR>_p2[_t2]. Rows of 2 x 80-112 bytes
// read as whole runs of the cache (docs/design.md).
#define FX_MMA_PAIR_ENTRY(NAME, T, D, DR, TILED)                                            \
    extern "C" __global__ void __launch_bounds__(FX_WARPS_D##D * 32, 1) NAME(               \
        const T* q, const T* k, const T* v, float* ws_o, float* ws_ml, int n_heads,         \
        int n_kv_heads, int seq_len, const int* seq_len_dev, int splits, int tile) {        \
        fx_mma_body<T, D, false, FX_WARPS_D##D, DR, TILED, 0, 2>(q, k, v, ws_o, ws_ml, nullptr, \
                                                              n_heads, n_kv_heads, seq_len, \
                                                              seq_len_dev, splits, tile);   \
    }

// An fp8 cache (Q8) with q and the output of type QT, features F (0: none; their values
// passed either way): gqa_split_mma_<dt>_<e4m3|e5m2>_d<D>[_r<DR>][_t2]_x<F> and its
// _cluster twin; the cache's head_dim DR a multiple of 8 (fx_issue_step copies 8-byte
// chunks where it is not one of 16).
#define FX_MMA8_KERNELS(NAME, QT, Q8, D, DR, TILED, F)                                       \
    extern "C" __global__ void __launch_bounds__(FX_WARPS_D##D * 32, 1) NAME(               \
        const QT* q, const unsigned char* k, const unsigned char* v, float* ws_o,           \
        float* ws_ml, int n_heads, int n_kv_heads, int seq_len, const int* seq_len_dev,     \
        int splits, int tile, const float* kv_scales, float scale, float cap, int window,   \
        const float* slopes, long long head_stride) {                                       \
        const FxFeat feat{scale, cap, window, slopes, nullptr, nullptr, head_stride};       \
        gqa_split_mma_swapped<fx_half, D, false, FX_WARPS_D##D, DR, TILED, F, 1, Q8, QT>(    \
            q, k, v, ws_o, ws_ml, nullptr, n_heads, n_kv_heads, seq_len, seq_len_dev,       \
            splits, tile, feat, kv_scales);                                                 \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(FX_WARPS_D##D * 32, 1) NAME##_cluster(     \
        const QT* q, const unsigned char* k, const unsigned char* v, QT* out, int n_heads,  \
        int n_kv_heads, int seq_len, const int* seq_len_dev, int splits, int tile,          \
        const float* kv_scales, float scale, float cap, int window, const float* slopes,    \
        long long head_stride, const float* sinks, float* lse) {                            \
        const FxFeat feat{scale, cap, window, slopes, sinks, lse, head_stride};             \
        gqa_split_mma_swapped<fx_half, D, true, FX_WARPS_D##D, DR, TILED, F, 1, Q8, QT>(     \
            q, k, v, nullptr, nullptr, out, n_heads, n_kv_heads, seq_len, seq_len_dev,      \
            splits, tile, feat, kv_scales);                                                 \
    }
// ... and the wide cluster kernel: gqa_split_mma_<dt>_<e4m3|e5m2>_d128_wide_x<F>_cluster
#define FX_MMA8_WIDE_KERNEL(NAME, QT, Q8, F)                                                \
    extern "C" __global__ void __launch_bounds__(FX_WIDE_WARPS * 32, 1) NAME(               \
        const QT* q, const unsigned char* k, const unsigned char* v, QT* out, int n_heads,  \
        int n_kv_heads, int seq_len, const int* seq_len_dev, int splits, int tile,          \
        const float* kv_scales, float scale, float cap, int window, const float* slopes,    \
        long long head_stride, const float* sinks, float* lse) {                            \
        const FxFeat feat{scale, cap, window, slopes, sinks, lse, head_stride};             \
        gqa_split_mma_swapped<fx_half, 128, true, FX_WIDE_WARPS, 128, false, F, 1, Q8, QT>(  \
            q, k, v, nullptr, nullptr, out, n_heads, n_kv_heads, seq_len, seq_len_dev,      \
            splits, tile, feat, kv_scales);                                                 \
    }

#ifndef FX_SELECTED
FX_MMA_WIDE_ENTRY(gqa_split_mma_f16_d128_wide_cluster, fx_half)
FX_MMA_WIDE_ENTRY(gqa_split_mma_bf16_d128_wide_cluster, fx_bf16)
#endif
