"""Half the multiprocessors, no combine kernel: at mid lengths, the fp16/bf16 head_dim 128
plans merge each KV head's chunks on chip in clusters of C (8 per KV head for 8 KV heads:
64 blocks), against the planned combine plan (16 chunks per KV head: 128 blocks and the
combine kernel). stream_probe.py --half found 64 blocks with a 4x4 cp.async ring streaming
32/8/128's cache as fast as 128 blocks (5.27 us at 4096 tokens, 31.9 at 32768), where v8
had seen 64 busy multiprocessors at 65-71% of the ceiling with the kernels of then; the
combine costs 1.7-2.4 us of every decode (NOTES.md v18).

    PYTHONPATH=. python3 docs/perf-history/half_cluster_compare.py [shape ...] [--rings 4x2,8x2]
        [--seqs 4096,32768] [--mha-cluster 2]

MHA (32/32/128, planned 4 chunks per KV head and the combine: 32 clusters of 4 would not
all be resident) takes clusters of 3 (96 blocks), at 32768 and 131072 tokens, where it
trails PyTorch by 0.3-0.4% (`half-cluster-compare-mha-v18.log`).

Each cluster plan runs with the library's ring (4 warps x 2 steps) and with 3 and 4 steps
(--rings: warps x steps of each variant; 4x2,4x3,4x4 by default), each launched with at
least 16 warp-steps' shared memory (4 warps x 4: one block per multiprocessor). v19 added
8-warp rings: each block of a half-size grid does twice the products, so twice the warps
share them (`half-cluster-compare-8warps-v19.log`). Timed in turn,
three rounds, the fastest kept, in the benchmark's back-to-back harness; errors against the
float64 reference (max |out - ref| / max |ref|) for each.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np
from points import plan_kind, points, ring_variant

from ferrox_driver.attention import MMA_STAGES, MMA_WARPS, clusters_fit
from ferrox_driver.bench_decode import bench_stream
from ferrox_driver.device import default_device

SEQS = [2048, 4096, 8192, 16384]
CASES = [
    ((32, 8, 128), "bf16", SEQS),
    ((64, 8, 128), "bf16", SEQS),
    ((28, 4, 128), "bf16", SEQS),
    ((32, 32, 128), "bf16", [32768, 131072]),  # MHA: 96 blocks in clusters of 3
]
CLUSTER = {8: 8, 4: 16, 32: 3}  # chunks per KV head (cluster size) by KV heads


def main() -> None:
    args = sys.argv[1:]
    rings = [(4, 2), (4, 3), (4, 4)]
    cases, cluster = CASES, dict(CLUSTER)
    if "--rings" in args:
        at = args.index("--rings")
        rings = [tuple(map(int, r.split("x"))) for r in args[at + 1].split(",")]  # type: ignore[misc]
        del args[at : at + 2]
    if "--seqs" in args:  # lengths for the GQA shapes
        at = args.index("--seqs")
        seqs = [int(x) for x in args[at + 1].split(",")]
        cases = [(shape, dt, seqs if shape[1] != shape[0] else mha) for shape, dt, mha in CASES]
        del args[at : at + 2]
    if "--mha-cluster" in args:
        at = args.index("--mha-cluster")
        cluster[32] = int(args[at + 1])
        del args[at : at + 2]
    stream = bench_stream(default_device())
    dev = stream.device
    modules: dict[tuple[int, int], Any] = {}
    for p in points(cases, stream, args):
        base = p.plan()
        item = np.dtype(p.dtype).itemsize
        c = cluster[p.n_kv]
        name = f"{base.kernel.removesuffix('_cluster')}_cluster"
        runs: list[tuple[str, Any, Any]] = [("planned", base, None)]
        for warps, s in rings:
            plan = dataclasses.replace(
                base, kernel=name, splits=c, cluster=c, threads=32 * warps, stages=s,
                reserve_stages=max(s, 16 // warps),
            )  # 16 warp-steps' shared memory at least: one block per multiprocessor, as planned
            if not clusters_fit(dev, name, c, p.n_kv, plan.threads, plan.shared_bytes(
                    p.head_dim, item)):  # fmt: skip
                print(f"{p.label}: c{c} with {warps}x{s} does not fit", flush=True)
                continue
            kern = None
            if (warps, s) != (MMA_WARPS[p.head_dim], MMA_STAGES[p.head_dim]):
                if (warps, s) not in modules:
                    modules[warps, s] = ring_variant(p.head_dim, warps, s, dev)
                kern = modules[warps, s].get_function(name)
            runs.append((f"c{c} {warps}x{s}", plan, kern))
        outs = p.outputs(runs)
        errs = p.errors(outs)
        best = p.fastest(runs)
        ref = best["planned"]
        cells = [
            f"{k} {v:.2f} ({100 * (v / ref - 1):+.1f}%, err {errs[k]:.1e})" for k, v in best.items()
        ]
        print(f"{p.label} (planned: {plan_kind(base)}): " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
