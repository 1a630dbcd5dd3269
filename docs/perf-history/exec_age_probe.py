"""Is the slow mode (gap-probe-v13.log: ~0.18 us more per kernel in a graph once a process
has run some measure_points) a property of the process, or of the graph executables
instantiated after it sets in? Graphs instantiated first thing in the process (an empty
kernel x 64, and the 32/8/128 bf16 4096 indicator's chain of decodes) are kept and timed
again after each measure_point, beside the same graphs instantiated afresh; and the old
ones once more after cuGraphUpload.

    PYTHONPATH=. python3 docs/perf-history/exec_age_probe.py [measure_points, default 4]
"""

from __future__ import annotations

import sys

import numpy as np
from points import points

import ferrox_driver as fd
from ferrox_driver import bench_decode
from ferrox_driver._driver import drv
from ferrox_driver.attention import launch_split, stream_workspace
from ferrox_driver.bench_decode import captured, time_events
from ferrox_driver.compiler import compile_source
from ferrox_driver.launch import Module

SRC = r"""extern "C" __global__ void fx_empty(int* p) { if (p) *p = 0; }"""


def main() -> None:
    bench_decode._torch = None  # no PyTorch in this process
    stream = fd.Stream()
    empty = Module(compile_source(SRC, name="fx_age.cu")).get_function("fx_empty")
    gen = points([((32, 8, 128), "bf16", [4096])], stream)  # held: closing it frees the point
    p = next(gen)
    plan = p.plan()
    ws = stream_workspace(p.q.device, stream, plan.workspace_floats(p.n_heads, p.head_dim))
    turn = [0]

    def decode() -> None:
        k, v = p.sets[turn[0] % len(p.sets)]
        turn[0] += 1
        launch_split(
            plan, p.q, k, v, p.out, ws, n_heads=p.n_heads, n_kv_heads=p.n_kv,
            head_dim=p.head_dim, seq_len=p.seq, seq_len_dev=None, stream=stream,
        )  # fmt: skip

    def graphs() -> tuple[fd.GraphExec, fd.GraphExec]:
        turn[0] = 0
        e = captured(stream, lambda: empty.launch(1, 32, (np.uint64(0),), stream=stream), 64)
        return e, captured(stream, decode, p.chain)

    def timed(exe: fd.GraphExec, n: int) -> float:
        return time_events(lambda i: exe.launch(stream), stream, 30, 3, n)

    decode()
    stream.synchronize()
    old_e, old_d = graphs()

    def row(label: str, upload: bool = False) -> None:
        new_e, new_d = graphs()
        if upload:
            for exe in (old_e, old_d):
                drv("cuGraphUpload", exe.handle, stream.handle)
            stream.synchronize()
        cells = (
            f"old: empty {timed(old_e, 64):.2f} us/kernel, decode {timed(old_d, p.chain):.2f}; "
            f"new: empty {timed(new_e, 64):.2f}, decode {timed(new_d, p.chain):.2f}"
        )
        print(f"{label:28} {cells}", flush=True)
        new_e.close()
        new_d.close()

    row("fresh process")
    row("again")
    for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 4):
        bench_decode.measure_point((32, 8, 128), 4096, "bf16", 30, stream.device)
        row(f"after measure_point {i + 1}")
    row("old ones uploaded again", upload=True)


if __name__ == "__main__":
    main()
