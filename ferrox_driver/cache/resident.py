"""ferrox-cuda-compatible, process-wide resident KV caches (``ensure_layer_kv`` and friends).

ferrox-cuda keeps one set of per-layer buffers per process behind a mutex; so do we. Unlike
ferrox-cuda, an append copies one row (not the whole capacity, twice), and a drifted cache is
resynchronised in one bulk copy (not token by token).
"""

from __future__ import annotations

import threading

import numpy as np

from ..decode.checks import MAX_TOKENS, check_dims, check_dtype, check_int
from ..decode.eager import gqa_decode
from ..errors import KVCapacityError
from ..types import DTypeLike
from .layers import LayerKVCache

__all__ = ["clear_layer_kv", "ensure_layer_kv", "gqa_decode_resident", "resident_layers"]

_lock = threading.Lock()
_layers: LayerKVCache | None = None


def ensure_layer_kv(
    n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, *, dtype: DTypeLike = np.float32
) -> None:
    """Make sure the process-wide per-layer caches exist with this shape.

    As in ferrox-cuda: nothing happens when they already do; on any shape change they are
    rebuilt empty (the old memory is freed).
    """
    global _layers
    n_layers = check_int(n_layers, "n_layers", 1)
    check_dims(n_kv_heads, n_kv_heads, head_dim)
    capacity = check_int(capacity, "capacity", 1, MAX_TOKENS)
    dt = check_dtype(dtype, "dtype")
    with _lock:
        cur = _layers
        if cur is not None and (
            len(cur),
            cur.n_kv_heads,
            cur.head_dim,
            cur.capacity,
            cur.dtype,
        ) == (
            n_layers,
            n_kv_heads,
            head_dim,
            capacity,
            dt,
        ):
            return
        if cur is not None:
            _layers = None
            cur.close()
        _layers = LayerKVCache(n_layers, n_kv_heads, head_dim, capacity, dtype=dt)


def clear_layer_kv() -> None:
    """Empty every layer's cache (a new sequence). Safe when none exist."""
    with _lock:
        if _layers is not None:
            _layers.clear()


def resident_layers() -> LayerKVCache | None:
    """The process-wide caches, or None before `ensure_layer_kv`."""
    return _layers


def release_layer_kv() -> None:
    """Free the process-wide caches."""
    global _layers
    with _lock:
        if _layers is not None:
            _layers.close()
            _layers = None


def gqa_decode_resident(
    layer: int,
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    host_seq: int,
) -> np.ndarray:
    """Decode against layer ``layer``'s resident cache, kept in step with a host cache.

    ``k_cache``/``v_cache`` are the host's caches holding at least ``host_seq`` tokens.
    When the resident cache is exactly one token behind, that token's rows are appended;
    on any other drift the resident cache is rebuilt from the host cache in one bulk copy.
    Without `ensure_layer_kv`, it decodes from the host cache directly (as ferrox-cuda does).

    Returns:
        A numpy array of q's shape and dtype; zeros when ``host_seq`` is 0.

    Raises:
        ValueError, TypeError: bad arguments (checked before anything changes).
        ValueError: no such layer (also for the other bad arguments).
        KVCapacityError: ``host_seq`` exceeds the resident capacity.
    """
    n_heads, n_kv_heads, head_dim = check_dims(n_heads, n_kv_heads, head_dim)
    host_seq = check_int(host_seq, "host_seq", 0)
    row = n_kv_heads * head_dim
    for arr, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache")):
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"{name}: expected a numpy array, got {type(arr).__name__}")
    flat_k, flat_v = k_cache.reshape(-1), v_cache.reshape(-1)
    for arr, name in ((flat_k, "k_cache"), (flat_v, "v_cache")):
        if arr.size < host_seq * row:
            raise ValueError(
                f"{name}: holds {arr.size // row} tokens, fewer than host_seq={host_seq}"
            )
    if host_seq == 0:
        check_dtype(q.dtype, "q")
        if q.size != n_heads * head_dim:
            raise ValueError(f"q: expected {n_heads * head_dim} elements, got {q.size}")
        return np.zeros(q.shape, q.dtype)
    k_rows = flat_k[: host_seq * row].reshape(host_seq, n_kv_heads, head_dim)
    v_rows = flat_v[: host_seq * row].reshape(host_seq, n_kv_heads, head_dim)
    with _lock:
        layers = _layers
        if layers is None:
            out = gqa_decode(
                q, k_rows, v_rows, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim
            )
            assert isinstance(out, np.ndarray)  # numpy in, numpy out
            return out
        check_int(layer, "layer", 0, len(layers) - 1)
        if (layers.n_kv_heads, layers.head_dim) != (n_kv_heads, head_dim):
            raise ValueError(
                f"n_kv_heads, head_dim: the resident caches hold {layers.n_kv_heads}x"
                f"{layers.head_dim} per token, got {n_kv_heads}x{head_dim}"
            )
        kv = layers[layer]
        if host_seq > kv.capacity:
            raise KVCapacityError(host_seq - 1, kv.capacity)
        if q.dtype != kv.dtype or k_cache.dtype != kv.dtype or v_cache.dtype != kv.dtype:
            raise TypeError(
                f"q, k_cache, v_cache: expected the resident dtype {kv.dtype}, got "
                f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
            )
        if kv.seq_len + 1 == host_seq:
            kv.append(k_rows[-1], v_rows[-1])
        else:  # drift: resynchronise from the host cache in one bulk copy
            kv.clear()
            kv.extend(np.ascontiguousarray(k_rows), np.ascontiguousarray(v_rows))
        return kv.decode(q, n_heads=n_heads)
