// Split kernels (gqa_decode_split.cu), part 11: a verify's rows on tensor cores with the rows
// as the mma's rows (flash-attention's layout), two launches in place of split_verify.cuh's
// three.
//
// A verify of n_q queries has n_q x group rows per KV head. The swapped body
// (split_mma_swapped.cuh) gives the rows the mma's 8 columns and has every warp multiply
// every row by its own tokens: its accumulators grow with the rows (255 registers and
// spills at 32 rows), and past 32 rows a KV head's rows take more blocks, each reading the
// chunk again. Here a block of RW warps takes 16 x RW rows, 16 per warp as the mma's A
// operand (no padding past the last row), and the warps share each step of K and V that
// the block's threads copy into shared memory: K and V are read once for up to 128 rows,
// a warp's accumulators are its 16 rows' (16 x D / 32 floats a lane), and the operands
// come from shared memory by ldmatrix.
//
// The kernel reads q in its own layout (n_q, n_heads, head_dim), attends to every token
// of the chunk under each row's own mask (causal or the tree mask on the new tokens), its
// own window and ALiBi relative to its own position, so no tail kernel runs: the new
// tokens are the last chunk's. Its partials go to ws_o / ws_ml by the row's place in the
// output, t x n_heads + h, for gqa_verify_rows_combine (the combine, with the sinks and
// the LSE).
//
// Shared memory: S stages of [K, V][FX_ROWS_TOKENS][D], then q's rows [16 RW][D], rows
// XOR-swizzled in 16-byte units (chunk c of row r at c ^ (r & 7)) so that every ldmatrix
// is free of bank conflicts. An fp8 cache (Q8): the stages hold the cache's bytes as they
// are, and each step is widened (exactly) into one more stage of fp16 [K, V] that the warps
// read as they read a 16-bit cache's; q is converted to fp16, each row scaled by a power of
// two where it would pass fp16's range (as fx_load_q8 does), the K scale and that power
// folded into the row's score scale, the V scale applied to the partial once. A q4 cache
// (FX_Q4, kv_quantize4.cu; token- or head-major): the stages hold each token's nibbles and
// float16 group scales, widened as ((nibble - 8) * scale) in fp16. An nvfp4 cache
// (FX_NVFP4): e2m1 nibbles and an e4m3 scale per 16, widened exactly (their product has at
// most 6 significant bits), the KV head's float32 scales folded as an fp8 cache's. With R, K was rotated
// on append (a Hadamard transform over head_dim) and q is rotated the same way here, in
// float32, before its conversion to fp16 (the scores are unchanged: the transform is
// orthonormal).
//
// K and V in formats of their own (V8, V's format, not Q8, K's: both quantized, e.g. e4m3 K
// and q4 V, as llama.cpp's q8_0 K and q4_0 V): a step holds K's TOK rows in K's bytes, then
// V's in V's, then K's block scales and V's (the 4-bit sides'), each side widened by its own
// format; K's scale (fp8, nvfp4) is folded into the scores, V's applied to the partial.
// Where V8 == Q8 (every other instantiation) the code is the one-format kernel's.

__device__ __forceinline__ void fx_ldsm_x4(unsigned (&r)[4], const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void fx_ldsm_x4_trans(unsigned (&r)[4], const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
// element offset of 16-byte chunk c of row r in a swizzled tile of rows of D elements
template <int D>
__device__ __forceinline__ int fx_rows_at(int r, int c) {
    return r * D + ((c ^ (r & 7)) << 3);
}

// The stages per head_dim (FX_ROWS_STAGES_D<D>): split_traits.h, from kernels/traits.py.
template <int D>
struct FxRowsStages {
    static constexpr int value =
        D == 64 ? FX_ROWS_STAGES_D64 : D == 128 ? FX_ROWS_STAGES_D128 : FX_ROWS_STAGES_D256;
};

// 16-byte chunk c (elements 8c .. 8c + 7) of a q4 row (`nib`: its D / 2 bytes; `sc`: its
// D / FX_Q4_GROUP float16 scales, as bytes) as fp16: (nibble - 8) exactly (0x6400 | n is
// 1024 + n), times the group's scale (rounded once, to fp16).
__device__ __forceinline__ uint4 fx_widen_q4(const unsigned char* nib, const unsigned char* sc,
                                             int c) {
    const unsigned w = *reinterpret_cast<const unsigned*>(nib + c * 4);
    const unsigned s2 =
        (unsigned)reinterpret_cast<const unsigned short*>(sc)[c * 8 / FX_Q4_GROUP] * 0x10001u;
    unsigned r[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned b = (w >> (8 * i)) & 0xffu;
        const unsigned h = 0x64006400u | (b & 0xfu) | ((b & 0xf0u) << 12);
        asm("{.reg .b32 t;\n sub.f16x2 t, %1, %2;\n mul.rn.f16x2 %0, t, %3;}"
            : "=r"(r[i]) : "r"(h), "r"(0x64086408u), "r"(s2));
    }
    return make_uint4(r[0], r[1], r[2], r[3]);
}
// ... of an nvfp4 row (`sc`: its D / 16 e4m3 scales): each e2m1 nibble's magnitude (bits
// 0-2: 0, 0.5, 1, 1.5, 2, 3, 4, 6) as its fp16's high byte (the low byte is 0 for all of
// them), its sign bit 3 as fp16's bit 15, times the block's scale: exact.
__device__ __forceinline__ uint4 fx_widen_nvfp4(const unsigned char* nib,
                                                const unsigned char* sc, int c) {
    const unsigned w = *reinterpret_cast<const unsigned*>(nib + c * 4);
    unsigned s2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(s2) : "h"((unsigned short)(sc[c / 2] * 0x101u)));
    unsigned r[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned b = (w >> (8 * i)) & 0xffu;
        const unsigned lo = b & 0xfu, hi = b >> 4;
        // bytes 0-7 of (0x3e3c3800, 0x46444240): the magnitudes' high bytes
        const unsigned mlo = __byte_perm(0x3e3c3800u, 0x46444240u, lo & 7u) & 0xffu;
        const unsigned mhi = __byte_perm(0x3e3c3800u, 0x46444240u, hi & 7u) & 0xffu;
        const unsigned h = (mlo << 8) | ((lo & 8u) << 12) | (mhi << 24) | ((hi & 8u) << 28);
        asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r[i]) : "r"(h), "r"(s2));
    }
    return make_uint4(r[0], r[1], r[2], r[3]);
}
// 16-byte chunk c of a ring row of format Q8 (quantized) as fp16: `vals` its bytes, `sc`
// its block scales (4-bit formats)
template <int Q8>
__device__ __forceinline__ uint4 fx_widen_row(const unsigned char* vals, const unsigned char* sc,
                                              int c) {
    if constexpr (Q8 == FX_Q4)
        return fx_widen_q4(vals, sc, c);
    else if constexpr (Q8 == FX_NVFP4)
        return fx_widen_nvfp4(vals, sc, c);
    else
        return FxRead<Q8>::at(vals, c * 8);
}

// the mma's element type: q's, or fp16 for an fp8 or q4 cache
template <class QT, int Q8>
struct FxRowsMma {
    using type = fx_half;
};
template <class QT>
struct FxRowsMma<QT, 0> {
    using type = QT;
};

// Q8: 0 (q's dtype), FX_E4M3, FX_E5M2, FX_Q4 or FX_NVFP4 (k_sc / v_sc: the 4-bit formats'
// scales per block, as bytes; nvfp4's per head in kv_scales); R: q rotated (K was); V8:
// V's format where it is not K's (both quantized)
template <class QT, int D, int RW, int F, int Q8 = 0, int R = 0, int V8 = Q8>
__device__ __forceinline__ void gqa_verify_rows(
    const QT* __restrict__ q, const typename FxStore<QT, Q8>::type* __restrict__ k,
    const typename FxStore<QT, Q8>::type* __restrict__ v, float* __restrict__ ws_o,
    float* __restrict__ ws_ml, int n_heads, int n_kv_heads, int n_q, int seq_len,
    const int* __restrict__ seq_len_dev, int splits, int tile,
    const unsigned char* __restrict__ mask, int mask_mode, const FxFeat feat,
    const float* __restrict__ kv_scales = nullptr,
    const unsigned char* __restrict__ k_sc = nullptr,
    const unsigned char* __restrict__ v_sc = nullptr) {
    using KT = typename FxStore<QT, Q8>::type;  // the cache's element
    using T = typename FxRowsMma<QT, Q8>::type;
    constexpr bool Q4 = Q8 == FX_Q4, NIB = Q4 || Q8 == FX_NVFP4;  // (NIB: 4-bit values)
    constexpr bool MIX = V8 != Q8, VNIB = V8 == FX_Q4 || V8 == FX_NVFP4;  // (V's)
    static_assert(!MIX || (Q8 != 0 && V8 != 0), "K and V of their own formats: quantized");
    constexpr int TOK = FX_ROWS_TOKENS, S = FxRowsStages<D>::value;
    constexpr int THREADS = RW * 32, NCH = D / 8;  // 16-byte chunks of a row of T
    constexpr int RB = NIB ? D / 2 : D * (int)sizeof(KT);  // bytes of a cache row (K's)
    constexpr int KCH = RB / 16, SCB = NIB ? D / 16 : 0;  // (4-bit: a row's scale bytes)
    constexpr int VRB = VNIB ? D / 2 : D * (int)sizeof(KT), VSCB = VNIB ? D / 16 : 0;  // V's
    constexpr int STAGE_B = TOK * (RB + SCB + VRB + VSCB);  // a step's bytes: K, V, scales
    constexpr int STAGE = 2 * TOK * D;             // elements of a step of T (K, then V)
    static_assert(TOK % 16 == 0 && D % 64 == 0, "whole mma tiles");
    static_assert(!(NIB || VNIB) || D == 64 || D == 128 || D == 256,
                  "4-bit: head_dim 64, 128, 256");
    extern __shared__ __align__(16) unsigned char fx_dyn_smem[];
    unsigned char* ring = fx_dyn_smem;
    T* wide = reinterpret_cast<T*>(ring + S * STAGE_B);  // (Q8: the step widened)
    T* q_s = wide + (Q8 ? STAGE : 0);
    fx_check_launch(S * STAGE_B + ((Q8 ? STAGE : 0) + 16 * RW * D) * sizeof(T), THREADS);
    fx_let_combine_start<2>();

    // ---- where the block stands: its rows, its chunk
    const FxRowBlock<F, 16 * RW> blk(n_heads, n_kv_heads, n_q, seq_len, seq_len_dev, splits,
                                     tile, feat.window);
    if (blk.idle()) return;  // (gqa_verify_rows_combine reads none of it)
    const int group = blk.group, rows_kv = blk.rows_kv, g_kv = blk.g_kv, r0 = blk.r0;
    const int seq = blk.seq, base = blk.base;  // query t sits at base + t
    const int start = blk.start, end = blk.end;
    const int split = blockIdx.x, window = feat.window;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;
    // (F_HND: head-major rows, head_stride apart; a 4-bit cache's block scales too, as
    // many rows apart; K and V in formats of their own: token-major only)
    const bool hnd = (F & FX_F_HND) != 0;
    static_assert(!MIX || !(F & FX_F_HND), "K and V in formats of their own: token-major");
    constexpr int RE = NIB ? D / 2 : D;    // a cache row's elements (K's)
    constexpr int VRE = VNIB ? D / 2 : D;  // (V's)
    const long long row = hnd ? (long long)RE : (long long)n_kv_heads * RE;
    const KT* kg = hnd ? k + g_kv * feat.head_stride : k + (long long)g_kv * RE;
    const KT* vg = hnd ? v + g_kv * feat.head_stride : v + (long long)g_kv * VRE;
    const long long srow = hnd ? (long long)SCB : (long long)n_kv_heads * SCB;  // (scale rows)
    const long long sc_at = hnd ? g_kv * (feat.head_stride / RE) * SCB : (long long)g_kv * SCB;
    const unsigned char* ksg = NIB ? k_sc + sc_at : nullptr;  // (bytes)
    const unsigned char* vsg = VNIB ? v_sc + (MIX ? (long long)g_kv * VSCB : sc_at) : nullptr;

    // ---- stage j: tokens start + j TOK .. of K and V (rows past `end`: zeros)
    const int steps = (end - start + TOK - 1) / TOK;
    auto issue = [&](int j) {
        if (j < steps) {
            KT* ks = reinterpret_cast<KT*>(ring + (j % S) * STAGE_B);
            KT* vs = ks + TOK * RE;
            const int t0 = start + j * TOK;
            constexpr int EPC = 16 / (int)sizeof(KT);  // elements per 16-byte chunk
            if constexpr (!MIX) {
#pragma unroll
                for (int i = threadIdx.x; i < TOK * KCH; i += THREADS) {
                    const int r = i / KCH, c = i % KCH;
                    const bool ok = t0 + r < end;
                    const long long off = (long long)(ok ? t0 + r : start) * row + c * EPC;
                    // (Q8: rows as they are, widened below; else swizzled for ldmatrix)
                    const int at = Q8 ? r * RE + c * EPC : fx_rows_at<D>(r, c);
                    fx_cp_async16(ks + at, kg + off, ok);
                    fx_cp_async16(vs + at, vg + off, ok);
                }
            } else {  // (bytes, as they are) K's rows, then V's
                const long long vrow = hnd ? (long long)VRE : (long long)n_kv_heads * VRE;
#pragma unroll
                for (int i = threadIdx.x; i < TOK * KCH; i += THREADS) {
                    const int r = i / KCH, c = i % KCH;
                    const bool ok = t0 + r < end;
                    const long long off = (long long)(ok ? t0 + r : start) * row + c * 16;
                    fx_cp_async16(ks + r * RE + c * 16, kg + off, ok);
                }
#pragma unroll
                for (int i = threadIdx.x; i < TOK * (VRB / 16); i += THREADS) {
                    const int r = i / (VRB / 16), c = i % (VRB / 16);
                    const bool ok = t0 + r < end;
                    const long long off = (long long)(ok ? t0 + r : start) * vrow + c * 16;
                    fx_cp_async16(vs + r * VRE + c * 16, vg + off, ok);
                }
            }
            if constexpr (NIB && !MIX) {  // the rows' scales, after the values: K's, then V's
                unsigned char* kss = ring + (j % S) * STAGE_B + 2 * TOK * RB;
                for (int r = threadIdx.x; r < TOK; r += THREADS) {
                    const bool ok = t0 + r < end;
                    const long long off = (long long)(ok ? t0 + r : start) * srow;
                    fx_cp_async_small<SCB>(kss + r * SCB, ksg + off, ok);
                    fx_cp_async_small<SCB>(kss + (TOK + r) * SCB, vsg + off, ok);
                }
            } else if constexpr (MIX && (NIB || VNIB)) {  // the 4-bit side's (or both sides')
                unsigned char* kss = ring + (j % S) * STAGE_B + TOK * (RB + VRB);
                for (int r = threadIdx.x; r < TOK; r += THREADS) {
                    const bool ok = t0 + r < end;
                    const long long tok = ok ? t0 + r : start;
                    if constexpr (NIB)
                        fx_cp_async_small<SCB>(kss + r * SCB, ksg + tok * n_kv_heads * SCB, ok);
                    if constexpr (VNIB)
                        fx_cp_async_small<VSCB>(kss + TOK * SCB + r * VSCB,
                                                vsg + tok * n_kv_heads * VSCB, ok);
                }
            }
        }
        fx_cp_async_commit();  // (one group per stage, even empty: the waits count stages)
    };
#pragma unroll
    for (int j = 0; j < S - 1; ++j) issue(j);

    // ---- q's rows: block row i is KV head row r0 + i = t x group + the head of the group
    auto q_chunk = [&](int i, int& r, int& c) {
        r = i / NCH;
        c = i % NCH;
        const int kr = r0 + r;
        const bool ok = kr < rows_kv;
        const long long at =
            ok ? ((long long)(kr / group) * n_heads + g_kv * group + kr % group) : 0;
        return fx_ldg16(q + at * D + c * 8, ok);
    };
    __shared__ int q_top[16 * RW];  // (Q8: the bits of each row's largest |q|)
    if constexpr (R != 0) {  // q rotated in float32 (as K was), a warp per row
        constexpr int E = D / 32;
        for (int r = warp; r < 16 * RW; r += RW) {
            const int kr = r0 + r;
            const bool ok = kr < rows_kv;
            const long long at =
                ok ? ((long long)(kr / group) * n_heads + g_kv * group + kr % group) : 0;
            float x[E];
#pragma unroll
            for (int e = 0; e < E; ++e) x[e] = ok ? fx_to_float(q[at * D + lane * E + e]) : 0.f;
            fx_hadamard_lanes<E>(x, lane, D, fx_inv_sqrt<D>());
            float top = 0.f;
#pragma unroll
            for (int e = 0; e < E; ++e) top = fmaxf(top, fabsf(x[e]));
            top = fx_lanes_max<1, 32>(top);
            const int ex = fx_q8_shift(__float_as_int(top));
            const float down = __int_as_float((127 - ex) << 23);
            if (lane == 0) q_top[r] = __float_as_int(top);
            fx_half* dst = reinterpret_cast<fx_half*>(q_s) +
                           fx_rows_at<D>(r, lane * E / 8) + (lane * E) % 8;
#pragma unroll
            for (int e = 0; e < E; ++e) dst[e] = fx_from_float<fx_half>(x[e] * down);
        }
    } else if (Q8) {
        for (int i = threadIdx.x; i < 16 * RW; i += THREADS) q_top[i] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < 16 * RW * NCH; i += THREADS) {
            int r, c;
            const uint4 w = q_chunk(i, r, c);
            atomicMax(&q_top[r], __float_as_int(fx_top8<QT>(w)));
        }
        __syncthreads();
    }
    // (Q8) e_r: 2^-e_r brings row r within fp16's range
    auto q_shift = [&](int r) { return fx_q8_shift(q_top[r]); };
    for (int i = threadIdx.x; i < (R ? 0 : 16 * RW * NCH); i += THREADS) {
        int r, c;
        uint4 w = q_chunk(i, r, c);
        if (Q8) w = fx_half8<QT>(w, __int_as_float((127 - q_shift(r)) << 23));
        *reinterpret_cast<uint4*>(q_s + fx_rows_at<D>(r, c)) = w;
    }
    __syncthreads();
    // this warp's rows g (a) and g + 8 (b): KV head rows, queries, heads, positions
    const int ka = r0 + warp * 16 + g, kb = ka + 8;
    const int qmax = n_q - 1;  // (a padding row past the last takes the last query's mask)
    const int ta = min(ka / group, qmax), tb = min(kb / group, qmax);
    const int ha = g_kv * group + ka % group, hb = g_kv * group + kb % group;
    const bool va = ka < rows_kv, vb = kb < rows_kv;
    const bool active = r0 + warp * 16 < rows_kv;  // (warp-uniform)
    FxScore<F> sca = fx_scorer<F>(feat, D, ha, va, seq, nullptr);
    FxScore<F> scb = fx_scorer<F>(feat, D, hb, vb, seq, nullptr);
    sca.last = base + ta;  // ALiBi relative to the row's own position
    scb.last = base + tb;
    if (Q8) {  // the K scale (fp8) and q's power of two
        const float k_scale = Q4 ? 1.f : kv_scales[g_kv];  // (nvfp4: the head's)
        sca.fold(k_scale * __int_as_float((127 + q_shift(warp * 16 + g)) << 23));
        scb.fold(k_scale * __int_as_float((127 + q_shift(warp * 16 + g + 8)) << 23));
    }
    const int loa = (F & FX_F_WINDOW) ? base + ta + 1 - window : 0;  // the rows' windows
    const int lob = (F & FX_F_WINDOW) ? base + tb + 1 - window : 0;
    // steps wholly below `clean` and from `clean_lo` need no per-token check
    const int clean = base, clean_lo = (F & FX_F_WINDOW) ? seq - window : 0;

    constexpr bool Q_REGS = D <= 128;  // (head_dim 256: q's fragments from shared memory)
    unsigned qf[Q_REGS ? D / 16 : 1][4];
    const T* q_w = q_s + warp * 16 * D;
    const int q_r = ((lane >> 3) & 1) * 8 + (lane & 7), q_c = lane >> 4;
    if (Q_REGS) {
#pragma unroll
        for (int kk = 0; kk < (Q_REGS ? D / 16 : 1); ++kk)
            fx_ldsm_x4(qf[kk], q_w + fx_rows_at<D>(q_r, 2 * kk + q_c));
    }

    float o[D / 8][4];
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;
    FxRunning rna, rnb;

    const int k_r = lane & 7, k_c = lane >> 3;                      // K: x4 = 4 chunks
    const int v_r = ((lane >> 3) & 1) * 8 + (lane & 7), v_c = lane >> 4;  // V: tokens x 2
    for (int j = 0; j < steps; ++j) {
        fx_cp_async_wait<S - 2>();
        __syncthreads();  // stage j is in for every thread; stage j - 1 is free
        issue(j + S - 1);
        const T* ks;
        if constexpr (MIX) {  // K's rows widened by K's format, V's by V's, into `wide`
            const unsigned char* nb = ring + (j % S) * STAGE_B;
            const unsigned char* sb = nb + TOK * (RB + VRB);
            for (int i = threadIdx.x; i < TOK * NCH; i += THREADS) {
                const int r = i / NCH, c = i % NCH;
                *reinterpret_cast<uint4*>(wide + fx_rows_at<D>(r, c)) =
                    fx_widen_row<Q8>(nb + r * RB, sb + r * SCB, c);
            }
            for (int i = threadIdx.x; i < TOK * NCH; i += THREADS) {
                const int r = i / NCH, c = i % NCH;
                *reinterpret_cast<uint4*>(wide + fx_rows_at<D>(TOK + r, c)) =
                    fx_widen_row<V8>(nb + TOK * RB + r * VRB, sb + TOK * SCB + r * VSCB, c);
            }
            __syncthreads();
            ks = wide;
        } else if constexpr (NIB) {  // the step's nibbles and scales widened into `wide`
            const unsigned char* nb = ring + (j % S) * STAGE_B;
            const unsigned char* sb = nb + 2 * TOK * RB;
            for (int i = threadIdx.x; i < 2 * TOK * NCH; i += THREADS) {
                const int r = i / NCH, c = i % NCH;  // (rows past TOK: V's)
                *reinterpret_cast<uint4*>(wide + fx_rows_at<D>(r, c)) =
                    Q4 ? fx_widen_q4(nb + r * RB, sb + r * SCB, c)
                       : fx_widen_nvfp4(nb + r * RB, sb + r * SCB, c);
            }
            __syncthreads();
            ks = wide;
        } else if constexpr (Q8 != 0) {  // the step's bytes widened into `wide`, swizzled
            const KT* kb = reinterpret_cast<const KT*>(ring + (j % S) * STAGE_B);
            for (int i = threadIdx.x; i < 2 * TOK * NCH; i += THREADS) {
                const int r = i / NCH, c = i % NCH;  // (rows past TOK: V's)
                *reinterpret_cast<uint4*>(wide + fx_rows_at<D>(r, c)) =
                    FxRead<Q8>::at(kb + r * D, c * 8);
            }
            __syncthreads();
            ks = wide;
        } else {
            ks = reinterpret_cast<const T*>(ring + (j % S) * STAGE_B);
        }
        if (!active) continue;  // (a warp of padding rows: it loads and widens, no more)
        const T* vs = ks + TOK * D;
        const int t0 = start + j * TOK;
        // ---- S = Q K^T: n-tile nt is tokens t0 + 8 nt .. + 7
        float s[TOK / 8][4];
#pragma unroll
        for (int nt = 0; nt < TOK / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk += 2) {
            unsigned qa[4], qb[4];
            if (Q_REGS) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    qa[e] = qf[Q_REGS ? kk : 0][e];
                    qb[e] = qf[Q_REGS ? kk + 1 : 0][e];
                }
            } else {
                fx_ldsm_x4(qa, q_w + fx_rows_at<D>(q_r, 2 * kk + q_c));
                fx_ldsm_x4(qb, q_w + fx_rows_at<D>(q_r, 2 * kk + 2 + q_c));
            }
#pragma unroll
            for (int nt = 0; nt < TOK / 8; ++nt) {
                unsigned b[4];  // tokens 8 nt + g; d 16 kk .. 16 kk + 31
                fx_ldsm_x4(b, ks + fx_rows_at<D>(nt * 8 + k_r, 2 * kk + k_c));
                FxMma<T>::run(s[nt][0], s[nt][1], s[nt][2], s[nt][3], qa[0], qa[1], qa[2], qa[3],
                              b[0], b[1]);
                FxMma<T>::run(s[nt][0], s[nt][1], s[nt][2], s[nt][3], qb[0], qb[1], qb[2], qb[3],
                              b[2], b[3]);
            }
        }
        // ---- scores, each row's mask, its online softmax
        float xa[TOK / 4], xb[TOK / 4];
        const bool plain = t0 + TOK <= min(end, clean) && (!(F & FX_F_WINDOW) || t0 >= clean_lo);
#pragma unroll
        for (int nt = 0; nt < TOK / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int tok = t0 + nt * 8 + 2 * tig + e;
                float sa = sca(s[nt][e], tok), sb = scb(s[nt][2 + e], tok);
                if (!plain) {
                    const bool in = tok < end;
                    const bool na = tok < clean || (tok - base <= qmax &&
                                                    fx_sees(mask, mask_mode, n_q, ta, tok - base));
                    const bool nb = tok < clean || (tok - base <= qmax &&
                                                    fx_sees(mask, mask_mode, n_q, tb, tok - base));
                    if (!(in && na && va && tok >= loa)) sa = -INFINITY;
                    if (!(in && nb && vb && tok >= lob)) sb = -INFINITY;
                }
                xa[nt * 2 + e] = sa;
                xb[nt * 2 + e] = sb;
            }
        float ma = xa[0], mb = xb[0];
#pragma unroll
        for (int i = 1; i < TOK / 4; ++i) {
            ma = fmaxf(ma, xa[i]);
            mb = fmaxf(mb, xb[i]);
        }
        float pa[TOK / 4], pb[TOK / 4];
        const float alpha_a = rna.step(fx_lanes_max<1, 4>(ma), xa, pa);
        const float alpha_b = rnb.step(fx_lanes_max<1, 4>(mb), xb, pb);
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
            o[dn][0] *= alpha_a;
            o[dn][1] *= alpha_a;
            o[dn][2] *= alpha_b;
            o[dn][3] *= alpha_b;
        }
        // ---- O += P V: k-step kt is tokens t0 + 16 kt .. + 15 (P from S's accumulators)
#pragma unroll
        for (int kt = 0; kt < TOK / 16; ++kt) {
            const unsigned a0 = fx_pack2<T>(pa[4 * kt], pa[4 * kt + 1]);
            const unsigned a1 = fx_pack2<T>(pb[4 * kt], pb[4 * kt + 1]);
            const unsigned a2 = fx_pack2<T>(pa[4 * kt + 2], pa[4 * kt + 3]);
            const unsigned a3 = fx_pack2<T>(pb[4 * kt + 2], pb[4 * kt + 3]);
#pragma unroll
            for (int dn = 0; dn < D / 8; dn += 2) {
                unsigned b[4];  // tokens 16 kt ..; d 8 dn .. 8 dn + 15
                fx_ldsm_x4_trans(b, vs + fx_rows_at<D>(kt * 16 + v_r, dn + v_c));
                FxMma<T>::run(o[dn][0], o[dn][1], o[dn][2], o[dn][3], a0, a1, a2, a3, b[0], b[1]);
                FxMma<T>::run(o[dn + 1][0], o[dn + 1][1], o[dn + 1][2], o[dn + 1][3], a0, a1, a2,
                              a3, b[2], b[3]);
            }
        }
    }
    fx_cp_async_wait<0>();  // no copy may land after the block has left
    fx_let_combine_start<1>();
    if (V8 && V8 != FX_Q4) {  // the V scale (fp8, nvfp4: the head's), once
        const float v_scale = kv_scales[n_kv_heads + g_kv];
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[dn][e] *= v_scale;
    }

    // ---- the rows' partials: the lanes' sums added over the quad, by the row's output place
    rna.l += __shfl_xor_sync(0xffffffffu, rna.l, 1);
    rna.l += __shfl_xor_sync(0xffffffffu, rna.l, 2);
    rnb.l += __shfl_xor_sync(0xffffffffu, rnb.l, 1);
    rnb.l += __shfl_xor_sync(0xffffffffu, rnb.l, 2);
    const long long pa_at = ((long long)ta * n_heads + ha) * splits + split;
    const long long pb_at = ((long long)tb * n_heads + hb) * splits + split;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
        const int d = dn * 8 + 2 * tig;
        if (va) *reinterpret_cast<float2*>(ws_o + pa_at * D + d) = make_float2(o[dn][0], o[dn][1]);
        if (vb) *reinterpret_cast<float2*>(ws_o + pb_at * D + d) = make_float2(o[dn][2], o[dn][3]);
    }
    if (tig == 0) {
        if (va) *reinterpret_cast<float2*>(ws_ml + 2 * pa_at) = make_float2(rna.m, rna.l);
        if (vb) *reinterpret_cast<float2*>(ws_ml + 2 * pb_at) = make_float2(rnb.m, rnb.l);
    }
}

// The rows' chunks merged (fx_combine_chunks) into out (n_q, n_heads, head_dim): a block per
// (row t x n_heads + h, 32 columns), with head h's sink and the row's LSE; the chunks
// gqa_verify_rows wrote for the length, from query 0's window on.
template <class T, int F>
__device__ __forceinline__ void gqa_verify_rows_combine(
    T* __restrict__ out, const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
    int head_dim, int seq_len, const int* __restrict__ seq_len_dev, int splits, int tile,
    int n_heads, int n_q, const FxFeat feat) {
    __shared__ float w_s[FX_MAX_SPLITS];
    __shared__ float red_s[FX_COMBINE_WARPS][32];
    const int r = blockIdx.x, h = r % n_heads;
    const int d = blockIdx.y * 32 + (threadIdx.x & 31);
    const int seq = fx_seq_len(seq_len, seq_len_dev);  // written before the rows kernel ran
    fx_wait_for_split();
    T* out_r = out + (long long)r * head_dim;
    const float sink2 = (F & FX_F_SINKS) ? feat.sinks[h] * FX_LOG2E : 0.f;
    float* lse_r = (F & FX_F_LSE) && blockIdx.y == 0 ? feat.lse + r : nullptr;
    const int base = seq - n_q;
    if (base < 0) {  // (no such verify: a graph's length below its queries) zeros
        if (threadIdx.x < 32 && d < head_dim) out_r[d] = fx_from_float<T>(0.f);
        if ((F & FX_F_LSE) && lse_r != nullptr && threadIdx.x == 0)
            *lse_r = (F & FX_F_SINKS) ? feat.sinks[h] : -INFINITY;
        return;
    }
    const int first = (F & FX_F_WINDOW) ? max(0, base + 1 - feat.window) : 0;
    fx_combine_row<T, F>(out_r, ws_o, ws_ml, r, head_dim, d, first, seq, splits, tile, w_s,
                         red_s, sink2, lse_r);
}

// gqa_verify_rows_<dt>_d<D>_w<RW>_x<F>: fp16/bf16 q and cache, head_dim D (64, 128, 256),
// RW warps of 16 rows, features F (window, cap, ALiBi, scale, head-major).
#define FX_VERIFY_ROWS_ENTRY(NAME, T, D, RW, F)                                             \
    extern "C" __global__ void __launch_bounds__(RW * 32, 1) NAME(                             \
        const T* q, const T* k, const T* v, float* ws_o, float* ws_ml, int n_heads,         \
        int n_kv_heads, int n_q, int seq_len, const int* seq_len_dev, int splits, int tile, \
        const unsigned char* mask, int mask_mode, float scale, float cap, int window,       \
        const float* slopes, long long head_stride) {                                       \
        const FxFeat feat{scale, cap, window, slopes, nullptr, nullptr, head_stride};       \
        gqa_verify_rows<T, D, RW, F>(q, k, v, ws_o, ws_ml, n_heads, n_kv_heads, n_q,        \
                                     seq_len, seq_len_dev, splits, tile, mask, mask_mode,   \
                                     feat);                                                 \
    }

// gqa_verify_rows_<dt>_<e4m3|e5m2>_d<D>_w<RW>_x<F>: an fp8 cache of q's type QT (fp16,
// bf16), its scales (n_kv_heads K scales, then the V ones) last.
#define FX_VERIFY_ROWS8_ENTRY(NAME, QT, Q8, D, RW, F)                                      \
    extern "C" __global__ void __launch_bounds__(RW * 32, 1) NAME(                             \
        const QT* q, const unsigned char* k, const unsigned char* v, float* ws_o,           \
        float* ws_ml, int n_heads, int n_kv_heads, int n_q, int seq_len,                    \
        const int* seq_len_dev, int splits, int tile, const unsigned char* mask,            \
        int mask_mode, float scale, float cap, int window, const float* slopes,             \
        long long head_stride, const float* kv_scales) {                                    \
        const FxFeat feat{scale, cap, window, slopes, nullptr, nullptr, head_stride};       \
        gqa_verify_rows<QT, D, RW, F, Q8>(q, k, v, ws_o, ws_ml, n_heads, n_kv_heads, n_q,   \
                                          seq_len, seq_len_dev, splits, tile, mask,         \
                                          mask_mode, feat, kv_scales);                      \
    }

// gqa_verify_rows_<dt>_q4[r]_d<D>_w<RW>_x<F>: a q4 cache (values: nibbles [token][n_kv]
// [D / 2], scales: float16 [token][n_kv][D / FX_Q4_GROUP]), q of type QT (fp16, bf16); R: K
// was rotated on append, q is here.
#define FX_VERIFY_ROWS4_ENTRY(NAME, QT, D, RW, F, R)                                        \
    extern "C" __global__ void __launch_bounds__(RW * 32, 1) NAME(                             \
        const QT* q, const unsigned char* k, const unsigned char* v, float* ws_o,           \
        float* ws_ml, int n_heads, int n_kv_heads, int n_q, int seq_len,                    \
        const int* seq_len_dev, int splits, int tile, const unsigned char* mask,            \
        int mask_mode, float scale, float cap, int window, const float* slopes,             \
        long long head_stride, const fx_half* k_scales, const fx_half* v_scales) {          \
        const FxFeat feat{scale, cap, window, slopes, nullptr, nullptr, head_stride};       \
        gqa_verify_rows<QT, D, RW, F, FX_Q4, R>(                                            \
            q, k, v, ws_o, ws_ml, n_heads, n_kv_heads, n_q, seq_len, seq_len_dev, splits,   \
            tile, mask, mask_mode, feat, nullptr,                                           \
            reinterpret_cast<const unsigned char*>(k_scales),                               \
            reinterpret_cast<const unsigned char*>(v_scales));                              \
    }

// gqa_verify_rows_<dt>_nvfp4[r]_d<D>_w<RW>_x<F>: an nvfp4 cache (values: e2m1 nibbles
// [token][n_kv][D / 2], block_scales: e4m3 [token][n_kv][D / 16], kv_scales: float32, the
// KV heads' K scales then their V ones), q of type QT; R: K was rotated on append.
#define FX_VERIFY_ROWS_NVFP4_ENTRY(NAME, QT, D, RW, F, R)                                   \
    extern "C" __global__ void __launch_bounds__(RW * 32, 1) NAME(                          \
        const QT* q, const unsigned char* k, const unsigned char* v, float* ws_o,           \
        float* ws_ml, int n_heads, int n_kv_heads, int n_q, int seq_len,                    \
        const int* seq_len_dev, int splits, int tile, const unsigned char* mask,            \
        int mask_mode, float scale, float cap, int window, const float* slopes,             \
        long long head_stride, const unsigned char* k_scales,                               \
        const unsigned char* v_scales, const float* kv_scales) {                            \
        const FxFeat feat{scale, cap, window, slopes, nullptr, nullptr, head_stride};       \
        gqa_verify_rows<QT, D, RW, F, FX_NVFP4, R>(                                         \
            q, k, v, ws_o, ws_ml, n_heads, n_kv_heads, n_q, seq_len, seq_len_dev, splits,   \
            tile, mask, mask_mode, feat, kv_scales, k_scales, v_scales);                    \
    }

// gqa_verify_rows_<dt>_<kfmt>[r]_v<vfmt>_d<D>_w<RW>_x<F>: K in format KQ8, V in VQ8 (FX_E4M3,
// FX_E5M2, FX_Q4, FX_NVFP4; not the same), q of type QT; k_scales / v_scales the 4-bit
// sides' block scales (as bytes; the other side's unread), kv_scales the KV heads' float32
// K scales then V ones (the fp8 and nvfp4 sides'); R: K (4-bit) was rotated on append.
#define FX_VERIFY_ROWS_MIXED_ENTRY(NAME, QT, KQ8, VQ8, D, RW, F, R)                         \
    extern "C" __global__ void __launch_bounds__(RW * 32, 1) NAME(                          \
        const QT* q, const unsigned char* k, const unsigned char* v, float* ws_o,           \
        float* ws_ml, int n_heads, int n_kv_heads, int n_q, int seq_len,                    \
        const int* seq_len_dev, int splits, int tile, const unsigned char* mask,            \
        int mask_mode, float scale, float cap, int window, const float* slopes,             \
        long long head_stride, const unsigned char* k_scales,                               \
        const unsigned char* v_scales, const float* kv_scales) {                            \
        const FxFeat feat{scale, cap, window, slopes, nullptr, nullptr, head_stride};       \
        gqa_verify_rows<QT, D, RW, F, KQ8, R, VQ8>(                                         \
            q, k, v, ws_o, ws_ml, n_heads, n_kv_heads, n_q, seq_len, seq_len_dev, splits,   \
            tile, mask, mask_mode, feat, kv_scales, k_scales, v_scales);                    \
    }

// gqa_verify_rows_combine_<dt>_x<F>: window, sinks, LSE.
#define FX_VERIFY_ROWS_COMBINE_ENTRY(NAME, T, F)                                            \
    extern "C" __global__ void __launch_bounds__(FX_COMBINE_THREADS) NAME(                  \
        T* out, const float* ws_o, const float* ws_ml, int head_dim, int seq_len,           \
        const int* seq_len_dev, int splits, int tile, int n_heads, int n_q, int window,     \
        const float* sinks, float* lse) {                                                   \
        const FxFeat feat{0.f, 0.f, window, nullptr, sinks, lse, 0};                        \
        gqa_verify_rows_combine<T, F>(out, ws_o, ws_ml, head_dim, seq_len, seq_len_dev,     \
                                      splits, tile, n_heads, n_q, feat);                    \
    }
