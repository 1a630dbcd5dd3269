"""A verify on the rows kernel (split_rows.cuh, two launches) against the tail, split and
combine kernels (split_verify.cuh, three), in one process, graph-replayed over rotated KV
sets, next to the one-token decode of the same length; ``--min-chunk`` adds rows plans of
other chunk floors (Overrides.rows_min_chunk).

    PYTHONPATH=. python benchmarks/verify_rows_compare.py [--shapes 32/8/128 28/4/128]
        [--seqs 4096 32768 131072] [--n-q 2 4 8 16] [--dtype bf16] [--min-chunk 256 512]
"""

from __future__ import annotations

import argparse
import dataclasses

import ml_dtypes
import numpy as np

from ferrox_driver.apps.bench.verify import measure_verify_point
from ferrox_driver.decode import plan as planner
from ferrox_driver.decode.launches import plan_rows
from ferrox_driver.driver.device import default_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=["32/8/128", "28/4/128"])
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "f16"))
    parser.add_argument("--seqs", nargs="+", type=int, default=[4096, 32768, 131072])
    parser.add_argument("--n-q", nargs="+", type=int, default=[2, 4, 8, 16])
    parser.add_argument("--min-chunk", nargs="*", type=int, default=[])
    args = parser.parse_args()
    dev = default_device()
    base = planner.OVERRIDES
    rows = dataclasses.replace(base, verify_rows=True)
    variants = {"tail": dataclasses.replace(base, verify_rows=False), "rows": rows}
    for m in args.min_chunk:
        variants[f"rows/{m}"] = dataclasses.replace(rows, rows_min_chunk=m)
    names = list(variants)
    print(f"{'shape':>9} {'seq':>7} {'n_q':>4} {'1 tok':>7} "
          + " ".join(f"{n:>9}" for n in names) + "  rows plan")  # fmt: skip
    for shape_s in args.shapes:
        shape = tuple(int(x) for x in shape_s.split("/"))
        for seq in args.seqs:
            one = measure_verify_point(shape, seq, 1, args.dtype, 20, dev)  # type: ignore[arg-type]
            for n_q in args.n_q:
                times = []
                for name in names:
                    planner.OVERRIDES = variants[name]
                    times.append(measure_verify_point(shape, seq, n_q, args.dtype, 20, dev))  # type: ignore[arg-type]
                planner.OVERRIDES = rows
                h, kv, d = shape
                rp = plan_rows(dev, np.dtype(ml_dtypes.bfloat16), n_q, h, kv, d, seq, True, 0)
                plan = (
                    "-"
                    if rp is None
                    else (f"warps={rp.spec.row_warps} blocks={rp.row_blocks} splits={rp.splits}")
                )
                planner.OVERRIDES = base
                cells = " ".join(f"{t:6.1f}/{t / one:4.2f}"[:9].rjust(9) for t in times)
                print(f"{shape_s:>9} {seq:>7} {n_q:>4} {one:7.1f} {cells}  {plan}", flush=True)


if __name__ == "__main__":
    main()
