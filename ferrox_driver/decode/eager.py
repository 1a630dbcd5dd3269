"""``gqa_decode``: the eager decode call path.

Launch records (`records.DecodeRecord`) are made once per signature (device, dtype, shape,
length bucket, alignment, stream, overrides, features). ``gqa_decode`` on device arrays
keeps, per call signature (the arrays' shapes with the length replaced by its bucket,
`records.length_bound`; dtypes, devices, the stream, ``out``, the features), the validated
call itself, so a repeated call, or one over a cache grown by a token, does no checking,
planning, allocation or parsing: it reads the arrays' pointers and the length, takes its
outputs from per-stream pools and launches. Every length of a bucket shares one record (the
store keeps at most MAX_RECORDS), and the records of a stream share their scratch, one
buffer per power-of-two size (`records.shared_scratch`), so device memory follows the
scratch sizes in use, never the number of lengths or buckets. A head-major K's head stride
is written per call too (a role, as the length): a view of a larger cache keys its strides,
which stay; a contiguous ``(n_kv_heads, n, head_dim)`` array's stride is n * head_dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
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
    MAX_TOKENS,
    ArrayInfo,
    DecodeSpec,
    _element_strides,
    check_decode_args,
    check_decode_infos,
    check_head_major_args,
    check_kv_layout,
)
from .features import Features, check_features
from .launches import plan_split
from .plan import check_algorithm
from .records import DecodeRecord, decode_record, launch_decode, launches_for, length_bound
from .values import takes_own_width, values_decode
from .verify import is_many_queries, verify_decode

__all__ = ["gqa_decode"]

MAX_CALLS = 256  # validated gqa_decode call signatures kept (LRU)
_F32 = np.dtype(np.float32)


def _result(
    pool: OutputPool, shape: tuple[int, ...], dtype: np.dtype, device: Device,
    out: ArrayRef | None, obj: Any, theirs: bool,
) -> DeviceArray:  # fmt: skip
    """A call's output array: a block of ``pool`` (``out`` None; never handed out again
    when a foreign graph writes it), or a DeviceArray over ``out`` (``obj``)."""
    if out is None:
        return pool.take(shape, dtype, keep=not theirs)
    if type(obj) is DeviceArray:  # a view of it: closing it closes the result
        arr = DeviceArray._wrap(out[0], out[1], out[2], device, None)
        arr._parent = obj if obj._parent is None else obj._parent
        return arr
    return DeviceArray._wrap(out[0], out[1], out[2], device, obj if out[5] is None else out[5])


class _Call:
    """A validated gqa_decode signature on device arrays: its record, its output's shape,
    dtype and pool, and whether its stream must be asked about captures. ``seq_len``: the
    length of a flat K (keyed exactly); a shaped K's length is the call's."""

    __slots__ = ("device", "dtype", "foreign", "plan", "plan_for", "pool", "record", "seq_len",
                 "shape", "sid")  # fmt: skip

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
        self.plan: Any = None  # (see _sibling)
        self.plan_for: Callable[[int], Any] | None = None

    def __call__(
        self,
        q: ArrayRef,
        k: ArrayRef,
        v: ArrayRef,
        out: ArrayRef | None,
        obj: Any,
        inputs: tuple[Any, Any, Any],
        n: int,
    ) -> DeviceArray:
        record = self.record
        self.device.activate()  # this thread's context current before any driver call
        ours = getattr(capture_state, "depth", 0)  # a ferrox capture on this thread
        theirs = not ours and self.foreign and stream_capturing(self.sid)
        arr = _result(self.pool, self.shape, self.dtype, self.device, out, obj, theirs)
        if ours or theirs:  # the graph holds what it reads and writes
            owners = [i if r[5] is None else r[5] for r, i in zip((q, k, v), inputs, strict=True)]
            keep_for_capture(self.sid, self.foreign, record, arr, *owners)
            record.captured = True
        record.run((q[0], k[0], v[0], arr._ptr, self.seq_len if n < 0 else n))
        return arr


_calls = records.Kept(MAX_CALLS)  # validated calls, by signature
# the features of a head-major decode without any (read, never written)
_PLAIN: dict[str, Any] = dict(sliding_window=None, logits_soft_cap=None, sinks=None,
                              alibi_slopes=None, scale=None, return_lse=False)  # fmt: skip
# a shaped K's call by its signature less the length's bucket (`_family`): the call of the
# bucket made last, whose plan a new bucket of the same plan shares
_families = records.Kept(MAX_CALLS)


def _family(key: tuple[Any, ...], at: int, length_at: int) -> tuple[Any, ...]:
    """``key`` with the K shape at ``key[at]`` less its length's bucket (at ``length_at``)."""
    shape = key[at]
    return (*key[:at], (*shape[:length_at], *shape[length_at + 1 :]), *key[at + 1 :])


def _sibling(family: tuple[Any, ...], n: int) -> Any:
    """The call of ``family`` whose record serves length ``n`` too (the plan for n's bucket
    is its plan: a new bucket needs no checks, record or call of its own), or None."""
    call = _families.get(family)
    if (
        call is None or call.plan_for is None or n > MAX_TOKENS
        or call.plan_for(length_bound(n)) != call.plan
    ):  # fmt: skip
        return None
    return call


def _planner(dev: Device, spec: DecodeSpec, aligned: bool, bits: int = 0,
             window: int | None = None) -> Callable[[int], Any]:  # fmt: skip
    """The plan a shaped K's record takes for a length bucket's bound (what
    records.decode_record and feature_record key their records by)."""

    def plan_for(bound: int) -> Any:
        seq = max(1, bound if window is None else min(bound, window))
        return plan_split(dev, spec.dtype, spec.n_heads, spec.n_kv_heads, spec.head_dim, seq,
                          aligned, bits)  # fmt: skip

    return plan_for


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
    shaped = len(refs[1][1]) == 3  # (a flat K is keyed by its exact length)
    plan_seq = length_bound(spec.seq_len) if shaped else spec.seq_len
    record = decode_record(
        qv, kv, vv, out_view, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads,
        head_dim=spec.head_dim, seq_len=spec.seq_len, stream=stream, algorithm=algorithm,
        plan_seq=plan_seq,
    )  # fmt: skip
    nbytes = math.prod(spec.q_shape) * spec.dtype.itemsize
    foreign = sid != 0 and not isinstance(stream, Stream)
    call = _calls.keep(key, _Call(record, spec, dev, sid, foreign, output_pool(dev, sid, nbytes)))
    if shaped and algorithm != "parity":
        aligned = ((qv.ptr | kv.ptr | vv.ptr) & 15) == 0
        call.plan_for = _planner(dev, spec, aligned)
        call.plan = call.plan_for(plan_seq)  # (its record's plan)
        _families.keep(_family(key, 4, 0), call)
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
    tree_mask: ArrayLike = None,
    head_dim_v: int | None = None,
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
    tree_mask: ArrayLike = None,
    head_dim_v: int | None = None,
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
    tree_mask: ArrayLike = None,
    head_dim_v: int | None = None,
) -> np.ndarray | DeviceArray | tuple[np.ndarray | DeviceArray, np.ndarray | DeviceArray]:
    """Attention of one query token (or of several: a speculative verify) over a KV cache,
    on the GPU (ferrox-cuda's ``launch_gqa_decode``), with the features real models use.

    Args:
        q: ``(n_heads*head_dim,)``, ``(n_heads, head_dim)`` or PyTorch SDPA's one token of
            a batch of one, ``(1, n_heads, 1, head_dim)``; the result has q's shape. Or
            ``(n_q, n_heads, head_dim)``: n_q query tokens, the cache's last n_q (append
            their K and V first): query t, at position ``seq_len - n_q + t``, sees the
            tokens up to its own (causal) or, with ``tree_mask``, every earlier token and
            the new ones its row of the mask names; windows and ALiBi are relative to each
            query's own position. The result is ``(n_q, n_heads, head_dim)``, the LSE
            ``(n_q, n_heads)``; one pass over the cache serves every query.
        k_cache: ``(seq_len*n_kv_heads*head_dim,)`` or ``(seq_len, n_kv_heads, head_dim)``,
            layout ``[token][kv_head][head_dim]``. On the device, ``cache[:n]`` of a
            larger cache is read in place; a cache growing by a token per call costs what
            a repeated call does (calls of nearby lengths share one plan).
        v_cache: like ``k_cache``.
        n_heads: query heads, a multiple of ``n_kv_heads``. Optional where the shapes say
            it (q shaped, or flat with head_dim known), as are ``n_kv_heads`` and
            ``head_dim`` (K shaped); given, each is checked against the shapes.
        n_kv_heads: KV heads (needed with a flat ``k_cache``).
        head_dim: elements per head, 1 to 512 (needed with flat ``k_cache`` and ``q``; past
            256 on CUDA cores).
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
        tree_mask: with an ``(n_q, n_heads, head_dim)`` q: which new tokens each query
            sees, bool ``(n_q, n_q)`` or bit-packed uint8 ``(n_q, ceil(n_q / 8))``
            (``numpy.packbits(mask, axis=1, bitorder="little")``), on the host or the
            device (read there at run time: a captured graph takes a new mask in place).
            The diagonal must be set (checked for a host mask). None: causal.
        head_dim_v: the values' width where it differs from K's head_dim (None: equal):
            ``v_cache`` then has rows of ``head_dim_v`` in K's layout and the result is
            ``q.shape[:-1] + (head_dim_v,)``. On the latent tensor-core kernels: q
            ``(n_heads, head_dim)`` or ``(n_q, n_heads, head_dim)`` (n_q up to 16) of
            float16 or bfloat16, head_dim a multiple of 64 up to 576, head_dim_v a multiple
            of 128 up to 512, shaped K and V (device views with contiguous, 16-byte aligned
            rows read in place); every feature but ALiBi and ``tree_mask``
            (`decode.values.values_decode`).

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
    if head_dim_v is not None and takes_own_width(q, head_dim, head_dim_v):
        return values_decode(
            q, k_cache, v_cache, head_dim_v, n_heads=n_heads, n_kv_heads=n_kv_heads,
            head_dim=head_dim, stream=stream, algorithm=algorithm, device=device, out=out,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
            alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse,
            kv_layout=kv_layout, tree_mask=tree_mask,
        )  # fmt: skip
    if tree_mask is not None:
        return _many(q, k_cache, v_cache, n_heads, n_kv_heads, head_dim, stream, algorithm,
                     device, out, sliding_window, logits_soft_cap, sinks, alibi_slopes, scale,
                     return_lse, kv_layout, tree_mask)  # fmt: skip
    plain = (
        sliding_window is None and logits_soft_cap is None and sinks is None
        and alibi_slopes is None and scale is None and return_lse is False
    )  # fmt: skip
    if plain and kv_layout == "HND" and type(kv_layout) is str:  # (a transformers cache's)
        dims = (n_heads, n_kv_heads, head_dim, algorithm, device)
        try:
            sig = _plain_head_major_signature(q, k_cache, v_cache, out, dims, stream)
            call = None if sig is None else _calls.get(sig[0])
        except Exception:  # (anything the checks refuse: they name it)
            sig = call = None
        if sig is not None and call is not None:
            _calls.touch(sig[0])
            return call(sig, out, (q, k_cache, v_cache, None, None))
        return _feature_decode(q, k_cache, v_cache, n_heads, n_kv_heads, head_dim, stream,
                               algorithm, device, out, _PLAIN, "HND")  # fmt: skip
    if not (plain and type(kv_layout) is str and kv_layout == "NHD"):
        return _feature_decode(
            q, k_cache, v_cache, n_heads, n_kv_heads, head_dim, stream, algorithm, device, out,
            dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
                 alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse),
            "HND" if type(kv_layout) is str and kv_layout == "HND" else check_kv_layout(kv_layout),
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
            ks = kr[1]
            if len(ks) == 3:  # (seq_len, n_kv_heads, head_dim): keyed by the length's bucket
                n = ks[0]
                kshape: Any = (length_bound(n), ks[1], ks[2])
            else:  # flat: keyed exactly (its length needs the validated dims)
                n, kshape = -1, ks
            key = (
                qr[1], qr[2], qr[3], qr[4], kshape, kr[2], kr[3], kr[4], vr[2], vr[3], vr[4],
                None if orf is None else (orf[1], orf[2], orf[3], orf[4]),
                n_heads, n_kv_heads, head_dim, sid, algorithm, device,
                ((qr[0] | kr[0] | vr[0]) & 15) == 0, attention.OVERRIDES,
            )  # fmt: skip
            try:
                call = _calls.get(key)
            except TypeError:  # an unhashable argument, which the checks name (no sibling)
                call, n = None, -1
            if call is None or vr[1] != ks:  # (V's shape differing: the checks name it)
                if is_many_queries(qr[1]):
                    return _many(q, k_cache, v_cache, n_heads, n_kv_heads, head_dim, stream,
                                 algorithm, device, out, sliding_window, logits_soft_cap, sinks,
                                 alibi_slopes, scale, return_lse, kv_layout, None)  # fmt: skip
                with records.lock:
                    call = None if n < 0 or vr[1] != ks else _sibling(_family(key, 4, 0), n)
                    if call is None:
                        call = _prepare_call(
                            key, (qr, kr, vr), orf, n_heads, n_kv_heads, head_dim, stream, sid,
                            algorithm, device,
                        )  # fmt: skip
                    else:
                        _calls.keep(key, call)
            else:
                _calls.touch(key)
            return call(qr, kr, vr, orf, out, (q, k_cache, v_cache), n)
    if isinstance(q, np.ndarray) and is_many_queries(q.shape):
        return _many(q, k_cache, v_cache, n_heads, n_kv_heads, head_dim, stream, algorithm,
                     device, out, sliding_window, logits_soft_cap, sinks, alibi_slopes, scale,
                     return_lse, kv_layout, None)  # fmt: skip
    return _host_decode(q, k_cache, v_cache, n_heads, n_kv_heads, head_dim, stream, algorithm,
                        device, out)  # fmt: skip


def _many(
    q: Any, k: Any, v: Any, n_heads: Any, n_kv_heads: Any, head_dim: Any, stream: Any,
    algorithm: Any, device: Any, out: Any, window: Any, cap: Any, sinks: Any, slopes: Any,
    scale: Any, lse: Any, layout: Any, tree_mask: Any,
) -> Any:  # fmt: skip
    """gqa_decode of several query tokens (`verify.verify_decode`)."""
    kw = dict(sliding_window=window, logits_soft_cap=cap, sinks=sinks, alibi_slopes=slopes,
              scale=scale, return_lse=lse)  # fmt: skip
    lay = "HND" if type(layout) is str and layout == "HND" else check_kv_layout(layout)
    return verify_decode(q, k, v, n_heads, n_kv_heads, head_dim, stream, algorithm, device, out,
                         kw, lay, tree_mask)  # fmt: skip


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


class _FeatureCall:
    """A validated gqa_decode signature with features or a head-major cache: its record
    (FEATURE_ROLES), its outputs' pools (the result's and, with ``return_lse``, the LSE's),
    and for a flat K (keyed exactly) its length and head stride."""

    __slots__ = ("device", "dtype", "foreign", "head_stride", "lse_pool", "n_heads", "plan",
                 "plan_for", "pool", "record", "seq_len", "shape", "sid")  # fmt: skip

    def __init__(
        self,
        record: DecodeRecord,
        spec: DecodeSpec,
        head_stride: int,
        device: Device,
        sid: int,
        foreign: bool,
        lse: bool,
    ) -> None:
        self.record, self.device, self.sid, self.foreign = record, device, sid, foreign
        self.shape, self.dtype, self.n_heads = spec.q_shape, spec.dtype, spec.n_heads
        self.seq_len, self.head_stride = spec.seq_len, head_stride
        self.pool = output_pool(device, sid, math.prod(spec.q_shape) * spec.dtype.itemsize)
        self.lse_pool = output_pool(device, sid, 4 * spec.n_heads) if lse else None
        self.plan: Any = None  # (see _sibling)
        self.plan_for: Callable[[int], Any] | None = None

    def __call__(self, sig: tuple[Any, ...], obj: Any, inputs: tuple[Any, ...]) -> Any:
        _, q, k, v, out, sinks, slopes, n, heads, _, _ = sig
        record = self.record
        self.device.activate()  # this thread's context current before any driver call
        ours = getattr(capture_state, "depth", 0)  # a ferrox capture on this thread
        theirs = not ours and self.foreign and stream_capturing(self.sid)
        if out is None:
            arr = self.pool.take(self.shape, self.dtype, keep=not theirs)
        else:
            arr = _result(self.pool, self.shape, self.dtype, self.device, out, obj, theirs)
        lse_pool = self.lse_pool
        lse = None if lse_pool is None else lse_pool.take((self.n_heads,), _F32, keep=not theirs)
        if ours or theirs:  # the graph holds what it reads and writes
            owners = [
                i if r[5] is None else r[5]
                for r, i in zip((q, k, v, sinks, slopes), inputs, strict=True) if r is not None
            ]  # fmt: skip
            made = [arr] if lse is None else [arr, lse]
            keep_for_capture(self.sid, self.foreign, record, *made, *owners)
            record.captured = True
        if n < 0:
            n, heads = self.seq_len, self.head_stride
        record.run((
            q[0], k[0], v[0], arr._ptr, n, 0 if slopes is None else slopes[0],
            0 if sinks is None else sinks[0], 0 if lse is None else lse._ptr, heads,
        ))  # fmt: skip
        return arr if lse is None else (arr, lse)


def _view_heads(k: Any, v: Any, kr: ArrayRef, vr: ArrayRef) -> tuple[Any, int] | None:
    """A head-major view's strides and head stride (elements from one KV head's rows to
    the next's), or None where the checks are to decide: strides that are not whole rows,
    V's unlike K's, heads that would overlap."""
    ks = kr[1]
    n, hd = ks[-2], ks[-1]
    torch = is_torch(k)  # (a tensor's own strides: one C call; V not one: refused)
    strides = k.stride() if torch else _element_strides(k, kr[2].itemsize)
    if (
        strides is None or len(strides) != len(ks) or strides[-2] != hd
        or (hd > 1 and strides[-1] != 1) or not 0 <= strides[-3] < 2**40
        or (v.stride() if torch else _element_strides(v, vr[2].itemsize)) != strides
    ):  # fmt: skip
        return None
    heads = n * hd
    if ks[-3] > 1:
        heads = strides[-3]
        if heads < n * hd:  # overlapping heads: the checks refuse them
            return None
    return strides, heads


def _feature_signature(
    q: Any, k: Any, v: Any, out: Any, dims: tuple[Any, ...], stream: Any, kw: dict[str, Any],
    layout: str,
) -> tuple[Any, ...] | None:  # fmt: skip
    """What identifies a feature or head-major decode of device arrays among the calls
    remembered (``dims``: n_heads, n_kv_heads, head_dim, algorithm and device as given; the
    arrays' shapes with the length replaced by its bucket, their dtypes, devices and
    layouts, the features' values and types, the stream, the alignment), with what the call
    writes: ``(key, q, k, v, out, sinks, slopes (refs or None), length, head stride, stream,
    stream id)``. None where the call is not one to remember (numpy arrays, host feature
    arrays, views the checks would refuse or that need them each call); raises on anything
    the checks refuse, which they then name."""
    qr = array_ref(q, "q")
    if qr is None:
        return None
    kr, vr = array_ref(k, "k_cache"), array_ref(v, "v_cache")
    if kr is None or vr is None:
        return None
    orf = None if out is None else array_ref(out, "out")
    if out is not None and orf is None:
        return None
    sinks, slopes = kw["sinks"], kw["alibi_slopes"]
    sr = None if sinks is None else array_ref(sinks, "sinks")
    ar = None if slopes is None else array_ref(slopes, "alibi_slopes")
    if (sinks is not None and sr is None) or (slopes is not None and ar is None):
        return None  # host arrays: copied in at every call
    if stream is None and is_torch(q):  # torch's current stream on q's device
        stream = torch_stream(qr[3])
    sid = stream_key(stream)
    ks = kr[1]
    if vr[1] != ks or kr[4] != vr[4]:
        return None
    strides = None
    kshape: tuple[int, ...]
    if len(ks) == 1:  # flat: keyed exactly (its length needs the validated dims)
        n, kshape, heads = -1, ks, 0
    elif layout == "NHD":
        n, heads = ks[0], 0
        kshape = (length_bound(n), *ks[1:])
    else:  # ([1,] n_kv_heads, seq_len, head_dim)
        n, hd = ks[-2], ks[-1]
        kshape = (ks[0], length_bound(n), hd) if len(ks) == 3 else (*ks[:-2], length_bound(n), hd)
        heads = n * hd  # contiguous: each KV head's n rows follow the last's
        if not kr[4]:  # a view of the first tokens of a larger cache (its heads stay apart)
            found = _view_heads(k, v, kr, vr)
            if found is None:
                return None
            strides, heads = found
    aligned = ((qr[0] | kr[0] | vr[0] | heads * kr[2].itemsize) & 15) == 0
    window, cap, scale, lse = (kw["sliding_window"], kw["logits_soft_cap"], kw["scale"],
                               kw["return_lse"])  # fmt: skip
    scalars = None  # (a head-major decode without them: a shorter key)
    if not (window is None and cap is None and scale is None and lse is False):
        scalars = (type(window), window, type(cap), cap, type(scale), scale, type(lse), lse)
    key = (
        *dims, layout, qr[1], qr[2], qr[3], qr[4], kshape, kr[2], kr[3], kr[4], strides, vr[2],
        vr[3], None if orf is None else (orf[1], orf[2], orf[3], orf[4]),
        None if sr is None else (sr[1], sr[2], sr[3], sr[4]),
        None if ar is None else (ar[1], ar[2], ar[3], ar[4]), scalars, sid, aligned,
        attention.OVERRIDES,
    )  # fmt: skip
    return key, qr, kr, vr, orf, sr, ar, n, heads, stream, sid


def _plain_head_major_signature(
    q: Any, k: Any, v: Any, out: Any, dims: tuple[Any, ...], stream: Any
) -> tuple[Any, ...] | None:
    """`_feature_signature` of a head-major decode without features, for a shaped K
    (``([1,] n_kv_heads, seq_len, head_dim)``): the same signature, key included, made with
    less work (a growing transformers or user cache's every call). None where the general
    one is to decide (flat arrays, numpy, views it might refuse)."""
    qr, kr, vr = array_ref(q, "q"), array_ref(k, "k_cache"), array_ref(v, "v_cache")
    if qr is None or kr is None or vr is None:
        return None
    orf = None
    if out is not None:
        orf = array_ref(out, "out")
        if orf is None:
            return None
    ks = kr[1]
    if vr[1] != ks or kr[4] != vr[4] or len(ks) < 3:
        return None
    if stream is None and is_torch(q):  # torch's current stream on q's device
        stream = torch_stream(qr[3])
    sid = stream_key(stream)
    n, hd = ks[-2], ks[-1]
    bound = length_bound(n)
    kshape = (ks[0], bound, hd) if len(ks) == 3 else (*ks[:-2], bound, hd)
    heads, strides = n * hd, None
    if not kr[4]:  # a view of the first tokens of a larger cache
        found = _view_heads(k, v, kr, vr)
        if found is None:
            return None
        strides, heads = found
    aligned = ((qr[0] | kr[0] | vr[0] | heads * kr[2].itemsize) & 15) == 0
    key = (
        *dims, "HND", qr[1], qr[2], qr[3], qr[4], kshape, kr[2], kr[3], kr[4], strides, vr[2],
        vr[3], None if orf is None else (orf[1], orf[2], orf[3], orf[4]), None, None, None,
        sid, aligned, attention.OVERRIDES,
    )  # fmt: skip
    return key, qr, kr, vr, orf, None, None, n, heads, stream, sid


def _feature_call(
    sig: tuple[Any, ...], spec: DecodeSpec, feats: Features, head_stride: int, layout: str,
    dev: Device,
) -> _FeatureCall:  # fmt: skip
    """The call of a validated signature: its record planned for the length's bucket (at
    most the window)."""
    _, qr, kr, vr, orf, _, _, n, _, stream, sid = sig
    bound = length_bound(spec.seq_len) if n >= 0 else spec.seq_len
    window = feats.sliding_window
    plan_seq = max(1, bound if window is None else min(bound, window))
    bits = abi.feature_bits_of(feats) | (abi.F_HND if layout == "HND" else 0)
    _, values = abi.feature_args(feats, spec.head_dim)
    heads_at = head_stride * spec.dtype.itemsize  # (16-byte loads need whole heads aligned)
    aligned = ((qr[0] | kr[0] | vr[0] | heads_at) & 15) == 0
    wrap = DeviceArray._wrap
    record = records.feature_record(
        wrap(qr[0], qr[1], qr[2], dev, None), wrap(kr[0], kr[1], kr[2], dev, None),
        wrap(vr[0], vr[1], vr[2], dev, None),
        wrap(orf[0] if orf else 0, spec.q_shape, spec.dtype, dev, None),
        n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads, head_dim=spec.head_dim,
        plan_seq=plan_seq, aligned=aligned, bits=bits, values=values, stream=stream,
    )  # fmt: skip
    foreign = sid != 0 and not isinstance(stream, Stream)
    call = _FeatureCall(record, spec, head_stride, dev, sid, foreign, feats.return_lse)
    if n >= 0:
        call.plan_for = _planner(dev, spec, aligned, bits, window)
        call.plan = call.plan_for(bound)
    return call


def _feature_decode(
    q: Any, k_cache: Any, v_cache: Any, n_heads: Any, n_kv_heads: Any, head_dim: Any,
    stream: Any, algorithm: Any, device: Any, out: Any, kw: dict[str, Any],
    kv_layout: str = "NHD",
) -> Any:  # fmt: skip
    """gqa_decode with features or head-major K and V: a call seen before
    (`_feature_signature`) launched with its pointers, length and head stride; a new one
    with every argument checked first (features.check_features), then one split decode with
    them compiled in (attention.plan's features; a head-major cache is one more bit), numpy
    in and out or device arrays in and out; device arrays remembered (`_FeatureCall`), but
    for host per-head arrays, which are copied in at each call."""
    try:
        dims = (n_heads, n_kv_heads, head_dim, algorithm, device)
        sig = _feature_signature(q, k_cache, v_cache, out, dims, stream, kw, kv_layout)
        key = None if sig is None else sig[0]
        call = None if key is None else _calls.get(key)
    except Exception:  # (anything the checks refuse: they name it)
        sig = key = call = None
    inputs = (q, k_cache, v_cache, kw["sinks"], kw["alibi_slopes"])
    if call is not None:
        _calls.touch(key)
        return call(sig, out, inputs)
    shape = sig[1][1] if sig is not None else tuple(getattr(q, "shape", ()) or ())
    if is_many_queries(shape):
        return verify_decode(q, k_cache, v_cache, n_heads, n_kv_heads, head_dim, stream,
                             algorithm, device, out, kw, kv_layout, None)  # fmt: skip
    family = None
    if sig is not None and key is not None and sig[7] >= 0:  # a shaped K: its bucket's plan
        family = _family(key, 10, 0 if kv_layout == "NHD" else len(key[10]) - 2)
        with records.lock:
            call = _sibling(family, sig[7])
            if call is not None:
                return _calls.keep(key, call)(sig, out, inputs)
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
    sid = stream_key(stream) if sig is None else sig[10]  # (the signature's, checked)
    if on_device and sig is not None and key is not None:
        with records.lock:
            call = _calls.keep(key, _feature_call(
                sig, spec, feats, head_stride, kv_layout, device_for(ordinal)
            ))  # fmt: skip
            if family is not None and call.plan_for is not None:
                _families.keep(family, call)
        return call(sig, out, inputs)
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
