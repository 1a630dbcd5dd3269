"""``python -m ferrox_driver bench --only kv4 --accuracy``: how far each KV cache format
moves the attention output, on the CPU (numpy, float64 reference).

Each row is one kind of data, each column one format of the cache (K and V quantized the
same way unless the column says otherwise); a cell is ``||out - ref|| / ||ref||``, out the
float64 attention of q over the dequantized cache, ref the float64 attention over the
cache as it came (q in bf16, as a model's). Rotated formats rotate K (and q with it: the
scores are unchanged in exact arithmetic) and, where the column says so, V (the output
rotated back). The formats are the host helpers' (decode/kv4.py, decode/fp8.py), so the
table is what the GPU's caches store, whatever kernel reads them.

The rows: Gaussian K and V; K with a few outlier channels 10-50x the rest (as real models'
K have); a sink token whose K has a large norm and which the queries attend to; a long
context (131072 tokens) where errors could add up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...decode.fp8 import quantize_fp8
from ...decode.kv4 import (
    dequantize_nvfp4,
    dequantize_q4,
    hadamard,
    quantize_nvfp4,
    quantize_q4,
)
from ...decode.reference import reference_gqa_decode

__all__ = ["KV4_CASES", "KV4_FORMATS", "Kv4Format", "accuracy_table", "print_accuracy"]

Rounder = Callable[[np.ndarray], np.ndarray]  # float32 (seq, n_kv, D) -> its dequantized self
Data = tuple[np.ndarray, np.ndarray, np.ndarray]  # q (n_heads, D), k and v (seq, n_kv, D)


def _bf16(x: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def _e4m3(x: np.ndarray) -> np.ndarray:
    import ml_dtypes

    # per KV head, the scale a user calibrates: the head's largest value maps to 448
    scale = np.maximum(np.abs(x).max(axis=(0, 2)) / np.float32(448), np.float32(1e-30))
    return quantize_fp8(x, ml_dtypes.float8_e4m3fn, scale).astype(np.float32) * scale[:, None]


def _q4(group: int) -> Rounder:
    def rounder(x: np.ndarray) -> np.ndarray:
        return dequantize_q4(*quantize_q4(x, group))

    return rounder


def _nvfp4(x: np.ndarray) -> np.ndarray:
    return dequantize_nvfp4(*quantize_nvfp4(x))


@dataclass(frozen=True)
class Kv4Format:
    """A column: how K and V are rounded, and which of them are rotated first."""

    name: str
    bits: float  # per element, scales included
    k: Rounder
    v: Rounder
    rotate_k: bool = False
    rotate_v: bool = False

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """The float64 attention of ``q`` over the cache stored in this format."""
        if self.rotate_k:
            q, k = hadamard(q), hadamard(k)
        if self.rotate_v:
            v = hadamard(v)
        out = reference_gqa_decode(q, self.k(k), self.v(v))
        return hadamard(out).astype(np.float64) if self.rotate_v else out


def _formats() -> list[Kv4Format]:
    found = [Kv4Format("bf16", 16, _bf16, _bf16), Kv4Format("e4m3", 8, _e4m3, _e4m3)]
    for group in (16, 32, 64):
        bits = 4 + 16 / group
        found.append(Kv4Format(f"q4/{group}", bits, _q4(group), _q4(group)))
        found.append(Kv4Format(f"q4/{group} rotK", bits, _q4(group), _q4(group), True))
        found.append(Kv4Format(f"q4/{group} rotKV", bits, _q4(group), _q4(group), True, True))
    found.append(Kv4Format("nvfp4", 4.5, _nvfp4, _nvfp4))
    found.append(Kv4Format("nvfp4 rotK", 4.5, _nvfp4, _nvfp4, True))
    found.append(Kv4Format("nvfp4 rotKV", 4.5, _nvfp4, _nvfp4, True, True))
    found.append(Kv4Format("e4m3 K, q4/32 V", 6.25, _e4m3, _q4(32)))
    found.append(Kv4Format("e4m3 K, nvfp4 V", 6.25, _e4m3, _nvfp4))
    return found


KV4_FORMATS = _formats()


def _gaussian(rng: np.random.Generator, seq: int, n_heads: int, n_kv: int, d: int) -> Data:
    q = rng.standard_normal((n_heads, d), dtype=np.float32)
    k = rng.standard_normal((seq, n_kv, d), dtype=np.float32)
    v = rng.standard_normal((seq, n_kv, d), dtype=np.float32)
    return q, k, v


def _outliers(rng: np.random.Generator, seq: int, n_heads: int, n_kv: int, d: int) -> Data:
    # four channels per KV head 10-50x the rest, as in real models mostly a magnitude the
    # tokens share (which shifts every score of a query alike, so the softmax stays as
    # soft) with a token-to-token part of their own
    q, k, v = _gaussian(rng, seq, n_heads, n_kv, d)
    for h in range(n_kv):
        channels = rng.choice(d, 4, replace=False)
        size = rng.uniform(10, 50, size=4).astype(np.float32) * rng.choice([-1, 1], size=4)
        k[:, h, channels] = size * (1 + np.float32(0.1) * k[:, h, channels])
    return q, k, v


def _sink(rng: np.random.Generator, seq: int, n_heads: int, n_kv: int, d: int) -> Data:
    q, k, v = _gaussian(rng, seq, n_heads, n_kv, d)
    u = rng.standard_normal(d).astype(np.float32)
    u /= np.linalg.norm(u)
    k[0] = 40 * u  # a large norm, in the direction the queries lean to
    q += 3 * u
    return q, k, v


def _long(rng: np.random.Generator, seq: int, n_heads: int, n_kv: int, d: int) -> Data:
    return _outliers(rng, seq, n_heads, n_kv, d)


# rows: (name, data, seq, n_heads, n_kv_heads, head_dim)
KV4_CASES = [
    ("Gaussian", _gaussian, 4096, 32, 8, 128),
    ("K outlier channels (10-50x)", _outliers, 4096, 32, 8, 128),
    ("sink token (large K norm)", _sink, 4096, 32, 8, 128),
    ("long context, K outliers", _long, 131072, 8, 2, 128),
]


def accuracy_table(
    seed: int = 0, cases: list | None = None, formats: list[Kv4Format] | None = None,
    draws: int = 3,
) -> dict[str, dict[str, float]]:  # fmt: skip
    """Relative errors of the attention output, ``{row: {format: error}}`` (see the module),
    each the median of ``draws`` draws of the row's data (one draw's outlier channels can
    land so that a rotation gains nothing: the medians rank the formats)."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    table: dict[str, dict[str, float]] = {}
    for name, make, seq, n_heads, n_kv, d in cases or KV4_CASES:
        errors: dict[str, list[float]] = {f.name: [] for f in formats or KV4_FORMATS}
        for _ in range(draws):
            q, k, v = make(rng, seq, n_heads, n_kv, d)
            q = q.astype(ml_dtypes.bfloat16).astype(np.float32)
            ref = reference_gqa_decode(q, k, v)
            for f in formats or KV4_FORMATS:
                err = np.linalg.norm(f.attention(q, k, v) - ref) / np.linalg.norm(ref)
                errors[f.name].append(float(err))
        table[name] = {f: float(np.median(e)) for f, e in errors.items()}
    return table


def print_accuracy(table: dict[str, dict[str, float]]) -> None:
    """The table as Markdown: a row per kind of data, a column per format."""
    names = list(next(iter(table.values())))
    bits = {f.name: f.bits for f in KV4_FORMATS}
    print("| data | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    print("| bits per element | " + " | ".join(f"{bits.get(n, 0):g}" for n in names) + " |")
    for row, cells in table.items():
        print(f"| {row} | " + " | ".join(f"{cells[n]:.1e}" for n in names) + " |")
