"""Whether the benchmark's own points (measure_point) sit in the slow mode at 4096 tokens
because of PyTorch's timing in the same process: 32/8/128 bf16 points measured with the
comparison off, then on, then time_split_plan over the same shape, in one process.

    PYTHONPATH=. python3 docs/perf-history/bench_mode_probe.py [--arena | --churn] [seq ...]

--arena: every point's KV sets are carved out of one 1 GiB allocation made first in the
process. --churn: 400 MiB are allocated and freed before the first point.
"""

from __future__ import annotations

import sys

import numpy as np
from points import points

import ferrox_driver as fd
from ferrox_driver import bench_decode
from ferrox_driver.device import default_device


def arena_sets(arena: fd.DeviceArray):
    def rotated(seq, n_kv, hd, dtype, stream, device):
        dt = np.dtype(dtype)
        shape = (seq, n_kv, hd)
        n_sets, chain = bench_decode.rotation(2 * seq * n_kv * hd * dt.itemsize)
        one = seq * n_kv * hd * dt.itemsize
        sets = []
        for i in range(n_sets):
            k = arena.view(shape, dt, offset=2 * i * one)
            v = arena.view(shape, dt, offset=(2 * i + 1) * one)
            bench_decode.fill_uniform(k, 100 + 2 * i, stream)
            bench_decode.fill_uniform(v, 101 + 2 * i, stream)
            sets.append((k, v))
        return bench_decode.RotatedKV(sets, chain, fd.empty((1,), np.uint8))

    return rotated


def main() -> None:
    args = sys.argv[1:]
    seqs = [int(a) for a in args if a.isdigit()] or [512, 4096]
    dev = default_device()
    if "--arena" in args:
        arena = fd.empty((2**30,), np.uint8)
        bench_decode.rotated_kv_sets = arena_sets(arena)
        print(f"arena at {arena.ptr:#x}", flush=True)
    if "--churn" in args:
        fd.empty((400 * 2**20,), np.uint8).close()
        print("churn: 400 MiB allocated and freed", flush=True)
    for torch_on in (False, True, False):
        bench_decode._torch = False if torch_on else None
        for r in range(2):
            for seq in seqs:
                pt = bench_decode.measure_point((32, 8, 128), seq, "bf16", 30, dev)
                print(
                    f"torch {'on ' if torch_on else 'off'} round {r} {seq:>5}: graph "
                    f"{pt.graph_us:.2f} us, single {pt.single_us:.2f}, torch {pt.torch_us}",
                    flush=True,
                )
        stream = fd.Stream()
        for p in points([((32, 8, 128), "bf16", seqs)], stream):
            print(f"  time_split_plan {p.label}: {p.time(p.plan()):.2f} us", flush=True)
        stream.close()


if __name__ == "__main__":
    main()
