"""Do L2 prefetch-size hints on the K/V copies stream faster? The kernels' cp.async copies
16 bytes per lane with no hint; PTX lets each ask the L2 to fetch 128 or 256 bytes around
it (`.L2::128B`, `.L2::256B`: a row of one KV head is 128-512 bytes), or mark the data
evict-first (read once). Same kernels otherwise, the plans of plan_split, the benchmark's
back-to-back harness over rotated KV sets.

    PYTHONPATH=. python3 docs/perf-history/l2_hint_variants.py
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

import ferrox_driver as fd
from ferrox_driver.attention import plan_split
from ferrox_driver.bench_decode import fill_uniform, rotated_kv_sets, time_split_plan
from ferrox_driver.compiler import compile_source, kernel_source
from ferrox_driver.launch import Module

DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
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
VARIANTS = {
    "shipped": None,
    "L2::128B": COPY.replace("global [", "global.L2::128B ["),
    "L2::256B": COPY.replace("global [", "global.L2::256B ["),
    "evict_first": EVICT_FIRST,
}


def variant_source(copy: str | None) -> str:
    src = kernel_source("gqa_decode_split.cu")
    if copy is None:
        return src
    assert src.count(COPY) == 1
    src = src.replace(COPY, copy)
    if "cache_hint" in copy:  # the policy operand
        src = src.replace(
            '"r"(ok ? 16 : 0)\n                 : "memory");',
            '"r"(ok ? 16 : 0), "l"(pol)\n                 : "memory");',
        )
    return src


def main() -> None:
    dev = fd.Device(0)
    stream = fd.Stream()
    modules = {
        label: Module(compile_source(variant_source(c), name="l2_hint.cu"), dev)
        for label, c in VARIANTS.items()
    }
    for (n_heads, n_kv, hd), dtn, seqs in CASES:
        dt = DTYPES[dtn]
        item = np.dtype(dt).itemsize
        q = fd.empty((n_heads, hd), dt)
        out = fd.empty((n_heads, hd), dt)
        fill_uniform(q, 1, stream)
        for seq in seqs:
            plan = plan_split(dev, dt, n_heads, n_kv, hd, seq)
            sets, chain = rotated_kv_sets(seq, n_kv, hd, dt, stream, dev)
            kv_bytes = 2 * seq * n_kv * hd * item
            cells = []
            for label, module in modules.items():
                kern = module.get_function(plan.kernel)
                us = time_split_plan(plan, q, out, sets, chain, stream, kern)
                pct = 100 * kv_bytes / (us * 1e-6) / 4.35e12
                cells.append(f"{label} {us:.1f} ({pct:.0f}%)")
            print(f"{n_heads}/{n_kv}/{hd} {dtn} {seq:>6}: " + "   ".join(cells), flush=True)
            for k, v in sets:
                k.close()
                v.close()
        q.close()
        out.close()


if __name__ == "__main__":
    main()
