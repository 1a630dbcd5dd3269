// fp8 KV caches (KVCache with dtype float8_e4m3fn or float8_e5m2, compute capability 8.9
// and up): float32, float16 or bfloat16 rows quantized on the device. Each value x of KV head h becomes
// x / scale_h (an IEEE division), rounded to nearest even and saturated to the format's
// finite range (448 for e4m3, 57344 for e5m2; infinities too); NaN stays NaN. As
// `np.clip(x / scale, -max, max).astype(ml_dtypes.float8_*)`, bit for bit.

#include "fp8_quantize.cuh"

// Rows [first, first + n_rows) of the caches from rows k_src, v_src of type QT ([n_rows]
// [n_kv][head_dim]); kv_scales: n_kv K scales, then n_kv V ones. first = -1: one row at the
// device's length state[0], which is then bumped (a full cache writes nothing and sets the
// overflow flag state[1]); launch ONE block then. first = -2: n_rows rows at the device's
// length, any grid, not bumped (kv_bump follows; rows past `capacity`: nothing written,
// the flag set).
template <int Q8, class QT>
__device__ __forceinline__ void fx_quantize_rows(const QT* __restrict__ k_src,
                                                 const QT* __restrict__ v_src,
                                                 unsigned char* __restrict__ k_cache,
                                                 unsigned char* __restrict__ v_cache,
                                                 const float* __restrict__ kv_scales, int n_kv,
                                                 int head_dim, int n_rows, int first,
                                                 int* __restrict__ state, int capacity) {
    const bool bump = first == -1;
    int row0;
    if (!fx_append_row0(first, n_rows, state, capacity, row0)) return;
    const long long row = (long long)n_kv * head_dim, n = row * n_rows;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const int h = (int)((i / head_dim) % n_kv);
        const long long at = (long long)row0 * row + i;
        k_cache[at] = fx_quantize<Q8>(fx_to_float(k_src[i]) / kv_scales[h]);
        v_cache[at] = fx_quantize<Q8>(fx_to_float(v_src[i]) / kv_scales[n_kv + h]);
    }
    if (bump) {
        __syncthreads();
        if (threadIdx.x == 0) state[0] = row0 + 1;
    }
}

// kv_quantize_<e4m3|e5m2> (float32 rows: the host's appends, staged) and
// kv_quantize_<fmt>_<f16|bf16> (kv_append_async's 16-bit device rows)
#define FX_QUANTIZE_ENTRY(NAME, Q8, QT)                                                     \
    extern "C" __global__ void NAME(const QT* k_src, const QT* v_src,                       \
                                    unsigned char* k_cache, unsigned char* v_cache,         \
                                    const float* kv_scales, int n_kv, int head_dim,         \
                                    int n_rows, int first, int* state, int capacity) {      \
        fx_quantize_rows<Q8, QT>(k_src, v_src, k_cache, v_cache, kv_scales, n_kv, head_dim, \
                                 n_rows, first, state, capacity);                           \
    }
#ifndef FX_SELECTED  // (a module of one FX_APPEND_ENTRY leaves these out)
FX_QUANTIZE_ENTRY(kv_quantize_e4m3, 1, float)
FX_QUANTIZE_ENTRY(kv_quantize_e5m2, 2, float)
FX_QUANTIZE_ENTRY(kv_quantize_e4m3_f16, 1, fx_half)
FX_QUANTIZE_ENTRY(kv_quantize_e5m2_f16, 2, fx_half)
FX_QUANTIZE_ENTRY(kv_quantize_e4m3_bf16, 1, fx_bf16)
FX_QUANTIZE_ENTRY(kv_quantize_e5m2_bf16, 2, fx_bf16)
#endif

// kv_append_<fmt>_<f32|f16|bf16>_n<N> (KVCache.append): one token's K and V rows, N
// values each ([n_kv][head_dim]), passed by value as one argument (the driver copies the
// arguments when it queues the launch: no host-to-device copy, no staging ring), quantized
// into row `at` of the caches as above; then state[0] = at + 1. Launch ONE block.
template <int Q8, class QT, int N>
__device__ __forceinline__ void fx_quantize_pair(const FxRowPair<QT, N>& rows,
                                                 unsigned char* __restrict__ k_cache,
                                                 unsigned char* __restrict__ v_cache,
                                                 const float* __restrict__ kv_scales, int n_kv,
                                                 int head_dim, int at, int* __restrict__ state) {
    const long long base = (long long)at * N;
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        const int h = i / head_dim;
        k_cache[base + i] = fx_quantize<Q8>(fx_to_float(rows.k[i]) / kv_scales[h]);
        v_cache[base + i] = fx_quantize<Q8>(fx_to_float(rows.v[i]) / kv_scales[n_kv + h]);
    }
    if (threadIdx.x == 0) state[0] = at + 1;
}

#define FX_APPEND_ENTRY(NAME, Q8, QT, N)                                                 \
    extern "C" __global__ void NAME(const __grid_constant__ FxRowPair<QT, N> rows,       \
                                    unsigned char* k_cache, unsigned char* v_cache,      \
                                    const float* kv_scales, int n_kv, int head_dim,      \
                                    int at, int* state) {                                \
        fx_quantize_pair<Q8, QT, N>(rows, k_cache, v_cache, kv_scales, n_kv, head_dim, at, \
                                    state);                                              \
    }
// (instantiated by the host, one per cache's row length: get_kernel's select)
