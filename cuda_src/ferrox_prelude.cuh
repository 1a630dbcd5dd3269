// Pre-included into every ferrox kernel (NVRTC --pre-include). NVRTC ships no libc or
// CUDA runtime headers, so what kernels need beyond the built-ins lives here:
// INFINITY/NAN (undefined under NVRTC: ferrox-cuda's kernel does not compile without them) and
// fp16/bf16 storage types with their conversions, written without cuda_fp16.h/cuda_bf16.h.
#pragma once

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif

// Storage-only 16-bit float types: arithmetic always happens in float.
struct fx_half { unsigned short bits; };
struct fx_bf16 { unsigned short bits; };

__device__ __forceinline__ float fx_to_float(float x) { return x; }
__device__ __forceinline__ float fx_to_float(fx_half x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float fx_to_float(fx_bf16 x) {
    return __uint_as_float(((unsigned)x.bits) << 16);
}

// The two halves of a 32-bit word holding two packed 16-bit values (low one first).
__device__ __forceinline__ float2 fx_unpack2(unsigned w, fx_half) {
    float2 r;
    asm("{.reg .f16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.f32.f16 %0, lo;\n cvt.f32.f16 %1, hi;}"
        : "=f"(r.x), "=f"(r.y) : "r"(w));
    return r;
}
__device__ __forceinline__ float2 fx_unpack2(unsigned w, fx_bf16) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

template <class T> __device__ __forceinline__ T fx_from_float(float f);
template <> __device__ __forceinline__ float fx_from_float<float>(float f) { return f; }
template <> __device__ __forceinline__ fx_half fx_from_float<fx_half>(float f) {
    fx_half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
    return h;
}
template <> __device__ __forceinline__ fx_bf16 fx_from_float<fx_bf16>(float f) {
    // Round to nearest even, as ml_dtypes does; NaN stays a (quiet) NaN.
    unsigned u = __float_as_uint(f);
    fx_bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x40u);
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        r.bits = (unsigned short)(u >> 16);
    }
    return r;
}
