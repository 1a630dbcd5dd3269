"""The float64 numpy reference for GQA decode (plain softmax, not the online form)."""

from __future__ import annotations

import numpy as np

from .types import HostArrayLike
from .validation import check_decode_args

__all__ = ["reference_gqa_decode"]


def reference_gqa_decode(
    q: HostArrayLike,
    k: HostArrayLike,
    v: HostArrayLike,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
) -> np.ndarray:
    """Attention of one query token over a KV cache, in float64 on the CPU.

    Query head ``h`` reads KV head ``h // (n_heads // n_kv_heads)``; scores are
    ``q.k / sqrt(head_dim)``, softmax over all positions, output ``softmax @ v``.

    Args:
        q: ``(n_heads*head_dim,)`` or ``(n_heads, head_dim)``.
        k: ``(seq_len*n_kv_heads*head_dim,)`` or ``(seq_len, n_kv_heads, head_dim)``.
        v: like ``k``.
        n_heads: query heads, a multiple of ``n_kv_heads``.
        n_kv_heads: KV heads.
        head_dim: elements per head.

    Returns:
        float64 array of q's shape; zeros when seq_len is 0.

    Raises:
        ValueError, TypeError: as `ferrox_driver.gqa_decode`.
    """
    spec = check_decode_args(q, k, v, n_heads, n_kv_heads, head_dim, allow_device=False)
    qh = np.asarray(q, dtype=np.float64).reshape(n_heads, head_dim)
    if spec.seq_len == 0:
        return np.zeros(spec.q_shape, np.float64)
    kh = np.asarray(k, dtype=np.float64).reshape(spec.seq_len, n_kv_heads, head_dim)
    vh = np.asarray(v, dtype=np.float64).reshape(spec.seq_len, n_kv_heads, head_dim)
    group = n_heads // n_kv_heads
    # Query head h = g*group + j reads KV head g: view q as (n_kv_heads, group, head_dim).
    qg = qh.reshape(n_kv_heads, group, head_dim)
    scores = np.einsum("gjd,sgd->gjs", qg, kh) / np.sqrt(head_dim)
    scores -= scores.max(axis=2, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=2, keepdims=True)
    out = np.einsum("gjs,sgd->gjd", p, vh)
    return out.reshape(spec.q_shape)
