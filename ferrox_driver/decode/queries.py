"""Many query tokens per decode (speculative verify): q read as ``(n_q, n_heads, head_dim)``
and the tree mask checked, naming ``q`` / ``tree_mask``, before any device work.

The n_q queries are the cache's last n_q tokens: query t sits at position ``seq_len - n_q +
t``. By default (causal) it sees cache tokens ``j <= seq_len - n_q + t``; with a tree mask it
sees every earlier token (``j < seq_len - n_q``) and new token u (position ``seq_len - n_q +
u``) where ``mask[t, u]``. A mask is ``(n_q, n_q)`` bool, or bit-packed: uint8 ``(n_q,
ceil(n_q / 8))``, bit ``u % 8`` (least significant first) of byte ``u // 8`` of row t, which
is ``numpy.packbits(mask, axis=1, bitorder="little")``; bits past n_q are zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .checks import MAX_HEAD_DIM, check_host_extent, check_int, q_heads, read_dims

__all__ = [
    "Queries",
    "check_query_count",
    "check_tree_mask",
    "query_heads",
    "read_query_dims",
    "single_query_only",
    "split_queries",
    "tree_mask_packed",
]


@dataclass(frozen=True)
class Queries:
    """What a q's shape says: ``n_q`` query tokens of ``n_heads`` heads of ``head_dim``,
    each token's q of ``token_shape`` (the one-token shape the single-query checks read)."""

    n_q: int
    n_heads: int
    head_dim: int
    token_shape: tuple[int, ...]


def split_queries(shape: Any, name: str = "q") -> tuple[int, tuple[int, ...]]:
    """``(n_q, one token's shape)``: a 3-D ``(n_q, n_heads, head_dim)`` gives ``(n_q,
    (n_heads, head_dim))``; today's one-token shapes (flat, 2-D, ``(1, n_heads, 1,
    head_dim)``) give ``(1, shape)``, checked later by the one-token checks.

    Raises:
        ValueError: a 3-D shape with a zero dimension, naming ``name``.
    """
    qs = tuple(int(n) for n in shape)
    if len(qs) != 3:
        return 1, qs
    if min(qs) < 1:
        raise ValueError(
            f"{name}: expected (n_q, n_heads, head_dim) with each at least 1, got {qs}"
        )
    return qs[0], qs[1:]


def query_heads(shape: Any, head_dim: int, n_heads: Any = None, name: str = "q") -> Queries:
    """`checks.q_heads` for every accepted q shape: the query tokens and heads of a q over
    heads of ``head_dim`` (known: the cache's), ``n_heads`` checked against it if given.

    Raises:
        TypeError, ValueError: naming ``n_heads`` or ``name``.
    """
    qs = tuple(int(n) for n in shape)
    n_q, token = split_queries(qs, name)
    if len(qs) == 3:
        _agree(qs, head_dim, "given", n_heads, name)
    return Queries(n_q, q_heads(token, head_dim, n_heads, name), head_dim, token)


def read_query_dims(
    q_shape: Any,
    k_shape: Any,
    n_heads: Any,
    n_kv_heads: Any,
    head_dim: Any,
    *,
    layout: str = "NHD",
    names: tuple[str, str] = ("q", "k_cache"),
    max_head_dim: int = MAX_HEAD_DIM,
) -> tuple[Queries, tuple[int, int, int]]:
    """`checks.read_dims` for every accepted q shape: the queries and ``(n_heads,
    n_kv_heads, head_dim)``, each given value checked, the others read from the shapes. A
    3-D q says its head_dim and heads: they must agree with what is given and with K's
    shape (errors name ``q`` with its whole shape, or ``n_heads``).

    Raises:
        TypeError, ValueError: naming the argument.
    """
    q_name, k_name = names
    qs, ks = tuple(int(n) for n in q_shape), tuple(int(n) for n in k_shape)
    n_q, token = split_queries(qs, q_name)
    if len(qs) == 3:
        if head_dim is not None:
            hd = check_int(head_dim, "head_dim", 1, max_head_dim)
            _agree(qs, hd, "given", n_heads, q_name)
        elif (found := _k_head_dim(ks, layout)) is not None:
            _agree(qs, found, f"read from {k_name}'s shape {ks}", n_heads, q_name)
        else:
            _agree(qs, qs[2], "", n_heads, q_name)
    dims = read_dims(token, ks, n_heads, n_kv_heads, head_dim, layout=layout, names=names,
                     max_head_dim=max_head_dim)  # fmt: skip
    return Queries(n_q, dims[0], dims[2], token), dims


def _k_head_dim(ks: tuple[int, ...], layout: str) -> int | None:
    """K's head_dim where its shape says it (as `checks.read_dims` reads it), else None."""
    if layout == "NHD":
        return ks[2] if len(ks) == 3 else None
    return ks[-1] if len(ks) == 3 or (len(ks) == 4 and ks[0] == 1) else None


def _agree(qs: tuple[int, ...], head_dim: int, source: str, n_heads: Any, name: str) -> None:
    """A 3-D q's head_dim and heads against the known head_dim and the given n_heads."""
    if qs[2] != head_dim:
        raise ValueError(
            f"{name}: expected shape (n_q, n_heads, head_dim) with head_dim = {head_dim} "
            f"({source}), got {qs}"
        )
    if n_heads is not None and check_int(n_heads, "n_heads") != qs[1]:
        raise ValueError(
            f"n_heads: {n_heads} given, but {name} of shape {qs} holds {qs[1]} heads (read "
            f"as (n_q, n_heads, head_dim))"
        )


def check_query_count(n_q: int, seq_len: int, name: str = "q") -> int:
    """``n_q`` if the cache holds that many tokens: the queries are its last n_q tokens.

    Raises:
        ValueError: naming ``name``.
    """
    if not 1 <= n_q <= seq_len:
        raise ValueError(
            f"{name}: {n_q} query tokens for a cache of {seq_len} tokens: the queries are "
            f"the cache's last n_q tokens (append their K and V first), so n_q must be "
            f"1..{seq_len}"
        )
    return n_q


def single_query_only(shape: Any, name: str = "q") -> None:
    """Refuse a q of several query tokens on an entry point that decodes one: a 3-D
    ``(n_q, n_heads, head_dim)`` with n_q > 1, or SDPA's ``(1, n_heads, n_q, head_dim)``
    with n_q > 1, which a read of whole heads from q's size would take for n_q * n_heads
    heads of one token.

    Raises:
        ValueError: naming ``name``.
    """
    qs = tuple(shape)
    n_q = qs[0] if len(qs) == 3 else qs[2] if len(qs) == 4 else 1
    if n_q > 1:
        raise ValueError(
            f"{name}: shape {qs} holds {n_q} query tokens; pass several query tokens as "
            f"(n_q, n_heads, head_dim) (gqa_decode, gqa_decode_async, KVCache.decode and "
            f"the torch ops take that form)"
        )


def tree_mask_packed(shape: Any, dtype: Any, n_q: int, name: str = "tree_mask") -> bool:
    """Whether a tree mask of ``shape`` and ``dtype`` (host or device) is bit-packed (uint8
    ``(n_q, ceil(n_q / 8))``) or not (bool ``(n_q, n_q)``); its values are not read.

    Raises:
        TypeError, ValueError: naming ``name``.
    """
    dt, got = np.dtype(dtype), tuple(shape)
    if dt == np.bool_:
        want, packed = (n_q, n_q), False
    elif dt == np.uint8:
        want, packed = (n_q, (n_q + 7) // 8), True
    else:
        raise TypeError(
            f"{name}: expected bool (n_q, n_q) or bit-packed uint8 (n_q, ceil(n_q/8)), got "
            f"dtype {dt}"
        )
    if got != want:
        raise ValueError(
            f"{name}: expected shape {want} ({'bit-packed uint8' if packed else 'bool'}) for "
            f"{n_q} query tokens, got {got}"
        )
    return packed


def check_tree_mask(mask: Any, n_q: int, name: str = "tree_mask") -> np.ndarray:
    """A host tree mask as bool ``(n_q, n_q)``: query t sees new token u iff ``[t, u]``.
    Takes bool ``(n_q, n_q)`` or bit-packed uint8 (module docstring); the diagonal must
    be set (each query sees itself), a packed mask's bits past n_q clear.

    Raises:
        TypeError, ValueError: naming ``name``.
    """
    if not isinstance(mask, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array, got {type(mask).__name__}")
    check_host_extent(mask, name)  # (read by value: any strides)
    packed = tree_mask_packed(mask.shape, mask.dtype, n_q, name)
    if packed:
        bits = np.unpackbits(mask, axis=1, bitorder="little").astype(bool)
        if bits[:, n_q:].any():
            raise ValueError(
                f"{name}: bits past the {n_q} query tokens are set (rows packed as "
                f"numpy.packbits(mask, axis=1, bitorder='little'), least significant bit "
                f"first, padding zero)"
            )
        full = bits[:, :n_q]
    else:
        full = np.array(mask, dtype=bool)
    missing = np.flatnonzero(~full.diagonal())
    if missing.size:
        raise ValueError(
            f"{name}: the diagonal must be set (each query sees its own token), missing at "
            f"t = {missing[:8].tolist()}{' ...' if missing.size > 8 else ''}"
        )
    return full
