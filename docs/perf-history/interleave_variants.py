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

import numpy as np

os.environ["FERROX_CLUSTER"] = "0"

from points import edited_source, load_variant, points

import ferrox_driver as fd
from ferrox_driver.attention import stream_workspace

CASES = [
    ((16, 2, 64), "bf16", [32768, 131072]),
    ((8, 1, 256), "bf16", [32768, 131072]),
    ((28, 4, 128), "bf16", [32768]),
    ((32, 8, 128), "bf16", [32768, 131072]),
    ((32, 32, 128), "bf16", [32768]),
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


def main() -> None:
    stream = fd.Stream()
    module = load_variant(edited_source(EDITS), "interleave.cu")
    for p in points(CASES, stream):
        plan = p.plan()
        assert not plan.cluster, plan
        kernel = module.get_function(plan.kernel)
        # same result as the shipped kernel (sums in another order)
        ws = stream_workspace(stream.device, stream, plan.workspace_floats(p.n_heads, p.head_dim))
        results = []
        for kern in (None, kernel):
            p.decode(plan, ws, kern)
            stream.synchronize()
            results.append(p.out.to_host().astype(np.float32))
        diff = float(np.abs(results[0] - results[1]).max())
        cells = []
        for label, kern in (("contiguous", None), ("interleaved", kernel)):
            main_us = p.time(plan, kern, parts="main")
            both = p.time(plan, kern)
            cells.append(f"{label} {main_us:.1f} / {both:.1f} ({p.pct(both):.0f}%)")
        print(
            f"{p.label} {plan.splits} chunks, main / both: "
            + "   ".join(cells)
            + f"   |diff| {diff:.1e}",
            flush=True,
        )


if __name__ == "__main__":
    main()
