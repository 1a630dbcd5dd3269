"""``python -m ferrox_driver demo``: a multi-layer decode loop, eager, a CUDA graph per layer,
and one CUDA graph per token (every layer in it, one sync); then, where PyTorch sees the GPU,
a Llama-shaped model with random weights whose whole token is one PyTorch CUDA graph, its
attention on ferrox or on SDPA (``ferrox_driver.apps.toy_llama``). Without a GPU
(``run_cpu_demo``): the float64 reference decode, the plan a GPU of the chosen architecture
would run, and its kernels compiled for that architecture."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from ..cache.graphs import DecodeGraph, LayerDecodeGraph
from ..cache.layers import LayerKVCache
from ..decode.checks import SUPPORTED_DTYPES
from ..decode.plan import SplitPlan
from ..decode.reference import reference_gqa_decode
from ..kernels.traits import chunk_tokens
from .progress import progress

__all__ = ["DemoConfig", "describe_plan", "run_cpu_demo", "run_demo", "run_model_demo"]

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


def _dtype(name: str) -> np.dtype:
    return np.dtype(next(d for d, n in SUPPORTED_DTYPES.items() if n == name))


def run_demo(cfg: DemoConfig) -> int:
    """Run the loop; print latencies and checks. Returns the exit code (1 on a failed check)."""
    dt = _dtype(cfg.dtype)
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


def _kib(n: int) -> str:
    return f"{n / 1024:.1f}".removesuffix(".0") + " KiB"


def describe_plan(
    plan: SplitPlan, dtype: np.dtype, n_heads: int, n_kv_heads: int, head_dim: int, seq: int
) -> list[str]:
    """The launches of ``plan`` (for ``seq`` tokens of this shape), in words, a line each."""
    x, y, z = plan.grid(n_kv_heads)
    blocks = x * y * z
    kind = (
        "tensor cores (mma.sync; K and V stream through each warp's cp.async ring)"
        if plan.tensor_cores
        else "CUDA cores"
    )
    group = n_heads // n_kv_heads
    heads = "two KV heads' rows read as one (a pair), " if plan.paired else ""
    per_block = -(-(2 * group if plan.paired else group) // plan.head_tiles)
    chunk = chunk_tokens(seq, plan.splits, plan.tile)
    shared = plan.shared_bytes(head_dim, dtype.itemsize)
    lines = [
        f"{plan.kernel}: {kind}",
        f"  grid {x} x {y} x {z} = {blocks} block(s) of {plan.threads} threads"
        + (f", {_kib(shared)} of shared memory each" if shared else ""),
        f"  {heads}each block: one chunk of one KV head's cache, for {per_block} query "
        f"head(s) of its group",
        f"  the sequence in {plan.splits} chunk(s) per KV head of up to {chunk} tokens "
        f"(multiples of {plan.tile}, recomputed on the GPU from the length)",
    ]
    combine = plan.combine_kernel(dtype)
    if combine is None:
        lines.append(
            f"  each KV head's chunks merged on chip, in a cluster of {plan.cluster} blocks "
            f"(one kernel)"
        )
    else:
        lines.append(
            f"then {combine}: merges the chunks' partial results (log-sum-exp weighted), "
            f"one block per query head"
        )
    return lines


def run_cpu_demo(cfg: DemoConfig, arch: str) -> int:
    """What the library does without a GPU: the float64 reference decode of a small problem,
    the plan a GPU of ``arch`` would run for the demo's shape at ``cfg.tokens`` tokens, and
    that plan's kernels compiled for ``arch`` (timed). Returns 0, or 1 where the reference
    disagrees with its own definition."""
    from ..archs import arch_limits
    from ..decode import launches
    from ..decode import plan as attention
    from ..driver import module_cache
    from ..driver.compiler import nvrtc_version_string

    H, KV, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    dims = f"n_heads={H}, n_kv_heads={KV}, head_dim={D}"
    shape = f"{H}/{KV}/{D}"
    rng = np.random.default_rng()
    seq = 16
    q = rng.standard_normal((H, D), dtype=np.float32)
    k = rng.standard_normal((seq, KV, D), dtype=np.float32)
    v = rng.standard_normal((seq, KV, D), dtype=np.float32)
    out = reference_gqa_decode(q, k, v, n_heads=H, n_kv_heads=KV, head_dim=D)
    scores = k[:, 0].astype(np.float64) @ q[0] / np.sqrt(D)  # head 0 by hand: its KV head 0
    p = np.exp(scores - scores.max())
    by_hand = (p / p.sum()) @ v[:, 0].astype(np.float64)
    diff = float(np.abs(by_hand - out[0]).max())
    print(f"1. reference: the exact decode on the CPU, in float64, for any shape (q {q.shape}, "
          f"k and v {k.shape}):", flush=True)  # fmt: skip
    print(f"   out = fd.reference_gqa_decode(q, k, v, {dims})")
    print(
        f"   out {out.shape} {out.dtype}; out[0, :4] = {np.array2string(out[0, :4], precision=4)}"
    )
    print(f"   query head 0 by hand, softmax(q k^T / sqrt({D})) v over its KV head: max "
          f"difference {diff:.1e}")  # fmt: skip
    print("   (a GPU's fd.gqa_decode(q, k, v, ...) is checked against it: the tests, the demo)")

    limits = arch_limits(arch)
    dt = _dtype(cfg.dtype)
    T = cfg.tokens
    print(f"\n2. plan: what fd.gqa_decode runs for {shape} {cfg.dtype} at {T} tokens on a GPU "
          f"of {arch} ({limits.gpu.split(' (')[0]}: {limits.multiprocessor_count} SMs, "
          f"{_kib(limits.shared_per_block)} of shared memory per block):", flush=True)  # fmt: skip
    compiles = module_cache.stats.compiles
    started = time.perf_counter()
    traits = launches.arch_traits(arch)  # (planning compiles the candidates: occupancy)
    plan = attention.plan(traits, dt, H, KV, D, T)
    kernels = [plan.spec, *filter(None, [plan.combine_spec(dt)])]
    programs = [launches.split_program([spec], arch) for spec in kernels]
    seconds = time.perf_counter() - started
    fresh = module_cache.stats.compiles - compiles
    for line in describe_plan(plan, dt, H, KV, D, T):
        print(f"   {line}")

    how = (
        f"compiled {fresh} module(s) in {seconds:.1f} s"
        if fresh
        else f"loaded from the disk cache in {seconds:.2f} s (compiled on an earlier run)"
    )
    print(f"\n3. compile: the plan's kernels for {arch} with NVRTC {nvrtc_version_string()} "
          f"(no GPU needed): {how}", flush=True)  # fmt: skip
    for name, program in zip((s.name for s in kernels), programs, strict=True):
        r = program.resources[name]
        spills = r.spill_stores + r.spill_loads + r.stack_bytes
        print(f"   {name}: {r.registers} registers a thread, "
              f"{'no spills' if not spills else f'{spills} bytes spilled'}")  # fmt: skip
    where = module_cache.cache_dir()
    if where is not None:
        print(f"   (kept in {where}: a GPU of {arch} loads them without compiling)")
    print("\nOn a GPU, this demo runs a decode loop over layers: eager, a CUDA graph per layer, "
          "one graph per token.")  # fmt: skip
    return 0 if diff < 1e-9 else 1
