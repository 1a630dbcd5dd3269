"""Whether the ~1 us modes of combine plans at short lengths (NOTES v12) follow where the
stream's workspace, out or q lie: per round of fresh points, the plan timed back to back
with the stream's workspace, then with each of several fresh workspaces (a pad of a
different size allocated before each, so their addresses differ), outs and qs, with the
addresses printed beside the times.

    PYTHONPATH=. python3 docs/perf-history/placement_probe.py [rounds] [--torch] [shape ...]

With --torch, PyTorch works between rounds as the benchmark's PyTorch timing would: after
round 0 torch.ones on the GPU, after round 1 one SDPA over 32/8/128 bf16 at 4096 tokens,
after round 3 torch.cuda.empty_cache().
"""

from __future__ import annotations

import sys

import numpy as np
from points import Point, points

import ferrox_driver as fd
from ferrox_driver.attention import SplitPlan, launch_split, stream_workspace
from ferrox_driver.bench_decode import captured, fill_uniform, time_events

CASES = [
    ((32, 8, 128), "bf16", [512, 4096]),
    ((64, 8, 128), "bf16", [512]),
]
TRIALS = 6


def timed(
    p: Point, plan: SplitPlan, ws: fd.DeviceArray, out: fd.DeviceArray, q: fd.DeviceArray
) -> float:
    """Microseconds per decode, back to back over the rotated sets, with these buffers."""
    turn = [0]

    def decode() -> None:
        k, v = p.sets[turn[0] % len(p.sets)]
        turn[0] += 1
        launch_split(
            plan, q, k, v, out, ws, n_heads=p.n_heads, n_kv_heads=p.n_kv,
            head_dim=p.head_dim, seq_len=p.seq, seq_len_dev=None, stream=p.stream,
        )  # fmt: skip

    decode()
    p.stream.synchronize()
    turn[0] = 0
    exe = captured(p.stream, decode, p.chain)
    us = time_events(lambda i: exe.launch(p.stream), p.stream, 30, 3, p.chain)
    exe.close()
    return us


def padded(make, trial: int) -> fd.DeviceArray:
    """``make()`` after a pad of 4 KiB x 37^trial mod 1021 (closed at once: the pad moves
    where the allocator puts the next buffer only while it is held, so it is kept)."""
    pad = fd.empty(((4096 * (37**trial % 1021)) // 4,), np.float32)
    arr = make()
    _pads.append(pad)
    return arr


_pads: list[fd.DeviceArray] = []


def probe(p: Point) -> None:
    plan = p.plan(clusters=False)
    floats = plan.workspace_floats(p.n_heads, p.head_dim)
    ws0 = stream_workspace(p.q.device, p.stream, floats)
    base = timed(p, plan, ws0, p.out, p.q)
    print(
        f"{p.label} {plan.kernel} ({plan.splits} chunks): stream workspace "
        f"{ws0.ptr:#x} {base:.2f} us; q {p.q.ptr:#x} out {p.out.ptr:#x} "
        f"k0 {p.sets[0][0].ptr:#x}",
        flush=True,
    )
    made: list[fd.DeviceArray] = []
    for name in ("workspace", "out", "q"):
        row = []
        for t in range(TRIALS):
            if name == "workspace":
                a = padded(lambda: fd.empty((floats,), np.float32), t)
                us = timed(p, plan, a, p.out, p.q)
            elif name == "out":
                a = padded(lambda: fd.empty(p.out.shape, p.dtype), t)
                us = timed(p, plan, ws0, a, p.q)
            else:
                a = padded(lambda: fd.empty(p.q.shape, p.dtype), t)
                fill_uniform(a, 7, p.stream)
                us = timed(p, plan, ws0, p.out, a)
            made.append(a)
            row.append(f"{a.ptr:#x} {us:.2f}")
        print(f"  {name:9}: " + ", ".join(row), flush=True)
    print(f"  again    : {timed(p, plan, ws0, p.out, p.q):.2f} us", flush=True)
    for a in made:
        a.close()


def torch_between(r: int) -> None:
    """PyTorch's work after round ``r`` (--torch)."""
    import torch

    if r == 0:
        torch.ones(1, device="cuda")
        print("-- torch.ones", flush=True)
    elif r == 1:
        q = torch.rand(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        kv = torch.rand(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
        torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        torch.cuda.synchronize()
        print("-- one SDPA", flush=True)
    elif r == 3:
        torch.cuda.empty_cache()
        print("-- torch.cuda.empty_cache()", flush=True)


def main() -> None:
    args = sys.argv[1:]
    rounds = int(args.pop(0)) if args and args[0].isdigit() else 3
    with_torch = "--torch" in args
    only = [a for a in args if a != "--torch"]
    for r in range(rounds):
        if with_torch and r:
            torch_between(r - 1)
        print(f"round {r}", flush=True)
        stream = fd.Stream()  # a new stream: a new stream workspace too
        for p in points(CASES, stream, only):
            probe(p)
        stream.close()
        for pad in _pads:
            pad.close()
        _pads.clear()


if __name__ == "__main__":
    main()
