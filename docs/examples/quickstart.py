"""Quickstart: one decode step on the GPU, next to the float64 reference (no GPU: the reference)."""

import numpy as np

import ferrox_driver as fd

rng = np.random.default_rng()
q = rng.standard_normal((32, 128), dtype=np.float32)  # the new token: 32 query heads of 128
k = rng.standard_normal((4096, 8, 128), dtype=np.float32)  # the cache: 4096 tokens x 8 KV heads
v = rng.standard_normal((4096, 8, 128), dtype=np.float32)

ref = fd.reference_gqa_decode(q, k, v)  # on the CPU, in float64; sizes read from the shapes
if fd.cuda_available():
    out = fd.gqa_decode(q, k, v)  # numpy in, numpy out (device arrays in: device arrays out)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    print(f"GPU decode {out.shape}: relative error {err:.1e} against the float64 reference")
else:
    print(f"no GPU: the float64 reference {ref.shape}")
