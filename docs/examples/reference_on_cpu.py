"""The float64 reference decode: runs anywhere, no GPU needed.

Exits non-zero when the check fails.
"""

import sys

import numpy as np

import ferrox_driver as fd

rng = np.random.default_rng()
n_heads, n_kv_heads, head_dim, seq_len = 8, 2, 64, 100
q = rng.standard_normal((n_heads, head_dim)).astype(np.float32)
k = rng.standard_normal((seq_len, n_kv_heads, head_dim)).astype(np.float32)
v = rng.standard_normal((seq_len, n_kv_heads, head_dim)).astype(np.float32)
out = fd.reference_gqa_decode(q, k, v, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)
print(f"reference output: shape {out.shape}, dtype {out.dtype}")

# Query head 0 reads KV head 0; with all scores equal, the output is the mean of V.
flat = fd.reference_gqa_decode(
    np.zeros_like(q), k, v, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim
)
if not np.allclose(flat[0], v[:, 0].astype(np.float64).mean(axis=0)):
    sys.exit("uniform attention is not the mean of V")
print("uniform attention equals the mean of V: ok")
