"""The split kernel's blocks merging their chunks themselves through the workspace (a
counter per KV head; FX_MERGE_GRID, `_grid` kernels) against the combine kernel, on every
plan that has no cluster: time per decode back to back over rotated KV sets, and the two
outputs side by side (max abs difference, and against a float64 reference of the first
set up to 32768 tokens).

    PYTHONPATH=. python3 docs/perf-history/grid_merge_compare.py [shape ...]

Each plan is timed three times, alternating, and the median printed. It ran against commit
68a5e65 (`grid-merge-compare-relaxed-v16.log`; `grid-merge-compare-v16.log` against the same
kernels with the counters polled by ld.acquire on one cache line), then against 68a5e65's
kernels with release/acquire atomics instead of __threadfence (`-acqrel-`, not committed
alone) and against 9086ee3, which adds the chunks spread over lanes (`-lanes-`). Both
commits were reverted: on later code there are no `_grid` kernels and FERROX_GRID_MERGE
does nothing, so every line prints "no grid plan".
"""

from __future__ import annotations

import os
import statistics
import sys

import numpy as np
from points import points

import ferrox_driver as fd
from ferrox_driver.attention import stream_workspace
from ferrox_driver.reference import reference_gqa_decode

CASES = [
    ((32, 8, 128), "bf16", [4096, 32768, 131072]),
    ((64, 8, 128), "bf16", [4096, 32768]),
    ((28, 4, 128), "bf16", [1024, 4096, 32768, 131072]),
    ((32, 32, 128), "bf16", [512, 4096, 32768]),
    ((16, 2, 64), "bf16", [4096, 32768, 131072]),
    ((8, 1, 256), "bf16", [512, 4096, 32768, 131072]),
    ((32, 8, 128), "f32", [4096, 32768]),
    ((28, 4, 128), "f32", [4096, 32768]),
    ((16, 2, 64), "f32", [4096, 32768]),
    ((8, 1, 256), "f32", [512, 4096, 32768]),
]


def planned(p, grid: bool):
    saved = os.environ.get("FERROX_GRID_MERGE")
    os.environ["FERROX_GRID_MERGE"] = "1" if grid else "0"
    try:
        return p.plan()
    finally:
        if saved is None:
            os.environ.pop("FERROX_GRID_MERGE", None)
        else:
            os.environ["FERROX_GRID_MERGE"] = saved


def main() -> None:
    stream = fd.Stream()
    for p in points(CASES, stream, sys.argv[1:]):
        plans = {"combine": planned(p, False), "grid": planned(p, True)}
        if not plans["grid"].grid:
            print(f"{p.label} {plans['grid'].kernel}: no grid plan", flush=True)
            continue
        outs = {}
        for name, plan in plans.items():
            floats = plan.workspace_floats(p.n_heads, p.head_dim)
            ws = stream_workspace(stream.device, stream, floats)
            p.out.fill_bytes(0xFF, stream)  # NaN: an unwritten output shows
            p.decode(plan, ws)
            stream.synchronize()
            outs[name] = p.out.to_host().astype(np.float64)
        err = {n: float("nan") for n in outs}
        if p.seq <= 32768:  # (the float64 reference of longer caches takes gigabytes)
            k, v = (a.to_host().astype(np.float64) for a in p.sets[0])
            ref = reference_gqa_decode(
                p.q.to_host().astype(np.float64), k, v, n_heads=p.n_heads, n_kv_heads=p.n_kv,
                head_dim=p.head_dim,
            )  # fmt: skip
            err = {n: float(np.max(np.abs(o - ref.reshape(o.shape)))) for n, o in outs.items()}
        diff = float(np.max(np.abs(outs["grid"] - outs["combine"])))
        times: dict[str, list[float]] = {n: [] for n in plans}
        for _ in range(3):
            for name, plan in plans.items():
                times[name].append(p.time(plan))
        t = {n: statistics.median(ts) for n, ts in times.items()}
        print(
            f"{p.label} {plans['grid'].kernel} ({plans['grid'].splits} chunks): "
            f"combine {t['combine']:.2f} us, grid {t['grid']:.2f} us "
            f"({100 * (t['grid'] / t['combine'] - 1):+.1f}%); |grid - combine| {diff:.2e}, "
            f"vs ref {err['combine']:.2e} / {err['grid']:.2e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
