"""The fp32 tensor-core (3xTF32) kernels with shallower rings than planned, each plan
otherwise as planned (its chunks, its cluster, its launch's shared memory: one block per
multiprocessor), as ring_smem_variants.py did for fp16/bf16, where one step in flight
measured fastest for head_dim 128 and two for head_dim 64. Timed in turn, three rounds, the
fastest kept, in the benchmark's back-to-back harness; each output compared bit for bit with
the planned kernel's (the ring depth does not change the arithmetic).

    PYTHONPATH=. python3 docs/perf-history/tc32_ring_variants.py [shape ...]
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from points import TC32_CASES, against, load_variant, plan_kind, points, tc32_only

from ferrox_driver.attention import TC32_STAGES
from ferrox_driver.bench_decode import bench_stream
from ferrox_driver.compiler import kernel_source
from ferrox_driver.device import default_device


def main() -> None:
    stream = bench_stream(default_device())
    src = tc32_only(kernel_source("gqa_decode_split.cu"))
    modules: dict[tuple[int, int], Any] = {}
    for p in points(TC32_CASES, stream, sys.argv[1:]):
        base = p.plan()
        hd = p.head_dim
        if not base.kernel.startswith("gqa_split_tc32"):
            print(f"{p.label}: planned on CUDA cores ({base.kernel}), skipped", flush=True)
            continue
        runs = [(f"planned x{base.stages}", base, None)]
        for s in range(1, TC32_STAGES[hd]):
            if (hd, s) not in modules:
                defines = f"#define FX_TC32_STAGES_D{hd} {s}\n"
                modules[hd, s] = load_variant(defines + src, f"tc32_d{hd}_x{s}.cu", stream.device)
            kern = modules[hd, s].get_function(base.kernel)
            # the ring of s steps, the launch's shared memory as planned
            padded = dataclasses.replace(base, stages=s, reserve_stages=base.stages)
            runs.append((f"x{s} padded", padded, kern))
        outs = p.outputs(runs)
        best = p.fastest(runs)
        cells = against(best, outs, runs[0][0])
        print(f"{p.label} ({plan_kind(base)}): " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
