"""Append + decode per token as device-only operations, and captured once as a CUDA graph.

``kv_append_async`` and ``gqa_decode_async`` take device inputs, do no host work and read
the cache's sequence length on the device, so they can sit inside any captured graph
(ours, PyTorch's or CuPy's). ``DecodeGraph`` captures a whole token step once and replays
it for every token, with no re-capture and no node update.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..decode import plan as attention
from ..decode.checks import (
    SUPPORTED_DTYPES,
    _element_strides,
    check_dims,
    check_kv_layout,
    check_tokens,
    dtype_name,
    head_major_rows,
)
from ..decode.features import check_features
from ..decode.fp8 import ROW_DTYPES, quantize_kernel
from ..decode.plan import check_algorithm
from ..decode.records import MAX_RECORDS, DecodeRecord
from ..decode.records import lock as _records_lock
from ..decode.records import store as _records
from ..driver.calls import capture_keep, drv
from ..driver.calls import capture_state as _capture_state
from ..driver.device import Device, device_for
from ..driver.graph import GraphExec, keep_for_capture, stream_capturing
from ..driver.interop import ArrayRef, array_ref
from ..driver.launch import LaunchSequence, PackedLaunch
from ..driver.memory import DeviceArray, empty, pinned_empty, to_device
from ..driver.pool import stream_buffer as _stream_buffer
from ..driver.stream import Stream, call_stream, stream_handle, stream_key
from ..errors import ClosedError, FerroxError, KVCapacityError
from ..types import ArrayLike, DeviceArrayLike, DTypeLike, StreamLike
from .kv_cache import KVCache, LayerKVCache, _feature_key, append_kernel

__all__ = ["DecodeGraph", "LayerDecodeGraph", "gqa_decode_async", "kv_append_async"]

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


def _q_heads(n_heads: Any, q_dev: Any, head_dim: int) -> Any:
    """``n_heads`` as given (checked later), or read from device array ``q_dev``'s size:
    any shape holding whole heads of ``head_dim`` (``(n_heads, head_dim)``, SDPA's ``(1,
    n_heads, 1, head_dim)``, flat...).

    Raises:
        TypeError, ValueError: ``q_dev`` is no device array, or holds no whole heads.
    """
    if n_heads is not None:
        return n_heads
    ref = array_ref(q_dev, "q_dev")
    if ref is None:
        raise TypeError("q_dev: expected a device array, got a numpy array")
    size = math.prod(ref[1])
    if size == 0 or size % head_dim:
        raise ValueError(
            f"q_dev: shape {tuple(ref[1])} holds no whole number of heads of head_dim "
            f"{head_dim} (n_heads not given: read from q_dev's size)"
        )
    return size // head_dim


def _check_cache(kv: Any) -> KVCache:
    if not isinstance(kv, KVCache):
        raise TypeError(f"kv: expected a ferrox_driver.KVCache, got {type(kv).__name__}")
    if kv._closed or kv.stream._closed:
        kv._check_open()
    return kv


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
        self.foreign = foreign


def _signature(ref: ArrayRef | None) -> tuple[Any, ...] | None:
    return None if ref is None else (ref[1], ref[2], ref[3], ref[4])


def _length_for_device_work(
    kv: KVCache, sid: int, foreign: bool, a: ArrayRef, b: ArrayRef, objs: tuple[Any, Any]
) -> bool:
    """Bring the device's length up to date for work queued now on stream ``sid``; inside a
    capture, keep the cache and the operands ``a``, ``b`` (read from ``objs``) with the
    graph (see KVCache.device_length_for). Returns whether the work is captured."""
    kv.device.activate()  # this thread's context current before any driver call
    ours = getattr(_capture_state, "depth", 0)
    if ours or (foreign and stream_capturing(sid)):
        owners = (objs[0] if a[5] is None else a[5], objs[1] if b[5] is None else b[5])
        keep_for_capture(sid, foreign, kv, *owners)
        kv.device_length_for(True)
        return True
    if not kv._device_seq_current:
        kv.device_length()
    return False


class _AppendsTo:
    """Kept by a ferrox graph that appends to ``kv``: each launch of it tells the cache
    that its length changed on the device (see GraphExec.launch)."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv

    def _on_graph_launch(self) -> None:
        self.kv.mark_device_appends()


def kv_append_async(
    kv: KVCache, k_dev: DeviceArrayLike, v_dev: DeviceArrayLike, *, stream: StreamLike
) -> None:
    """Queue a device-side append of one token: rows ``k_dev``/``v_dev`` go to position
    ``seq_len`` (read on the device), which is then bumped. Capturable in a graph.

    A full cache is not written: the device sets an overflow flag and the host raises
    KVCapacityError at ``kv.synchronize()``.

    Captured into a ferrox graph, each ``GraphExec.launch`` tells the cache its length
    changed; captured into a graph of PyTorch or CuPy, whose replays ferrox cannot see,
    the cache reads its length from the device before every later host append or decode,
    so no token a replay appended is ever overwritten.

    Args:
        kv: the cache.
        k_dev: device array of ``n_kv_heads*head_dim`` elements, cache dtype.
        v_dev: like ``k_dev``.
        stream: the stream (a ferrox Stream, any ``__cuda_stream__`` object, an int
            handle) to queue on; None: PyTorch's current stream for a PyTorch ``k_dev``,
            else the legacy default stream.
    """
    kv = _check_cache(kv)
    kr, vr = array_ref(k_dev, "k_dev"), array_ref(v_dev, "v_dev")
    stream = call_stream(stream, k_dev)
    sid = stream_key(stream)
    key = (sid, _signature(kr), _signature(vr))
    with kv._lock:
        appender = kv._appenders.get(key)
        if appender is None:  # checked once per signature
            rows = _fp8_dtype(k_dev, "k_dev", ROW_DTYPES) if kv.fp8 else None
            _operand(k_dev, "k_dev", kv.row_elems, kv, rows)
            _operand(v_dev, "v_dev", kv.row_elems, kv, rows)
            foreign = sid != 0 and not isinstance(stream, Stream)
            appender = kv._appenders[key] = _Appender(kv, stream_handle(sid), foreign, rows)
        assert kr is not None and vr is not None  # _operand refused host arrays
        captured = _length_for_device_work(kv, sid, appender.foreign, kr, vr, (k_dev, v_dev))
        if captured and not capture_keep(_AppendsTo(kv)):  # a graph ferrox cannot see run
            kv._graph_appends = True
        appender.sequence.run((kr[0], vr[0]))
        kv._host_seq_valid = False


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
    read, not checked on the host. float32/float16/bfloat16 (an fp8 cache is a KVCache,
    whose scales the decode reads).

    Args:
        q_dev: device array of ``n_heads*head_dim`` elements (any shape: ``(n_heads,
            head_dim)``, SDPA's ``(1, n_heads, 1, head_dim)``...), cache dtype.
        kv: the cache, or a pair ``(k_cache, v_cache)`` of device arrays (above).
        out_dev: device array like ``q_dev``, written with the result.
        n_heads: query heads, a multiple of ``kv.n_kv_heads`` (default: q_dev's size over
            head_dim).
        stream: the stream to queue on (None: PyTorch's current stream for a PyTorch
            ``q_dev``, else the legacy default stream).
        algorithm: ``"auto"``/``"split"`` or ``"parity"``.
        out_lse: a float32 device array of ``n_heads``, written with the log-sum-exp.
        sliding_window: as `gqa_decode`; the window follows the device's seq_len, so a
            graph captured once keeps it as the cache grows.
        logits_soft_cap: as `gqa_decode`.
        sinks: as `gqa_decode`, a float32 device array (read by the kernel at each run).
        alibi_slopes: as `gqa_decode`, a float32 device array.
        scale: as `gqa_decode`.
        seq_len: with a ``(k_cache, v_cache)`` pair (and only then): the int32 device
            scalar of the tokens to decode.
        kv_layout: with a pair: ``"NHD"`` or ``"HND"`` (above).
    """
    stream = call_stream(stream, q_dev)
    if isinstance(kv, tuple):
        _decode_async_pair(
            q_dev, kv, out_dev, n_heads, stream, algorithm, seq_len, kv_layout,
            dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
                 alibi_slopes=alibi_slopes, scale=scale),
            out_lse,
        )  # fmt: skip
        return
    if seq_len is not None or type(kv_layout) is not str or kv_layout != "NHD":
        raise ValueError(
            "seq_len, kv_layout: only with a (k_cache, v_cache) pair; a KVCache keeps its "
            "own length and layout"
        )
    kv = _check_cache(kv)
    if not (
        out_lse is None and sliding_window is None and logits_soft_cap is None
        and sinks is None and alibi_slopes is None and scale is None
    ):  # fmt: skip
        _decode_async_features(
            q_dev, kv, out_dev, n_heads, stream, algorithm,
            dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
                 alibi_slopes=alibi_slopes, scale=scale),
            out_lse,
        )  # fmt: skip
        return
    qr, outr = array_ref(q_dev, "q_dev"), array_ref(out_dev, "out_dev")
    sid = stream_key(stream)
    aligned = qr is not None and outr is not None and ((qr[0] | outr[0]) & 15) == 0
    key = (n_heads, algorithm, sid, _signature(qr), _signature(outr), aligned)
    with kv._lock:
        try:
            entry = kv._async_records.get(key)
        except TypeError:  # an unhashable argument, which the checks name
            entry = None
        if entry is None:  # checked once per signature
            n_heads = _q_heads(n_heads, q_dev, kv.head_dim)
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
            entry = kv._async_records[key] = (record, foreign)
        assert qr is not None and outr is not None  # _operand refused host arrays
        record, foreign = entry
        _length_for_device_work(kv, sid, foreign, qr, outr, (q_dev, out_dev))
        record.run((qr[0], kv._k_ptr, kv._v_ptr, outr[0], 0))


def _q_dtype(q_dev: Any, kv: KVCache, algorithm: str) -> np.dtype:
    """q's dtype for a decode of ``kv``: the cache's, or an fp8 cache's float16/bfloat16."""
    if not kv.fp8:
        return kv.dtype
    qdt = _fp8_dtype(q_dev, "q_dev", ROW_DTYPES[1:])
    return kv._q_dtype_for(qdt, algorithm)


def _feature_array(obj: Any, name: str, n: int, device: Device) -> DeviceArray | None:
    """A per-head float32 device array of a graph-safe decode (None stays None)."""
    ptr = _feature_ptr(obj, name, n, device.ordinal)
    return None if ptr is None else DeviceArray._wrap(ptr, (n,), np.dtype(np.float32), device, None)


def _feature_ptr(obj: Any, name: str, n: int, ordinal: int) -> int | None:
    """``_feature_array``'s checks, with no device work: the array's pointer."""
    if obj is None:
        return None
    ref = array_ref(obj, name)
    if ref is None:
        raise TypeError(f"{name}: expected a float32 device array (the kernel reads it), got "
                        "a numpy array")  # fmt: skip
    ptr, shape, dtype, at, contiguous, _ = ref
    if dtype != np.float32 or math.prod(shape) != n or not contiguous:
        raise ValueError(f"{name}: expected {n} contiguous float32, got shape {shape} of {dtype}")
    if at != ordinal:
        raise ValueError(f"{name}: on device {at}, the cache on {ordinal}")
    return int(ptr)


def _decode_async_features(
    q_dev: Any, kv: KVCache, out_dev: Any, n_heads: Any, stream: Any, algorithm: Any,
    kw: dict[str, Any], out_lse: Any,
) -> None:  # fmt: skip
    """gqa_decode_async with features: checked (every call; the record is made once per
    signature and feature values), then queued reading the length on the device."""
    n_heads = _q_heads(n_heads, q_dev, kv.head_dim)
    n_heads, _, _ = check_dims(n_heads, kv.n_kv_heads, kv.head_dim)
    if check_algorithm(algorithm) == "parity":
        raise ValueError("algorithm: the features need the split kernels ('auto' or 'split')")
    feats = check_features(n_heads, **kw, return_lse=out_lse is not None)
    size = n_heads * kv.head_dim
    qdt = _q_dtype(q_dev, kv, algorithm)
    q = _operand(q_dev, "q_dev", size, kv, qdt)
    out = _operand(out_dev, "out_dev", size, kv, qdt)
    sinks = _feature_array(feats.sinks, "sinks", n_heads, kv.device)
    slopes = _feature_array(feats.alibi_slopes, "alibi_slopes", n_heads, kv.device)
    lse = _feature_array(out_lse, "out_lse", n_heads, kv.device)
    bits, fargs = attention.feature_args(feats, kv.head_dim, slopes=slopes, sinks=sinks, lse=lse)
    sid = stream_key(stream)
    qr, outr = array_ref(q_dev, "q_dev"), array_ref(out_dev, "out_dev")
    assert qr is not None and outr is not None
    with kv._lock:
        q_view = DeviceArray._wrap(q, (size,), qdt, kv.device, None)
        out_view = DeviceArray._wrap(out, (size,), qdt, kv.device, None)
        record = kv.decode_record(
            q_view, out_view, n_heads, algorithm, stream, length_on_device=True,
            features=(bits, fargs),
        )  # fmt: skip
        foreign = sid != 0 and not isinstance(stream, Stream)
        kept = tuple(x for x in (feats.sinks, feats.alibi_slopes, out_lse) if x is not None)
        captured = _length_for_device_work(kv, sid, foreign, qr, outr, (q_dev, out_dev))
        if captured and kept:
            keep_for_capture(sid, foreign, *kept)
        record.run((qr[0], kv._k_ptr, kv._v_ptr, outr[0], 0))


@dataclasses.dataclass(frozen=True)
class _Pair:
    """A caller's (k_cache, v_cache) pair, checked: the refs, its shape and layout."""

    k: ArrayRef
    v: ArrayRef
    n_kv_heads: int
    head_dim: int
    capacity: int
    head_stride: int  # elements from one KV head's rows to the next's (HND), else 0
    layout: str


def _check_pair(pair: tuple[Any, ...], kv_layout: Any) -> _Pair:
    """A ``(k_cache, v_cache)`` pair of device arrays in layout ``kv_layout``, checked."""
    layout = check_kv_layout(kv_layout)
    if len(pair) != 2:
        raise TypeError(
            f"kv: expected a KVCache or a pair (k_cache, v_cache), got {len(pair)} items"
        )
    k, v = pair
    kr, vr = array_ref(k, "k_cache"), array_ref(v, "v_cache")
    if kr is None or vr is None:
        raise TypeError(
            "k_cache, v_cache: expected device arrays (a pair is read in place on the "
            "device), got a numpy array"
        )
    shape, dtype = tuple(kr[1]), kr[2]
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"k_cache: expected float32, float16 or bfloat16, got {dtype} (an fp8 cache is "
            "a KVCache: the decode reads its scales)"
        )
    if layout == "HND":
        if len(shape) not in (3, 4) or (len(shape) == 4 and shape[0] != 1):
            raise ValueError(
                "k_cache: expected a head-major array (n_kv_heads, capacity, head_dim) or "
                f"(1, n_kv_heads, capacity, head_dim), got shape {shape}"
            )
        n_kv, hd = shape[-3], shape[-1]
        _, capacity, stride = head_major_rows(k, "k_cache", n_kv, hd)
        _, _, stride_v = head_major_rows(v, "v_cache", n_kv, hd)
    else:
        if len(shape) != 3 or not kr[4]:
            raise ValueError(
                "k_cache: expected a C-contiguous token-major array (capacity, n_kv_heads, "
                f"head_dim), got shape {shape}{'' if kr[4] else ' (strided)'}"
            )
        capacity, n_kv, hd = shape
        check_tokens(capacity, "k_cache")
        stride = stride_v = 0
    if tuple(vr[1]) != shape or vr[2] != dtype or stride_v != stride:
        raise ValueError(
            f"v_cache: expected k_cache's shape {shape}, dtype {dtype} and layout, got "
            f"{tuple(vr[1])} of {vr[2]}"
        )
    if layout == "NHD" and not vr[4]:
        raise ValueError(f"v_cache: must be C-contiguous, got a strided view of shape {shape}")
    if kr[3] != vr[3]:
        raise ValueError(f"v_cache: on device {vr[3]}, k_cache on device {kr[3]}")
    return _Pair(kr, vr, n_kv, hd, capacity, stride, layout)


def _pair_operand(obj: Any, name: str, size: int, dtype: np.dtype, ordinal: int) -> ArrayRef:
    """A device array of ``size`` contiguous elements of ``dtype`` on device ``ordinal``."""
    ref = array_ref(obj, name)
    if ref is None:
        raise TypeError(f"{name}: expected a device array, got a numpy array")
    _, shape, got, at, contiguous, _ = ref
    if got != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {got}")
    if math.prod(shape) != size or not contiguous:
        raise ValueError(f"{name}: expected {size} contiguous elements, got shape {shape}")
    if at != ordinal:
        raise ValueError(f"{name}: on device {at}, the cache on device {ordinal}")
    return ref


# The eager pair decode's calls, by everything its checks read: a repeated call (the same
# shapes, strides, dtypes, features, seq_len array and stream; new q/k/v/out pointers)
# skips the checks and the record lookup and only writes the pointers. The oldest go first
# past MAX_PAIR_CALLS; the records themselves live in decode's LRU too.
_pair_calls: dict[tuple[Any, ...], tuple[Any, Device, bool]] = {}
MAX_PAIR_CALLS = 256
_PAIR_ROLES = ("q_dev", "k_cache", "v_cache", "out_dev", "seq_len", "sinks", "alibi_slopes",
               "out_lse")  # fmt: skip


def _decode_async_pair(
    q_dev: Any, pair: tuple[Any, ...], out_dev: Any, n_heads: Any, stream: Any,
    algorithm: Any, seq_len: Any, kv_layout: Any, kw: dict[str, Any], out_lse: Any,
) -> None:  # fmt: skip
    """gqa_decode_async over a caller's (k_cache, v_cache): a call seen before (`_pair_calls`)
    queued with its pointers; a new one checked (`_pair_checked`) and remembered."""
    sid = stream_key(stream)
    found = _pair_call_key(q_dev, pair, out_dev, n_heads, sid, algorithm, seq_len, kv_layout,
                           kw, out_lse)  # fmt: skip
    entry = None if found is None else _pair_calls.get(found[0])
    if entry is None:
        entry = _pair_checked(q_dev, pair, out_dev, n_heads, stream, sid, algorithm, seq_len,
                              kv_layout, kw, out_lse)  # fmt: skip
        if found is not None:
            with _records_lock:
                while len(_pair_calls) >= MAX_PAIR_CALLS:
                    _pair_calls.pop(next(iter(_pair_calls)), None)
                _pair_calls[found[0]] = entry
    record, dev, foreign = entry
    dev.activate()  # this thread's context current before any driver call
    objs = (q_dev, pair[0], pair[1], out_dev, seq_len, kw.get("sinks"), kw.get("alibi_slopes"),
            out_lse)  # fmt: skip
    refs: list[Any] = found[1] if found is not None else [
        None if o is None else array_ref(o, n) for o, n in zip(objs, _PAIR_ROLES, strict=True)
    ]  # fmt: skip
    if bool(getattr(_capture_state, "depth", 0)) or (foreign and stream_capturing(sid)):
        owners = [o if r[5] is None else r[5] for r, o in zip(refs, objs, strict=True) if r]
        keep_for_capture(sid, foreign, record, *owners)
    record.run((refs[0][0], refs[1][0], refs[2][0], refs[3][0], 0))


def _pair_call_key(
    q_dev: Any, pair: Any, out_dev: Any, n_heads: Any, sid: int, algorithm: Any, seq_len: Any,
    kv_layout: Any, kw: dict[str, Any], out_lse: Any,
) -> tuple[tuple[Any, ...], list[Any]] | None:  # fmt: skip
    """The key of a pair decode's call in `_pair_calls` and its arrays' refs, or None where
    the call is not one to remember (anything the checks would refuse goes to them)."""
    if not isinstance(pair, tuple) or len(pair) != 2:
        return None
    objs = (q_dev, pair[0], pair[1], out_dev, seq_len, kw.get("sinks"), kw.get("alibi_slopes"),
            out_lse)  # fmt: skip
    refs: list[Any] = []
    sigs: list[Any] = []
    for obj, role in zip(objs, _PAIR_ROLES, strict=True):
        if obj is None:
            if len(refs) < 4:  # (q, k, v, out missing: the checks name them)
                return None
            refs.append(None)
            sigs.append(None)
            continue
        ref = array_ref(obj, role)
        if ref is None:
            return None
        sig: tuple[Any, ...] = (ref[1], ref[2], ref[3], ref[4])
        if not ref[4]:  # (a head-major view: its strides place the heads)
            sig += (_element_strides(obj, ref[2].itemsize),)
        refs.append(ref)
        sigs.append(sig)
    # q, k, v and out change pointers from call to call (their 16-byte alignment matters);
    # seq_len's and the features' arrays are the record's own
    aligned = ((refs[0][0] | refs[1][0] | refs[2][0] | refs[3][0]) & 15) == 0
    held = tuple(0 if r is None else r[0] for r in refs[4:])
    key = (sid, n_heads, algorithm, kv_layout, kw.get("sliding_window"),
           kw.get("logits_soft_cap"), kw.get("scale"), aligned, held, *sigs,
           attention.OVERRIDES)  # fmt: skip
    try:
        hash(key)
    except TypeError:
        return None
    return key, refs


def _pair_checked(
    q_dev: Any, pair: tuple[Any, ...], out_dev: Any, n_heads: Any, stream: Any, sid: int,
    algorithm: Any, seq_len: Any, kv_layout: Any, kw: dict[str, Any], out_lse: Any,
) -> tuple[Any, Device, bool]:  # fmt: skip
    """A pair decode's every argument checked, and its record (made on first use, outside
    a capture), device and whether its stream is another library's."""
    kv = _check_pair(pair, kv_layout)
    n_heads = _q_heads(n_heads, q_dev, kv.head_dim)
    n_heads, n_kv, hd = check_dims(n_heads, kv.n_kv_heads, kv.head_dim)
    if check_algorithm(algorithm) == "parity":
        raise ValueError("algorithm: a (k_cache, v_cache) pair needs the split kernels ('auto')")
    if seq_len is None:
        raise TypeError(
            "seq_len: a (k_cache, v_cache) pair needs its length, an int32 device scalar"
        )
    ordinal, dtype = kv.k[3], np.dtype(kv.k[2])
    seq = _pair_operand(seq_len, "seq_len", 1, np.dtype(np.int32), ordinal)
    size = n_heads * hd
    q = _pair_operand(q_dev, "q_dev", size, dtype, ordinal)
    out = _pair_operand(out_dev, "out_dev", size, dtype, ordinal)
    feats = check_features(n_heads, **kw, return_lse=out_lse is not None)
    for obj, name in ((feats.sinks, "sinks"), (feats.alibi_slopes, "alibi_slopes"),
                      (out_lse, "out_lse")):  # fmt: skip
        _feature_ptr(obj, name, n_heads, ordinal)  # (checked before the device is asked)
    dev = device_for(ordinal)
    sinks = _feature_array(feats.sinks, "sinks", n_heads, dev)
    slopes = _feature_array(feats.alibi_slopes, "alibi_slopes", n_heads, dev)
    lse = _feature_array(out_lse, "out_lse", n_heads, dev)
    bits, fargs = attention.feature_args(feats, hd, slopes=slopes, sinks=sinks, lse=lse)
    if kv.layout == "HND":
        bits |= attention.F_HND
        fargs = dataclasses.replace(fargs, head_stride=kv.head_stride)
    heads_at = kv.head_stride * dtype.itemsize  # (16-byte loads need whole heads aligned)
    aligned = ((q[0] | kv.k[0] | kv.v[0] | out[0] | heads_at) & 15) == 0
    foreign = sid != 0 and not isinstance(stream, Stream)
    dev.activate()  # this thread's context current before any driver call
    key = ("pair", dev.context_handle, dtype, n_heads, n_kv, hd, kv.capacity, kv.head_stride,
           aligned, sid, seq[0], bits, _feature_key(fargs), attention.OVERRIDES)  # fmt: skip
    captured = bool(getattr(_capture_state, "depth", 0)) or (foreign and stream_capturing(sid))
    record = _records.get(key)
    if record is None:
        if captured:
            raise FerroxError(
                "stream: the first decode of this (k_cache, v_cache) signature cannot load "
                "its kernels or allocate its scratch inside a capture: run it once before "
                "capturing"
            )
        with _records_lock:
            record = _pair_record(key, dev, kv, q, out, seq, n_heads, dtype, aligned, bits,
                                  fargs, feats.sliding_window, sid)  # fmt: skip
    return record, dev, foreign


def _pair_record(
    key: tuple[Any, ...], dev: Device, kv: _Pair, q: ArrayRef, out: ArrayRef, seq: ArrayRef,
    n_heads: int, dtype: np.dtype, aligned: bool, bits: int, fargs: Any,
    window: int | None, sid: int,
) -> DecodeRecord:  # fmt: skip
    """The launches of a pair's decode, planned for its capacity (at most the window)."""
    record = _records.get(key)
    if record is not None:
        return record
    plan_seq = kv.capacity if window is None else min(kv.capacity, window)
    n_kv, hd = kv.n_kv_heads, kv.head_dim
    plan = attention.plan_split(dev, dtype, n_heads, n_kv, hd, max(plan_seq, 1), aligned, bits)
    ws = _stream_buffer(dev, sid, "workspace", plan.workspace_floats(n_heads, hd))
    q_d, out_d = (DeviceArray._wrap(r[0], (n_heads * hd,), dtype, dev, None) for r in (q, out))
    k_d, v_d = (DeviceArray._wrap(r[0], tuple(r[1]), dtype, dev, None) for r in (kv.k, kv.v))
    seq_d = DeviceArray._wrap(seq[0], (1,), np.dtype(np.int32), dev, None)
    launches = attention.split_launches(
        plan, q_d, k_d, v_d, out_d, ws, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd,
        seq_len=kv.capacity, seq_len_dev=seq_d, features=fargs,
    )  # fmt: skip
    record = _records[key] = DecodeRecord(launches, dev, stream_handle(sid), None)
    while len(_records) > MAX_RECORDS:
        _records.popitem(last=False)
    return record


def _staging(sizes: tuple[int, ...], dt: np.dtype, device: Any) -> tuple[list[int], Any, Any]:
    """Parts of ``sizes`` elements in one page-locked buffer and one device buffer, each
    part 256-byte aligned (a replay copies them in with one copy): the parts' starts and
    the two buffers."""
    step = 256 // dt.itemsize
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + -(-n // step) * step)
    total = starts[-1] + sizes[-1]
    return starts, pinned_empty((total,), dt), empty((total,), dt, device=device)


def _got(arr: Any) -> str:
    """What a graph step was given instead of its numpy staging's kind of array; a device
    array's message names the calls that take one."""
    if isinstance(arr, np.ndarray):
        return f"{arr.dtype} of size {arr.size}"
    what = f"{type(arr).__module__}.{type(arr).__name__}"
    if hasattr(arr, "__dlpack__") or hasattr(arr, "__cuda_array_interface__"):
        return (
            f"a device array ({what}): the graph copies numpy arrays in; device arrays go "
            f"to fd.kv_append_async and fd.gqa_decode_async, which a graph of your own "
            f"(torch.cuda.graph, Stream.capture) can capture"
        )
    return what


class DecodeGraph:
    """One token step (copy in q/k/v, append, decode, copy out) captured once as a CUDA
    graph and replayed for every token.

    Args:
        kv: the cache to append to and decode against.
        n_heads: query heads, a multiple of ``kv.n_kv_heads``.
        stream: where the graph runs (default: the cache's stream, so it stays ordered
            with the cache's own appends).
        algorithm: ``"auto"`` or ``"parity"``.
        sliding_window: as `gqa_decode`; the window follows the cache's length.
        logits_soft_cap: as `gqa_decode`.
        sinks: as `gqa_decode`: a float32 device array (read at each step), or numpy,
            copied once into the device array ``sinks``.
        alibi_slopes: like ``sinks``.
        scale: as `gqa_decode`.
        return_lse: each step also writes the log-sum-exp per query head into ``lse``.
        q_dtype: an fp8 cache's dtype for q, the rows and the result (float16 or bfloat16;
            default bfloat16): the rows are quantized on the device at each step. Other
            caches take their own dtype.

    Calling it is thread-safe (it takes the cache's lock); ``launch`` + ``synchronize``
    as a pair are the caller's to order. Closing the cache or the stream makes it raise
    `ClosedError`, as does its own ``close()``.

    Attributes:
        dtype: the dtype of q, the rows and the result (the cache's, or an fp8 cache's
            ``q_dtype``).
        q: page-locked staging for the query, (n_heads, head_dim); fill it in place and
            call ``launch`` then ``synchronize`` to skip even the staging copy.
        k: page-locked staging for the new token's K row, (n_kv_heads, head_dim).
        v: like ``k``, for V.
        out: page-locked array the result lands in, (n_heads, head_dim).
        lse: with ``return_lse``, the page-locked (n_heads,) float32 LSE of the last step.
        sinks: the device array of sinks the graph reads (None without); write it in place
            to change them.
        alibi_slopes: like ``sinks``, for the slopes.
    """

    def __init__(
        self,
        kv: KVCache,
        *,
        n_heads: int,
        stream: Stream | None = None,
        algorithm: str = "auto",
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: ArrayLike = None,
        alibi_slopes: ArrayLike = None,
        scale: float | None = None,
        return_lse: bool = False,
        q_dtype: DTypeLike = None,
    ) -> None:
        self._closed = True  # until built
        self.kv = _check_cache(kv)
        self.n_heads, _, _ = check_dims(n_heads, kv.n_kv_heads, kv.head_dim)
        algorithm = check_algorithm(algorithm)
        # q, the rows and the result: the cache's dtype, or an fp8 cache's q_dtype (its rows
        # quantized on the device by the graph's append)
        self.dtype = kv._q_dtype_for(q_dtype, algorithm)
        feats = check_features(
            self.n_heads, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            sinks=sinks, alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse,
        )  # fmt: skip
        if algorithm == "parity" and (not feats.plain or scale is not None or return_lse):
            raise ValueError("algorithm: the features need the split kernels ('auto')")
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"stream: expected a ferrox_driver.Stream, got {type(stream)}")
        if stream is not None:
            stream._check_open()
        self.stream = kv.stream if stream is None else stream
        self._h = stream_handle(self.stream)
        dt, hd = self.dtype, kv.head_dim
        # q, k and v share one page-locked buffer and one device buffer (each part 256-byte
        # aligned), so a replay copies them in with one copy.
        sizes = (self.n_heads * hd, kv.row_elems, kv.row_elems)
        starts, self._stage, self._in_d = _staging(sizes, dt, kv.device)
        parts = [self._stage[a : a + n] for a, n in zip(starts, sizes, strict=True)]
        self.q = parts[0].reshape(self.n_heads, hd)
        self.k = parts[1].reshape(kv.n_kv_heads, hd)
        self.v = parts[2].reshape(kv.n_kv_heads, hd)
        self._flat = parts
        self.out = pinned_empty((self.n_heads, hd), dt)
        self._q_d, self._k_d, self._v_d = (
            self._in_d.view((n,), offset=a * dt.itemsize)
            for a, n in zip(starts, sizes, strict=True)
        )
        self._out_d = empty((sizes[0],), dt, device=kv.device)
        # the features' per-head arrays on the device (numpy ones copied once into arrays
        # of this graph: ``sinks``/``alibi_slopes``, writable in place), and the LSE
        self._owned: list[DeviceArray] = []
        self.sinks = self._per_head(feats.sinks)
        self.alibi_slopes = self._per_head(feats.alibi_slopes)
        self._lse_d = None
        self.lse = None
        if feats.return_lse:
            self._lse_d = empty((self.n_heads,), np.float32, device=kv.device)
            self._owned.append(self._lse_d)
            self.lse = pinned_empty((self.n_heads,), np.float32)
        self._features: dict[str, Any] = {
            "sliding_window": feats.sliding_window, "logits_soft_cap": feats.logits_soft_cap,
            "scale": feats.scale,
        }  # fmt: skip
        with kv._lock:
            kv.synchronize()  # earlier eager work is done; the host seq_len is exact
            self._exec = self._capture(algorithm)
        self._exec_handle = self._exec.handle
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def _check_open(self) -> None:
        """Raise ClosedError when this graph, its cache or its stream was closed."""
        if self._closed:
            raise ClosedError("DecodeGraph")
        kv = self.kv
        if kv._closed:
            raise ClosedError("DecodeGraph", "uses a KVCache that was closed")
        if kv.stream._closed or self.stream._closed:
            raise ClosedError("DecodeGraph", "runs on a Stream that was closed")

    def _per_head(self, values: Any) -> Any:
        """A feature's per-head array on the device: a device array as given, numpy copied."""
        if values is None or not isinstance(values, np.ndarray):
            return values
        arr = to_device(np.ascontiguousarray(values, np.float32), device=self.kv.device)
        self._owned.append(arr)
        return arr

    def _capture(self, algorithm: str) -> GraphExec:
        kv, s, h = self.kv, self.stream, self._h
        eager_seq = kv._eager_seq  # this graph's launches bring the length up to date
        feats: dict[str, Any] = {k: v for k, v in self._features.items() if v is not None}
        for name, arr in (("sinks", self.sinks), ("alibi_slopes", self.alibi_slopes)):
            if arr is not None:
                feats[name] = arr
        # Load kernels and allocate scratch first: neither is capturable.
        kv.prepare(self.n_heads, algorithm, return_lse=self._lse_d is not None,
                   q_dtype=self.dtype if kv.fp8 else None, **feats)  # fmt: skip
        with s.capture() as graph:
            drv("cuMemcpyHtoDAsync", self._in_d.ptr, self._stage.ctypes.data, self._in_d.nbytes, h)
            kv_append_async(kv, self._k_d, self._v_d, stream=s)
            gqa_decode_async(
                self._q_d, kv, self._out_d, n_heads=self.n_heads, stream=s, algorithm=algorithm,
                out_lse=self._lse_d, **feats,
            )  # fmt: skip
            drv("cuMemcpyDtoHAsync", self.out.ctypes.data, self._out_d.ptr, self._out_d.nbytes, h)
            if self._lse_d is not None and self.lse is not None:
                drv("cuMemcpyDtoHAsync", self.lse.ctypes.data, self._lse_d.ptr,
                    self._lse_d.nbytes, h)  # fmt: skip
        kv._eager_seq = eager_seq
        graph.keep_alive(self._stage, self.out, self._in_d, self._out_d, kv, *self._owned,
                         *((self.lse,) if self.lse is not None else ()))  # fmt: skip
        exec_ = graph.instantiate()
        graph.close()
        return exec_

    def launch(self) -> None:
        """Queue one replay with whatever the staging arrays hold (no waiting).

        Raises:
            ClosedError: this graph, its cache or its stream was closed.
        """
        kv = self.kv
        with kv._lock:
            self._check_open()
            kv.device_length()
            kv.mark_device_appends()
            kv.device.activate()
            drv("cuGraphLaunch", self._exec_handle, self._h)

    def synchronize(self) -> None:
        """Wait for the last replay; then ``out`` holds its result.

        Raises:
            KVCapacityError: the replay found the cache full (nothing was appended, and
                ``out`` holds the decode over the unchanged cache).
            ClosedError: this graph, its cache or its stream was closed.
        """
        self._check_open()
        if self.stream is not self.kv.stream:
            drv("cuStreamSynchronize", self._h)
        self.kv.synchronize()  # reads the device's length (and its overflow flag)

    def _step_done(self, seq_len: int) -> None:
        """After a replay ``__call__`` started at ``seq_len`` tokens, below the capacity: its
        append cannot have overflowed, so the length is known without reading it."""
        drv("cuStreamSynchronize", self._h)
        self.kv._seq_len, self.kv._host_seq_valid = seq_len + 1, not self.kv._graph_appends

    def __call__(self, q: np.ndarray, k_tok: np.ndarray, v_tok: np.ndarray) -> np.ndarray:
        """Append ``k_tok``/``v_tok`` and decode ``q``: one graph launch, one sync.

        Returns:
            A new numpy array of shape (n_heads, head_dim) in ``dtype`` (built with
                ``return_lse``, the step's LSE is then in ``lse``).

        Raises:
            KVCapacityError: the cache is full (checked on the host first: nothing runs).
            TypeError, ValueError: wrong shapes or dtypes.
            ClosedError: this graph, its cache or its stream was closed.
        """
        kv = self.kv
        dt = self.dtype
        fq, fk, fv = self._flat
        if not (
            type(q) is np.ndarray and type(k_tok) is np.ndarray and type(v_tok) is np.ndarray
            and q.dtype == dt and k_tok.dtype == dt and v_tok.dtype == dt
            and q.size == fq.size and k_tok.size == fk.size and v_tok.size == fv.size
        ):  # fmt: skip
            for arr, stage, name in ((q, fq, "q"), (k_tok, fk, "k_tok"), (v_tok, fv, "v_tok")):
                if not isinstance(arr, np.ndarray) or arr.dtype != dt or arr.size != stage.size:
                    raise TypeError(
                        f"{name}: expected a numpy array of {stage.size} {dt} elements, got "
                        f"{_got(arr)}"
                    )
        with kv._lock:  # the staging and the result are this graph's: one step at a time
            if self._closed or kv._closed or kv.stream._closed or self.stream._closed:
                self._check_open()
            seq = kv._seq_len if kv._host_seq_valid else kv.seq_len
            if seq >= kv.capacity:
                raise KVCapacityError(seq, kv.capacity)
            np.copyto(fq, q.reshape(-1))
            np.copyto(fk, k_tok.reshape(-1))
            np.copyto(fv, v_tok.reshape(-1))
            self.launch()
            self._step_done(seq)
            return self.out.copy()

    step = __call__

    def close(self) -> None:
        """Free the executable graph and the staging buffers; closing again does nothing."""
        if self._closed:
            return
        with self.kv._lock:  # not while another thread runs a step
            self._closed = True
            self._exec.close()
            for arr in (self._in_d, self._out_d, *self._owned):
                arr.close()

    def __enter__(self) -> DecodeGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LayerDecodeGraph:
    """A whole token of a model, every layer's append and decode, captured once as one
    CUDA graph and replayed for every token: one copy in (every layer's q and new K and V
    rows), one launch, one copy out, one synchronize per token.

    Args:
        layers: the model's caches (a `LayerKVCache`; its layers share its stream).
        n_heads: query heads, a multiple of the caches' KV heads.
        sliding_window: as `DecodeGraph`, the same for every layer.
        logits_soft_cap: as `DecodeGraph`.
        sinks: as `DecodeGraph` (one array for every layer).
        alibi_slopes: as `DecodeGraph`.
        scale: as `DecodeGraph`.

    Calling it is thread-safe (it takes every layer's lock, in layer order).

    Attributes:
        dtype: the caches' dtype: q's, the rows' and the result's.
        q: page-locked staging, (n_layers, n_heads, head_dim).
        k: page-locked staging for the new token's K rows, (n_layers, n_kv_heads, head_dim).
        v: like ``k``, for V.
        out: page-locked array the results land in, (n_layers, n_heads, head_dim).
    """

    def __init__(
        self,
        layers: LayerKVCache,
        *,
        n_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: ArrayLike = None,
        alibi_slopes: ArrayLike = None,
        scale: float | None = None,
    ) -> None:
        self._closed = True  # until built
        if not isinstance(layers, LayerKVCache):
            raise TypeError(
                f"layers: expected a ferrox_driver.LayerKVCache, got {type(layers).__name__}"
            )
        self.caches: list[KVCache] = list(layers)
        first = self.caches[0]
        self.n_heads, _, _ = check_dims(n_heads, first.n_kv_heads, first.head_dim)
        feats = check_features(
            self.n_heads, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            sinks=sinks, alibi_slopes=alibi_slopes, scale=scale,
        )  # fmt: skip
        self.stream = layers.stream
        self._h = stream_handle(self.stream)
        n, dt, hd = len(self.caches), first.dtype, first.head_dim
        self.dtype = dt
        # every layer's q, then every layer's K rows, then V rows: one page-locked buffer
        # and one device buffer (each part 256-byte aligned), one copy in per token
        sizes = (n * self.n_heads * hd, n * first.row_elems, n * first.row_elems)
        starts, self._stage, self._in_d = _staging(sizes, dt, first.device)
        parts = [self._stage[a : a + size] for a, size in zip(starts, sizes, strict=True)]
        self.q = parts[0].reshape(n, self.n_heads, hd)
        self.k = parts[1].reshape(n, first.n_kv_heads, hd)
        self.v = parts[2].reshape(n, first.n_kv_heads, hd)
        self.out = pinned_empty((n, self.n_heads, hd), dt)
        self._out_d = empty((n * self.n_heads * hd,), dt, device=first.device)
        q_rows, kv_rows = self.n_heads * hd, first.row_elems
        isz = dt.itemsize
        self._layer_views = [
            (
                self._in_d.view((q_rows,), offset=(starts[0] + i * q_rows) * isz),
                self._in_d.view((kv_rows,), offset=(starts[1] + i * kv_rows) * isz),
                self._in_d.view((kv_rows,), offset=(starts[2] + i * kv_rows) * isz),
                self._out_d.view((q_rows,), offset=i * q_rows * isz),
            )
            for i in range(n)
        ]
        self._owned: list[DeviceArray] = []
        self.sinks = self._per_head(feats.sinks, first)
        self.alibi_slopes = self._per_head(feats.alibi_slopes, first)
        self._features: dict[str, Any] = {
            k: v for k, v in (("sliding_window", feats.sliding_window),
                              ("logits_soft_cap", feats.logits_soft_cap), ("scale", feats.scale),
                              ("sinks", self.sinks), ("alibi_slopes", self.alibi_slopes))
            if v is not None
        }  # fmt: skip
        with contextlib.ExitStack() as locks:
            for kv in self.caches:
                locks.enter_context(kv._lock)
            for kv in self.caches:
                kv.synchronize()  # earlier eager work is done; the host lengths are exact
            self._exec = self._capture()
        self._exec_handle = self._exec.handle
        self._closed = False

    def _per_head(self, values: Any, kv: KVCache) -> Any:
        if values is None or not isinstance(values, np.ndarray):
            return values
        arr = to_device(np.ascontiguousarray(values, np.float32), device=kv.device)
        self._owned.append(arr)
        return arr

    def _capture(self) -> GraphExec:
        s, h = self.stream, self._h
        eager = [kv._eager_seq for kv in self.caches]
        for kv in self.caches:  # kernels and scratch first: neither is capturable
            kv.prepare(self.n_heads, **self._features)
        with s.capture() as graph:
            drv("cuMemcpyHtoDAsync", self._in_d.ptr, self._stage.ctypes.data, self._in_d.nbytes, h)
            for kv, (q_d, k_d, v_d, out_d) in zip(self.caches, self._layer_views, strict=True):
                kv_append_async(kv, k_d, v_d, stream=s)
                gqa_decode_async(q_d, kv, out_d, n_heads=self.n_heads, stream=s,
                                 **self._features)  # fmt: skip
            drv("cuMemcpyDtoHAsync", self.out.ctypes.data, self._out_d.ptr, self._out_d.nbytes, h)
        for kv, was in zip(self.caches, eager, strict=True):
            kv._eager_seq = was
        graph.keep_alive(self._stage, self.out, self._in_d, self._out_d, *self.caches,
                         *self._owned)  # fmt: skip
        exec_ = graph.instantiate()
        graph.close()
        return exec_

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("LayerDecodeGraph")
        for kv in self.caches:
            if kv._closed:
                raise ClosedError("LayerDecodeGraph", "uses a KVCache that was closed")
            if kv.stream._closed:
                raise ClosedError("LayerDecodeGraph", "runs on a Stream that was closed")

    def __call__(self, q: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray) -> np.ndarray:
        """Append every layer's ``k_rows[i]``/``v_rows[i]`` and decode its ``q[i]``: one
        graph launch, one sync.

        Args:
            q: ``(n_layers, n_heads, head_dim)`` (or any shape of that size), the dtype's.
            k_rows: ``(n_layers, n_kv_heads, head_dim)``, the new token's K rows.
            v_rows: like ``k_rows``.

        Returns:
            A new numpy array ``(n_layers, n_heads, head_dim)``.

        Raises:
            KVCapacityError: a layer's cache is full (checked first: nothing runs).
            TypeError: wrong sizes or dtypes.
            ClosedError: this graph, a cache or the stream was closed.
        """
        for arr, stage, name in ((q, self.q, "q"), (k_rows, self.k, "k_rows"),
                                 (v_rows, self.v, "v_rows")):  # fmt: skip
            if not isinstance(arr, np.ndarray) or arr.dtype != self.dtype or arr.size != stage.size:
                raise TypeError(
                    f"{name}: expected a numpy array of {stage.size} {self.dtype} elements "
                    f"{stage.shape}, got {_got(arr)}"
                )
        with contextlib.ExitStack() as locks:
            for kv in self.caches:
                locks.enter_context(kv._lock)
            self._check_open()
            seqs = [kv._seq_len if kv._host_seq_valid else kv.seq_len for kv in self.caches]
            for kv, seq in zip(self.caches, seqs, strict=True):
                if seq >= kv.capacity:
                    raise KVCapacityError(seq, kv.capacity)
            np.copyto(self.q, q.reshape(self.q.shape))
            np.copyto(self.k, k_rows.reshape(self.k.shape))
            np.copyto(self.v, v_rows.reshape(self.v.shape))
            for kv in self.caches:
                kv.device_length()
                kv.mark_device_appends()
            self.caches[0].device.activate()
            drv("cuGraphLaunch", self._exec_handle, self._h)
            drv("cuStreamSynchronize", self._h)
            for kv, seq in zip(self.caches, seqs, strict=True):  # below capacity: no overflow
                kv._seq_len, kv._host_seq_valid = seq + 1, not kv._graph_appends
            return self.out.copy()

    step = __call__

    def close(self) -> None:
        """Free the executable graph and the buffers; closing again does nothing."""
        if self._closed:
            return
        with contextlib.ExitStack() as locks:
            for kv in self.caches:
                locks.enter_context(kv._lock)
            self._closed = True
            self._exec.close()
            for arr in (self._in_d, self._out_d, *self._owned):
                arr.close()

    def __enter__(self) -> LayerDecodeGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
