// Split kernels (gqa_decode_split.cu), part 1: what every split kernel and the combine
// share: chunk bounds from the length (which may live on the device), the combine's early
// launch, exp2.

#ifndef FX_THREADS  // (overridable with -D for experiments, as the rings in split_mma.cuh)
#define FX_THREADS 128
#endif
#define FX_WARPS (FX_THREADS / 32)
#define FX_TILE 64  // the largest chunk granularity (tokens): a block's tokens per iteration
#define FX_MAX_SPLITS 1024
#define FX_LOG2E 1.4426950408889634f

__device__ __forceinline__ int fx_seq_len(int seq_len, const int* seq_len_dev) {
    return seq_len_dev != nullptr ? *seq_len_dev : seq_len;
}

// Tokens per chunk for this length: a multiple of `tile`, at most `splits` chunks. (`tile`
// is 8 to FX_TILE tokens, chosen by the host: short chunks cut the serial trips to memory
// of short sequences.)
__device__ __forceinline__ int fx_chunk(int seq, int splits, int tile) {
    int c = (seq + splits - 1) / splits;
    return (c + tile - 1) / tile * tile;
}

// Tokens [start, end) of chunk `split` at the current length; false when it has none
// (the blocks past the end of a graph sized for the capacity leave at once).
__device__ __forceinline__ bool fx_chunk_bounds(int seq_len, const int* seq_len_dev,
                                                int splits, int tile, int split, int& start,
                                                int& end) {
    const int seq = fx_seq_len(seq_len, seq_len_dev);
    const int chunk = fx_chunk(seq, splits, tile);
    start = split * chunk;
    end = min(seq, start + chunk);
    return seq > 0 && start < seq;
}

// Programmatic dependent launch (compute capability 9.0 and up): the combine kernel is
// launched with the programmatic-serialization attribute, so it may start once every split
// block has called fx_let_combine_start (or left), and it waits in fx_wait_for_split,
// before its first read of the workspace, until the split kernel has finished and its
// writes are visible. Without the attribute both are no-ops. FX_PDL_TRIGGER: where the
// split kernels let it start (0: at their end, 1: once all their warps are past their main
// loops, 2: at entry; a block counts from its first thread's call).
#ifndef FX_PDL_TRIGGER
#define FX_PDL_TRIGGER 1
#endif
template <int WHERE>
__device__ __forceinline__ void fx_let_combine_start() {
#if __CUDA_ARCH__ >= 900
    if (WHERE == FX_PDL_TRIGGER) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void fx_wait_for_split() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ float fx_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
