"""The fp16/bf16 head_dim 128 plans that keep 4-warp blocks (the combine kernel's plans:
28/4/128, 64/8/128 below 16384 tokens, MHA; and the 512-token clusters) with 8-warp blocks
instead, the ring still 2 steps and the launch's shared memory the same (16 warp-steps):
twice the warps per multiprocessor, twice the bytes in flight. v19's wide plans gained
from 8 warps in half the grid; this asks whether the full grid does too.

    PYTHONPATH=. python3 docs/perf-history/ring8_compare.py [shape ...]
"""

from __future__ import annotations

import dataclasses
import sys

from points import new_against_old, plan_kind, points, ring_variant

from ferrox_driver.attention import MMA_STAGES
from ferrox_driver.bench_decode import bench_stream
from ferrox_driver.device import default_device

CASES = [
    ((28, 4, 128), "bf16", [512, 4096, 32768, 131072]),
    ((64, 8, 128), "bf16", [2048, 4096, 8192]),
    ((32, 32, 128), "bf16", [4096, 32768, 131072]),
    ((32, 8, 128), "bf16", [512]),
]


def main() -> None:
    stream = bench_stream(default_device())
    s = MMA_STAGES[128]
    module = ring_variant(128, 8, s, stream.device)
    for p in points(CASES, stream, sys.argv[1:]):
        base = p.plan()
        wide = dataclasses.replace(base, threads=256, reserve_stages=16 // 8)
        assert wide.shared_bytes(128, 2) == base.shared_bytes(128, 2), (wide, base)
        runs = [("4 warps", base, None), ("8 warps", wide, module.get_function(base.kernel))]
        cells = new_against_old(p, runs, "8 warps", "4 warps")
        print(f"{p.label} ({plan_kind(base)}): " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
