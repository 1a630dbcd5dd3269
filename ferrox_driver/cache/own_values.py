"""A KVCache whose V rows are ``head_dim_v`` wide, apart from K's ``head_dim`` (issue 50):
its construction checks, its appends (host rows, device rows) and its decode, through
``gqa_decode(..., head_dim_v=)`` on views of the cache over the host's length.

Kept apart so that a cache of equal widths runs exactly the code it ran before: `KVCache`
branches here only where ``own_v`` is set. The decode reads the length on the host (the
values kernels take it as an argument), so what needs the length on the device (graphs,
``gqa_decode_async``, ``kv_append_async``, ``prepare``) is refused by name (``refuse``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..decode.checks import check_host_extent, check_int
from ..decode.eager import gqa_decode
from ..decode.features import check_features
from ..decode.plan import check_algorithm
from ..decode.values import VALUES_MAX_HEAD_DIM_V
from ..driver.calls import drv
from ..driver.interop import array_ref
from ..driver.memory import DeviceArray, as_dtype, pinned_empty, to_device
from ..driver.stream import call_stream, stream_key
from ..errors import FerroxError, KVCapacityError
from ..kernels.spec import LATENT_MAX_HEAD_DIM
from .four_bit import four_bit_format
from .state import CacheState, capturing

__all__ = ["OwnValues", "check_head_dim_v", "refuse"]

_HALF = ("float16", "bfloat16")


def check_head_dim_v(
    head_dim_v: Any, head_dim: int, dtype: Any, v_dtype: Any, rotate: Any
) -> int | None:
    """``head_dim_v`` where it differs from ``head_dim`` (None: equal, or not given), checked
    with what such a cache holds: float16 or bfloat16 rows, token-major, widths on the
    values kernels' tiles (head_dim a multiple of 64, head_dim_v of 128 up to 512).

    Raises:
        TypeError, ValueError: naming the argument, before any device work.
    """
    if head_dim_v is None:
        return None
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, (int, np.integer)):
        raise TypeError(f"head_dim_v: expected an int or None, got {head_dim_v!r}")
    dv = int(head_dim_v)
    if dv == head_dim:
        return None
    if v_dtype is not None:
        raise ValueError("v_dtype: not with head_dim_v (values of their own width are held "
                         "in K's float16 or bfloat16 dtype)")  # fmt: skip
    if rotate:
        raise ValueError("rotate: not with head_dim_v (only 4-bit caches rotate K)")
    four = four_bit_format(dtype)
    dt = None if four else as_dtype(dtype, "dtype")
    if dt is None or dt.name not in _HALF:
        raise ValueError(
            f"dtype: a cache with head_dim_v holds float16 or bfloat16 rows (its decode runs "
            f"on fp16/bf16 tensor-core kernels; fp8, 4-bit and float32 are not supported), "
            f"got {four or dt}"
        )
    if not (0 < dv <= VALUES_MAX_HEAD_DIM_V and dv % 128 == 0):
        raise ValueError(f"head_dim_v: a multiple of 128 up to {VALUES_MAX_HEAD_DIM_V} "
                         f"(or head_dim's {head_dim}), got {dv}")  # fmt: skip
    if head_dim % 64 or head_dim > LATENT_MAX_HEAD_DIM:
        raise ValueError(f"head_dim: with head_dim_v, a multiple of 64 (the values kernels' "
                         f"tiles), got {head_dim}")  # fmt: skip
    return dv


def refuse(kv: Any, call: str) -> None:
    """Raise for ``call`` on a cache with values of their own width (it reads the length on
    the device, which the values kernels behind such a cache's decode do not yet take)."""
    if getattr(kv, "own_v", None) is not None:
        raise FerroxError(
            f"kv: {call} is not supported on a KVCache with head_dim_v "
            f"({kv.head_dim_v}) apart from head_dim ({kv.head_dim}): it needs the length on "
            f"the device; use kv.append, kv.extend and kv.decode"
        )


def _not_captured(sid: int, call: str) -> None:
    """Raise where work on ``sid`` would be captured into a graph (see ``refuse``)."""
    if capturing(sid):
        raise FerroxError(
            f"stream: KVCache.{call} of a cache with head_dim_v cannot be captured into a "
            f"graph (it reads the length on the host, and such a cache has no graph path)"
        )


class OwnValues:
    """V's side of a cache with values ``head_dim_v`` wide: its row sizes and shapes, and a
    page-locked row per staging slot (K's rows go through the ring as a cache's do; the
    slot's event covers both copies)."""

    def __init__(self, kv: CacheState, head_dim_v: int, slots: int) -> None:
        self.head_dim_v = head_dim_v
        self.row_elems = kv.n_kv_heads * head_dim_v
        self.row_bytes = self.row_elems * kv.dtype.itemsize
        n_kv = kv.n_kv_heads
        self.shapes = ((self.row_elems,), (n_kv, head_dim_v), (1, n_kv, 1, head_dim_v))
        self.stage = pinned_empty((slots, self.row_elems), kv.dtype)
        self.stage_addr = self.stage.ctypes.data

    def check_shape(self, shape: tuple[int, ...], name: str, one: bool) -> None:
        """V rows of one token (``one``) or of n: raise naming ``name`` for other shapes."""
        shape, e, n_kv, dv = tuple(shape), self.row_elems, self.shapes[1][0], self.head_dim_v
        if one and shape not in self.shapes:
            raise ValueError(f"{name}: expected one token's V of shape ({e},), ({n_kv}, {dv}) "
                             f"or (1, {n_kv}, 1, {dv}) (head_dim_v {dv}), got {shape}")  # fmt: skip
        if not one and not (
            (len(shape) == 1 and shape[0] % e == 0)
            or (len(shape) == 2 and shape[1] == e)
            or (len(shape) == 3 and shape[1:] == (n_kv, dv))
        ):
            raise ValueError(f"{name}: expected V tokens of shape (n, {n_kv}, {dv}), (n, {e}) "
                             f"or (n*{e},) (head_dim_v {dv}), got {shape}")  # fmt: skip

    def check_host(self, kv: Any, k: Any, v: Any, names: tuple[str, str], one: bool) -> int:
        """Host rows checked (K as the cache's, V of its own width); their token count."""
        kv._check_rows(k, names[0], one=one)
        if not isinstance(v, np.ndarray):
            raise TypeError(f"{names[1]}: expected a numpy array, got {type(v).__name__}")
        if v.dtype != kv.dtype:
            raise TypeError(f"{names[1]}: expected dtype {kv.dtype} (the cache's), got {v.dtype}")
        self.check_shape(v.shape, names[1], one)
        check_host_extent(v, names[1])
        n, n_v = k.size // kv.row_elems, v.size // self.row_elems
        if n_v != n:
            raise ValueError(f"{names[1]}: expected {n} tokens like {names[0]}, got {n_v}")
        return n

    # -- appends -------------------------------------------------------------------
    def append(self, kv: Any, k: Any, v: Any, one: bool, stream: Any) -> None:
        """``append`` (``one``) or ``extend`` of host or device rows, V's of its own width."""
        names = ("k_tok", "v_tok") if one else ("k_rows", "v_rows")
        if not (isinstance(k, np.ndarray) and isinstance(v, np.ndarray)):
            return self._append_device(kv, k, v, names, one, stream)
        n = self.check_host(kv, k, v, names, one)
        with kv.lock:
            if kv._closed or kv.stream._closed:
                kv.check_open()
            seq = kv._seq_len if kv._host_seq_valid else kv.seq_len
            if seq + n > kv.capacity:
                raise KVCapacityError(seq, kv.capacity, *(() if one else (n,)))
            if n == 0:
                return
            kv.device.activate()
            kb, vb, h = kv.row_bytes, self.row_bytes, kv._h
            if one:  # staged: the copies are queued and the host goes on (as KVCache.append)
                slot = kv._take_slot()
                kv._stage_k[slot] = k.reshape(-1)
                self.stage[slot] = v.reshape(-1)
                drv("cuMemcpyHtoDAsync", kv._k_ptr + seq * kb, kv._stage_k_addr + slot * kb,
                    kb, h)  # fmt: skip
                drv("cuMemcpyHtoDAsync", kv._v_ptr + seq * vb, self.stage_addr + slot * vb,
                    vb, h)  # fmt: skip
                kv._seq_len = seq + 1
                if kv._eager_seq:
                    kv._stage_seq[slot] = seq + 1
                    drv("cuMemcpyHtoDAsync", kv.state.ptr, kv._stage_seq_addr + 4 * slot, 4, h)
                else:
                    kv._device_seq_current = False
                kv._done_slot(slot)
                return
            # from pageable memory (the driver stages the bytes before returning)
            k_src, v_src = np.ascontiguousarray(k), np.ascontiguousarray(v)
            drv("cuMemcpyHtoDAsync", kv._k_ptr + seq * kb, k_src.ctypes.data, n * kb, h)
            drv("cuMemcpyHtoDAsync", kv._v_ptr + seq * vb, v_src.ctypes.data, n * vb, h)
            kv._seq_len = seq + n
            kv._device_seq_current = False
            kv.device_length()  # a prefill is rare: keep the device's copy current

    def _append_device(
        self, kv: Any, k: Any, v: Any, names: tuple[str, str], one: bool, stream: Any
    ) -> None:
        """Device rows: checked, then copied device to device on the cache's stream, joined
        to the caller's (as ``KVCache._extend_device``)."""
        kr, vr = array_ref(k, names[0]), array_ref(v, names[1])
        if kr is None or vr is None:
            raise TypeError(
                f"{names[0]}, {names[1]}: pass both as numpy arrays or both as device arrays"
            )
        for ref, name in ((kr, names[0]), (vr, names[1])):
            _, shape, dt, ordinal, contiguous, _ = ref
            if dt != kv.dtype:
                raise TypeError(f"{name}: expected dtype {kv.dtype} (the cache's), got {dt}")
            if ordinal != kv.device.ordinal:
                raise ValueError(
                    f"{name}: on device {ordinal}, but the cache is on device {kv.device.ordinal}"
                )
            if not contiguous:
                raise ValueError(f"{name}: must be C-contiguous, got a strided view of shape "
                                 f"{tuple(shape)}")  # fmt: skip
        kv._check_row_shape(kr[1], names[0], one)
        self.check_shape(vr[1], names[1], one)
        n, n_v = math.prod(kr[1]) // kv.row_elems, math.prod(vr[1]) // self.row_elems
        if n_v != n:
            raise ValueError(f"{names[1]}: expected {n} tokens like {names[0]}, got {n_v}")
        sid = stream_key(call_stream(stream, k, kr[3]))
        _not_captured(sid, "append" if one else "extend")
        with kv.lock:
            if kv._closed or kv.stream._closed:
                kv.check_open()
            if kv._host_seq_valid and kv._seq_len + n > kv.capacity:  # (no join)
                raise KVCapacityError(kv._seq_len, kv.capacity, *(() if one else (n,)))
            kv.device.activate()
            joined = kv.join(sid, "append" if one else "extend", "kv_append_async")
            try:
                seq = kv._seq_len if kv._host_seq_valid else kv.seq_len
                if seq + n > kv.capacity:
                    raise KVCapacityError(seq, kv.capacity, *(() if one else (n,)))
                if n == 0:
                    return
                kb, vb = kv.row_bytes, self.row_bytes
                drv("cuMemcpyDtoDAsync", kv._k_ptr + seq * kb, kr[0], n * kb, kv._h)
                drv("cuMemcpyDtoDAsync", kv._v_ptr + seq * vb, vr[0], n * vb, kv._h)
                kv._seq_len = seq + n
                kv._device_seq_current = False
                if kv._eager_seq or not one:
                    kv.device_length()
            finally:
                if joined:
                    kv.rejoin(sid)

    # -- decode --------------------------------------------------------------------
    def decode(
        self, kv: Any, q: Any, n_heads: Any, stream: Any, algorithm: Any,
        features: dict[str, Any], tree_mask: Any,
    ) -> Any:  # fmt: skip
        """``KVCache.decode`` of a cache with values of their own width: q checked, then
        ``gqa_decode(..., head_dim_v=)`` over the cache's first ``seq_len`` tokens (the
        host's length) on the cache's stream; the result ``q.shape[:-1] + (head_dim_v,)``
        (flat q: ``(n_heads*head_dim_v,)``)."""
        if tree_mask is not None:
            raise ValueError("tree_mask: not with head_dim_v (its kernels are causal only)")
        if features["alibi_slopes"] is not None:
            raise ValueError("alibi_slopes: not with head_dim_v (its kernels have no ALiBi)")
        if check_algorithm(algorithm) == "parity":
            raise ValueError("algorithm: head_dim_v runs on the split kernels ('auto')")
        host = isinstance(q, np.ndarray)
        ref = None if host else array_ref(q, "q")
        if not host and ref is None:
            raise TypeError(f"q: expected a numpy or device array, got {type(q).__name__}")
        shape, dt = (tuple(q.shape), q.dtype) if ref is None else (tuple(ref[1]), ref[2])
        if dt != kv.dtype:
            raise TypeError(f"q: expected dtype {kv.dtype} (the cache's), got {dt}")
        d, dv = kv.head_dim, self.head_dim_v
        size = math.prod(shape)
        if len(shape) == 1 and shape[0] % d == 0 and size:
            heads: tuple[int, ...] = (size // d, d)
        elif (len(shape) == 2 and shape[1] == d) or (len(shape) == 3 and shape[2] == d):
            heads = shape
        elif len(shape) == 4 and shape[0] == shape[2] == 1 and shape[3] == d:
            heads = (shape[1], d)
        else:
            raise ValueError(f"q: expected (n_heads*{d},), (n_heads, {d}), (1, n_heads, 1, "
                             f"{d}) or (n_q, n_heads, {d}), got {shape}")  # fmt: skip
        h = heads[-2]
        if n_heads is not None and check_int(n_heads, "n_heads", 1) != h:
            raise ValueError(f"n_heads: {n_heads} given, but q's shape {shape} says {h}")
        if h % kv.n_kv_heads:
            raise ValueError(f"n_heads: {h} query heads are not groups of the cache's "
                             f"{kv.n_kv_heads} KV heads")  # fmt: skip
        check_features(h, **{k: v for k, v in features.items() if k != "alibi_slopes"})
        out_shape = (h * dv,) if len(shape) == 1 else (*shape[:-1], dv)
        kw = dict(n_heads=h, n_kv_heads=kv.n_kv_heads, head_dim=d, head_dim_v=dv,
                  algorithm=algorithm, **features)  # fmt: skip
        with kv.lock:  # (the length and the stream's work: one decode at a time)
            if kv._closed or kv.stream._closed:
                kv.check_open()
            seq = kv.seq_len  # (after device-side changes: waits, reads the device's)
            if host:
                check_host_extent(q, "q")
                return self._decode_host(kv, q.reshape(heads), seq, out_shape, kw)
            assert ref is not None
            if ref[3] != kv.device.ordinal:
                raise ValueError(
                    f"q: on device {ref[3]}, but the cache is on device {kv.device.ordinal}"
                )
            if not ref[4]:
                raise ValueError(f"q: must be C-contiguous, got a strided view of shape {shape}")
            sid = stream_key(call_stream(stream, q, ref[3]))
            _not_captured(sid, "decode")
            kv.device.activate()
            q_d = DeviceArray._wrap(ref[0], heads, dt, kv.device, q if ref[5] is None else ref[5])
            joined = kv.join(sid, "decode", "gqa_decode_async")
            try:
                result = gqa_decode(q_d, *self._views(kv, seq), stream=kv.stream, **kw)
            finally:
                if joined:
                    kv.rejoin(sid)
            out, lse = result if features["return_lse"] else (result, None)
            out = out.view(out_shape)
            return out if lse is None else (out, lse)

    def _views(self, kv: Any, seq: int) -> tuple[DeviceArray, DeviceArray]:
        """The cache's K and V over its first ``seq`` tokens, read in place."""
        return (kv._k.view((seq, kv.n_kv_heads, kv.head_dim)),
                kv._v.view((seq, kv.n_kv_heads, self.head_dim_v)))  # fmt: skip

    def _decode_host(
        self, kv: Any, q: np.ndarray, seq: int, out_shape: tuple[int, ...], kw: dict[str, Any]
    ) -> Any:
        """A numpy q's decode: copied in, decoded, copied back (complete)."""
        if seq == 0:  # (nothing to read: gqa_decode's numpy path gives the zeros and LSE)
            n_kv, dt = kv.n_kv_heads, kv.dtype
            result = gqa_decode(q, np.zeros((0, n_kv, kv.head_dim), dt),
                                np.zeros((0, n_kv, self.head_dim_v), dt), **kw)  # fmt: skip
        else:
            kv.device.activate()
            made = [to_device(np.ascontiguousarray(q), kv.stream, device=kv.device)]
            try:
                dev = gqa_decode(made[0], *self._views(kv, seq), stream=kv.stream, **kw)
                made += list(dev) if kw["return_lse"] else [dev]
                result = tuple(a.to_host(kv.stream) for a in made[1:])
                if not kw["return_lse"]:
                    result = result[0]
            finally:
                for arr in made:
                    arr.close()
        if kw["return_lse"]:
            return result[0].reshape(out_shape), result[1]
        return result.reshape(out_shape)
