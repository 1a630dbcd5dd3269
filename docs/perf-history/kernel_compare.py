"""A change to the split kernels against the source before it: the same bits out, and the
time per decode of each, for the plans plan_split makes (cluster and combine plans), in
the benchmark's back-to-back harness over rotated KV sets.

    PYTHONPATH=. python3 docs/perf-history/kernel_compare.py OLD.cu

OLD.cu: the kernel file before the change (e.g. `git show HEAD~1:cuda_src/gqa_decode_split.cu`).
Each kernel is timed twice, alternating, and the faster of its two times is printed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np

import ferrox_driver as fd
from ferrox_driver.attention import launch_split, plan_split, stream_workspace
from ferrox_driver.bench_decode import fill_uniform, rotated_kv_sets, time_split_plan
from ferrox_driver.compiler import compile_source, kernel_source
from ferrox_driver.launch import Module

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}
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
]


def main() -> None:
    dev = fd.Device(0)
    stream = fd.Stream()
    sources = {"old": Path(sys.argv[1]).read_text(), "new": kernel_source("gqa_decode_split.cu")}
    modules = {k: Module(compile_source(s, name=f"{k}.cu"), dev) for k, s in sources.items()}
    for (n_heads, n_kv, hd), dtn, seqs in CASES:
        dt = DTYPES[dtn]
        q = fd.empty((n_heads, hd), dt)
        out = fd.empty((n_heads, hd), dt)
        fill_uniform(q, 1, stream)
        for seq in seqs:
            plan = plan_split(dev, dt, n_heads, n_kv, hd, seq)
            kernels = {k: m.get_function(plan.kernel) for k, m in modules.items()}
            sets, chain = rotated_kv_sets(seq, n_kv, hd, dt, stream, dev)
            floats = plan.workspace_floats(n_heads, hd)
            ws = stream_workspace(dev, stream, floats) if floats else None
            bits = []
            for kern in kernels.values():
                out.fill_bytes(0xFF, stream)  # NaN: an unwritten output shows
                launch_split(
                    plan, q, *sets[0], out, ws, n_heads=n_heads, n_kv_heads=n_kv,
                    head_dim=hd, seq_len=seq, seq_len_dev=None, stream=stream, kernel=kern,
                )  # fmt: skip
                stream.synchronize()
                bits.append(out.to_host().view(np.uint8).copy())
            same = np.array_equal(bits[0], bits[1])
            times: dict[str, float] = {}
            for _ in range(2):
                for k, kern in kernels.items():
                    us = time_split_plan(plan, q, out, sets, chain, stream, kern)
                    times[k] = min(times.get(k, us), us)
            print(
                f"{n_heads}/{n_kv}/{hd} {dtn} {seq:>6} {plan.kernel} ({plan.splits} chunks): "
                f"old {times['old']:.2f} us, new {times['new']:.2f} us "
                f"({100 * (times['new'] / times['old'] - 1):+.1f}%), "
                f"{'same bits' if same else 'BITS DIFFER'}",
                flush=True,
            )
            for k, v in sets:
                k.close()
                v.close()
        q.close()
        out.close()


if __name__ == "__main__":
    main()
