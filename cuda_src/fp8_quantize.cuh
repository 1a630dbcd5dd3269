// What the quantizing appends share (kv_quantize.cu, kv_quantize4.cu): one float as an fp8
// byte, rounded to nearest even and saturated to the format's finite range (NaN stays
// NaN), the fp8 caches' quantization and a side of a cache whose K and V take formats of
// their own; a token's rows passed by value; the first row an append writes.
#pragma once

template <int Q8>  // 1: e4m3, 2: e5m2
__device__ __forceinline__ unsigned char fx_quantize(float x) {
    unsigned short r;  // (both halves converted from x)
    if (Q8 == 1)
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %1;" : "=h"(r) : "f"(x));
    else
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %1;" : "=h"(r) : "f"(x));
    return (unsigned char)(r & 0xffu);
}

// One token's K and V rows, N values each, passed to an append kernel by value as one
// argument (kv_quantize.cu's FX_APPEND_ENTRY, kv_quantize4.cu's FX_APPEND4_ENTRY)
template <class QT, int N>
struct FxRowPair {
    QT k[N];
    QT v[N];
};

// The first cache row an append of n_rows writes: `first` itself, or (first < 0) the
// device's length state[0], read by every thread before one of them may bump it (first
// -1); false where the rows would pass `capacity` (the overflow flag state[1] set, nothing
// to write).
__device__ __forceinline__ bool fx_append_row0(int first, int n_rows, int* __restrict__ state,
                                               int capacity, int& row0) {
    row0 = first;
    if (first < 0) {
        row0 = state[0];
        if (first == -1) __syncthreads();
        if (row0 < 0 || row0 > capacity - n_rows) {
            if (threadIdx.x == 0 && blockIdx.x == 0) state[1] = 1;
            return false;
        }
    }
    return true;
}
