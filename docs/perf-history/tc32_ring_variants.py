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
import re
import sys
from typing import Any

import numpy as np
from points import load_variant, points

from ferrox_driver.attention import TC32_STAGES
from ferrox_driver.bench_decode import bench_stream
from ferrox_driver.compiler import kernel_source
from ferrox_driver.device import default_device

SEQS = [512, 4096, 32768, 131072]
CASES = [
    ((32, 8, 128), "f32", [512, 4096, 32768]),  # groups of 4: CUDA cores above 32768
    ((64, 8, 128), "f32", SEQS),
    ((28, 4, 128), "f32", [512, 4096, 32768]),
    ((16, 2, 64), "f32", SEQS),
    ((8, 1, 256), "f32", SEQS),
]


def main() -> None:
    stream = bench_stream(default_device())
    src = kernel_source("gqa_decode_split.cu")
    # Only the fp32 tensor-core kernels are needed (the others only slow the compile down).
    src = re.sub(r"^(FX_GENERIC_FOR_TYPE|FX_MMA_ENTRY)\(.*$", "", src, flags=re.MULTILINE)
    modules: dict[tuple[int, int], Any] = {}
    for p in points(CASES, stream, sys.argv[1:]):
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
        ref = best[runs[0][0]]
        cells = [
            f"{k} {v:.2f} ({100 * (v / ref - 1):+.1f}%"
            + ("" if np.array_equal(outs[k], outs[runs[0][0]]) else ", BITS DIFFER")
            + ")"
            for k, v in best.items()
        ]
        kind = f"cluster {base.cluster}" if base.cluster else f"{base.splits} chunks"
        print(f"{p.label} ({kind}): " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
