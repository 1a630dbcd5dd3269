"""Where a verify's time goes: each of its three launches (tail, split, combine) timed alone,
graph-replayed over rotated KV sets, next to the whole verify and the one-token decode.
Run it twice to compare plans, e.g. with FERROX_CLUSTER=0 (the one-token decode without
clusters, as the verify's split kernel is planned).

    PYTHONPATH=. python benchmarks/verify_parts.py [--seqs 4096 32768] [--n-q 1 2 8]
"""

from __future__ import annotations

import argparse

from ferrox_driver.apps.bench.verify import measure_verify_point
from ferrox_driver.decode.launches import plan_split
from ferrox_driver.driver.device import default_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="32/8/128")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "f16", "fp8"))
    parser.add_argument("--seqs", nargs="+", type=int, default=[4096, 32768, 131072])
    parser.add_argument("--n-q", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument(
        "--parts",
        action="store_true",
        help="time each launch alone too "
        "(the split kernel alone reads the prefix length the tail last wrote)",
    )
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split("/"))
    dev = default_device()
    print(f"{'seq':>7} {'n_q':>4} {'whole':>8} {'tail':>7} {'split':>7} {'combine':>8}  plan")
    for seq in args.seqs:
        for n_q in args.n_q:
            whole = measure_verify_point(shape, seq, n_q, args.dtype, 20, dev)  # type: ignore[arg-type]
            parts = ["", "", ""]
            if n_q > 1 and args.parts:
                for at in range(3):
                    us = measure_verify_point(shape, seq, n_q, args.dtype, 20, dev, only=(at,))  # type: ignore[arg-type]
                    parts[at] = f"{us:.1f}"
            h, kv, d = shape
            import ml_dtypes
            import numpy as np

            plan = plan_split(dev, np.dtype(ml_dtypes.bfloat16), n_q * h, kv, d,
                              max(1, seq - (n_q if n_q > 1 else 0)), True, 0, "",
                              verify=n_q > 1)  # fmt: skip
            print(f"{seq:>7} {n_q:>4} {whole:8.1f} {parts[0]:>7} {parts[1]:>7} {parts[2]:>8}  "
                  f"{plan.spec.name} splits={plan.splits} tiles={plan.head_tiles} "
                  f"cluster={plan.cluster}")  # fmt: skip


if __name__ == "__main__":
    main()
