"""The fp16/bf16 head_dim 128 kernel with other ring depths than planned (4 warps x 2, 3
or 4 steps), each plan otherwise as planned (its chunks, its cluster): launched with the
ring's own shared memory (two blocks may then fit a multiprocessor) and "padded", with the
planned launch's shared memory (one block per multiprocessor, as planned). Timed in turn,
three rounds, the fastest kept, in the benchmark's back-to-back harness on its one stream;
each output compared with the planned kernel's. `ring-smem-variants-v16.log` ran when the
planned ring had 4 steps; `-after-` with the 2-step ring planned (reserving 4 steps'
shared memory).

    PYTHONPATH=. python3 docs/perf-history/ring_smem_variants.py [shape ...]
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
from points import load_variant, points

from ferrox_driver.attention import MMA_STAGES, stream_workspace
from ferrox_driver.bench_decode import bench_stream
from ferrox_driver.compiler import kernel_source
from ferrox_driver.device import default_device

CASES = [
    ((32, 8, 128), "bf16", [512, 4096, 32768, 131072]),
    ((32, 8, 128), "f16", [4096, 32768]),
    ((64, 8, 128), "bf16", [512, 4096, 32768]),
    ((28, 4, 128), "bf16", [512, 4096, 32768]),
    ((32, 32, 128), "bf16", [4096, 32768]),
]
RINGS = [s for s in (2, 3, 4) if s != MMA_STAGES[128]]  # steps, 4 warps


def main() -> None:
    stream = bench_stream(default_device())
    src = kernel_source("gqa_decode_split.cu")
    modules = {
        s: load_variant(f"#define FX_STAGES_D128 {s}\n" + src, f"ring4x{s}.cu", stream.device)
        for s in RINGS
    }
    for p in points(CASES, stream, sys.argv[1:]):
        base = p.plan()
        runs = [("planned", base, None)]
        for s, mod in modules.items():
            kern = mod.get_function(base.kernel)
            own = dataclasses.replace(base, stages=s, reserve_stages=0)  # its ring alone
            runs.append((f"4x{s}", own, kern))
            runs.append((f"4x{s} padded", base, kern))  # the planned ring's shared memory
        outs = {}
        for label, plan, kern in runs:
            floats = plan.workspace_floats(p.n_heads, p.head_dim)
            ws = stream_workspace(stream.device, stream, floats) if floats else None
            p.out.fill_bytes(0xFF, stream)
            p.decode(plan, ws, kern)
            stream.synchronize()
            outs[label] = p.out.to_host().astype(np.float64)
        best: dict[str, float] = {}
        for _ in range(3):
            for label, plan, kern in runs:
                us = p.time(plan, kern)
                best[label] = min(best.get(label, us), us)
        ref = best["planned"]
        cells = [
            f"{k} {v:.2f} ({100 * (v / ref - 1):+.1f}%"
            + ("" if np.array_equal(outs[k], outs["planned"]) else ", BITS DIFFER")
            + ")"
            for k, v in best.items()
        ]
        kind = f"cluster {base.cluster}" if base.cluster else f"{base.splits} chunks"
        print(f"{p.label} ({kind}): " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
