// GQA decode at memory speed: split-KV ("flash-decoding") kernels.
//
// The sequence is cut into `splits` chunks so the grid fills the GPU. A block handles one
// chunk of one KV head and ALL the query heads of its group, so K and V are read once per
// group. Each block writes an unnormalised partial output with its running max and sum;
// gqa_split_combine merges the chunks with log-sum-exp rescaling.
//
// The chunk size is computed on the device from the sequence length (which may live in
// device memory), so a launch captured in a CUDA graph adapts to every length: blocks past
// the end leave at once.
//
// Scores are kept in the base-2 domain (q pre-multiplied by log2(e)/sqrt(head_dim)), so
// every exponential is one exp2.
//
// Workspace: ws_o [n_heads][splits][head_dim] f32, ws_ml [n_heads][splits][2] f32 (m, l).
// Layout: q [n_heads][head_dim]; k/v [token][n_kv_heads][head_dim]; out like q.
//
// The file is one translation unit in parts: compiler.kernel_source puts each part in place
// of its #include (each part uses what the ones before it define).

#include "split_traits.h"
#include "split_common.cuh"
#include "split_generic.cuh"
#include "split_cluster.cuh"
#include "split_ring.cuh"
#include "split_merge.cuh"
#include "split_mma.cuh"
#include "hadamard.cuh"
#include "split_mma_swapped.cuh"
#include "split_tc32.cuh"
#include "split_combine.cuh"
#include "split_verify.cuh"
#include "split_rows.cuh"
#include "split_latent.cuh"
#include "split_latent_wg.cuh"
