// Split kernels (gqa_decode_split.cu), part 5: the tensor-core kernels' ending: the warps of
// a block merged in a fixed order, then the block's partial to the workspace or its cluster.

#define FX_OPAD 34  // floats per row of the merge area (32 lanes + 2: no bank conflicts)

// The largest of the W warps' maxima for head j.
template <int W>
__device__ __forceinline__ float mb_of(const float (*m_s)[8], int j) {
    float mb = -INFINITY;
#pragma unroll
    for (int w = 0; w < W; ++w) mb = fmaxf(mb, m_s[w][j]);
    return mb;
}

// This warp's running max and sum of head g (lane = 4g + tig; the sum is split over the
// four lanes of a row) into m_s/l_s[warp][g].
__device__ __forceinline__ void fx_park_warp_stats(float m_run, float l_run, float (*m_s)[8],
                                                   float (*l_s)[8]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
    if ((lane & 3) == 0) {
        m_s[warp][lane >> 2] = m_run;
        l_s[warp][lane >> 2] = l_run;
    }
}

// This warp's O accumulators o[a][b][c] into the merge area in fragment order:
// [warp][slot][lane] with slot = (a * B + b) * 2 + c and rows of FX_OPAD floats.
template <int A, int B>
__device__ __forceinline__ void fx_park_fragments(float* o_f, const float (&o)[A][B][2],
                                                  int warp, int lane) {
#pragma unroll
    for (int a = 0; a < A; ++a)
#pragma unroll
        for (int b = 0; b < B; ++b)
#pragma unroll
            for (int c = 0; c < 2; ++c)
                o_f[(warp * (A * B * 2) + a * (B * 2) + b * 2 + c) * FX_OPAD + lane] = o[a][b][c];
}

// Each warp's weight in its block's merge: w_s[w][j] = 2^(m_w - max over warps) for head j,
// 0 for a warp that saw no tokens (m_w = -inf; its accumulators and sum are zeros), once
// per (warp, head) rather than per output column. Call after the barrier that completes
// m_s and before the one that precedes fx_write_partial.
template <int WARPS>
__device__ __forceinline__ void fx_warp_weights(const float (*m_s)[8], float (*w_s)[8]) {
    if (threadIdx.x < WARPS * 8) {
        const int w = threadIdx.x / 8, j = threadIdx.x % 8;
        const float mw = m_s[w][j];
        w_s[w][j] = mw == -INFINITY ? 0.f : fx_exp2(mw - mb_of<WARPS>(m_s, j));
    }
}

// The block's partial for its chunk, the warps merged in a fixed order (bitwise
// reproducible): o_f holds each warp's unscaled O in fragment order ([warp][slot][lane],
// rows of FX_OPAD floats), m_s/l_s each warp's max and sum per head, w_s its weight
// (fx_warp_weights); where(d, slot, tig) says which slot of lane 4 * head + tig holds
// column d. put_o(j, d, x) stores head j's output d, put_ml(j, max, sum) its max and sum
// (into the workspace, or pushed to the cluster's blocks for their merge).
//
// Thread t takes column d = t % D (and d + THREADS, ... where D > THREADS) of heads
// j = t / D, + HS, + 2 HS, ... (HS = THREADS / D heads side by side, at least 1), so the
// index arithmetic is done once, and it issues every read before its first store: a store
// is a compiler barrier for the reads after it (the cluster's pushes are asm volatile),
// and one column at a time, each waiting for its reads and a chain of integer divisions,
// cost ~140 cycles per column (1.3 us for the 2048 columns of 8/1/256: docs/design.md).
template <int WARPS, int D, int SLOTS, class Where, class PutO, class PutMl>
__device__ __forceinline__ void fx_write_partial(const float* o_f, const float (*m_s)[8],
                                                 const float (*l_s)[8], const float (*w_s)[8],
                                                 int group, Where where, PutO put_o,
                                                 PutMl put_ml) {
    if (threadIdx.x < group) {
        const int j = threadIdx.x;
        float lb = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) lb += l_s[w][j] * w_s[w][j];
        put_ml(j, mb_of<WARPS>(m_s, j), lb);
    }
    constexpr int THREADS = WARPS * 32;
    static_assert(THREADS % D == 0 || D % THREADS == 0, "columns must tile the threads");
    constexpr int HS = THREADS >= D ? THREADS / D : 1;  // heads side by side
    constexpr int DC = THREADS >= D ? 1 : D / THREADS;  // columns of a head per thread
    constexpr int R = (8 + HS - 1) / HS;                // heads per thread (of 8)
    const int t = threadIdx.x;
    const int j0 = THREADS >= D ? t / D : 0, d0 = t % D;
    int at[DC];  // where column d0 + c * THREADS lies in a warp's area, less the head
#pragma unroll
    for (int c = 0; c < DC; ++c) {
        int slot, tig;
        where(d0 + c * THREADS, slot, tig);
        at[c] = slot * FX_OPAD + tig;
    }
    float o[R][DC][WARPS], wt[R][WARPS];  // rows past the group: neither read nor written
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int j = j0 + r * HS;  // the same in a whole warp (D >= 64)
        if (j >= group) break;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            wt[r][w] = w_s[w][j];
#pragma unroll
            for (int c = 0; c < DC; ++c) o[r][c][w] = o_f[w * SLOTS * FX_OPAD + at[c] + j * 4];
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int j = j0 + r * HS;
        if (j >= group) break;
#pragma unroll
        for (int c = 0; c < DC; ++c) {
            float acc = 0.f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) acc += o[r][c][w] * wt[r][w];
            put_o(j, d0 + c * THREADS, acc);
        }
    }
}

// The block's result, after the warps have parked their fragments in the merge area o_f
// (the first floats of the ring, RING bytes): without CLUSTER its partial goes to the
// workspace for the combine kernel; with CLUSTER each value is pushed to the receive area
// (past the ring) of the block whose output unit it feeds, and the cluster's merge writes
// the output.
template <bool CLUSTER, int WARPS, int D, int SLOTS, int RING, int DR, int F = 0, int PAIR = 1, class T,
          class Where>
__device__ __forceinline__ void fx_finish(float* o_f, const float (*m_s)[8],
                                          const float (*l_s)[8], const float (*w_s)[8],
                                          float* ws_o, float* ws_ml,
                                          T* out, int h0, int group, int splits, int split,
                                          int seq_len, const int* seq_len_dev, Where where,
                                          const FxFeat* feat = nullptr, int a_heads = 0) {
    static_assert(PAIR == 1 || !CLUSTER, "paired KV heads merge through the combine kernel");
    if (!CLUSTER) {
        constexpr int DRH = DR / PAIR;  // a head's columns in the workspace
        fx_write_partial<WARPS, D, SLOTS>(
            o_f, m_s, l_s, w_s, group, where,
            [&](int j, int d, float x) {  // (columns past the cache's DR are padding)
                // paired: the first a_heads heads own columns 0 .. DRH, the others DRH .. DR
                const int lo = PAIR == 1 || j < a_heads ? 0 : DRH;
                if ((PAIR == 1 && (DR == D || d < DR)) || (PAIR == 2 && d >= lo && d < lo + DRH))
                    ws_o[((long long)(h0 + j) * splits + split) * DRH + (d - lo)] = x;
            },
            [&](int j, float m, float l) {
                float* ml = ws_ml + ((long long)(h0 + j) * splits + split) * 2;
                ml[0] = m;
                ml[1] = l;
            });
        return;
    }
    static_assert(RING % 16 == 0 && D % 4 == 0, "the receive area must be 16-byte aligned");
    float* recv = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(o_f) + RING);
    const unsigned recv_at = (unsigned)__cvta_generic_to_shared(recv);
    const unsigned blocks = fx_cluster_blocks(), rank = fx_cluster_rank();
    const int slots = (group * DR / 4 + (int)blocks - 1) / (int)blocks;
    fx_cluster_wait();  // every block of the cluster has started: its shared memory exists
    fx_write_partial<WARPS, D, SLOTS>(
        o_f, m_s, l_s, w_s, group, where,
        [&](int j, int d, float x) {  // unit u: to block u % blocks, [rank][u / blocks]
            if (DR != D && d >= DR) return;  // a padding column
            const unsigned u = (unsigned)(j * DR + d) >> 2;  // unsigned: a shorter division
            const unsigned at = FX_MAX_CLUSTER * 16 + (rank * slots + u / blocks) * 4 + (d & 3);
            fx_cluster_store(recv_at + at * 4, u % blocks, x);
        },
        [&](int j, float m, float l) {  // every block needs every head's max and sum
            const int at = ((int)rank * 8 + j) * 2;
            for (unsigned c = 0; c < blocks; ++c) {
                fx_cluster_store(recv_at + at * 4, c, m);
                fx_cluster_store(recv_at + (at + 1) * 4, c, l);
            }
        });
    fx_cluster_merge<T, DR, WARPS * 32, F>(recv, out, h0, group, fx_seq_len(seq_len, seq_len_dev),
                                           feat);
}

// The tensor-core kernels' ending, once the warp's loop is done: the warps merged in a
// fixed order (bitwise reproducible), then fx_finish. Each warp parks its running max and
// sum per head (park_stats(m_s, l_s): m_s/l_s[warp][head]), and, once every warp is past its
// loop (the rings are free), its unscaled O accumulators in the ring in fragment order
// (park_o(o_f)): [warp][slot][lane] with rows of FX_OPAD floats, SLOTS accumulators per
// lane. The writes are whole rows, and fx_write_partial's column-ordered reads hit 32
// different banks. (Serial warp-by-warp rounds over a row-major o_s cost 4 us, with 16-way
// bank conflicts: docs/design.md.) `where` maps an output column to its fragment slot and lane.
template <bool CLUSTER, int WARPS, int D, int SLOTS, int RING, int DR, int F = 0, int PAIR = 1, class T,
          class ParkStats, class ParkO, class Where>
__device__ __forceinline__ void fx_merge_parked(unsigned char* smem, ParkStats park_stats,
                                                ParkO park_o, float* ws_o, float* ws_ml, T* out,
                                                int h0, int group, int splits, int split,
                                                int seq_len, const int* seq_len_dev,
                                                Where where, const FxFeat* feat = nullptr, int a_heads = 0) {
    static_assert(WARPS * SLOTS * FX_OPAD * 4 <= RING, "the merge area must fit in the ring");
    __shared__ float m_s[WARPS][8];
    __shared__ float l_s[WARPS][8];
    __shared__ float w_s[WARPS][8];
    park_stats(m_s, l_s);
    float* o_f = reinterpret_cast<float*>(smem);
    __syncthreads();  // every warp is past its loop: the rings are free; m_s complete
    fx_let_combine_start<1>();
    fx_warp_weights<WARPS>(m_s, w_s);
    park_o(o_f);
    __syncthreads();
    fx_finish<CLUSTER, WARPS, D, SLOTS, RING, DR, F, PAIR>(o_f, m_s, l_s, w_s, ws_o, ws_ml, out, h0,
                                                     group, splits, split, seq_len, seq_len_dev,
                                                     where, feat, a_heads);
}

// fx_merge_parked for the kernels whose rows are heads: lane 4g + tig holds head g's running
// max and a quarter of its sum, and O accumulators oacc[A][B][2] (fx_park_fragments).
template <bool CLUSTER, int WARPS, int D, int RING, int DR, int F = 0, int PAIR = 1, class T, int A, int B,
          class Where>
__device__ __forceinline__ void fx_merge_warps(unsigned char* smem, float m_run, float l_run,
                                               const float (&oacc)[A][B][2], float* ws_o,
                                               float* ws_ml, T* out, int h0, int group,
                                               int splits, int split, int seq_len,
                                               const int* seq_len_dev, Where where,
                                               const FxFeat* feat = nullptr, int a_heads = 0) {
    auto park_stats = [&](float (*m_s)[8], float (*l_s)[8]) {
        fx_park_warp_stats(m_run, l_run, m_s, l_s);
    };
    auto park_o = [&](float* o_f) {
        fx_park_fragments(o_f, oacc, threadIdx.x >> 5, threadIdx.x & 31);
    };
    fx_merge_parked<CLUSTER, WARPS, D, A * B * 2, RING, DR, F, PAIR>(
        smem, park_stats, park_o, ws_o, ws_ml, out, h0, group, splits, split, seq_len,
        seq_len_dev, where, feat, a_heads);
}
