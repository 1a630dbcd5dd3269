"""The gap between kernels in a graph, fast mode against slow (ncu-mode-probe-v13.log:
each decode kernel alone costs the same in both): per kernel, back to back in one graph
of 64, an empty kernel and one that spins 2 us (%globaltimer); a graph of 32 pairs of
2 us kernels, the second launched early (programmatic dependent launch) and waiting
(griddepcontrol.wait); and the 32/8/128 bf16 4096 indicator. Timed first thing in the
process, then after three measure_points.

    PYTHONPATH=. python3 docs/perf-history/gap_probe.py [streams]

With "streams", rows follow streams made and closed (one more each) instead.
"""

from __future__ import annotations

import sys

import numpy as np
from points import points

import ferrox_driver as fd
from ferrox_driver import bench_decode
from ferrox_driver.bench_decode import captured, time_events
from ferrox_driver.compiler import compile_source
from ferrox_driver.launch import Module

SRC = r"""
extern "C" __global__ void fx_empty(int* p) { if (p) *p = 0; }
extern "C" __global__ void fx_spin(unsigned long long ns, int wait) {
    if (wait) asm volatile("griddepcontrol.wait;" ::: "memory");
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


SPIN, SPIN_WAIT = (np.uint64(2000), np.int32(0)), (np.uint64(2000), np.int32(1))


def main() -> None:
    bench_decode._torch = None  # no PyTorch in this process
    stream = fd.Stream()
    module = Module(compile_source(SRC, name="fx_gap.cu"))
    empty, spin = module.get_function("fx_empty"), module.get_function("fx_spin")
    gen = points([((32, 8, 128), "bf16", [4096])], stream)  # held: closing it frees the point
    p = next(gen)

    def per_kernel(body, n: int) -> float:
        exe = captured(stream, body, n)
        us = time_events(lambda i: exe.launch(stream), stream, 30, 3, n)
        exe.close()
        return us

    def row(label: str) -> None:
        e = per_kernel(lambda: empty.launch(1, 32, (np.uint64(0),), stream=stream), 64)
        s = per_kernel(
            lambda: spin.launch(132, 128, (np.uint64(2000), np.int32(0)), stream=stream), 64
        )

        def pair() -> None:
            spin.launch(132, 128, (np.uint64(2000), np.int32(0)), stream=stream)
            spin.launch(132, 128, (np.uint64(2000), np.int32(1)), stream=stream, early=True)

        pr = per_kernel(pair, 32)
        ind = p.time(p.plan())
        print(
            f"{label:24} empty {e:.2f} us/kernel, 2 us spin {s:.2f}, early pair of spins "
            f"{pr:.2f} us/pair; indicator {ind:.2f}",
            flush=True,
        )

    row("fresh process")
    row("again")
    if "streams" in sys.argv[1:]:  # streams made and closed, one more before each row
        for i in range(12):
            fd.Stream().close()
            row(f"after {i + 1} more streams")
        return
    for i in range(3):
        bench_decode.measure_point((32, 8, 128), 4096, "bf16", 30, stream.device)
        row(f"after measure_point {i + 1}")


if __name__ == "__main__":
    main()
