"""A Llama-shaped model with random weights, one whole token captured as one PyTorch CUDA
graph, with its attention on ferrox or on PyTorch's SDPA: the demo's last part and
``benchmarks/toy_llama.py``. Needs PyTorch with a GPU; nothing else in the package imports
this module (``import ferrox_driver`` imports no framework).

The model: RMSNorm, fused QKV and output projections, RoPE, a SwiGLU MLP and a greedy next
token, bf16, Llama-3-8B's shapes by default. Three attentions over the same weights, cache
and token:

- ``FerroxAttention``: a ``KVCache`` per layer, ``kv_append_async`` + ``gqa_decode_async``
  (the length on the device);
- ``SdpaAttention``: PyTorch's SDPA over a static head-major cache, the new row written at
  the device's position and a mask over the capacity (what transformers' StaticCache does);
- ``FerroxStaticAttention``: ferrox over that same static cache, in place
  (``gqa_decode_async`` of the pair, ``kv_layout="HND"``, the length on the device).

``compare`` times each as a graph of one token and measures how far each one's first-step
logits are from the same model's with its attention in float32: in a deep random bf16
model two right attentions differ by a few 1e-2, so ferrox passes where it is no further
from float32 than SDPA is (twice its distance, or 1e-2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F

from ..cache.device_ops import gqa_decode_async, kv_append_async
from ..cache.kv_cache import KVCache

__all__ = [
    "LLAMA_3_8B",
    "SMALL",
    "ToyLlama",
    "ToyResult",
    "cache_logits_errors",
    "compare",
    "fits",
    "time_verify",
]

BF16 = torch.bfloat16
# (hidden, heads, kv_heads, head_dim, intermediate, vocab)
LLAMA_3_8B = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "inter": 14336,
              "vocab": 128256}  # fmt: skip
SMALL = {**LLAMA_3_8B, "hidden": 512, "inter": 1024, "vocab": 1000}  # narrow layers
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Context = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V rows (n, kv_heads, hd)


class ToyLlama:
    """Random bf16 weights scaled so that activations stay O(1)."""

    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 inter: int, vocab: int, seed: int = 0) -> None:  # fmt: skip
        g = torch.Generator("cuda").manual_seed(seed)

        def w(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=g, device="cuda") / math.sqrt(rows)).to(BF16)

        self.shape = (heads, kv_heads, head_dim)
        self.embed = w(vocab, hidden) * math.sqrt(vocab)
        self.layers = [
            {
                "ln1": torch.ones(hidden, device="cuda", dtype=BF16),
                "qkv": w(hidden, (heads + 2 * kv_heads) * head_dim),
                "o": w(heads * head_dim, hidden),
                "ln2": torch.ones(hidden, device="cuda", dtype=BF16),
                "gate_up": w(hidden, 2 * inter),
                "down": w(inter, hidden),
            }
            for _ in range(layers)
        ]
        self.norm = torch.ones(hidden, device="cuda", dtype=BF16)
        self.head = w(hidden, vocab)
        self.inv_freq = 500000.0 ** (-torch.arange(0, head_dim, 2, device="cuda") / head_dim)

    @staticmethod
    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(BF16) * weight

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        angle = pos.float() * self.inv_freq  # (head_dim / 2,), from the device's position
        cos, sin = torch.cos(angle), torch.sin(angle)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(BF16)

    def step(self, token: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
        """One token: the logits, and token/pos advanced in place (capturable)."""
        heads, kv_heads, hd = self.shape
        x = self.embed[token]  # (1, hidden)
        for i, layer in enumerate(self.layers):
            qkv = self.rms(x, layer["ln1"]) @ layer["qkv"]
            q, k, v = qkv[0].split([heads * hd, kv_heads * hd, kv_heads * hd])
            q = self.rope(q.view(heads, hd), pos)
            k = self.rope(k.view(kv_heads, hd), pos)
            attn = attend(i, q, k, v.contiguous().view(kv_heads, hd), pos)  # (heads, hd)
            x = x + attn.reshape(1, -1) @ layer["o"]
            gate, up = (self.rms(x, layer["ln2"]) @ layer["gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"]
        logits = self.rms(x, self.norm) @ self.head
        token.copy_(logits.argmax(-1))
        pos.add_(1)
        return logits

    def verify(self, tokens: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
        """A verify step of k = len(tokens) tokens at positions pos .. pos + k - 1: the
        logits ``(k, vocab)``; ``tokens`` takes each position's greedy next token and
        ``pos`` advances by k, in place (capturable). ``attend`` sees q ``(k, heads, hd)``
        and the rows ``(k, kv_heads, hd)``."""
        heads, kv_heads, hd = self.shape
        n = tokens.shape[0]
        at = (pos + torch.arange(n, device="cuda")).view(n, 1, 1)
        x = self.embed[tokens]  # (k, hidden)
        for i, layer in enumerate(self.layers):
            qkv = self.rms(x, layer["ln1"]) @ layer["qkv"]
            q, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
            q = self.rope(q.reshape(n, heads, hd), at)
            k = self.rope(k.reshape(n, kv_heads, hd), at)
            attn = attend(i, q, k, v.contiguous().view(n, kv_heads, hd), pos)
            x = x + attn.reshape(n, -1) @ layer["o"]
            gate, up = (self.rms(x, layer["ln2"]) @ layer["gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"]
        logits = self.rms(x, self.norm) @ self.head
        tokens.copy_(logits.argmax(-1))
        pos.add_(n)
        return logits


def _rows_numpy(t: torch.Tensor) -> np.ndarray:
    """A bf16 torch tensor's values as an ml_dtypes.bfloat16 numpy array."""
    return t.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)


class SdpaAttention:
    """SDPA over a static head-major cache (``exact``: in float32, the reference)."""

    def __init__(self, context: Context, capacity: int, shape: tuple[int, int, int],
                 exact: bool = False) -> None:  # fmt: skip
        heads, kv_heads, hd = shape
        self.heads, self.exact = heads, exact
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for k, v in context:
            n = k.shape[0]
            kc = torch.zeros(1, kv_heads, capacity, hd, device="cuda", dtype=BF16)
            vc = torch.zeros_like(kc)
            kc[0, :, :n] = k.transpose(0, 1)
            vc[0, :, :n] = v.transpose(0, 1)
            self.k.append(kc)
            self.v.append(vc)
        self.slots = torch.arange(capacity, device="cuda")

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Layer ``i``'s new K and V rows into the cache at the device's position."""
        at = pos.view(1)
        self.k[i].index_copy_(2, at, k.view(1, -1, 1, k.shape[-1]))
        self.v[i].index_copy_(2, at, v.view(1, -1, 1, v.shape[-1]))

    def __call__(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 pos: torch.Tensor) -> torch.Tensor:  # fmt: skip
        self.write(i, k, v, pos)
        mask = (self.slots <= pos).view(1, 1, 1, -1)
        q, kc, vc = q.view(1, self.heads, 1, -1), self.k[i], self.v[i]
        if self.exact:
            q, kc, vc = q.float(), kc.float(), vc.float()
        out = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)
        return out.to(BF16).view(self.heads, -1)

    def close(self) -> None:
        self.k.clear()
        self.v.clear()


class FerroxAttention:
    """A ``KVCache`` per layer: ``kv_append_async`` then ``gqa_decode_async`` (of ``n_q``
    rows and queries at once: a verify)."""

    def __init__(
        self, context: Context, capacity: int, shape: tuple[int, int, int], n_q: int = 1,
        cache_dtype: Any = None,
    ) -> None:  # fmt: skip
        heads, kv_heads, hd = shape
        self.heads = heads
        self.caches: list[KVCache] = []
        dtype = ml_dtypes.bfloat16 if cache_dtype is None else cache_dtype
        for k, v in context:  # (n, kv_heads, hd) each, token-major
            kv = KVCache(kv_heads, hd, capacity, dtype=dtype)
            self.caches.append(kv)
            kv.extend(_rows_numpy(k), _rows_numpy(v))
            kv.prepare(heads, n_q=n_q)  # kernels and scratch before any capture
            kv.synchronize()  # the prefill's copies done before PyTorch's streams append
        lead = (n_q,) if n_q > 1 else ()
        self.out = [torch.empty(*lead, heads, hd, device="cuda", dtype=BF16) for _ in context]

    def __call__(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 pos: torch.Tensor) -> torch.Tensor:  # fmt: skip
        stream = torch.cuda.current_stream().cuda_stream
        kv_append_async(self.caches[i], k, v, stream=stream)
        gqa_decode_async(q, self.caches[i], self.out[i], n_heads=self.heads, stream=stream)
        return self.out[i]

    def close(self) -> None:
        for kv in self.caches:
            kv.close()


class FerroxStaticAttention:
    """ferrox over SDPA's static head-major cache, in place (what a transformers
    StaticCache holds): the row written by PyTorch at the device's position, then
    ``gqa_decode_async(q, (k_cache, v_cache), ..., seq_len=, kv_layout="HND")``."""

    def __init__(self, context: Context, capacity: int, shape: tuple[int, int, int]) -> None:
        self.cache = SdpaAttention(context, capacity, shape)
        heads, _, hd = shape
        self.heads = heads
        self.length = torch.zeros(1, dtype=torch.int32, device="cuda")  # tokens, on the device
        self.out = [torch.empty(heads, hd, device="cuda", dtype=BF16) for _ in context]

    def __call__(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 pos: torch.Tensor) -> torch.Tensor:  # fmt: skip
        self.cache.write(i, k, v, pos)
        if i == 0:
            self.length.copy_(pos.view(1) + 1)
        stream = torch.cuda.current_stream().cuda_stream
        pair = (self.cache.k[i], self.cache.v[i])
        gqa_decode_async(q, pair, self.out[i], n_heads=self.heads, stream=stream,
                         seq_len=self.length, kv_layout="HND")  # fmt: skip
        return self.out[i]

    def close(self) -> None:
        self.cache.close()


def first_logits(model: ToyLlama, attention: Attend, context: int) -> torch.Tensor:
    """The logits of one eager token at position ``context``."""
    token = torch.zeros(1, dtype=torch.long, device="cuda")
    pos = torch.full((), context, dtype=torch.long, device="cuda")
    return model.step(token, pos, attention).float()


def run(model: ToyLlama, attention: Attend, context: int, steps: int
        ) -> tuple[float, torch.Tensor]:  # fmt: skip
    """ms per token of the captured token graph (the median of 5 rounds of ``steps``
    replays), and the first step's logits."""
    token = torch.zeros(1, dtype=torch.long, device="cuda")
    pos = torch.full((), context, dtype=torch.long, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (cuBLAS workspaces): one eager token
        first = model.step(token, pos, attention).clone()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):  # (where the warm-up made ferrox's scratch)
        model.step(token, pos, attention)
    graph.replay()  # (the second token, untimed)
    ms = _replay_ms(graph, steps)
    del graph
    return ms, first.float()


def _replay_ms(graph: torch.cuda.CUDAGraph, steps: int) -> float:
    """ms per replay of ``graph``: the median of 5 rounds of ``steps`` replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rounds = []
    for _ in range(5):
        start.record()
        for _ in range(steps):
            graph.replay()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / steps)
    return sorted(rounds)[2]


@dataclass(frozen=True)
class ToyResult:
    """One context's ms per token and first-step logits' distance from float32 attention's,
    by path ("ferrox", "in place", "sdpa")."""

    context: int
    ms: dict[str, float]
    err: dict[str, float]

    @property
    def ok(self) -> bool:
        """ferrox's paths no further from float32 attention than SDPA (twice, or 1e-2)."""
        return max(self.err["ferrox"], self.err["in place"]) <= max(2 * self.err["sdpa"], 1e-2)


PATHS: dict[str, Any] = {
    "ferrox": FerroxAttention,
    "in place": FerroxStaticAttention,
    "sdpa": SdpaAttention,
}


def compare(model: ToyLlama, context: int, steps: int) -> ToyResult:
    """The three attentions on ``model`` after ``context`` random tokens of cache."""
    _, kv_heads, hd = model.shape
    g = torch.Generator("cuda").manual_seed(context)
    rows = [(torch.randn(context, kv_heads, hd, generator=g, device="cuda").to(BF16),
             torch.randn(context, kv_heads, hd, generator=g, device="cuda").to(BF16))
            for _ in model.layers]  # fmt: skip
    capacity = context + 5 * steps + 2
    exact = SdpaAttention(rows, capacity, model.shape, exact=True)
    want = first_logits(model, exact, context)
    exact.close()
    ms, err = {}, {}
    for name, cls in PATHS.items():
        attention = cls(rows, capacity, model.shape)
        try:
            ms[name], logits = run(model, attention, context, steps)
        finally:
            attention.close()
        err[name] = ((logits - want).norm() / want.norm()).item()
    return ToyResult(context, ms, err)


def cache_logits_errors(model: ToyLlama, context: int, dtypes: dict[str, Any]) -> dict[str, float]:
    """The relative error of ``model``'s logits at position ``context`` (after that many
    random tokens of cache) with each of ``dtypes``'s caches (name -> KVCache dtype),
    against the same step on a bf16 KVCache."""
    _, kv_heads, hd = model.shape
    g = torch.Generator("cuda").manual_seed(context + 1)
    rows = [(torch.randn(context, kv_heads, hd, generator=g, device="cuda").to(BF16),
             torch.randn(context, kv_heads, hd, generator=g, device="cuda").to(BF16))
            for _ in model.layers]  # fmt: skip
    logits = {}
    for name, dtype in {"bf16": None, **dtypes}.items():
        attention = FerroxAttention(rows, context + 2, model.shape, cache_dtype=dtype)
        try:
            logits[name] = first_logits(model, attention, context)
        finally:
            attention.close()
    want = logits.pop("bf16")
    return {name: ((got - want).norm() / want.norm()).item() for name, got in logits.items()}


def time_verify(model: ToyLlama, context: int, steps: int, k: int) -> float:
    """ms of one captured step of ``model`` verifying ``k`` tokens (``ToyLlama.verify``,
    ferrox's KVCache per layer) after ``context`` random tokens: the median of 5 rounds of
    ``steps`` replays (the cache grows by k per replay: every draft accepted)."""
    _, kv_heads, hd = model.shape
    g = torch.Generator("cuda").manual_seed(context)
    rows = [(torch.randn(context, kv_heads, hd, generator=g, device="cuda").to(BF16),
             torch.randn(context, kv_heads, hd, generator=g, device="cuda").to(BF16))
            for _ in model.layers]  # fmt: skip
    attention = FerroxAttention(rows, context + (5 * steps + 4) * k, model.shape, n_q=k)
    rows.clear()
    tokens = torch.zeros(k, dtype=torch.long, device="cuda")
    pos = torch.full((), context, dtype=torch.long, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):  # warm-up: one eager step
            model.verify(tokens, pos, attention)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            model.verify(tokens, pos, attention)
        graph.replay()
        ms = _replay_ms(graph, steps)
        del graph
    finally:
        torch.cuda.synchronize()
        attention.close()
    return ms


def fits(layers: int, shape: dict[str, int], context: int) -> bool:
    """Whether the model's weights and three attentions' caches fit the GPU's free memory
    (with a quarter to spare)."""
    h, heads, kv, hd = shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    per_layer = h * (heads + 2 * kv) * hd + heads * hd * h + 3 * h * shape["inter"]
    weights = 2 * (layers * per_layer + 2 * shape["vocab"] * h)
    caches = 4 * layers * (context + 512) * kv * hd * 2 * 2  # rows, exact, two at a time
    free, _ = torch.cuda.mem_get_info()
    return 1.25 * (weights + caches) < free


def table_header() -> str:
    return (f"{'context':>8} {'ferrox ms':>10} {'in place ms':>12} {'sdpa ms':>8} "
            f"{'ferrox tok/s':>13} {'sdpa tok/s':>11} {'speed-up':>9} {'ferrox err':>11} "
            f"{'in place err':>13} {'sdpa err':>9}")  # fmt: skip


def table_row(r: ToyResult) -> str:
    f, p, s = r.ms["ferrox"], r.ms["in place"], r.ms["sdpa"]
    return (f"{r.context:>8} {f:>10.3f} {p:>12.3f} {s:>8.3f} {1e3 / f:>13.1f} "
            f"{1e3 / s:>11.1f} {s / f:>8.2f}x {r.err['ferrox']:>11.1e} "
            f"{r.err['in place']:>13.1e} {r.err['sdpa']:>9.1e}")  # fmt: skip
