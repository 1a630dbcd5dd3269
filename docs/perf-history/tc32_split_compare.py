"""The fp32 tensor-core kernels as they are against a baseline kernel file (the same plans,
the same launches): timed in turn, three rounds, the fastest kept, in the benchmark's
back-to-back harness, and each output's largest error relative to the float64 reference
(up to 32768 tokens; max |out - ref| / max |ref|), its output NaN-poisoned before.
`tc32-split-compare-v17.log` ran the two-mma split TF32 products (rows 8..15 of A carrying
the low parts) against commit 2c31a63's three-mma 3xTF32 kernels:

    git show 2c31a63:cuda_src/gqa_decode_split.cu > /tmp/base.cu
    PYTHONPATH=. python3 docs/perf-history/tc32_split_compare.py /tmp/base.cu [shape ...]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
from points import load_variant, points

from ferrox_driver.bench_decode import bench_stream
from ferrox_driver.device import default_device
from ferrox_driver.reference import reference_gqa_decode

SEQS = [512, 4096, 32768, 131072]
CASES = [
    ((32, 8, 128), "f32", [512, 4096, 32768]),  # groups of 4: CUDA cores above 32768
    ((64, 8, 128), "f32", SEQS),
    ((28, 4, 128), "f32", [512, 4096, 32768]),
    ((16, 2, 64), "f32", SEQS),
    ((8, 1, 256), "f32", SEQS),
]


def main() -> None:
    base_file, only = sys.argv[1], sys.argv[2:]
    stream = bench_stream(default_device())
    # Only the fp32 tensor-core kernels are needed (the others only slow the compile down).
    src = re.sub(
        r"^(FX_GENERIC_FOR_TYPE|FX_MMA_ENTRY)\(.*$", "", Path(base_file).read_text(),
        flags=re.MULTILINE,
    )  # fmt: skip
    base = load_variant(src, "tc32_base.cu", stream.device)
    for p in points(CASES, stream, only):
        plan = p.plan()
        if not plan.kernel.startswith("gqa_split_tc32"):
            print(f"{p.label}: planned on CUDA cores ({plan.kernel}), skipped", flush=True)
            continue
        runs = [("now", plan, None), ("base", plan, base.get_function(plan.kernel))]
        outs = p.outputs(runs)
        best = p.fastest(runs)
        cells = [f"{k} {v:.2f}" for k, v in best.items()]
        cells.append(f"({100 * (best['now'] / best['base'] - 1):+.1f}%)")
        if p.seq <= 32768:
            k, v = p.sets[0]
            ref = reference_gqa_decode(
                p.q.to_host(), k.to_host(), v.to_host(),
                n_heads=p.n_heads, n_kv_heads=p.n_kv, head_dim=p.head_dim,
            )  # fmt: skip
            scale = np.abs(ref).max()
            for label, out in outs.items():
                cells.append(f"{label} err {np.abs(out - ref).max() / scale:.1e}")
        else:
            diff = np.abs(outs["now"] - outs["base"]).max()
            cells.append(f"now - base {diff:.1e}")
        kind = f"cluster {plan.cluster}" if plan.cluster else f"{plan.splits} chunks"
        print(f"{p.label} ({kind}): " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
