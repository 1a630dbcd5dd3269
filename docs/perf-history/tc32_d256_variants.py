"""The fp32 head_dim 256 tensor-core (3xTF32) kernel with other block shapes than planned:
warps per block, ring steps per warp and chunk tile, each variant's chunks as plan_split
would give them (one wave of its resident blocks, at most one chunk per tile). A shallower
ring lets two or three blocks share a multiprocessor, so short sequences get more, shorter
chunks. Timed in turn, three rounds, the fastest kept, in the benchmark's back-to-back
harness; each output compared with the planned kernel's (8/1/256 fp32 at 4096 tokens sat
at 9.9-10.0x PyTorch, the issue's line).

    PYTHONPATH=. python3 docs/perf-history/tc32_d256_variants.py
"""

from __future__ import annotations

import dataclasses

import numpy as np
from points import load_variant, points, tc32_only

from ferrox_driver.attention import MAX_SPLITS, TC32_STAGES, TC32_TOKENS, TC32_WARPS
from ferrox_driver.bench_decode import bench_stream
from ferrox_driver.compiler import kernel_source
from ferrox_driver.device import default_device

CASES = [((8, 1, 256), "f32", [512, 4096, 32768, 131072])]
VARIANTS = [  # (warps, ring steps, chunk tile in tokens); 8-token steps
    (4, 2, 32),
    (4, 1, 32),
    (2, 3, 16),
    (2, 2, 16),
    (2, 1, 16),
    (8, 1, 64),
]
KERNEL = "gqa_split_tc32_f32_d256"


def main() -> None:
    stream = bench_stream(default_device())
    dev = stream.device
    src = tc32_only(kernel_source("gqa_decode_split.cu"))
    assert TC32_TOKENS[256] == 8, TC32_TOKENS
    kernels = {}
    for warps, stages, _ in VARIANTS:
        if (warps, stages) not in kernels:
            defines = f"#define FX_TC32_WARPS_D256 {warps}\n#define FX_TC32_STAGES_D256 {stages}\n"
            mod = load_variant(defines + src, f"tc32_d256_{warps}x{stages}.cu", dev)
            kernels[warps, stages] = mod.get_function(KERNEL)
    print(f"planned: {TC32_WARPS[256]} warps x {TC32_STAGES[256]} steps", flush=True)
    for p in points(CASES, stream):
        base = p.plan()
        assert base.kernel == KERNEL and not base.cluster, base
        runs = [(f"planned {base.splits}x{base.tile}", base, None)]
        for warps, stages, tile in VARIANTS:
            kern = kernels[warps, stages]
            smem = warps * stages * 8 * 2 * 256 * 4
            per_sm = kern.max_active_blocks(32 * warps, smem)
            splits = max(1, min(per_sm * dev.multiprocessor_count, MAX_SPLITS, -(-p.seq // tile)))
            plan = dataclasses.replace(
                base, threads=32 * warps, stages=stages, tile=tile, splits=splits
            )
            runs.append((f"{warps}w x{stages} {splits}x{tile} ({per_sm}/SM)", plan, kern))
        outs = p.outputs(runs)
        best = p.fastest(runs)
        ref_label = runs[0][0]
        ref = best[ref_label]
        cells = []
        for label, us in best.items():
            diff = np.nanmax(np.abs(outs[label] - outs[ref_label]))
            bad = np.isnan(outs[label]).any()
            note = ", NaN" if bad else f", max diff {diff:.1e}"
            cells.append(f"{label} {us:.2f} ({100 * (us / ref - 1):+.1f}%{note})")
        print(f"{p.label}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
