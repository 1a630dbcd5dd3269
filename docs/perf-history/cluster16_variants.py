"""Clusters of 16 blocks where one block per multiprocessor leaves them no room: with a
smaller ring (two blocks fit a multiprocessor), 8 clusters of 16 may all be resident, so
the 16 chunks per KV head of 8-KV-head shapes at 4096-131072 tokens could merge on chip
instead of in the combine kernel. For each ring variant of the head_dim 128 kernel
(warps x steps), the planned combine plan, the variant's combine plan (the ring's own
cost) and its cluster plan, timed in turn, three rounds, the fastest kept; in the
benchmark's back-to-back harness on its one stream. First, the resident clusters of 16.

    PYTHONPATH=. python3 docs/perf-history/cluster16_variants.py [shape ...]
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
from points import points, ring_variant

from ferrox_driver.bench_decode import bench_stream
from ferrox_driver.device import default_device

CASES = [
    ((32, 8, 128), "bf16", [4096, 32768, 131072]),
    ((64, 8, 128), "bf16", [4096, 32768]),
]
RINGS = [(4, 3), (2, 6), (4, 2)]  # (warps, steps): 96, 96 and 64 KB


def main() -> None:
    stream = bench_stream(default_device())
    modules = {(w, s): ring_variant(128, w, s, stream.device) for w, s in RINGS}
    for p in points(CASES, stream, sys.argv[1:]):
        base = p.plan()
        item = np.dtype(p.dtype).itemsize
        runs = [("planned", base, None)]
        for (w, s), mod in modules.items():
            ring = dataclasses.replace(base, threads=32 * w, stages=s)
            runs.append((f"{w}x{s}", ring, mod.get_function(base.kernel)))
            clustered = dataclasses.replace(
                ring, kernel=f"{base.kernel}_cluster", cluster=base.splits
            )
            kern = mod.get_function(clustered.kernel)
            shared = clustered.shared_bytes(p.head_dim, item)
            fit = kern.max_active_clusters(base.splits, 32 * w, shared)
            need = p.n_kv
            print(
                f"  {w}x{s}: {fit} clusters of {base.splits} resident "
                f"({shared} B shared), {need} needed",
                flush=True,
            )
            if fit >= need:
                runs.append((f"{w}x{s} cluster", clustered, kern))
        outs = p.outputs(runs)
        best = p.fastest(runs)
        ref = best["planned"]
        cells = [
            f"{k} {v:.2f} us ({100 * (v / ref - 1):+.1f}%, "
            f"diff {np.max(np.abs(outs[k] - outs['planned'])):.1e})"
            for k, v in best.items()
        ]
        print(f"{p.label} ({base.splits} chunks): " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
