"""The wide plans as the library ships them (gqa_split_mma_*_d128_wide_cluster: 8 chunks per
KV head in clusters of 8-warp blocks) against the plans they replace (FERROX_WIDE=0: 16
chunks per KV head and the combine kernel), on the same points, in the benchmark's
back-to-back harness: times (fastest of three rounds in turn), the change, and each output's
error against the float64 reference (up to 32768 tokens).

    PYTHONPATH=. python3 docs/perf-history/wide_compare.py [shape ...] [--any-length]

--any-length times the wide plan wherever it fits, below wide_from's lengths too (to place
the rule for groups that were not measured: 40/8/128, group 5; 48/12/128, 12 KV heads).

half_cluster_compare.py measured the same plans with a ring variant compiled from the
kernel file (FX_WARPS_D128 8); the shipped entry compiles to other machine code (same
registers), so this times what ships.
"""

from __future__ import annotations

import os
import sys

from points import new_against_old, plan_kind, points

from ferrox_driver.attention import wide_plan
from ferrox_driver.bench_decode import bench_stream
from ferrox_driver.device import default_device

SEQS = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
CASES = [
    ((32, 8, 128), "bf16", SEQS),
    ((32, 8, 128), "f16", [4096, 32768]),
    ((64, 8, 128), "bf16", SEQS),
    ((16, 8, 128), "bf16", [4096, 32768]),
    ((40, 8, 128), "bf16", [2048, 4096, 8192, 16384, 32768]),
    ((48, 12, 128), "bf16", [2048, 4096, 32768, 131072]),
]


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--any-length"]
    any_length = len(args) < len(sys.argv) - 1
    stream = bench_stream(default_device())
    for p in points(CASES, stream, args):
        wide = p.plan()
        os.environ["FERROX_WIDE"] = "0"
        try:
            old = p.plan()
        finally:
            del os.environ["FERROX_WIDE"]
        if any_length:  # the rule's length threshold left out; the rest of it kept
            group = p.n_heads // p.n_kv
            forced = wide_plan(stream.device, old, p.dtype_name, p.n_kv, group, p.head_dim, 1 << 30)
            wide = forced or wide
        runs = [(plan_kind(old), old, None), ("wide " + plan_kind(wide), wide, None)]
        if wide == old:
            print(f"{p.label}: no wide plan ({plan_kind(old)})", flush=True)
            continue
        cells = new_against_old(p, runs, runs[1][0], runs[0][0])
        print(f"{p.label}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
