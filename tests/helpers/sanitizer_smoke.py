"""Runs every kernel family once on small inputs: the workload for compute-sanitizer
(memcheck, racecheck, initcheck), e.g.

    compute-sanitizer --tool racecheck python3 tests/helpers/sanitizer_smoke.py
"""

import contextlib

import ml_dtypes
import numpy as np

import ferrox_driver as fd

rng = np.random.default_rng(0)
for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
    for n_heads, n_kv, hd, seq in ((32, 8, 128, 300), (8, 1, 256, 130), (7, 7, 100, 70)):
        q = rng.standard_normal((n_heads, hd)).astype(dtype)
        k = rng.standard_normal((seq, n_kv, hd)).astype(dtype)
        v = rng.standard_normal((seq, n_kv, hd)).astype(dtype)
        for algorithm in ("split", "parity"):
            fd.gqa_decode(
                q, k, v, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd, algorithm=algorithm
            )
    with fd.KVCache(8, 128, 40, dtype=dtype) as kv, fd.DecodeGraph(kv, n_heads=32) as step:
        for _ in range(41):  # the last one overflows inside the graph
            step.q[...] = 1
            step.launch()
            with contextlib.suppress(fd.KVCapacityError):
                step.synchronize()
print("sanitizer smoke: done")
