"""Decode benchmark: CUDA events, warm-up, medians, KV buffers rotated past the L2 cache."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np

from .attention import launch_decode
from .memory import DeviceArray, empty
from .stream import Event, Stream
from .validation import check_dims

__all__ = ["Timing", "time_decode", "READ_CEILING_TBS"]

READ_CEILING_TBS = 4.26  # measured H200 read ceiling (a 4 GiB sum), see BASELINE.md
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

    @property
    def pct_of_ceiling(self) -> float:
        return 100.0 * self.tbs / READ_CEILING_TBS


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
    stream = Stream()
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

    for i in range(warmup):
        run(i)
    times = []
    start, end = Event(), Event()
    for i in range(iters):
        start.record(stream)
        run(i)
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_ms(end) * 1000.0)
    stream.synchronize()
    return Timing(
        n_heads,
        n_kv_heads,
        head_dim,
        seq_len,
        dt.name,
        algorithm,
        statistics.median(times),
        kv_bytes,
    )
