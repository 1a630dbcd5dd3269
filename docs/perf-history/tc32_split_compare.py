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

import sys
from pathlib import Path

from points import TC32_CASES, load_variant, new_against_old, plan_kind, points, tc32_only

from ferrox_driver.bench_decode import bench_stream
from ferrox_driver.device import default_device


def main() -> None:
    base_file, only = sys.argv[1], sys.argv[2:]
    stream = bench_stream(default_device())
    src = tc32_only(Path(base_file).read_text())
    base = load_variant(src, "tc32_base.cu", stream.device)
    for p in points(TC32_CASES, stream, only):
        plan = p.plan()
        if not plan.kernel.startswith("gqa_split_tc32"):
            print(f"{p.label}: planned on CUDA cores ({plan.kernel}), skipped", flush=True)
            continue
        runs = [("now", plan, None), ("base", plan, base.get_function(plan.kernel))]
        cells = new_against_old(p, runs, "now", "base")
        print(f"{p.label} ({plan_kind(plan)}): " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
