"""PyTorch's side of the benchmarks: scaled_dot_product_attention(enable_gqa=True) timed the
same ways as ours, on the same shapes in the same process, when PyTorch is importable."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from .harness import rotation
from .report import DecodePoint

__all__ = ["import_torch", "torch_sdpa_us", "torch_side_stream", "torch_step_us", "with_torch"]


def import_torch() -> Any:
    """PyTorch for the side-by-side comparison, or None (it is optional). Imported before
    any CUDA work of ours: seen on the H200 image, importing it later can fail."""
    global _torch
    if _torch is False:
        try:
            import torch

            _torch = torch if torch.cuda.is_available() else None
        except Exception as exc:  # any failure just drops the comparison
            print(f"PyTorch unavailable for the comparison: {exc!r}")
            _torch = None
    return _torch


_torch: Any = False
_torch_side: Any = None


def torch_side_stream(torch: Any) -> Any:
    """PyTorch's stream for every measurement (one, as ours: bench_stream)."""
    global _torch_side
    if _torch_side is None:
        _torch_side = torch.cuda.Stream()
    return _torch_side


def torch_sdpa_us(
    shape: tuple[int, int, int], seq: int, dtype: str, iters: int, token_major: bool = False,
    n_q: int = 1, causal: str = "mask",
) -> tuple[float, float] | tuple[None, None]:  # fmt: skip
    """PyTorch SDPA per decode: back to back in one graph, and one replay timed alone; over
    head-major K/V (PyTorch's own layout), or with ``token_major`` over the [seq][kv][d]
    rows our decode reads, as a strided [1, kv, seq, d] view. ``n_q`` > 1: a verify of the
    last n_q tokens, causal through ``attn_mask`` (``causal="mask"``: query t sees tokens
    up to seq - n_q + t) or SDPA's ``is_causal`` (``"is_causal"``, its own alignment: for
    timing next to ours)."""
    torch = import_torch()
    if torch is None:
        return None, None
    import torch.nn.functional as F

    n_heads, n_kv, hd = shape
    tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    n_sets, chain = rotation(2 * seq * n_kv * hd * torch.finfo(tdt).bits // 8)
    q = torch.rand(1, n_heads, n_q, hd, device="cuda", dtype=tdt) * 2 - 1
    kw: dict[str, Any] = {}
    if n_q > 1 and causal == "is_causal":
        kw["is_causal"] = True
    elif n_q > 1:
        rows = torch.arange(n_q, device="cuda").view(n_q, 1) + (seq - n_q)
        kw["attn_mask"] = torch.arange(seq, device="cuda").view(1, seq) <= rows
    if token_major:
        pool = torch.empty(n_sets, 2, seq, n_kv, hd, device="cuda", dtype=tdt).uniform_(-1, 1)
        sets = [(pool[i, 0].permute(1, 0, 2)[None], pool[i, 1].permute(1, 0, 2)[None])
                for i in range(n_sets)]  # fmt: skip
    else:
        pool = torch.empty(n_sets, 2, 1, n_kv, seq, hd, device="cuda", dtype=tdt).uniform_(-1, 1)
        sets = [(pool[i, 0], pool[i, 1]) for i in range(n_sets)]  # one allocation, as ours
    side = torch_side_stream(torch)
    graphs = []
    with torch.cuda.stream(side):
        for k, v in sets:  # warm-up outside capture
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        torch.cuda.synchronize()
        for k, v in sets:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=side):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
            graphs.append(g)
        chained = torch.cuda.CUDAGraph()
        with torch.cuda.graph(chained, stream=side):
            for i in range(chain):
                k, v = sets[i % n_sets]
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(replay: Callable[[int], None], per_run: int) -> float:
        times = []
        for i in range(iters + 5):
            start.record()
            replay(i)
            end.record()
            end.synchronize()
            if i >= 5:
                times.append(start.elapsed_time(end) * 1e3 / per_run)
        return statistics.median(times)

    single = timed(lambda i: graphs[i % n_sets].replay(), 1)
    back_to_back = timed(lambda i: chained.replay(), chain)
    for g in [*graphs, chained]:
        g.reset()
    graphs.clear()
    sets.clear()
    del pool
    torch.cuda.empty_cache()
    return back_to_back, single


def torch_step_us(
    torch: Any,
    shape: tuple[int, int, int],
    cap: int,
    seq_len: int,
    dt: np.dtype,
    qs: np.ndarray,
    ks: np.ndarray,
    vs: np.ndarray,
) -> float:
    """Host microseconds per token step of PyTorch doing what a ferrox decode step does: copy
    q and the token's K/V row into preallocated device tensors and the cache, SDPA with a
    length mask, the result back to pinned host memory; one torch graph replayed per step
    (``qs``/``ks``/``vs``: one row per token, as numpy arrays)."""
    import time

    import torch.nn.functional as F

    n_heads, n_kv, hd = shape
    tdt = {"float32": torch.float32, "float16": torch.float16}.get(dt.name, torch.bfloat16)
    dev = "cuda"
    k_cache = torch.rand(1, n_kv, cap, hd, device=dev, dtype=tdt)
    v_cache = torch.rand(1, n_kv, cap, hd, device=dev, dtype=tdt)
    pos = torch.tensor([seq_len - 1], device=dev, dtype=torch.long)
    ar = torch.arange(cap, device=dev)
    host = {
        n: torch.empty(s, dtype=tdt).pin_memory()
        for n, s in (
            ("q", (n_heads, hd)),
            ("k", (n_kv, hd)),
            ("v", (n_kv, hd)),
            ("out", (n_heads, hd)),
        )
    }
    q_d = torch.empty(1, n_heads, 1, hd, device=dev, dtype=tdt)
    k_d = torch.empty(1, n_kv, 1, hd, device=dev, dtype=tdt)
    v_d = torch.empty(1, n_kv, 1, hd, device=dev, dtype=tdt)

    def body() -> None:
        q_d.copy_(host["q"].view(1, n_heads, 1, hd), non_blocking=True)
        k_d.copy_(host["k"].view(1, n_kv, 1, hd), non_blocking=True)
        v_d.copy_(host["v"].view(1, n_kv, 1, hd), non_blocking=True)
        k_cache.index_copy_(2, pos, k_d)
        v_cache.index_copy_(2, pos, v_d)
        mask = (ar <= pos).view(1, 1, 1, cap)
        out = F.scaled_dot_product_attention(q_d, k_cache, v_cache, attn_mask=mask, enable_gqa=True)
        host["out"].copy_(out.view(n_heads, hd), non_blocking=True)
        pos.add_(1)

    side = torch_side_stream(torch)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # warm-up
    torch.cuda.synchronize()
    pos.fill_(seq_len - 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    pos.fill_(seq_len - 1)
    torch.cuda.synchronize()
    # Host inputs converted to torch tensors before timing (ferrox takes the numpy arrays).
    as_t = {
        n: torch.from_numpy(a.astype(np.float32)).to(tdt)
        for n, a in (("q", qs), ("k", ks), ("v", vs))
    }
    tokens = len(qs)
    t0 = time.perf_counter()
    for t in range(tokens):
        for n in ("q", "k", "v"):
            host[n].copy_(as_t[n][t])
        graph.replay()
        torch.cuda.synchronize()
        host["out"].clone()
    return (time.perf_counter() - t0) / tokens * 1e6


def with_torch(point: DecodePoint, shape: tuple[int, int, int], iters: int) -> DecodePoint:
    """``point`` (of ``shape``) with PyTorch SDPA's timings at its length and dtype (None
    where PyTorch is unavailable)."""
    torch_us, single_us = torch_sdpa_us(shape, point.seq_len, point.dtype, iters)
    return replace(point, torch_us=torch_us, torch_single_us=single_us)
