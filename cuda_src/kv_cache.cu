// KV cache maintenance on the device. The cache state is two int32s in device memory:
// state[0] = seq_len (tokens in the cache), state[1] = overflow flag. Kernels read the
// sequence length from there, so a captured CUDA graph stays valid for every token.

// Append one token: copy a staged K row and V row (row_bytes each) to position state[0]
// of the caches and bump it. When the cache is full nothing is written: the overflow flag
// is set for the host to report. Launch ONE block (the bump must follow every copy).
extern "C" __global__ void kv_append_row(
    const uint4* __restrict__ k_row, const uint4* __restrict__ v_row,
    char* __restrict__ k_cache, char* __restrict__ v_cache, int* __restrict__ state,
    long long row_bytes, int capacity) {
    const int seq = state[0];
    __syncthreads();  // every thread has read seq before thread 0 may bump it
    if (seq < 0 || seq >= capacity) {
        if (threadIdx.x == 0) state[1] = 1;
        return;
    }
    // row_bytes is a multiple of 16 for fp32 rows with head_dim*n_kv % 4 == 0; the tail
    // loop covers every other size byte by byte.
    const long long n16 = row_bytes / 16;
    uint4* k_dst = reinterpret_cast<uint4*>(k_cache + (long long)seq * row_bytes);
    uint4* v_dst = reinterpret_cast<uint4*>(v_cache + (long long)seq * row_bytes);
    const bool aligned = (row_bytes % 16) == 0;
    if (aligned) {
        for (long long i = threadIdx.x; i < n16; i += blockDim.x) {
            k_dst[i] = k_row[i];
            v_dst[i] = v_row[i];
        }
    } else {
        const char* ks = reinterpret_cast<const char*>(k_row);
        const char* vs = reinterpret_cast<const char*>(v_row);
        char* kd = k_cache + (long long)seq * row_bytes;
        char* vd = v_cache + (long long)seq * row_bytes;
        for (long long i = threadIdx.x; i < row_bytes; i += blockDim.x) {
            kd[i] = ks[i];
            vd[i] = vs[i];
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) state[0] = seq + 1;
}

// One sequence sharded over `world` ranks: token g belongs to rank (g / block) % world, at
// slot (g / (block * world)) * block + g % block of that rank's cache. Every rank runs this
// for every token with the same rows; the owner stores them at its next slot. state[0] =
// the sequence's length (every rank counts every token), state[1] = this rank's tokens,
// state[2] = overflow flag (the sequence at `capacity`: nothing written or counted). Rows
// as kv_append_row. Launch ONE block.
extern "C" __global__ void kv_append_shard(
    const char* __restrict__ k_row, const char* __restrict__ v_row, char* __restrict__ k_cache,
    char* __restrict__ v_cache, int* __restrict__ state, long long row_bytes, int capacity,
    int rank, int world, int block) {
    const int g = state[0], local = state[1];
    __syncthreads();  // every thread has read the state before thread 0 may bump it
    if (g < 0 || g >= capacity) {
        if (threadIdx.x == 0) state[2] = 1;
        return;
    }
    const bool mine = (g / block) % world == rank;
    if (mine) {
        char* kd = k_cache + (long long)local * row_bytes;
        char* vd = v_cache + (long long)local * row_bytes;
        if (((unsigned long long)k_row | (unsigned long long)v_row | row_bytes) % 16 == 0) {
            const uint4* ks = reinterpret_cast<const uint4*>(k_row);
            const uint4* vs = reinterpret_cast<const uint4*>(v_row);
            for (long long i = threadIdx.x; i < row_bytes / 16; i += blockDim.x) {
                reinterpret_cast<uint4*>(kd)[i] = ks[i];
                reinterpret_cast<uint4*>(vd)[i] = vs[i];
            }
        } else {
            for (long long i = threadIdx.x; i < row_bytes; i += blockDim.x) {
                kd[i] = k_row[i];
                vd[i] = v_row[i];
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        state[0] = g + 1;
        if (mine) state[1] = local + 1;
    }
}

// Append n_rows tokens at the device's length (fxt.kv_append's rows of several tokens, a
// prefill's): rows [state[0], state[0] + n_rows) of the caches from k_rows, v_rows
// (row_bytes each, contiguous). Any grid: the length is only read here, and bumped by
// kv_bump launched after it on the same stream. A sequence that would pass `capacity`
// writes nothing and sets the overflow flag state[1].
extern "C" __global__ void kv_append_rows(
    const char* __restrict__ k_rows, const char* __restrict__ v_rows, char* __restrict__ k_cache,
    char* __restrict__ v_cache, int* __restrict__ state, long long row_bytes, int n_rows,
    int capacity) {
    const int seq = state[0];
    if (seq < 0 || seq > capacity - n_rows) {
        if (blockIdx.x == 0 && threadIdx.x == 0) state[1] = 1;
        return;
    }
    const long long n = row_bytes * n_rows, at = (long long)seq * row_bytes;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (((unsigned long long)k_rows | (unsigned long long)v_rows | at | n) % 16 == 0) {
        const uint4* ks = reinterpret_cast<const uint4*>(k_rows);
        const uint4* vs = reinterpret_cast<const uint4*>(v_rows);
        uint4* kd = reinterpret_cast<uint4*>(k_cache + at);
        uint4* vd = reinterpret_cast<uint4*>(v_cache + at);
        for (long long i = first; i < n / 16; i += stride) {
            kd[i] = ks[i];
            vd[i] = vs[i];
        }
    } else {
        for (long long i = first; i < n; i += stride) {
            k_cache[at + i] = k_rows[i];
            v_cache[at + i] = v_rows[i];
        }
    }
}

// The length after kv_append_rows (or the quantizing append of several rows): state[0] +=
// n_rows where they fitted. Launch one thread.
extern "C" __global__ void kv_bump(int* __restrict__ state, int n_rows, int capacity) {
    const int seq = state[0];
    if (seq >= 0 && seq <= capacity - n_rows) state[0] = seq + n_rows;
}

// Roll the length back to *n (a speculative verify's accepted count, known only on the
// device): state[0] = *n where 0 <= *n <= state[0]; a longer *n keeps every token (as x[:n]
// would); a negative one changes nothing and sets state[1] = 2 (the host reports it).
// Nothing is copied or cleared: the next append writes token *n. Launch one thread.
extern "C" __global__ void kv_truncate(int* __restrict__ state, const int* __restrict__ n) {
    const int want = *n;
    if (want < 0) {
        state[1] = 2;
        return;
    }
    if (want < state[0]) state[0] = want;
}
