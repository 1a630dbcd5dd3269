"""Paired plans (two adjacent KV heads' rows read as one row of 2 x head_dim, on the
tensor-core kernel of the next head_dim up) against the plan the library makes, per
head_dim, in one process: the benchmark's back-to-back graph over rotated KV sets, each
plan timed twice, alternating, the faster kept; and the two outputs' largest difference
(the pairs sum in another order, so a few ulps).

    PYTHONPATH=. python3 benchmarks/paired_compare.py [D,D,...] [SEQ,SEQ,...] [bf16|f16]

A D is the shape 32/8/D; a whole shape (64/8/72) may be named instead.
"""

from __future__ import annotations

import sys

import numpy as np
from _common import points

import ferrox_driver as fd
from ferrox_driver.decode import plan as attention


def main(argv: list[str]) -> int:
    dims = argv[1].split(",") if len(argv) > 1 else ["56", "64", "72", "80", "96", "112"]
    seqs = [int(x) for x in argv[2].split(",")] if len(argv) > 2 else [4096, 32768, 131072]
    dtype = argv[3] if len(argv) > 3 else "bf16"
    stream = fd.Stream()
    shipped, paired = attention.OVERRIDES, attention.Overrides(paired=True)
    shapes = [tuple(int(x) for x in (d if "/" in d else f"32/8/{d}").split("/")) for d in dims]
    cases = [((s[0], s[1], s[2]), dtype, seqs) for s in shapes]
    print(f"{dtype}, us per decode (graph replay): the library's plan vs paired")
    for p in points(cases, stream):
        plans = {}
        for name, ov in (("plan", shipped), ("paired", paired)):
            attention.OVERRIDES = ov
            plans[name] = p.plan()
        attention.OVERRIDES = shipped
        if not plans["paired"].paired:
            print(f"{p.label}: no paired plan ({plans['paired'].kernel})", flush=True)
            continue
        outs = []
        for plan in plans.values():
            p.out.fill_bytes(0xFF, stream)  # NaN: an unwritten output shows
            p.decode(plan)
            stream.synchronize()
            outs.append(p.out.to_host().astype(np.float32))
        diff = float(np.max(np.abs(outs[0] - outs[1])))
        times: dict[str, float] = {}
        for _ in range(2):
            for name, plan in plans.items():
                us = p.time(plan)
                times[name] = min(times.get(name, us), us)
        a, b = times["plan"], times["paired"]
        print(
            f"{p.label} {plans['plan'].kernel} {a:.2f} us | {plans['paired'].kernel} "
            f"({plans['paired'].splits} chunks) {b:.2f} us ({100 * (b / a - 1):+.1f}%), "
            f"max diff {diff:.2e}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
