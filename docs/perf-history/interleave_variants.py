"""Do the blocks stream faster when they read neighbouring rows at the same time? The
shipped kernels give each block one contiguous chunk, so 132 blocks read 132 (264 with V)
far-apart places of the cache; where a KV row holds several heads (32/8/128) the blocks of
one chunk's heads read one row together, and those shapes stream at 89% of the ceiling
(ncu), against 70-76% for 16/2/64 and 8/1/256. The variant "interleaved" gives block b of
n the block-steps b, b + n, b + 2n, ... (a block-step: every warp's 16 tokens), so all
blocks read one window of the cache together. Same partials up to the order of the sums.

    PYTHONPATH=. python3 docs/perf-history/interleave_variants.py

fp16/bf16 tensor-core kernels, combine plans (clusters off), the benchmark's back-to-back
harness over rotated KV sets; "main" is the split kernel alone.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np

os.environ["FERROX_CLUSTER"] = "0"

import ferrox_driver as fd
from ferrox_driver.attention import launch_split, plan_split, stream_workspace
from ferrox_driver.bench_decode import (
    fill_uniform,
    rotated_kv_sets,
    time_split_plan,
)
from ferrox_driver.compiler import compile_source, kernel_source
from ferrox_driver.launch import Module

DT = ml_dtypes.bfloat16
CASES = [
    ((16, 2, 64), [32768, 131072]),
    ((8, 1, 256), [32768, 131072]),
    ((28, 4, 128), [32768]),
    ((32, 8, 128), [32768, 131072]),
    ((32, 32, 128), [32768]),
]
STEP0 = "start + warp * 16 + j * STRIDE"  # the shipped kernel's first token of step j
BLOCK_STEP0 = "(split + j * splits) * STRIDE + warp * 16"  # the interleaved one's
EDITS = [
    (f"ring, j, {STEP0}, start, end, lane, kg,", f"ring, j, {BLOCK_STEP0}, start, end, lane, kg,"),
    (f"for (int j = 0; {STEP0} < end; ++j)", f"for (int j = 0; {BLOCK_STEP0} < end; ++j)"),
    (f"const int t0 = {STEP0};", f"const int t0 = {BLOCK_STEP0};"),
    (  # every block's tokens are the whole sequence's block-steps b, b + n, ...
        "    const T* kg = k + (long long)g_kv * D;",
        "    start = 0;\n    end = fx_seq_len(seq_len, seq_len_dev);\n"
        "    const T* kg = k + (long long)g_kv * D;",
    ),
]


def interleaved_source() -> str:
    src = kernel_source("gqa_decode_split.cu")
    for anchor, replacement in EDITS:
        assert src.count(anchor) == 1, anchor
        src = src.replace(anchor, replacement)
    return src


def main() -> None:
    dev = fd.Device(0)
    stream = fd.Stream()
    module = Module(compile_source(interleaved_source(), name="interleave.cu"), dev)
    for (n_heads, n_kv, hd), seqs in CASES:
        q = fd.empty((n_heads, hd), DT)
        out = fd.empty((n_heads, hd), DT)
        fill_uniform(q, 1, stream)
        for seq in seqs:
            plan = plan_split(dev, DT, n_heads, n_kv, hd, seq)
            assert not plan.cluster, plan
            kernel = module.get_function(plan.kernel)
            sets, chain = rotated_kv_sets(seq, n_kv, hd, DT, stream, dev)
            # same result as the shipped kernel (sums in another order)
            ws = stream_workspace(dev, stream, plan.workspace_floats(n_heads, hd))
            results = []
            for kern in (None, kernel):
                launch_split(
                    plan,
                    q,
                    *sets[0],
                    out,
                    ws,
                    n_heads=n_heads,
                    n_kv_heads=n_kv,
                    head_dim=hd,
                    seq_len=seq,
                    seq_len_dev=None,
                    stream=stream,
                    kernel=kern,
                )
                stream.synchronize()
                results.append(out.to_host().astype(np.float32))
            diff = float(np.abs(results[0] - results[1]).max())
            kv_bytes = 2 * seq * n_kv * hd * 2
            cells = []
            for label, kern in (("contiguous", None), ("interleaved", kernel)):
                main_us = time_split_plan(plan, q, out, sets, chain, stream, kern, parts="main")
                both = time_split_plan(plan, q, out, sets, chain, stream, kern)
                pct = 100 * kv_bytes / (both * 1e-6) / 4.35e12
                cells.append(f"{label} {main_us:.1f} / {both:.1f} ({pct:.0f}%)")
            print(
                f"{n_heads}/{n_kv}/{hd} bf16 {seq:>6} {plan.splits} chunks, main / both: "
                + "   ".join(cells)
                + f"   |diff| {diff:.1e}",
                flush=True,
            )
            for k, v in sets:
                k.close()
                v.close()
        q.close()
        out.close()


if __name__ == "__main__":
    main()
