"""A Gemma-2-style local layer: a 4096-token sliding window and logits soft-capped at 50,
decoded on the GPU and checked against the float64 reference. Needs a GPU."""

import sys

import ml_dtypes
import numpy as np

import ferrox_driver as fd

n_heads, n_kv_heads, head_dim, seq_len = 16, 8, 256, 6000
rng = np.random.default_rng(0)
bf16 = ml_dtypes.bfloat16
q = rng.standard_normal((n_heads, head_dim)).astype(bf16)
k = rng.standard_normal((seq_len, n_kv_heads, head_dim)).astype(bf16)
v = rng.standard_normal((seq_len, n_kv_heads, head_dim)).astype(bf16)
features = {"sliding_window": 4096, "logits_soft_cap": 50.0, "scale": 256**-0.5}

out = fd.gqa_decode(q, k, v, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                    **features)  # fmt: skip
ref = fd.reference_gqa_decode(q, k, v, n_heads=n_heads, n_kv_heads=n_kv_heads,
                              head_dim=head_dim, **features)  # fmt: skip
err = float(np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max())
print(f"window 4096 of {seq_len} tokens, soft-cap 50: max error {err:.1e} of the largest output")
if not err < 1e-2:
    sys.exit("wrong result")
