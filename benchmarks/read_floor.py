"""The read floor of a decode's access pattern: a kernel that only reads the K/V bytes a
split decode reads, the same way (one block per (chunk, KV head), 16-byte cp.async-free
loads of rows of head_dim elements, n_kv_heads * head_dim apart), next to the decode on
the same cache, over the rotated sets the benchmark uses (past L2). Where the floor is
as slow as the decode, the head_dim's gap is the layout's, not the kernel's arithmetic.

    PYTHONPATH=. python3 benchmarks/read_floor.py [D,D,...] [SEQ,SEQ,...] [dtype]

Prints, per (head_dim, seq_len): the floor's us and TB/s (graph replay, medians) with the
decode's 16 blocks per KV head and with 4x as many, the decode's, and the decode's share
of the (16-block) floor's speed.
"""

from __future__ import annotations

import sys

import numpy as np

import ferrox_driver as fd
from ferrox_driver.apps.bench.decode import SUPPORTED_DTYPES, measure_point
from ferrox_driver.apps.bench.harness import (
    bench_stream,
    captured,
    rotated_kv_sets,
    time_replays,
)

SOURCE = r"""
// Block (chunk, kv head) reads rows t in [start, end) of K and V for its head: 16-byte
// loads, n16 per row, rows `row16` 16-byte units apart; the sum keeps the loads alive.
extern "C" __global__ void __launch_bounds__(256) read_rows(
    const uint4* k, const uint4* v, int seq, int chunk, int n16, long long row16,
    unsigned* sink) {
    const int start = blockIdx.x * chunk, end = min(seq, start + chunk);
    const long long head = (long long)blockIdx.y * n16;
    unsigned acc = 0;
    const int units = (end - start) * n16;
#pragma unroll 4
    for (int i = threadIdx.x; i < units; i += 256) {
        const long long at = (long long)(start + i / n16) * row16 + head + i % n16;
        const uint4 a = __ldcg(k + at), b = __ldcg(v + at);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;  // (never, in practice)
}
"""

SPLITS = 16  # the padded kernels' plans: 16 chunks per KV head, one block per multiprocessor


def floor_us(
    seq: int, n_kv: int, head_dim: int, dtype: str, device: fd.Device, splits: int = SPLITS
) -> float:
    dt = next(d for d, name in SUPPORTED_DTYPES.items() if name == dtype)
    stream = bench_stream(device)
    kernel = fd.ensure_module_loaded(SOURCE, "read_floor.cu", "read_rows").get_function("read_rows")
    rotated = rotated_kv_sets(seq, n_kv, head_dim, dt, stream, device)
    sink = fd.zeros((1,), np.uint32, device=device)
    n16 = head_dim * dt.itemsize // 16
    chunk = -(-seq // splits)

    def one(i: int) -> None:
        k, v = rotated.sets[i % len(rotated.sets)]
        args = (k, v, np.int32(seq), np.int32(chunk), np.int32(n16), np.int64(n_kv * n16), sink)
        kernel.launch((splits, n_kv), 256, args, stream=stream)

    def chain() -> None:
        for i in range(rotated.chain):
            one(i)

    chained = captured(stream, chain)
    singles = [captured(stream, lambda i=i: one(i)) for i in range(len(rotated.sets))]
    us, _ = time_replays(chained, rotated.chain, singles, stream, 30)
    rotated.pool.close()
    return us


def main(argv: list[str]) -> int:
    dims = [int(x) for x in argv[1].split(",")] if len(argv) > 1 else [40, 48, 56, 64, 72, 96, 128]
    seqs = [int(x) for x in argv[2].split(",")] if len(argv) > 2 else [32768, 131072]
    dtype = argv[3] if len(argv) > 3 else "bf16"
    device = fd.Device(0)
    print(f"32/8/D {dtype}: read floor (same bytes, same rows) vs decode, graph replay")
    head = ("D", 4), ("seq", 7), ("floor us", 9), ("TB/s", 6), ("x4 blocks", 10), ("TB/s", 6)
    head += ("decode us", 10), ("TB/s", 6)
    print(" ".join(f"{name:>{w}}" for name, w in head), f"{'of floor':>8}")
    for d in dims:
        for s in seqs:
            nbytes = 2 * s * 8 * d * 2
            f = floor_us(s, 8, d, dtype, device)
            f4 = floor_us(s, 8, d, dtype, device, 4 * SPLITS)
            p = measure_point((32, 8, d), s, dtype, 30, device).graph_us
            print(
                f"{d:>4} {s:>7} {f:9.1f} {nbytes / f / 1e6:6.2f} {f4:10.1f} "
                f"{nbytes / f4 / 1e6:6.2f} {p:10.1f} {nbytes / p / 1e6:6.2f} {100 * f / p:7.0f}%",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
