"""kv_append_async + gqa_decode_async inside a PyTorch CUDA graph.

The ops read the sequence length on the device, so the graph captured once stays valid as
the cache grows. Needs a GPU and PyTorch. Exits non-zero when a check fails.
"""

import sys

import numpy as np
import torch

import ferrox_driver as fd

n_heads, n_kv_heads, head_dim, steps = 32, 8, 128, 50
rng = np.random.default_rng()
qs = rng.standard_normal((steps, n_heads * head_dim)).astype(np.float32)
ks = rng.standard_normal((steps, n_kv_heads * head_dim)).astype(np.float32)
vs = rng.standard_normal((steps, n_kv_heads * head_dim)).astype(np.float32)

kv = fd.KVCache(n_kv_heads, head_dim, capacity=steps)
kv.prepare(n_heads)  # load kernels and allocate scratch before capturing
q_t = torch.zeros(n_heads * head_dim, device="cuda")
k_t = torch.zeros(n_kv_heads * head_dim, device="cuda")
v_t = torch.zeros(n_kv_heads * head_dim, device="cuda")
out_t = torch.zeros(n_heads * head_dim, device="cuda")

graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    stream = torch.cuda.current_stream().cuda_stream
    fd.kv_append_async(kv, k_t, v_t, stream=stream)
    fd.gqa_decode_async(q_t, kv, out_t, n_heads=n_heads, stream=stream)

worst = 0.0
for t in range(steps):
    q_t.copy_(torch.from_numpy(qs[t]))
    k_t.copy_(torch.from_numpy(ks[t]))
    v_t.copy_(torch.from_numpy(vs[t]))
    graph.replay()
    ref = fd.reference_gqa_decode(
        qs[t],
        ks[: t + 1].reshape(-1),
        vs[: t + 1].reshape(-1),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
    )
    got = out_t.cpu().numpy()
    worst = max(worst, float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))
print(f"{steps} replays of one captured graph; cache now holds {kv.seq_len} tokens")
print(f"worst relative error against the reference: {worst:.2e}")
kv.close()
if not worst < 1e-5:
    sys.exit("decode inside the torch graph does not match the reference")
