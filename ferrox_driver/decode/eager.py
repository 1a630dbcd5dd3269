"""``gqa_decode``: the eager decode call path.

Launch records (`records.DecodeRecord`) are made once per signature (device, dtype, shape,
length, alignment, stream, overrides). ``gqa_decode`` on device arrays
keeps, per call signature (the arrays' shapes, dtypes and devices, the stream, ``out``),
the validated call itself, so a repeated call does no checking, planning, allocation or
parsing: it reads the arrays' pointers, takes an output block from a per-stream pool and
launches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Literal, overload

import numpy as np

from ..driver.calls import capture_state, stream_sync_raw
from ..driver.device import Device, device_for, ordinal_of, resolve
from ..driver.graph import keep_for_capture, stream_capturing
from ..driver.interop import ArrayRef, array_ref, is_torch
from ..driver.memory import DeviceArray, empty, to_device
from ..driver.pool import OutputPool, output_pool, stream_buffer
from ..driver.stream import Stream, stream_handle, stream_key, torch_stream
from ..kernels import abi
from ..types import ArrayLike, DeviceArrayLike, DeviceLike, StreamLike
from . import plan as attention
from . import records
from .checks import (
    ArrayInfo,
    DecodeSpec,
    check_decode_args,
    check_decode_infos,
    check_head_major_args,
    check_kv_layout,
)
from .features import check_features
from .plan import check_algorithm
from .records import DecodeRecord, decode_record, launch_decode, launches_for

__all__ = ["gqa_decode"]

MAX_CALLS = 256  # validated gqa_decode call signatures kept (LRU)


class _Call:
    """A validated gqa_decode signature on device arrays: its record, its output's shape,
    dtype and pool, and whether its stream must be asked about captures."""

    __slots__ = ("device", "dtype", "foreign", "pool", "record", "seq_len", "shape", "sid")

    def __init__(
        self,
        record: DecodeRecord,
        spec: DecodeSpec,
        device: Device,
        sid: int,
        foreign: bool,
        pool: OutputPool,
    ) -> None:
        self.record, self.device, self.sid, self.foreign, self.pool = (
            record, device, sid, foreign, pool,
        )  # fmt: skip
        self.shape, self.dtype, self.seq_len = spec.q_shape, spec.dtype, spec.seq_len

    def __call__(
        self,
        q: ArrayRef,
        k: ArrayRef,
        v: ArrayRef,
        out: ArrayRef | None,
        obj: Any,
        inputs: tuple[Any, Any, Any],
    ) -> DeviceArray:
        record = self.record
        self.device.activate()  # this thread's context current before any driver call
        ours = getattr(capture_state, "depth", 0)  # a ferrox capture on this thread
        theirs = not ours and self.foreign and stream_capturing(self.sid)
        if out is None:  # a block a foreign graph writes must never be handed out again
            arr = self.pool.take(self.shape, self.dtype, keep=not theirs)
        else:
            if type(obj) is DeviceArray:  # a view of it: closing it closes the result
                arr = DeviceArray._wrap(out[0], out[1], out[2], self.device, None)
                arr._parent = obj if obj._parent is None else obj._parent
            else:
                owner = obj if out[5] is None else out[5]
                arr = DeviceArray._wrap(out[0], out[1], out[2], self.device, owner)
        if ours or theirs:  # the graph holds what it reads and writes
            owners = [i if r[5] is None else r[5] for r, i in zip((q, k, v), inputs, strict=True)]
            keep_for_capture(self.sid, self.foreign, record, arr, *owners)
            record.captured = True
        record.run((q[0], k[0], v[0], arr._ptr, self.seq_len))
        return arr


_calls = records.Kept(MAX_CALLS)  # validated calls, by signature


def _info(ref: ArrayRef, name: str) -> ArrayInfo:
    if not ref[4]:
        raise ValueError(f"{name}: must be C-contiguous, got a strided view of shape {ref[1]}")
    return ArrayInfo(ref[1], ref[2], True)


def check_device(device: Any, ordinal: int | None) -> None:
    """``device`` (None, or any form ``device.ordinal_of`` takes) checked before any device
    work: with device arrays on device ``ordinal``, it must name theirs.

    Raises:
        TypeError, ValueError: naming ``device``.
    """
    if device is None:
        return
    given = ordinal_of(device)
    if ordinal is not None and given != ordinal:
        what = str(given) if isinstance(device, int) else f"{device!r} (device {given})"
        raise ValueError(f"device: {what} given, but q is on device {ordinal}")


def _prepare_call(
    key: tuple[Any, ...],
    refs: tuple[ArrayRef, ArrayRef, ArrayRef],
    out: ArrayRef | None,
    n_heads: Any,
    n_kv_heads: Any,
    head_dim: Any,
    stream: Any,
    sid: int,
    algorithm: Any,
    device: Any,
) -> _Call:
    """Validate a device-array call (raising before any device work) and make its _Call."""
    names = ("q", "k_cache", "v_cache")
    qi, ki, vi = (_info(ref, name) for ref, name in zip(refs, names, strict=True))
    spec = check_decode_infos(qi, ki, vi, n_heads, n_kv_heads, head_dim)
    algorithm = check_algorithm(algorithm)
    ordinal = refs[0][3]
    for ref, name in zip(refs[1:], names[1:], strict=True):
        if ref[3] != ordinal:
            raise ValueError(
                f"{name}: on device {ref[3]}, but q is on device {ordinal}: pass q, k_cache, "
                f"v_cache and out on one device"
            )
    check_device(device, ordinal)
    if out is not None:
        _info(out, "out")
        if out[3] != ordinal:
            raise ValueError(f"out: on device {out[3]}, but q is on device {ordinal}")
        if out[2] != spec.dtype or math.prod(out[1]) != math.prod(spec.q_shape):
            raise ValueError(
                f"out: expected {math.prod(spec.q_shape)} elements of {spec.dtype}, got shape "
                f"{out[1]} of {out[2]}"
            )
    dev = device_for(ordinal)
    qv, kv, vv = (DeviceArray._wrap(r[0], r[1], r[2], dev, None) for r in refs)
    out_view = DeviceArray._wrap(out[0] if out else 0, spec.q_shape, spec.dtype, dev, None)
    record = decode_record(
        qv, kv, vv, out_view, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads,
        head_dim=spec.head_dim, seq_len=spec.seq_len, stream=stream, algorithm=algorithm,
    )  # fmt: skip
    nbytes = math.prod(spec.q_shape) * spec.dtype.itemsize
    foreign = sid != 0 and not isinstance(stream, Stream)
    call = _calls.keep(key, _Call(record, spec, dev, sid, foreign, output_pool(dev, sid, nbytes)))
    return call


@overload
def gqa_decode(
    q: ArrayLike,
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    *,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    stream: StreamLike = None,
    algorithm: str = "auto",
    device: DeviceLike = None,
    out: DeviceArrayLike = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: ArrayLike = None,
    alibi_slopes: ArrayLike = None,
    scale: float | None = None,
    return_lse: Literal[False] = False,
    kv_layout: str = "NHD",
) -> np.ndarray | DeviceArray: ...
@overload
def gqa_decode(
    q: ArrayLike,
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    *,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    stream: StreamLike = None,
    algorithm: str = "auto",
    device: DeviceLike = None,
    out: DeviceArrayLike = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: ArrayLike = None,
    alibi_slopes: ArrayLike = None,
    scale: float | None = None,
    return_lse: Literal[True],
    kv_layout: str = "NHD",
) -> tuple[np.ndarray | DeviceArray, np.ndarray | DeviceArray]: ...
def gqa_decode(
    q: ArrayLike,
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    *,
    n_heads: int | None = None,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    stream: StreamLike = None,
    algorithm: str = "auto",
    device: DeviceLike = None,
    out: DeviceArrayLike = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: ArrayLike = None,
    alibi_slopes: ArrayLike = None,
    scale: float | None = None,
    return_lse: bool = False,
    kv_layout: str = "NHD",
) -> np.ndarray | DeviceArray | tuple[np.ndarray | DeviceArray, np.ndarray | DeviceArray]:
    """Attention of one query token over a KV cache, on the GPU (ferrox-cuda's
    ``launch_gqa_decode``), with the features real models use.

    Args:
        q: ``(n_heads*head_dim,)``, ``(n_heads, head_dim)`` or PyTorch SDPA's one token of
            a batch of one, ``(1, n_heads, 1, head_dim)``; the result has q's shape.
        k_cache: ``(seq_len*n_kv_heads*head_dim,)`` or ``(seq_len, n_kv_heads, head_dim)``,
            layout ``[token][kv_head][head_dim]``.
        v_cache: like ``k_cache``.
        n_heads: query heads, a multiple of ``n_kv_heads``. Optional where the shapes say
            it (q shaped, or flat with head_dim known), as are ``n_kv_heads`` and
            ``head_dim`` (K shaped); given, each is checked against the shapes.
        n_kv_heads: KV heads (needed with a flat ``k_cache``).
        head_dim: elements per head, 1 to 256 (needed with flat ``k_cache`` and ``q``).
        stream: where the work runs: a ferrox Stream, a PyTorch/CuPy/cuda.core stream (any
            ``__cuda_stream__`` object), an int handle, or None: with PyTorch tensors,
            PyTorch's current stream on their device (``torch.cuda.current_stream``, so a
            call inside ``with torch.cuda.stream(s)`` or a ``torch.cuda.graph`` capture
            runs on ``s``), otherwise the legacy default stream.
        algorithm: ``"auto"``/``"split"`` (split-KV kernels; tensor cores where they pay)
            or ``"parity"`` (ferrox-cuda's algorithm, corrected; slow, the reference path).
        device: the device for numpy inputs (a Device, an int, a ``torch.device`` or
            ``"cuda:N"``; default: device 0); with device arrays, it must be theirs.
        out: with device inputs, a device array of q's size and dtype to write into
            (default: a block of a per-stream pool).
        sliding_window: attend to the last ``sliding_window`` tokens only.
        logits_soft_cap: scores become ``cap * tanh(score / cap)``.
        sinks: one logit per query head (float32) added to the softmax's denominator.
        alibi_slopes: one ALiBi slope per query head (float32).
        scale: the score scale (default ``1/sqrt(head_dim)``).
        return_lse: also return the log-sum-exp of the scores per query head (float32,
            natural log): the result is ``(out, lse)``. The definitions are
            `reference_gqa_decode`'s. Every dtype and head_dim takes every feature.
        kv_layout: ``"NHD"`` (default: ``k_cache`` as above) or ``"HND"``: head-major K and
            V, ``(n_kv_heads, seq_len, head_dim)`` or ``(1, n_kv_heads, seq_len,
            head_dim)`` (PyTorch SDPA's and transformers' layout), each token's row
            contiguous and the KV heads any number of rows apart, so ``cache[:, :, :n]``
            of a larger head-major cache is read in place. Takes every feature.

    Returns:
        With numpy inputs, a numpy array (copied back, complete). With device inputs
            (DeviceArray, PyTorch tensors, CuPy arrays, any ``__dlpack__`` or
            ``__cuda_array_interface__`` object, all three on one device), a DeviceArray
            queued on ``stream`` with no host round trip; ``torch.from_dlpack`` takes it
            without a copy. Shape and dtype are q's. seq_len 0 gives zeros.

    Raises:
        ValueError: bad shapes, layouts, or arrays on different devices.
        TypeError: bad types or dtypes. Both raised before any device work.
    """
    if not (
        sliding_window is None and logits_soft_cap is None and sinks is None
        and alibi_slopes is None and scale is None and return_lse is False
        and type(kv_layout) is str and kv_layout == "NHD"
    ):  # fmt: skip
        return _feature_decode(
            q, k_cache, v_cache, n_heads, n_kv_heads, head_dim, stream, algorithm, device, out,
            dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
                 alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse),
            check_kv_layout(kv_layout),
        )  # fmt: skip
    qr = array_ref(q, "q")
    if qr is not None:
        kr = array_ref(k_cache, "k_cache")
        vr = array_ref(v_cache, "v_cache")
        orf = None if out is None else array_ref(out, "out")
        if kr is not None and vr is not None and (out is None or orf is not None):
            if stream is None and is_torch(q):  # torch's current stream on q's device
                stream = torch_stream(qr[3])
            sid = stream_key(stream)
            key = (
                qr[1], qr[2], qr[3], qr[4], kr[1], kr[2], kr[3], kr[4], vr[1], vr[2], vr[3],
                vr[4], None if orf is None else (orf[1], orf[2], orf[3], orf[4]),
                n_heads, n_kv_heads, head_dim, sid, algorithm, device,
                ((qr[0] | kr[0] | vr[0]) & 15) == 0, attention.OVERRIDES,
            )  # fmt: skip
            try:
                call = _calls.get(key)
            except TypeError:  # an unhashable argument, which the checks name
                call = None
            if call is None:
                with records.lock:
                    call = _prepare_call(
                        key, (qr, kr, vr), orf, n_heads, n_kv_heads, head_dim, stream, sid,
                        algorithm, device,
                    )  # fmt: skip
            else:
                _calls.touch(key)
            return call(qr, kr, vr, orf, out, (q, k_cache, v_cache))
    return _host_decode(q, k_cache, v_cache, n_heads, n_kv_heads, head_dim, stream, algorithm,
                        device, out)  # fmt: skip


def _host_decode(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    n_heads: Any,
    n_kv_heads: Any,
    head_dim: Any,
    stream: Any,
    algorithm: Any,
    device: Any,
    out: Any,
) -> np.ndarray:
    """gqa_decode of numpy arrays (or a mix, which check_decode_args refuses): every
    argument checked first, then copied in, decoded, copied back."""
    spec = check_decode_args(q, k_cache, v_cache, n_heads, n_kv_heads, head_dim)
    algorithm = check_algorithm(algorithm)
    if out is not None:
        raise TypeError("out: only accepted with device inputs; numpy inputs return a new array")
    check_device(device, None)
    stream_key(stream)  # a bad stream is refused before any copy
    if spec.seq_len == 0:
        return np.zeros(spec.q_shape, spec.dtype)
    dev = resolve(device)
    q_d = to_device(q, stream, device=dev)
    k_d = to_device(k_cache, stream, device=dev)
    v_d = to_device(v_cache, stream, device=dev)
    out_d = empty(spec.q_shape, spec.dtype, device=dev)
    try:
        launch_decode(
            q_d, k_d, v_d, out_d, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads,
            head_dim=spec.head_dim, seq_len=spec.seq_len, stream=stream, algorithm=algorithm,
        )  # fmt: skip
        return out_d.to_host(stream)  # waits for the work
    except BaseException:
        with contextlib.suppress(Exception):  # what was queued must end before the frees
            stream_sync_raw(stream_handle(stream))
        raise
    finally:
        for a in (q_d, k_d, v_d, out_d):
            a.close()


def _per_head_device(value: Any, dev: Device, sid: int, role: str, stream: Any) -> Any:
    """A per-head float32 feature array on the device: a device array as given, a host
    one copied into this stream's buffer for ``role``."""
    if value is None or not isinstance(value, np.ndarray):
        if value is None:
            return None
        ref = array_ref(value, role)
        assert ref is not None
        return DeviceArray._wrap(ref[0], ref[1], ref[2], dev, None)
    buf = stream_buffer(dev, sid, role, value.size)
    buf.copy_from_host(np.ascontiguousarray(value, np.float32).reshape(-1), stream)
    return buf


def _checked_out(out: Any, spec: DecodeSpec, ordinal: int) -> ArrayRef:
    """A feature decode's ``out``: q's size and dtype, contiguous, on q's device."""
    ref = array_ref(out, "out")
    n = math.prod(spec.q_shape)
    if ref is None or ref[2] != spec.dtype or math.prod(ref[1]) != n or not ref[4]:
        got = "a numpy array" if ref is None else f"shape {ref[1]} of {ref[2]}"
        raise ValueError(f"out: expected {n} contiguous elements of {spec.dtype}, got {got}")
    if ref[3] != ordinal:
        raise ValueError(f"out: on device {ref[3]}, but q is on device {ordinal}")
    return ref


def _feature_decode(
    q: Any, k_cache: Any, v_cache: Any, n_heads: Any, n_kv_heads: Any, head_dim: Any,
    stream: Any, algorithm: Any, device: Any, out: Any, kw: dict[str, Any],
    kv_layout: str = "NHD",
) -> Any:  # fmt: skip
    """gqa_decode with features or head-major K and V: every argument checked first
    (features.check_features), then one split decode with them compiled in
    (attention.plan's features; a head-major cache is one more bit), numpy in and out or
    device arrays in and out."""
    head_stride = 0
    if kv_layout == "HND":
        spec, head_stride = check_head_major_args(
            q, k_cache, v_cache, n_heads, n_kv_heads, head_dim
        )
        if not spec.on_device:  # copied in anyway: whole heads, contiguous
            k_cache, v_cache = np.ascontiguousarray(k_cache), np.ascontiguousarray(v_cache)
            head_stride = spec.seq_len * spec.head_dim
    else:
        spec = check_decode_args(q, k_cache, v_cache, n_heads, n_kv_heads, head_dim)
    feats = check_features(spec.n_heads, **kw)
    if check_algorithm(algorithm) == "parity":
        raise ValueError(
            "algorithm: the features and head-major caches need the split kernels ('auto' or "
            "'split')"
        )
    on_device = spec.on_device
    if not on_device and out is not None:
        raise TypeError("out: only accepted with device inputs; numpy inputs return a new array")
    refs = []
    if on_device:
        refs = [array_ref(a, n) for a, n in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"))]
        ordinal = refs[0][3] if refs[0] else 0
        if any(r is None or r[3] != ordinal for r in refs):
            raise ValueError("q, k_cache, v_cache: pass all three on one device")
        out_ref = None if out is None else _checked_out(out, spec, ordinal)
        check_device(device, ordinal)
        if stream is None and is_torch(q):  # torch's current stream on q's device
            stream = torch_stream(ordinal)
    else:
        check_device(device, None)
    sid = stream_key(stream)
    dev = resolve(device) if not on_device else None
    arrays: list[DeviceArray] = []  # what this call made for numpy inputs (freed at the end)
    if on_device:
        dev = device_for(ordinal)
        q_d, k_d, v_d = (DeviceArray._wrap(r[0], r[1], r[2], dev, None) for r in refs if r)
        if out is None:
            out_d = empty(spec.q_shape, spec.dtype, device=dev)
        else:
            assert out_ref is not None
            out_d = DeviceArray._wrap(out_ref[0], spec.q_shape, spec.dtype, dev, out)
    else:
        assert dev is not None
        q_d, k_d, v_d = (to_device(a, stream, device=dev) for a in (q, k_cache, v_cache))
        out_d = empty(spec.q_shape, spec.dtype, device=dev)
        arrays += [q_d, k_d, v_d, out_d]
    lse_d = empty((spec.n_heads,), np.float32, device=dev) if feats.return_lse else None
    seq = spec.seq_len
    bits = abi.feature_bits_of(feats) | (abi.F_HND if kv_layout == "HND" else 0)
    plan_seq = seq if feats.sliding_window is None else min(seq, feats.sliding_window)
    heads_at = head_stride * spec.dtype.itemsize  # (16-byte loads need whole heads aligned)
    aligned = ((q_d.ptr | k_d.ptr | v_d.ptr | heads_at) & 15) == 0
    try:
        _, args = abi.feature_args(
            feats, spec.head_dim, lse=lse_d,
            slopes=_per_head_device(feats.alibi_slopes, dev, sid, "alibi_slopes", stream),
            sinks=_per_head_device(feats.sinks, dev, sid, "sinks", stream),
        )  # fmt: skip
        launches, _ = launches_for(
            q_d, k_d, v_d, out_d, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads,
            head_dim=spec.head_dim, seq_len=seq, plan_seq=max(plan_seq, 1), aligned=aligned,
            bits=bits, features=dataclasses.replace(args, head_stride=head_stride),
            workspace=lambda floats: stream_buffer(dev, sid, "workspace", floats),
        )  # fmt: skip
        for launch in launches:
            launch.run(stream, dev)
        if on_device:
            return (out_d, lse_d) if feats.return_lse else out_d
        host = out_d.to_host(stream)  # waits for the work
        return (host, lse_d.to_host(stream)) if lse_d is not None else host
    except BaseException:
        with contextlib.suppress(Exception):  # what was queued must end before the frees
            stream_sync_raw(stream_handle(stream))
        raise
    finally:
        for a in arrays:
            a.close()
        if lse_d is not None and not on_device:
            lse_d.close()
