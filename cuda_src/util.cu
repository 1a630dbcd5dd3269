// Small utility kernels: the minimal compile-and-launch example and test helpers.

// y[i] = a * x[i] + y[i] for i < n.
extern "C" __global__ void ferrox_axpy_f32(float a, const float* x, float* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) y[i] = a * x[i] + y[i];
}

// Deterministic pseudo-random fill, uniform in [-1, 1): benchmarks never time zeros, and
// filling gigabytes on the device is far quicker than generating them on the host.
__device__ __forceinline__ float ferrox_hash_uniform(unsigned long long i, unsigned seed) {
    unsigned long long x = i * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull;
    x ^= x >> 31; x *= 0xBF58476D1CE4E5B9ull; x ^= x >> 27; x *= 0x94D049BB133111EBull;
    x ^= x >> 33;
    return (float)(x >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

#define FERROX_FILL_ENTRY(NAME, T)                                                          \
    extern "C" __global__ void NAME(T* x, long long n, unsigned seed) {                     \
        long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;                     \
        long long stride = (long long)gridDim.x * blockDim.x;                               \
        for (; i < n; i += stride) x[i] = fx_from_float<T>(ferrox_hash_uniform(i, seed));   \
    }
FERROX_FILL_ENTRY(ferrox_fill_uniform_f32, float)
FERROX_FILL_ENTRY(ferrox_fill_uniform_f16, fx_half)
FERROX_FILL_ENTRY(ferrox_fill_uniform_bf16, fx_bf16)

// Read every byte once (16-byte loads) and add it up: measures the read ceiling.
extern "C" __global__ void ferrox_read_sum(const float4* x, long long n16, float* total) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    float acc = 0.f;
    for (; i < n16; i += stride) {
        const float4 v = __ldg(x + i);
        acc += (v.x + v.y) + (v.z + v.w);
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if ((threadIdx.x & 31) == 0) atomicAdd(total, acc);
}

// Does nothing: the launch-cost baseline of the benchmarks.
extern "C" __global__ void ferrox_noop() {}
