"""Host time of one eager call, per entry point (32/8/128 bf16, 512 tokens): microseconds
of Python and driver calls per decode, measured with the GPU queue never empty-waiting
(no synchronisation inside the timed loop), then where that time goes (cProfile).

    python3 benchmarks/host_overhead.py
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np

import ferrox_driver as fd
from ferrox_driver.apps.bench.harness import fill_uniform
from ferrox_driver.decode.records import launch_decode

N_HEADS, N_KV, HD, SEQ = 32, 8, 128, 512
DT = ml_dtypes.bfloat16


def host_us(fn: Callable[[], None], stream: fd.Stream, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    stream.synchronize()
    return (t1 - t0) / n * 1e6


def profile(label: str, fn: Callable[[], None], stream: fd.Stream, n: int = 2000) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    stream.synchronize()
    print(f"--- {label}: cProfile over {n} calls (tottime)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def main() -> None:
    stream = fd.Stream()
    q = fd.empty((N_HEADS, HD), DT)
    k = fd.empty((SEQ, N_KV, HD), DT)
    v = fd.empty((SEQ, N_KV, HD), DT)
    out = fd.empty((N_HEADS, HD), DT)
    for i, a in enumerate((q, k, v)):
        fill_uniform(a, i, stream)
    rng = np.random.default_rng(0)
    q_host = rng.standard_normal((N_HEADS, HD)).astype(DT)
    row = rng.standard_normal((N_KV, HD)).astype(DT)
    cache = fd.KVCache(N_KV, HD, 4096, dtype=DT)
    for _ in range(SEQ):
        cache.append(row, row)
    kw = {"n_heads": N_HEADS, "n_kv_heads": N_KV, "head_dim": HD}

    def low() -> None:
        launch_decode(q, k, v, out, **kw, seq_len=SEQ, stream=stream)

    def checked() -> None:
        fd.gqa_decode(q, k, v, **kw, stream=stream, out=out)

    def cache_launch() -> None:
        cache.launch_decode(q, out, n_heads=N_HEADS, stream=cache.stream)

    def cache_step() -> None:  # what a generation loop does per token on one layer
        cache.append(row, row)
        cache.decode(q_host, n_heads=N_HEADS)

    cases = [
        ("launch_decode (no checks)", low, stream),
        ("gqa_decode, device arrays", checked, stream),
        ("KVCache.launch_decode", cache_launch, cache.stream),
    ]
    for label, fn, s in cases:
        print(f"{label}: {host_us(fn, s):.1f} us host per call", flush=True)
    print(f"KVCache append + decode (numpy q): {host_us(cache_step, cache.stream, 300):.1f} us")
    profile("launch_decode", low, stream)
    profile("gqa_decode, device arrays", checked, stream)
    cache.close()


if __name__ == "__main__":
    main()
