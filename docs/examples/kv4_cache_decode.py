"""A 4-bit KVCache on the GPU: an int4 cache (K rotated) and an nvfp4 one, filled from
bfloat16 rows, decoded with bfloat16 q; each decode against the float64 reference on the
cache's own dequantized rows (what the kernels must match, ~1e-3) and on the unquantized
rows (what the format costs). Exits non-zero when a check fails.
"""

import sys

import ml_dtypes
import numpy as np

import ferrox_driver as fd

rng = np.random.default_rng(0)
n_heads, n_kv_heads, head_dim, seq_len = 32, 8, 128, 4096
bf16 = ml_dtypes.bfloat16
k = rng.standard_normal((seq_len, n_kv_heads, head_dim)).astype(bf16)
v = rng.standard_normal((seq_len, n_kv_heads, head_dim)).astype(bf16)
q = rng.standard_normal((n_heads, head_dim)).astype(bf16)
dims = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim}
exact = fd.reference_gqa_decode(q, k, v, **dims)

for dtype in ("int4", "nvfp4"):
    with fd.KVCache(n_kv_heads, head_dim, seq_len, dtype=dtype) as kv:
        kv.extend(k[:-1], v[:-1])  # a prefill
        kv.append(k[-1], v[-1])  # and one token
        out = kv.decode(q, n_heads=n_heads).astype(np.float64)
        k_back, v_back = kv.dequantized()  # float32, K's rotation undone
        ref = fd.reference_gqa_decode(q, k_back, v_back, **dims)
        kernel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        fmt = np.linalg.norm(out - exact) / np.linalg.norm(exact)
        print(f"{dtype} (rotate={kv.rotate}): against its dequantized rows {kernel:.1e}, "
              f"against the unquantized rows {fmt:.3f}")  # fmt: skip
        if not (kernel < 1e-2 and fmt < 0.3):
            sys.exit(f"{dtype}: the decode is off")
