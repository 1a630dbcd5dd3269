// Split kernels (gqa_decode_split.cu), part 4: the tensor-core kernels' start (launch checks,
// the block's chunk) and loads (16-byte reads, each warp's cp.async ring of K/V steps).

__device__ __forceinline__ uint4 fx_ldg16(const void* p, bool ok) {
    return ok ? __ldg(reinterpret_cast<const uint4*>(p)) : make_uint4(0u, 0u, 0u, 0u);
}

// 16 bytes global -> shared without registers; ok == false writes zeros and reads nothing.
__device__ __forceinline__ void fx_cp_async16(void* dst, const void* src, bool ok) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src),
                 "r"(ok ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void fx_cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void fx_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// The tensor-core kernels' shared pieces. Element type T (2 or 4 bytes), TOK tokens per
// step, S steps in each warp's ring.
//
// Queue step j of a warp: K and V rows t0..t0+TOK into stage j % S of its ring, 16 bytes per
// cp.async, rows XOR-swizzled in 16-byte units (K chunk c of row r at c ^ ((r & 1) << 2), V
// at c ^ (r & 6)); rows past `end` are zeros. One commit group per step, even an empty one,
// so the waits count steps. The cache's rows have DR <= D elements (a multiple of EPC): the
// ring's columns past DR are zeros, never read from memory (a head_dim padded to the
// kernel's D).
// fp8 rings (1-byte T: 16 elements per chunk; an 8-byte read is half a chunk) swizzle for
// their own reads (gqa_split_mma_swapped): K chunk c of row r at c ^ 2(r & 3) (D >= 128; a
// warp's 8 rows of 32 bytes in two wavefronts), ^ 2((r >> 1) & 1) for D = 64; V at
// c ^ 4((r >> 1) & 1) (D >= 128; rows 2t, 2t + 8 apart in the banks), as it is for D = 64.
template <class T, int D>
__device__ __forceinline__ int fx_swz_k(int r) {
    return sizeof(T) > 1 ? (r & 1) << 2 : D >= 128 ? (r & 3) << 1 : ((r >> 1) & 1) << 1;
}
template <class T, int D>
__device__ __forceinline__ int fx_swz_v(int r) {
    return sizeof(T) > 1 ? r & 6 : D >= 128 ? ((r >> 1) & 1) << 2 : 0;
}
// 8 bytes global -> shared (fp8 rings whose rows are not whole 16-byte chunks).
__device__ __forceinline__ void fx_cp_async8(void* dst, const void* src, bool ok) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(d), "l"(src),
                 "r"(ok ? 8 : 0)
                 : "memory");
}
// 4, 8 or 16 bytes global -> shared (a 4-bit step's scales); ok == false writes zeros
template <int N>
__device__ __forceinline__ void fx_cp_async_small(void* dst, const void* src, bool ok) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(d), "l"(src), "n"(N),
                 "r"(ok ? N : 0)
                 : "memory");
}

template <class T, int D, int TOK, int S, int DR = D>
__device__ __forceinline__ void fx_issue_step(T* ring, int j, int t0, int start, int end,
                                              int lane, const T* kg, const T* vg,
                                              long long row) {
    // 16-byte chunks; an fp8 ring of rows of 8-byte multiples copies 8-byte halves, each
    // where the 16-byte chunk's swizzle puts it (unit u of row r at u ^ 2 swz(r))
    constexpr int CB = sizeof(T) == 1 && DR % 16 ? 8 : 16;
    constexpr int EPC = CB / (int)sizeof(T);  // elements per chunk
    constexpr int NCH = D / EPC, STEP = TOK * D, SW = 16 / CB;
    static_assert(DR <= D && DR % EPC == 0, "rows of whole chunks, at most D");
    if (t0 < end) {
        T* ks = ring + (j % S) * 2 * STEP;
        T* vs = ks + STEP;
#pragma unroll
        for (int i = 0; i < TOK * NCH / 32; ++i) {
            const int idx = i * 32 + lane, r = idx / NCH, c = idx % NCH;
            const bool col = DR == D || c < DR / EPC;  // a column the cache has
            const bool ok = t0 + r < end && col;
            const long long off = (long long)(t0 + r < end ? t0 + r : start) * row +
                                  (col ? c : 0) * EPC;
            if constexpr (CB == 16) {
                fx_cp_async16(ks + r * D + ((c ^ fx_swz_k<T, D>(r)) * EPC), kg + off, ok);
                fx_cp_async16(vs + r * D + ((c ^ fx_swz_v<T, D>(r)) * EPC), vg + off, ok);
            } else {
                fx_cp_async8(ks + r * D + ((c ^ (SW * fx_swz_k<T, D>(r))) * EPC), kg + off, ok);
                fx_cp_async8(vs + r * D + ((c ^ (SW * fx_swz_v<T, D>(r))) * EPC), vg + off, ok);
            }
        }
    }
    fx_cp_async_commit();
}

// One warp's K/V ring in the block's dynamic shared memory (fx_issue_step): S stages of
// [K, V][TOK][D], the block's WARPS warps taking turns, so this warp's step j holds tokens
// t0(j) .. t0(j) + TOK of the block's [start, end). fx_warp_ring queues the first S - 1.
template <class T, int D, int TOK, int S, int WARPS, int DR = D>
struct FxWarpRing {
    T* ring;
    const T* kg;  // the block's KV head at token 0
    const T* vg;
    long long row;  // elements from one token to the next
    int start, end, warp, lane;
    __device__ __forceinline__ int t0(int j) const {
        return start + warp * TOK + j * (WARPS * TOK);
    }
    __device__ __forceinline__ void issue(int j) const {
        fx_issue_step<T, D, TOK, S, DR>(ring, j, t0(j), start, end, lane, kg, vg, row);
    }
    // step j's K rows (its V rows follow, TOK * D elements on)
    __device__ __forceinline__ const T* k_stage(int j) const {
        return ring + (j % S) * 2 * (TOK * D);
    }
};
// (F: the kernel's features; with FX_F_HND the rows are head-major, head_stride apart)
template <class T, int D, int TOK, int S, int WARPS, int DR = D, int F = 0>
__device__ __forceinline__ FxWarpRing<T, D, TOK, S, WARPS, DR> fx_warp_ring(
    unsigned char* smem, const T* k, const T* v, int g_kv, int n_kv_heads, long long head_stride,
    int start, int end, int warp, int lane) {
    const bool hnd = (F & FX_F_HND) != 0;
    const FxWarpRing<T, D, TOK, S, WARPS, DR> r{
        reinterpret_cast<T*>(smem) + warp * S * 2 * (TOK * D),
        hnd ? k + g_kv * head_stride : k + (long long)g_kv * DR,
        hnd ? v + g_kv * head_stride : v + (long long)g_kv * DR,
        hnd ? (long long)DR : (long long)n_kv_heads * DR, start, end, warp, lane};
#pragma unroll
    for (int j = 0; j < S - 1; ++j) r.issue(j);
    return r;
}

// Refuse (trap) a launch with less dynamic shared memory than `bytes` (the ring would be
// written past its end) or with other than `threads` threads (fewer warps would skip their
// tokens).
__device__ __forceinline__ void fx_check_launch(unsigned bytes, unsigned threads) {
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < bytes) __trap();
    if (blockDim.x != threads) __trap();
}

// The tensor-core kernels' start: check the launch (dynamic shared memory: the ring's
// `ring_bytes`, and with CLUSTER the receive area past it; threads; and with CLUSTER that
// the `splits` blocks of a KV head form one cluster), then
// this block's tokens [start, end) of its chunk `split`. False: the block has none and
// leaves. A cluster's blocks all stay (an idle one with end = start: no tokens) to take
// part in the merge, and arrive at the cluster barrier that fx_finish waits on before any
// block writes into another's shared memory (which must have started by then).
template <bool CLUSTER, int D, int F = 0>
__device__ __forceinline__ bool fx_block_chunk(unsigned ring_bytes, unsigned threads,
                                               int seq_len, const int* seq_len_dev, int splits,
                                               int tile, int split, int& start, int& end,
                                               int window = 0) {
    fx_check_launch(ring_bytes + (CLUSTER ? FX_RECV_FLOATS(D) * 4 : 0), threads);
    if (CLUSTER) {
        fx_check_cluster(splits);
        fx_cluster_arrive_relaxed();
    }
    if (fx_chunk_bounds<F>(seq_len, seq_len_dev, splits, tile, split, start, end, window))
        return true;
    if (!CLUSTER) return false;
    end = start;
    return true;
}

// Where a tensor-core block stands: its tokens [start, end) of chunk `split`, its KV head
// g_kv and its query heads h0 .. h0 + group (all of the KV head's, at most 8; with TILED,
// groups of 9-16 or a verify's rows, one tile of 8: tile_h its first, within the KV head's;
// with TILED = 2 or 4, that many adjacent tiles, up to 8 x TILED rows, read with one pass
// over K and V).
struct FxTcBlock {
    int split, start, end, heads_per_kv, g_kv, tile_h, group, h0;
};
// The first lines of every tensor-core body: let the combine kernel start early, check the
// launch (fx_block_chunk: `ring_bytes` of ring, `threads`) and place the block (`at`).
// False: the block has no tokens and leaves.
template <bool CLUSTER, int TILED, int D, int F>
__device__ __forceinline__ bool fx_tc_block(FxTcBlock& at, unsigned ring_bytes, unsigned threads,
                                            int n_heads, int n_kv_heads, int seq_len,
                                            const int* seq_len_dev, int splits, int tile,
                                            int window) {
    fx_let_combine_start<2>();
    fx_wait_for_split();  // (a verify's split kernel: for the tail's writes; else a no-op)
    at.split = blockIdx.x;
    if (!fx_block_chunk<CLUSTER, D, F>(ring_bytes, threads, seq_len, seq_len_dev, splits, tile,
                                       at.split, at.start, at.end, window))
        return false;
    // TILED (groups past 8: 9-16, or a verify's rows): blockIdx.y = tiles g_kv + tile, 8
    // query heads per tile (TILED = 2, 4: 8 x TILED per block, that many tiles)
    constexpr int ROWS = TILED >= 2 ? 8 * TILED : 8;
    at.heads_per_kv = n_heads / n_kv_heads;
    const int tiles = TILED ? (at.heads_per_kv + ROWS - 1) / ROWS : 1;
    at.g_kv = TILED ? (int)blockIdx.y / tiles : (int)blockIdx.y;
    at.tile_h = TILED ? (int)blockIdx.y % tiles * ROWS : 0;
    at.group = TILED ? min(ROWS, at.heads_per_kv - at.tile_h) : at.heads_per_kv;
    at.h0 = at.g_kv * at.heads_per_kv + at.tile_h;
    return true;
}
