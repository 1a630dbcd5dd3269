// Split kernels (gqa_decode_split.cu), part 8: fp32 caches on tensor cores (split TF32),
// with their entry points.

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
// Per head_dim: warps per block, steps in each warp's ring and tokens per step
// (FX_TC32_WARPS_D<D>, FX_TC32_STAGES_D<D>, FX_TC32_TOKENS_D<D>, FX_TC32_RESERVE_STAGES_D<D>):
// split_traits.h, written from ferrox_driver/kernel_traits.py.
template <int D> struct FxTc32Shape;
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

template <int D, bool CLUSTER, int F = 0>  // CLUSTER: as gqa_split_mma; F: features
__device__ __forceinline__ void gqa_split_tc32(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    float* __restrict__ ws_o, float* __restrict__ ws_ml, float* __restrict__ out, int n_heads,
    int n_kv_heads, int seq_len, const int* __restrict__ seq_len_dev, int splits, int tile,
    const FxFeat feat = FxFeat{}) {
    constexpr int S = FxTc32Shape<D>::stages;
    constexpr int WARPS = FxTc32Shape<D>::warps, THREADS = WARPS * 32;
    constexpr int TOK = FxTc32Shape<D>::tokens, NB = TOK / 8;  // tokens per step, 8-blocks
    static_assert(TOK == 8 || TOK == 16, "steps of 8 or 16 tokens");
    constexpr int NCH = D / 4;     // 16-byte chunks per row
    constexpr int STEP = TOK * D;  // floats of one step's K (or V)
    constexpr int DR = D;          // the cache's head_dim: the kernel's own
    constexpr bool TILED = false;  // groups of at most 8
    extern __shared__ __align__(16) unsigned char fx_dyn_smem[];

    FxTcBlock blk;  // this block's chunk, KV head and query heads
    if (!fx_tc_block<CLUSTER, TILED, D, F>(blk, WARPS * S * 2 * STEP * sizeof(float), THREADS,
                                           n_heads, n_kv_heads, seq_len, seq_len_dev, splits,
                                           tile, feat.window))
        return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;  // mma fragment coordinates: lane = 4g + tig
    const auto wr = fx_warp_ring<float, D, TOK, S, WARPS, DR, F>(
        fx_dyn_smem, k, v, blk.g_kv, n_kv_heads, feat.head_stride, blk.start, blk.end, warp, lane);

    // Q, pre-scaled into the base-2 domain and split into TF32 pairs, in shared memory
    // (in registers it would take 2 * D / 4 of them): rows = heads, padded by 16 bytes.
    __shared__ __align__(16) unsigned qh_s[8][D + 4];
    __shared__ __align__(16) unsigned ql_s[8][D + 4];
    const float sscale = fx_q_scale<F>(feat, D);
    // (with a soft-cap or ALiBi, Q is scaled in natural units and sc finishes the scores)
    const auto sc =
        fx_scorer<F & ~FX_F_SCALE>(feat, 1, blk.h0 + g, g < blk.group, seq_len, seq_len_dev);
    for (int i = threadIdx.x; i < 8 * NCH; i += THREADS) {
        const int j = i / NCH, c = (i % NCH) * 4;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (j < blk.group)
            x = __ldg(reinterpret_cast<const float4*>(q + (long long)(blk.h0 + j) * D + c));
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
    FxRunning run;  // head g's online softmax

    for (int j = 0; wr.t0(j) < blk.end; ++j) {
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
                    t0 + 8 * n + 2 * tig + e < blk.end
                        ? fx_prescaled<F>(sc, (s[n][e] + s[n][e + 2]) + (s2[n][e] + s2[n][e + 2]),
                                          t0 + 8 * n + 2 * tig + e)
                        : -INFINITY;
        float mx = x[0];
#pragma unroll
        for (int i = 1; i < 2 * NB; ++i) mx = fmaxf(mx, x[i]);
        float p[2 * NB];
        const float alpha = run.step(fx_lanes_max<1, 4>(mx), x, p);
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
    fx_merge_warps<CLUSTER, WARPS, D, WARPS * S * 2 * STEP * (int)sizeof(float), DR>(
        fx_dyn_smem, run.m, run.l, oacc, ws_o, ws_ml, out, blk.h0, blk.group, splits,
        blk.split, seq_len, seq_len_dev, where);
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

// With features F: gqa_split_tc32_f32_d<D>_x<F> (the combine kernel merges it).
#define FX_TC32_FEAT_ENTRY(NAME, D, F)                                                      \
    extern "C" __global__ void __launch_bounds__(FX_TC32_WARPS_D##D * 32, 1) NAME(          \
        const float* q, const float* k, const float* v, float* ws_o, float* ws_ml,          \
        int n_heads, int n_kv_heads, int seq_len, const int* seq_len_dev, int splits,       \
        int tile, float scale, float cap, int window, const float* slopes,                  \
        long long head_stride) {                                                            \
        const FxFeat feat{scale, cap, window, slopes, nullptr, nullptr, head_stride};       \
        gqa_split_tc32<D, false, F>(q, k, v, ws_o, ws_ml, nullptr, n_heads, n_kv_heads,     \
                                    seq_len, seq_len_dev, splits, tile, feat);              \
    }

#ifndef FX_SELECTED  // the host compiles one entry at a time (attention.split_entry)
FX_TC32_ENTRY(gqa_split_tc32_f32_d64, 64)
FX_TC32_ENTRY(gqa_split_tc32_f32_d128, 128)
FX_TC32_ENTRY(gqa_split_tc32_f32_d256, 256)
#endif
