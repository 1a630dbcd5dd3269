"""gpt-oss-style attention sinks: one learned logit per query head in the softmax's
denominator, as a device array (so a captured graph can use it), with the log-sum-exp.
Needs a GPU."""

import sys

import numpy as np

import ferrox_driver as fd

n_heads, n_kv_heads, head_dim, seq_len = 64, 8, 64, 3000
rng = np.random.default_rng(1)
q = rng.standard_normal((n_heads, head_dim)).astype(np.float16)
k = rng.standard_normal((seq_len, n_kv_heads, head_dim)).astype(np.float16)
v = rng.standard_normal((seq_len, n_kv_heads, head_dim)).astype(np.float16)
sinks = rng.standard_normal(n_heads).astype(np.float32)
dims = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim}

sinks_d = fd.to_device(sinks)
out, lse = fd.gqa_decode(fd.to_device(q), fd.to_device(k), fd.to_device(v), **dims,
                         sinks=sinks_d, return_lse=True)  # fmt: skip
ref, ref_lse = fd.reference_gqa_decode(q, k, v, **dims, sinks=sinks, return_lse=True)
err = float(np.abs(out.to_host().astype(np.float64) - ref).max())
lse_err = float(np.abs(lse.to_host() - ref_lse).max())
print(f"sinks: output error {err:.1e}, log-sum-exp error {lse_err:.1e} (natural log)")
if not (err < 1e-2 and lse_err < 1e-3):
    sys.exit("wrong result")
