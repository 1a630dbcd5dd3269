"""Do L2 prefetch-size hints on the K/V copies stream faster? The kernels' cp.async copies
16 bytes per lane with no hint; PTX lets each ask the L2 to fetch 128 or 256 bytes around
it (`.L2::128B`, `.L2::256B`: a row of one KV head is 128-512 bytes), or mark the data
evict-first (read once). Same kernels otherwise, the plans of plan_split, the benchmark's
back-to-back harness over rotated KV sets.

    PYTHONPATH=. python3 docs/perf-history/l2_hint_variants.py [shape ...]
"""

from __future__ import annotations

import sys

from points import edited_source, load_variant, points

import ferrox_driver as fd

CASES = [
    ((32, 32, 128), "bf16", [32768, 131072]),
    ((32, 8, 128), "bf16", [4096, 32768, 131072]),
    ((28, 4, 128), "bf16", [32768]),
    ((16, 2, 64), "bf16", [32768, 131072]),
    ((8, 1, 256), "bf16", [131072]),
    ((32, 8, 128), "f32", [32768]),
]
COPY = 'asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src),'
EVICT_FIRST = (
    "unsigned long long pol;\n"
    '    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));\n'
    '    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;"'
    ' ::"r"(d), "l"(src),'
)
OPERANDS = '"r"(ok ? 16 : 0)\n                 : "memory");'
VARIANTS = {  # edits of the kernel file
    "shipped": [],
    "L2::128B": [(COPY, COPY.replace("global [", "global.L2::128B ["))],
    "L2::256B": [(COPY, COPY.replace("global [", "global.L2::256B ["))],
    "evict_first": [(COPY, EVICT_FIRST), (OPERANDS, OPERANDS.replace(")\n", '), "l"(pol)\n'))],
}


def main() -> None:
    stream = fd.Stream()
    modules = {
        label: load_variant(edited_source(edits), "l2_hint.cu") for label, edits in VARIANTS.items()
    }
    for p in points(CASES, stream, sys.argv[1:]):
        plan = p.plan()
        cells = []
        for label, module in modules.items():
            us = p.time(plan, module.get_function(plan.kernel))
            cells.append(f"{label} {us:.1f} ({p.pct(us):.0f}%)")
        print(f"{p.label}: " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
