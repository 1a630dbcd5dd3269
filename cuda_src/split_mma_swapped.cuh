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
#define FX_Q4 3  // a q4 cache: nibbles and a float16 scale per FX_Q4_GROUP elements
#define FX_Q4_GROUP 32
#ifndef FX_Q4_PROBE  // (experiment: 1 copies only, 2 compute only, 3 no widening,
                      // 4 the values' copies only, 5 neither copies nor compute: the fixed costs)
#define FX_Q4_PROBE 0
#endif
#define FX_NVFP4 4  // an nvfp4 cache: e2m1 nibbles, an e4m3 scale per 16, a float32 per head
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

// ---- 4-bit caches (Q8 = FX_Q4, FX_NVFP4) on this body: each warp's ring holds its steps'
// nibbles and block scales as they are (a quarter of a 16-bit ring's bytes per token), and
// every lane widens the values its mma fragments need in registers: no widening pass, no
// barrier. A lane reads 8 consecutive elements of a row as one 32-bit word and widens them
// into the fp16 pairs {e0, e4}, {e1, e5}, {e2, e6}, {e3, e7} (a mask and a magic exponent
// each: FasterTransformer's and Marlin's trick), so
//  - K: lane tig takes chunks (8 elements) tig * NKB + kb of rows g and g + 8 (NKB = D / 32:
//    one 16-byte read a row at head_dim 128), and q is staged in the same order
//    (fx_load_q4), so the pairs are the mma's k-pairs as they come;
//  - V: lane g takes chunks g * NHB + hb (NHB = D / 64) of tokens 2tig, 2tig + 1, 2tig + 8,
//    2tig + 9, so row g of mma i of block hb is element i of its chunk and row g + 8 element
//    i + 4 (the output's columns in that order: the kernel parks them by their d); the
//    two tokens of each pair share one word before widening (one byte-permute: elements
//    0-3 of both, another 4-7), so the pairs come out as the A operand's registers.
// Ring rows are placed so that each of these reads takes the fewest shared-memory
// wavefronts its bytes need (a bank model of every head_dim's reads): K's 16-byte chunk c of
// row r at c ^ (r & 1) (head_dim 256), V's rows permuted and their chunks XORed (fx_v4_at).
template <int D>
__device__ __forceinline__ int fx_k4_at(int r, int c) {  // byte of K's chunk c of row r
    return r * (D / 2) + ((c ^ (D == 256 ? r & 1 : 0)) << 4);
}
template <int D>
__device__ __forceinline__ int fx_v4_at(int r, int c) {  // byte of V's chunk c of row r
    const int pr = D == 64 ? r ^ ((r >> 2) & 1) : D == 128 ? r ^ ((r >> 1) & 1) : r;
    const int f = D == 128 ? ((r >> 2) & 1) << 1 : D == 256 ? ((r >> 1) & 3) << 1 : 0;
    return pr * (D / 2) + ((c ^ f) << 4);
}
// this lane's K words of row r (chunks tig * NKB ..): NKB words
template <int D>
__device__ __forceinline__ void fx_k4_words(const unsigned char* ks, int r, int tig,
                                            unsigned (&w)[D / 32]) {
    if constexpr (D == 64) {
        const uint2 x = *reinterpret_cast<const uint2*>(ks + fx_k4_at<D>(r, tig >> 1) +
                                                        (tig & 1) * 8);
        w[0] = x.x;
        w[1] = x.y;
    } else {
#pragma unroll
        for (int h = 0; h < D / 128; ++h) {
            const uint4 x =
                *reinterpret_cast<const uint4*>(ks + fx_k4_at<D>(r, tig * (D / 128) + h));
            w[4 * h] = x.x;
            w[4 * h + 1] = x.y;
            w[4 * h + 2] = x.z;
            w[4 * h + 3] = x.w;
        }
    }
}
// this lane's V words of token row r (chunks g * NHB ..): NHB words
template <int D>
__device__ __forceinline__ void fx_v4_words(const unsigned char* vs, int r, int g,
                                            unsigned (&w)[D / 64]) {
    if constexpr (D == 64) {
        w[0] = *reinterpret_cast<const unsigned*>(vs + fx_v4_at<D>(r, g >> 2) + (g & 3) * 4);
    } else if constexpr (D == 128) {
        const uint2 x =
            *reinterpret_cast<const uint2*>(vs + fx_v4_at<D>(r, g >> 1) + (g & 1) * 8);
        w[0] = x.x;
        w[1] = x.y;
    } else {
        const uint4 x = *reinterpret_cast<const uint4*>(vs + fx_v4_at<D>(r, g));
        w[0] = x.x;
        w[1] = x.y;
        w[2] = x.z;
        w[3] = x.w;
    }
}
// the block scale of chunk c (8 elements) of a row (`sc`: its scale bytes) as an fp16 pair
template <int Q8>
__device__ __forceinline__ unsigned fx_scale4(const unsigned char* sc, int c) {
    if constexpr (Q8 == FX_Q4) {
        return (unsigned)reinterpret_cast<const unsigned short*>(sc)[c * 8 / FX_Q4_GROUP] *
               0x10001u;
    } else {
        unsigned s2;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(s2) : "h"((unsigned short)(sc[c >> 1] * 0x101u)));
        return s2;
    }
}
// a word's 8 elements (element e in bits 4e .. 4e + 3) widened into r[i] = {e_i, e_i+4},
// times the block scale s2 (its halves may differ: V's words hold two tokens' halves):
// q4 (nibble - 8) x scale, the nibble under a magic exponent where it lies (a byte's low
// nibble: 0x6400 | n = 1024 + n; its high one: 0x5400 | 16 n = 64 + n), so the subtraction
// is exact and the product rounded once; nvfp4 e2m1 (sign, e1 e0 m) placed under fp16's
// sign and exponent bits, which makes 2^-14 of its value (subnormal where e = 0), x scale,
// exact (the 2^14 folded into the head's scales).
// the widening's constants, in registers the compiler keeps (built from a zero it cannot
// see, so it does not rematerialize them every step)
struct FxNibConst {
    unsigned c0, c1, c2, c3;
};
template <int Q8>
__device__ __forceinline__ FxNibConst fx_nib_const(unsigned zero) {
    if constexpr (Q8 == FX_Q4)
        return FxNibConst{0x000f000fu | zero, 0x00f000f0u | zero, 0x64006400u | zero,
                          0x54005400u | zero};
    else
        return FxNibConst{0u, 0u, 0x80008000u | zero, 0u};  // (nvfp4: the sign bits)
}
template <int Q8>
__device__ __forceinline__ void fx_widen4(unsigned w, unsigned s2, unsigned (&r)[4],
                                          const FxNibConst& k) {
    if constexpr (FX_Q4_PROBE == 3) {
        const unsigned u = w >> 8;  // (values in [0, 1): no infinities)
        r[0] = w & 0x3bff3bffu;
        r[1] = (w & 0x0bff0bffu) | s2;
        r[2] = u & 0x3bff3bffu;
        r[3] = u & 0x33ff33ffu;
        return;
    }
    const unsigned u = w >> 8;  // (one shift a word: elements 2, 3 and 6, 7 from w >> 8)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned t = i & 2 ? u : w;
        if constexpr (Q8 == FX_Q4) {
            const unsigned h = i & 1 ? (t & k.c1) | k.c3   // 64 + n
                                     : (t & k.c0) | k.c2;  // 1024 + n
            asm("{.reg .b32 t;\n sub.f16x2 t, %1, %2;\n mul.rn.f16x2 %0, t, %3;}"
                : "=r"(r[i])
                : "r"(h), "r"(i & 1 ? 0x54805480u : 0x64086408u), "r"(s2));
        } else {
            // e2m1 (sign, e1 e0 m) as fp16's sign and bits 9-11
            const unsigned a = i < 3 ? w << (9 - 4 * i) : w >> 3;
            const unsigned h = (a & 0x0e000e00u) | ((a << 3) & k.c2);
            asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r[i]) : "r"(h), "r"(s2));
        }
    }
}
// the block scales of chunk c of two rows (`sa`, `sb`: their scale bytes) as {s_a, s_b}
template <int Q8>
__device__ __forceinline__ unsigned fx_scale4_pair(const unsigned char* sa,
                                                   const unsigned char* sb, int c) {
    if constexpr (Q8 == FX_Q4) {
        const int at = c * 8 / FX_Q4_GROUP;
        return __byte_perm(reinterpret_cast<const unsigned short*>(sa)[at],
                           reinterpret_cast<const unsigned short*>(sb)[at], 0x5410u);
    } else {
        unsigned s2;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;"
            : "=r"(s2)
            : "h"((unsigned short)(sa[c >> 1] | (sb[c >> 1] << 8))));
        return s2;
    }
}
template <int D>
struct FxStages4 {
    static constexpr int value =
        D == 64 ? FX_STAGES4_D64 : D == 128 ? FX_STAGES4_D128 : FX_STAGES4_D256;
};
// One warp's ring of a 4-bit cache: S steps of 16 tokens, each [K values][V values]
// [K scales][V scales] (rows of D / 2 and D / 16 bytes), the block's WARPS warps taking
// turns as FxWarpRing's do; one commit group per step, even an empty one. The cache's rows
// token-major, or head-major (one KV head's rows in a run: each step reads 16 x D / 2
// contiguous bytes, where token-major rows of 64 bytes read at 76% of the memory's rate).
template <int D, int S, int WARPS>
struct FxRing4 {
    static constexpr int RB = D / 2, SCB = D / 16, KCH = RB / 16;
    static constexpr int STEP_B = 2 * 16 * (RB + SCB);
    static constexpr int NU = 16 * KCH / 32;  // 16-byte units of K (and of V) a lane copies
    unsigned char* ring;
    const unsigned char *kg, *vg, *ksg, *vsg;  // the block's KV head at token 0
    long long row, srow;                       // bytes token to token: values, scales
    int start, end, warp, lane;
    // this lane's sources at the step next issued (K's units; V's are dv further; its
    // scale row's), advanced a step of the block's warps each issue
    const unsigned char* kp[NU];
    const unsigned char* sp;
    long long dv;
    __device__ __forceinline__ int t0(int j) const {
        return start + warp * 16 + j * (WARPS * 16);
    }
    __device__ __forceinline__ const unsigned char* stage(int j) const {
        return ring + (j % S) * STEP_B;
    }
    __device__ __forceinline__ void init() {
#pragma unroll
        for (int n = 0; n < NU; ++n) {
            const int i = n * 32 + lane, r = i / KCH, c = i % KCH;
            kp[n] = kg + (long long)(start + warp * 16 + r) * row + c * 16;
        }
        dv = vg - kg;
        sp = (lane < 16 ? ksg : vsg) + (long long)(start + warp * 16 + (lane & 15)) * srow;
    }
    __device__ __forceinline__ void issue(int j) {
        const int t = t0(j);
        if (t < end && FX_Q4_PROBE != 5 && (FX_Q4_PROBE != 2 || j < S - 1)) {
            unsigned char* st = ring + (j % S) * STEP_B;
#pragma unroll
            for (int n = 0; n < NU; ++n) {
                const int i = n * 32 + lane, r = i / KCH, c = i % KCH;
                const bool ok = t + r < end;
                const unsigned char* src = ok ? kp[n] : kg;  // (rows past the end: zeros)
                fx_cp_async16(st + fx_k4_at<D>(r, c), src, ok);
                fx_cp_async16(st + 16 * RB + fx_v4_at<D>(r, c), src + dv, ok);
            }
            const int r = lane & 15;  // lanes 0-15: K's scales, 16-31: V's
            const bool ok = t + r < end && FX_Q4_PROBE != 4;
            fx_cp_async_small<SCB>(st + 32 * RB + (lane >> 4) * 16 * SCB + r * SCB,
                                   ok ? sp : ksg, ok);
        }
        fx_cp_async_commit();
#pragma unroll
        for (int n = 0; n < NU; ++n) kp[n] += WARPS * 16 * row;
        sp += WARPS * 16 * srow;
    }
};
template <int D, int S, int WARPS>
__device__ __forceinline__ FxRing4<D, S, WARPS> fx_ring4(unsigned char* smem,
                                                         const unsigned char* k,
                                                         const unsigned char* v,
                                                         const unsigned char* k_sc,
                                                         const unsigned char* v_sc, int g_kv,
                                                         int n_kv_heads, bool hnd,
                                                         long long head_stride, int start,
                                                         int end, int warp, int lane) {
    using R = FxRing4<D, S, WARPS>;
    R r;
    r.ring = smem + warp * S * R::STEP_B;
    if (hnd) {  // (head-major: a head's rows head_stride bytes apart, its scale rows too)
        const long long sh = head_stride / R::RB * R::SCB;
        r.kg = k + g_kv * head_stride;
        r.vg = v + g_kv * head_stride;
        r.ksg = k_sc + g_kv * sh;
        r.vsg = v_sc + g_kv * sh;
        r.row = R::RB;
        r.srow = R::SCB;
    } else {
        r.kg = k + (long long)g_kv * R::RB;
        r.vg = v + (long long)g_kv * R::RB;
        r.ksg = k_sc + (long long)g_kv * R::SCB;
        r.vsg = v_sc + (long long)g_kv * R::SCB;
        r.row = (long long)n_kv_heads * R::RB;
        r.srow = (long long)n_kv_heads * R::SCB;
    }
    r.start = start;
    r.end = end;
    r.warp = warp;
    r.lane = lane;
    r.init();
#pragma unroll
    for (int j = 0; j < S - 1; ++j) r.issue(j);
    return r;
}
// q for a 4-bit cache's fp16 mmas: as fx_load_q8 (each head's power of two), rotated first
// in float32 where K was (R, as the rows kernel does), staged in the order fx_widen4 gives
// K's elements: chunk c = tig * NKB + kb of head j, element e, at q_s[j][kb * 32 + tig * 8 +
// 2 (e & 3) + (e >> 2)], which FxQ reads as column (kb, tig).
template <int D, int THREADS, int R, class QT>
__device__ __forceinline__ FxQ<fx_half, D> fx_load_q4(const QT* q, int h0, int group, int g,
                                                      int tig, float& mul_a, float& mul_b) {
    __shared__ __align__(16) fx_half q_s[8][D + 8];
    __shared__ int q_top[8];  // the bits of each head's largest |q|
    constexpr int E = D / 32, NKB = D / 32;
    const int lane = threadIdx.x & 31;
    for (int j = threadIdx.x >> 5; j < 8; j += THREADS / 32) {  // a warp per head
        const bool ok = j < group;
        const QT* qj = q + (long long)(ok ? h0 + j : h0) * D + lane * E;
        float x[E];
#pragma unroll
        for (int e = 0; e < E; ++e) x[e] = ok ? fx_to_float(qj[e]) : 0.f;
        if constexpr (R != 0) fx_hadamard_lanes<E>(x, lane, D, fx_inv_sqrt<D>());
        float top = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) top = fmaxf(top, fabsf(x[e]));
        top = fx_lanes_max<1, 32>(top);
        const float down = __int_as_float((127 - fx_q8_shift(__float_as_int(top))) << 23);
        if (lane == 0) q_top[j] = __float_as_int(top);
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int d = lane * E + e, c = d >> 3, el = d & 7;
            q_s[j][(c % NKB) * 32 + (c / NKB) * 8 + 2 * (el & 3) + (el >> 2)] =
                fx_from_float<fx_half>(x[e] * down);
        }
    }
    __syncthreads();
    mul_a = __int_as_float((127 + fx_q8_shift(q_top[2 * tig])) << 23);
    mul_b = __int_as_float((127 + fx_q8_shift(q_top[2 * tig + 1])) << 23);
    return FxQ<fx_half, D>::of(q_s[g], tig);
}
// (a type by a compile-time choice)
template <bool C, class A, class B>
struct FxPick {
    using type = A;
};
template <class A, class B>
struct FxPick<false, A, B> {
    using type = B;
};

template <int F, int Q8>
__device__ __forceinline__ FxScore<F> fx_folded(FxScore<F> sc, float f) {
    if (Q8) sc.fold(f);
    return sc;
}

// Q8 = FX_Q4, FX_NVFP4: a 4-bit cache (k_sc / v_sc its block scales as bytes, nvfp4's per
// head in kv_scales; fx_widen4), R: K was rotated on append and q is here (fx_load_q4),
// S4: a 4-bit ring's steps where not FxStages4's (the narrow kernels').
template <class T, int D, bool CLUSTER, int WARPS, int DR = D, int TILED = 0, int F = 0,
          int PAIR = 1, int Q8 = 0, class QT = T, int R = 0, int S4 = 0>
__device__ __forceinline__ void gqa_split_mma_swapped(
    const QT* __restrict__ q, const typename FxStore<T, Q8>::type* __restrict__ k,
    const typename FxStore<T, Q8>::type* __restrict__ v, float* __restrict__ ws_o,
    float* __restrict__ ws_ml, QT* __restrict__ out, int n_heads, int n_kv_heads, int seq_len,
    const int* __restrict__ seq_len_dev, int splits, int tile, const FxFeat feat = FxFeat{},
    const float* __restrict__ kv_scales = nullptr,
    const unsigned char* __restrict__ k_sc = nullptr,
    const unsigned char* __restrict__ v_sc = nullptr) {
    using KT = typename FxStore<T, Q8>::type;  // the cache's element
    constexpr bool Q4 = Q8 == FX_Q4, NIB = Q4 || Q8 == FX_NVFP4;  // (NIB: 4-bit values)
    static_assert(!NIB || (DR == D && PAIR == 1), "4-bit: the kernel's own head_dim");
    // (an fp8 ring: twice the kernel's steps of bytes; a pair's: the kernel's; 4-bit: its own)
    constexpr int S = NIB ? (S4 ? S4 : FxStages4<D>::value)
                      : Q8 ? 2 * FxStages<D>::value
                           : FxStages<D, PAIR == 1 ? DR : D>::value;
    constexpr int THREADS = WARPS * 32;
    constexpr int STEP = 16 * D;  // elements of one step's K (or V)
    constexpr int RING = NIB ? WARPS * S * FxRing4<D, S, WARPS>::STEP_B
                             : WARPS * S * 2 * STEP * (int)sizeof(KT);
    extern __shared__ __align__(16) unsigned char fx_dyn_smem[];

    FxTcBlock blk;  // this block's chunk, KV head and query heads
    if (!fx_tc_block<CLUSTER, TILED, D, F>(blk, RING, THREADS, n_heads, n_kv_heads, seq_len,
                                           seq_len_dev, splits, tile, feat.window))
        return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;  // mma fragment coordinates: lane = 4g + tig
    typename FxPick<NIB, FxRing4<D, S, WARPS>, FxWarpRing<KT, D, 16, S, WARPS, DR>>::type wr;
    if constexpr (NIB)
        wr = fx_ring4<D, S, WARPS>(fx_dyn_smem, k, v, k_sc, v_sc, blk.g_kv, n_kv_heads,
                                   (F & FX_F_HND) != 0, feat.head_stride, blk.start, blk.end,
                                   warp, lane);
    else
        wr = fx_warp_ring<KT, D, 16, S, WARPS, DR, F>(fx_dyn_smem, k, v, blk.g_kv, n_kv_heads,
                                                      feat.head_stride, blk.start, blk.end,
                                                      warp, lane);

    // 4-bit: the widening's constants and the chunks (8 elements) a block scale covers
    const FxNibConst nk = fx_nib_const<Q8>((unsigned)splits >> 31);
    constexpr int PER4 = (Q8 == FX_Q4 ? FX_Q4_GROUP : 16) / 8;

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
        if constexpr (NIB)
            qf[u] = fx_load_q4<D, THREADS, R>(q, h0[u], group[u], g, tig, q_mul_a[u], q_mul_b[u]);
        else if constexpr (Q8 != 0)
            qf[u] = fx_load_q8<D, THREADS, DR>(q, h0[u], group[u], g, tig, q_mul_a[u], q_mul_b[u]);
        else
            qf[u] = fx_load_q<T, D, THREADS, DR, PAIR>(q, h0[u], group[u], g, tig, a_heads);
    }

    // heads 2tig (a) and 2tig + 1 (b); Q8: the K scale and q's folded in
    // (nvfp4: the head's, times 2^14 where fx_widen4 widens to 2^-14 of the value)
    constexpr float NIB_UP = Q8 == FX_NVFP4 ? 16384.f : 1.f;
    const float k_scale = Q8 && !Q4 ? kv_scales[blk.g_kv] * NIB_UP : 1.f;
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
        if constexpr (NIB && (FX_Q4_PROBE == 1 || FX_Q4_PROBE == 4 || FX_Q4_PROBE == 5))
            continue;
        const int t0 = wr.t0(j);
        const KT* ks;
        const KT* vs;
        if constexpr (NIB) {
            ks = wr.stage(j);
            vs = ks + 16 * (D / 2);
        } else {
            ks = wr.k_stage(j);
            vs = ks + STEP;
        }
        // ---- S^T = K Q^T: rows = tokens t0 + g (c0, c1) and t0 + g + 8 (c2, c3), columns
        // = heads 2tig, 2tig + 1; two chains (the 16-byte reads' halves)
        float s[NT][4], s2[NT][4];
#pragma unroll
        for (int u = 0; u < NT; ++u)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[u][e] = s2[u][e] = 0.f;
        if constexpr (NIB) {  // this lane's words of rows g and g + 8, widened per chunk
            constexpr int NKB = D / 32;
            const unsigned char* ksc = ks + 32 * (D / 2);  // K's scales, then V's
            unsigned wa[NKB], wc[NKB];
            fx_k4_words<D>(ks, g, tig, wa);
            fx_k4_words<D>(ks, g + 8, tig, wc);
            unsigned sk_a = 0, sk_c = 0;  // rows g and g + 8: the block scale of chunk c
#pragma unroll
            for (int kb = 0; kb < NKB; ++kb) {
                const int c = tig * NKB + kb;
                if (kb % PER4 == 0) {  // (a scale's chunks: once)
                    sk_a = fx_scale4<Q8>(ksc + g * (D / 16), c);
                    sk_c = fx_scale4<Q8>(ksc + (g + 8) * (D / 16), c);
                }
                unsigned ka[4], kc[4];
                fx_widen4<Q8>(wa[kb], sk_a, ka, nk);
                fx_widen4<Q8>(wc[kb], sk_c, kc, nk);
#pragma unroll
                for (int u = 0; u < NT; ++u) {
                    const uint4 qv = qf[u].at(kb, tig);
                    FxMma<T>::run(s[u][0], s[u][1], s[u][2], s[u][3], ka[0], kc[0], ka[1], kc[1],
                                  qv.x, qv.y);
                    FxMma<T>::run(s2[u][0], s2[u][1], s2[u][2], s2[u][3], ka[2], kc[2], ka[3],
                                  kc[3], qv.z, qv.w);
                }
            }
        }
#pragma unroll
        for (int kb = 0; kb < (NIB ? 0 : D / 32); ++kb) {
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
        if constexpr (NIB) {  // (4-bit: chunk g * NHB + hb, rows g and g + 8: elements i, i + 4)
            constexpr int NHB = D / 64;
            const unsigned char* vsc = reinterpret_cast<const unsigned char*>(ks) +
                                       32 * (D / 2) + 16 * (D / 16);  // V's scales
            unsigned w4[4][NHB];  // tokens 2tig, 2tig + 1, 2tig + 8, 2tig + 9
#pragma unroll
            for (int e = 0; e < 4; ++e) fx_v4_words<D>(vs, 2 * tig + (e & 1) + (e >> 1) * 8, g, w4[e]);
            {  // O rescaled only where a row's max moved
                bool moved = false;
#pragma unroll
                for (int u = 0; u < NT; ++u) moved |= alpha_a[u] != 1.f || alpha_b[u] != 1.f;
                if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
                    for (int u = 0; u < NT; ++u)
#pragma unroll
                        for (int hb = 0; hb < NHB; ++hb)
#pragma unroll
                            for (int i = 0; i < 4; ++i) {
                                float* o = oacc[u][hb][i];
                                o[0] *= alpha_a[u];
                                o[1] *= alpha_b[u];
                                o[2] *= alpha_a[u];
                                o[3] *= alpha_b[u];
                            }
                }
            }
            unsigned sv[2] = {0u, 0u};  // token pairs 2tig, + 1 and 2tig + 8, + 9: {s_a, s_b}
#pragma unroll
            for (int hb = 0; hb < NHB; ++hb) {
                unsigned r4[4][4];
                // tokens paired before widening: the halves of x hold elements 0-3 of
                // tokens a and b (y: 4-7), so r4[2p][i] = {a's e_i, b's e_i} is the A
                // operand's register as it comes, with the scales {s_a, s_b}
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    const int ta4 = 2 * tig + 8 * p, c4 = g * NHB + hb;
                    if (hb % PER4 == 0)
                        sv[p] = fx_scale4_pair<Q8>(vsc + ta4 * (D / 16), vsc + (ta4 + 1) * (D / 16),
                                                   c4);
                    fx_widen4<Q8>(__byte_perm(w4[2 * p][hb], w4[2 * p + 1][hb], 0x5410u), sv[p],
                                  r4[2 * p], nk);
                    fx_widen4<Q8>(__byte_perm(w4[2 * p][hb], w4[2 * p + 1][hb], 0x7632u), sv[p],
                                  r4[2 * p + 1], nk);
                }
#pragma unroll
                for (int i = 0; i < 4; ++i) {
#pragma unroll
                    for (int u = 0; u < NT; ++u) {
                        float* o = oacc[u][hb][i];
                        FxMma<T>::run(o[0], o[1], o[2], o[3], r4[0][i], r4[1][i], r4[2][i],
                                      r4[3][i], pb0[u], pb1[u]);
                    }
                }
            }
        }
#pragma unroll
        for (int hb = 0; hb < (NIB ? 0 : D / 64); ++hb) {
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
    if (Q8 && !Q4) {  // the V scale, once (nvfp4: the head's)
        const float v_scale = kv_scales[n_kv_heads + blk.g_kv] * NIB_UP;
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
                        int slot = hb * 16 + (g >> 2) * 8 + 2 * i + (c >> 1), t = g & 3;
                        if constexpr (NIB)  // (this accumulator's column, parked where it goes)
                            where((g * (D / 64) + hb) * 8 + i + 4 * (c >> 1), slot, t);
                        const int ln = 4 * (2 * tig + (c & 1)) + t;
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

// A 4-bit cache (Q8: FX_Q4 or FX_NVFP4; values: nibbles [token][n_kv_heads][D / 2], or with
// FX_F_HND [n_kv_heads][head_stride / (D / 2)][D / 2], head_stride in bytes; k_scales /
// v_scales: its block scales [token][n_kv_heads][...] (FX_F_HND: [n_kv_heads][...][...], as
// many rows a head as the values) as bytes, q4 float16 per 32, nvfp4 e4m3 per 16;
// kv_scales: nvfp4's float32 per KV head, K's then V's, unread for q4)
// with q and the output of type QT, R: K rotated on append, W warps a block, S steps in each
// warp's ring (FX_WARPS4_D<D> and FX_STAGES4_D<D>; the narrow kernels, for short contexts,
// FX_WARPS4N_D<D> and FX_STAGES4N_D<D>):
// gqa_split_mma_<dt>_<q4|nvfp4>[r]_d<D>[_t2][_n]_x<F> and its _cluster twin.
#define FX_MMA4_KERNELS(NAME, QT, Q8, D, TILED, F, R, W, S)                                 \
    extern "C" __global__ void __launch_bounds__(W * 32, FX_BLOCKS4_D##D) NAME(             \
        const QT* q, const unsigned char* k, const unsigned char* v, float* ws_o,           \
        float* ws_ml, int n_heads, int n_kv_heads, int seq_len, const int* seq_len_dev,     \
        int splits, int tile, const float* kv_scales, const unsigned char* k_scales,        \
        const unsigned char* v_scales, float scale, float cap, int window,                  \
        const float* slopes, long long head_stride) {                                       \
        const FxFeat feat{scale, cap, window, slopes, nullptr, nullptr, head_stride};       \
        gqa_split_mma_swapped<fx_half, D, false, W, D, TILED, F, 1, Q8, QT, R, S>(          \
            q, k, v, ws_o, ws_ml, nullptr, n_heads, n_kv_heads, seq_len, seq_len_dev,       \
            splits, tile, feat, kv_scales, k_scales, v_scales);                             \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(W * 32, FX_BLOCKS4_D##D) NAME##_cluster(   \
        const QT* q, const unsigned char* k, const unsigned char* v, QT* out, int n_heads,  \
        int n_kv_heads, int seq_len, const int* seq_len_dev, int splits, int tile,          \
        const float* kv_scales, const unsigned char* k_scales,                              \
        const unsigned char* v_scales, float scale, float cap, int window,                  \
        const float* slopes, long long head_stride, const float* sinks, float* lse) {       \
        const FxFeat feat{scale, cap, window, slopes, sinks, lse, head_stride};             \
        gqa_split_mma_swapped<fx_half, D, true, W, D, TILED, F, 1, Q8, QT, R, S>(           \
            q, k, v, nullptr, nullptr, out, n_heads, n_kv_heads, seq_len, seq_len_dev,      \
            splits, tile, feat, kv_scales, k_scales, v_scales);                             \
    }

#ifndef FX_SELECTED
FX_MMA_WIDE_ENTRY(gqa_split_mma_f16_d128_wide_cluster, fx_half)
FX_MMA_WIDE_ENTRY(gqa_split_mma_bf16_d128_wide_cluster, fx_bf16)
#endif
