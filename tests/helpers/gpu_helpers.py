"""Helpers for GPU tests: random inputs, poisoned outputs, error measures."""

from __future__ import annotations

import ml_dtypes
import numpy as np

import ferrox_driver as fd

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}
TOL = {"f32": 1e-5, "f16": 1e-2, "bf16": 1e-2}


def feature_kwargs(rng, n_heads, which, *, window, scale):
    """A decode's feature keywords for the features named in ``which`` (a "+"-joined
    string of window, cap, sinks, alibi, scale): sinks drawn from ``rng``, the sliding
    ``window`` and ``scale`` as given."""
    kw = {}
    if "window" in which:
        kw["sliding_window"] = window
    if "cap" in which:
        kw["logits_soft_cap"] = 5.0
    if "sinks" in which:
        kw["sinks"] = rng.standard_normal(n_heads).astype(np.float32)
    if "alibi" in which:
        kw["alibi_slopes"] = (2.0 ** -np.arange(1, n_heads + 1) * 4).astype(np.float32)
    if "scale" in which:
        kw["scale"] = scale
    return kw


def rel_err(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert not np.isnan(out).any(), "NaN in output (unwritten or poisoned element)"
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / denom) if denom else float(np.linalg.norm(out))


def score_error_bound(q, k, v, n_heads, n_kv_heads, head_dim, rel=2.0**-20) -> np.ndarray:
    """How far an fp32 decode may honestly be from the float64 one, per output element,
    when each score carries an error of ``rel`` times the sum of its terms' magnitudes
    (fp32 rounding of the dot product and of the scaling): out moves by
    sum_t p_t * delta_t * (v_t - out). Near zero where one token dominates; large only where
    huge scores nearly tie, which no fp32 arithmetic resolves (scores of ~1e3 carry errors
    of ~1e-4). ``rel`` = 2^-20 is 23x the worst the kernels' arithmetic does (3xTF32)."""
    group = n_heads // n_kv_heads
    qh = np.asarray(q, np.float64).reshape(n_heads, head_dim)
    kh = np.repeat(np.asarray(k, np.float64).reshape(-1, n_kv_heads, head_dim), group, axis=1)
    vh = np.repeat(np.asarray(v, np.float64).reshape(-1, n_kv_heads, head_dim), group, axis=1)
    scale = 1.0 / np.sqrt(head_dim)
    s = np.einsum("hd,thd->ht", qh, kh) * scale
    terms = np.einsum("hd,thd->ht", np.abs(qh), np.abs(kh)) * scale
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    out = np.einsum("ht,thd->hd", p, vh)
    return np.einsum("ht,thd->hd", p * rel * terms, np.abs(vh - out[None]))


def random_decode_inputs(rng, n_heads, n_kv_heads, head_dim, seq_len, dtype, q_scale=1.0):
    q = (rng.standard_normal((n_heads, head_dim)) * q_scale).astype(dtype)
    k = rng.standard_normal((seq_len, n_kv_heads, head_dim)).astype(dtype)
    v = rng.standard_normal((seq_len, n_kv_heads, head_dim)).astype(dtype)
    return q, k, v


def poisoned(shape, dtype) -> fd.DeviceArray:
    """A device array whose every byte is 0xFF: NaN in fp32, fp16 and bf16."""
    out = fd.empty(shape, dtype)
    out.fill_bytes(0xFF)
    return out


def torch_or_cupy():
    """PyTorch if importable, else CuPy; fail (not skip) when neither is there."""
    try:
        import torch

        return "torch", torch
    except ImportError:
        pass
    try:
        import cupy

        return "cupy", cupy
    except ImportError as exc:
        raise AssertionError("GPU tests need PyTorch or CuPy for interop checks") from exc
