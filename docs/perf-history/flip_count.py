"""Which of measure_point's kinds of work, repeated, turns on the slow mode
(exec-age-probe-v14.log: one to three measure_points do; flip-bisect-v13.log: one copy of
each stage in a fresh process does not). One kind of work, done REPEAT times, each
followed by the empty-kernel indicator (64 in a graph, kept from the start: ~0.55 us per
kernel fast, ~0.73 slow), in this process; `all` runs each kind in a fresh process.

    PYTHONPATH=. python3 docs/perf-history/flip_count.py [KIND|all]

KIND: pool, stream, graphs, eager, point (measure_point itself), small (a 256 KiB
allocation made and freed), smallkeep (one made and kept), streamonly (a stream made and
closed after one empty kernel, no scratch), pointtorch (measure_point with PyTorch's
SDPA beside ours).
"""

from __future__ import annotations

import functools
import subprocess
import sys

import numpy as np
from points import points

import ferrox_driver as fd
from ferrox_driver import bench_decode
from ferrox_driver.attention import launch_decode
from ferrox_driver.bench_decode import captured, rotated_kv_sets, time_events
from ferrox_driver.compiler import compile_source
from ferrox_driver.launch import Module

SRC = r"""extern "C" __global__ void fx_empty(int* p) { if (p) *p = 0; }"""
KINDS = ("point", "pointtorch")
REPEAT = 12


def main(kind: str) -> None:
    if kind == "pointtorch":
        bench_decode.import_torch()  # before any CUDA work of ours
    else:
        bench_decode._torch = None  # no PyTorch in this process
    stream = fd.Stream()
    empty = Module(compile_source(SRC, name="fx_flip.cu")).get_function("fx_empty")
    gen = points([((32, 8, 128), "bf16", [4096])], stream)  # held: closing it frees the point
    p = next(gen)
    kept = []
    ind = captured(stream, lambda: empty.launch(1, 32, (np.uint64(0),), stream=stream), 64)

    def eager(i: int, on: fd.Stream) -> None:
        k, v = p.sets[i % len(p.sets)]
        launch_decode(
            p.q, k, v, p.out, n_heads=32, n_kv_heads=8, head_dim=128, seq_len=p.seq, stream=on
        )

    def work() -> None:
        if kind == "small":
            fd.empty((65536,), np.float32).close()
        elif kind == "smallkeep":
            kept.append(fd.empty((65536,), np.float32))
        elif kind == "streamonly":
            s = fd.Stream()
            empty.launch(1, 32, (np.uint64(0),), stream=s)
            s.synchronize()
            s.close()
        elif kind == "pool":  # the KV sets of a point: one 400 MiB allocation, filled, freed
            rotated_kv_sets(4096, 8, 128, p.dtype, stream, stream.device).close()
        elif kind == "stream":  # a stream of its own with its decode scratch, closed
            s = fd.Stream()
            eager(0, s)
            s.synchronize()
            s.close()
        elif kind == "graphs":  # a single-decode graph per set and the chain, closed
            execs = [captured(stream, functools.partial(eager, i, stream)) for i in range(25)]
            execs.append(captured(stream, lambda: [eager(i, stream) for i in range(25)]))
            for e in execs:
                e.launch(stream)
            stream.synchronize()
            for e in execs:
                e.close()
        elif kind == "eager":  # the eager timing
            time_events(lambda i: eager(i, stream), stream, 30, 5)
        else:  # point, pointtorch
            bench_decode.measure_point((32, 8, 128), 4096, "bf16", 30, stream.device)
        stream.synchronize()

    def row(label: str) -> None:
        us = time_events(lambda i: ind.launch(stream), stream, 30, 3, 64)
        print(f"{kind:7} {label:10} empty {us:.2f} us/kernel", flush=True)

    eager(0, stream)  # the stream's decode scratch, allocated outside any capture
    row("start")
    for i in range(REPEAT):
        work()
        row(f"after {i + 1}")


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    if which != "all":
        main(which)
    else:
        for kind in KINDS:
            subprocess.run([sys.executable, __file__, kind], check=True)
