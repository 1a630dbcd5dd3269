"""How many chunks, of what granularity, for the tensor-core kernels: whole waves of blocks
at long lengths (the one-wave plans leave multiprocessors idle, e.g. 128 of 132 for
32/32/128 and 32/8/128), and fewer chunks merged on chip against many merged by the
combine kernel at 4096 tokens; in the benchmark's back-to-back harness (one graph of >= 8
decodes over rotated KV sets).

    PYTHONPATH=. python3 docs/perf-history/wave_variants.py

A cell "tT/N" is a tile of T tokens and N chunks per KV head (N x KV heads blocks); "+c"
merges in clusters. "plan" is what plan_split picks.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
from points import points

import ferrox_driver as fd
from ferrox_driver.attention import MAX_SPLITS, _blocks_per_sm, clusters_fit
from ferrox_driver.module_cache import get_kernel

CASES = [
    ((32, 32, 128), "bf16", [32768, 131072]),
    ((32, 8, 128), "bf16", [4096, 32768, 131072]),
    ((64, 8, 128), "bf16", [32768]),
    ((28, 4, 128), "bf16", [32768]),
    ((16, 2, 64), "bf16", [32768]),
    ((16, 2, 64), "f32", [4096]),
    ((8, 1, 256), "f32", [4096]),
    ((32, 8, 128), "f32", [32768]),
]


def candidates(plan, seq, n_kv, wave, dev, hd, item):  # type: ignore[no-untyped-def]
    """(label, plan) pairs to time at ``seq`` tokens."""
    runs = [(f"plan t{plan.tile}/{plan.splits}{'+c' if plan.cluster else ''}", plan)]
    base = dataclasses.replace(plan, kernel=plan.kernel.removesuffix("_cluster"), cluster=0)
    shared = plan.shared_bytes(hd, item)
    if seq <= 8192:
        for s in (2, 4, 8, 16):
            name = f"{base.kernel}_cluster"
            if s != plan.splits and clusters_fit(dev, name, s, n_kv, base.threads, shared):
                p = dataclasses.replace(base, kernel=name, splits=s, cluster=s)
                runs.append((f"t{base.tile}/{s}+c", p))
        if not plan.cluster and plan.splits >= 4:  # half the chunks, twice as long
            s = plan.splits // 2
            runs.append((f"t{base.tile}/{s}", dataclasses.replace(base, splits=s)))
        for t in (32, 16):
            s = min(-(-seq // t), wave // n_kv)
            runs.append((f"t{t}/{s}", dataclasses.replace(base, tile=t, splits=s)))
        return runs
    exact = next(s for s in range(1, 1024) if (s * n_kv) % wave == 0)  # whole waves
    pairs = ((16, plan.splits), (16, exact), (32, exact), (16, 2 * exact), (16, 2 * plan.splits))
    for t, s in pairs:
        if s <= MAX_SPLITS and -(-seq // t) >= s:
            runs.append((f"t{t}/{s}", dataclasses.replace(base, tile=t, splits=s)))
    return runs


def main() -> None:
    stream = fd.Stream()
    dev = stream.device
    for p in points(CASES, stream, sys.argv[1:]):
        plan = p.plan()
        item = np.dtype(p.dtype).itemsize
        kern = get_kernel("gqa_decode_split.cu", plan.kernel, dev)
        bps = _blocks_per_sm(kern, dev, plan.threads, plan.shared_bytes(p.head_dim, item))
        wave = bps * dev.multiprocessor_count
        cells = []
        for label, c in candidates(plan, p.seq, p.n_kv, wave, dev, p.head_dim, item):
            us = p.time(c)
            cells.append(f"{label} {us:.1f} ({p.pct(us):.0f}%)")
        print(f"{p.label} [{bps}/SM, wave {wave}]: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
