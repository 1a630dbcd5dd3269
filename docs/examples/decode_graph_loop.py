"""A decode loop replayed from one CUDA graph: append + decode captured once, one launch and
one synchronize per token. Needs a GPU. Exits non-zero when a check fails."""

import sys
import time

import numpy as np

import ferrox_driver as fd

n_heads, n_kv_heads, head_dim, tokens = 32, 8, 128, 200
rng = np.random.default_rng()
ks = rng.standard_normal((tokens, n_kv_heads, head_dim)).astype(np.float32)
vs = rng.standard_normal((tokens, n_kv_heads, head_dim)).astype(np.float32)

with (
    fd.KVCache(n_kv_heads, head_dim, capacity=tokens) as kv,
    fd.DecodeGraph(kv, n_heads=n_heads) as step,
):
    start = time.perf_counter()
    for t in range(tokens):
        q = rng.standard_normal((n_heads, head_dim)).astype(np.float32)
        out = step(q, ks[t], vs[t])  # copies in, one graph launch, one sync
    per_token_us = (time.perf_counter() - start) / tokens * 1e6
    print(f"{tokens} tokens, {per_token_us:.1f} us per token (append + decode, host to host)")

ref = fd.reference_gqa_decode(q, ks, vs, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)
err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
print(f"last token: relative error {err:.2e}")
if not err < 1e-5:
    sys.exit("graph decode does not match the reference")
