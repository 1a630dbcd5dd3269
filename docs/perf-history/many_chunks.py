"""Where the time of the shapes under 85% of the ceiling at long lengths goes: the split
kernel alone, the combine kernel alone and both, for the plan and for fewer chunks, in the
benchmark's back-to-back harness (one graph of >= 8 decodes over rotated KV sets).

    PYTHONPATH=. python3 docs/perf-history/many_chunks.py [div] [shape ...]

A cell "N (B busy): main / combine / both" is N chunks per KV head, of which B blocks have
tokens ("t16": chunks in multiples of 16 tokens rather than the plan's tile); % is both
against 4.35 TB/s.
"""

from __future__ import annotations

import dataclasses
import math
import sys

from points import CEILING, points

import ferrox_driver as fd

CASES = [
    ((16, 2, 64), "bf16", [32768, 131072]),
    ((16, 2, 64), "bf16", [8192]),
    ((8, 1, 256), "bf16", [32768, 131072]),
    ((28, 4, 128), "bf16", [32768]),
    ((32, 8, 128), "bf16", [32768]),
    ((28, 4, 128), "bf16", [131072]),
    ((16, 2, 64), "f32", [32768, 131072]),
    ((8, 1, 256), "f32", [131072]),
    ((28, 4, 128), "f32", [32768]),
]


def main() -> None:
    args = sys.argv[1:]
    shapes = [a for a in args if a != "div"]
    for p in points(CASES, fd.Stream(), shapes):
        plan = p.plan()
        variants = [(f"{plan.splits}", plan)]
        if "div" in args:  # fewer, longer chunks (many-chunks.log)
            for div in (2, 4):
                if not plan.cluster and plan.splits // div >= 1:
                    fewer = dataclasses.replace(plan, splits=plan.splits // div)
                    variants.append((f"{fewer.splits}", fewer))
        if plan.tile != 16 and not plan.cluster:  # as many busy blocks as the splits
            variants.append((f"{plan.splits} t16", dataclasses.replace(plan, tile=16)))
        cells = []
        for label, v in variants:
            chunk = math.ceil(math.ceil(p.seq / v.splits) / v.tile) * v.tile
            busy = -(-p.seq // chunk) * p.n_kv
            parts = ("main", "combine", "both") if not v.cluster else ("both",)
            us = [p.time(v, parts=x) for x in parts]
            times = " / ".join(f"{t:.1f}" for t in us)
            cells.append(f"{label} ({busy} busy): {times} ({p.pct(us[-1]):.0f}%)")
        ideal = p.kv_bytes / CEILING * 1e6
        print(
            f"{p.label} {plan.kernel} t{plan.tile} [ideal {ideal:.1f}]: " + "   ".join(cells),
            flush=True,
        )


if __name__ == "__main__":
    main()
