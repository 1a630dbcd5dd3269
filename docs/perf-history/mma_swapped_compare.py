"""The fp16/bf16 tensor-core kernels with the mma's operands swapped (gqa_split_mma_swapped:
tokens and columns of d as the mma's 16 rows, the heads as its 8 columns, half the mmas)
against gqa_split_mma ("now"), for every head_dim (FX_MMA_SWAPPED_D<D> all 1 and all 0),
on the same plans: timed in turn, three rounds, the fastest kept,
in the benchmark's back-to-back harness, and each output's largest error relative to the
float64 reference (up to 32768 tokens; max |out - ref| / max |ref|), NaN-poisoned before.

    PYTHONPATH=. python3 docs/perf-history/mma_swapped_compare.py [shape ...]
"""

from __future__ import annotations

import sys

from points import load_variant, new_against_old, plan_kind, points

from ferrox_driver.bench_decode import bench_stream
from ferrox_driver.compiler import kernel_source
from ferrox_driver.device import default_device

SEQS = [512, 4096, 32768, 131072]
CASES = [
    ((32, 8, 128), "bf16", SEQS),
    ((32, 8, 128), "f16", [4096, 32768]),
    ((64, 8, 128), "bf16", SEQS),
    ((28, 4, 128), "bf16", SEQS),
    ((32, 32, 128), "bf16", [4096, 32768, 131072]),
    ((16, 2, 64), "bf16", SEQS),
    ((8, 1, 256), "bf16", SEQS),
    ((5, 1, 256), "f16", [1, 77, 4099]),
]


def main() -> None:
    stream = bench_stream(default_device())
    modules = {}
    for on in (0, 1):
        defines = "".join(f"#define FX_MMA_SWAPPED_D{d} {on}\n" for d in (64, 128, 256))
        src = defines + kernel_source("gqa_decode_split.cu")
        modules[on] = load_variant(src, f"mma_swapped{on}.cu", stream.device)
    for p in points(CASES, stream, sys.argv[1:]):
        plan = p.plan()
        runs = [("now", plan, modules[0].get_function(plan.kernel))]
        runs.append(("swapped", plan, modules[1].get_function(plan.kernel)))
        cells = new_against_old(p, runs, "swapped", "now")
        print(f"{p.label} ({plan_kind(plan)}): " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
