"""The fp16/bf16 head_dim 128 kernel's ring at long lengths: the planned one (4 warps x 4
steps) against deeper ones (4 x 6, 8 x 3), timed in turn, three rounds, the fastest of
each kept; in the benchmark's back-to-back harness over rotated KV sets, on the
benchmark's one stream. v6 and v10 measured the deeper rings 0.5-1% faster from 32768
tokens and 4-6% slower at 4096, in harnesses of their time.

    PYTHONPATH=. python3 docs/perf-history/ring_variants.py [shape ...]
"""

from __future__ import annotations

import dataclasses
import sys

from points import points, ring_variant

from ferrox_driver.bench_decode import bench_stream
from ferrox_driver.device import default_device

CASES = [
    ((32, 32, 128), "bf16", [32768, 131072]),
    ((32, 8, 128), "bf16", [4096, 32768, 131072]),
    ((64, 8, 128), "bf16", [32768, 131072]),
    ((28, 4, 128), "bf16", [32768, 131072]),
]
RINGS = [(4, 6), (8, 3)]  # (warps, steps)


def main() -> None:
    stream = bench_stream(default_device())
    modules = {(w, s): ring_variant(128, w, s, stream.device) for w, s in RINGS}
    for p in points(CASES, stream, sys.argv[1:]):
        base = p.plan()
        runs = [("4x4 (planned)", base, None)]
        for (w, s), mod in modules.items():
            plan = dataclasses.replace(base, threads=32 * w, stages=s)
            runs.append((f"{w}x{s}", plan, mod.get_function(base.kernel)))
        best: dict[str, float] = {}
        for _ in range(3):
            for label, plan, kern in runs:
                us = p.time(plan, kern)
                best[label] = min(best.get(label, us), us)
        ref = best["4x4 (planned)"]
        cells = [f"{k} {v:.1f} us ({100 * (v / ref - 1):+.1f}%)" for k, v in best.items()]
        print(f"{p.label} ({base.splits} chunks): " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
