"""Which step of the benchmark's measure_point flips a process into the slow mode
(bench-mode-probe*-v13.log: the first measure_point of a process is fast, every later one
~0.4 us slower at 512 tokens and ~0.6 at 4096, whatever the memory layout): measure_point's
steps one at a time on a 32/8/128 bf16 4096-token point, each followed by the
time_split_plan indicator (fast ~9.45 us, slow ~10.05).

    PYTHONPATH=. python3 docs/perf-history/flip_probe.py [seq_len of the steps' point]
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import numpy as np
from points import points

import ferrox_driver as fd
from ferrox_driver import bench_decode
from ferrox_driver.attention import launch_decode
from ferrox_driver.bench_decode import captured, time_events
from ferrox_driver.compiler import compile_source
from ferrox_driver.launch import Module

CLOCK = r"""
extern "C" __global__ void fx_clock(unsigned long long* out) {
    if (threadIdx.x != 0) return;
    unsigned long long t0, t1;
    long long c0 = clock64();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    while (clock64() - c0 < 4000000) {}
    long long c1 = clock64();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    out[0] = c1 - c0;
    out[1] = t1 - t0;
}
"""


def main() -> None:
    bench_decode._torch = None  # no PyTorch in this process
    stream = fd.Stream()
    seq = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    gen = points([((32, 8, 128), "bf16", [4096])], stream)  # held: closing it frees the point
    ind = next(gen)
    gen2 = points([((32, 8, 128), "bf16", [seq])], stream)
    p = next(gen2) if seq != 4096 else ind

    hot = dataclasses.replace(ind, sets=ind.sets[:1])  # one set: the KV stays in L2

    clock = Module(compile_source(CLOCK, name="fx_clock.cu")).get_function("fx_clock")
    ticks = fd.zeros((2,), np.uint64)

    def mhz() -> float:
        """The SM clock a kernel sees: clock64 cycles over %globaltimer ns for ~2 ms."""
        clock.launch(1, 32, (ticks,), stream=stream)
        stream.synchronize()
        cycles, ns = ticks.to_host()
        return float(cycles) / float(ns) * 1e3

    def show(step: str) -> None:
        us = [ind.time(ind.plan()) for _ in range(2)]
        print(
            f"{step:44} {us[0]:.2f} {us[1]:.2f} us; KV in L2 {hot.time(hot.plan()):.2f}; "
            f"SM clock {mhz():.0f} MHz",
            flush=True,
        )

    show("start")
    own = fd.Stream()

    def eager(i: int) -> None:
        k, v = p.sets[i % len(p.sets)]
        launch_decode(
            p.q, k, v, p.out, n_heads=32, n_kv_heads=8, head_dim=128, seq_len=p.seq, stream=own
        )

    show("a new stream")
    eager(0)
    own.synchronize()
    show("one eager launch_decode on it")
    singles = [captured(own, functools.partial(eager, i)) for i in range(len(p.sets))]
    show(f"{len(singles)} single-decode graphs instantiated")
    chained = captured(own, lambda: [eager(i) for i in range(p.chain)])
    show("the chained graph instantiated")
    time_events(lambda i: chained.launch(own), own, 30, 3, p.chain)
    show("the chained graph timed")
    time_events(lambda i: singles[i % len(singles)].launch(own), own, 30, 3)
    show("single replays timed one per event pair")
    time_events(eager, own, 30, 5)
    show("eager decodes timed one per event pair")
    for e in [*singles, chained]:
        e.close()
    show("graphs closed")
    own.close()
    show("stream closed")
    dev = stream.device
    spare = fd.empty((400 * 2**20 // 4,), np.float32)
    show("400 MiB allocated")
    bench_decode.fill_uniform(spare, 3, stream)
    stream.synchronize()
    show("... filled on the GPU")
    spare.close()
    show("... freed")
    for seq in (4096, 4096, 512, 512, 4096):  # the benchmark's own points
        pt = bench_decode.measure_point((32, 8, 128), seq, "bf16", 30, dev)
        show(f"measure_point at {seq}: {pt.graph_us:.2f} us")
    for seq in (4096, 4096, 512, 512, 4096):  # again
        pt = bench_decode.measure_point((32, 8, 128), seq, "bf16", 30, dev)
        show(f"measure_point at {seq}: {pt.graph_us:.2f} us")
    for r in range(3):  # points made now, after all that
        for fresh in points([((32, 8, 128), "bf16", [4096])], stream):
            plan = fresh.plan()
            mixed = dataclasses.replace(fresh, sets=ind.sets)
            other = dataclasses.replace(ind, sets=fresh.sets)
            print(
                f"a fresh point {r}: {fresh.time(plan):.2f} us; its q and out over the first "
                f"point's KV sets {mixed.time(plan):.2f}; the first point's q and out over "
                f"its KV sets {other.time(plan):.2f}; the first point {ind.time(plan):.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
