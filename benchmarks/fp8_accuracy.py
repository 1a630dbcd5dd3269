"""How much an fp8 KV cache costs in accuracy (CPU only, no GPU): the decode of a quantized
cache (the float64 reference of the dequantized cache, which the kernels match to ~1e-3,
tests/decode/test_gpu_fp8.py) against the float64 decode of the unquantized one, for three kinds
of activations, two formats and three ways to choose the scales. Prints the table of
docs/guides/fp8-cache.md.

    python3 benchmarks/fp8_accuracy.py [seq_len]
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

import ferrox_driver as fd
from ferrox_driver.decode.fp8 import fp8_max

N_HEADS, N_KV, HEAD_DIM = 32, 8, 128
FORMATS = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def activations(kind: str, rng: np.random.Generator, seq: int) -> np.ndarray:
    """K or V rows (seq, N_KV, HEAD_DIM) of one kind, with KV heads of different sizes."""
    shape = (seq, N_KV, HEAD_DIM)
    head_size = np.geomspace(0.25, 4.0, N_KV)[None, :, None]  # heads 16x apart
    if kind == "normal":
        x = rng.standard_normal(shape)
    elif kind == "heavy-tailed":  # Student's t, 3 degrees of freedom
        x = rng.standard_t(3, shape)
    else:  # outlier channels: 4 of the 128 channels 20x the rest (as K caches have)
        x = rng.standard_normal(shape)
        x[..., rng.choice(HEAD_DIM, 4, replace=False)] *= 20.0
    return (x * head_size).astype(np.float32)


def scales(x: np.ndarray, how: str, top: float) -> np.ndarray:
    """One scale per KV head: its own amax / the format's max, the tensor's, or 1."""
    if how == "per-head amax":
        return np.abs(x).max(axis=(0, 2)) / top
    if how == "per-tensor amax":
        return np.full(N_KV, np.abs(x).max() / top)
    return np.ones(N_KV)


def main() -> None:
    seq = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    rng = np.random.default_rng(0)
    dims = {"n_heads": N_HEADS, "n_kv_heads": N_KV, "head_dim": HEAD_DIM}
    print(f"32/8/128, {seq} tokens: relative L2 error of the decode against the unquantized "
          "float64 decode, all heads and the worst KV head's; scores of std 1 (flat "
          "attention) and 4 (peaky)")  # fmt: skip
    print(f"{'activations':<16} {'format':<6} {'scales':<16} {'flat':>9} {'worst':>9} "
          f"{'peaky':>9} {'worst':>9}")  # fmt: skip
    for kind in ("normal", "heavy-tailed", "outlier channels"):
        k, v = activations(kind, rng, seq), activations(kind, rng, seq)
        q = rng.standard_normal((N_HEADS, HEAD_DIM)).astype(np.float32)
        scores = np.einsum("gjd,sgd->gjs", q.reshape(N_KV, -1, HEAD_DIM), k) / HEAD_DIM**0.5
        q /= scores.std(axis=2).reshape(-1, 1)  # each head's scores of std 1
        exact = [fd.reference_gqa_decode(q * sharp, k, v, **dims) for sharp in (1, 4)]
        for fmt, dt in FORMATS.items():
            for how in ("per-head amax", "per-tensor amax", "scale 1"):
                ks, vs = scales(k, how, fp8_max(dt)), scales(v, how, fp8_max(dt))
                kq = fd.quantize_fp8(k, dt, ks).astype(np.float32) * ks[:, None].astype(np.float32)
                vq = fd.quantize_fp8(v, dt, vs).astype(np.float32) * vs[:, None].astype(np.float32)
                cols = []
                for sharp, want in zip((1, 4), exact, strict=True):
                    got = fd.reference_gqa_decode(q * sharp, kq, vq, **dims)
                    cols += [rel(got, want), max(rel(got[h], want[h]) for h in heads)]
                print(f"{kind:<16} {fmt:<6} {how:<16} " + " ".join(f"{c:9.2e}" for c in cols))


def rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


heads = [slice(h * (N_HEADS // N_KV), (h + 1) * (N_HEADS // N_KV)) for h in range(N_KV)]


if __name__ == "__main__":
    main()
