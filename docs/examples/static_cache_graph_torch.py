"""A static head-major cache decoded in place inside a PyTorch CUDA graph: each replay
writes the new token's row at a device position (as transformers' StaticCache does), then
ferrox decodes the pair's first seq_len tokens, seq_len an int32 on the device, so the one
graph serves every length. Against PyTorch's SDPA on the same tokens. Needs a GPU and
PyTorch. Exits non-zero when a check fails.
"""

import sys

import torch

import ferrox_driver as fd

n_heads, n_kv_heads, head_dim, capacity = 32, 8, 128, 4096
bf16 = dict(device="cuda", dtype=torch.bfloat16)
k_cache = torch.zeros(1, n_kv_heads, capacity, head_dim, **bf16)  # a StaticCache layer's
v_cache = torch.zeros(1, n_kv_heads, capacity, head_dim, **bf16)
q = torch.empty(n_heads, head_dim, **bf16)  # the step's inputs, filled before each replay
k_row = torch.empty(1, n_kv_heads, 1, head_dim, **bf16)
v_row = torch.empty(1, n_kv_heads, 1, head_dim, **bf16)
pos = torch.zeros(1, dtype=torch.long, device="cuda")  # where the new token goes
seq_len = torch.zeros(1, dtype=torch.int32, device="cuda")  # the tokens ferrox reads
out = torch.empty(n_heads, head_dim, **bf16)


def step():
    k_cache.index_copy_(2, pos, k_row)
    v_cache.index_copy_(2, pos, v_row)
    seq_len.copy_(pos + 1)
    fd.gqa_decode_async(
        q, (k_cache, v_cache), out, n_heads=n_heads, seq_len=seq_len, kv_layout="HND",
        stream=torch.cuda.current_stream().cuda_stream,
    )  # fmt: skip


side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    step()  # once eagerly, on the capture stream: ferrox makes its launches here
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph, stream=side):
    step()

worst = 0.0
for t in range(300):
    for x in (q, k_row, v_row):
        x.normal_()
    pos.fill_(t)
    graph.replay()
    if t in (0, 1, 150, 299):
        n = t + 1
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.view(1, n_heads, 1, head_dim).float(), k_cache[:, :, :n].float(),
            v_cache[:, :, :n].float(), enable_gqa=True,
        ).view(n_heads, head_dim)  # fmt: skip
        worst = max(worst, ((out.float() - ref).norm() / ref.norm()).item())
print(f"300 tokens, one graph, the cache read in place: worst relative error {worst:.1e}")
sys.exit(0 if worst < 1e-2 else 1)
