"""Tensor-core chunk granularity (64, 32 or 16 tokens) at short lengths, with the combine
kernel and, where the chunks fit one resident cluster per KV head, the on-chip merge; in
the benchmark's back-to-back harness (one graph of >= 8 decodes over rotated KV sets).

    PYTHONPATH=. python3 docs/perf-history/tile_variants.py [shape ...]

A cell "tT/N" is a tile of T tokens, N chunks per KV head; "+c" merges in clusters. The
last column is what plan_split picks.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
from points import points

import ferrox_driver as fd
from ferrox_driver.attention import clusters_fit

SEQS = [512, 1024, 4096]
CASES = [
    ((8, 1, 256), "f32", SEQS),
    ((8, 1, 256), "bf16", SEQS),
    ((16, 2, 64), "f32", SEQS),
    ((16, 2, 64), "bf16", SEQS),
    ((28, 4, 128), "bf16", SEQS),
    ((32, 8, 128), "bf16", SEQS),
    ((64, 8, 128), "bf16", SEQS),
    ((32, 8, 128), "f32", SEQS),
    ((64, 8, 128), "f32", SEQS),
    ((28, 4, 128), "f32", SEQS),
    ((16, 8, 128), "bf16", SEQS),
    ((16, 4, 256), "bf16", SEQS),
]
TC_TILES = (64, 32, 16)


def main() -> None:
    stream = fd.Stream()
    for p in points(CASES, stream, sys.argv[1:]):
        # the most chunks, the combine kernel (at 32768: fp32 group 4 stays on tensor cores)
        base = p.plan(32768, clusters=False)
        if not base.tensor_cores:
            print(f"{p.label}: CUDA-core plan, no tiles to compare", flush=True)
            continue
        picked = p.plan()
        item = np.dtype(p.dtype).itemsize
        runs = []
        for t in TC_TILES:
            s = min(base.splits, -(-p.seq // t))
            runs.append((f"t{t}/{s}", dataclasses.replace(base, splits=s, tile=t)))
            name = f"{base.kernel}_cluster"
            plan = dataclasses.replace(base, kernel=name, splits=s, tile=t, cluster=s)
            shared = plan.shared_bytes(p.head_dim, item)  # with the cluster's receive area
            if clusters_fit(stream.device, name, s, p.n_kv, base.threads, shared):
                runs.append((f"t{t}/{s}+c", plan))
        cells = [f"{label} {p.time(plan):.1f}" for label, plan in runs]
        pick = f"t{picked.tile}/{picked.splits}{'+c' if picked.cluster else ''}"
        print(f"{p.label} (us): " + "  ".join(cells) + f"  | picked {pick}", flush=True)


if __name__ == "__main__":
    main()
