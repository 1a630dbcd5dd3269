"""Choosing an fp8 cache's scales, on the CPU: one per KV head from calibration rows
(their largest |x| over the format's largest value), then the error they cost a decode,
against the unquantized float64 decode. fd.quantize_fp8 is the cache's own rounding, bit
for bit, so this is what an fp8 KVCache's decodes carry (the kernels add ~1e-3 of their
own). Exits non-zero when the check fails.
"""

import sys

import ml_dtypes
import numpy as np

import ferrox_driver as fd

rng = np.random.default_rng(0)
n_heads, n_kv_heads, head_dim, seq_len = 16, 4, 128, 2048
fp8 = ml_dtypes.float8_e4m3fn
sizes = np.array([0.002, 0.1, 10.0, 400.0])[None, :, None]  # KV heads 200000x apart
k = (rng.standard_normal((seq_len, n_kv_heads, head_dim)) * sizes).astype(np.float32)
v = (rng.standard_normal((seq_len, n_kv_heads, head_dim)) * sizes).astype(np.float32)
q = (rng.standard_normal((n_heads, head_dim)) / np.repeat(sizes[0, :, 0], 4)[:, None]).astype(
    np.float32
)

# one scale per KV head, from the first 256 rows (a calibration set)
top = float(ml_dtypes.finfo(fp8).max)  # 448
k_scale = np.abs(k[:256]).max(axis=(0, 2)) / top
v_scale = np.abs(v[:256]).max(axis=(0, 2)) / top
print("k_scale per KV head:", np.array2string(k_scale, precision=4))

# what a cache made with fd.KVCache(..., dtype=fp8, k_scale=k_scale, v_scale=v_scale) holds
# and reads back (its to_host() bytes and dequantized() values)
kq = fd.quantize_fp8(k, fp8, k_scale).astype(np.float32) * k_scale[:, None]
vq = fd.quantize_fp8(v, fp8, v_scale).astype(np.float32) * v_scale[:, None]

dims = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim}
exact = fd.reference_gqa_decode(q, k, v, **dims)
got = fd.reference_gqa_decode(q, kq, vq, **dims)
err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
print(f"decode of the e4m3 cache: relative L2 error {err:.3f} against unquantized")

# every scale 1 instead: the smallest head falls below e4m3's normal range (2^-6) and the
# largest saturates at 448
kq1 = fd.quantize_fp8(k, fp8).astype(np.float32)
vq1 = fd.quantize_fp8(v, fp8).astype(np.float32)
err1 = np.linalg.norm(fd.reference_gqa_decode(q, kq1, vq1, **dims) - exact) / np.linalg.norm(exact)
print(f"with every scale 1 instead: {err1:.3f}")
if not (err < 0.06 and err1 > 2 * err):
    sys.exit("per-head scales did not keep the error small")
