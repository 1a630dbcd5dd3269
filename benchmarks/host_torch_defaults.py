"""Host time of an eager gqa_decode on PyTorch tensors, written the explicit way (sizes and
stream given) and the short way a PyTorch user writes it (``fd.gqa_decode(q, k, v)``: sizes
read from the shapes, torch's current stream), 32/8/128 at 512 tokens, in microseconds per
call (the median of 5 rounds of 2000 back-to-back calls, one synchronize each; the best
of 3 interleaved repeats, each printed), next to SDPA on the same tensors.

    python3 benchmarks/host_torch_defaults.py          # prints one line per form and dtype

Run it from a checkout of another revision too (PYTHONPATH there) to compare; the short form
exists from issue 45 on.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import ferrox_driver as fd

H, HKV, D, N = 32, 8, 128, 512


def per_call_us(fn: Callable[[], Any], n: int = 2000, rounds: int = 5) -> float:
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def one_dtype(dt: Any, cur: Any) -> None:
    q = torch.randn(H, D, device="cuda", dtype=dt)
    k = torch.randn(N, HKV, D, device="cuda", dtype=dt)
    v = torch.randn(N, HKV, D, device="cuda", dtype=dt)
    q4 = q.view(1, H, 1, D)
    k4 = k.permute(1, 0, 2).contiguous().view(1, HKV, N, D)
    v4 = v.permute(1, 0, 2).contiguous().view(1, HKV, N, D)
    forms: dict[str, Callable[[], Any]] = {
        "explicit (sizes, stream=)": lambda: fd.gqa_decode(
            q, k, v, n_heads=H, n_kv_heads=HKV, head_dim=D, stream=cur
        ),
        "sdpa (torch)": lambda: F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True),
    }
    try:
        fd.gqa_decode(q, k, v)
        forms["short fd.gqa_decode(q, k, v)"] = lambda: fd.gqa_decode(q, k, v)
    except TypeError:
        pass  # a revision before sizes were read from the shapes
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(3):  # the forms interleaved, so a drift of the machine hits each alike
        for name, fn in forms.items():
            times[name].append(per_call_us(fn))
    for name, ts in times.items():
        spread = " ".join(f"{t:.2f}" for t in ts)
        print(f"{dt!s:<15} {name:<32} {min(ts):7.2f} us/call (rounds: {spread})")


def main() -> None:
    cur = torch.cuda.current_stream()
    for dt in (torch.float16, torch.bfloat16):
        one_dtype(dt, cur)


if __name__ == "__main__":
    main()
