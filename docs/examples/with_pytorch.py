"""With PyTorch: bf16 tensors in and a tensor out with no copy, then a static cache that
PyTorch owns decoded in place inside a torch.cuda.graph, one graph for every length. Checked
against PyTorch's SDPA. Without PyTorch or a GPU it says so and exits 0; with them it exits
non-zero when a check fails.
"""

import sys

import ferrox_driver as fd

try:
    import torch
except ImportError:
    torch = None
if torch is None or not (fd.cuda_available() and torch.cuda.is_available()):
    print("this example needs PyTorch and a GPU: nothing to show here")
    sys.exit(0)

sdpa = torch.nn.functional.scaled_dot_product_attention
n_heads, n_kv_heads, head_dim, n = 32, 8, 128, 1000
bf16 = dict(device="cuda", dtype=torch.bfloat16)
stream = torch.cuda.current_stream()

# Tensors in, a tensor out: ferrox reads the tensors where they are, and its result is a
# DeviceArray that torch.from_dlpack takes without a copy (bf16 included).
q = torch.randn(n_heads, head_dim, **bf16)
k = torch.randn(n, n_kv_heads, head_dim, **bf16)  # token-major: (tokens, KV heads, head_dim)
v = torch.randn(n, n_kv_heads, head_dim, **bf16)
dev_out = fd.gqa_decode(q, k, v, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                        stream=stream)  # fmt: skip
out = torch.from_dlpack(dev_out)  # torch.bfloat16, (n_heads, head_dim), the same memory
ref = sdpa(q[None, :, None].float(), k.transpose(0, 1)[None].float(),
           v.transpose(0, 1)[None].float(), enable_gqa=True)[0, :, 0]  # fmt: skip
err = ((out.float() - ref).norm() / ref.norm()).item()
print(f"bf16 tensors in, {out.dtype} {tuple(out.shape)} out: relative error {err:.1e}")

# A static cache as transformers' StaticCache holds it, head-major (1, KV heads, capacity,
# head_dim): each replay writes the new token's row at a device position and ferrox decodes
# the first seq_len tokens in place, seq_len an int32 on the device.
capacity = 4096
k_cache = torch.zeros(1, n_kv_heads, capacity, head_dim, **bf16)
v_cache = torch.zeros(1, n_kv_heads, capacity, head_dim, **bf16)
k_row = torch.zeros(1, n_kv_heads, 1, head_dim, **bf16)
v_row = torch.zeros(1, n_kv_heads, 1, head_dim, **bf16)
pos = torch.zeros(1, dtype=torch.long, device="cuda")
seq_len = torch.zeros(1, dtype=torch.int32, device="cuda")
graph_out = torch.empty(n_heads, head_dim, **bf16)


def token_step():
    k_cache.index_copy_(2, pos, k_row)
    v_cache.index_copy_(2, pos, v_row)
    seq_len.copy_(pos + 1)
    fd.gqa_decode_async(q, (k_cache, v_cache), graph_out, n_heads=n_heads, seq_len=seq_len,
                        kv_layout="HND", stream=torch.cuda.current_stream())  # fmt: skip


side = torch.cuda.Stream()
side.wait_stream(stream)
with torch.cuda.stream(side):
    token_step()  # the first call makes ferrox's launches: outside the capture, on its stream
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph, stream=side):
    token_step()

for t in range(64):
    for x in (q, k_row, v_row):
        x.normal_()
    pos.fill_(t)
    graph.replay()
ref = sdpa(q[None, :, None].float(), k_cache[:, :, :64].float(), v_cache[:, :, :64].float(),
           enable_gqa=True)[0, :, 0]  # fmt: skip
graph_err = ((graph_out.float() - ref).norm() / ref.norm()).item()
print(f"64 replays of one torch.cuda.graph over a static cache: relative error {graph_err:.1e}")
sys.exit(0 if max(err, graph_err) < 1e-2 else 1)
