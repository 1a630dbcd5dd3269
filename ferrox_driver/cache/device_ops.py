"""Appends and decodes of a KVCache as device-only operations, capturable in any graph.

``kv_append_async`` and ``gqa_decode_async`` take device inputs, do no host work and read
the cache's sequence length on the device, so they can sit inside any captured graph
(ours, PyTorch's or CuPy's); each packs its launches once per signature and a call writes
the pointers and launches.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from ..decode.checks import check_dims, dtype_name, q_heads
from ..decode.features import check_features
from ..decode.fp8 import ROW_DTYPES, quantize_kernel
from ..decode.pair import (
    as_queries,
    checked_operand,
    decode_async_pair,
    device_mask,
    feature_array,
    q_heads_of,
    query_count,
)
from ..decode.plan import check_algorithm
from ..decode.queries import check_query_count
from ..driver.interop import ArrayRef, array_ref
from ..driver.launch import LaunchSequence, PackedLaunch
from ..driver.memory import DeviceArray, empty, to_device
from ..driver.pool import output_pool
from ..driver.pool import stream_buffer as _stream_buffer
from ..driver.stream import Stream, call_stream, stream_handle, stream_key
from ..kernels import abi
from ..types import DeviceArrayLike, StreamLike
from .decoding import Decodes
from .host_decode import check_q_dtype_of
from .kv_cache import KVCache, append_kernel, check_cache, truncate_kernel
from .own_values import refuse
from .pair_append import append_async_pair, append_launches

__all__ = ["decode_device", "gqa_decode_async", "kv_append_async", "kv_truncate_async"]

_F32 = np.dtype(np.float32)

APPEND_THREADS = 256


def _operand(obj: Any, name: str, size: int, kv: KVCache, dtype: Any = None) -> int:
    """The device pointer of ``obj``, checked to hold ``size`` elements of ``dtype`` (default:
    the cache's; an fp8 cache's q, out and rows: ``_fp8_dtype``) on the cache's device,
    C-contiguous.

    Raises:
        TypeError, ValueError: it does not.
    """
    ref = array_ref(obj, name)
    if ref is None:
        raise TypeError(f"{name}: expected a device array, got a numpy array")
    ptr, shape, got, ordinal, contiguous, _ = ref
    want = kv.dtype if dtype is None else np.dtype(dtype)
    if got != want:
        whose = "the cache's" if dtype is None else f"as for this {kv.dtype} cache"
        raise TypeError(f"{name}: expected dtype {want} ({whose}), got {got}")
    if math.prod(shape) != size:
        raise ValueError(f"{name}: expected {size} elements, got shape {shape}")
    if ordinal != kv.device.ordinal:
        raise ValueError(
            f"{name}: on device {ordinal}, but the cache is on device {kv.device.ordinal}"
        )
    if not contiguous:
        raise ValueError(f"{name}: must be C-contiguous, got a strided view of shape {shape}")
    return ptr


def _fp8_dtype(obj: Any, name: str, allowed: Sequence[np.dtype]) -> np.dtype:
    """The dtype of device array ``obj`` for an fp8 cache: one of ``allowed``."""
    ref = array_ref(obj, name)
    if ref is None:
        raise TypeError(f"{name}: expected a device array, got a numpy array")
    if ref[2] not in allowed:
        names = " or ".join(str(d) for d in allowed)
        raise TypeError(f"{name}: expected {names} for an fp8 cache, got {ref[2]}")
    return np.dtype(ref[2])


class _Appender:
    """The append kernel packed once for one cache, stream and operand signature: a call
    writes the two row pointers and launches."""

    def __init__(self, kv: KVCache, stream: Any, foreign: bool, rows: Any = None) -> None:
        args: tuple[Any, ...]
        self.foreign = foreign
        if kv.four_bit is not None:  # quantized at the device's length, which it bumps
            self.sequence = kv.four_bit.device_append(kv, np.dtype(rows), 1, stream)
            return
        if kv.fp8:  # quantized on the way in, at the device's length (first = -1)
            args = (None, None, kv.k_buffer, kv.v_buffer, kv.kv_scales,
                    np.int32(kv.n_kv_heads), np.int32(kv.head_dim), np.int32(1), np.int32(-1),
                    kv.state, np.int32(kv.capacity))  # fmt: skip
            kernel = quantize_kernel(kv.fp8, kv.device, dtype_name(rows))
        else:
            args = (None, None, kv.k_buffer, kv.v_buffer, kv.state, np.int64(kv.row_bytes),
                    np.int32(kv.capacity))  # fmt: skip
            kernel = append_kernel(kv.device)
        launch = PackedLaunch(kernel, 1, APPEND_THREADS, args, stream=stream)
        self.sequence = LaunchSequence([launch], ("k", "v"), [((0, "k"), (1, "v"))], kv.device)


class _RowsAppender:
    """The append of ``n`` > 1 rows in one launch (and the length's bump after it), packed
    once for one cache, stream and operand signature: a KVCache's buffers are a pair's
    (`pair_append`), so its launches are the pair's."""

    def __init__(self, kv: KVCache, stream: Any, foreign: bool, n: int, rows: Any) -> None:
        self.foreign = foreign
        if kv.four_bit is not None:  # quantized at the device's length, then the bump
            self.sequence = kv.four_bit.device_append(kv, np.dtype(rows), n, stream)
            return
        refs = [array_ref(a, "kv") for a in (kv.k_buffer, kv.v_buffer)]
        shape = (kv.capacity, kv.n_kv_heads, kv.head_dim)
        kc, vc = ((r[0], shape, *r[2:]) for r in refs if r is not None)
        scales = None if kv.kv_scales is None else array_ref(kv.kv_scales, "kv_scales")
        checked = (kc, vc, None, None, array_ref(kv.state, "state"), scales)
        rows_dtype = kv.dtype if rows is None else np.dtype(rows)
        self.sequence = append_launches(kv.device, checked, kv.capacity, kv.row_elems, n, kv.fp8,
                                      rows_dtype, stream)  # fmt: skip


def _row_count(kr: ArrayRef | None, vr: ArrayRef | None, kv: KVCache) -> int:
    """The tokens an append's rows hold: 1 for one token's elements (any shape), else n of
    rows ``(n, n_kv_heads, head_dim)``.

    Raises:
        TypeError, ValueError: naming ``k_dev`` or ``v_dev``.
    """
    for ref, name in ((kr, "k_dev"), (vr, "v_dev")):
        if ref is None:
            raise TypeError(f"{name}: expected a device array, got a numpy array")
    assert kr is not None and vr is not None
    size = math.prod(kr[1])
    if size == kv.row_elems:
        return 1
    shape = tuple(kr[1])
    if len(shape) != 3 or shape[1:] != (kv.n_kv_heads, kv.head_dim) or shape[0] < 1:
        raise ValueError(
            f"k_dev: expected one token ({kv.row_elems} elements) or rows (n, "
            f"{kv.n_kv_heads}, {kv.head_dim}), got shape {shape}"
        )
    if tuple(vr[1]) != shape:
        raise ValueError(f"v_dev: expected k_dev's shape {shape}, got {tuple(vr[1])}")
    return shape[0]


def _signature(ref: ArrayRef | None) -> tuple[Any, ...] | None:
    return None if ref is None else (ref[1], ref[2], ref[3], ref[4])


def kv_append_async(
    kv: KVCache | tuple[DeviceArrayLike, DeviceArrayLike],
    k_dev: DeviceArrayLike,
    v_dev: DeviceArrayLike,
    *,
    stream: StreamLike,
    state: DeviceArrayLike = None,
    kv_scales: DeviceArrayLike = None,
) -> None:
    """Queue a device-side append of one token, or of n tokens in one launch: rows
    ``k_dev``/``v_dev`` go to positions ``seq_len`` .. ``seq_len + n - 1`` (read on the
    device), which is then bumped by n. Capturable in a graph.

    A cache too full for the rows gets none of them: the device sets an overflow flag and
    the host raises KVCapacityError at ``kv.synchronize()``.

    Captured into a ferrox graph, each ``GraphExec.launch`` tells the cache its length
    changed; captured into a graph of PyTorch or CuPy, whose replays ferrox cannot see,
    the cache reads its length from the device before every later host append or decode,
    so no token a replay appended is ever overwritten.

    Args:
        kv: the cache.
        k_dev: device array of one token's ``n_kv_heads*head_dim`` elements (any shape),
            or of n tokens ``(n, n_kv_heads, head_dim)`` (a speculative draft's rows), cache
            dtype (an fp8 cache: float32, float16 or bfloat16, quantized on the device).
        v_dev: like ``k_dev``.
        stream: the stream (a ferrox Stream, any ``__cuda_stream__`` object, an int
            handle) to queue on; None: PyTorch's current stream for a PyTorch ``k_dev``,
            else the legacy default stream.
        state: with a pair (and only then): two int32 on the device, the length and an
            overflow flag, as a KVCache keeps them.
        kv_scales: with an fp8 pair: float32, the n_kv_heads K scales then the V ones.

    ``kv`` may also be a pair ``(k_cache, v_cache)`` of the caller's device arrays: a
    C-contiguous token-major cache ``(capacity, n_kv_heads, head_dim)`` (an fp8 one
    quantizes with ``kv_scales``) and its ``state``. Then ``k_dev``/``v_dev`` are one token
    ``(n_kv_heads, head_dim)`` or several ``(n, n_kv_heads, head_dim)``, written at
    ``state[0]``, which is bumped by n; rows that would pass the capacity are not written and
    set ``state[1]`` (read it to know).
    """
    stream = call_stream(stream, k_dev)
    if isinstance(kv, tuple):
        if state is None:
            raise TypeError("kv, state: a (k_cache, v_cache) pair needs its state, two int32 on "
                            "the device (the length, the overflow flag)")  # fmt: skip
        append_async_pair(kv, k_dev, v_dev, state, kv_scales, stream)
        return
    if state is not None or kv_scales is not None:
        raise ValueError("state, kv_scales: only with a (k_cache, v_cache) pair; a KVCache "
                         "keeps its own")  # fmt: skip
    kv = check_cache(kv)
    if kv.own_v is not None:  # (V rows of their own width: no device-side append yet)
        refuse(kv, "kv_append_async")
    kr, vr = array_ref(k_dev, "k_dev"), array_ref(v_dev, "v_dev")
    sid = stream_key(stream)
    key = (sid, _signature(kr), _signature(vr))
    with kv.lock:
        appender = kv.appenders.get(key)
        if appender is None:  # checked once per signature
            rows = _fp8_dtype(k_dev, "k_dev", ROW_DTYPES) if kv.fp8 else None
            n = _row_count(kr, vr, kv)
            _operand(k_dev, "k_dev", n * kv.row_elems, kv, rows)
            _operand(v_dev, "v_dev", n * kv.row_elems, kv, rows)
            foreign = sid != 0 and not isinstance(stream, Stream)
            appender = kv.appenders[key] = (
                _Appender(kv, stream_handle(sid), foreign, rows) if n == 1
                else _RowsAppender(kv, stream_handle(sid), foreign, n, rows)
            )  # fmt: skip
        assert kr is not None and vr is not None  # _operand refused host arrays
        kv.queue_append(appender.sequence.run, kr[0], vr[0], sid, appender.foreign, kr, vr,
                        (k_dev, v_dev))  # fmt: skip


def kv_truncate_async(kv: KVCache, n_dev: DeviceArrayLike, *, stream: StreamLike) -> None:
    """Queue a roll-back of ``kv`` to its first ``n_dev[0]`` tokens, the count read on the
    device (a speculative verify's accepted tokens, known only there): ``KVCache.truncate``
    for a captured loop. Capturable in a graph; nothing is copied or cleared.

    A count past the cache's length keeps every token (as ``x[:n]`` would); a negative one
    changes nothing and the host raises FerroxError at ``kv.synchronize()``.

    Args:
        kv: the cache (a ShardedKVCache cannot: its shards' counts are the host's).
        n_dev: one int32 on the cache's device.
        stream: as for `kv_append_async`.

    Raises:
        TypeError, ValueError: naming the argument, before any device work.
    """
    stream = call_stream(stream, n_dev)
    if not isinstance(kv, KVCache) and hasattr(kv, "local_len"):
        raise TypeError(
            "kv: a ShardedKVCache rolls back on the host only (its shards' counts are "
            "computed there): call kv.truncate(n)"
        )
    kv = check_cache(kv)
    nr = array_ref(n_dev, "n_dev")
    sid = stream_key(stream)
    key = ("truncate", sid, _signature(nr))
    with kv.lock:
        truncate = kv.appenders.get(key)
        if truncate is None:  # checked once per signature
            checked_operand(n_dev, "n_dev", 1, np.dtype(np.int32), kv.device.ordinal)
            foreign = sid != 0 and not isinstance(stream, Stream)
            launch = PackedLaunch(truncate_kernel(kv.device), 1, 1, (kv.state, None),
                                  stream=stream_handle(sid))  # fmt: skip
            sequence = LaunchSequence([launch], ("n", "again"), [((1, "n"),)], kv.device)
            truncate = kv.appenders[key] = (sequence, foreign)
        assert nr is not None  # _operand refused host arrays
        # (the length protocol of a device-side append: the device's copy current first,
        # kept with a graph that captures it, the host's length read back after)
        kv.queue_append(truncate[0].run, nr[0], nr[0], sid, truncate[1], nr, nr,
                        (n_dev, n_dev))  # fmt: skip


def gqa_decode_async(
    q_dev: DeviceArrayLike,
    kv: KVCache | tuple[DeviceArrayLike, DeviceArrayLike],
    out_dev: DeviceArrayLike,
    *,
    n_heads: int | None = None,
    stream: StreamLike,
    algorithm: str = "auto",
    out_lse: DeviceArrayLike = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: DeviceArrayLike = None,
    alibi_slopes: DeviceArrayLike = None,
    scale: float | None = None,
    seq_len: DeviceArrayLike = None,
    kv_layout: str = "NHD",
    kv_scales: DeviceArrayLike = None,
    tree_mask: DeviceArrayLike = None,
    n_queries: int | None = None,
) -> None:
    """Queue a decode of ``q_dev`` against the cache, reading seq_len on the device.
    No host work: capturable in a graph, valid for every sequence length. Before the
    first capture call ``kv.prepare(n_heads)`` (with the same features) or run it once
    eagerly: loading kernels and allocating its scratch cannot happen inside a capture.

    ``kv`` may also be a pair ``(k_cache, v_cache)`` of the caller's device arrays, read in
    place: a static cache of ``capacity`` tokens, of which the first ``seq_len`` (an int32
    device scalar, read by the kernels at each run) are decoded. ``kv_layout="NHD"``:
    ``(capacity, n_kv_heads, head_dim)``, C-contiguous; ``"HND"``: ``(n_kv_heads,
    capacity, head_dim)`` or ``(1, n_kv_heads, capacity, head_dim)`` (a transformers
    StaticCache layer's or an SDPA cache's buffers), rows contiguous, heads any whole
    number of rows apart. The decode is planned for the capacity, as a KVCache's is; the
    first call of each signature (shapes, dtypes, stream, features, the ``seq_len``
    array) makes its launches and must come before a capture, the later ones only write
    the pointers. ``seq_len`` must stay within ``[0, capacity]``: it is the kernels' to
    read, not checked on the host. float32/float16/bfloat16, or an fp8 pair
    (``float8_e4m3fn``/``float8_e5m2`` bytes, ``kv_scales`` given; q and out float16 or
    bfloat16).

    Several query tokens at once (a speculative verify, as `gqa_decode`'s): q_dev ``(n_q,
    n_heads, head_dim)`` are the cache's last n_q tokens (counted from the length read on
    the device), causal or under ``tree_mask``; out_dev of q's size, out_lse of ``n_q *
    n_heads``. A KVCache's first verify of each n_q before a capture: ``kv.prepare(n_heads,
    n_q=n_q)`` or one eager call.

    Args:
        q_dev: device array of ``n_heads*head_dim`` elements (any shape: ``(n_heads,
            head_dim)``, SDPA's ``(1, n_heads, 1, head_dim)``...), cache dtype; or ``(n_q,
            n_heads, head_dim)``, n_q query tokens.
        kv: the cache, or a pair ``(k_cache, v_cache)`` of device arrays (above).
        out_dev: device array like ``q_dev``, written with the result.
        n_heads: query heads, a multiple of ``kv.n_kv_heads`` (default: q_dev's size over
            head_dim).
        stream: the stream to queue on (None: PyTorch's current stream for a PyTorch
            ``q_dev``, else the legacy default stream).
        algorithm: ``"auto"``/``"split"`` or ``"parity"``.
        out_lse: a float32 device array of ``n_heads`` (``n_q * n_heads``), written with
            the log-sum-exp.
        sliding_window: as `gqa_decode`; the window follows the device's seq_len, so a
            graph captured once keeps it as the cache grows.
        logits_soft_cap: as `gqa_decode`.
        sinks: as `gqa_decode`, a float32 device array (read by the kernel at each run).
        alibi_slopes: as `gqa_decode`, a float32 device array.
        scale: as `gqa_decode`.
        seq_len: with a ``(k_cache, v_cache)`` pair (and only then): the int32 device
            scalar of the tokens to decode.
        kv_layout: with a pair: ``"NHD"`` or ``"HND"`` (above).
        kv_scales: with an fp8 pair (and only then): float32 device array of ``2 *
            n_kv_heads``, the K scales then the V ones (a value is its byte times its KV
            head's scale).
        tree_mask: with ``(n_q, n_heads, head_dim)`` q: a device array, bool ``(n_q,
            n_q)`` or bit-packed uint8 ``(n_q, ceil(n_q / 8))`` (see `gqa_decode`), read by
            the kernels at each run (write it in place between replays; its diagonal is
            the caller's to keep set: it is not checked on the host).
        n_queries: the query tokens q_dev holds (None: read from its shape, 3-D for
            several): given, q_dev and out_dev may be flat buffers, or ``(n_queries *
            n_heads, head_dim)``, holding them in ``(n_queries, n_heads, head_dim)`` order.
    """
    stream = call_stream(stream, q_dev)
    if n_queries is not None:
        q_dev, out_dev = as_queries(q_dev, out_dev, n_queries, n_heads, _head_dim_of(kv))
    if isinstance(kv, tuple):
        decode_async_pair(
            q_dev, kv, out_dev, n_heads, stream, algorithm, seq_len, kv_layout,
            dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
                 alibi_slopes=alibi_slopes, scale=scale),
            out_lse, kv_scales, tree_mask=tree_mask,
        )  # fmt: skip
        return
    if kv_scales is not None:
        raise ValueError("kv_scales: only with an fp8 (k_cache, v_cache) pair; a KVCache keeps "
                         "its own scales")  # fmt: skip
    if seq_len is not None or type(kv_layout) is not str or kv_layout != "NHD":
        raise ValueError(
            "seq_len, kv_layout: only with a (k_cache, v_cache) pair; a KVCache keeps its "
            "own length and layout"
        )
    kv = check_cache(kv)
    if kv.own_v is not None:  # (its decode reads the length on the host: not capturable)
        refuse(kv, "gqa_decode_async")
    if (
        tree_mask is None and out_lse is None and sliding_window is None
        and logits_soft_cap is None and sinks is None and alibi_slopes is None and scale is None
    ):  # fmt: skip
        qr, outr = array_ref(q_dev, "q_dev"), array_ref(out_dev, "out_dev")
        sid = stream_key(stream)
        aligned = qr is not None and outr is not None and ((qr[0] | outr[0]) & 15) == 0
        key = (n_heads, algorithm, sid, _signature(qr), _signature(outr), aligned)
        with kv.lock:
            try:
                entry = kv.async_records.get(key)
            except TypeError:  # an unhashable argument, which the checks name
                entry = None
            # checked once per signature (q's shape in it: several queries never get here)
            if entry is None and not _many(q_dev):
                n_heads = q_heads_of(n_heads, q_dev, kv.head_dim)
                n_heads, _, _ = check_dims(n_heads, kv.n_kv_heads, kv.head_dim)
                algorithm = check_algorithm(algorithm)
                size = n_heads * kv.head_dim
                qdt = _q_dtype(q_dev, kv, algorithm)
                q = _operand(q_dev, "q_dev", size, kv, qdt)
                out = _operand(out_dev, "out_dev", size, kv, qdt)
                q_view = DeviceArray._wrap(q, (size,), qdt, kv.device, None)
                out_view = DeviceArray._wrap(out, (size,), qdt, kv.device, None)
                record = kv.decode_record(
                    q_view, out_view, n_heads, algorithm, stream, length_on_device=True
                )
                foreign = sid != 0 and not isinstance(stream, Stream)
                entry = kv.async_records.keep(key, (record, foreign))
            if entry is not None:
                assert qr is not None and outr is not None  # _operand refused host arrays
                record, foreign = entry
                kv.queue_decode(
                    record.run, qr[0], outr[0], sid, foreign, qr, outr, (q_dev, out_dev)
                )
                return
    _decode_async_features(
        q_dev, kv, out_dev, n_heads, stream, algorithm,
        dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
             alibi_slopes=alibi_slopes, scale=scale),
        out_lse, tree_mask,
    )  # fmt: skip


def _head_dim_of(kv: Any) -> int | None:
    """The head_dim of a KVCache, or of a pair's K (None where ``kv`` is neither: its
    checks name what is wrong)."""
    if isinstance(kv, KVCache):
        return kv.head_dim
    if isinstance(kv, tuple) and kv:
        with contextlib.suppress(TypeError, ValueError):
            ref = array_ref(kv[0], "k_cache")
            if ref is not None and len(ref[1]) >= 2:
                return int(ref[1][-1])
    return None


def _many(q_dev: Any) -> bool:
    """Whether ``q_dev`` holds several query tokens ``(n_q, n_heads, head_dim)``, n_q > 1
    (its shape read without the interop's whole walk where it has one)."""
    shape = getattr(q_dev, "shape", None)
    if shape is None:
        ref = array_ref(q_dev, "q_dev")
        shape = () if ref is None else ref[1]
    return len(shape) == 3 and shape[0] > 1


def _q_dtype(q_dev: Any, kv: KVCache, algorithm: str) -> np.dtype:
    """q's dtype for a decode of ``kv``: the cache's, or an fp8 cache's float16/bfloat16."""
    if not kv.fp8:
        return kv.dtype
    qdt = _fp8_dtype(q_dev, "q_dev", ROW_DTYPES[1:])
    return kv.q_dtype_for(qdt, algorithm)


def _decode_async_features(
    q_dev: Any, kv: KVCache, out_dev: Any, n_heads: Any, stream: Any, algorithm: Any,
    kw: dict[str, Any], out_lse: Any, tree_mask: Any = None,
) -> None:  # fmt: skip
    """gqa_decode_async with features, or of q ``(n_q, n_heads, head_dim)`` (a verify, under
    ``tree_mask`` if given): checked at every call (the record is made once per signature,
    feature values, n_q and mask), then queued reading the length on the device."""
    n_q = query_count(q_dev, kv.head_dim, n_heads)
    n_heads = q_heads_of(n_heads, q_dev, kv.head_dim)
    n_heads, _, _ = check_dims(n_heads, kv.n_kv_heads, kv.head_dim)
    if check_algorithm(algorithm) == "parity":
        what = "a decode of several queries needs" if n_q > 1 else "the features need"
        raise ValueError(f"algorithm: {what} the split kernels ('auto' or 'split')")
    if n_q > max(kv.capacity, 1):
        check_query_count(n_q, kv.capacity, "q_dev")
    feats = check_features(n_heads, **kw, return_lse=out_lse is not None)
    size = n_q * n_heads * kv.head_dim
    qdt = _q_dtype(q_dev, kv, algorithm)
    q = _operand(q_dev, "q_dev", size, kv, qdt)
    out = _operand(out_dev, "out_dev", size, kv, qdt)
    sinks = feature_array(feats.sinks, "sinks", n_heads, kv.device)
    slopes = feature_array(feats.alibi_slopes, "alibi_slopes", n_heads, kv.device)
    lse = feature_array(out_lse, "out_lse", n_q * n_heads, kv.device)
    mref, mask_mode = device_mask(tree_mask, n_q, kv.device.ordinal)
    mask = None
    if mref is not None:
        mask = DeviceArray._wrap(mref[0], tuple(mref[1]), np.dtype(mref[2]), kv.device, None)
    features = abi.feature_args(feats, kv.head_dim, slopes=slopes, sinks=sinks, lse=lse)
    sid = stream_key(stream)
    qr, outr = array_ref(q_dev, "q_dev"), array_ref(out_dev, "out_dev")
    assert qr is not None and outr is not None
    with kv.lock:
        q_view = DeviceArray._wrap(q, (size,), qdt, kv.device, None)
        out_view = DeviceArray._wrap(out, (size,), qdt, kv.device, None)
        record = kv.decode_record(
            q_view, out_view, n_heads, algorithm, stream, length_on_device=True,
            features=features, queries=(n_q, mask, mask_mode),
        )  # fmt: skip
        foreign = sid != 0 and not isinstance(stream, Stream)
        kept = tuple(x for x in (feats.sinks, feats.alibi_slopes, out_lse, tree_mask)
                     if x is not None)  # fmt: skip
        kv.queue_decode(record.run, qr[0], outr[0], sid, foreign, qr, outr, (q_dev, out_dev),
                        kept)  # fmt: skip


def decode_device(
    kv: Decodes, q: Any, n_heads: Any, stream: Any, algorithm: Any, kw: dict[str, Any]
) -> Any:
    """KVCache.decode of a device q: checked, then `gqa_decode_async` into an output
    block of the caller's stream's pool, on the cache's stream joined to the caller's
    (``KVCache.join``); numpy sinks and slopes are copied into device buffers of the cache's
    stream first."""
    ref = array_ref(q, "q")
    assert ref is not None  # (numpy arrays take the host path)
    _, shape, dtype, ordinal, contiguous, _ = ref
    if ordinal != kv.device.ordinal:
        raise ValueError(f"q: on device {ordinal}, but the cache is on device {kv.device.ordinal}")
    if not contiguous:
        raise ValueError(f"q: must be C-contiguous, got a strided view of shape {shape}")
    check_q_dtype_of(kv, dtype, check_algorithm(algorithm))
    n_heads, _, _ = check_dims(q_heads(shape, kv.head_dim, n_heads), kv.n_kv_heads,
                               kv.head_dim)  # fmt: skip
    feats = check_features(n_heads, **kw)
    sid = stream_key(call_stream(stream, q, ordinal))
    with kv.lock:
        kv.check_open()
        kv.device.activate()
        joined = kv.join(sid, "decode", "gqa_decode_async")
        try:
            nbytes = math.prod(shape) * dtype.itemsize
            out = output_pool(kv.device, sid, nbytes).take(tuple(shape), dtype)
            lse = None
            if feats.return_lse:
                lse = output_pool(kv.device, sid, 4 * n_heads).take((n_heads,), _F32)
            per_head = {}
            for role in ("sinks", "alibi_slopes"):
                values = getattr(feats, role)
                if isinstance(values, np.ndarray):  # into this cache stream's buffer
                    buf = _stream_buffer(kv.device, kv.stream._handle_int, role, n_heads)
                    buf.copy_from_host(values.astype(np.float32), kv.stream)
                    values = buf
                per_head[role] = values
            gqa_decode_async(
                q, cast(KVCache, kv), out, n_heads=n_heads, stream=kv.stream, algorithm=algorithm,
                out_lse=lse, sliding_window=feats.sliding_window,
                logits_soft_cap=feats.logits_soft_cap, scale=feats.scale, **per_head,
            )  # fmt: skip
        finally:
            if joined:
                kv.rejoin(sid)
    return (out, lse) if lse is not None else out


def _verify_host(
    kv: Decodes, q: np.ndarray, n_heads: int, algorithm: str, shape: tuple[int, ...],
    dtype: np.dtype, sid: int,
) -> np.ndarray:  # fmt: skip
    """decode_many of a numpy q, causal, no features: q copied into a block of the cache
    stream's pool, the verify queued by `gqa_decode_async` (its record made once per
    signature, where building the launches at every call cost 10x more), the result
    copied back."""
    from ..decode.queries import check_query_count

    with kv.lock:
        kv.check_open()
        check_query_count(shape[0], kv.seq_len)
        dev, s = kv.device, kv.stream
        dev.activate()
        pool = output_pool(dev, sid, math.prod(shape) * dtype.itemsize)
        q_d, out = pool.take(shape, dtype), pool.take(shape, dtype)
        q_d.copy_from_host(np.ascontiguousarray(q), s)
        gqa_decode_async(q_d, cast(KVCache, kv), out, n_heads=n_heads, stream=s,
                         algorithm=algorithm)  # fmt: skip
        return out.to_host(s)


def decode_many(
    kv: Decodes, q: Any, n_heads: Any, stream: Any, algorithm: Any, kw: dict[str, Any],
    tree_mask: Any,
) -> Any:  # fmt: skip
    """KVCache.decode of q ``(n_q, n_heads, head_dim)``: n_q queries, the cache's last n_q
    tokens (`gqa_decode`'s verify), on the cache's stream (joined to the caller's for a
    device q; a numpy q is copied in and the result back, complete)."""
    from ..decode.queries import check_query_count, split_queries
    from ..decode.records import launches_for
    from ..decode.verify import check_mask, mask_operand, per_head_operand

    host = isinstance(q, np.ndarray)
    ref = None if host else array_ref(q, "q")
    if ref is not None:
        _, shape, dtype, ordinal, contiguous, _ = ref
        if ordinal != kv.device.ordinal:
            raise ValueError(
                f"q: on device {ordinal}, but the cache is on device {kv.device.ordinal}"
            )
        if not contiguous:
            raise ValueError(f"q: must be C-contiguous, got a strided view of shape {shape}")
    else:
        shape, dtype = tuple(q.shape), q.dtype
    n_q, token = split_queries(shape)
    algorithm = check_algorithm(algorithm)
    if algorithm == "parity":
        raise ValueError("algorithm: a decode of several queries needs the split kernels")
    check_q_dtype_of(kv, np.dtype(dtype), algorithm)
    n_heads, _, _ = check_dims(q_heads(token, kv.head_dim, n_heads), kv.n_kv_heads, kv.head_dim)
    if token != (n_heads, kv.head_dim):
        raise ValueError(f"q: expected (n_q, {n_heads}, {kv.head_dim}), got {tuple(shape)}")
    feats = check_features(n_heads, **kw)
    mref = None if tree_mask is None else array_ref(tree_mask, "tree_mask")
    mask_mode = 0 if tree_mask is None else check_mask(tree_mask, mref, n_q)
    sid = stream_key(kv.stream if host else call_stream(stream, q, kv.device.ordinal))
    out_shape = (n_q, n_heads, kv.head_dim)
    if host and tree_mask is None and feats.plain and feats.scale is None and not feats.return_lse:
        return _verify_host(kv, q, n_heads, algorithm, out_shape, np.dtype(dtype), sid)
    with kv.lock:
        kv.check_open()
        kv.device.activate()
        seq = kv.seq_len
        check_query_count(n_q, seq)
        joined = False if host else kv.join(sid, "decode", "a graph of gqa_decode")
        made: list[DeviceArray] = []
        try:
            dev, s = kv.device, kv.stream
            if host:
                q_d = to_device(np.ascontiguousarray(q), s, device=dev)
                made.append(q_d)
            else:
                assert ref is not None
                q_d = DeviceArray._wrap(ref[0], tuple(shape), np.dtype(dtype), dev, q)
            out = (
                empty(out_shape, dtype, device=dev) if host
                else output_pool(dev, sid, math.prod(out_shape) * np.dtype(dtype).itemsize).take(
                    out_shape, np.dtype(dtype))
            )  # fmt: skip
            if host:
                made.append(out)
            lse = None
            if feats.return_lse:
                lse = (empty((n_q, n_heads), np.float32, device=dev) if host
                       else output_pool(dev, sid, 4 * n_q * n_heads).take((n_q, n_heads),
                                                                          _F32))  # fmt: skip
                if host:
                    made.append(lse)
            mask_d = mask_operand(tree_mask, mref, n_q, dev, s, made)
            slopes = per_head_operand(feats.alibi_slopes, "alibi_slopes", dev, s, made)
            sinks = per_head_operand(feats.sinks, "sinks", dev, s, made)
            bits, values = abi.feature_args(feats, kv.head_dim, lse=lse, slopes=slopes,
                                            sinks=sinks)  # fmt: skip
            plan_seq = kv.capacity if not values.window else min(kv.capacity, values.window)
            aligned = ((q_d.ptr | kv._k_ptr | kv._v_ptr) & 15) == 0
            launches, _ = launches_for(
                q_d, kv._k, kv._v, out, n_heads=n_heads, n_kv_heads=kv.n_kv_heads,
                head_dim=kv.head_dim, seq_len=seq, plan_seq=plan_seq, aligned=aligned,
                dtype=np.dtype(dtype), bits=bits, fp8=kv.fp8, features=values,
                kv_scales=kv.kv_scales, n_q=n_q, mask=mask_d, mask_mode=mask_mode,
                workspace=lambda floats: _stream_buffer(dev, s._handle_int, "verify", floats),
                **kv.four_bit_args(),
            )  # fmt: skip
            for launch in launches:
                launch.run(s, dev)
            if host:
                host_out = out.to_host(s)
                return (host_out, lse.to_host(s)) if lse is not None else host_out
            return (out, lse) if lse is not None else out
        finally:
            if joined:
                kv.rejoin(sid)
            if host:
                s.synchronize()
            for a in made:
                a.close()
