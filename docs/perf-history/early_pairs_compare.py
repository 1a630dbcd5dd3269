"""Combine plans with the split kernel and the combine kernel each launched early or not
(four pairs), timed in turn, three rounds, the fastest kept; the benchmark's harness on
its one stream. Which of the two early launches costs the combine plans at 4096 tokens
(early-split-compare-v15.log)? The library launches only cluster plans' split kernels
early; here a wrapper forces the attribute on a combine plan's split kernel.

    PYTHONPATH=. python3 docs/perf-history/early_pairs_compare.py [shape ...]
"""

from __future__ import annotations

import sys
from typing import Any

from points import points

from ferrox_driver import attention
from ferrox_driver.attention import SPLIT_FILE
from ferrox_driver.bench_decode import bench_stream
from ferrox_driver.device import default_device
from ferrox_driver.module_cache import get_kernel

CASES = [
    ((32, 8, 128), "bf16", [4096, 32768]),
    ((64, 8, 128), "bf16", [4096]),
    ((28, 4, 128), "bf16", [4096, 32768]),
    ((16, 2, 64), "bf16", [4096]),
    ((8, 1, 256), "bf16", [4096]),
    ((32, 32, 128), "bf16", [4096]),
]


class Early:
    """A kernel whose every launch is early (programmatic dependent launch)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def launch(self, *args: Any, **kw: Any) -> None:
        self.kernel.launch(*args, **kw, early=True)


def main() -> None:
    stream = bench_stream(default_device())
    for p in points(CASES, stream, sys.argv[1:]):
        plan = p.plan()
        assert not plan.cluster, plan
        split = get_kernel(SPLIT_FILE, plan.kernel, stream.device)
        best: dict[str, float] = {}
        for _ in range(3):
            for split_early in (False, True):
                for combine_early in (False, True):
                    attention.EARLY_COMBINE = combine_early
                    us = p.time(plan, Early(split) if split_early else None)
                    key = f"split {'early' if split_early else 'plain'}/combine " + (
                        "early" if combine_early else "plain"
                    )
                    best[key] = min(best.get(key, us), us)
        ref = best["split plain/combine early"]  # the library's launch
        cells = [f"{k} {v:.2f} us ({100 * (v / ref - 1):+.1f}%)" for k, v in best.items()]
        print(f"{p.label} ({plan.splits} chunks): " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
