"""How the benchmarks time GPU work: device-filled inputs, rotated KV sets, CUDA events,
captured graphs, and one stream per process.

Method: inputs filled on the device with pseudo-random values (never zeros); KV sets rotated
so more than 400 MB (ROTATE_BYTES) separate two reads of one set (the H200's L2 is 60 MB);
CUDA events after warm-up; medians of >= 30. The scripts in ``benchmarks/`` build on these.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...decode.checks import dtype_name
from ...driver.device import Device
from ...driver.graph import GraphExec
from ...driver.memory import DeviceArray, empty, zeros
from ...driver.stream import Event, Stream
from ...kernels.catalogue import get_kernel

__all__ = [
    "CHAIN_MIN",
    "MAX_SETS",
    "ROTATE_BYTES",
    "KVSets",
    "RotatedKV",
    "bench_stream",
    "captured",
    "fill_uniform",
    "measure_read_ceiling",
    "rotated_graph_us",
    "rotated_kv_sets",
    "rotation",
    "time_events",
    "time_graph_body",
    "time_replays",
]

ROTATE_BYTES = 400 * 2**20
MAX_SETS = 512
CHAIN_MIN = 8


def rotation(kv_bytes: int) -> tuple[int, int]:
    """KV sets to rotate among (together past ROTATE_BYTES, so no read hits L2) and the
    decodes in one back-to-back graph (every set, and at least CHAIN_MIN)."""
    n_sets = max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / kv_bytes)))
    return n_sets, max(n_sets, CHAIN_MIN)


def fill_uniform(arr: DeviceArray, seed: int, stream: Stream) -> None:
    """Fill a float32/float16/bfloat16 device array with values uniform in [-1, 1) (an fp8
    one: its bytes as float16 ones, values within +-1.0 and a few NaN: for timing only)."""
    if arr.dtype.itemsize == 1 and arr.size % 2 == 0:
        arr = arr.view((arr.size // 2,), np.float16)
    kernel = get_kernel("util.cu", f"ferrox_fill_uniform_{dtype_name(arr.dtype)}", arr.device)
    kernel.launch(1024, 256, (arr, np.int64(arr.size), np.uint32(seed)), stream=stream)


KVSets = list[tuple[DeviceArray, DeviceArray]]


@dataclass
class RotatedKV:
    """The K/V sets one benchmark point rotates among (views into ``pool``) and the decodes
    in one back-to-back graph; ``close()`` frees them."""

    sets: KVSets
    chain: int
    pool: DeviceArray

    def close(self) -> None:
        self.sets.clear()
        self.pool.close()


def rotated_kv_sets(
    seq: int, n_kv_heads: int, head_dim: int, dtype: Any, stream: Stream, device: Device
) -> RotatedKV:
    """The K/V sets one benchmark point rotates among, filled on the device (set i with
    seeds 100 + 2i and 101 + 2i), and the decodes in one back-to-back graph (``rotation``).

    The sets are carved out of one allocation, as a model's caches allocated at once would
    be and as PyTorch's sets are: one allocation and free per point instead of up to 1024,
    laid out alike for both libraries."""
    dt = np.dtype(dtype)
    shape = (seq, n_kv_heads, head_dim)
    one = seq * n_kv_heads * head_dim * dt.itemsize  # bytes of one K or V
    n_sets, chain = rotation(2 * one)
    pool = empty((2 * n_sets * one,), np.uint8, device=device)
    sets = []
    for i in range(n_sets):
        k = pool.view(shape, dt, offset=2 * i * one)
        v = pool.view(shape, dt, offset=(2 * i + 1) * one)
        fill_uniform(k, 100 + 2 * i, stream)
        fill_uniform(v, 101 + 2 * i, stream)
        sets.append((k, v))
    return RotatedKV(sets, chain, pool)


def time_events(
    run: Callable[[int], None], stream: Stream, iters: int, warmup: int, per_run: int = 1
) -> float:
    """Median microseconds of ``run(i)`` on ``stream`` between two events, divided by
    ``per_run`` (the decodes one run queues)."""
    for i in range(warmup):
        run(i)
    start, end = Event(), Event()
    times = []
    for i in range(iters):
        start.record(stream)
        run(i)
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_ms(end) * 1e3 / per_run)
    return statistics.median(times)


def captured(stream: Stream, body: Callable[[], None], repeat: int = 1) -> GraphExec:
    """``body`` called ``repeat`` times under capture on ``stream``, instantiated."""
    with stream.capture() as graph:
        for _ in range(repeat):
            body()
    exe = graph.instantiate()
    graph.close()
    return exe


def time_replays(
    chained: GraphExec, chain: int, singles: Sequence[GraphExec], stream: Stream, iters: int
) -> tuple[float, float]:
    """Microseconds per decode: ``chained`` (``chain`` decodes back to back) and the
    ``singles`` (one decode each, replayed in turn, each timed alone)."""
    back_to_back = time_events(lambda i: chained.launch(stream), stream, iters, 3, chain)
    single = time_events(lambda i: singles[i % len(singles)].launch(stream), stream, iters, 5)
    return back_to_back, single


def rotated_graph_us(
    eager: Callable[[int], None], rotated: RotatedKV, stream: Stream, iters: int
) -> float:
    """Graph-replayed us per decode of ``eager(i)`` (a decode over set i of ``rotated``): run
    once, then ``rotated.chain`` decodes over the sets in turn in one graph, timed."""
    eager(0)
    stream.synchronize()
    execs = [captured(stream, functools.partial(eager, i)) for i in range(len(rotated.sets))]

    def all_sets() -> None:
        for i in range(rotated.chain):
            eager(i)

    chained = captured(stream, all_sets)
    graph_us, _ = time_replays(chained, rotated.chain, execs, stream, iters)
    for e in [*execs, chained]:
        e.close()
    return graph_us


def time_graph_body(
    stream: Stream, body: Callable[[], None], iters: int = 50, chain: int = 20
) -> tuple[float, float]:
    """Microseconds of what ``body`` queues on ``stream``: ``chain`` of it back to back in
    one graph (per item), and one graph replay of it timed alone (same inputs every time:
    for fixed costs, the KV in L2)."""
    body()
    stream.synchronize()
    chained, single = captured(stream, body, chain), captured(stream, body)
    times = time_replays(chained, chain, [single], stream, iters)
    chained.close()
    single.close()
    return times


def measure_read_ceiling(device: Device, gib: float = 4.0) -> float:
    """TB/s of reading ``gib`` GiB once (a sum over 16-byte loads), on bench_stream."""
    stream = bench_stream(device)
    n = int(gib * 2**30) // 4
    data = empty((n,), np.float32, device=device)
    fill_uniform(data, 1, stream)
    total = zeros((1,), np.float32, device=device)
    kernel = get_kernel("util.cu", "ferrox_read_sum", device)
    blocks = device.multiprocessor_count * 8

    def run(_: int) -> None:
        kernel.launch(blocks, 256, (data, np.int64(n // 4), total), stream=stream)

    us = time_events(run, stream, 20, 3)
    data.close()
    return n * 4 / (us * 1e-6) / 1e12


_streams: dict[int, Stream] = {}


def bench_stream(device: Device) -> Stream:
    """The one stream every measurement of this process runs on, per device, as a decode
    loop would use: after work on a few streams, every kernel of the process runs slower
    (docs/design.md, "A process state to know about when measuring")."""
    stream = _streams.get(device.context_handle)
    if stream is None:
        stream = _streams[device.context_handle] = Stream(device)
    return stream
