"""Decode token by token against a KV cache that stays on the GPU.

Each token appends one row of K and one of V (an async copy from page-locked memory), then
decodes. Needs a GPU. Exits non-zero when a check against the reference fails.
"""

import sys

import ml_dtypes
import numpy as np

import ferrox_driver as fd

n_heads, n_kv_heads, head_dim = 32, 8, 128
rng = np.random.default_rng()
dtype = ml_dtypes.bfloat16
prompt_k = rng.standard_normal((500, n_kv_heads, head_dim)).astype(dtype)
prompt_v = rng.standard_normal((500, n_kv_heads, head_dim)).astype(dtype)

with fd.KVCache(n_kv_heads, head_dim, capacity=1024, dtype=dtype) as kv:
    kv.extend(prompt_k, prompt_v)  # the prompt: one copy for K, one for V
    all_k, all_v = [prompt_k], [prompt_v]
    for _ in range(20):
        k_tok = rng.standard_normal((n_kv_heads, head_dim)).astype(dtype)
        v_tok = rng.standard_normal((n_kv_heads, head_dim)).astype(dtype)
        q = rng.standard_normal((n_heads, head_dim)).astype(dtype)
        kv.append(k_tok, v_tok)
        out = kv.decode(q, n_heads=n_heads)
        all_k.append(k_tok[None])
        all_v.append(v_tok[None])
    print(f"cache holds {kv.seq_len} tokens of capacity {kv.capacity}")

ref = fd.reference_gqa_decode(
    q,
    np.concatenate(all_k),
    np.concatenate(all_v),
    n_heads=n_heads,
    n_kv_heads=n_kv_heads,
    head_dim=head_dim,
)
err = np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref)
print(f"relative error against the float64 reference: {err:.2e}")
if not err < 1e-2:
    sys.exit("decode does not match the reference")
