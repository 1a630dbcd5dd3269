// 4-bit KV caches, "q4" and "nvfp4" (decode/kv4.py has the formats and their host twins):
// float32, float16 or bfloat16 rows quantized on the device, bit for bit as
// `kv4.quantize_q4` / `kv4.quantize_nvfp4` (of `kv4.hadamard(rows)` where K is rotated) do
// on the host.
//
// A row (one token's KV head, head_dim D = 64, 128 or 256) is one warp's: lane l holds
// elements l E .. l E + E - 1 (E = D / 32). The rotation is the host's butterflies in the
// host's order: for h = 1, 2, 4, .. below the block b (the largest power of two dividing D:
// D itself here), the pair (i, i + h) becomes (a + b, a - b), in registers for h < E and
// across lanes (shuffles) above; then one multiplication by float32(1 / sqrt(b)), which the
// host passes (`inv_sqrt_b`) as numpy computes it. A group of G elements takes G / E
// lanes: its largest magnitude over them (shuffles), the float16 scale amax / 7 (an IEEE
// division, saturated at 65504, rounded to nearest even), codes rint(x / scale) (ties to
// even) clipped to +-7, stored as nibbles code + 8, element 2i in the low half of byte i.
// A scale of 0 stores codes 0.

#include "hadamard.cuh"
#include "fp8_quantize.cuh"

// This lane's E values of a row as q4: nibbles into `vals` (the row's D / 2 bytes) and, by
// the group's first lane, the float16 scale into `scales` (the row's D / G).
template <int E, int G>
__device__ __forceinline__ void fx_quantize_q4_lanes(const float (&x)[E], int lane,
                                                     unsigned char* __restrict__ vals,
                                                     fx_half* __restrict__ scales) {
    static_assert(G % E == 0 && G / E <= 32, "a group of whole lanes");
    float amax = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) amax = fmaxf(amax, fabsf(x[e]));
#pragma unroll
    for (int o = 1; o < G / E; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const fx_half scale = fx_from_float<fx_half>(fminf(__fdiv_rn(amax, 7.f), 65504.f));
    const float s = fx_to_float(scale);
    unsigned char nib[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int code = s > 0.f ? __float2int_rn(__fdiv_rn(x[e], s)) : 0;
        nib[e] = (unsigned char)(min(7, max(-7, code)) + 8);
    }
    if (lane % (G / E) == 0) scales[lane * E / G] = scale;
#pragma unroll
    for (int e = 0; e < E; e += 2) vals[(lane * E + e) / 2] = nib[e] | (nib[e + 1] << 4);
}

// This lane's E values of a row as nvfp4 (kv4.quantize_nvfp4): `g` the row's KV head's
// float32 scale; a block of 16 takes 16 / E lanes: its e4m3 scale min(amax / 6 / g, 448)
// (two IEEE divisions, rounded to nearest even), values x / (scale * g) (0 where that is
// 0) clipped to +-6 and rounded to the nearest even e2m1 (magnitudes 0, 0.5, 1, 1.5, 2, 3,
// 4, 6: a tie goes to the even code), the sign from the quotient's (-0 kept).
template <int E>
__device__ __forceinline__ void fx_quantize_nvfp4_lanes(const float (&x)[E], int lane, float g,
                                                        unsigned char* __restrict__ vals,
                                                        unsigned char* __restrict__ scales) {
    static_assert(16 % E == 0, "a block of whole lanes");
    float amax = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) amax = fmaxf(amax, fabsf(x[e]));
#pragma unroll
    for (int o = 1; o < 16 / E; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float s = fminf(__fdiv_rn(__fdiv_rn(amax, 6.f), g), 448.f);
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %1;" : "=h"(pair) : "f"(s));
    const unsigned char bs = (unsigned char)(pair & 0xffu);
    unsigned h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)(bs * 0x101u)));
    const float denom = fx_to_float(fx_half{(unsigned short)(h2 & 0xffffu)}) * g;
    unsigned char nib[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const float y = denom > 0.f ? fminf(6.f, fmaxf(-6.f, __fdiv_rn(x[e], denom))) : 0.f;
        const float m = fabsf(y);
        const int code = (m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) +
                         (m > 2.5f) + (m >= 3.5f) + (m > 5.f);
        nib[e] = (unsigned char)(code | ((__float_as_uint(y) >> 31) << 3));
    }
    if (lane % (16 / E) == 0) scales[lane * E / 16] = bs;
#pragma unroll
    for (int e = 0; e < E; e += 2) vals[(lane * E + e) / 2] = nib[e] | (nib[e + 1] << 4);
}

// Rows [first, first + n_rows) of a q4 cache (values [token][n_kv][D / 2], scales [token]
// [n_kv][D / G]; head_rows > 0, head-major: [n_kv][head_rows][...], the split kernels'
// FX_F_HND) from rows k_src, v_src of type QT ([n_rows][n_kv][D]), K rotated where
// ROT_K; first as fx_quantize_rows's (kv_quantize.cu): -1, one row at the device's length
// state[0], then bumped (ONE block); -2, n_rows rows at the device's length, not bumped
// (rows past `capacity`: nothing written, the overflow flag state[1] set). A warp per
// (row, KV head).
// G 0: nvfp4 (scales e4m3 bytes [token][n_kv][D / 16], `globals` the KV heads' float32
// scales, K's then V's), else q4 in groups of G (scales float16).
template <class QT, int D, int G, bool ROT_K>
__device__ __forceinline__ void fx_quantize_q4_rows(
    const QT* __restrict__ k_src, const QT* __restrict__ v_src, unsigned char* __restrict__ k_vals,
    unsigned char* __restrict__ v_vals, void* __restrict__ k_scales, void* __restrict__ v_scales,
    int n_kv, int n_rows, int first, int* __restrict__ state, int capacity, float inv_sqrt_b,
    const float* __restrict__ globals, long long head_rows) {
    constexpr int E = D / 32;
    static_assert(D % 32 == 0 && (E & (E - 1)) == 0, "head_dim 32 x a power of two");
    const bool bump = first == -1;
    int row0;
    if (!fx_append_row0(first, n_rows, state, capacity, row0)) return;
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (long long w = (long long)blockIdx.x * warps + (threadIdx.x >> 5);
         w < (long long)n_rows * n_kv; w += (long long)gridDim.x * warps) {
        // the cache's (token, KV head) row
        const long long at = head_rows ? (w % n_kv) * head_rows + row0 + w / n_kv
                                       : (long long)row0 * n_kv + w;
#pragma unroll
        for (int kv = 0; kv < 2; ++kv) {
            const QT* src = (kv ? v_src : k_src) + w * D + lane * E;
            float x[E];
#pragma unroll
            for (int e = 0; e < E; ++e) x[e] = fx_to_float(src[e]);
            if (ROT_K && kv == 0) fx_hadamard_lanes<E>(x, lane, D, inv_sqrt_b);
            unsigned char* vals = (kv ? v_vals : k_vals) + at * (D / 2);
            if constexpr (G == 0) {
                const float g = globals[kv * n_kv + (int)(w % n_kv)];
                fx_quantize_nvfp4_lanes<E>(x, lane, g, vals,
                                           static_cast<unsigned char*>(kv ? v_scales : k_scales) +
                                               at * (D / 16));
            } else {
                fx_quantize_q4_lanes<E, G>(x, lane, vals,
                                           static_cast<fx_half*>(kv ? v_scales : k_scales) +
                                               at * (D / G));
            }
        }
    }
    if (bump) {
        __syncthreads();
        if (threadIdx.x == 0) state[0] = row0 + 1;
    }
}

// kv_quantize_q4_<f32|f16|bf16>_d<D>_g<G>[_rk]: _rk, K rotated
#define FX_QUANTIZE_Q4_ENTRY(NAME, QT, D, G, ROT_K)                                         \
    extern "C" __global__ void NAME(const QT* k_src, const QT* v_src, unsigned char* k_vals,  \
                                    unsigned char* v_vals, fx_half* k_scales,               \
                                    fx_half* v_scales, int n_kv, int n_rows, int first,     \
                                    int* state, int capacity, float inv_sqrt_b,             \
                                    long long head_rows) {                                  \
        fx_quantize_q4_rows<QT, D, G, ROT_K>(k_src, v_src, k_vals, v_vals, k_scales,         \
                                             v_scales, n_kv, n_rows, first, state,          \
                                             capacity, inv_sqrt_b, nullptr, head_rows);     \
    }

// kv_quantize_nvfp4_<f32|f16|bf16>_d<D>[_rk]: globals, the KV heads' K then V scales
#define FX_QUANTIZE_NVFP4_ENTRY(NAME, QT, D, ROT_K)                                         \
    extern "C" __global__ void NAME(const QT* k_src, const QT* v_src, unsigned char* k_vals,  \
                                    unsigned char* v_vals, unsigned char* k_scales,         \
                                    unsigned char* v_scales, int n_kv, int n_rows,          \
                                    int first, int* state, int capacity, float inv_sqrt_b,  \
                                    const float* globals, long long head_rows) {            \
        fx_quantize_q4_rows<QT, D, 0, ROT_K>(k_src, v_src, k_vals, v_vals, k_scales,         \
                                             v_scales, n_kv, n_rows, first, state,          \
                                             capacity, inv_sqrt_b, globals, head_rows);     \
    }

// K and V in formats of their own (e.g. e4m3 K and q4 V, as llama.cpp's q8_0 K and q4_0 V):
// KF, VF each 1 (e4m3), 2 (e5m2), 3 (q4, groups of 32) or 4 (nvfp4), as the split kernels'
// FX_E4M3 .. FX_NVFP4. A side is stored as a cache of its format stores it, bit for bit:
// fp8, x / scale (an IEEE division) rounded and saturated (kv_quantize.cu's), values
// [token][n_kv][D] bytes; 4-bit, as above (values [token][n_kv][D / 2], block scales beside
// them). kv_scales: the KV heads' float32 K scales, then V's (the fp8 and nvfp4 sides'
// scales; a q4 side's are unread); K rotated where ROT_K (a 4-bit K). `first` as
// fx_quantize_q4_rows's; a warp per (row, KV head).
template <int FMT, int D, int E>
__device__ __forceinline__ void fx_quantize_side(const float (&x)[E], int lane, float g,
                                                 unsigned char* __restrict__ vals,
                                                 unsigned char* __restrict__ scales,
                                                 long long at) {
    if constexpr (FMT == 1 || FMT == 2) {
        unsigned char* row = vals + at * D + lane * E;
#pragma unroll
        for (int e = 0; e < E; ++e) row[e] = fx_quantize<FMT>(__fdiv_rn(x[e], g));
    } else if constexpr (FMT == 3) {
        fx_quantize_q4_lanes<E, 32>(x, lane, vals + at * (D / 2),
                                    reinterpret_cast<fx_half*>(scales) + at * (D / 32));
    } else {
        static_assert(FMT == 4, "formats 1 (e4m3), 2 (e5m2), 3 (q4), 4 (nvfp4)");
        fx_quantize_nvfp4_lanes<E>(x, lane, g, vals + at * (D / 2), scales + at * (D / 16));
    }
}

template <class QT, int D, int KF, int VF, bool ROT_K>
__device__ __forceinline__ void fx_quantize_mixed_rows(
    const QT* __restrict__ k_src, const QT* __restrict__ v_src, unsigned char* __restrict__ k_vals,
    unsigned char* __restrict__ v_vals, unsigned char* __restrict__ k_scales,
    unsigned char* __restrict__ v_scales, int n_kv, int n_rows, int first,
    int* __restrict__ state, int capacity, float inv_sqrt_b, const float* __restrict__ kv_scales) {
    constexpr int E = D / 32;
    static_assert(D % 32 == 0 && (E & (E - 1)) == 0, "head_dim 32 x a power of two");
    static_assert(!ROT_K || KF >= 3, "a 4-bit K is rotated");
    const bool bump = first == -1;
    int row0;
    if (!fx_append_row0(first, n_rows, state, capacity, row0)) return;
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    for (long long w = (long long)blockIdx.x * warps + (threadIdx.x >> 5);
         w < (long long)n_rows * n_kv; w += (long long)gridDim.x * warps) {
        const long long at = (long long)row0 * n_kv + w;  // the cache's (token, KV head) row
        const int h = (int)(w % n_kv);
        float x[E];
#pragma unroll
        for (int e = 0; e < E; ++e) x[e] = fx_to_float(k_src[w * D + lane * E + e]);
        if (ROT_K) fx_hadamard_lanes<E>(x, lane, D, inv_sqrt_b);
        fx_quantize_side<KF, D, E>(x, lane, KF == 3 ? 1.f : kv_scales[h], k_vals, k_scales, at);
#pragma unroll
        for (int e = 0; e < E; ++e) x[e] = fx_to_float(v_src[w * D + lane * E + e]);
        fx_quantize_side<VF, D, E>(x, lane, VF == 3 ? 1.f : kv_scales[n_kv + h], v_vals,
                                   v_scales, at);
    }
    if (bump) {
        __syncthreads();
        if (threadIdx.x == 0) state[0] = row0 + 1;
    }
}

// kv_quantize_<kfmt>[r]_v<vfmt>_<f32|f16|bf16>_d<D>: r, K rotated
#define FX_QUANTIZE_MIXED_ENTRY(NAME, QT, D, KF, VF, ROT_K)                                  \
    extern "C" __global__ void NAME(const QT* k_src, const QT* v_src, unsigned char* k_vals,  \
                                    unsigned char* v_vals, unsigned char* k_scales,         \
                                    unsigned char* v_scales, int n_kv, int n_rows,          \
                                    int first, int* state, int capacity, float inv_sqrt_b,  \
                                    const float* kv_scales) {                               \
        fx_quantize_mixed_rows<QT, D, KF, VF, ROT_K>(k_src, v_src, k_vals, v_vals, k_scales,  \
                                                     v_scales, n_kv, n_rows, first, state,  \
                                                     capacity, inv_sqrt_b, kv_scales);      \
    }

// kv_append4_<q4|nvfp4>_<f32|f16|bf16>_d<D>[_rk]_n<N> (KVCache.append of a 4-bit cache):
// one token's K and V rows, N values each ([n_kv][D]), passed by value as one argument (as
// kv_quantize.cu's FX_APPEND_ENTRY: no host-to-device copy, no staging), quantized into
// row `at` as above (G 0: nvfp4, `globals` its scales; head_rows as above); then state[0] =
// at + 1. Launch ONE block of 32 x min(n_kv, 16) threads.
#define FX_APPEND4_ENTRY(NAME, QT, D, G, ROT_K, N)                                          \
    extern "C" __global__ void NAME(const __grid_constant__ FxRowPair<QT, N> rows,           \
                                    unsigned char* k_vals, unsigned char* v_vals,             \
                                    void* k_scales, void* v_scales, int n_kv, int at,         \
                                    int* state, float inv_sqrt_b, const float* globals,       \
                                    long long head_rows) {                                    \
        fx_quantize_q4_rows<QT, D, G, ROT_K>(rows.k, rows.v, k_vals, v_vals, k_scales,        \
                                             v_scales, n_kv, 1, at, state, at + 1,           \
                                             inv_sqrt_b, globals, head_rows);                \
        __syncthreads();                                                                    \
        if (threadIdx.x == 0) state[0] = at + 1;                                            \
    }
// (instantiated by the host, one per cache's row length and format: get_kernel's select)
