"""Time the on-chip (thread block cluster) merge against the combine kernel, by cluster
size, in the benchmark's back-to-back harness (one graph of >= 8 decodes over rotated KV
sets); first, how many clusters of each size the tensor-core kernels can hold at once.

    PYTHONPATH=. python3 docs/perf-history/cluster_variants.py [shape ...]

Columns: "combine" is the plan with the combine kernel (FERROX_CLUSTER=0); "cN" the
cluster kernel with N chunks per KV head (only sizes whose clusters are all resident).
"""

from __future__ import annotations

import dataclasses
import sys

import ml_dtypes
import numpy as np
from points import CEILING, points

import ferrox_driver as fd
from ferrox_driver.attention import (
    SPLIT_FILE,
    TILE,
    cluster_recv_bytes,
    clusters_fit,
    plan_split,
)
from ferrox_driver.module_cache import get_kernel

SEQS = [512, 4096, 32768, 131072]
SIZES = {  # cluster sizes tried per (shape, dtype)
    ((32, 8, 128), "bf16"): [8, 12, 13, 14, 15, 16],
    ((32, 8, 128), "f32"): [8, 12, 14, 16],
    ((64, 8, 128), "bf16"): [8, 14, 16],
    ((32, 32, 128), "bf16"): [2, 3, 4],
    ((28, 4, 128), "bf16"): [8, 16],
}
CASES = [(shape, dtype, SEQS) for shape, dtype in SIZES]


def resident_clusters(device: fd.Device) -> None:
    for name in ("gqa_split_mma_bf16_d128", "gqa_split_tc32_f32_d128", "gqa_split_mma_bf16_d64"):
        dt = np.float32 if "f32" in name else ml_dtypes.bfloat16
        hd = int(name.rsplit("d", 1)[1])
        plan = plan_split(device, dt, 8 * 8, 8, hd, 1 << 20)  # a combine plan: the ring
        kern = get_kernel(SPLIT_FILE, f"{name}_cluster", device)
        shared = plan.shared_bytes(hd, np.dtype(dt).itemsize) + cluster_recv_bytes(hd)
        sizes = {c: kern.max_active_clusters(c, plan.threads, shared) for c in range(1, 17)}
        print(f"{name}_cluster resident clusters by size: {sizes}", flush=True)


def main() -> None:
    stream = fd.Stream()
    resident_clusters(stream.device)
    for p in points(CASES, stream, sys.argv[1:]):
        base = p.plan(clusters=False)
        item = np.dtype(p.dtype).itemsize
        runs = [("combine", base)]
        sizes = SIZES[(p.n_heads, p.n_kv, p.head_dim), p.dtype_name]
        for c in sizes if base.tensor_cores else []:  # no cluster kernel on CUDA cores
            name = f"{base.kernel}_cluster"
            plan = dataclasses.replace(base, kernel=name, splits=c, cluster=c)
            shared = plan.shared_bytes(p.head_dim, item)  # with the cluster's receive area
            if c <= -(-p.seq // TILE) and clusters_fit(
                stream.device, name, c, p.n_kv, base.threads, shared
            ):
                runs.append((f"c{c}", plan))
        cells = []
        for label, plan in runs:
            us = p.time(plan)
            cells.append(f"{label} {us:.1f} ({p.pct(us):.0f}%)")
        print(f"{p.label} (us, % of {CEILING / 1e12:.2f} TB/s): " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
