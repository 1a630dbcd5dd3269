"""``python -m ferrox_driver bench --only verify``: a speculative verify of n_q query tokens
against ferrox's own one-token decode and PyTorch SDPA's verify, graph-replayed.

Each point decodes q ``(n_q, n_heads, head_dim)``, the cache's last n_q tokens (causal), over
KV sets rotated past L2 (harness.py), back to back in one captured graph; n_q = 1 is the
one-token decode of the same length in the same run. SDPA computes the same verify from the
same-sized head-major K/V with ``attn_mask`` (query t sees tokens up to ``seq - n_q + t``);
past MAX_MASKED queries it runs ``is_causal`` instead (its own alignment: a time to stand
next to ours, not the same attention). An fp8 cache (e4m3, bf16 q) has no SDPA column.

The toy table: one whole token step of the toy Llama-shaped model (apps/toy_llama.py)
verifying k tokens, one captured graph per step, next to k one-token steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ...decode.fp8 import FP8_DTYPES
from ...decode.records import launches_for
from ...driver.device import Device, default_device
from ...driver.memory import DeviceArray, empty, zeros
from .harness import bench_stream, fill_uniform, rotated_graph_us, rotated_kv_sets
from .torch_baseline import import_torch, torch_sdpa_us

__all__ = ["VERIFY_N_Q", "VERIFY_SEQ_LENS", "VERIFY_SHAPES", "run_verify_bench"]

VERIFY_SHAPES = [(32, 8, 128), (28, 4, 128)]
VERIFY_SEQ_LENS = (4096, 32768, 131072)
VERIFY_N_Q = (1, 2, 4, 8, 16, 32, 64, 128)
VERIFY_DTYPES = ("bf16", "f16", "fp8")
MAX_MASKED = 64  # SDPA with attn_mask up to here; is_causal past it
TARGETS = {2: 1.3, 4: 1.3, 8: 1.3, 16: 1.6}  # most a verify may cost over one token
_Q_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "f16": np.dtype(np.float16)}


def measure_verify_point(
    shape: tuple[int, int, int], seq: int, n_q: int, dtype: str, iters: int, device: Device,
    only: tuple[int, ...] | None = None,
) -> float:  # fmt: skip
    """Graph-replayed us of a causal verify of ``n_q`` queries (n_q = 1: the one-token
    decode) over ``seq`` tokens of a ``dtype`` cache (bf16, f16; fp8: e4m3 bytes, bf16 q,
    scales 1), planned for ``seq`` as a cache of that length would be. ``only``: time these
    of its launches alone (benchmarks/verify_parts.py)."""
    n_heads, n_kv, hd = shape
    fp8 = dtype == "fp8"
    q_dt = _Q_DTYPES["bf16" if fp8 else dtype]
    kv_dt = next(d for d, name in FP8_DTYPES.items() if name == "e4m3") if fp8 else q_dt
    stream = bench_stream(device)
    q = empty((n_q, n_heads, hd), q_dt, device=device)
    out = empty((n_q, n_heads, hd), q_dt, device=device)
    fill_uniform(q, 7, stream)
    scales = None
    if fp8:
        scales = zeros((2 * n_kv,), np.float32, device=device)
        scales.copy_from_host(np.ones(2 * n_kv, np.float32), stream)
    held: list[DeviceArray] = []

    def workspace(floats: int) -> DeviceArray:  # (made by the first, uncaptured call)
        if not held:
            held.append(zeros((max(floats, 1),), np.float32, device=device))
        return held[0]

    rotated = rotated_kv_sets(seq, n_kv, hd, kv_dt, stream, device)
    sets = rotated.sets

    def eager(i: int) -> None:
        k, v = sets[i % len(sets)]
        launches = launches_for(
            q, k, v, out, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd, seq_len=seq,
            plan_seq=seq, aligned=True, dtype=q_dt, fp8="e4m3" if fp8 else "",
            kv_scales=scales, workspace=workspace, n_q=n_q,
        )[0]  # fmt: skip
        for at, launch in enumerate(launches):
            if only is None or at in only:
                launch.run(stream, device)

    graph_us = rotated_graph_us(eager, rotated, stream, iters)
    rotated.close()
    for arr in (q, out, *held, *(() if scales is None else (scales,))):
        arr.close()
    return graph_us


def run_verify_bench(
    out_dir: Path | None,
    iters: int = 20,
    shapes: list[tuple[int, int, int]] | None = None,
    seqs: list[int] | None = None,
    dtypes: list[str] | None = None,
    n_qs: tuple[int, ...] = VERIFY_N_Q,
    toy: bool = True,
) -> dict[str, Any]:
    """``bench --only verify``: every shape, length, dtype and n_q, ferrox then SDPA (last,
    as run_decode_bench), the ratios to one token and to SDPA; then the toy model's table.
    Prints the tables; writes ``bench_verify.json``."""
    device = default_device()
    rows: list[dict[str, Any]] = []
    for shape in shapes or VERIFY_SHAPES:
        for seq in seqs or VERIFY_SEQ_LENS:
            for dtype in dtypes or VERIFY_DTYPES:
                one = 0.0
                for n_q in n_qs:
                    us = measure_verify_point(shape, seq, n_q, dtype, iters, device)
                    one = us if n_q == 1 else one
                    rows.append({"shape": "/".join(map(str, shape)), "seq_len": seq,
                                 "dtype": dtype, "n_q": n_q, "us": us,
                                 "vs_one": us / one if one else None})  # fmt: skip
    if import_torch() is not None:
        for row in rows:
            if row["dtype"] == "fp8":
                continue
            n_h, n_kv, hd = map(int, row["shape"].split("/"))
            causal = "mask" if row["n_q"] <= MAX_MASKED else "is_causal"
            sdpa, _ = torch_sdpa_us((n_h, n_kv, hd), row["seq_len"], row["dtype"], iters,
                                    n_q=row["n_q"], causal=causal)  # fmt: skip
            row["sdpa_us"], row["sdpa_form"] = sdpa, causal
    print("causal verify of n_q tokens, us per decode (graph replay, KV rotated past L2):")
    print(f"{'shape':<10} {'seq_len':>7} {'dtype':<5} {'n_q':>4} {'us':>8} {'vs 1 tok':>9} "
          f"{'target':>7} {'sdpa us':>9} {'sdpa form':>10} {'vs sdpa':>8}")  # fmt: skip
    for row in rows:
        target, sdpa = TARGETS.get(row["n_q"]), row.get("sdpa_us")
        target_col = f"{target:.1f}x" if target else "-"
        sdpa_col = f"{sdpa:.1f}" if sdpa else "-"
        vs_sdpa = f"{sdpa / row['us']:.2f}x" if sdpa else "-"
        print(f"{row['shape']:<10} {row['seq_len']:>7} {row['dtype']:<5} {row['n_q']:>4} "
              f"{row['us']:8.1f} {row['vs_one']:8.2f}x {target_col:>7} {sdpa_col:>9} "
              f"{row.get('sdpa_form', '-'):>10} {vs_sdpa:>8}")  # fmt: skip
    result: dict[str, Any] = {"device": device.name, "rows": rows}
    if toy and import_torch() is not None:
        result["toy"] = run_toy_verify()
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench_verify.json").write_text(json.dumps(result, indent=1))
    return result


def run_toy_verify(
    layers: int = 32, contexts: tuple[int, ...] = (4096, 32768), ks: tuple[int, ...] = (1, 2, 4, 8),
    steps: int = 20,
) -> list[dict[str, Any]]:  # fmt: skip
    """The toy Llama-3-8B-shaped model (``layers`` layers): ms of one captured step verifying
    k tokens (ferrox's KVCache per layer), next to k one-token steps."""
    from ..toy_llama import LLAMA_3_8B, ToyLlama, fits, time_verify

    shape = LLAMA_3_8B
    rows: list[dict[str, Any]] = []
    model = ToyLlama(layers, **shape)
    for context in contexts:
        if not fits(layers, shape, context):
            print(f"toy model: {layers} layers at {context} tokens do not fit; skipped")
            continue
        one = 0.0
        for k in ks:
            ms = time_verify(model, context, steps, k)
            one = ms if k == 1 else one
            rows.append({"context": context, "k": k, "ms": ms, "k_one_token_ms": k * one})
    print(f"toy Llama-3-8B-shaped model ({layers} layers, bf16), one captured step verifying k "
          "tokens:")  # fmt: skip
    print(f"{'context':>8} {'k':>3} {'verify ms':>10} {'k x 1-token ms':>15} {'ratio':>6} "
          f"{'ms/token':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['context']:>8} {r['k']:>3} {r['ms']:10.2f} {r['k_one_token_ms']:15.2f} "
              f"{r['ms'] / r['k_one_token_ms']:6.2f} {r['ms'] / r['k']:9.2f}")  # fmt: skip
    return rows
