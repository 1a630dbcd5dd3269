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

import ml_dtypes
import numpy as np

import ferrox_driver as fd
from ferrox_driver.attention import plan_split
from ferrox_driver.bench_decode import fill_uniform, rotated_kv_sets, time_split_plan

DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
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
    stream = fd.Stream()
    only = sys.argv[1:]
    for (n_heads, n_kv, hd), dtn, seqs in CASES:
        if [a for a in only if a != "div"] and f"{n_heads}/{n_kv}/{hd}" not in only:
            continue
        dt = DTYPES[dtn]
        item = np.dtype(dt).itemsize
        q = fd.empty((n_heads, hd), dt)
        out = fd.empty((n_heads, hd), dt)
        fill_uniform(q, 1, stream)
        for seq in seqs:
            plan = plan_split(fd.Device(0), dt, n_heads, n_kv, hd, seq)
            kv_bytes = 2 * seq * n_kv * hd * item
            sets, chain = rotated_kv_sets(seq, n_kv, hd, dt, stream, fd.Device(0))
            cells = []
            variants = [(f"{plan.splits}", plan)]
            if "div" in only:  # fewer, longer chunks (many-chunks.log)
                for div in (2, 4):
                    if not plan.cluster and plan.splits // div >= 1:
                        p = dataclasses.replace(plan, splits=plan.splits // div)
                        variants.append((f"{p.splits}", p))
            if plan.tile != 16 and not plan.cluster:  # as many busy blocks as the splits
                variants.append((f"{plan.splits} t16", dataclasses.replace(plan, tile=16)))
            for label, p in variants:
                chunk = math.ceil(math.ceil(seq / p.splits) / p.tile) * p.tile
                busy = -(-seq // chunk) * n_kv
                parts = ("main", "combine", "both") if not p.cluster else ("both",)
                us = [time_split_plan(p, q, out, sets, chain, stream, parts=x) for x in parts]
                pct = 100 * kv_bytes / (us[-1] * 1e-6) / 4.35e12
                times = " / ".join(f"{t:.1f}" for t in us)
                cells.append(f"{label} ({busy} busy): {times} ({pct:.0f}%)")
            ideal = kv_bytes / 4.35e12 * 1e6
            print(
                f"{n_heads}/{n_kv}/{hd} {dtn} {seq:>6} {plan.kernel} t{plan.tile} "
                f"[ideal {ideal:.1f}]: " + "   ".join(cells),
                flush=True,
            )
            for k, v in sets:
                k.close()
                v.close()
        q.close()
        out.close()


if __name__ == "__main__":
    main()
