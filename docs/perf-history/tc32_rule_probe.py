"""Where the fp32 CUDA-core kernels were kept (tc32_for: groups under 4, and groups of 4
above 32768 tokens), the tensor-core kernel of the same chunks timed beside them, now that
its products take two mmas instead of three. Timed in turn, three rounds, the fastest kept,
in the benchmark's back-to-back harness; the two outputs' largest difference printed.

    PYTHONPATH=. python3 docs/perf-history/tc32_rule_probe.py

`tc32-rule-v17.log` ran groups of 4 and 2; `tc32-rule-g3-v17.log` groups of 3 too.
"""

from __future__ import annotations

import os

import numpy as np
from points import points

from ferrox_driver.attention import plan_split
from ferrox_driver.bench_decode import bench_stream
from ferrox_driver.device import default_device

CASES = [
    ((32, 8, 128), "f32", [32768, 65536, 131072]),  # group 4
    ((16, 8, 128), "f32", [4096, 32768, 131072]),  # group 2
    ((24, 8, 128), "f32", [4096, 32768, 131072]),  # group 3
]


def main() -> None:
    stream = bench_stream(default_device())
    # the tensor-core plan of 8 KV heads x 128 (16 chunks from 1024 tokens; each block
    # computes its chunk from the actual length)
    tc32 = plan_split(stream.device, np.dtype(np.float32), 32, 8, 128, 32768)
    assert tc32.kernel == "gqa_split_tc32_f32_d128" and not tc32.cluster, tc32
    for p in points(CASES, stream):
        os.environ["FERROX_TC32"] = "0"
        try:
            cuda_core = p.plan()
        finally:
            os.environ.pop("FERROX_TC32")
        runs = [(f"cuda-core {cuda_core.splits} chunks", cuda_core, None)]
        runs.append((f"tc32 {tc32.splits} chunks", tc32, None))
        outs = p.outputs(runs)
        best = p.fastest(runs)
        a, b = (best[r[0]] for r in runs)
        diff = np.abs(outs[runs[0][0]] - outs[runs[1][0]]).max()
        cells = ", ".join(f"{k} {v:.2f} ({p.pct(v):.0f}%)" for k, v in best.items())
        print(f"{p.label}: {cells}; tc32 {100 * (b / a - 1):+.1f}%, diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
