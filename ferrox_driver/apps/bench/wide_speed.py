"""``benchmarks/wide_speed.py``: head_dim 512 GQA decode (issue 50's table), graph-replayed
over K/V sets rotated past L2, the median of events, in one process:

- ``cuda``: ``fd.gqa_decode`` on the CUDA-core ``_d512`` kernels (``FERROX_WIDE_TC=0``);
- ``tc``: ``fd.gqa_decode``'s own route (what a user gets): the latent tensor-core kernels
  with V rows of their own (records.wide_launches, DK = DV = head_dim);
- ``D128``: head_dim 128 on the same bytes (4x the KV heads, the same group): the TB/s the
  issue's target compares to (90% of it from 32768 tokens);
- ``sdpa``: PyTorch SDPA on head_dim 512 K/V of the same shape (its own rotation), where
  PyTorch is importable.

    PYTHONPATH=. python benchmarks/wide_speed.py [--kv 4] [--groups 1 2 4 8]
        [--seqs 4096 32768 131072] [--dtype bf16] [--n-q 1] [--head-dim 512] [--no-sdpa]
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

from ...decode import plan as planner
from ...decode.eager import gqa_decode
from ...driver.device import default_device
from ...driver.memory import DeviceArray, empty
from .harness import bench_stream, fill_uniform, rotated_graph_us, rotated_kv_sets
from .torch_baseline import import_torch, torch_sdpa_us

DTYPES: dict[str, Any] = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}
ITERS = 20


def _decode_us(shape: tuple[int, int, int], seq: int, n_q: int, dtype: Any, route: str) -> float:
    """Graph-replayed us of one decode of ``shape`` over ``seq`` tokens on ``route``
    (``tc``: gqa_decode's own; ``cuda``: with the wide tensor-core plans off)."""
    n_heads, n_kv, d = shape
    dev = default_device()
    stream = bench_stream(dev)
    rotated = rotated_kv_sets(seq, n_kv, d, dtype, stream, dev)
    q_shape = (n_q, n_heads, d) if n_q > 1 else (n_heads, d)
    q = empty(q_shape, dtype, device=dev)
    out = empty(q_shape, dtype, device=dev)
    fill_uniform(q, 7, stream)
    sets = rotated.sets

    def eager(i: int, q: DeviceArray = q, out: DeviceArray = out) -> None:
        k, v = sets[i % len(sets)]
        gqa_decode(q, k, v, out=out, stream=stream)

    before = planner.OVERRIDES
    planner.OVERRIDES = dataclasses.replace(before, wide_tensor_cores=route == "tc")
    try:
        return rotated_graph_us(eager, rotated, stream, ITERS)
    finally:
        planner.OVERRIDES = before
        for arr in (q, out):
            arr.close()
        rotated.close()


def _cell(us: float | None) -> str:
    return "-" if us is None else f"{us:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv", type=int, default=4, help="KV heads of the head_dim 512 rows")
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--n-q", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=512)
    parser.add_argument("--no-sdpa", action="store_true")
    args = parser.parse_args(argv)
    torch = None if args.no_sdpa else import_torch()  # (before any CUDA work of ours)
    dev = default_device()
    dtype = DTYPES[args.dtype]
    item = np.dtype(dtype).itemsize
    print(f"# {dev.name}: head_dim {args.head_dim} GQA decode, {args.dtype}, n_q {args.n_q}; "
          f"us per decode, graph-replayed; TB/s = K+V bytes / us; D128 = head_dim 128 with "
          f"{args.head_dim // 128}x the KV heads (equal bytes); best = the faster of cuda "
          f"and tc")  # fmt: skip
    print(
        f"{'shape':>10} {'seq':>7} {'cuda us':>8} {'tc us':>8} {'D128 us':>8} "
        f"{'best TB/s':>9} {'D128 TB/s':>9} {'% D128':>6} {'sdpa us':>8} {'x sdpa':>6}"
    )
    for g in args.groups:
        wide = args.head_dim // 128  # (the D128 point: wide x the KV heads)
        shape = (args.kv * g, args.kv, args.head_dim)
        narrow = (wide * args.kv * g, wide * args.kv, 128)
        for seq in args.seqs:
            nbytes = 2 * seq * args.kv * args.head_dim * item
            cuda = _decode_us(shape, seq, args.n_q, dtype, "cuda")
            tc = _decode_us(shape, seq, args.n_q, dtype, "tc")
            d128 = _decode_us(narrow, seq, args.n_q, dtype, "tc")
            sdpa = None
            if torch is not None:
                sdpa, _ = torch_sdpa_us(shape, seq, args.dtype, ITERS, n_q=args.n_q)
            best = min(cuda, tc)
            tbs, tbs128 = nbytes / best / 1e6, nbytes / d128 / 1e6
            label = f"{shape[0]}/{shape[1]}/{args.head_dim}"
            print(f"{label:>10} {seq:>7} {cuda:>8.2f} {tc:>8.2f} {d128:>8.2f} {tbs:>9.2f} "
                  f"{tbs128:>9.2f} {100 * tbs / tbs128:>5.0f}% {_cell(sdpa):>8} "
                  f"{'-' if sdpa is None else f'{sdpa / best:.1f}':>6}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
