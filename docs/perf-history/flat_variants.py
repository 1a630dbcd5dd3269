"""Flat plans against chunked ones: the KV heads' tokens in a row, cut into one equal run
per multiprocessor (attention.flat_plan), against whole chunks per KV head with the combine
kernel (8 or 32 KV heads x chunks = 128 of the H200's 132 multiprocessors); in the
benchmark's back-to-back harness, each pair timed ROUNDS times alternately (medians).

    PYTHONPATH=. python3 docs/perf-history/flat_variants.py [shape ...]

Also checks that the two plans' outputs agree (they sum in different chunks, so to
rounding, not bit for bit).
"""

from __future__ import annotations

import statistics
import sys

import numpy as np
from points import points

import ferrox_driver as fd
from ferrox_driver.attention import FLAT_HEAD_DIMS, flat_plan

SEQS = [4096, 32768, 131072]
CASES = [
    ((32, 32, 128), "bf16", SEQS),
    ((32, 8, 128), "bf16", SEQS),
    ((64, 8, 128), "bf16", SEQS),
    ((64, 8, 128), "f32", SEQS),
    ((32, 8, 128), "f32", [4096, 32768]),
    ((16, 2, 64), "bf16", SEQS),
]
ROUNDS = 3


def main() -> None:
    stream = fd.Stream()
    wave = stream.device.multiprocessor_count
    for p in points(CASES, stream, sys.argv[1:]):
        base = p.plan(clusters=False, flat=False)
        if not base.tensor_cores or p.head_dim not in FLAT_HEAD_DIMS:
            print(f"{p.label}: no flat kernel for this plan", flush=True)
            continue
        flat = flat_plan(base, stream.device, p.n_kv, wave)
        outs = []
        for plan in (base, flat):
            ws = fd.empty((plan.workspace_floats(p.n_heads, p.head_dim),), np.float32)
            p.decode(plan, ws)
            stream.synchronize()
            outs.append(p.out.to_host(stream).astype(np.float64))
            ws.close()
        diff = float(np.max(np.abs(outs[0] - outs[1])))
        times: dict[str, list[float]] = {"chunked": [], "flat": []}
        for _ in range(ROUNDS):
            times["chunked"].append(p.time(base))
            times["flat"].append(p.time(flat))
        a, b = (statistics.median(times[n]) for n in ("chunked", "flat"))
        print(
            f"{p.label}: chunked {base.splits}x{p.n_kv} {a:.1f} us ({p.pct(a):.0f}%)  "
            f"flat {wave} runs {b:.1f} us ({p.pct(b):.0f}%)  {100 * (b / a - 1):+.1f}%  "
            f"max |diff| {diff:.1e}  [{' '.join(f'{x:.1f}' for x in times['chunked'])} | "
            f"{' '.join(f'{x:.1f}' for x in times['flat'])}]",
            flush=True,
        )


if __name__ == "__main__":
    main()
