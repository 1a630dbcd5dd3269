# ruff: noqa: B023  (closures are called before the loop moves on)
"""Time variants of the split kernel side by side (32/8/128 bf16 unless told), in the
benchmark's back-to-back harness: one graph of >= 8 decodes over rotated KV sets.

    PYTHONPATH=. python3 docs/perf-history/variants.py

A variant is a kernel source (the current one with -D options, or an older copy kept
here) and its dynamic shared memory; the combine kernel is always the current one.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

import ferrox_driver as fd
from ferrox_driver.attention import COMBINE_THREADS, MAX_SPLITS, TILE, stream_workspace
from ferrox_driver.bench_decode import fill_uniform, rotation, time_events
from ferrox_driver.compiler import compile_source, kernel_source
from ferrox_driver.launch import Module
from ferrox_driver.module_cache import get_kernel

HERE = Path(__file__).parent
DT = np.dtype(ml_dtypes.bfloat16)
SEQS = [512, 4096, 32768, 131072]


def variant(head_dim: int, stages: int, warps: int = 4) -> Variant:
    """A ring of ``stages`` steps per warp, ``warps`` warps per block: (name, -D options,
    dynamic shared memory, threads per block)."""
    opts = (f"-DFX_STAGES_D{head_dim}={stages}", f"-DFX_WARPS_D{head_dim}={warps}")
    name = f"d{head_dim} S={stages} {warps}w"
    return name, opts, warps * stages * 16 * 2 * head_dim * 2, 32 * warps


Variant = tuple[str, tuple[str, ...], int, int]

# (q heads, kv heads, head_dim) -> variants
VARIANTS = {
    (32, 8, 128): [variant(128, 4), variant(128, 6), variant(128, 3, 8)],
    (32, 32, 128): [variant(128, 4), variant(128, 6), variant(128, 3, 8)],
    (16, 2, 64): [variant(64, 4), variant(64, 6), variant(64, 8), variant(64, 4, 8)],
    (8, 1, 256): [variant(256, 3), variant(256, 2, 6)],
}


def main() -> None:
    wanted = sys.argv[1:]  # shapes such as 16/2/64 (default: all)
    for shape, variants in VARIANTS.items():
        if not wanted or "/".join(map(str, shape)) in wanted:
            run_shape(shape, variants)


def run_shape(shape: tuple[int, int, int], variants: list[Variant]) -> None:
    n_heads, n_kv, hd = shape
    dev = fd.Device(0)
    stream = fd.Stream()
    combine = get_kernel("gqa_decode_split.cu", "gqa_split_combine_bf16")
    q = fd.empty((n_heads, hd), DT)
    out = fd.empty((n_heads, hd), DT)
    fill_uniform(q, 1, stream)
    kernels = []
    src = kernel_source("gqa_decode_split.cu")
    # Only the tensor-core kernels are timed (the others only slow the compile down).
    src = re.sub(r"^FX_GENERIC_FOR_TYPE\(.*$", "", src, flags=re.MULTILINE)
    for name, opts, smem, threads in variants:
        prog = compile_source(src, options=opts, name="variant.cu")
        kern = Module(prog, dev).get_function(f"gqa_split_mma_bf16_d{hd}")
        per_sm = kern.max_active_blocks(threads, smem)
        res = prog.resources.get(f"gqa_split_mma_bf16_d{hd}")
        print(
            f"{n_heads}/{n_kv}/{hd} {name:<10} regs {res.registers if res else '?':>3} "
            f"smem {smem + (res.shared_bytes if res else 0):>6} B blocks/SM {per_sm}"
        )
        kernels.append((name, kern, smem, per_sm, threads))
    print(f"{'seq_len':>7} " + " ".join(f"{n:>16}" for n, *_ in kernels) + "   (us per decode)")
    for seq in SEQS:
        kv_bytes = 2 * seq * n_kv * hd * DT.itemsize
        n_sets, chain = rotation(kv_bytes)
        sets = []
        for i in range(n_sets):
            k = fd.empty((seq, n_kv, hd), DT)
            v = fd.empty((seq, n_kv, hd), DT)
            fill_uniform(k, 10 + 2 * i, stream)
            fill_uniform(v, 11 + 2 * i, stream)
            sets.append((k, v))
        row = []
        for _, kern, smem, per_sm, threads in kernels:
            splits = per_sm * dev.multiprocessor_count // n_kv
            splits = max(1, min(splits, MAX_SPLITS, math.ceil(seq / TILE)))
            ws = stream_workspace(dev, stream, n_heads * splits * (hd + 2))
            ws_ml = ws.view((n_heads * splits * 2,), offset=n_heads * splits * hd * 4)
            heads = (np.int32(n_heads), np.int32(n_kv))
            tile = np.int32(TILE)

            def decode(i: int) -> None:
                k, v = sets[i % n_sets]
                args = (q, k, v, ws, ws_ml, *heads, np.int32(seq), None, np.int32(splits), tile)
                kern.launch((splits, n_kv, 1), threads, args, shared_mem=smem, stream=stream)
                combine.launch(
                    (n_heads, hd // 32),
                    COMBINE_THREADS,
                    (out, ws, ws_ml, np.int32(hd), np.int32(seq), None, np.int32(splits), tile),
                    stream=stream,
                )

            decode(0)
            with stream.capture() as graph:
                for i in range(chain):
                    decode(i)
            exe = graph.instantiate()
            graph.close()
            row.append(time_events(lambda i: exe.launch(stream), stream, 30, 3, chain))
            exe.close()
        pct = [100 * kv_bytes / (us * 1e-6) / 4.45e12 for us in row]
        cells = [f"{us:8.1f} ({p:4.1f}%)" for us, p in zip(row, pct, strict=True)]
        print(f"{seq:>7} " + " ".join(cells))
        for k, v in sets:
            k.close()
            v.close()


if __name__ == "__main__":
    main()
