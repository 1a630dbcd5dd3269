# ruff: noqa: B023  (closures are called before the loop moves on)
"""Where does the split kernel's time go at short lengths? Time, back to back in one graph,
copies of the tensor-core split kernel (32/8/128 bf16) that leave at successive points.

    PYTHONPATH=. python3 docs/perf-history/latency_probe.py

The KV stays in L2 (one set, 64 and 512 tokens): this measures the fixed cost, not
streaming. Each variant edits the current kernel source at an anchor line.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

import ferrox_driver as fd
from ferrox_driver.attention import launch_decode, plan_split
from ferrox_driver.bench_decode import fill_uniform, time_graph_body
from ferrox_driver.compiler import compile_source, kernel_source
from ferrox_driver.launch import Module
from ferrox_driver.validation import dtype_name

DT = np.dtype(ml_dtypes.bfloat16)
N_HEADS, N_KV, HD = 32, 8, 128
LEAVE = "if (seq_len >= 0) return;\n"
CHECK = "    const int split = blockIdx.x;\n    int start, end;\n"
SCALE = "    const float sscale = rsqrtf((float)D) * FX_LOG2E;"
DRAIN = "    fx_cp_async_wait<0>();  // no copy may land after the block has left"
LOOP = "for (int j = 0; start + warp * 16 + j * STRIDE < end; ++j) {"

# name -> (anchor, replacement)
VARIANTS: dict[str, tuple[str, str] | None] = {
    "whole kernel": None,
    "leave at entry": (CHECK, LEAVE + CHECK),
    "leave after Q + first loads": (SCALE, "fx_cp_async_wait<0>();" + LEAVE + SCALE),
    "leave after the loop": (DRAIN, DRAIN + "\n" + LEAVE),
    "skip the loop (merge + writes only)": (
        LOOP,
        LOOP.replace("start +", "seq_len < 0 && start +"),
    ),
}


def main() -> None:
    dev = fd.Device(0)
    stream = fd.Stream()
    src = kernel_source("gqa_decode_split.cu")
    name = f"gqa_split_mma_bf16_d{HD}"
    q = fd.empty((N_HEADS, HD), DT)
    fill_uniform(q, 1, stream)
    print(f"{'variant':<40} {'seq':>5} {'us back to back':>16}")
    for label, edit in VARIANTS.items():
        text = src
        if edit is not None:
            assert edit[0] in text, edit[0]
            text = text.replace(edit[0], edit[1], 1)
        kern = Module(compile_source(text, name="probe.cu"), dev).get_function(name)
        for seq in (64, 512):
            plan = plan_split(dev, DT, N_HEADS, N_KV, HD, seq)
            smem = plan.shared_bytes(HD, 2)
            kern.allow_shared(smem)
            k = fd.empty((seq, N_KV, HD), DT)
            v = fd.empty((seq, N_KV, HD), DT)
            fill_uniform(k, 2, stream)
            fill_uniform(v, 3, stream)
            ws = fd.empty((plan.workspace_floats(N_HEADS, HD),), np.float32)
            n_part = N_HEADS * plan.splits
            ws_ml = ws.view((n_part * 2,), offset=n_part * HD * 4)
            args = (
                q,
                k,
                v,
                ws,
                ws_ml,
                np.int32(N_HEADS),
                np.int32(N_KV),
                np.int32(seq),
                None,
                np.int32(plan.splits),
                np.int32(plan.tile),
            )

            def body() -> None:
                grid = (plan.splits, N_KV, 1)
                kern.launch(grid, plan.threads, args, shared_mem=smem, stream=stream)

            us = time_graph_body(stream, body)[0]
            print(f"{label:<40} {seq:>5} {us:16.2f}")
            for a in (k, v, ws):
                a.close()
    decodes(dev, stream)


def decodes(dev: fd.Device, stream: fd.Stream) -> None:
    """Whole decodes (split kernel + combine), KV in L2, 20 back to back in one graph."""
    print(f"{'decode':<40} {'seq':>5} {'us back to back':>16}")
    for dtype in (np.dtype(np.float32), DT):
        for seq in (64, 512, 4096):
            q = fd.empty((N_HEADS, HD), dtype)
            out = fd.empty((N_HEADS, HD), dtype)
            k = fd.empty((seq, N_KV, HD), dtype)
            v = fd.empty((seq, N_KV, HD), dtype)
            for i, a in enumerate((q, k, v)):
                fill_uniform(a, 5 + i, stream)

            def body() -> None:
                launch_decode(
                    q,
                    k,
                    v,
                    out,
                    n_heads=N_HEADS,
                    n_kv_heads=N_KV,
                    head_dim=HD,
                    seq_len=seq,
                    stream=stream,
                )

            us = time_graph_body(stream, body)[0]
            print(f"{'32/8/128 ' + dtype_name(dtype):<40} {seq:>5} {us:16.2f}")
            for a in (q, out, k, v):
                a.close()


if __name__ == "__main__":
    main()
