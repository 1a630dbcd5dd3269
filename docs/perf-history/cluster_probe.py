"""Which plans merge their chunks in thread block clusters on this GPU, and how many
clusters of each size the tensor-core kernels can hold at once.

    PYTHONPATH=. python3 docs/perf-history/cluster_probe.py
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

import ferrox_driver as fd
from ferrox_driver.attention import (
    MAX_CLUSTER,
    MMA_STAGES,
    MMA_WARPS,
    SPLIT_FILE,
    SplitPlan,
    plan_split,
)
from ferrox_driver.bench_decode import SEQ_LENS, SHAPES
from ferrox_driver.module_cache import get_kernel

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}


def main() -> None:
    dev = fd.Device(0)
    print(dev.name, dev.compute_capability, dev.multiprocessor_count, "SMs")
    for d in (64, 128, 256):
        name = f"gqa_split_mma_bf16_d{d}_cluster"
        plan = SplitPlan(name, True, 1, 32, 1, 32 * MMA_WARPS[d], stages=MMA_STAGES[d])
        shared = plan.shared_bytes(d, 2)
        kernel = get_kernel(SPLIT_FILE, name, dev)
        sizes = {c: kernel.max_active_clusters(c, plan.threads, shared) for c in (1, 2, 4, 8, 16)}
        print(f"{name}: clusters resident at once by size {sizes} (max size {MAX_CLUSTER})")
    for n_heads, n_kv, hd in SHAPES:
        for dt in DTYPES:
            row = []
            for seq in SEQ_LENS:
                p = plan_split(dev, DTYPES[dt], n_heads, n_kv, hd, seq)
                row.append(f"{seq}: {p.splits}{'c' if p.cluster else ''}")
            print(f"{n_heads}/{n_kv}/{hd} {dt}: splits per KV head (c = cluster) {', '.join(row)}")


if __name__ == "__main__":
    main()
