"""Time shapes of the fp32 tensor-core (3xTF32) split kernel side by side, in the
benchmark's back-to-back harness: one graph of >= 8 decodes over rotated KV sets.

    PYTHONPATH=. python3 docs/perf-history/tc32_variants.py [64/8/128 ...]

A variant is the current kernel compiled with -D options for its warps per block, ring
steps per warp and tokens per step; the row "cuda-core" is the CUDA-core kernel.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import numpy as np

import ferrox_driver as fd
from ferrox_driver.attention import MAX_SPLITS, TILE, plan_split
from ferrox_driver.bench_decode import fill_uniform, rotated_kv_sets, time_split_plan
from ferrox_driver.compiler import compile_source, kernel_source
from ferrox_driver.launch import Module

SEQS = [4096, 32768, 131072]
CONFIGS = {  # head_dim -> (warps, stages, tokens per step)
    64: [(8, 3, 16), (16, 3, 8), (8, 6, 8)],
    128: [(4, 3, 16), (8, 3, 8), (4, 6, 8), (6, 2, 16)],
    256: [(4, 3, 8), (2, 3, 16), (3, 4, 8), (2, 6, 8)],
}
SHAPES = [(64, 8, 128), (28, 4, 128), (16, 2, 64), (8, 1, 256)]


def main() -> None:
    wanted = sys.argv[1:]
    dev = fd.Device(0)
    stream = fd.Stream()
    src = kernel_source("gqa_decode_split.cu")
    # Only the fp32 tensor-core kernels are timed (the others only slow the compile down).
    src = re.sub(r"^(FX_GENERIC_FOR_TYPE|FX_MMA_ENTRY)\(.*$", "", src, flags=re.MULTILINE)
    for shape in SHAPES:
        if wanted and "/".join(map(str, shape)) not in wanted:
            continue
        n_heads, n_kv, hd = shape
        variants = []
        for warps, stages, tokens in CONFIGS[hd]:
            opts = [
                f"-DFX_TC32_WARPS_D{hd}={warps}",
                f"-DFX_TC32_STAGES_D{hd}={stages}",
                f"-DFX_TC32_TOKENS_D{hd}={tokens}",
            ]
            prog = compile_source(src, options=opts, name="tc32_variant.cu")
            kern = Module(prog, dev).get_function(f"gqa_split_tc32_f32_d{hd}")
            smem = warps * stages * tokens * 2 * hd * 4
            per_sm = kern.max_active_blocks(32 * warps, smem)
            variants.append(
                (f"{warps}w S={stages} T={tokens}", kern, warps, stages, tokens, per_sm)
            )
        print(f"{n_heads}/{n_kv}/{hd} f32 (us per decode, back to back)")
        print(
            f"{'seq_len':>7} " + " ".join(f"{v[0]:>16}" for v in variants) + f" {'cuda-core':>16}"
        )
        q = fd.empty((n_heads, hd), np.float32)
        out = fd.empty((n_heads, hd), np.float32)
        fill_uniform(q, 1, stream)
        for seq in SEQS:
            kv_bytes = 2 * seq * n_kv * hd * 4
            kv = rotated_kv_sets(seq, n_kv, hd, np.float32, stream, dev)
            sets, chain = kv.sets, kv.chain
            row = []
            base = plan_split(dev, np.float32, n_heads, n_kv, hd, seq)
            runs = [
                (
                    dataclasses.replace(
                        base,
                        threads=32 * w,
                        stages=st,
                        step_tokens=t,
                        splits=max(
                            1,
                            min(
                                per_sm * dev.multiprocessor_count // n_kv,
                                MAX_SPLITS,
                                -(-seq // TILE),
                            ),
                        ),
                    ),
                    kern,
                )
                for _, kern, w, st, t, per_sm in variants
            ]
            os.environ["FERROX_TC32"] = "0"
            runs.append((plan_split(dev, np.float32, n_heads, n_kv, hd, seq), None))
            os.environ.pop("FERROX_TC32")
            for plan, kern in runs:
                row.append(time_split_plan(plan, q, out, sets, chain, stream, kernel=kern))
            pct = [100 * kv_bytes / (us * 1e-6) / 4.45e12 for us in row]
            print(
                f"{seq:>7} "
                + " ".join(f"{us:8.1f} ({p:4.1f}%)" for us, p in zip(row, pct, strict=True))
            )
            kv.close()


if __name__ == "__main__":
    main()
