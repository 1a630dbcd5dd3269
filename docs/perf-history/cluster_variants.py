"""Time the on-chip (thread block cluster) merge against the combine kernel, by cluster
size, in the benchmark's back-to-back harness (one graph of >= 8 decodes over rotated KV
sets); first, how many clusters of each size the tensor-core kernels can hold at once.

    PYTHONPATH=. python3 docs/perf-history/cluster_variants.py

Columns: "combine" is the plan with the combine kernel (FERROX_CLUSTER=0); "cN" the
cluster kernel with N chunks per KV head (only sizes whose clusters are all resident).
"""

from __future__ import annotations

import dataclasses
import os

import ml_dtypes
import numpy as np

import ferrox_driver as fd
from ferrox_driver.attention import SPLIT_FILE, TILE, clusters_fit, plan_split
from ferrox_driver.bench_decode import fill_uniform, rotated_kv_sets, time_split_plan
from ferrox_driver.module_cache import get_kernel

SEQS = [512, 4096, 32768, 131072]
CASES = [
    ((32, 8, 128), "bf16", [8, 12, 13, 14, 15, 16]),
    ((32, 8, 128), "f32", [8, 12, 14, 16]),
    ((64, 8, 128), "bf16", [8, 14, 16]),
    ((32, 32, 128), "bf16", [2, 3, 4]),
    ((28, 4, 128), "bf16", [8, 16]),
]
DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}


def main() -> None:
    dev = fd.Device(0)
    stream = fd.Stream()
    for name in ("gqa_split_mma_bf16_d128", "gqa_split_tc32_f32_d128", "gqa_split_mma_bf16_d64"):
        dt = np.float32 if "f32" in name else ml_dtypes.bfloat16
        hd = int(name.rsplit("d", 1)[1])
        os.environ["FERROX_CLUSTER"] = "0"
        plan = plan_split(dev, dt, 8 * 8, 8, hd, 1 << 20)
        os.environ.pop("FERROX_CLUSTER")
        kern = get_kernel(SPLIT_FILE, f"{name}_cluster", dev)
        shared = plan.shared_bytes(hd, np.dtype(dt).itemsize)
        sizes = {c: kern.max_active_clusters(c, plan.threads, shared) for c in range(1, 17)}
        print(f"{name}_cluster resident clusters by size: {sizes}")
    for (n_heads, n_kv, hd), dtn, sizes in CASES:
        dt = DTYPES[dtn]
        item = np.dtype(dt).itemsize
        q = fd.empty((n_heads, hd), dt)
        out = fd.empty((n_heads, hd), dt)
        fill_uniform(q, 1, stream)
        print(f"{n_heads}/{n_kv}/{hd} {dtn} (us per decode, back to back; % of 4.45 TB/s)")
        for seq in SEQS:
            kv_bytes = 2 * seq * n_kv * hd * item
            sets, chain = rotated_kv_sets(seq, n_kv, hd, dt, stream, dev)
            os.environ["FERROX_CLUSTER"] = "0"
            base = plan_split(dev, dt, n_heads, n_kv, hd, seq)
            os.environ.pop("FERROX_CLUSTER")
            runs = [("combine", base)]
            shared = base.shared_bytes(hd, item)
            for c in sizes if base.tensor_cores else []:  # no cluster kernel on CUDA cores
                name = f"{base.kernel}_cluster"
                if c <= -(-seq // TILE) and clusters_fit(dev, name, c, n_kv, base.threads, shared):
                    plan = dataclasses.replace(base, kernel=name, splits=c, cluster=c)
                    runs.append((f"c{c}", plan))
            cells = []
            for label, plan in runs:
                us = time_split_plan(plan, q, out, sets, chain, stream)
                pct = 100 * kv_bytes / (us * 1e-6) / 4.45e12
                cells.append(f"{label} {us:.1f} ({pct:.0f}%)")
            print(f"  {seq:>7}: " + "  ".join(cells), flush=True)
            for k, v in sets:
                k.close()
                v.close()


if __name__ == "__main__":
    main()
