"""Decode benchmark: CUDA events, warm-up, medians, KV buffers rotated past the L2 cache."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...decode.checks import check_dims
from ...decode.records import launch_decode
from ...driver.device import default_device
from ...driver.memory import DeviceArray, empty
from ...driver.stream import Stream
from .harness import bench_stream, time_events

__all__ = ["READ_CEILING_TBS", "AppendTiming", "Timing", "time_appends", "time_decode"]

READ_CEILING_TBS = 4.26  # the H200's read ceiling (a 4 GiB sum), the % column's 100
ROTATE_BYTES = 400 * 2**20  # > 6x the H200's 60 MB L2


@dataclass(frozen=True)
class Timing:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    seq_len: int
    dtype: str
    algorithm: str
    median_us: float
    kv_bytes: int

    @property
    def tbs(self) -> float:
        return self.kv_bytes / (self.median_us * 1e-6) / 1e12


def _random_fill(arr: DeviceArray, rng: np.random.Generator, stream: Stream) -> None:
    host = rng.standard_normal(arr.size, dtype=np.float32).astype(arr.dtype)
    arr.copy_from_host(host, stream)


def time_decode(
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    seq_len: int,
    dtype: Any = np.float32,
    *,
    algorithm: str = "auto",
    iters: int = 30,
    warmup: int = 5,
    seed: int = 0,
) -> Timing:
    """Median time of one decode on random data, rotating KV buffers past the L2 cache."""
    check_dims(n_heads, n_kv_heads, head_dim)
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    stream = bench_stream(default_device())
    kv_bytes = 2 * seq_len * n_kv_heads * head_dim * dt.itemsize
    n_sets = max(1, min(16, math.ceil(ROTATE_BYTES / max(kv_bytes, 1))))
    q = empty((n_heads, head_dim), dt)
    out = empty((n_heads, head_dim), dt)
    _random_fill(q, rng, stream)
    sets = []
    for _ in range(n_sets):
        k = empty((seq_len, n_kv_heads, head_dim), dt)
        v = empty((seq_len, n_kv_heads, head_dim), dt)
        _random_fill(k, rng, stream)
        _random_fill(v, rng, stream)
        sets.append((k, v))

    def run(i: int) -> None:
        k, v = sets[i % n_sets]
        launch_decode(
            q,
            k,
            v,
            out,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            seq_len=seq_len,
            stream=stream,
            algorithm=algorithm,
        )

    median_us = time_events(run, stream, iters, warmup)
    stream.synchronize()
    return Timing(
        n_heads,
        n_kv_heads,
        head_dim,
        seq_len,
        dt.name,
        algorithm,
        median_us,
        kv_bytes,
    )


@dataclass(frozen=True)
class AppendTiming:
    strategy: str
    capacity: int
    append_us: float  # host time per appended token
    append_decode_us: float  # host time per append + decode (decode returns to the host)


def time_appends(
    capacity: int,
    n_heads: int = 32,
    n_kv_heads: int = 8,
    head_dim: int = 128,
    *,
    tokens: int = 1000,
    seed_tokens: int = 20,
) -> list[AppendTiming]:
    """Host time per token: our one-row async append vs ferrox-cuda's full re-upload."""
    import time

    from ...cache.kv_cache import KVCache

    rng = np.random.default_rng(0)
    row = (n_kv_heads, head_dim)
    k = rng.standard_normal((tokens, *row), dtype=np.float32)
    v = rng.standard_normal((tokens, *row), dtype=np.float32)
    q = rng.standard_normal((n_heads, head_dim), dtype=np.float32)
    prefill = capacity - tokens - 1  # measure near the end of the cache, where it hurts
    results = []
    with KVCache(n_kv_heads, head_dim, capacity, stream=bench_stream(default_device())) as kv:
        fill = rng.standard_normal((prefill, *row), dtype=np.float32)
        kv.extend(fill, fill)
        kv.synchronize()
        t0 = time.perf_counter()
        for i in range(tokens):
            kv.append(k[i], v[i])
        append_us = (time.perf_counter() - t0) / tokens * 1e6
        kv.synchronize()
        kv.clear()
        kv.extend(fill, fill)
        kv.decode(q, n_heads=n_heads)
        t0 = time.perf_counter()
        for i in range(tokens):
            kv.append(k[i], v[i])
            kv.decode(q, n_heads=n_heads)
        both_us = (time.perf_counter() - t0) / tokens * 1e6
        decode_us = both_us - append_us
    results.append(AppendTiming("ours: one row, pinned async", capacity, append_us, both_us))

    # ferrox-cuda's CudaKvBuffers::append: extend a host mirror, clone it, pad to capacity and
    # upload both buffers whole (freshly allocated), on every token.
    k_host = [fill.reshape(-1)]
    v_host = [fill.reshape(-1)]
    bufs: list[DeviceArray] = []
    t0 = time.perf_counter()
    for i in range(seed_tokens):
        k_host.append(k[i].reshape(-1))
        v_host.append(v[i].reshape(-1))
        for host in (k_host, v_host):
            full = np.zeros(capacity * n_kv_heads * head_dim, np.float32)
            flat = np.concatenate(host)
            full[: flat.size] = flat
            dev = empty(full.shape, np.float32)
            dev.copy_from_host(full)
            bufs.append(dev)
        while len(bufs) > 2:
            bufs.pop(0).close()
    seed_us = (time.perf_counter() - t0) / seed_tokens * 1e6
    for b in bufs:
        b.close()
    results.append(AppendTiming("seed: full re-upload", capacity, seed_us, seed_us + decode_us))
    return results
