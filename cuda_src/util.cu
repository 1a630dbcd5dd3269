// Small utility kernels: the minimal compile-and-launch example and test helpers.

// y[i] = a * x[i] + y[i] for i < n.
extern "C" __global__ void ferrox_axpy_f32(float a, const float* x, float* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (; i < n; i += stride) y[i] = a * x[i] + y[i];
}
