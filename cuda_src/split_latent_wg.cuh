// Split kernels (gqa_decode_split.cu), part 13: MLA decode on Hopper's warpgroup MMA (wgmma,
// sm_90a), for blocks of 64 query rows: the latent kernel of part 12 at 16-32 rows a block
// re-reads each K tile once per block of rows and runs mma.sync with its B operands from
// shared memory at 2 x rows flops a byte; here one block takes 64 rows (128 heads: two
// blocks), and the tensor cores read Q, K, P and V from shared memory themselves.
//
// A block of 8 warps = two warpgroups (WG 0, 1) takes chunk `split` of the sequence and rows
// r0 .. r0 + 63 of KV head g_kv (n_q x group rows, query-major, as in part 12), in steps of
// TOK = 64 tokens through a ring of two stages every thread fills by cp.async. Per step:
//   S = Q K^T   WG w: the 64 rows x tokens 32 w .. 32 w + 31, DK / 16 wgmma m64n32k16 (A: Q,
//               B: the stage's K rows, both from shared memory);
//   softmax     each thread holds rows 16 (warp % 4) + g and + 8 of its WG's 32 tokens; the
//               two WGs swap their rows' maxima through shared memory, so both keep the same
//               running max (the same operations on the same values), and write P (16-bit)
//               for their tokens into one 64 x 64 tile;
//   O += P V    WG w: output columns 256 w .. 256 w + 255, TOK / 16 wgmma m64n256k16 (A: P,
//               B: V = the stage's first DV columns of K, read N-major: no second copy).
// Three barriers a step (four with an fp8 cache): the stage in, the maxima, P.
//
// Shared memory tiles (16-bit elements) are wgmma's 128-byte-swizzle layout, in column
// blocks of 64: element (r, c) of a tile of R rows at byte (c / 64) 128 R + 128 r +
// 16 ((c / 8 % 8) ^ (r % 8)) + 2 (c % 8), every tile 1024-byte aligned. K-major operands (Q
// and K as Q K^T's A and B, P as P V's A): rows 8 apart at 1024 bytes (the descriptor's
// stride offset), a k-step of 16 columns 32 bytes on within a block. V as P V's B, N-major:
// column blocks TOK 128 bytes apart (the leading offset), token groups of 8 at 1024.
// Accumulators (m64nN, f32): thread (warp w of its WG, lane = 4 g + tig) holds d[4 n + e] =
// row 16 w + g + 8 (e / 2), column 8 n + 2 tig + e % 2.
//
// An fp8 cache (Q8): the stages hold its bytes as they are; each step is widened (exactly)
// into a 16-bit tile, and q converted to fp16, each row scaled by a power of two where it
// would pass fp16's range, the K scale folded into the row's score scale, the V scale
// applied once to the partial output (part 12's arithmetic).
//
// Compiled for sm_90a alone (the host compiles this kernel's module for it); elsewhere the
// body is empty and the plan never chooses it.

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FX_WG_OK 1
#endif

// The block's shared memory (decode/latent_plan.py's latent_shared_bytes computes the same):
// 1024 bytes of slack to align the tiles, Q, (Q8) the widened step, the ring, P, the maxima.
template <int DK, int Q8>
struct FxLatentWgSmem {
    static constexpr int TOK = 64, HT = 64, S = 2;
    static constexpr int TILE = TOK * DK * 2;           // a 16-bit tile of TOK (= HT) rows
    static constexpr int STAGE = TOK * DK * (Q8 ? 1 : 2);
    static constexpr int WIDE = Q8 ? TILE : 0;
    static constexpr int P = HT * TOK * 2;
    static constexpr int RED = 2 * HT * 4 + HT * 4;     // two WGs' maxima; q's largest |q|
    static constexpr int BYTES = 1024 + TILE + WIDE + S * STAGE + P + RED;
};

// byte offset of 16-byte chunk c (elements 8c .. 8c + 7) of row r in a swizzled tile of R rows
template <int R>
__device__ __forceinline__ int fx_wg_at(int r, int c) {
    return (c >> 3) * (R * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}
#ifdef FX_WG_OK
// a shared-memory matrix descriptor, 128-byte swizzle: the leading and stride byte offsets
__device__ __forceinline__ unsigned long long fx_wg_desc(const void* p, unsigned lead,
                                                         unsigned stride = 1024) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    return (unsigned long long)((a & 0x3ffffu) >> 4) | ((unsigned long long)(lead >> 4) << 16) |
           ((unsigned long long)(stride >> 4) << 32) | (1ull << 62);
}
// V's descriptor, N-major: column blocks TOK 128 bytes apart (leading), 8 tokens 1024
// (stride; swapped, the outputs measured wrong by 1.0: the offsets mean what they say)
template <int TOK>
__device__ __forceinline__ unsigned long long fx_wg_v_desc(const void* p) {
    return fx_wg_desc(p, TOK * 128, 1024);
}
__device__ __forceinline__ void fx_wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void fx_wg_commit_wait() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
// shared memory written by this thread (st.shared, cp.async) visible to wgmma's reads
__device__ __forceinline__ void fx_fence_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// one k-step of 16 for a type tag (fx_bf16, fx_half) and its PTX name ("bf16", "f16"):
// S (m64n32, K-major A and B; acc 0: S = A B) and O (m64n256, K-major A, N-major B: O += A B)
#define FX_WG_MMAS(TAG, PTX)                                                               \
    __device__ __forceinline__ void fx_wg_qk(float(&d)[16], unsigned long long a,          \
                                            unsigned long long b, int acc, TAG) {          \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"                          \
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32." PTX "." PTX " "           \
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "               \
                 "%16, %17, p, 1, 1, 0, 0;\n}\n"                                           \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),\
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])                      \
                 : "l"(a), "l"(b), "r"(acc));                                              \
    }                                                                                      \
    __device__ __forceinline__ void fx_wg_pv(float(&d)[128], unsigned long long a,         \
                                            unsigned long long b, TAG) {                   \
        asm volatile("{\n"                                                                 \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." PTX "." PTX " "           \
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                 \
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"        \
                 "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"        \
                 "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"        \
                 "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"        \
                 "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"        \
                 "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"\
                 "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, "\
                 "%128, %129, 1, 1, 1, 0, 1;\n}\n"                                         \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),\
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),\
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),\
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),\
                   "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),\
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),\
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),\
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),\
                   "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),\
                   "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]),\
                   "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),\
                   "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),\
                   "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),\
                   "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]),\
                   "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),\
                   "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]),\
                   "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]),\
                   "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]),\
                   "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),\
                   "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),\
                   "+f"(d[126]), "+f"(d[127])                                              \
                 : "l"(a), "l"(b));                                                        \
    }
FX_WG_MMAS(fx_bf16, "bf16")
FX_WG_MMAS(fx_half, "f16")
#endif

// QT: q's and the output's type (fx_half, fx_bf16); Q8: 0 (a cache of QT), FX_E4M3 or
// FX_E5M2; DK, DV: K's width and the values' (K's first DV columns); F: the features
// (window, cap, scale; the sinks and the LSE are the combine's). The arguments are part 12's
// (v, v_row and v_head unread: V is K's).
template <class QT, int Q8, int DK, int DV, int F>
__device__ __forceinline__ void gqa_split_latent_wg(
    const QT* __restrict__ q, const typename FxStore<QT, Q8>::type* __restrict__ k,
    float* __restrict__ ws_o, float* __restrict__ ws_ml, int n_heads, int n_kv_heads, int n_q,
    int seq_len, const int* __restrict__ seq_len_dev, int splits, int tile, long long k_row,
    long long k_head, const FxFeat feat, const float* __restrict__ k_scales,
    const float* __restrict__ v_scales, float kv_scale) {
#ifdef FX_WG_OK
    using KT = typename FxStore<QT, Q8>::type;  // the cache's element
    using T = typename FxRowsMma<QT, Q8>::type;  // the mma's (fp16 for an fp8 cache)
    using SM = FxLatentWgSmem<DK, Q8>;
    constexpr int TOK = SM::TOK, HT = SM::HT, S = SM::S, THREADS = 256;
    constexpr int KB = DK / 64;         // column blocks of a 16-bit tile
    constexpr int EPC = Q8 ? 16 : 8;    // cache elements per 16-byte chunk
    static_assert(Q8 == 0 || Q8 == FX_E4M3 || Q8 == FX_E5M2, "16-bit or fp8 caches");
    static_assert(DK % 64 == 0 && DV == 512 && DV <= DK, "two WGs of 256 output columns");

    extern __shared__ __align__(16) unsigned char fx_dyn_smem[];
    const unsigned sa = (unsigned)__cvta_generic_to_shared(fx_dyn_smem);
    unsigned char* base = fx_dyn_smem + (((sa + 1023u) & ~1023u) - sa);  // tiles 1024-aligned
    unsigned char* q_s = base;                             // [KB][HT][128 B]
    unsigned char* wide = q_s + SM::TILE;                  // (Q8) [KB][TOK][128 B]
    unsigned char* ring = wide + SM::WIDE;                 // S stages
    unsigned char* p_s = ring + S * SM::STAGE;             // [HT][128 B]
    float* red = reinterpret_cast<float*>(p_s + SM::P);    // [2][HT]
    int* q_top = reinterpret_cast<int*>(red + 2 * HT);     // [HT]
    fx_check_launch(SM::BYTES, THREADS);
    fx_let_combine_start<2>();

    // ---- where the block stands: its rows, its chunk
    const FxRowBlock<F, HT> blk(n_heads, n_kv_heads, n_q, seq_len, seq_len_dev, splits, tile,
                                feat.window);
    if (blk.idle()) return;  // (the combine reads none of it)
    const int group = blk.group, rows_kv = blk.rows_kv, g_kv = blk.g_kv, r0 = blk.r0;
    const int seq = blk.seq, base_t = blk.base;  // query t sits at base_t + t
    const int start = blk.start, end = blk.end;
    const int split = blockIdx.x, window = feat.window;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // (the WG broadcast from lane 0: the compiler then knows it is warp-uniform and keeps
    // the descriptors that depend on it in uniform registers)
    const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0);
    const int wl = warp & 3, g = lane >> 2, tig = lane & 3;
    const KT* kg = k + (long long)g_kv * k_head;
    auto out_row = [&](int i) {
        const int kr = r0 + i;
        return kr < rows_kv ? (kr / group) * n_heads + g_kv * group + kr % group : -1;
    };

    // ---- stage j: tokens start + j TOK .. (rows past `end`: zeros, never read from memory);
    // 16-bit rows swizzled for wgmma, fp8 rows as they are (widened below)
    const int steps = (end - start + TOK - 1) / TOK;
    // each thread's copies at offsets fixed for the block: (16-bit) chunk cj = t % 8 of every
    // 64-column block of rows cr = t / 8 and cr + 32 (swizzled); (fp8) chunks cj + 4 b of row
    // cr = t / 4; a step adds its row pointers and immediates
    constexpr int CPR = Q8 ? 4 : 8, RPP = THREADS / CPR;
    const int cr = threadIdx.x / CPR, cj = threadIdx.x % CPR;
    const int c_smem = Q8 ? cr * DK + cj * 16 : cr * 128 + ((cj ^ (cr & 7)) << 4);
    const KT* c_src = kg + cj * EPC;
    auto issue = [&](int j) {
        if (j < steps) {
            unsigned char* st = ring + (j % S) * SM::STAGE + c_smem;
            const int t0 = start + j * TOK;
#pragma unroll
            for (int h = 0; h < TOK / RPP; ++h) {
                const int row = t0 + cr + h * RPP;
                const bool ok = row < end;
                const KT* src = c_src + (long long)(ok ? row : start) * k_row;
#pragma unroll
                for (int b = 0; b < DK / 64; ++b)
                    fx_cp_async16(st + (Q8 ? b * 64 : b * (TOK * 128) + h * (RPP * 128)),
                                  src + b * 64, ok);
            }
        }
        fx_cp_async_commit();
    };
    issue(0);

    // ---- q's 64 rows into their tile (padding rows: zeros); (Q8) as fp16, each row scaled
    // by 2^-e where its largest |q| would pass fp16's range
    if constexpr (Q8 != 0) {
        for (int i = threadIdx.x; i < HT; i += THREADS) q_top[i] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < HT * (DK / 8); i += THREADS) {
            const int r = i / (DK / 8), c = i % (DK / 8), o = out_row(r);
            if (o >= 0)
                atomicMax(&q_top[r], __float_as_int(fx_top8<QT>(
                                         fx_ldg16(q + (long long)o * DK + c * 8, true))));
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < HT * (DK / 8); i += THREADS) {
        const int r = i / (DK / 8), c = i % (DK / 8), o = out_row(r);
        uint4 w = fx_ldg16(q + (long long)max(o, 0) * DK + c * 8, o >= 0);
        if constexpr (Q8 != 0)
            w = fx_half8<QT>(w, __int_as_float((127 - fx_q8_shift(q_top[r])) << 23));
        *reinterpret_cast<uint4*>(q_s + fx_wg_at<HT>(r, c)) = w;
    }

    // ---- this thread's rows (16 wl + g, + 8): scorers, visible tokens [lo, hi]
    const float k_sc = Q8 ? (k_scales != nullptr ? k_scales[g_kv] : kv_scale) : 1.f;
    FxScore<F> sc[2];
    int lo[2], hi[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = 16 * wl + g + 8 * h, r = out_row(row);
        const int t = (r0 + row) / group;
        sc[h] = fx_scorer<F>(feat, DK, 0, false, seq, nullptr);
        if (Q8) sc[h].fold(k_sc * __int_as_float((127 + fx_q8_shift(q_top[row])) << 23));
        hi[h] = r >= 0 ? base_t + t : -1;
        lo[h] = (F & FX_F_WINDOW) ? base_t + t + 1 - window : 0;
    }
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;

    // Q's and P's descriptors (a k-step adds its offset / 16 to the start address field, which
    // holds any offset of shared memory without a carry)
    const unsigned long long qd = fx_wg_desc(q_s, 16), pd = fx_wg_desc(p_s, 16);
    for (int j = 0; j < steps; ++j) {
        fx_cp_async_wait<0>();
        fx_fence_async_shared();
        __syncthreads();  // stage j (and q) in; step j - 1 done by every warp
        issue(j + 1);
        const unsigned char* ks;
        if constexpr (Q8 != 0) {  // the step's bytes widened into `wide`, swizzled
            const KT* kb = reinterpret_cast<const KT*>(ring + (j % S) * SM::STAGE);
            // (as the 16-bit copies: chunk wj of every 64-column block, rows wr and wr + 32)
            const int wr = threadIdx.x >> 3, wj = threadIdx.x & 7;
            unsigned char* wd = wide + wr * 128 + ((wj ^ (wr & 7)) << 4);
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int b = 0; b < DK / 64; ++b)
                    *reinterpret_cast<uint4*>(wd + b * (TOK * 128) + h * 4096) =
                        FxRead<Q8>::at(kb + (wr + 32 * h) * DK, b * 64 + wj * 8);
            fx_fence_async_shared();
            __syncthreads();
            ks = wide;
        } else {
            ks = ring + (j % S) * SM::STAGE;
        }
        const int t0 = start + j * TOK;

        // ---- S = Q K^T: the 64 rows x this WG's 32 tokens
        float s[16];
        const unsigned long long kd = fx_wg_desc(ks + wg * 32 * 128, 16);
        fx_wg_fence();
#pragma unroll
        for (int kk = 0; kk < DK / 16; ++kk) {
            const int blk = kk >> 2, in = (kk & 3) * 32;
            fx_wg_qk(s, qd + ((blk * (HT * 128) + in) >> 4),
                     kd + ((blk * (TOK * 128) + in) >> 4), kk, T{});
        }
        fx_wg_commit_wait();

        // ---- scores, their maxima over both WGs' tokens
        // (a step whose 64 tokens this thread's rows all see: no mask)
        float x[16], mx[2] = {-INFINITY, -INFINITY};
        const bool whole = t0 + TOK <= end && t0 + TOK - 1 <= min(hi[0], hi[1]) &&
                           t0 >= max(lo[0], lo[1]);
        if (whole) {
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const int h = (i >> 1) & 1;
                x[i] = sc[h](s[i], t0 + 32 * wg + 8 * (i >> 2) + 2 * tig + (i & 1));
                mx[h] = fmaxf(mx[h], x[i]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const int h = (i >> 1) & 1;
                const int tok = t0 + 32 * wg + 8 * (i >> 2) + 2 * tig + (i & 1);
                const bool in = tok < end && tok <= hi[h] && tok >= lo[h];
                x[i] = in ? sc[h](s[i], tok) : -INFINITY;
                mx[h] = fmaxf(mx[h], x[i]);
            }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            if (tig == 0) red[wg * HT + 16 * wl + g + 8 * h] = mx[h];
        }
        __syncthreads();  // the maxima are in
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = 16 * wl + g + 8 * h;
            const float m_new = fmaxf(m_run[h], fmaxf(red[row], red[HT + row]));
            alpha[h] = m_run[h] == -INFINITY ? 0.f : fx_exp2(m_run[h] - m_new);
            m_run[h] = m_new;
        }
        // ---- P for this WG's tokens, the rows' shares of the sums
        float ps[2] = {0.f, 0.f};
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float* xi = x + 4 * n + 2 * h;
                const float p0 = xi[0] == -INFINITY ? 0.f : fx_exp2(xi[0] - m_run[h]);
                const float p1 = xi[1] == -INFINITY ? 0.f : fx_exp2(xi[1] - m_run[h]);
                ps[h] += p0 + p1;
                const int row = 16 * wl + g + 8 * h;
                *reinterpret_cast<unsigned*>(p_s + fx_wg_at<HT>(row, 4 * wg + n) + 4 * tig) =
                    fx_pack2_rn<T>(p0, p1);
            }
        l_run[0] = l_run[0] * alpha[0] + ps[0];
        l_run[1] = l_run[1] * alpha[1] + ps[1];
        if (!__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) {  // a max moved
#pragma unroll
            for (int n = 0; n < 32; ++n) {
                o[4 * n] *= alpha[0];
                o[4 * n + 1] *= alpha[0];
                o[4 * n + 2] *= alpha[1];
                o[4 * n + 3] *= alpha[1];
            }
        }
        fx_fence_async_shared();
        __syncthreads();  // P is in

        // ---- O += P V: this WG's 256 output columns
        const unsigned long long vd = fx_wg_v_desc<TOK>(ks + 4 * wg * (TOK * 128));
        fx_wg_fence();
#pragma unroll
        for (int kt = 0; kt < TOK / 16; ++kt)
            fx_wg_pv(o, pd + ((kt * 32) >> 4), vd + ((kt * 16 * 128) >> 4), T{});
        fx_wg_commit_wait();
    }
    fx_cp_async_wait<0>();  // no copy may land after the block has left
    fx_let_combine_start<1>();

    // ---- the rows' sums over their quads, then over the two WGs (in `red`: every thread is
    // past its last read of the maxima, before the last barrier)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
        l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
        if (tig == 0) red[wg * HT + 16 * wl + g + 8 * h] = l_run[h];
    }
    __syncthreads();

    // ---- the partials, by the row's place in the output (o scaled by the V scale)
    const float v_sc = Q8 ? (v_scales != nullptr ? v_scales[g_kv] : kv_scale) : 1.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = 16 * wl + g + 8 * h, r = out_row(row);
        if (r < 0) continue;
        const long long at = (long long)r * splits + split;
#pragma unroll
        for (int n = 0; n < 32; ++n) {
            const int d = 256 * wg + 8 * n + 2 * tig;
            *reinterpret_cast<float2*>(ws_o + at * DV + d) =
                make_float2(o[4 * n + 2 * h] * v_sc, o[4 * n + 2 * h + 1] * v_sc);
        }
        if (wg == 0 && tig == 0)
            *reinterpret_cast<float2*>(ws_ml + 2 * at) =
                make_float2(m_run[h], red[row] + red[HT + row]);
    }
#endif
}

// gqa_split_latent_<dt>[_<fp8>]_dk<DK>_dv<DV>_h64_x<F>: part 12's arguments and partials.
#define FX_LATENT_WG_ENTRY(NAME, QT, Q8, DK, DV, F)                                          \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(                               \
        const QT* q, const FxLatentKT<QT, Q8>* k, const FxLatentKT<QT, Q8>* v, float* ws_o,   \
        float* ws_ml, int n_heads, int n_kv_heads, int n_q, int seq_len,                     \
        const int* seq_len_dev, int splits, int tile, long long k_row, long long v_row,      \
        long long k_head, long long v_head, float scale, float cap, int window,              \
        const float* k_scales, const float* v_scales, float kv_scale) {                      \
        const FxFeat feat{scale, cap, window, nullptr, nullptr, nullptr, 0};                 \
        gqa_split_latent_wg<QT, Q8, DK, DV, F>(q, k, ws_o, ws_ml, n_heads, n_kv_heads, n_q,   \
                                               seq_len, seq_len_dev, splits, tile, k_row,    \
                                               k_head, feat, k_scales, v_scales, kv_scale);  \
    }
