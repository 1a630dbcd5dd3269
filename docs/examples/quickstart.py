"""Ten lines: decode on the GPU when there is one, check against the float64 reference."""

import sys

import numpy as np

import ferrox_driver as fd

rng = np.random.default_rng()
q = rng.standard_normal((32, 128)).astype(np.float32)  # 32 query heads
k = rng.standard_normal((4096, 8, 128)).astype(np.float32)  # 4096 tokens x 8 KV heads
v = rng.standard_normal((4096, 8, 128)).astype(np.float32)
ref = fd.reference_gqa_decode(q, k, v, n_heads=32, n_kv_heads=8, head_dim=128)
if fd.cuda_available():
    out = fd.gqa_decode(q, k, v, n_heads=32, n_kv_heads=8, head_dim=128)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    print(f"GPU decode, relative error {err:.1e}")
    sys.exit(0 if err < 1e-5 else 1)
print("no GPU: reference only", ref.shape)
