"""The fp16/bf16 tensor-core kernels with other ring depths than planned (2 steps up to
the steps' worth of shared memory their launch reserves), each plan otherwise as planned
(its chunks, its cluster): launched with the
ring's own shared memory (two blocks may then fit a multiprocessor) and "padded", with the
planned launch's shared memory (one block per multiprocessor, as planned). Timed in turn,
three rounds, the fastest kept, in the benchmark's back-to-back harness on its one stream;
each output compared with the planned kernel's. `ring-smem-variants-v16.log` ran when the
head_dim 128 ring had 4 steps; `-after-` with its 2-step ring planned (reserving 4 steps'
shared memory); `-d64-d256-` on those head_dims' kernels.

    PYTHONPATH=. python3 docs/perf-history/ring_smem_variants.py [shape ...]
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from points import against, plan_kind, points, ring_variant

from ferrox_driver.attention import MMA_RESERVE_STAGES, MMA_STAGES, MMA_WARPS
from ferrox_driver.bench_decode import bench_stream
from ferrox_driver.device import default_device

CASES = [
    ((32, 8, 128), "bf16", [512, 4096, 32768, 131072]),
    ((32, 8, 128), "f16", [4096, 32768]),
    ((64, 8, 128), "bf16", [512, 4096, 32768]),
    ((28, 4, 128), "bf16", [512, 4096, 32768]),
    ((32, 32, 128), "bf16", [4096, 32768]),
    ((16, 2, 64), "bf16", [512, 4096, 32768, 131072]),
    ((8, 1, 256), "bf16", [512, 4096, 32768, 131072]),
]


def main() -> None:
    stream = bench_stream(default_device())
    modules: dict[tuple[int, int], Any] = {}
    for p in points(CASES, stream, sys.argv[1:]):
        base = p.plan()
        runs = [("planned", base, None)]
        hd, warps = p.head_dim, MMA_WARPS[p.head_dim]
        for s in range(2, max(MMA_STAGES[hd], MMA_RESERVE_STAGES[hd]) + 1):
            if s == MMA_STAGES[hd]:
                continue
            if (hd, s) not in modules:
                modules[hd, s] = ring_variant(hd, warps, s, stream.device)
            kern = modules[hd, s].get_function(base.kernel)
            own = dataclasses.replace(base, stages=s, reserve_stages=0)  # its ring alone
            runs.append((f"{warps}x{s}", own, kern))
            runs.append((f"{warps}x{s} padded", base, kern))  # the planned launch's memory
        outs = p.outputs(runs)
        best = p.fastest(runs)
        cells = against(best, outs, "planned")
        print(f"{p.label} ({plan_kind(base)}): " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
