"""What a 4-bit cache stores, on the CPU: fd.quantize_int4 of fd.hadamard(K) is an int4
KVCache's K bit for bit (its default rotates K), fd.quantize_int4 of V its V; the decode
of the dequantized rows (K rotated back) against the unquantized one shows what the
format costs, with and without the rotation, on K with outlier channels as real models'
K have. Exits non-zero when the check fails.
"""

import sys

import numpy as np

import ferrox_driver as fd

rng = np.random.default_rng(0)
n_heads, n_kv_heads, head_dim, seq_len = 32, 8, 128, 2048
k = rng.standard_normal((seq_len, n_kv_heads, head_dim)).astype(np.float32)
k[:, :, [3, 40, 77, 100]] *= rng.uniform(10, 50, 4).astype(np.float32)  # outlier channels
v = rng.standard_normal((seq_len, n_kv_heads, head_dim)).astype(np.float32)
q = rng.standard_normal((n_heads, head_dim)).astype(np.float32)
dims = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim}
exact = fd.reference_gqa_decode(q, k, v, **dims)

v_back = fd.dequantize_int4(*fd.quantize_int4(v))
errors = {}
for rotate in (True, False):
    values, scales = fd.quantize_int4(fd.hadamard(k) if rotate else k)  # the cache's K
    k_back = fd.dequantize_int4(values, scales)
    if rotate:
        k_back = fd.hadamard(k_back)  # the rotation is its own inverse
    got = fd.reference_gqa_decode(q, k_back, v_back, **dims)
    errors[rotate] = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    print(f"int4, rotate={rotate}: K bytes {values.nbytes + scales.nbytes}, "
          f"decode error {errors[rotate]:.3f} against unquantized")  # fmt: skip

if not errors[True] < errors[False]:
    sys.exit("the rotation should lower int4's error where K has outlier channels")
