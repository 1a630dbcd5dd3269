// Split kernels (gqa_decode_split.cu), part 6: fp16/bf16 caches on tensor cores, the heads as
// the mma's rows (split_mma_swapped.cuh has the other body and the entry points).

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

template <class T>
__device__ __forceinline__ unsigned fx_pack2(float lo, float hi) {
    return (unsigned)fx_from_float<T>(lo).bits | ((unsigned)fx_from_float<T>(hi).bits << 16);
}

// Per head_dim: warps per block and steps in each warp's ring (one fewer in flight). The
// The rings' shape per head_dim (FX_WARPS_D<D>, FX_STAGES_D<D>, FX_RESERVE_STAGES_D<D>):
// split_traits.h, written from ferrox_driver/kernel_traits.py, where the host plans with
// the same values and their measurements are noted.
// A padded head_dim DR may have a depth of its own (FX_STAGES_D<D>_R<DR>: FxPaddedStages),
// and its loops may stop at its own columns (FX_TRIM_D<D>_R<DR>: FxPaddedTrim).
template <int D, int DR = D> struct FxStages {
    static constexpr int value =
        FxPaddedStages<D, DR>::value ? FxPaddedStages<D, DR>::value
        : D == 64                    ? FX_STAGES_D64
        : D == 128                   ? FX_STAGES_D128
                                     : FX_STAGES_D256;
};
template <int D> struct FxWarps {
    static constexpr int value = D == 64 ? FX_WARPS_D64 : D == 128 ? FX_WARPS_D128 : FX_WARPS_D256;
};

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
    // head g's row of the staged Q (shared memory), this lane's part in registers
    __device__ __forceinline__ static FxQ of(const T* row, int tig) {
        FxQ r;
        r.row = row;
        if (IN_REGS) {
#pragma unroll
            for (int kb = 0; kb < D / 32; ++kb)
                r.frag[kb] = *reinterpret_cast<const uint4*>(row + kb * 32 + tig * 8);
        }
        return r;
    }
};
// PAIR = 2 (two KV heads' rows side by side as one of DR = 2 x head_dim): rows j <
// a_heads are the first KV head's query heads, their q in columns 0 .. DR/2, the rest the
// second's, in DR/2 .. DR; the other half of each row is zeros.
template <class T, int D, int THREADS, int DR = D, int PAIR = 1>
__device__ __forceinline__ FxQ<T, D> fx_load_q(const T* q, int h0, int group, int g, int tig,
                                               int a_heads = 0) {
    __shared__ __align__(16) T q_s[8][D + 8];
    for (int i = threadIdx.x; i < 8 * (D / 8); i += THREADS) {
        const int j = i / (D / 8), c = (i % (D / 8)) * 8;  // (columns past DR: zeros)
        if (PAIR == 1) {
            const bool ok = j < group && (DR == D || c < DR);
            *reinterpret_cast<uint4*>(&q_s[j][c]) =
                fx_ldg16(q + (long long)(h0 + j) * DR + c, ok);
        } else {
            constexpr int DRH = DR / 2;  // the head_dim
            const int lo = j < a_heads ? 0 : DRH;
            const bool ok = j < group && c >= lo && c < lo + DRH;
            *reinterpret_cast<uint4*>(&q_s[j][c]) =
                fx_ldg16(q + (long long)(h0 + j) * DRH + (ok ? c - lo : 0), ok);
        }
    }
    __syncthreads();  // q_s complete; the first steps' loads are already in flight
    return FxQ<T, D>::of(q_s[g], tig);
}

template <class T, int D, bool CLUSTER, int WARPS, int DR = D, int TILED = 0, int F = 0, int PAIR = 1>
__device__ __forceinline__ void gqa_split_mma(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    float* __restrict__ ws_o, float* __restrict__ ws_ml, T* __restrict__ out, int n_heads,
    int n_kv_heads, int seq_len, const int* __restrict__ seq_len_dev, int splits, int tile,
    const FxFeat feat = FxFeat{}) {
    static_assert(TILED < 2, "two tiles per block: the swapped body's (gqa_split_mma_swapped)");
    constexpr int S = FxStages<D, PAIR == 1 ? DR : D>::value;
    constexpr int THREADS = WARPS * 32;
    constexpr int STEP = 16 * D;          // elements of one step's K (or V)
    // a padded head_dim's columns past DR are zeros; where measured to pay (FxPaddedTrim)
    // the loops stop at the last 32 (Q K^T) and 64 (P V) columns with any of DR
    constexpr bool TRIM = PAIR == 1 && FxPaddedTrim<D, DR>::value;
    constexpr int KB = TRIM ? (DR + 31) / 32 : D / 32, HB = TRIM ? (DR + 63) / 64 : D / 64;
    extern __shared__ __align__(16) unsigned char fx_dyn_smem[];

    FxTcBlock blk;  // this block's chunk, KV head and query heads
    if (!fx_tc_block<CLUSTER, TILED, D, F>(blk, WARPS * S * 2 * STEP * sizeof(T), THREADS,
                                           n_heads, n_kv_heads, seq_len, seq_len_dev, splits,
                                           tile, feat.window))
        return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;  // mma fragment coordinates: lane = 4g + tig
    const auto wr = fx_warp_ring<T, D, 16, S, WARPS, DR, F>(
        fx_dyn_smem, k, v, blk.g_kv, n_kv_heads, feat.head_stride, blk.start, blk.end, warp, lane);

    // Q as the A operand (rows = heads; rows 8..15 are zero)
    const int a_heads = PAIR == 1 ? 0 : max(0, min(blk.group, blk.heads_per_kv / 2 - blk.tile_h));
    const FxQ<T, D> qf = fx_load_q<T, D, THREADS, DR, PAIR>(q, blk.h0, blk.group, g, tig, a_heads);

    const FxScore<F> sc =
        fx_scorer<F>(feat, DR / PAIR, blk.h0 + g, g < blk.group, seq_len, seq_len_dev);

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
    FxRunning run;  // head g's online softmax

    for (int j = 0; wr.t0(j) < blk.end; ++j) {
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
            for (int kb = 0; kb < KB; ++kb) {
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
        x[0] = ta < blk.end ? sc(s[0][0], ta) : -INFINITY;
        x[1] = ta + 1 < blk.end ? sc(s[0][1], ta + 1) : -INFINITY;
        x[2] = tc < blk.end ? sc(s[1][0], tc) : -INFINITY;
        x[3] = tc + 1 < blk.end ? sc(s[1][1], tc + 1) : -INFINITY;
        float p[4];
        const float alpha =
            run.step(fx_lanes_max<1, 4>(fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]))), x, p);
        const unsigned pa0 = fx_pack2<T>(p[0], p[1]);  // P[g][tokens 2tig, 2tig+1]
        const unsigned pa2 = fx_pack2<T>(p[2], p[3]);  // P[g][tokens 8+2tig, 9+2tig]
        // ---- O = O * alpha + P V; this lane's V rows are 2tig, 2tig+1, 2tig+8, 2tig+9
#pragma unroll
        for (int hb = 0; hb < HB; ++hb) {
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
    fx_merge_warps<CLUSTER, WARPS, D, WARPS * S * 2 * STEP * (int)sizeof(T), DR, F, PAIR>(
        fx_dyn_smem, run.m, run.l, oacc, ws_o, ws_ml, out, blk.h0, blk.group, splits,
        blk.split, seq_len, seq_len_dev, where, &feat, a_heads);
}
