"""A change to the split-kernel file against the source before it: the same bits out, and
the time per decode of each (its split and combine kernels both from the file compared),
for the plans plan_split makes (cluster and combine plans), in the benchmark's
back-to-back harness over rotated KV sets.

    python3 benchmarks/kernel_compare.py OLD [shape ...]

OLD: the kernel file before the change, as a git revision (e.g. HEAD~1; its parts in place) or
a file holding the whole source.
Each kernel is timed twice, alternating, and the faster of its two times is printed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from _common import points, source_at

import ferrox_driver as fd
from ferrox_driver import attention
from ferrox_driver.compiler import compile_source, kernel_source

CASES = [
    ((32, 8, 128), "bf16", [512, 4096, 32768]),
    ((8, 1, 256), "bf16", [512, 32768, 131072]),
    ((16, 2, 64), "bf16", [131072]),
    ((28, 4, 128), "bf16", [32768]),
    ((32, 32, 128), "bf16", [32768]),
    ((64, 8, 128), "f16", [4096]),
    ((32, 8, 128), "f32", [512]),
    ((16, 2, 64), "f32", [4096]),
    ((8, 1, 256), "f32", [4096]),
    # cluster plans (merged on chip) of the other shapes
    ((16, 2, 64), "bf16", [512, 1024]),
    ((28, 4, 128), "bf16", [512]),
    ((64, 8, 128), "bf16", [512]),
]


def main() -> None:
    stream = fd.Stream()
    old = Path(sys.argv[1])
    sources = {
        "old": old.read_text() if old.is_file() else source_at(sys.argv[1]),
        "new": kernel_source("gqa_decode_split.cu"),
    }
    modules = {k: fd.Module(compile_source(src, name=f"{k}.cu")) for k, src in sources.items()}
    # a combine kernel launched early must wait for the split kernel (fx_wait_for_split)
    early = all("fx_wait_for_split" in src for src in sources.values())
    attention.OVERRIDES = attention.Overrides(early_combine=early)
    for p in points(CASES, stream, sys.argv[2:]):
        plan = p.plan()
        combine = f"gqa_split_combine_{p.dtype_name}"
        names = [plan.kernel] if plan.cluster else [plan.kernel, combine]
        kernels = {k: {n: m.get_function(n) for n in names} for k, m in modules.items()}
        bits = []
        for kern in kernels.values():
            p.out.fill_bytes(0xFF, stream)  # NaN: an unwritten output shows
            p.decode(plan, kern)
            stream.synchronize()
            bits.append(p.out.to_host().view(np.uint8).copy())
        same = np.array_equal(bits[0], bits[1])
        times: dict[str, float] = {}
        for _ in range(2):
            for k, kern in kernels.items():
                us = p.time(plan, kern)
                times[k] = min(times.get(k, us), us)
        print(
            f"{p.label} {plan.kernel} ({plan.splits} chunks): "
            f"old {times['old']:.2f} us, new {times['new']:.2f} us "
            f"({100 * (times['new'] / times['old'] - 1):+.1f}%), "
            f"{'same bits' if same else 'BITS DIFFER'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
