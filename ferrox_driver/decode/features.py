"""The attention features a decode may ask for (sliding window, soft-cap, sinks, ALiBi,
score scale, log-sum-exp), checked once, naming the bad argument.

Definitions (docs/design.md, "features"), for the query at position i = seq_len - 1 and
cache token j: score_j = scale * q.k_j (scale 1/sqrt(head_dim) by default); with a
soft-cap, score_j = cap * tanh(score_j / cap); with ALiBi, score_j += slope_h * (j - i); a
window keeps only j >= seq_len - window; the softmax's denominator is sum_j exp(score_j),
plus exp(sink_h) with sinks (which carry no value); lse = log(denominator), natural log.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Features", "check_features"]


@dataclass(frozen=True)
class Features:
    """A decode's features, validated (``check_features``). The per-head arrays are kept as
    given (numpy or device arrays); the rest are plain values."""

    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: Any = None
    alibi_slopes: Any = None
    scale: float | None = None
    return_lse: bool = False

    @property
    def plain(self) -> bool:
        """No feature but possibly a scale or LSE: the softmax the plain kernels compute."""
        return (
            self.sliding_window is None
            and self.logits_soft_cap is None
            and self.sinks is None
            and self.alibi_slopes is None
        )

    def score_scale(self, head_dim: int) -> float:
        """The scores' scale: ``scale``, or 1/sqrt(head_dim)."""
        return 1.0 / math.sqrt(head_dim) if self.scale is None else self.scale

    def window_start(self, seq_len: int) -> int:
        """The first token the window keeps at ``seq_len`` (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, seq_len - self.sliding_window)


def _positive_float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a positive number or None, got {value!r}")
    x = float(value)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
    return x


def _per_head(value: Any, name: str, n_heads: int, allow_device: bool) -> Any:
    """One float32 per query head: a host array (checked for shape and finite values) or,
    where ``allow_device``, a device array of float32 (checked for shape)."""
    from .checks import array_info

    info = array_info(value, name, allow_device=allow_device)
    if info.shape not in ((n_heads,), (n_heads, 1)):
        raise ValueError(f"{name}: expected one value per query head, shape ({n_heads},), "
                         f"got {info.shape}")  # fmt: skip
    if info.on_device:
        if info.dtype != np.float32:
            raise TypeError(f"{name}: expected a float32 device array, got {info.dtype}")
        return value
    if info.dtype.kind not in "fiu":
        raise TypeError(f"{name}: expected real numbers, got {info.dtype}")
    host = np.asarray(value, dtype=np.float64).reshape(n_heads)
    return host


def check_features(
    n_heads: int,
    *,
    sliding_window: Any = None,
    logits_soft_cap: Any = None,
    sinks: Any = None,
    alibi_slopes: Any = None,
    scale: Any = None,
    return_lse: Any = False,
    allow_device: bool = True,
) -> Features:
    """Validate a decode's features; raise TypeError/ValueError naming the first bad one.

    Args:
        n_heads: query heads (the length of ``sinks`` and ``alibi_slopes``).
        sliding_window: attend to the last ``sliding_window`` tokens only (an int >= 1).
        logits_soft_cap: scores become ``cap * tanh(score / cap)`` (a positive number).
        sinks: one logit per query head added to the softmax's denominator (-inf: none).
        alibi_slopes: one slope per query head; score_j += slope * (j - (seq_len - 1)).
        scale: the score scale (a finite number; default 1/sqrt(head_dim)).
        return_lse: also return the log-sum-exp per query head.
        allow_device: whether ``sinks`` and ``alibi_slopes`` may be device arrays.
    """
    window = None
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, (int, np.integer)):
            raise TypeError(f"sliding_window: expected an int or None, got {sliding_window!r}")
        if not 1 <= sliding_window <= 2**31 - 1:  # (the kernels take it as an int32)
            raise ValueError(f"sliding_window: expected 1..2147483647 tokens, got {sliding_window}")
        window = int(sliding_window)
    cap = None if logits_soft_cap is None else _positive_float(logits_soft_cap, "logits_soft_cap")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
            raise TypeError(f"scale: expected a number or None, got {scale!r}")
        if not math.isfinite(float(scale)):
            raise ValueError(f"scale: expected a finite number, got {scale!r}")
        scale = float(scale)
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse: expected True or False, got {return_lse!r}")
    sink_values = None if sinks is None else _per_head(sinks, "sinks", n_heads, allow_device)
    if (
        isinstance(sink_values, np.ndarray)
        and (np.isnan(sink_values) | (sink_values == np.inf)).any()
    ):
        raise ValueError("sinks: expected finite logits or -inf (no sink), got NaN or +inf")
    slopes = (
        None if alibi_slopes is None
        else _per_head(alibi_slopes, "alibi_slopes", n_heads, allow_device)
    )  # fmt: skip
    if isinstance(slopes, np.ndarray) and not np.isfinite(slopes).all():
        raise ValueError("alibi_slopes: expected finite slopes")
    return Features(window, cap, sink_values, slopes, scale, bool(return_lse))
