// Split kernels (gqa_decode_split.cu), part 12: multi-head latent attention (MLA) decode on
// tensor cores, written so that wide GQA heads (head_dim 512, a value width of its own) can
// take the same body.
//
// MLA (DeepSeek V2/V3) in its absorbed form: one latent "KV head" of DK = 576 columns (512
// latent + 64 rope) read by every query head; the values are the first DV = 512 columns of
// the same rows. At batch one the decode is bound by reading the latent, so a block serves
// 16 x RT query rows (RT = 1 or 2) from each K tile it copies into shared memory once: the
// rows are a KV head's n_q x group (query t's heads, then t + 1's), as the verify rows
// kernel (split_rows.cuh) has them, and its combine (gqa_verify_rows_combine) merges the
// chunks with the sinks and the LSE.
//
// A block of FX_LATENT_WARPS = 8 warps takes chunk `split` of the sequence and rows r0 ..
// r0 + 16 RT of KV head g_kv, in steps of TOK tokens (64; 32 where a GPU's shared memory
// per block cannot hold the 64-token ring, sm_89/sm_86/sm_120) through a ring of S stages
// that every thread fills by cp.async. Per step:
//   S = Q K^T   the warps split the DK columns four ways (KW = 4 column groups of DK / 64
//               columns, q's fragments of them held in registers for the whole chunk) and
//               the tokens TW = 8 / (4 RT) ways: warp w = (kw, rt, tw) multiplies row tile
//               rt's 16 rows by tokens tw TOK / TW .. of its columns, NT = TOK / (8 TW)
//               independent accumulators; the four column groups' partial scores go to
//               shared memory as they lie in the fragments (a float4 a lane);
//   softmax     units of (row tile, 8 tokens) go round the warps: each sums its four
//               partials in a fixed order, scales, caps and masks them (the row's causal
//               limit, window, the chunk's end), and posts its rows' maxima; every warp then
//               reads the maxima of all its rows (each lane: rows g and g + 8 of every row
//               tile) and keeps the same running max (bit for bit: the same operations on
//               the same values), so each knows the factor alpha that rescales what came
//               before; a unit writes its probabilities P as 16-bit values to shared memory
//               and keeps its share of the running sum;
//   O += P V    the warps split the DV output columns (DV / 8 = 64 each: RT x 8 mma tiles
//               of accumulators, 32 RT floats a lane) and read V as the first DV columns of
//               the step's K rows (VK: no second read of the latent) or, for a separate
//               value cache (!VK), the step's V rows.
// Five barriers a step: the stage in (and the previous step done), (fp8) the stage widened,
// the partial scores written, the maxima written, P written.
//
// mma.sync m16n8k16 (row.col, fp16/bf16 in, fp32 accumulate); g = lane / 4, tig = lane % 4:
//   A (16 x 16, row major): a0 = (row g, k 2tig..2tig+1), a1 = (row g+8, k 2tig..),
//                           a2 = (row g, k 2tig+8..2tig+9), a3 = (row g+8, k 2tig+8..)
//   B (16 x 8, "col"):      b0 = (k 2tig..2tig+1, col g), b1 = (k 2tig+8..2tig+9, col g)
//   C (16 x 8, fp32):       c0, c1 = (row g, cols 2tig, 2tig+1), c2, c3 = (row g+8, same)
// S = Q K^T: A = q (rows x columns; from global memory once), B[k][n] = K[token n][column
// k]: an ldmatrix (not transposed) of 8 token rows x 8 columns gives lane l the row l / 4,
// columns 2(l % 4).. = (token g, columns 2tig..) = b0's. O = P V: A = P (rows x tokens, by
// ldmatrix from shared memory), B[k][n] = V[token k][column n]: ldmatrix.trans of 8 token
// rows x 8 columns gives (tokens 2tig, 2tig+1; column g) = b0's.
//
// Shared memory (dynamic, in this order): the ring, S stages of [TOK][DK] K rows (then, !VK,
// [TOK][DV] V rows) of the cache's elements, 16-bit rows XOR-swizzled in 16-byte units
// (chunk c of row r at c ^ (r & 7), fx_rows_at: every ldmatrix free of bank conflicts; DK
// and DV multiples of 64 keep each chunk within its row); (Q8) one more stage widened to
// fp16; the partial scores [KW][RT][TOK / 8][32 lanes] float4; P [16 RT][TOK + 8] (a row
// padded by 16 bytes against bank conflicts); the maxima [TOK / 8][16 RT] float (after the
// loop: the sums); q's largest |q| per row (Q8).
//
// An fp8 cache (Q8: FX_E4M3, FX_E5M2): the stages hold the cache's bytes as they are, and
// each step is widened (exactly) into the fp16 stage; q is converted to fp16, each row
// scaled by a power of two where it would pass fp16's range (fx_q8_shift), the K scale and
// that power folded into the row's score scale, the V scale applied to the partial output
// once. The scales: k_scales[g_kv] and v_scales[g_kv] where given, else `kv_scale` (a
// per-tensor scale passed by value).

// The ring's depth per step size and format (FX_LATENT_STAGES*: split_traits.h, from
// kernels/traits.py, where the host plans with the same values)
template <int TOK, int Q8>
struct FxLatentStages {
    static constexpr int value = TOK == 64 ? (Q8 ? FX_LATENT_STAGES8_T64 : FX_LATENT_STAGES_T64)
                                           : (Q8 ? FX_LATENT_STAGES8_T32 : FX_LATENT_STAGES_T32);
};

// The block's shared memory, in bytes, by part (decode/latent_plan.py's
// latent_shared_bytes computes the same sum for the launch)
template <int DK, int DV, bool VK, int RT, int TOK, int Q8>
struct FxLatentSmem {
    static constexpr int S = FxLatentStages<TOK, Q8>::value;
    static constexpr int ROW_ELEMS = DK + (VK ? 0 : DV);  // a token's elements in a stage
    static constexpr int STAGE = TOK * ROW_ELEMS * (Q8 ? 1 : 2);
    static constexpr int RING = S * STAGE;
    static constexpr int WIDE = Q8 ? TOK * ROW_ELEMS * 2 : 0;
    static constexpr int PART = 4 * RT * (TOK / 8) * 32 * 16;
    static constexpr int PS = TOK + 8;  // a P row's elements
    static constexpr int P = 16 * RT * PS * 2;
    static constexpr int RED = (TOK / 8) * 16 * RT * 4;
    static constexpr int TOP = 16 * RT * 4;
    static constexpr int BYTES = RING + WIDE + PART + P + RED + TOP;
};

// two floats as a 16-bit pair (lo in the low half) by one cvt: fx_pack2's rounding, round to
// nearest even, in hardware (the bits agree but for a NaN's payload; bf16 in software takes
// ten instructions a value, which a latent step's P pays 16 times a thread). sm_80 on, as
// the latent kernels.
template <class T>
__device__ __forceinline__ unsigned fx_pack2_rn(float lo, float hi);
#if __CUDA_ARCH__ >= 800
template <>
__device__ __forceinline__ unsigned fx_pack2_rn<fx_bf16>(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <>
__device__ __forceinline__ unsigned fx_pack2_rn<fx_half>(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
#endif

// TOK rows of W elements (16-byte chunks of EPC) from `src` (rows `row` apart; rows from
// `end` on: zeros, never read) into a stage `dst` by cp.async: SWZ, swizzled for ldmatrix
// (fx_rows_at), else as they are. Each thread's copies sit at offsets fixed for the block (a
// chunk cj of every 8 (SWZ) or 4, rows r + passes of THREADS / 8 or / 4): a step computes
// its row pointers and adds immediates, not a divide and a swizzle per chunk (where the
// shapes do not divide so: the chunk-by-chunk loop).
template <int W, int EPC, int TOK, int THREADS, bool SWZ, class KT>
__device__ __forceinline__ void fx_latent_copy(KT* dst, const KT* src, long long row, int t0,
                                               int end, int start) {
    constexpr int CH = W / EPC, CPR = SWZ ? 8 : 4, RPP = THREADS / CPR;
    if constexpr (CH % CPR == 0 && TOK % RPP == 0 && RPP % 8 == 0) {
        const int r = threadIdx.x / CPR, cj = threadIdx.x % CPR;
        KT* d = dst + r * W + (SWZ ? (cj ^ (r & 7)) : cj) * EPC;  // (rows RPP on: r & 7 alike)
#pragma unroll
        for (int h = 0; h < TOK / RPP; ++h) {
            const int t = t0 + r + h * RPP;
            const bool ok = t < end;
            const KT* s = src + (long long)(ok ? t : start) * row + cj * EPC;
#pragma unroll
            for (int k = 0; k < CH / CPR; ++k)
                fx_cp_async16(d + h * RPP * W + k * CPR * EPC, s + k * CPR * EPC, ok);
        }
    } else {
#pragma unroll 2
        for (int i = threadIdx.x; i < TOK * CH; i += THREADS) {
            const int r = i / CH, c = i % CH;
            const bool ok = t0 + r < end;
            const long long off = (long long)(ok ? t0 + r : start) * row + c * EPC;
            fx_cp_async16(dst + (SWZ ? fx_rows_at<W>(r, c) : r * W + c * EPC), src + off, ok);
        }
    }
}

// (Q8) TOK rows of W fp8 elements (`src`, rows W bytes apart) widened into 16-bit rows of
// `dst`, swizzled for ldmatrix (fx_rows_at): each thread's chunks at offsets fixed for the
// block (chunk c = t % 8 of every 64 columns of rows t / 8 + passes of THREADS / 8), not a
// divide a chunk (where the shapes do not divide so: the chunk-by-chunk loop)
template <int W, int TOK, int THREADS, int Q8, class T, class KT>
__device__ __forceinline__ void fx_latent_widen(T* dst, const KT* src) {
    constexpr int CH = W / 8, RPP = THREADS / 8;
    if constexpr (CH % 8 == 0 && TOK % RPP == 0 && RPP % 8 == 0) {
        const int r = threadIdx.x >> 3, c = threadIdx.x & 7;
        T* d = dst + r * W + ((c ^ (r & 7)) << 3);  // (rows RPP on: r & 7 alike)
        const KT* s = src + r * W + c * 8;
#pragma unroll
        for (int h = 0; h < TOK / RPP; ++h)
#pragma unroll
            for (int b = 0; b < CH / 8; ++b)
                *reinterpret_cast<uint4*>(d + h * RPP * W + b * 64) =
                    FxRead<Q8>::at(s + h * RPP * W, b * 64);
    } else {
        for (int i = threadIdx.x; i < TOK * CH; i += THREADS) {
            const int r = i / CH, c = i % CH;
            *reinterpret_cast<uint4*>(dst + fx_rows_at<W>(r, c)) =
                FxRead<Q8>::at(src + r * W, c * 8);
        }
    }
}

// QT: q's and the output's type (fx_half, fx_bf16); Q8: 0 (a cache of QT), FX_E4M3 or
// FX_E5M2; DK, DV: K's and V's widths; VK: V is the first DV columns of K's rows (MLA; v
// and v_row unread); RT: row tiles of 16 per block; TOK: tokens a step; F: the features
// (window, cap, scale; the sinks and the LSE are the combine's).
// k_row, v_row: elements from one token's row to the next; k_head, v_head: from one KV
// head's to the next's (an MLA cache: 576, 576, 0, 0).
template <class QT, int Q8, int DK, int DV, bool VK, int RT, int TOK, int F>
__device__ __forceinline__ void gqa_split_latent(
    const QT* __restrict__ q, const typename FxStore<QT, Q8>::type* __restrict__ k,
    const typename FxStore<QT, Q8>::type* __restrict__ v, float* __restrict__ ws_o,
    float* __restrict__ ws_ml, int n_heads, int n_kv_heads, int n_q, int seq_len,
    const int* __restrict__ seq_len_dev, int splits, int tile, long long k_row, long long v_row,
    long long k_head, long long v_head, const FxFeat feat, const float* __restrict__ k_scales,
    const float* __restrict__ v_scales, float kv_scale) {
    using KT = typename FxStore<QT, Q8>::type;  // the cache's element
    using T = typename FxRowsMma<QT, Q8>::type;  // the mma's (fp16 for an fp8 cache)
    using SM = FxLatentSmem<DK, DV, VK, RT, TOK, Q8>;
    constexpr int W = FX_LATENT_WARPS, THREADS = 32 * W, KW = 4, TW = W / (KW * RT);
    constexpr int NT = TOK / (8 * TW);  // a QK warp's n-tiles (8 tokens each)
    constexpr int KS = DK / (16 * KW);  // a QK warp's k-steps (16 columns each)
    constexpr int NTOT = TOK / 8;       // n-tiles of a step
    constexpr int UNITS = RT * NTOT, UPW = (UNITS + W - 1) / W;  // softmax units, per warp
    constexpr int NV = DV / (8 * W);    // a PV warp's n-tiles of output columns
    constexpr int S = SM::S, HT = 16 * RT, PS = SM::PS;
    constexpr int EPC = Q8 ? 16 : 8;    // cache elements per 16-byte chunk
    static_assert(Q8 == 0 || Q8 == FX_E4M3 || Q8 == FX_E5M2, "16-bit or fp8 caches");
    static_assert(W % (KW * RT) == 0 && TW >= 1 && NT % 2 == 0, "warps tile the scores");
    static_assert(DK % (16 * KW) == 0 && DK % 64 == 0 && DV % 64 == 0, "whole swizzled rows");
    static_assert(DV % (16 * W) == 0 && NV % 2 == 0, "warps tile the output columns");
    static_assert(!VK || DV <= DK, "V within K's rows");
    static_assert(TOK == 32 || TOK == 64, "steps of 32 or 64 tokens");
    static_assert(UNITS <= 2 * W, "at most two softmax units a warp");

    extern __shared__ __align__(16) unsigned char fx_dyn_smem[];
    unsigned char* ring = fx_dyn_smem;
    T* wide = reinterpret_cast<T*>(ring + SM::RING);  // (Q8: the step widened)
    float4* part = reinterpret_cast<float4*>(ring + SM::RING + SM::WIDE);
    T* p_s = reinterpret_cast<T*>(ring + SM::RING + SM::WIDE + SM::PART);
    float* red = reinterpret_cast<float*>(ring + SM::RING + SM::WIDE + SM::PART + SM::P);
    int* q_top = reinterpret_cast<int*>(red + NTOT * HT);
    fx_check_launch(SM::BYTES, THREADS);
    fx_let_combine_start<2>();

    // ---- where the block stands: its rows, its chunk
    const FxRowBlock<F, HT> blk(n_heads, n_kv_heads, n_q, seq_len, seq_len_dev, splits, tile,
                                feat.window);
    if (blk.idle()) return;  // (the combine reads none of it)
    const int group = blk.group, rows_kv = blk.rows_kv, g_kv = blk.g_kv, r0 = blk.r0;
    const int seq = blk.seq, base = blk.base;  // query t sits at base + t
    const int start = blk.start, end = blk.end;
    const int split = blockIdx.x, window = feat.window;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const KT* kg = k + (long long)g_kv * k_head;
    const KT* vg = v + (long long)g_kv * v_head;

    // ---- stage j: tokens start + j TOK .. (rows past `end`: zeros, never read from memory)
    const int steps = (end - start + TOK - 1) / TOK;
    auto issue = [&](int j) {
        if (j < steps) {
            KT* ks = reinterpret_cast<KT*>(ring + (j % S) * SM::STAGE);
            const int t0 = start + j * TOK;
            fx_latent_copy<DK, EPC, TOK, THREADS, Q8 == 0>(ks, kg, k_row, t0, end, start);
            if constexpr (!VK)
                fx_latent_copy<DV, EPC, TOK, THREADS, Q8 == 0>(ks + TOK * DK, vg, v_row, t0, end,
                                                               start);
        }
        fx_cp_async_commit();  // (one group per stage, even empty: the waits count stages)
    };
#pragma unroll
    for (int j = 0; j < S - 1; ++j) issue(j);

    // ---- this warp's roles: (kw, rt, tw) for the scores, its output columns for P V
    const int kw = warp % KW, q_rt = (warp / KW) % RT, tw = warp / (KW * RT);
    // block row i -> the KV head's row r0 + i: query t = row / group, head g_kv group + row %
    // group; its place among the output's rows, t n_heads + h (-1: a padding row)
    auto out_row = [&](int i) {
        const int kr = r0 + i;
        return kr < rows_kv ? (kr / group) * n_heads + g_kv * group + kr % group : -1;
    };

    // ---- q's fragments of row tile q_rt, columns of group kw: a (k-step kk) = 16 kk ..
    unsigned qf[KS][4];
    {
        const int ra = out_row(q_rt * 16 + g), rb = out_row(q_rt * 16 + g + 8);
        const QT* qa = q + (long long)max(ra, 0) * DK + kw * (KS * 16) + 2 * tig;
        const QT* qb = q + (long long)max(rb, 0) * DK + kw * (KS * 16) + 2 * tig;
#pragma unroll
        for (int i = 0; i < KS; ++i) {
            qf[i][0] = ra >= 0 ? __ldg(reinterpret_cast<const unsigned*>(qa + 16 * i)) : 0u;
            qf[i][1] = rb >= 0 ? __ldg(reinterpret_cast<const unsigned*>(qb + 16 * i)) : 0u;
            qf[i][2] = ra >= 0 ? __ldg(reinterpret_cast<const unsigned*>(qa + 16 * i + 8)) : 0u;
            qf[i][3] = rb >= 0 ? __ldg(reinterpret_cast<const unsigned*>(qb + 16 * i + 8)) : 0u;
        }
    }
    if constexpr (Q8 != 0) {  // each row's largest |q| -> the power of two it is scaled by
        for (int i = threadIdx.x; i < HT; i += THREADS) q_top[i] = 0;
        __syncthreads();
        float ta = 0.f, tb = 0.f;
#pragma unroll
        for (int i = 0; i < KS; ++i)
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                const float2 fa = fx_unpack2(qf[i][e], QT{}), fb = fx_unpack2(qf[i][e + 1], QT{});
                ta = fmaxf(ta, fmaxf(fabsf(fa.x), fabsf(fa.y)));
                tb = fmaxf(tb, fmaxf(fabsf(fb.x), fabsf(fb.y)));
            }
        atomicMax(&q_top[q_rt * 16 + g], __float_as_int(ta));
        atomicMax(&q_top[q_rt * 16 + g + 8], __float_as_int(tb));
        __syncthreads();
        const float da = __int_as_float((127 - fx_q8_shift(q_top[q_rt * 16 + g])) << 23);
        const float db = __int_as_float((127 - fx_q8_shift(q_top[q_rt * 16 + g + 8])) << 23);
#pragma unroll
        for (int i = 0; i < KS; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 f = fx_unpack2(qf[i][e], QT{});
                const float d = (e & 1) ? db : da;
                qf[i][e] = fx_pack2<fx_half>(f.x * d, f.y * d);
            }
    }

    // ---- the softmax units of this warp: u = warp + i W is (row tile u / NTOT, n-tile u %
    // NTOT); per unit, its two rows' scorers and visible tokens [lo, hi]
    const float k_sc = Q8 ? (k_scales != nullptr ? k_scales[g_kv] : kv_scale) : 1.f;
    FxScore<F> sc[UPW][2];
    int lo[UPW][2], hi[UPW][2];
#pragma unroll
    for (int i = 0; i < UPW; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int u = min(warp + i * W, UNITS - 1), row = (u / NTOT) * 16 + g + 8 * h;
            const int r = out_row(row);
            const int t = (r0 + row) / group;  // (a padding row: never visible)
            sc[i][h] = fx_scorer<F>(feat, DK, 0, false, seq, nullptr);
            if (Q8) sc[i][h].fold(k_sc * __int_as_float((127 + fx_q8_shift(q_top[row])) << 23));
            hi[i][h] = r >= 0 ? base + t : -1;
            lo[i][h] = (F & FX_F_WINDOW) ? base + t + 1 - window : 0;
        }

    // running maxima of the lane's rows (g, g + 8 of every row tile), kept alike by every
    // warp; each unit's share of its rows' running sums; the output's accumulators
    float m_run[RT][2], l_sh[UPW][2];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) m_run[rt][0] = m_run[rt][1] = -INFINITY;
#pragma unroll
    for (int i = 0; i < UPW; ++i) l_sh[i][0] = l_sh[i][1] = 0.f;
    float o[RT][NV][4];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int n = 0; n < NV; ++n) o[rt][n][0] = o[rt][n][1] = o[rt][n][2] = o[rt][n][3] = 0.f;

    // ldmatrix lanes: K (x4: tokens 0-7 / 8-15 of an n-tile pair, columns 16 kk / + 8), P
    // (x4: rows 0-7 / 8-15, tokens 16 kt / + 8), V (x4 trans: tokens 0-7 / 8-15, columns of
    // n-tiles dn / dn + 1)
    const int k_r = ((lane >> 4) << 3) + (lane & 7), k_c = (lane >> 3) & 1;
    const int a_r = ((lane >> 3) & 1) * 8 + (lane & 7), a_c = lane >> 4;
    const int v_r = a_r, v_c = a_c;

    for (int j = 0; j < steps; ++j) {
        fx_cp_async_wait<S - 2>();
        __syncthreads();  // stage j is in for every thread; step j - 1 is done by every warp
        issue(j + S - 1);
        const T* ks;
        if constexpr (Q8 != 0) {  // the step's bytes widened into `wide`, swizzled
            const KT* kb = reinterpret_cast<const KT*>(ring + (j % S) * SM::STAGE);
            fx_latent_widen<DK, TOK, THREADS, Q8>(wide, kb);
            if constexpr (!VK)
                fx_latent_widen<DV, TOK, THREADS, Q8>(wide + TOK * DK, kb + TOK * DK);
            __syncthreads();
            ks = wide;
        } else {
            ks = reinterpret_cast<const T*>(ring + (j % S) * SM::STAGE);
        }
        const int t0 = start + j * TOK;

        // ---- partial scores: row tile q_rt x tokens tw TOK / TW .. x columns of group kw
        {
            float s[NT][4];
#pragma unroll
            for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
            const T* kt = ks + tw * (NT * 8) * DK;
#pragma unroll
            for (int i = 0; i < KS; ++i) {
                const int kk = kw * KS + i;
#pragma unroll
                for (int n = 0; n < NT; n += 2) {
                    unsigned b[4];  // b0, b1: tokens 8n + g; b2, b3: tokens 8n + 8 + g
                    fx_ldsm_x4(b, kt + fx_rows_at<DK>(n * 8 + k_r, 2 * kk + k_c));
                    FxMma<T>::run(s[n][0], s[n][1], s[n][2], s[n][3], qf[i][0], qf[i][1],
                                  qf[i][2], qf[i][3], b[0], b[1]);
                    FxMma<T>::run(s[n + 1][0], s[n + 1][1], s[n + 1][2], s[n + 1][3], qf[i][0],
                                  qf[i][1], qf[i][2], qf[i][3], b[2], b[3]);
                }
            }
#pragma unroll
            for (int n = 0; n < NT; ++n)
                part[((kw * RT + q_rt) * NTOT + tw * NT + n) * 32 + lane] =
                    make_float4(s[n][0], s[n][1], s[n][2], s[n][3]);
        }
        __syncthreads();  // the partial scores are in

        // ---- the units' scores and their maxima
        float x[UPW][4];
#pragma unroll
        for (int i = 0; i < UPW; ++i) {
            const int u = warp + i * W;
            if (u >= UNITS) continue;
            const int rt = u / NTOT, nt = u % NTOT;
            float4 acc = part[((0 * RT + rt) * NTOT + nt) * 32 + lane];
#pragma unroll
            for (int c = 1; c < KW; ++c) {  // the column groups' partials, in order
                const float4 y = part[((c * RT + rt) * NTOT + nt) * 32 + lane];
                acc.x += y.x;
                acc.y += y.y;
                acc.z += y.z;
                acc.w += y.w;
            }
            const float dots[4] = {acc.x, acc.y, acc.z, acc.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = e >> 1, tok = t0 + nt * 8 + 2 * tig + (e & 1);
                const bool in = tok < end && tok <= hi[i][h] && tok >= lo[i][h];
                x[i][e] = in ? sc[i][h](dots[e], tok) : -INFINITY;
            }
            const float ma = fx_lanes_max<1, 4>(fmaxf(x[i][0], x[i][1]));
            const float mb = fx_lanes_max<1, 4>(fmaxf(x[i][2], x[i][3]));
            if (tig == 0) {
                red[nt * HT + rt * 16 + g] = ma;
                red[nt * HT + rt * 16 + g + 8] = mb;
            }
        }
        __syncthreads();  // the maxima are in

        // ---- every warp: its rows' new maxima and the factors rescaling what came before
        float alpha[RT][2];
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = rt * 16 + g + 8 * h;
                float mx = red[row];
#pragma unroll
                for (int nt = 1; nt < NTOT; ++nt) mx = fmaxf(mx, red[nt * HT + row]);
                const float m_new = fmaxf(m_run[rt][h], mx);
                alpha[rt][h] = m_run[rt][h] == -INFINITY ? 0.f : fx_exp2(m_run[rt][h] - m_new);
                m_run[rt][h] = m_new;
            }
        // ---- the units' probabilities to P, their shares of the sums
#pragma unroll
        for (int i = 0; i < UPW; ++i) {
            const int u = warp + i * W;
            if (u >= UNITS) continue;
            const int rt = u / NTOT, nt = u % NTOT;
            float m[2], al[2];  // (row tile rt's, selected without indexing by it)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                m[h] = m_run[0][h];
                al[h] = alpha[0][h];
#pragma unroll
                for (int r = 1; r < RT; ++r) {
                    m[h] = rt == r ? m_run[r][h] : m[h];
                    al[h] = rt == r ? alpha[r][h] : al[h];
                }
            }
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; ++e)
                p[e] = x[i][e] == -INFINITY ? 0.f : fx_exp2(x[i][e] - m[e >> 1]);
            l_sh[i][0] = l_sh[i][0] * al[0] + (p[0] + p[1]);
            l_sh[i][1] = l_sh[i][1] * al[1] + (p[2] + p[3]);
            T* pr = p_s + (rt * 16 + g) * PS + nt * 8 + 2 * tig;
            *reinterpret_cast<unsigned*>(pr) = fx_pack2_rn<T>(p[0], p[1]);
            *reinterpret_cast<unsigned*>(pr + 8 * PS) = fx_pack2_rn<T>(p[2], p[3]);
        }
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int n = 0; n < NV; ++n) {
                o[rt][n][0] *= alpha[rt][0];
                o[rt][n][1] *= alpha[rt][0];
                o[rt][n][2] *= alpha[rt][1];
                o[rt][n][3] *= alpha[rt][1];
            }
        __syncthreads();  // P is in

        // ---- O += P V: this warp's output columns warp DV / W .., k-step kt = tokens 16 kt ..
        const T* vs = VK ? ks : ks + TOK * DK;
        constexpr int VD = VK ? DK : DV;  // (the V rows' width in the stage: K's for MLA)
#pragma unroll
        for (int kt = 0; kt < TOK / 16; ++kt) {
            unsigned a[RT][4];
#pragma unroll
            for (int rt = 0; rt < RT; ++rt)
                fx_ldsm_x4(a[rt], p_s + (rt * 16 + a_r) * PS + kt * 16 + a_c * 8);
#pragma unroll
            for (int n = 0; n < NV; n += 2) {
                unsigned b[4];  // b0, b1: columns of n-tile n; b2, b3: of n + 1
                fx_ldsm_x4_trans(b, vs + fx_rows_at<VD>(kt * 16 + v_r, warp * NV + n + v_c));
#pragma unroll
                for (int rt = 0; rt < RT; ++rt) {
                    FxMma<T>::run(o[rt][n][0], o[rt][n][1], o[rt][n][2], o[rt][n][3], a[rt][0],
                                  a[rt][1], a[rt][2], a[rt][3], b[0], b[1]);
                    FxMma<T>::run(o[rt][n + 1][0], o[rt][n + 1][1], o[rt][n + 1][2],
                                  o[rt][n + 1][3], a[rt][0], a[rt][1], a[rt][2], a[rt][3], b[2],
                                  b[3]);
                }
            }
        }
    }
    fx_cp_async_wait<0>();  // no copy may land after the block has left
    fx_let_combine_start<1>();

    // ---- the rows' sums: the units' shares over their quads, then over the n-tiles (in
    // `red`: every warp is past its last read of the maxima)
#pragma unroll
    for (int i = 0; i < UPW; ++i) {
        const int u = warp + i * W;
        if (u >= UNITS) continue;
        const int rt = u / NTOT, nt = u % NTOT;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_sh[i][h];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            if (tig == 0) red[nt * HT + rt * 16 + g + 8 * h] = l;
        }
    }
    __syncthreads();

    // ---- the partials, by the row's place in the output (o scaled by the V scale)
    const float v_sc = Q8 ? (v_scales != nullptr ? v_scales[g_kv] : kv_scale) : 1.f;
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = rt * 16 + g + 8 * h, r = out_row(row);
            if (r < 0) continue;
            const long long at = (long long)r * splits + split;
#pragma unroll
            for (int n = 0; n < NV; ++n) {
                const int d = (warp * NV + n) * 8 + 2 * tig;
                *reinterpret_cast<float2*>(ws_o + at * DV + d) =
                    make_float2(o[rt][n][2 * h] * v_sc, o[rt][n][2 * h + 1] * v_sc);
            }
            if (warp == 0 && tig == 0) {
                float l = red[row];
#pragma unroll
                for (int nt = 1; nt < NTOT; ++nt) l += red[nt * HT + row];
                *reinterpret_cast<float2*>(ws_ml + 2 * at) = make_float2(m_run[rt][h], l);
            }
        }
}

// gqa_split_latent_<dt>[_<fp8>]_dk<DK>_dv<DV>[_sv]_h<16 RT>[_t32]_x<F>: q of type QT (fp16,
// bf16), a cache of QT or (Q8) fp8 bytes, K rows of DK and V rows of DV (VK: K's first DV
// columns; else rows of their own: _sv), RT row tiles, steps of TOK tokens, features F.
// Partials to ws_o [n_q n_heads][splits][DV] and ws_ml [n_q n_heads][splits][2], merged by
// gqa_verify_rows_combine.
template <class QT, int Q8>
using FxLatentKT = typename FxStore<QT, Q8>::type;  // the cache's element
#define FX_LATENT_ENTRY(NAME, QT, Q8, DK, DV, VK, RT, TOK, F)                                \
    extern "C" __global__ void __launch_bounds__(FX_LATENT_WARPS * 32, 1) NAME(              \
        const QT* q, const FxLatentKT<QT, Q8>* k, const FxLatentKT<QT, Q8>* v, float* ws_o,   \
        float* ws_ml, int n_heads,     \
        int n_kv_heads, int n_q, int seq_len, const int* seq_len_dev, int splits, int tile,  \
        long long k_row, long long v_row, long long k_head, long long v_head, float scale,   \
        float cap, int window, const float* k_scales, const float* v_scales,                 \
        float kv_scale) {                                                                    \
        const FxFeat feat{scale, cap, window, nullptr, nullptr, nullptr, 0};                 \
        gqa_split_latent<QT, Q8, DK, DV, VK, RT, TOK, F>(                                    \
            q, k, v, ws_o, ws_ml, n_heads, n_kv_heads, n_q, seq_len, seq_len_dev, splits,    \
            tile, k_row, v_row, k_head, v_head, feat, k_scales, v_scales, kv_scale);         \
    }
