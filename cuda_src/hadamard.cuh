// The Hadamard rotation of a row held by a warp (4-bit caches: kv_quantize4.cu rotates K
// on append, split_rows.cuh rotates q): lane l holds elements l E .. l E + E - 1 (E a
// power of two). The host's butterflies in the host's order (decode/kv4.py's hadamard):
// for h = 1, 2, 4, .. below `block` (a power of two, at most 32 E), the pair (i, i + h)
// becomes (a + b, a - b), in registers for h < E and across lanes above; then one
// multiplication by `inv_sqrt_b`, float32(1 / sqrt(block)) as numpy computes it. The same
// float32 operations in the same order: the same bits.
#pragma once

template <int E>
__device__ __forceinline__ void fx_hadamard_lanes(float (&x)[E], int lane, int block,
                                                  float inv_sqrt_b) {
    // (block: at most 32 E, a power of two; E a power of two)
#pragma unroll
    for (int h = 1; h < E; h <<= 1) {
        if (h >= block) break;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            if (e & h) continue;
            const float a = x[e], b = x[e + h];
            x[e] = a + b;
            x[e + h] = a - b;
        }
    }
    for (int h = E; h < block; h <<= 1) {
        const int m = h / E;  // the partner lane: lane ^ m
        const bool upper = (lane & m) != 0;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const float other = __shfl_xor_sync(0xffffffffu, x[e], m);
            x[e] = upper ? other - x[e] : x[e] + other;  // (a - b: a the lower index's)
        }
    }
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] *= inv_sqrt_b;
}

// float32(1 / sqrt(D)) for the head_dims a warp rotates whole (as numpy rounds the double)
template <int D>
__device__ __forceinline__ float fx_inv_sqrt() {
    return D == 64 ? 0.125f : D == 128 ? 0.0883883476483184405f : 0.0625f;
}
