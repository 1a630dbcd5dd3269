"""Host time of ``gqa_decode`` over a growing cache: the first n tokens of a larger cache,
n one longer at each call (a decode loop over the user's own cache, no KVCache), and at
random lengths, next to the same call at one length and to PyTorch's SDPA on the same
views. bf16, PyTorch tensors where PyTorch with CUDA is there (ferrox DeviceArrays
otherwise: the token-major rows only), results from the per-stream pools (``out=None``)
on PyTorch's current stream.

The kernels the lengths take are loaded first by a pass over them on another stream
(whose records are its own), as in a process that has decoded before: a first use's
compile or module load is the first-use benchmark's, not a per-call cost. Calls that return
before the GPU is done are timed in bursts (``host.burst_us``: 10 bursts
of 200 calls, a synchronize between bursts not counted), so the time is the host's; the
growing rows' first pass over their lengths is what is timed (each new length bucket makes
its record inside the bursts, as in a real decode loop). ``growing_rows`` is what ``bench
--only torch`` reports; ``benchmarks/host_growing.py`` prints it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np

import ferrox_driver as fd

from .host import BURST, burst_us
from .torch_baseline import import_torch

__all__ = ["GROWING_FROM", "GROWING_LENGTHS", "RANDOM_CALLS", "RANDOM_TOP", "growing_rows"]

GROWING_FROM = 4096  # the growing rows' first length ...
GROWING_LENGTHS = 2000  # ... and how many they grow through
RANDOM_CALLS, RANDOM_TOP = 20_000, 8192  # the random row: calls, longest length
SDPA_CALLS = 50  # PyTorch's SDPA re-plans each new shape (tens of ms a call): fewer calls


def growing_rows(n_heads: int = 32, n_kv: int = 8, head_dim: int = 128) -> dict[str, float]:
    """Host microseconds per call (and the random row's device memory growth), bf16.

    Returns:
        ``fixed_us``: ``k[:4096]``, the same view every call. ``growing_nhd_us``:
        ``k[:n]`` of a ``(cap, n_kv, head_dim)`` cache, n from 4096 through 2,000 lengths.
        ``growing_hnd_us``: ``k[:, :n]`` of a ``(n_kv, cap, head_dim)`` cache,
        ``kv_layout="HND"``; ``growing_hnd_features_us``: the same with a sliding window,
        a soft-cap and the LSE. ``random_us``: 20,000 calls at random lengths 1..8192, all
        of them (first uses included) over the calls; ``random_memory_growth_bytes``: the
        device's free memory before those calls less after. ``sdpa_growing_us``: PyTorch's
        ``scaled_dot_product_attention(enable_gqa=True)`` on the growing head-major views
        (50 calls). Rows that cannot run here are NaN (no PyTorch: the head-major and
        SDPA rows).
    """
    torch = import_torch()
    cap = max(GROWING_FROM + GROWING_LENGTHS, RANDOM_TOP) + 1
    rng = np.random.default_rng(0)
    nan = float("nan")
    rows: dict[str, float] = {}
    if torch is not None:
        dt = torch.bfloat16
        q = torch.randn(n_heads, head_dim, device="cuda").to(dt)
        k, v = (torch.randn(cap, n_kv, head_dim, device="cuda").to(dt) for _ in "kv")
        kh, vh = (torch.randn(n_kv, cap, head_dim, device="cuda").to(dt) for _ in "kv")
        sync: Callable[[], None] = torch.cuda.synchronize

        def nhd(n: int) -> tuple[Any, Any]:
            return k[:n], v[:n]

    else:
        dt = ml_dtypes.bfloat16
        q = fd.to_device(rng.standard_normal((n_heads, head_dim)).astype(dt))
        k, v = (fd.to_device(rng.standard_normal((cap, n_kv, head_dim)).astype(dt)) for _ in "kv")
        sync = fd.Device(0).synchronize

        def nhd(n: int) -> tuple[Any, Any]:
            return k.view((n, n_kv, head_dim)), v.view((n, n_kv, head_dim))

    def lengths() -> Iterator[int]:
        return itertools.cycle(range(GROWING_FROM, GROWING_FROM + GROWING_LENGTHS))

    if torch is not None:  # the kernels loaded, on another stream (its own records)
        with torch.cuda.stream(torch.cuda.Stream()):
            for n in range(GROWING_FROM, GROWING_FROM + GROWING_LENGTHS, 16):
                fd.gqa_decode(q, *nhd(n))
                fd.gqa_decode(q, kh[:, :n], vh[:, :n], kv_layout="HND")
                fd.gqa_decode(q, kh[:, :n], vh[:, :n], kv_layout="HND", sliding_window=2048,
                              logits_soft_cap=50.0, return_lse=True)  # fmt: skip
            for n in range(1, RANDOM_TOP + 1, 16):
                fd.gqa_decode(q, *nhd(n))
        sync()
    fixed_k, fixed_v = nhd(GROWING_FROM)
    rows["fixed_us"] = burst_us(lambda: fd.gqa_decode(q, fixed_k, fixed_v), sync)
    grow = lengths()
    rows["growing_nhd_us"] = burst_us(lambda: fd.gqa_decode(q, *nhd(next(grow))), sync)
    if torch is not None:
        grow_h = lengths()

        def hnd() -> None:
            n = next(grow_h)
            fd.gqa_decode(q, kh[:, :n], vh[:, :n], kv_layout="HND")

        rows["growing_hnd_us"] = burst_us(hnd, sync)
        grow_f = lengths()

        def hnd_features() -> None:
            n = next(grow_f)
            fd.gqa_decode(q, kh[:, :n], vh[:, :n], kv_layout="HND", sliding_window=2048,
                          logits_soft_cap=50.0, return_lse=True)  # fmt: skip

        rows["growing_hnd_features_us"] = burst_us(hnd_features, sync)
    else:
        rows["growing_hnd_us"] = rows["growing_hnd_features_us"] = nan
    rows["random_us"], rows["random_memory_growth_bytes"] = _random_row(
        lambda n: fd.gqa_decode(q, *nhd(n)), sync, rng
    )
    rows["sdpa_growing_us"] = nan if torch is None else _sdpa_row(torch, q, kh, vh, sync)
    return {name: round(value, 2) for name, value in rows.items()}


def _random_row(
    call: Callable[[int], Any], sync: Callable[[], None], rng: np.random.Generator
) -> tuple[float, float]:
    """RANDOM_CALLS calls at random lengths 1..RANDOM_TOP in bursts of BURST (the
    synchronizes between bursts not counted): host us per call over all of them, and the
    device's free memory before less after."""
    lengths = rng.integers(1, RANDOM_TOP + 1, RANDOM_CALLS).tolist()
    device = fd.Device(0)
    sync()
    free_before = device.mem_info()[0]
    spent = 0.0
    for start in range(0, RANDOM_CALLS, BURST):
        t0 = time.perf_counter()
        for n in lengths[start : start + BURST]:
            call(n)
        spent += time.perf_counter() - t0
        sync()
    free_after = device.mem_info()[0]
    return spent / RANDOM_CALLS * 1e6, float(free_before - free_after)


def _sdpa_row(torch: Any, q: Any, kh: Any, vh: Any, sync: Callable[[], None]) -> float:
    """PyTorch SDPA on the growing head-major views, host us per call (SDPA_CALLS calls,
    synchronized at the end)."""
    import torch.nn.functional as F

    n_heads, head_dim = q.shape
    qs = q.view(1, n_heads, 1, head_dim)
    kb, vb = kh.unsqueeze(0), vh.unsqueeze(0)
    F.scaled_dot_product_attention(qs, kb[:, :, :GROWING_FROM], vb[:, :, :GROWING_FROM],
                                   enable_gqa=True)  # fmt: skip
    sync()
    t0 = time.perf_counter()
    for n in range(GROWING_FROM + 1, GROWING_FROM + 1 + SDPA_CALLS):
        F.scaled_dot_product_attention(qs, kb[:, :, :n], vb[:, :, :n], enable_gqa=True)
    sync()
    return (time.perf_counter() - t0) / SDPA_CALLS * 1e6
