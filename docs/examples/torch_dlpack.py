"""PyTorch bf16 tensors in, a PyTorch tensor out, with no copy either way.

gqa_decode reads the tensors' pointers directly and returns a DeviceArray, which PyTorch
takes through DLPack. Needs a GPU and PyTorch. Exits non-zero when a check fails.
"""

import sys

import numpy as np
import torch

import ferrox_driver as fd

n_heads, n_kv_heads, head_dim, seq_len = 32, 8, 128, 1000
q = torch.randn(n_heads, head_dim, device="cuda", dtype=torch.bfloat16)
k = torch.randn(seq_len, n_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
v = torch.randn(seq_len, n_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)

out = fd.gqa_decode(
    q, k, v, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
    stream=torch.cuda.current_stream(),
)  # fmt: skip
o = torch.from_dlpack(out)  # the same memory, dtype torch.bfloat16
assert o.data_ptr() == out.ptr and o.dtype == torch.bfloat16

ref = fd.reference_gqa_decode(
    *(t.float().cpu().numpy() for t in (q, k, v)),
    n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
)  # fmt: skip
got = o.float().cpu().numpy()
err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
print(f"bf16 torch tensors in and out: relative error {err:.1e}")
sys.exit(0 if err < 1e-2 else 1)
