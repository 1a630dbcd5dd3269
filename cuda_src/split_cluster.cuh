// Split kernels (gqa_decode_split.cu), part 3: thread block clusters, in which the blocks of
// a KV head merge their chunks on chip (the tensor-core kernels' "_cluster" entry points).

// ---- Thread block clusters (compute capability 9.0 and up): the blocks of one KV head's
// chunks form one cluster and merge their partials through distributed shared memory, so
// no combine kernel runs and no partial goes through global memory. Elsewhere the cluster
// kernels trap (the host never picks them there).
// (FX_MAX_CLUSTER, the largest cluster: split_traits.h)
// A cluster block's receive area, in dynamic shared memory past its ring: the partials the
// cluster's blocks push to it, [FX_MAX_CLUSTER][8][2] maxima and sums, then [blocks][slots]
// float4 outputs (slots * blocks <= 8 * D / 4 + FX_MAX_CLUSTER). The host adds its size
// (attention.cluster_recv_bytes) to the launch's dynamic shared memory.
#define FX_RECV_FLOATS(D) (FX_MAX_CLUSTER * 16 + (2 * (D) + FX_MAX_CLUSTER) * 4)

__device__ __forceinline__ unsigned fx_cluster_rank() {
    unsigned r = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}
__device__ __forceinline__ unsigned fx_cluster_blocks() {
    unsigned n = 1;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
    return n;
}
// Cluster barrier halves (every thread of every block arrives, then waits; a thread waits
// once per arrival). Relaxed arrival: no memory ordering, only "this block has started".
__device__ __forceinline__ void fx_cluster_arrive_relaxed() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
    __trap();
#endif
}
// Release arrival: this thread's earlier writes (to any block's shared memory) are visible
// to every thread of the cluster once the wait below returns there.
__device__ __forceinline__ void fx_cluster_arrive_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void fx_cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// Store x at shared-memory address `addr` (this block's layout) of cluster block `rank`.
__device__ __forceinline__ void fx_cluster_store(unsigned addr, unsigned rank, float x) {
#if __CUDA_ARCH__ >= 900
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(x) : "memory");
#endif
}

// Trap unless the launch made the `splits` blocks of a KV head one cluster (a launch
// without clusters would write each chunk's partial as the output).
__device__ __forceinline__ void fx_check_cluster(int splits) {
    if (fx_cluster_blocks() != (unsigned)splits || gridDim.x != (unsigned)splits) __trap();
}

// The cluster's merge, once every block has pushed its partial into the receive areas
// (`recv`, this block's): out = sum_c w_c o_c / sum_c w_c l_c over the cluster's blocks c
// in order (bitwise reproducible), w_c = 2^(m_c - max m); seq <= 0 writes zeros. Output
// unit u (head u / (D/4), columns 4(u % (D/4))..+3) belongs to block u % blocks, in its
// slot u / blocks; a thread takes one of this block's units and reads only local shared
// memory. The pushes (remote stores, no round trip) and one barrier replace reads of the
// other blocks' shared memory, a round trip, and the second barrier those needed to keep
// every block alive while read (docs/design.md).
template <class T, int D, int THREADS, int F = 0>
__device__ __forceinline__ void fx_cluster_merge(const float* recv, T* __restrict__ out, int h0,
                                                 int group, int seq,
                                                 const FxFeat* feat = nullptr) {
    fx_cluster_arrive_release();
    fx_cluster_wait();  // every block's pushes have landed
    const unsigned blocks = fx_cluster_blocks(), rank = fx_cluster_rank();
    const int units = group * D / 4, slots = (units + (int)blocks - 1) / (int)blocks;
    const float4* o4 = reinterpret_cast<const float4*>(recv + FX_MAX_CLUSTER * 16);
    for (int sl = threadIdx.x; sl < slots; sl += THREADS) {
        const int u = sl * (int)blocks + (int)rank;
        if (u >= units) break;
        const int j = u / (D / 4), d = (u % (D / 4)) * 4;
        float m[FX_MAX_CLUSTER], l[FX_MAX_CLUSTER];
        float4 o[FX_MAX_CLUSTER];
#pragma unroll
        for (int c = 0; c < FX_MAX_CLUSTER; ++c) {
            m[c] = -INFINITY;
            l[c] = 0.f;
            o[c] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (c < (int)blocks) {
                m[c] = recv[(c * 8 + j) * 2];
                l[c] = recv[(c * 8 + j) * 2 + 1];
                o[c] = o4[c * slots + sl];
            }
        }
        float mx = -INFINITY;
#pragma unroll
        for (int c = 0; c < FX_MAX_CLUSTER; ++c) mx = fmaxf(mx, m[c]);
        // with sinks, head j's sink logit (base 2) joins the maximum and the denominator
        const float sink2 = (F & FX_F_SINKS) ? feat->sinks[h0 + j] * FX_LOG2E : -INFINITY;
        if (F & FX_F_SINKS) mx = fmaxf(mx, sink2);
        float lsum = 0.f;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int c = 0; c < FX_MAX_CLUSTER; ++c) {
            const float w = m[c] == -INFINITY ? 0.f : fx_exp2(m[c] - mx);
            lsum += w * l[c];
            acc.x += w * o[c].x;
            acc.y += w * o[c].y;
            acc.z += w * o[c].z;
            acc.w += w * o[c].w;
        }
        if (F & FX_F_SINKS) lsum += sink2 == -INFINITY ? 0.f : fx_exp2(sink2 - mx);
        if ((F & FX_F_LSE) && d == 0)  // one unit per head writes its LSE (natural log)
            feat->lse[h0 + j] = seq > 0 ? (mx + log2f(lsum)) * 0.69314718055994531f
                                        : ((F & FX_F_SINKS) ? feat->sinks[h0 + j] : -INFINITY);
        const float inv = seq > 0 ? 1.f / lsum : 0.f;
        T* dst = out + (long long)(h0 + j) * D + d;
        dst[0] = fx_from_float<T>(acc.x * inv);
        dst[1] = fx_from_float<T>(acc.y * inv);
        dst[2] = fx_from_float<T>(acc.z * inv);
        dst[3] = fx_from_float<T>(acc.w * inv);
    }
}
