"""``python -m ferrox_driver demo``: a multi-layer decode loop, eager, a CUDA graph per layer,
and one CUDA graph per token (every layer in it, one sync); then, where PyTorch sees the GPU,
a Llama-shaped model with random weights whose whole token is one PyTorch CUDA graph, its
attention on ferrox or on SDPA (``ferrox_driver.toy_llama``)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from .decode_graph import DecodeGraph, LayerDecodeGraph
from .kv_cache import LayerKVCache
from .progress import progress
from .reference import reference_gqa_decode
from .validation import SUPPORTED_DTYPES

__all__ = ["DemoConfig", "run_demo", "run_model_demo"]

TOL = {"f32": 1e-5, "f16": 1e-2, "bf16": 1e-2}


@dataclass(frozen=True)
class DemoConfig:
    """Shapes of a real model: Llama-3-8B by default (32 layers, 32/8/128)."""

    layers: int = 32
    tokens: int = 256
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bf16"
    check_every: int = 64
    model_context: int = 4096  # the toy model's tokens of context (0: no model part)
    model_shape: str = "llama-3-8b"  # or "small" (narrow layers)


def _rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out64 = out.astype(np.float64)
    return float(np.linalg.norm(out64 - ref) / max(np.linalg.norm(ref), 1e-300))


def run_demo(cfg: DemoConfig) -> int:
    """Run the loop; print latencies and checks. Returns the exit code (1 on a failed check)."""
    dt = next(d for d, name in SUPPORTED_DTYPES.items() if name == cfg.dtype)
    rng = np.random.default_rng()
    L, T = cfg.layers, cfg.tokens
    shape_q = (cfg.n_heads, cfg.head_dim)
    shape_kv = (cfg.n_kv_heads, cfg.head_dim)
    print(
        f"decode loop: {L} layers x {T} tokens, {cfg.n_heads}/{cfg.n_kv_heads}/{cfg.head_dim} "
        f"{cfg.dtype}; reference checks every {cfg.check_every} tokens",
        flush=True,
    )
    k_all = rng.standard_normal((L, T, *shape_kv), dtype=np.float32).astype(dt)
    v_all = rng.standard_normal((L, T, *shape_kv), dtype=np.float32).astype(dt)
    failures = 0
    latency: dict[str, list[float]] = {"eager": [], "graph": [], "token": []}
    with (
        LayerKVCache(L, cfg.n_kv_heads, cfg.head_dim, T, dtype=dt) as eager_kv,
        LayerKVCache(L, cfg.n_kv_heads, cfg.head_dim, T, dtype=dt) as graph_kv,
        LayerKVCache(L, cfg.n_kv_heads, cfg.head_dim, T, dtype=dt) as token_kv,
        LayerDecodeGraph(token_kv, n_heads=cfg.n_heads) as token_graph,
    ):
        graphs = [DecodeGraph(graph_kv[i], n_heads=cfg.n_heads) for i in range(L)]
        try:
            for t in progress(range(T), T, "tokens"):
                q = rng.standard_normal((L, *shape_q), dtype=np.float32).astype(dt)
                t0 = time.perf_counter()
                eager_out = []
                for i in range(L):
                    eager_kv[i].append(k_all[i, t], v_all[i, t])
                    eager_out.append(eager_kv[i].decode(q[i], n_heads=cfg.n_heads))
                t1 = time.perf_counter()
                graph_out = [graphs[i](q[i], k_all[i, t], v_all[i, t]) for i in range(L)]
                t2 = time.perf_counter()
                token_out = token_graph(q, k_all[:, t], v_all[:, t])
                t3 = time.perf_counter()
                latency["eager"].append((t1 - t0) * 1e3)
                latency["graph"].append((t2 - t1) * 1e3)
                latency["token"].append((t3 - t2) * 1e3)
                if t % cfg.check_every == 0 or t == T - 1:
                    for i in sorted({0, int(rng.integers(L))}):
                        ref = reference_gqa_decode(
                            q[i],
                            k_all[i, : t + 1],
                            v_all[i, : t + 1],
                            n_heads=cfg.n_heads,
                            n_kv_heads=cfg.n_kv_heads,
                            head_dim=cfg.head_dim,
                        )
                        errs = (_rel_err(eager_out[i], ref), _rel_err(graph_out[i], ref),
                                _rel_err(token_out[i], ref))  # fmt: skip
                        if not max(errs) < TOL[cfg.dtype]:
                            failures += 1
                            print(f"\nMISMATCH token {t} layer {i}: rel err eager/graph/token "
                                  f"{errs}")  # fmt: skip
        finally:
            for g in graphs:
                g.close()
    names = {"eager": "eager", "graph": "a graph per layer", "token": "a graph per token"}
    print(f"{'path':<18} {'ms/token (all layers)':>22} {'us/layer':>10}")
    for path, values in latency.items():
        med = statistics.median(values[1:] or values)
        print(f"{names[path]:<18} {med:>22.3f} {med * 1e3 / L:>10.1f}")
    eager = statistics.median(latency["eager"])
    print(f"graph replay is {eager / statistics.median(latency['graph']):.1f}x faster per token "
          f"than eager launches; one graph per token, "
          f"{eager / statistics.median(latency['token']):.1f}x")  # fmt: skip
    print("reference checks: " + ("all passed" if not failures else f"{failures} FAILED"))
    model_failed = run_model_demo(cfg) if cfg.model_context else False
    return 1 if failures or model_failed else 0


def _torch_on_gpu() -> str | None:
    """Why the model part cannot run here (None: it can)."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return f"PyTorch {torch.__version__} sees no GPU"
    return None


def run_model_demo(cfg: DemoConfig) -> bool:
    """The toy model's part: ms per token of a whole token in one PyTorch CUDA graph with
    ferrox's attention against SDPA's; a line saying why not where PyTorch cannot run it.
    Returns True when ferrox's logits are further from float32 attention's than SDPA's."""
    why = _torch_on_gpu()
    if why is not None:
        print(f"\nmodel: skipped ({why}; pip install torch for a Llama-shaped model's token "
              f"graph with ferrox's attention against SDPA's)")  # fmt: skip
        return False
    from . import toy_llama

    shape = toy_llama.SMALL if cfg.model_shape == "small" else toy_llama.LLAMA_3_8B
    name = "Llama-3-8B-shaped" if cfg.model_shape != "small" else "narrow Llama-shaped"
    if shape is toy_llama.LLAMA_3_8B and not toy_llama.fits(cfg.layers, shape, cfg.model_context):
        shape, name = toy_llama.SMALL, "narrow Llama-shaped (the full width does not fit)"
    print(f"\nmodel: a {name} model with random weights, {cfg.layers} layers, bf16, "
          f"{cfg.model_context} tokens of context; each token one PyTorch CUDA graph, its "
          f"attention on ferrox (a KVCache per layer), on ferrox over SDPA's static cache "
          f"in place, and on SDPA; err: the first step's logits against float32 "
          f"attention's", flush=True)  # fmt: skip
    model = toy_llama.ToyLlama(cfg.layers, **shape)
    result = toy_llama.compare(model, cfg.model_context, steps=32)
    print(toy_llama.table_header())
    print(toy_llama.table_row(result))
    print("model check: " + ("passed" if result.ok else "FAILED (ferrox's logits further from "
                             "float32 attention's than twice SDPA's)"))  # fmt: skip
    return not result.ok
