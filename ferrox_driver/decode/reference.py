"""The float64 numpy reference for GQA decode (plain softmax, not the online form), with
every feature, and the exact merge of partial results by their log-sum-exp."""

from __future__ import annotations

from typing import Any, Literal, overload

import numpy as np

from ..types import HostArrayLike
from .checks import (
    REFERENCE_MAX_HEAD_DIM,
    _check_float,
    array_info,
    check_decode_args,
    check_head_major_args,
    check_int,
    check_kv_layout,
)
from .features import Features, check_features
from .queries import check_query_count, check_tree_mask, read_query_dims

__all__ = ["merge_states_host", "reference_gqa_decode"]


@overload
def reference_gqa_decode(
    q: HostArrayLike,
    k: HostArrayLike,
    v: HostArrayLike | None,
    *,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: HostArrayLike | None = None,
    alibi_slopes: HostArrayLike | None = None,
    scale: float | None = None,
    return_lse: Literal[False] = False,
    kv_layout: str = "NHD",
    tree_mask: HostArrayLike | None = None,
    head_dim_v: int | None = None,
) -> np.ndarray: ...
@overload
def reference_gqa_decode(
    q: HostArrayLike,
    k: HostArrayLike,
    v: HostArrayLike | None,
    *,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: HostArrayLike | None = None,
    alibi_slopes: HostArrayLike | None = None,
    scale: float | None = None,
    return_lse: Literal[True],
    kv_layout: str = "NHD",
    tree_mask: HostArrayLike | None = None,
    head_dim_v: int | None = None,
) -> tuple[np.ndarray, np.ndarray]: ...
@overload
def reference_gqa_decode(
    q: HostArrayLike,
    k: HostArrayLike,
    v: HostArrayLike | None,
    *,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: HostArrayLike | None = None,
    alibi_slopes: HostArrayLike | None = None,
    scale: float | None = None,
    return_lse: bool,
    kv_layout: str = "NHD",
    tree_mask: HostArrayLike | None = None,
    head_dim_v: int | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]: ...
def reference_gqa_decode(
    q: HostArrayLike,
    k: HostArrayLike,
    v: HostArrayLike | None,
    *,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: HostArrayLike | None = None,
    alibi_slopes: HostArrayLike | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    kv_layout: str = "NHD",
    tree_mask: HostArrayLike | None = None,
    head_dim_v: int | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Attention of one query token, or of n_q query tokens (speculative verify), over a
    KV cache, in float64 on the CPU: the definition the kernels are tested against.

    Query head ``h`` reads KV head ``h // (n_heads // n_kv_heads)``. For a query at position
    ``i`` (``seq_len - 1`` for one token) and a cache token ``j`` it sees: ``score_j = scale
    * q.k_j``; with a soft-cap ``score_j = cap * tanh(score_j / cap)``; with ALiBi
    ``score_j += slope_h * (j - i)``; a window keeps only ``j > i - sliding_window``. The
    output is ``sum_j exp(score_j) v_j / denominator``, ``denominator = sum_j
    exp(score_j)`` (plus ``exp(sink_h)`` with sinks, which carry no value), and ``lse =
    log(denominator)``.

    A q of shape ``(n_q, n_heads, head_dim)`` is the cache's last n_q tokens (their K and V
    already in the cache, ``1 <= n_q <= seq_len``): query t sits at ``i = seq_len - n_q +
    t``. Causal by default, it sees ``j <= i``. With ``tree_mask`` it sees every earlier
    token (``j < seq_len - n_q``) and new token u (``j = seq_len - n_q + u``) iff
    ``tree_mask[t, u]``; the window and ALiBi stay relative to ``i``. Each query computes
    exactly what a one-token call would at its position: n_q = 1 gives today's numbers.

    Args:
        q: ``(n_heads*head_dim,)``, ``(n_heads, head_dim)`` or ``(1, n_heads, 1,
            head_dim)`` (PyTorch SDPA's one token), or ``(n_q, n_heads, head_dim)`` (n_q
            query tokens); any floating dtype (float8 and bfloat16 read by value: an fp8
            cache's scales are not applied, see ``KVCache.dequantized``).
        k: ``(seq_len*n_kv_heads*head_dim,)`` or ``(seq_len, n_kv_heads, head_dim)``.
        v: like ``k``.
        n_heads: query heads, a multiple of ``n_kv_heads``; as `gqa_decode`, optional
            where the shapes say it, as are ``n_kv_heads`` and ``head_dim``.
        n_kv_heads: KV heads.
        head_dim: elements per head.
        sliding_window: attend to the last ``sliding_window`` tokens (up to and including
            the query's own) only.
        logits_soft_cap: cap the scores softly at +-``logits_soft_cap``.
        sinks: one logit per query head in the denominator (``-inf``: none).
        alibi_slopes: one ALiBi slope per query head.
        scale: the score scale (default ``1/sqrt(head_dim)``).
        return_lse: also return the log-sum-exp per query head.
        kv_layout: ``"NHD"`` (``k`` as above) or ``"HND"``: ``(n_kv_heads, seq_len,
            head_dim)`` or ``(1, n_kv_heads, seq_len, head_dim)``, as `gqa_decode`.
        head_dim_v: the value rows' width, where it is not ``head_dim``: ``v`` then has
            rows of ``head_dim_v`` elements in K's layout, and the result's heads are
            ``head_dim_v`` wide. With ``v`` None (multi-head latent attention: one latent
            KV head whose first ``head_dim_v`` columns are the values, e.g. 576 and 512),
            V is K's first ``head_dim_v`` columns. The reference takes head_dim up to
            1024 (the kernels, today, up to 512).
        tree_mask: with a 3-D q only: which new tokens each query sees (a draft tree: its
            ancestors and itself), a numpy bool ``(n_q, n_q)`` array, or the same
            bit-packed: uint8 ``(n_q, ceil(n_q/8))``, bit ``u % 8`` (least significant
            first) of byte ``u // 8`` of row t, which is ``numpy.packbits(mask, axis=1,
            bitorder="little")``, bits past n_q zero. The diagonal must be set; entries
            above it are honoured too. None: causal (the lower-triangular mask).

    Returns:
        float64 array of q's shape (zeros where a head attends to nothing: seq_len 0);
            with ``return_lse``, ``(out, lse)``, lse float64 of shape ``(n_heads,)``
            (``(n_q, n_heads)`` for a 3-D q), natural log (``-inf`` for a head with no
            token and no sink).

    Raises:
        ValueError, TypeError: as `ferrox_driver.gqa_decode`, naming the argument; for
            n_q > seq_len naming ``q``; for a bad mask (shape, dtype, diagonal, padding
            bits, or given with a one-token q) naming ``tree_mask``.
    """
    names = ("q", "k", "v")
    values = (v, head_dim_v)  # V of a width of its own, or K's columns: read after the checks
    if v is None or head_dim_v is not None:
        v = k  # (the checks see K twice)
    if isinstance(q, np.ndarray) and q.ndim == 3:  # (n_q, n_heads, head_dim)
        return _reference_queries(
            q, k, v, n_heads, n_kv_heads, head_dim, check_kv_layout(kv_layout), tree_mask,
            dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
                 alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse), values,
        )  # fmt: skip
    if check_kv_layout(kv_layout) == "HND":
        spec, _ = check_head_major_args(
            q, k, v, n_heads, n_kv_heads, head_dim, allow_device=False, names=names
        )
    else:
        spec = check_decode_args(
            q, k, v, n_heads, n_kv_heads, head_dim, allow_device=False, names=names
        )
    if tree_mask is not None:
        raise ValueError(
            f"tree_mask: only with a q of several query tokens, shape (n_q, n_heads, "
            f"head_dim); q has the one-token shape {spec.q_shape}"
        )
    n_heads, n_kv_heads, head_dim = spec.n_heads, spec.n_kv_heads, spec.head_dim
    feats = check_features(
        n_heads, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
        alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse, allow_device=False,
    )  # fmt: skip
    seq = spec.seq_len
    qh = np.asarray(q, dtype=np.float64).reshape(n_heads, head_dim)
    kh, vh = _token_major(k, v, kv_layout, seq, n_kv_heads, head_dim)
    vh = _values(values, kh, vh, kv_layout)
    out, lse = _attend(qh, kh, vh, feats.window_start(seq), seq, seq - 1, None, feats)
    out = out.reshape(_out_shape(spec.q_shape, head_dim, vh.shape[-1]))
    return (out, lse) if feats.return_lse else out


def _values(values: tuple[Any, Any], kh: np.ndarray, vh: np.ndarray, layout: str) -> np.ndarray:
    """V as the reference reads it, float64 ``(seq_len, n_kv_heads, head_dim_v)``: ``vh``
    (V of K's shape, checked with it) unless ``values`` = (v, head_dim_v) asks for V of a
    width of its own, or for K's first head_dim_v columns (v None: MLA's latent rows).

    Raises:
        TypeError, ValueError: naming ``v`` or ``head_dim_v``.
    """
    v, head_dim_v = values
    if v is not None and head_dim_v is None:
        return vh
    seq, n_kv, head_dim = kh.shape
    if head_dim_v is None:
        raise TypeError(
            "v, head_dim_v: v None needs head_dim_v (V is then K's first head_dim_v "
            "columns, as multi-head latent attention stores it)"
        )
    dv = check_int(head_dim_v, "head_dim_v", 1, head_dim if v is None else REFERENCE_MAX_HEAD_DIM)
    if v is None:
        return kh[..., :dv]
    if not isinstance(v, np.ndarray):
        raise TypeError(f"v: expected a numpy array, got {type(v).__name__}")
    _check_float(array_info(v, "v", allow_device=False), "v")
    shapes = ((seq, n_kv, dv),) if layout == "NHD" else ((n_kv, seq, dv), (1, n_kv, seq, dv))
    if v.shape not in (*shapes, (seq * n_kv * dv,)):
        forms = " or ".join(str(f) for f in (*shapes, (seq * n_kv * dv,)))
        raise ValueError(f"v: expected {forms} (K's tokens and KV heads, head_dim_v {dv} "
                         f"elements each), got {v.shape}")  # fmt: skip
    return _token_major(v, v, layout, seq, n_kv, dv)[0]


def _out_shape(q_shape: tuple[int, ...], head_dim: int, head_dim_v: int) -> tuple[int, ...]:
    """q's shape with each head ``head_dim_v`` wide (a flat q: as many heads, flat)."""
    if len(q_shape) == 1:
        return (q_shape[0] // head_dim * head_dim_v,)
    return (*q_shape[:-1], head_dim_v)


def _reference_queries(
    q: np.ndarray, k: Any, v: Any, n_heads: Any, n_kv_heads: Any, head_dim: Any, layout: str,
    tree_mask: Any, features: dict[str, Any], values: tuple[Any, Any] = (None, None),
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The reference for q ``(n_q, n_heads, head_dim)``: the cache's last n_q tokens, query
    t at position ``seq_len - n_q + t``, each attending as one query would (`_attend`) to
    the tokens its position, the window and the tree mask (causal: lower-triangular) let
    it see."""
    names = ("q", "k", "v")
    qi = array_info(q, "q", allow_device=False)
    _check_float(qi, "q")
    if not isinstance(k, np.ndarray):
        raise TypeError(f"k: expected a numpy array, got {type(k).__name__}")
    queries, _ = read_query_dims(
        qi.shape,
        k.shape,
        n_heads,
        n_kv_heads,
        head_dim,
        layout=layout,
        names=names[:2],
        max_head_dim=REFERENCE_MAX_HEAD_DIM,
    )
    # q's shape agrees with the dims now: the one-token checks read its first token
    if layout == "HND":
        spec, _ = check_head_major_args(
            q[0], k, v, n_heads, n_kv_heads, head_dim, allow_device=False, names=names
        )
    else:
        spec = check_decode_args(
            q[0], k, v, n_heads, n_kv_heads, head_dim, allow_device=False, names=names
        )
    seq = spec.seq_len
    n_q = check_query_count(queries.n_q, seq, "q")
    n_heads, n_kv_heads, head_dim = spec.n_heads, spec.n_kv_heads, spec.head_dim
    feats = check_features(n_heads, **features, allow_device=False)
    mask = None if tree_mask is None else check_tree_mask(tree_mask, n_q)
    qh = np.asarray(q, dtype=np.float64).reshape(n_q, n_heads, head_dim)
    kh, vh = _token_major(k, v, layout, seq, n_kv_heads, head_dim)
    vh = _values(values, kh, vh, layout)
    base = seq - n_q  # the tokens before the queries', which every query sees
    out = np.empty((n_q, n_heads, vh.shape[-1]))
    lse = np.empty((n_q, n_heads))
    for t in range(n_q):
        position = base + t
        first = feats.window_start(position + 1)
        end, allowed = position + 1, None  # causal: up to the query's own token
        if mask is not None:  # every new token the mask names (any u, not only u <= t)
            end, allowed = seq, np.ones(seq - first, dtype=bool)
            allowed[max(base - first, 0) :] = mask[t, max(first - base, 0) :]
        out[t], lse[t] = _attend(qh[t], kh, vh, first, end, position, allowed, feats)
    return (out, lse) if feats.return_lse else out


def _token_major(
    k: Any, v: Any, layout: str, seq: int, n_kv_heads: int, head_dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """K and V in float64, ``(seq_len, n_kv_heads, head_dim)``."""
    kh, vh = (np.asarray(a, dtype=np.float64) for a in (k, v))
    if layout == "HND":  # [kv_head][token] -> [token][kv_head]
        kh, vh = (a.reshape(n_kv_heads, seq, head_dim).transpose(1, 0, 2) for a in (kh, vh))
    return kh.reshape(seq, n_kv_heads, head_dim), vh.reshape(seq, n_kv_heads, head_dim)


def _attend(
    qh: np.ndarray, kh: np.ndarray, vh: np.ndarray, first: int, end: int, position: int,
    allowed: np.ndarray | None, feats: Features,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """One query ``qh`` ``(n_heads, head_dim)`` at cache position ``position`` over cache
    tokens ``first..end-1`` of ``kh``/``vh`` (those of them ``allowed`` where given): its
    output ``(n_heads, head_dim)`` and lse ``(n_heads,)``, by the definitions."""
    n_heads, head_dim = qh.shape
    n_kv_heads = kh.shape[1]
    kh, vh = kh[first:end], vh[first:end]
    group = n_heads // n_kv_heads
    # Query head h = g*group + j reads KV head g: view q as (n_kv_heads, group, head_dim).
    qg = qh.reshape(n_kv_heads, group, head_dim)
    scores = np.einsum("gjd,sgd->gjs", qg, kh) * feats.score_scale(head_dim)
    if feats.logits_soft_cap is not None:
        cap = feats.logits_soft_cap
        scores = cap * np.tanh(scores / cap)
    if feats.alibi_slopes is not None:
        distance = np.arange(first, end, dtype=np.float64) - position  # j - i (<= 0 causal)
        scores = scores + feats.alibi_slopes.reshape(n_kv_heads, group, 1) * distance
    if allowed is not None:  # a tree mask's hidden tokens weigh nothing
        scores = np.where(allowed, scores, -np.inf)
    # one more column per head: the sink's logit (-inf: none), which carries no value
    sink = np.full((n_kv_heads, group, 1), -np.inf)
    if feats.sinks is not None:
        sink = feats.sinks.reshape(n_kv_heads, group, 1)
    logits = np.concatenate([scores, sink], axis=2)
    top = logits.max(axis=2, keepdims=True)
    top = np.where(np.isneginf(top), 0.0, top)  # a head with nothing: no NaN from -inf - -inf
    weights = np.exp(logits - top)
    total = weights.sum(axis=2, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(total == 0, 0.0, weights[:, :, :-1] / total)  # (NaN stays NaN)
        lse = (top + np.log(total)).reshape(n_heads)  # log(0) = -inf: no token, no sink
    out = np.einsum("gjs,sgd->gjd", p, vh).reshape(n_heads, vh.shape[-1])
    return out, lse


def merge_states_host(outs: HostArrayLike, lses: HostArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """The exact combine of attention over disjoint parts of one sequence, from each part's
    output and log-sum-exp (``return_lse=True``): ``out = sum_p w_p out_p / sum_p w_p`` and
    ``lse = log(sum_p exp(lse_p))``, ``w_p = exp(lse_p)``. A part with ``lse = -inf`` (no
    tokens) contributes nothing; a head every part of which is empty gets zeros and -inf.
    Host (numpy) arrays: `merge_states` takes device arrays too.

    Args:
        outs: ``(parts, n_heads, head_dim)`` (or ``(parts, n_heads * head_dim)``), float.
        lses: ``(parts, n_heads)``, natural log.

    Returns:
        ``(out, lse)``: out ``(n_heads, head_dim)`` (or ``(n_heads * head_dim,)``) in
            outs' dtype, lse ``(n_heads,)`` in lses' dtype; computed in float64.

    Raises:
        ValueError, TypeError: naming the argument.
    """
    from .checks import array_info

    oi = array_info(outs, "outs", allow_device=False)
    li = array_info(lses, "lses", allow_device=False)
    for info, name in ((oi, "outs"), (li, "lses")):
        if info.dtype.kind != "f" and info.dtype.name != "bfloat16":
            raise TypeError(f"{name}: expected a floating-point array, got {info.dtype}")
    if len(li.shape) != 2 or min(li.shape) < 1:
        raise ValueError(f"lses: expected (parts, n_heads), at least one of each, got {li.shape}")
    parts, n_heads = li.shape
    if len(oi.shape) not in (2, 3) or (len(oi.shape) == 3 and oi.shape[:2] != (parts, n_heads)):
        raise ValueError(f"outs: expected (parts, n_heads, head_dim) = ({parts}, {n_heads}, "
                         f"head_dim) to match lses, got {oi.shape}")  # fmt: skip
    if len(oi.shape) == 2 and (oi.shape[0] != parts or oi.shape[1] % n_heads):
        raise ValueError(f"outs: expected (parts, n_heads * head_dim) with parts = {parts} "
                         f"and n_heads = {n_heads} (lses), got {oi.shape}")  # fmt: skip
    o = np.asarray(outs, dtype=np.float64).reshape(parts, n_heads, -1)
    lse = np.asarray(lses, dtype=np.float64)
    if np.isnan(lse).any() or (lse == np.inf).any():
        raise ValueError("lses: expected finite values or -inf (an empty part), got NaN or +inf")
    top = lse.max(axis=0)
    top = np.where(np.isfinite(top), top, 0.0)
    w = np.exp(lse - top)  # (parts, n_heads); 0 for an empty part
    total = w.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        merged = np.where(total[:, None] > 0, np.einsum("ph,phd->hd", w, o) / total[:, None], 0.0)
        merged_lse = top + np.log(total)
    out_shape = oi.shape[1:]
    return (merged.reshape(out_shape).astype(oi.dtype), merged_lse.astype(li.dtype))
