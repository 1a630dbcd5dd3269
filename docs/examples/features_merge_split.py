"""A sequence split in two: a shared prefix and a private suffix decoded apart, each with
its log-sum-exp, then merged exactly (fd.merge_states) into the decode of the whole.
Needs a GPU."""

import sys

import ml_dtypes
import numpy as np

import ferrox_driver as fd

n_heads, n_kv_heads, head_dim = 32, 8, 128
rng = np.random.default_rng(2)
bf16 = ml_dtypes.bfloat16
q = rng.standard_normal((n_heads, head_dim)).astype(bf16)
prefix_k, prefix_v = (rng.standard_normal((5000, n_kv_heads, head_dim)).astype(bf16)
                      for _ in range(2))  # fmt: skip
suffix_k, suffix_v = (rng.standard_normal((300, n_kv_heads, head_dim)).astype(bf16)
                      for _ in range(2))  # fmt: skip
dims = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim}

out_a, lse_a = fd.gqa_decode(q, prefix_k, prefix_v, **dims, return_lse=True)
out_b, lse_b = fd.gqa_decode(q, suffix_k, suffix_v, **dims, return_lse=True)
out, lse = fd.merge_states(np.stack([out_a, out_b]).astype(np.float32), np.stack([lse_a, lse_b]))

whole = fd.reference_gqa_decode(q, np.concatenate([prefix_k, suffix_k]),
                                np.concatenate([prefix_v, suffix_v]), **dims)  # fmt: skip
err = float(np.abs(out - whole).max())
print(f"prefix 5000 + suffix 300 tokens, merged: max error {err:.1e} against the whole")
if not err < 1e-2:
    sys.exit("wrong result")
