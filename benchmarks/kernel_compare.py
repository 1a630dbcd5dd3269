"""A change to the split-kernel file against the source before it: the same bits out, and
the time per decode of each (its split and combine kernels both from the file compared),
for the plans plan_split makes (cluster and combine plans), in the benchmark's
back-to-back harness over rotated KV sets. Each plan's kernels are compiled from each
source as the library compiles them (FX_SELECTED and the kernel's entry line), so kernels
made on demand (padded head dims, paired heads, tiles) compare too.

    python3 benchmarks/kernel_compare.py OLD [shape ...]
    python3 benchmarks/kernel_compare.py OLD --padded [shape ...]   # 32/8/D, D not 64/128/256
    python3 benchmarks/kernel_compare.py new FX_STAGES_D128=3 --padded 32/8/80
    python3 benchmarks/kernel_compare.py OLD +try1.cu +try2.cu [shape ...]

+FILE: a further source (a whole kernel file) timed beside the two, labelled by its name.

NAME=VALUE: the old side's kernels compiled with that trait's value (kernel_traits), to
compare a trait's two values (OLD then usually the working tree's file, "new"); the plans
stay the library's, so only traits that fit its launches compare (FX_STAGES_D<D> up to
FX_RESERVE_STAGES_D<D>: the launch's shared memory holds that many steps).

OLD: the kernel file before the change, as a git revision (e.g. HEAD~1; its parts in place) or
a file holding the whole source.
Each kernel is timed twice, alternating, and the faster of its two times is printed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
from _common import points, source_at

import ferrox_driver as fd
from ferrox_driver.decode import plan as attention
from ferrox_driver.driver.compiler import compile_source
from ferrox_driver.kernels.catalogue import kernel_source

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
# head dims padded to a tensor-core kernel's (paired where Tuning.paired_from says)
PADDED_DIMS = (40, 48, 56, 72, 80, 96, 112, 144, 160, 192)
PADDED = [((32, 8, d), "bf16", [4096, 32768, 131072]) for d in PADDED_DIMS]


def main() -> None:
    stream = fd.Stream()
    args = sys.argv[2:]
    cases = PADDED if "--padded" in args else CASES
    defines = dict(a.split("=") for a in args if "=" in a and not a.startswith("+"))
    tries = {Path(a[1:]).stem: Path(a[1:]).read_text() for a in args if a.startswith("+")}
    only = [a for a in args if a != "--padded" and "=" not in a and not a.startswith("+")]
    old = sys.argv[1]
    new_src = kernel_source("gqa_decode_split.cu")
    old_src = (
        new_src
        if old == "new"
        else Path(old).read_text()
        if Path(old).is_file()
        else source_at(old)
    )
    for name, value in defines.items():
        old_src = re.sub(rf"^#define {name} \d+$", f"#define {name} {value}", old_src, flags=re.M)
    sources = {"old": old_src, **tries, "new": new_src}
    # a combine kernel launched early must wait for the split kernel (fx_wait_for_split)
    early = all("fx_wait_for_split" in src for src in sources.values())
    attention.OVERRIDES = attention.Overrides(early_combine=early)
    for p in points(cases, stream, only):
        plans = {k: p.plan() for k in sources}
        plan = plans["new"]
        kernels = {}
        for k, src in sources.items():
            combine = plans[k].combine_spec(p.dtype)
            specs = [plans[k].spec, *([combine] if combine else [])]
            names = [spec.name for spec in specs]
            entries = "\n".join(spec.entry for spec in specs)
            program = compile_source(f"#define FX_SELECTED 1\n{src}\n{entries}\n", name=f"{k}.cu")
            module = fd.Module(program)
            kernels[k] = {n: module.get_function(n) for n in names}
        bits = []
        for k, kern in kernels.items():
            p.out.fill_bytes(0xFF, stream)  # NaN: an unwritten output shows
            p.decode(plans[k], kern)
            stream.synchronize()
            bits.append(p.out.to_host().view(np.uint8).copy())
        same = all(np.array_equal(bits[0], b) for b in bits[1:])
        times: dict[str, float] = {}
        for _ in range(2):
            for k, kern in kernels.items():
                us = p.time(plans[k], kern)
                times[k] = min(times.get(k, us), us)
        rest = ", ".join(
            f"{k} {times[k]:.2f} us ({100 * (times[k] / times['old'] - 1):+.1f}%)"
            for k in sources
            if k != "old"
        )
        print(
            f"{p.label} {plan.kernel} ({plan.splits} chunks): old {times['old']:.2f} us, "
            f"{rest}, {'same bits' if same else 'BITS DIFFER'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
