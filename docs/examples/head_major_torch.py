"""A head-major cache read in place: the first n tokens of a PyTorch tensor shaped like a
transformers StaticCache layer, (1, n_kv_heads, capacity, head_dim), decoded with
kv_layout="HND" and no copy, against PyTorch's SDPA on the same tokens. Needs a GPU and
PyTorch. Exits non-zero when a check fails.
"""

import sys

import torch

import ferrox_driver as fd

n_heads, n_kv_heads, head_dim, capacity, n = 32, 8, 128, 4096, 1000
bf16 = dict(device="cuda", dtype=torch.bfloat16)
k_cache = torch.zeros(1, n_kv_heads, capacity, head_dim, **bf16)  # a StaticCache layer's
v_cache = torch.zeros(1, n_kv_heads, capacity, head_dim, **bf16)
k_cache[:, :, :n] = torch.randn(1, n_kv_heads, n, head_dim, **bf16)
v_cache[:, :, :n] = torch.randn(1, n_kv_heads, n, head_dim, **bf16)
q = torch.randn(1, n_heads, 1, head_dim, **bf16)  # one token, as SDPA takes it

out = torch.empty(n_heads, head_dim, **bf16)
fd.gqa_decode(
    q.view(n_heads, head_dim), k_cache[:, :, :n], v_cache[:, :, :n],  # views, in place
    n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, kv_layout="HND", out=out,
    stream=torch.cuda.current_stream(),
)  # fmt: skip

group = n_heads // n_kv_heads  # SDPA's K and V: each KV head repeated for its query heads
k_rep = k_cache[:, :, :n].float().repeat_interleave(group, dim=1)
v_rep = v_cache[:, :, :n].float().repeat_interleave(group, dim=1)
ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k_rep, v_rep)
err = ((out.float() - ref.view(n_heads, head_dim)).norm() / ref.norm()).item()
print(f"head-major bf16 cache, {n} of {capacity} tokens read in place: relative error {err:.1e}")
sys.exit(0 if err < 1e-2 else 1)
