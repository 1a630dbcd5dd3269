// One float as an fp8 byte, rounded to nearest even and saturated to the format's finite
// range (NaN stays NaN): the fp8 caches' quantization (kv_quantize.cu), and a side of a
// cache whose K and V take formats of their own (kv_quantize4.cu).
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
