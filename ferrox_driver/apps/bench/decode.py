"""``python -m ferrox_driver bench``: decode speed against the read ceiling and PyTorch.

Each point is timed three ways (harness.py says how inputs are filled and KV sets rotated):
decodes back to back in one captured graph (one per KV set, at least CHAIN_MIN: how a
model's layers run; the headline number), one decode per graph replay timed alone, and eager
launches. PyTorch's scaled_dot_product_attention(enable_gqa=True) is timed the same two graph
ways, on the same shapes in the same process, when importable (torch_baseline.py).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ...decode.checks import SUPPORTED_DTYPES
from ...decode.records import launch_decode
from ...driver.device import Device, default_device
from ...driver.memory import empty, zeros
from ...kernels.catalogue import get_kernel
from ..progress import progress
from .harness import (
    bench_stream,
    captured,
    fill_uniform,
    measure_read_ceiling,
    rotated_graph_us,
    rotated_kv_sets,
    rotation,
    time_events,
    time_graph_body,
    time_replays,
)
from .report import DecodePoint, print_table, write_results
from .torch_baseline import import_torch, torch_sdpa_us, torch_step_us, with_torch

__all__ = ["DecodePoint", "SHAPES", "SEQ_LENS", "measure_read_ceiling", "run_decode_bench"]

READ_CEILING_TBS = 4.26
SHAPES = [(32, 8, 128), (64, 8, 128), (28, 4, 128), (32, 32, 128), (16, 2, 64), (8, 1, 256)]
SEQ_LENS = [512, 4096, 32768, 131072]
DTYPES = ["f32", "f16", "bf16"]


def measure_point(
    shape: tuple[int, int, int], seq: int, dtype: str, iters: int, device: Device
) -> DecodePoint:
    """Our decode at one point (the PyTorch columns empty: with_torch fills them)."""
    n_heads, n_kv, hd = shape
    dt = next(d for d, name in SUPPORTED_DTYPES.items() if name == dtype)
    stream = bench_stream(device)
    kv_bytes = 2 * seq * n_kv * hd * dt.itemsize
    q = empty((n_heads, hd), dt, device=device)
    out = empty((n_heads, hd), dt, device=device)
    fill_uniform(q, 7, stream)
    rotated = rotated_kv_sets(seq, n_kv, hd, dt, stream, device)
    sets, chain = rotated.sets, rotated.chain
    n_sets = len(sets)

    def eager(i: int) -> None:
        k, v = sets[i % n_sets]
        launch_decode(
            q, k, v, out, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd, seq_len=seq, stream=stream
        )

    eager(0)
    stream.synchronize()
    execs = [captured(stream, functools.partial(eager, i)) for i in range(n_sets)]

    def all_sets() -> None:
        for i in range(chain):
            eager(i)

    chained = captured(stream, all_sets)
    graph_us, single_us = time_replays(chained, chain, execs, stream, iters)
    eager_us = time_events(eager, stream, iters, 5)
    for e in [*execs, chained]:
        e.close()
    rotated.close()
    q.close()
    out.close()
    shape_name = f"{n_heads}/{n_kv}/{hd}"
    return DecodePoint(shape_name, dtype, seq, kv_bytes, graph_us, single_us, eager_us, None, None)


def run_decode_bench(
    out_dir: Path | None,
    shapes: Sequence[tuple[int, int, int]] = SHAPES,
    seq_lens: Sequence[int] = SEQ_LENS,
    dtypes: Sequence[str] = DTYPES,
    iters: int = 30,
    growing: bool = True,
) -> dict[str, Any]:
    """Measure every point, print the table, write JSON and a PNG plot into ``out_dir``;
    with ``growing``, also a decode captured once at seq_len 1 and replayed as the cache
    grows (measure_growing_graph; the result's "growing_graph").

    Ours are measured first, every point and the growing graph, then PyTorch's: PyTorch's
    first SDPA slows every kernel of the process from then on (docs/design.md), which our
    own work on one stream never does. So each library is timed in the state its own use
    leaves a process in; PyTorch has always been timed after its own first SDPA."""
    device = default_device()
    ceiling = measure_read_ceiling(device)
    print(f"measured read ceiling: {ceiling:.2f} TB/s (BASELINE.md: {READ_CEILING_TBS})")
    grid = [(s, n, d) for s in shapes for d in dtypes for n in seq_lens]
    points = [
        measure_point(shape, seq, dtype, iters, device)
        for shape, seq, dtype in progress(grid, len(grid), "decode bench, ferrox ")
    ]
    grown = measure_growing_graph(iters=iters) if growing else {}
    if import_torch() is not None:
        pairs = progress(zip(grid, points, strict=True), len(grid), "decode bench, PyTorch")
        points = [with_torch(p, shape, iters) for (shape, _, _), p in pairs]
    print_table(points, ceiling)
    result = {
        "device": device.name,
        "read_ceiling_tbs": ceiling,
        "points": [asdict(p) for p in points],
        "growing_graph": {
            str(seq): {"graph_us": g, "single_us": one} for seq, (g, one) in grown.items()
        },
    }
    if out_dir is not None:
        write_results(result, out_dir)
    return result


def measure_growing_graph(
    shape: tuple[int, int, int] = (32, 8, 128),
    dtype: str = "bf16",
    capacity: int = 32768,
    seq_lens: Sequence[int] = (4096, 32768),
    iters: int = 30,
) -> dict[int, tuple[float, float]]:
    """Capture ``gqa_decode_async`` once at seq_len 1, then time replays as the cache grows.

    Returns:
        Per length, median microseconds per decode: back to back in one graph over the
        rotated caches, and one replay timed alone (the two columns of the decode table).
    """
    from ...cache.device_ops import gqa_decode_async
    from ...cache.kv_cache import KVCache

    n_heads, n_kv, hd = shape
    dt = next(d for d, name in SUPPORTED_DTYPES.items() if name == dtype)
    device = default_device()
    stream = bench_stream(device)
    n_sets, chain = rotation(2 * min(seq_lens) * n_kv * hd * dt.itemsize)
    caches = [
        KVCache(n_kv, hd, capacity, dtype=dt, device=device, stream=stream) for _ in range(n_sets)
    ]
    q = empty((n_heads * hd,), dt, device=device)
    out = empty((n_heads * hd,), dt, device=device)
    fill_uniform(q, 3, stream)
    execs = []
    for i, kv in enumerate(caches):
        fill_uniform(kv.k_buffer, 200 + 2 * i, stream)
        fill_uniform(kv.v_buffer, 201 + 2 * i, stream)
        kv.extend(np.zeros((1, n_kv, hd), dt), np.zeros((1, n_kv, hd), dt))  # seq_len 1
        kv.synchronize()
        stream.synchronize()
        decode = functools.partial(gqa_decode_async, q, kv, out, n_heads=n_heads, stream=stream)
        decode()  # warm-up, loads the kernels
        execs.append(captured(stream, decode))

    def all_caches() -> None:
        for i in range(chain):
            gqa_decode_async(q, caches[i % n_sets], out, n_heads=n_heads, stream=stream)

    chained = captured(stream, all_caches)
    results = {}
    for seq in seq_lens:
        for kv in caches:
            kv.state.copy_from_host(np.array([seq, 0], np.int32))
            kv.mark_device_appends()
        results[seq] = time_replays(chained, chain, execs, stream, iters)
    for e in [*execs, chained]:
        e.close()
    for kv in caches:
        kv.close()
    return results


def measure_step_latency(
    shape: tuple[int, int, int] = (32, 8, 128),
    seq_len: int = 4096,
    dtype: str = "bf16",
    tokens: int = 200,
) -> dict[str, float]:
    """Host-measured microseconds per token step (append one token + decode + result on the
    host) at ``seq_len``: eager ferrox, DecodeGraph, and PyTorch (copy into a preallocated
    cache + scaled_dot_product_attention with a length mask) replayed from a torch graph."""
    import time

    from ...cache.graphs import DecodeGraph
    from ...cache.kv_cache import KVCache

    n_heads, n_kv, hd = shape
    dt = next(d for d, name in SUPPORTED_DTYPES.items() if name == dtype)
    rng = np.random.default_rng(0)
    cap = seq_len + tokens
    prefill = rng.standard_normal((seq_len - 1, n_kv, hd), dtype=np.float32).astype(dt)
    qs = rng.standard_normal((tokens, n_heads, hd), dtype=np.float32).astype(dt)
    ks = rng.standard_normal((tokens, n_kv, hd), dtype=np.float32).astype(dt)
    vs = rng.standard_normal((tokens, n_kv, hd), dtype=np.float32).astype(dt)
    result = {}
    stream = bench_stream(default_device())
    with KVCache(n_kv, hd, cap, dtype=dt, stream=stream) as kv:
        kv.extend(prefill, prefill)
        kv.decode(qs[0], n_heads=n_heads)  # warm-up
        t0 = time.perf_counter()
        for t in range(tokens):
            kv.append(ks[t], vs[t])
            kv.decode(qs[t], n_heads=n_heads)
        result["ferrox eager"] = (time.perf_counter() - t0) / tokens * 1e6
    with (
        KVCache(n_kv, hd, cap, dtype=dt, stream=stream) as kv,
        DecodeGraph(kv, n_heads=n_heads) as step,
    ):
        kv.extend(prefill, prefill)
        t0 = time.perf_counter()
        for t in range(tokens):
            step(qs[t], ks[t], vs[t])
        result["ferrox DecodeGraph"] = (time.perf_counter() - t0) / tokens * 1e6
    torch = import_torch()
    if torch is not None:
        result["torch graph (copy + SDPA)"] = torch_step_us(
            torch, shape, cap, seq_len, dt, qs, ks, vs
        )
    return result


def measure_fixed_costs(
    shape: tuple[int, int, int] = (32, 8, 128), dtype: str = "bf16", iters: int = 50
) -> dict[str, tuple[float, float]]:
    """Where the time of a short decode goes: graph replays of an empty kernel, of the split
    kernel alone, of the combine alone and of both, at 64 and 4096 tokens (the KV in L2).

    Returns:
        Per item, microseconds: back to back (20 in one graph, per item) and one replay
        timed alone."""
    from ...decode.records import launches_for, planned
    from ...kernels.abi import Launch, is_aligned

    n_heads, n_kv, hd = shape
    dt = next(d for d, name in SUPPORTED_DTYPES.items() if name == dtype)
    device = default_device()
    stream = bench_stream(device)
    noop = get_kernel("util.cu", "ferrox_noop", device)
    results = {}

    def timed_graph(body: Callable[[], None]) -> tuple[float, float]:
        return time_graph_body(stream, body, iters)

    results["empty kernel"] = timed_graph(lambda: noop.launch(1, 32, (), stream=stream))

    def two_noops() -> None:
        noop.launch(1, 32, (), stream=stream)
        noop.launch(1, 32, (), stream=stream)

    results["two empty kernels"] = timed_graph(two_noops)
    for seq in (64, 4096):
        q = empty((n_heads, hd), dt, device=device)
        out = empty((n_heads, hd), dt, device=device)
        k = empty((seq, n_kv, hd), dt, device=device)
        v = empty((seq, n_kv, hd), dt, device=device)
        for i, a in enumerate((q, k, v)):
            fill_uniform(a, 50 + i, stream)
        aligned = is_aligned(q, k, v)
        plan, ws = planned(
            device, dt, n_heads, n_kv, hd, seq, aligned, 0, "",
            lambda floats: empty((floats,), np.float32, device=device),
        )  # fmt: skip
        launches, _ = launches_for(
            q, k, v, out, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd, seq_len=seq,
            plan_seq=seq, aligned=aligned, workspace=ws,
        )  # fmt: skip
        parts = {"main": launches[:1], "combine": launches[1:], "both": launches}
        for part, chosen in parts.items():

            def body(chosen: list[Launch] = chosen) -> None:
                for launch in chosen:
                    launch.run(stream, device)

            results[f"seq {seq}: {part} ({plan.splits} chunks)"] = timed_graph(body)
        for a in (q, out, k, v):
            a.close()
        if ws is not None:
            ws.close()
    return results


HEADDIM_DIMS = [32, 40, 48, 64, 72, 80, 96, 112, 128, 160, 192, 256]
EQUAL_BYTES_FROM = 32768  # lengths from which each D is held to D = 128 at equal KV bytes


def run_headdim_bench(
    out_dir: Path | None,
    head_dims: Sequence[int] = HEADDIM_DIMS,
    seq_lens: Sequence[int] = SEQ_LENS,
    dtypes: Sequence[str] = ("bf16", "f16"),
    iters: int = 30,
) -> dict[str, Any]:
    """``bench --only headdim``: 32/8/D for every D of ``head_dims`` at ``seq_lens``, next to
    PyTorch, and from EQUAL_BYTES_FROM tokens against D = 128 over the same number of KV
    bytes (S * D / 128 tokens), measured in the same run. From EQUAL_BYTES_FROM tokens
    also each library on the other's layout: PyTorch over our token-major cache (a strided
    view) and our decode over a head-major one (kv_layout="HND"), so each comparison can
    be made on the same bytes in the same order. Prints the table; writes
    ``bench_headdim.json`` into ``out_dir``."""
    shapes = [(32, 8, d) for d in head_dims]
    result = run_decode_bench(None, shapes, seq_lens, dtypes, iters=iters, growing=False)
    device = default_device()
    ref_lens = sorted(
        {s * d // 128 for d in head_dims for s in seq_lens if s >= EQUAL_BYTES_FROM} - {0}
    )
    refs = {
        (dtype, seq): measure_point((32, 8, 128), seq, dtype, iters, device).graph_us
        for dtype in dtypes
        for seq in ref_lens
    }
    ceiling = result["read_ceiling_tbs"]
    rows = []
    print(f"32/8/D, us per decode (graph replay) | read ceiling {ceiling:.2f} TB/s")
    print(
        f"{'dtype':<5} {'D':>4} {'seq_len':>7} {'us':>8} {'TB/s':>6} {'torch us':>9} "
        f"{'vs torch':>8} {'vs D=128, equal bytes':>22} | token-major: {'torch us':>9} "
        f"{'vs':>6} | head-major: {'us':>7} {'vs torch':>8}"
    )
    for p in map(lambda d: DecodePoint(**d), result["points"]):
        d = int(p.shape.split("/")[2])
        tbs = p.tbs(p.graph_us) or 0.0
        equal = p.seq_len >= EQUAL_BYTES_FROM
        ref_us = refs.get((p.dtype, p.seq_len * d // 128)) if equal else None
        of_128 = None if ref_us is None else ref_us / p.graph_us  # TB/s over D = 128's
        speedup = p.torch_us / p.graph_us if p.torch_us else None
        # each library on the other's layout (the same bytes as the other column)
        torch_nhd = hnd = None
        if equal:
            shape = (32, 8, d)
            torch_nhd = torch_sdpa_us(shape, p.seq_len, p.dtype, iters, token_major=True)[0]
            hnd = measure_features_point(shape, p.seq_len, p.dtype, {"kv_layout": "HND"},
                                         iters, device)  # fmt: skip
        rows.append({**asdict(p), "head_dim": d, "tbs": tbs, "vs_torch": speedup,
                     "vs_d128_equal_bytes": of_128, "torch_token_major_us": torch_nhd,
                     "head_major_us": hnd})  # fmt: skip
        print(
            f"{p.dtype:<5} {d:>4} {p.seq_len:>7} {p.graph_us:8.1f} {tbs:6.2f} "
            + (f"{p.torch_us:9.1f} {speedup:7.2f}x" if speedup else f"{'-':>9} {'-':>8}")
            + (f" {100 * of_128:21.1f}%" if of_128 else f" {'':>22}")
            + (f" | {'':>12} {torch_nhd:9.1f} {torch_nhd / p.graph_us:5.2f}x" if torch_nhd else "")
            + (f" | {'':>11} {hnd:7.1f} {p.torch_us / hnd:7.2f}x" if hnd and p.torch_us else ""),
            flush=True,
        )
    out = {"device": device.name, "read_ceiling_tbs": ceiling, "points": rows,
           "d128_reference_us": {f"{k[0]}/{k[1]}": v for k, v in refs.items()}}  # fmt: skip
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench_headdim.json").write_text(json.dumps(out, indent=1))
    return out


# ``bench --only features``: what each feature costs over the plain decode (32/8/128 bf16)
FEATURE_CASES: dict[str, dict[str, Any]] = {
    "soft-cap": {"logits_soft_cap": 50.0},
    "sinks": {"sinks": True},
    "ALiBi": {"alibi_slopes": True},
    "return_lse": {"return_lse": True},
    "all four": {"logits_soft_cap": 50.0, "sinks": True, "alibi_slopes": True,
                 "return_lse": True},
}  # fmt: skip
FEATURE_SEQ_LENS = (4096, 32768)
WINDOW_CASE = (4096, 131072)  # a 4096-token window over 131072 tokens


def measure_features_point(
    shape: tuple[int, int, int], seq: int, dtype: str, features: dict[str, Any], iters: int,
    device: Device,
) -> float:  # fmt: skip
    """Graph-replayed us of a decode with ``features`` (sinks/alibi_slopes True: random
    device arrays; sliding_window as given; kv_layout "HND": the sets read head-major),
    over the benchmark's rotated KV sets."""
    from ...decode.records import launches_for, planned
    from ...kernels import abi, catalogue

    n_heads, n_kv, hd = shape
    dt = next(d for d, name in SUPPORTED_DTYPES.items() if name == dtype)
    stream = bench_stream(device)
    q = empty((n_heads, hd), dt, device=device)
    out = empty((n_heads, hd), dt, device=device)
    fill_uniform(q, 7, stream)
    per_head = {name: empty((n_heads,), np.float32, device=device)
                for name in ("sinks", "alibi_slopes", "lse")}  # fmt: skip
    for i, arr in enumerate(per_head.values()):
        fill_uniform(arr, 11 + i, stream)
    window = features.get("sliding_window")
    bits = abi.feature_bits(
        window is not None, "logits_soft_cap" in features, "alibi_slopes" in features,
        "sinks" in features, bool(features.get("return_lse")), False,
    )  # fmt: skip
    hnd = features.get("kv_layout") == "HND"
    bits |= abi.F_HND if hnd else 0
    args = abi.FeatureArgs(
        scale=hd**-0.5, cap=features.get("logits_soft_cap", 1.0), window=window or 0,
        slopes=per_head["alibi_slopes"] if "alibi_slopes" in features else None,
        sinks=per_head["sinks"] if "sinks" in features else None,
        lse=per_head["lse"] if features.get("return_lse") else None,
        head_stride=seq * hd if hnd else 0,
    )  # fmt: skip
    plan_seq = min(seq, window or seq)
    plan, ws = planned(
        device, np.dtype(dt), n_heads, n_kv, hd, plan_seq, True, bits, "",
        lambda floats: zeros((floats,), np.float32, device=device),
    )  # fmt: skip
    combine = plan.combine_spec(dt)
    if combine is not None:  # loaded before the capture
        catalogue.split_kernel(combine, device)
    rotated = rotated_kv_sets(seq, n_kv, hd, dt, stream, device)
    sets = rotated.sets

    def eager(i: int) -> None:
        k, v = sets[i % len(sets)]
        for launch in launches_for(
            q, k, v, out, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd, seq_len=seq,
            plan_seq=plan_seq, aligned=True, bits=bits, features=args, workspace=ws,
        )[0]:  # fmt: skip
            launch.run(stream, device)

    graph_us = rotated_graph_us(eager, rotated, stream, iters)
    rotated.close()
    for arr in (q, out, *per_head.values()):
        arr.close()
    if ws is not None:
        ws.close()
    return graph_us


def run_features_bench(out_dir: Path | None, iters: int = 30) -> dict[str, Any]:
    """``bench --only features``: 32/8/128 bf16, the plain decode and each feature at
    FEATURE_SEQ_LENS, and a 4096-token window over 131072 tokens against a plain 4096-token
    decode, in one run. Prints the table; writes ``bench_features.json``."""
    device = default_device()
    shape, dtype = (32, 8, 128), "bf16"
    rows: list[dict[str, Any]] = []
    print("32/8/128 bf16, us per decode (graph replay), against the plain decode")
    print(f"{'features':<12} {'seq_len':>7} {'us':>8} {'plain us':>9} {'vs plain':>9}")
    for seq in FEATURE_SEQ_LENS:
        plain = measure_point(shape, seq, dtype, iters, device).graph_us
        for name, feats in FEATURE_CASES.items():
            us = measure_features_point(shape, seq, dtype, feats, iters, device)
            rows.append({"features": name, "seq_len": seq, "us": us, "plain_us": plain})
            print(f"{name:<12} {seq:>7} {us:8.2f} {plain:9.2f} {100 * (us / plain - 1):+8.1f}%")
    w, seq = WINDOW_CASE
    plain = measure_point(shape, w, dtype, iters, device).graph_us
    us = measure_features_point(shape, seq, dtype, {"sliding_window": w}, iters, device)
    rows.append({"features": f"window {w}", "seq_len": seq, "us": us, "plain_us": plain})
    name = f"window {w}"
    print(f"{name:<12} {seq:>7} {us:8.2f} {plain:9.2f} {100 * (us / plain - 1):+8.1f}%"
          f"  (plain: {w} tokens)")  # fmt: skip
    out = {"device": device.name, "shape": "32/8/128", "dtype": dtype, "rows": rows}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench_features.json").write_text(json.dumps(out, indent=1))
    return out


# ``bench --only fp8``: an fp8 cache against a bf16 one and PyTorch bf16
FP8_SHAPES = [*SHAPES, (32, 8, 96)]
FP8_SEQ_LENS = (32768, 131072)


def measure_fp8_point(
    shape: tuple[int, int, int], seq: int, fmt: str, iters: int, device: Device
) -> float:
    """Graph-replayed us of a bf16-q decode of an fp8 cache of format ``fmt`` (e4m3,
    e5m2), over the benchmark's rotated KV sets (their bytes; scales 1)."""
    from ...decode.fp8 import FP8_DTYPES
    from ...decode.records import launches_for, planned
    from ...kernels import catalogue

    n_heads, n_kv, hd = shape
    q_dt = np.dtype(ml_dtypes.bfloat16)
    kv_dt = next(d for d, name in FP8_DTYPES.items() if name == fmt)
    stream = bench_stream(device)
    q = empty((n_heads, hd), q_dt, device=device)
    out = empty((n_heads, hd), q_dt, device=device)
    fill_uniform(q, 7, stream)
    scales = zeros((2 * n_kv,), np.float32, device=device)
    scales.copy_from_host(np.ones(2 * n_kv, np.float32), stream)
    plan, ws = planned(
        device, q_dt, n_heads, n_kv, hd, seq, True, 0, fmt,
        lambda floats: zeros((floats,), np.float32, device=device),
    )  # fmt: skip
    combine = plan.combine_spec(q_dt)
    if combine is not None:  # loaded before the capture
        catalogue.split_kernel(combine, device)
    rotated = rotated_kv_sets(seq, n_kv, hd, kv_dt, stream, device)
    sets = rotated.sets

    def eager(i: int) -> None:
        k, v = sets[i % len(sets)]
        for launch in launches_for(
            q, k, v, out, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd, seq_len=seq,
            plan_seq=seq, aligned=True, fp8=fmt, kv_scales=scales, workspace=ws,
        )[0]:  # fmt: skip
            launch.run(stream, device)

    graph_us = rotated_graph_us(eager, rotated, stream, iters)
    rotated.close()
    for arr in (q, out, scales):
        arr.close()
    if ws is not None:
        ws.close()
    return graph_us


def run_fp8_bench(out_dir: Path | None, iters: int = 30, fmt: str = "e4m3") -> dict[str, Any]:
    """``bench --only fp8``: FP8_SHAPES at FP8_SEQ_LENS, an fp8 (``fmt``) cache with bf16 q
    against a bf16 cache and PyTorch bf16, graph-replayed, in one run; TB/s counting the
    fp8 bytes, and % of the measured read ceiling. Prints the table; writes
    ``bench_fp8.json``."""
    device = default_device()
    ceiling = measure_read_ceiling(device)
    rows: list[dict[str, Any]] = []
    for shape in FP8_SHAPES:
        for seq in FP8_SEQ_LENS:
            fp8_us = measure_fp8_point(shape, seq, fmt, iters, device)
            bf16 = measure_point(shape, seq, "bf16", iters, device)
            rows.append({"shape": "/".join(map(str, shape)), "seq_len": seq, "fp8_us": fp8_us,
                         "bf16_us": bf16.graph_us, "point": bf16})  # fmt: skip
    for row, shape in zip(rows, [s for s in FP8_SHAPES for _ in FP8_SEQ_LENS], strict=True):
        point = with_torch(row.pop("point"), shape, iters)  # PyTorch last (run_decode_bench)
        row["torch_us"] = point.torch_us
    print(f"{fmt} cache, bf16 q: us per decode (graph replay) | read ceiling {ceiling:.2f} TB/s")
    print(f"{'shape':<10} {'seq_len':>7} {'fp8 us':>8} {'TB/s':>6} {'%ceil':>6} {'bf16 us':>8} "
          f"{'vs bf16':>8} {'torch us':>9} {'vs torch':>9}")  # fmt: skip
    for row in rows:
        _, n_kv, hd = map(int, row["shape"].split("/"))
        tbs = 2 * row["seq_len"] * n_kv * hd / row["fp8_us"] / 1e6
        row["fp8_tbs"], row["pct_ceiling"] = tbs, 100 * tbs / ceiling
        torch_us = row["torch_us"]
        vs_torch = f"{torch_us / row['fp8_us']:8.2f}x" if torch_us else f"{'-':>9}"
        torch_col = f"{torch_us:9.1f}" if torch_us else f"{'-':>9}"
        print(f"{row['shape']:<10} {row['seq_len']:>7} {row['fp8_us']:8.1f} {tbs:6.2f} "
              f"{row['pct_ceiling']:6.1f} {row['bf16_us']:8.1f} "
              f"{row['bf16_us'] / row['fp8_us']:7.2f}x {torch_col} {vs_torch}")  # fmt: skip
    out = {"device": device.name, "format": fmt, "read_ceiling_tbs": ceiling, "rows": rows}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench_fp8.json").write_text(json.dumps(out, indent=1))
    return out
