# ruff: noqa: B023  (closures are called before the loop moves on)
"""Ran against commit 76e5fcd, which had attention.EARLY_SPLIT and the split kernels'
wait (reverted since: early-after-probe-v15.log); on later code the flag does nothing.

A cluster decode launched early after a kernel that never lets it start early (as a
KV append or a user's kernel would be) against one launched plainly, and after a kernel
that lets it start at its entry (griddepcontrol.launch_dependents): back to back in one
graph of pairs (a one-block kernel, then a decode over the next rotated KV set), the
time per pair, three rounds, the fastest kept; the benchmark's one stream.

    PYTHONPATH=. python3 docs/perf-history/early_after_probe.py [shape ...]
"""

from __future__ import annotations

import sys

import numpy as np
from points import points

import ferrox_driver as fd
from ferrox_driver import attention
from ferrox_driver.bench_decode import bench_stream, captured, time_events
from ferrox_driver.compiler import compile_source
from ferrox_driver.device import default_device
from ferrox_driver.launch import Module

CASES = [
    ((32, 8, 128), "bf16", [512]),
    ((64, 8, 128), "bf16", [512]),
    ((28, 4, 128), "bf16", [512]),
    ((16, 2, 64), "bf16", [512, 1024]),
    ((32, 8, 128), "f32", [512]),
]
SRC = """
extern "C" __global__ void quiet(int* p) { if (threadIdx.x == 0) p[0] = 1; }
extern "C" __global__ void letting(int* p) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (threadIdx.x == 0) p[0] = 1;
}
"""


def main() -> None:
    stream = bench_stream(default_device())
    mod = Module(compile_source(SRC, name="pred.cu"), stream.device)
    preds = {"quiet": mod.get_function("quiet"), "letting": mod.get_function("letting")}
    flag = fd.zeros((4,), np.int32, device=stream.device)
    modes = [("quiet", False), ("quiet", True), ("letting", False), ("letting", True)]
    for p in points(CASES, stream, sys.argv[1:]):
        plan = p.plan()
        assert plan.cluster, plan
        best: dict[str, float] = {}
        for _ in range(3):
            for pred, early in modes:
                attention.EARLY_SPLIT = early
                turn = [0]

                def body(pred: str = pred) -> None:
                    preds[pred].launch(1, 32, (flag,), stream=stream)
                    p.decode(plan, None, kv=p.sets[turn[0] % len(p.sets)])
                    turn[0] += 1

                exe = captured(stream, body, p.chain)
                us = time_events(lambda i: exe.launch(stream), stream, 30, 3, p.chain)
                exe.close()
                key = f"after {pred}, {'early' if early else 'plain'}"
                best[key] = min(best.get(key, us), us)
        cells = [f"{k} {v:.2f} us" for k, v in best.items()]
        print(f"{p.label} ({plan.splits} chunks) per pair: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
