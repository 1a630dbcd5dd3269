"""Ran against commit 76e5fcd, which had attention.EARLY_SPLIT and the split kernels'
wait (reverted since: early-after-probe-v15.log); on later code the flag does nothing.

The cluster plans' split kernels launched early (attention.EARLY_SPLIT: programmatic
dependent launch after the kernel before them, which in the back-to-back graph is the
previous decode's) against an ordinary launch: the same bits out, and the time per decode
of each, timed in turn, three rounds, the fastest kept; the benchmark's harness (one graph
of >= 8 decodes over rotated KV sets) on its one stream. Combine plans launch as before
either way (the flag changes nothing for them).

early-split-compare-v15.log was taken with every tensor-core plan launched early and the
combine kernel letting the next kernel start after its own wait; in
early-split-compare-quiet-v15.log a third column is the combine without that trigger.
Combine plans lost at 4096 tokens with or without it, so only cluster plans launch early.

    PYTHONPATH=. python3 docs/perf-history/early_split_compare.py [shape ...]
"""

from __future__ import annotations

import sys

import numpy as np
from points import points

from ferrox_driver import attention
from ferrox_driver.attention import stream_workspace
from ferrox_driver.bench_decode import bench_stream
from ferrox_driver.device import default_device

SEQS = [512, 4096, 32768]
CASES = [
    ((32, 8, 128), "bf16", [512, 4096, 32768, 131072]),
    ((64, 8, 128), "bf16", SEQS),
    ((28, 4, 128), "bf16", SEQS),
    ((32, 32, 128), "bf16", SEQS),
    ((16, 2, 64), "bf16", SEQS),
    ((8, 1, 256), "bf16", SEQS),
    ((32, 8, 128), "f32", SEQS),
    ((16, 2, 64), "f32", [512, 4096]),
]


def main() -> None:
    stream = bench_stream(default_device())
    for p in points(CASES, stream, sys.argv[1:]):
        plan = p.plan()
        floats = plan.workspace_floats(p.n_heads, p.head_dim)
        ws = stream_workspace(stream.device, stream, floats) if floats else None
        modes = {"ordinary": False, "early": True}
        bits, best = [], {}
        for early in modes.values():
            attention.EARLY_SPLIT = early
            p.out.fill_bytes(0xFF, stream)
            p.decode(plan, ws)
            stream.synchronize()
            bits.append(p.out.to_host().view(np.uint8).copy())
        for _ in range(3):
            for mode, early in modes.items():
                attention.EARLY_SPLIT = early
                us = p.time(plan)
                best[mode] = min(best.get(mode, us), us)
        same = all(np.array_equal(bits[0], b) for b in bits)
        ref = best["ordinary"]
        cells = [f"{m} {us:.2f} us ({100 * (us / ref - 1):+.1f}%)" for m, us in best.items()]
        print(
            f"{p.label} {plan.kernel} ({plan.splits} chunks): " + ", ".join(cells)
            + f", {'same bits' if same else 'BITS DIFFER'}",
            flush=True,
        )  # fmt: skip


if __name__ == "__main__":
    main()
