"""Device-resident KV caches: one-row asynchronous appends, multi-layer caches.

Layout is ferrox-cuda's, [token][kv_head][head_dim], so one token is one contiguous row and
one copy. The sequence length lives on the device as well as on the host: kernels and
captured graphs read it there, so one captured graph serves every token.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any, Literal, overload

import numpy as np

from ..decode import plan as attention
from ..decode.checks import (
    MAX_HEAD_DIM,
    MAX_KV_HEADS,
    MAX_TOKENS,
    ArrayInfo,
    check_dims,
    check_dtype,
    check_host_extent,
    check_int,
    check_q,
    dtype_name,
    q_heads,
)
from ..decode.features import check_features
from ..decode.fp8 import (
    FP8_DTYPES,
    MIN_COMPUTE_CAPABILITY,
    ROW_DTYPES,
    ROWS_BY_VALUE_MAX,
    by_value_append_kernel,
    check_scales,
    quantize_kernel,
)
from ..decode.pair import feature_key
from ..decode.launches import allocate_scratch, parity_launches, plan_split, split_launches
from ..decode.plan import check_algorithm
from ..decode.records import DecodeRecord
from ..driver.calls import (
    SUCCESS,
    check,
    driver_version,
    drv,
    graph_launch_raw,
    memcpy_htod_raw,
    stream_of,
    stream_sync_raw,
)
from ..driver.calls import capture_state as _capture_state
from ..driver.device import Device, resolve
from ..driver.graph import stream_capturing
from ..driver.interop import array_ref
from ..driver.launch import Kernel, PackedLaunch
from ..driver.memory import DeviceArray, as_dtype, empty, pinned_empty
from ..driver.pool import output_pool
from ..driver.stream import Event, Stream, call_stream, stream_handle, stream_key
from ..errors import ClosedError, FerroxError, KVCapacityError
from ..kernels import abi
from ..kernels.catalogue import get_kernel, split_kernel
from ..types import ArrayLike, DeviceArrayLike, DeviceLike, DTypeLike, HostArrayLike, StreamLike

__all__ = ["KVCache", "LayerKVCache"]

STAGING_SLOTS = 64
SLOT_GROUP = 8  # staging slots per event


def check_kv_shape(n_kv_heads: Any, head_dim: Any) -> tuple[int, int]:
    """Validate the per-token KV shape."""
    n_kv_heads = check_int(n_kv_heads, "n_kv_heads", 1, MAX_KV_HEADS)  # (as decodes take)
    return n_kv_heads, check_int(head_dim, "head_dim", 1, MAX_HEAD_DIM)


def append_kernel(device: Device) -> Kernel:
    """The device-side append kernel (reads and bumps the device sequence length)."""
    return get_kernel("kv_cache.cu", "kv_append_row", device)


class _HostDecoder:
    """What ``KVCache.decode`` needs for one (n_heads, algorithm), made once: page-locked
    staging for q and the result, their device copies, and the step (copy q in, decode
    reading the length on the device, copy the result out) captured as one graph, so a
    decode is one launch and one wait."""

    def __init__(
        self, kv: KVCache, n_heads: int, algorithm: str, feats: Any = None, q_dtype: Any = None
    ) -> None:
        shape = (n_heads * kv.head_dim,)
        self.shapes = {shape, (n_heads, kv.head_dim), (1, n_heads, 1, kv.head_dim)}
        self.q_dtype = qdt = kv.dtype if q_dtype is None else np.dtype(q_dtype)
        nbytes = shape[0] * qdt.itemsize
        self.q_stage = pinned_empty(shape, qdt)
        self.out_stage = pinned_empty(shape, qdt)
        self.q_dev = empty(shape, qdt, device=kv.device)
        self.out_dev = empty(shape, qdt, device=kv.device)
        # with features: page-locked staging and device copies of the per-head arrays (the
        # call's sinks, slopes in; the LSE out), copied by the graph too
        self.stages: dict[str, tuple[np.ndarray, DeviceArray]] = {}
        features = None
        if feats is not None:
            for role, wanted in (("sinks", feats.sinks is not None),
                                 ("alibi_slopes", feats.alibi_slopes is not None),
                                 ("lse", feats.return_lse)):  # fmt: skip
                if wanted:
                    host = pinned_empty((n_heads,), np.float32)
                    self.stages[role] = (host, empty((n_heads,), np.float32, device=kv.device))
            dev = {role: pair[1] for role, pair in self.stages.items()}
            features = abi.feature_args(
                feats, kv.head_dim, slopes=dev.get("alibi_slopes"), sinks=dev.get("sinks"),
                lse=dev.get("lse"),
            )  # fmt: skip
        record = kv.decode_record(
            self.q_dev, self.out_dev, n_heads, algorithm, kv.stream, length_on_device=True,
            features=features,
        )  # fmt: skip
        h = kv._h
        with kv.stream.capture() as graph:
            drv("cuMemcpyHtoDAsync", self.q_dev.ptr, self.q_stage.ctypes.data, nbytes, h)
            for role in ("sinks", "alibi_slopes"):
                if role in self.stages:
                    host, dev_arr = self.stages[role]
                    drv("cuMemcpyHtoDAsync", dev_arr.ptr, host.ctypes.data, host.nbytes, h)
            record.run((self.q_dev.ptr, kv._k_ptr, kv._v_ptr, self.out_dev.ptr, 0))
            drv("cuMemcpyDtoHAsync", self.out_stage.ctypes.data, self.out_dev.ptr, nbytes, h)
            if "lse" in self.stages:
                host, dev_arr = self.stages["lse"]
                drv("cuMemcpyDtoHAsync", host.ctypes.data, dev_arr.ptr, host.nbytes, h)
        graph.keep_alive(self.q_stage, self.out_stage, self.q_dev, self.out_dev, record,
                         *(x for pair in self.stages.values() for x in pair))  # fmt: skip
        self.exec = graph.instantiate()
        graph.close()
        self.launch_args = (self.exec.handle, h)

    def close(self) -> None:
        self.exec.close()
        self.q_dev.close()
        self.out_dev.close()
        for _, dev_arr in self.stages.values():
            dev_arr.close()


_OK = SUCCESS
_F32 = np.dtype(np.float32)
_memcpy_htod = memcpy_htod_raw
_graph_launch = graph_launch_raw
_stream_sync = stream_sync_raw


class KVCache:
    """K and V of one attention layer, resident on the GPU, grown a token at a time.

    Args:
        n_kv_heads: KV heads per token.
        head_dim: elements per head, 1 to 256.
        capacity: the most tokens it will hold (memory is allocated once, up front).
        dtype: float32 (as ferrox-cuda), float16 or ``ml_dtypes.bfloat16``; or an fp8 cache,
            ``ml_dtypes.float8_e4m3fn`` or ``float8_e5m2`` (compute capability 8.9 and up,
            head_dim a multiple of 8): appended rows (float32, float16, bfloat16) are
            quantized on the device (as `quantize_fp8`), and decodes take
            float16 or bfloat16 q (the output in q's dtype).
        k_scale: an fp8 cache's K scale (float32, a scalar or one per KV head; default
            1): it stores ``x / k_scale`` and the kernels read ``byte * k_scale``
            (``set_scales`` changes it; the scales apply to every token, stored ones too).
        v_scale: the same for V.
        device: the device: a Device, an int, a ``torch.device`` or ``"cuda:N"``
            (default: device 0).
        stream: the stream appends and decodes run on (default: a stream of its own).

    Appends stage each row in page-locked memory and queue one ``cuMemcpyHtoDAsync`` per
    row (K and V): the host never waits, except when all staging slots are still in flight.
    The length is kept on the host and, for the kernels that read it there (graphs,
    ``kv_append_async``, ``gqa_decode_async``), on the device: host appends bring the
    device copy up to date when device work next needs it, so an append is two copies.

    Thread-safe: appends, decodes, ``clear`` and ``close`` from several threads are
    serialized by a lock per cache, so each decode sees the tokens appended before it and
    each caller gets its own result. ``close()`` frees the buffers unless a captured graph
    still uses them (then they go with the last such graph); every later use of the cache,
    or of a cache whose ``stream`` was closed, raises `ClosedError`.
    """

    def __init__(
        self,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        dtype: DTypeLike = np.float32,
        k_scale: HostArrayLike = None,
        v_scale: HostArrayLike = None,
        device: DeviceLike = None,
        stream: Stream | None = None,
        staging_slots: int = STAGING_SLOTS,
    ) -> None:
        self.n_kv_heads, self.head_dim = check_kv_shape(n_kv_heads, head_dim)
        self.capacity = check_int(capacity, "capacity", 1, MAX_TOKENS)
        dt = as_dtype(dtype, "dtype")
        self.fp8 = FP8_DTYPES.get(dt, "")  # "e4m3", "e5m2" or "" (attention.FP8_FORMATS)
        self.dtype = dt if self.fp8 else check_dtype(dt, "dtype")
        if not self.fp8 and (k_scale is not None or v_scale is not None):
            raise ValueError("k_scale: only fp8 caches take scales")
        if self.fp8 and self.head_dim % 8:
            raise ValueError(
                f"head_dim: fp8 caches take head_dims that are multiples of 8, got {self.head_dim}"
            )
        scales = np.concatenate([check_scales(k_scale, self.n_kv_heads, "k_scale"),
                                 check_scales(v_scale, self.n_kv_heads, "v_scale")])  # fmt: skip
        slots = check_int(staging_slots, "staging_slots", 1)
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"stream: expected a ferrox_driver.Stream, got {type(stream)}")
        self.device = resolve(device)
        if self.fp8 and self.device.compute_capability < MIN_COMPUTE_CAPABILITY:
            raise ValueError(
                f"dtype: fp8 caches need compute capability 8.9 or newer; device "
                f"{self.device.ordinal} has {self.device.compute_capability}"
            )
        self._owns_stream = stream is None
        self.stream = Stream(self.device) if stream is None else stream
        self._h = stream_handle(self.stream)
        self.row_elems = self.n_kv_heads * self.head_dim
        self.row_bytes = self.row_elems * self.dtype.itemsize
        # one token's rows: flat, (n_kv_heads, head_dim), or SDPA's (1, n_kv_heads, 1, head_dim)
        self._row_shapes = ((self.row_elems,), (self.n_kv_heads, self.head_dim),
                            (1, self.n_kv_heads, 1, self.head_dim))  # fmt: skip
        shape = (self.capacity, self.n_kv_heads, self.head_dim)
        self._k = empty(shape, self.dtype, device=self.device)
        self._v = empty(shape, self.dtype, device=self.device)
        self._k_ptr, self._v_ptr = self._k.ptr, self._v.ptr
        # state[0] = seq_len, state[1] = overflow flag (set by kernels, read by the host).
        self.state = empty((2,), np.int32, device=self.device)
        self.state.fill_bytes(0, self.stream)
        self._scales = scales  # the host's copy of kv_scales
        self.kv_scales: DeviceArray | None = None  # fp8: n_kv K scales, then n_kv V ones
        if self.fp8:  # K and V of a slot side by side in the rows' dtype: one copy (_init_fp8)
            self._stage_kv = pinned_empty((slots, 2 * self.row_elems * 4), np.uint8)
            self._stage_k = self._stage_v = self._stage_kv
        else:
            self._stage_k = pinned_empty((slots, self.row_elems), self.dtype)
            self._stage_v = pinned_empty((slots, self.row_elems), self.dtype)
        self._stage_seq = pinned_empty((slots,), np.int32)
        # Addresses computed once: numpy's .ctypes costs microseconds on every access.
        self._stage_k_addr = self._stage_k.ctypes.data
        self._stage_v_addr = self._stage_v.ctypes.data
        self._stage_seq_addr = self._stage_seq.ctypes.data
        # One event per group of slots, recorded after the group's last slot: a slot is
        # reused only after every other slot was, so its group's event covers it.
        self._group = min(SLOT_GROUP, slots)
        n_groups = -(-slots // self._group)
        self._group_events = [Event(timing=False, device=self.device) for _ in range(n_groups)]
        self._group_busy = [False] * n_groups
        self._slots = slots
        self._next_slot = 0
        self._seq_len = 0
        self._host_seq_valid = True
        self._device_seq_current = True  # state[0] == seq_len once queued work has run
        self._eager_seq = False  # a graph captured elsewhere reads state[0]: keep it current
        # A graph captured elsewhere (PyTorch, CuPy) appends: ferrox cannot see its replays,
        # so the host length is never trusted again (each host use reads the device's).
        self._graph_appends = False
        self._workspaces: dict[int, DeviceArray] = {}
        self._outgrown: list[DeviceArray] = []  # graphs captured earlier may still write them
        self._records: dict[tuple[Any, ...], DecodeRecord] = {}
        self._decoders: dict[tuple[int, str, np.dtype], _HostDecoder] = {}
        self._feature_decoders: dict[tuple[Any, ...], _HostDecoder] = {}
        self._appenders: dict[tuple[Any, ...], Any] = {}  # kv_append_async's packed launches
        self._async_records: dict[tuple[Any, ...], tuple[DecodeRecord, bool]] = {}
        self._join_events: tuple[Event, Event] | None = None  # (made at a device call's join)
        self._closed = False
        # Appends, decodes and the state they share (length, staging ring, scratch) are
        # ordered by one lock: re-entrant, as a decode may synchronize to read the length.
        self._lock = threading.RLock()
        if self.fp8:
            self._init_fp8(slots)
        self.stream.synchronize()

    def _init_fp8(self, slots: int) -> None:
        """An fp8 cache's scales on the device, and the quantizing append: each staging
        slot's K and V rows, in the rows' own dtype (float32, float16 or bfloat16: no
        conversion on the host), copied to a device slot, then quantized into the cache by
        one launch of that dtype's kernel."""
        self.kv_scales = empty((2 * self.n_kv_heads,), np.float32, device=self.device)
        self.kv_scales.copy_from_host(self._scales, self.stream)
        self._stage_kv_addr = self._stage_kv.ctypes.data
        self._dev_stage = empty(self._stage_kv.shape, np.uint8, device=self.device)
        slot_bytes = self._stage_kv.shape[1]
        threads = min(256, -(-self.row_elems // 32) * 32)
        # dtype -> (the staging ring seen as [slot][K|V][row] of it, its quantizing launch)
        self._fp8_appends: dict[np.dtype, tuple[np.ndarray, PackedLaunch]] = {}
        for dt in ROW_DTYPES:
            strides = (slot_bytes, self.row_elems * dt.itemsize, dt.itemsize)
            view = np.ndarray((slots, 2, self.row_elems), dt, self._stage_kv, strides=strides)
            args = (self._dev_stage, self._dev_stage, self._k, self._v, self.kv_scales,
                    np.int32(self.n_kv_heads), np.int32(self.head_dim), np.int32(1),
                    np.int32(0), self.state, np.int32(self.capacity))  # fmt: skip
            kernel = quantize_kernel(self.fp8, self.device, dtype_name(dt))
            launch = PackedLaunch(kernel, 1, threads, args, stream=self.stream)
            self._fp8_appends[dt] = (view, launch)
        # dtype -> (K and V rows, passed by value, its launch) or None: rows of the dtype
        # are staged (too many bytes for the launch's arguments, or a driver before 12.1)
        self._fp8_value_appends: dict[np.dtype, tuple[np.ndarray, PackedLaunch] | None] = {}

    def _value_append(self, dt: np.dtype) -> tuple[np.ndarray, PackedLaunch] | None:
        """The by-value append of rows of ``dt`` (made at its first use), or None."""
        if dt not in self._fp8_value_appends:
            entry = None
            if 2 * self.row_elems * dt.itemsize <= ROWS_BY_VALUE_MAX and (
                (driver_version() or 0) >= 12010
            ):
                kernel = by_value_append_kernel(self.fp8, self.device, dtype_name(dt),
                                                self.row_elems)  # fmt: skip
                blob = np.zeros((2, self.row_elems), dt)
                args = (np.uint64(0), self._k, self._v, self.kv_scales,
                        np.int32(self.n_kv_heads), np.int32(self.head_dim), np.int32(0),
                        self.state)  # fmt: skip
                threads = min(256, -(-self.row_elems // 32) * 32)
                launch = PackedLaunch(kernel, 1, threads, args, stream=self.stream)
                launch.by_value(0, blob)
                entry = (blob, launch)
            self._fp8_value_appends[dt] = entry
        return self._fp8_value_appends[dt]

    # -- lifetime checks -------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (or the cache's stream was closed)."""
        return self._closed or self.stream._closed

    def _check_open(self) -> None:
        """Raise ClosedError when the cache, or the stream it runs on, was closed."""
        if self._closed:
            raise ClosedError("KVCache")
        if self.stream._closed:
            raise ClosedError("KVCache", "runs on a Stream that was closed")

    def _resources(self) -> tuple[Any, ...]:
        """The device memory a graph that uses this cache must hold (see Graph)."""
        self._check_open()
        scales = () if self.kv_scales is None else (self.kv_scales,)
        arrays = (self._k, self._v, self.state, *scales, *self._workspaces.values(),
                  *self._outgrown)  # fmt: skip
        return tuple(a._base for a in arrays if a._base is not None)

    # -- state ---------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        """Tokens in the cache. After device-side appends (graphs, ``kv_append_async``)
        this waits for the cache's stream and reads the device counter."""
        if self._closed or self.stream._closed:
            self._check_open()
        if not self._host_seq_valid:
            self.synchronize()
        return self._seq_len

    def synchronize(self) -> None:
        """Wait for queued work and refresh the sequence length from the device.

        Raises:
            KVCapacityError: a device-side append found the cache full (nothing was
                written); the flag is cleared once reported.
            ClosedError: the cache or its stream was closed.
        """
        with self._lock:
            self._check_open()
            self.device_length()
            self.stream.synchronize()
            state = self.state.to_host(self.stream)
            self._seq_len = int(state[0])
            self._host_seq_valid = not self._graph_appends
            if state[1]:
                self._reset_overflow()
                raise KVCapacityError(self._seq_len, self.capacity)

    def _reset_overflow(self) -> None:
        drv("cuMemsetD32Async", self.state.ptr + 4, 0, 1, self._h)

    def mark_device_appends(self) -> None:
        """Note that device-side work may have changed the sequence length."""
        self._host_seq_valid = False

    def device_length(self) -> DeviceArray:
        """The device copy of the length (``state``: [seq_len, overflow flag]), brought up
        to date on the cache's stream first; device work that reads it calls this."""
        self._check_open()
        if not self._device_seq_current:
            with self._lock:
                if not self._device_seq_current:
                    self.device.activate()
                    self._queue_seq(self._take_slot(), self._seq_len)
        return self.state

    def device_length_for(self, captured: bool) -> DeviceArray:
        """``device_length`` for device work about to be queued, ``captured`` into a graph
        or not. A graph reads ``state`` whenever it runs, so from a capture on every host
        append updates it at once; and an update queued now would be captured too.

        Raises:
            FerroxError: ``captured``, and host appends since the device's copy was last
                brought up to date (call ``prepare`` or ``synchronize`` before capturing).
        """
        if not captured:
            return self.device_length()
        self._check_open()
        if not self._device_seq_current:
            raise FerroxError(
                f"kv: {self._seq_len} tokens were appended on the host since the device's "
                f"copy of the length was last updated, and that update cannot be captured: "
                f"call kv.prepare(n_heads) (or kv.synchronize()) before capturing"
            )
        self._eager_seq = True
        return self.state

    @property
    def k(self) -> DeviceArray:
        """Device view of the ``seq_len`` K rows, shape (seq_len, n_kv_heads, head_dim)."""
        return self._k.view((self.seq_len, self.n_kv_heads, self.head_dim))

    @property
    def v(self) -> DeviceArray:
        """Device view of the ``seq_len`` V rows, shape (seq_len, n_kv_heads, head_dim)."""
        return self._v.view((self.seq_len, self.n_kv_heads, self.head_dim))

    @property
    def k_buffer(self) -> DeviceArray:
        """The whole K buffer, (capacity, n_kv_heads, head_dim)."""
        self._check_open()
        return self._k

    @property
    def v_buffer(self) -> DeviceArray:
        """The whole V buffer, (capacity, n_kv_heads, head_dim)."""
        self._check_open()
        return self._v

    # -- writing -------------------------------------------------------------------
    def _check_rows(self, rows: Any, name: str, *, one: bool) -> np.ndarray:
        if not isinstance(rows, np.ndarray):
            raise TypeError(f"{name}: expected a numpy array, got {type(rows).__name__}")
        if self.fp8 and rows.dtype not in ROW_DTYPES:
            raise TypeError(
                f"{name}: expected float32, float16 or bfloat16 rows (quantized into the "
                f"{self.dtype} cache), got {rows.dtype}"
            )
        if not self.fp8 and rows.dtype != self.dtype:
            raise TypeError(f"{name}: expected dtype {self.dtype} (the cache's), got {rows.dtype}")
        self._check_row_shape(rows.shape, name, one)
        check_host_extent(rows, name)
        return rows

    def _check_row_shape(self, shape: tuple[int, ...], name: str, one: bool) -> None:
        """Rows of one token (``one``) or of n: raise naming ``name`` for other shapes."""
        shape = tuple(shape)
        if one:
            if shape not in self._row_shapes:
                raise ValueError(
                    f"{name}: expected one token of shape ({self.row_elems},), "
                    f"({self.n_kv_heads}, {self.head_dim}) or (1, {self.n_kv_heads}, 1, "
                    f"{self.head_dim}), got {shape}"
                )
        elif not (
            (len(shape) == 1 and shape[0] % self.row_elems == 0)
            or (len(shape) == 2 and shape[1] == self.row_elems)
            or (len(shape) == 3 and shape[1:] == (self.n_kv_heads, self.head_dim))
        ):
            sdpa = (
                len(shape) == 4
                and shape[0] == 1
                and shape[1::2] == (self.n_kv_heads, self.head_dim)
            )
            raise ValueError(
                f"{name}: expected tokens of shape (n, {self.n_kv_heads}, {self.head_dim}), "
                f"(n, {self.row_elems}) or (n*{self.row_elems},), got {shape}"
                + (": a PyTorch SDPA cache (1, n_kv_heads, n, head_dim) is head-major; "
                   "pass rows[0].transpose(0, 1).contiguous()" if sdpa else "")
            )  # fmt: skip

    def _take_slot(self) -> int:
        """The next staging slot, waited for when the ring has come round to it while its
        copies may still be in flight; the group's event is recorded after its last slot
        (by ``_done_slot``)."""
        slot = self._next_slot
        self._next_slot = (slot + 1) % self._slots
        group = slot // self._group
        if slot % self._group == 0 and self._group_busy[group]:
            self._group_events[group].synchronize()  # only when every slot is in flight
            self._group_busy[group] = False
        return slot

    def _done_slot(self, slot: int) -> None:
        if slot % self._group == self._group - 1 or slot == self._slots - 1:
            group = slot // self._group
            drv("cuEventRecord", self._group_events[group].handle, self._h)
            self._group_busy[group] = True

    def _queue_seq(self, slot: int, seq_len: int) -> None:
        self._stage_seq[slot] = seq_len
        drv("cuMemcpyHtoDAsync", self.state.ptr, self._stage_seq_addr + 4 * slot, 4, self._h)
        self._done_slot(slot)
        self._device_seq_current = True

    def append(self, k_tok: ArrayLike, v_tok: ArrayLike, *, stream: StreamLike = None) -> None:
        """Append one token's K and V rows (``n_kv_heads*head_dim`` each, cache dtype; shaped
        ``(n_kv_heads, head_dim)``, flat or SDPA's ``(1, n_kv_heads, 1, head_dim)``).

        Queued on the cache's stream; returns without waiting for the copies. Rows may be
        numpy arrays (staged in page-locked memory) or device arrays (PyTorch CUDA tensors,
        DeviceArray, CuPy...: one device-to-device copy each, see ``extend``).

        Args:
            k_tok: the token's K rows.
            v_tok: its V rows.
            stream: with device rows, the stream they were written on (see ``extend``);
                numpy rows ignore it.

        Raises:
            TypeError, ValueError: a row of the wrong type, dtype or size.
            KVCapacityError: the cache is full. Nothing was written in either case.
            ClosedError: the cache or its stream was closed.
        """
        if self.fp8:
            return self._append_fp8(k_tok, v_tok, stream)
        shapes = self._row_shapes
        if not (
            type(k_tok) is np.ndarray and type(v_tok) is np.ndarray
            and k_tok.dtype == self.dtype and v_tok.dtype == self.dtype
            and k_tok.shape in shapes and v_tok.shape in shapes
        ):  # fmt: skip
            if not (isinstance(k_tok, np.ndarray) and isinstance(v_tok, np.ndarray)):
                return self._extend_device(k_tok, v_tok, ("k_tok", "v_tok"), True, stream)
            self._check_rows(k_tok, "k_tok", one=True)
            self._check_rows(v_tok, "v_tok", one=True)
        check_host_extent(k_tok, "k_tok")  # (views numpy made: one attribute read each)
        check_host_extent(v_tok, "v_tok")
        with self._lock:
            if self._closed or self.stream._closed:
                self._check_open()
            seq = self._seq_len if self._host_seq_valid else self.seq_len
            if seq >= self.capacity:
                raise KVCapacityError(seq, self.capacity)
            self.device.activate()
            slot = self._take_slot()
            self._stage_k[slot] = k_tok.reshape(-1)
            self._stage_v[slot] = v_tok.reshape(-1)
            offset, n = seq * self.row_bytes, self.row_bytes
            h = self._h
            r1 = _memcpy_htod(self._k_ptr + offset, self._stage_k_addr + slot * n, n, h)
            r2 = _memcpy_htod(self._v_ptr + offset, self._stage_v_addr + slot * n, n, h)
            if r1[0] is not _OK or r2[0] is not _OK:  # nothing counted: the copies failed
                check(r1 if r1[0] is not _OK else r2, "cuMemcpyHtoDAsync")
            self._seq_len = seq + 1
            if self._eager_seq:
                self._stage_seq[slot] = seq + 1
                drv("cuMemcpyHtoDAsync", self.state.ptr, self._stage_seq_addr + 4 * slot, 4, h)
            else:
                self._device_seq_current = False
            self._done_slot(slot)

    def _append_fp8(self, k_tok: Any, v_tok: Any, stream: Any) -> None:
        """``append`` into an fp8 cache: one launch quantizing the rows into the cache,
        the rows (in their dtype; float32 when K's and V's differ) passed in its
        arguments, or, where they do not fit there, staged and copied to the device
        first."""
        shapes = self._row_shapes
        if not (
            type(k_tok) is np.ndarray
            and type(v_tok) is np.ndarray
            and k_tok.dtype in self._fp8_appends  # (keyed by ROW_DTYPES: a dict lookup)
            and v_tok.dtype in self._fp8_appends
            and k_tok.shape in shapes
            and v_tok.shape in shapes
        ):  # fmt: skip  (the full checks only where the quick one fails, as in append)
            if not (isinstance(k_tok, np.ndarray) and isinstance(v_tok, np.ndarray)):
                return self._extend_device(k_tok, v_tok, ("k_tok", "v_tok"), True, stream)
            self._check_rows(k_tok, "k_tok", one=True)
            self._check_rows(v_tok, "v_tok", one=True)
        check_host_extent(k_tok, "k_tok")
        check_host_extent(v_tok, "v_tok")
        with self._lock:
            if self._closed or self.stream._closed:
                self._check_open()
            seq = self._seq_len if self._host_seq_valid else self.seq_len
            if seq >= self.capacity:
                raise KVCapacityError(seq, self.capacity)
            self.device.activate()
            dt = k_tok.dtype if k_tok.dtype == v_tok.dtype else ROW_DTYPES[0]
            try:  # (one lookup a token; the first of a dtype makes its launch)
                by_value = self._fp8_value_appends[dt]
            except KeyError:
                by_value = self._value_append(dt)
            if by_value is not None:  # the rows in the launch's arguments, no copy
                blob, launch = by_value
                blob[0] = k_tok.reshape(-1)
                blob[1] = v_tok.reshape(-1)
                launch.slots[6] = seq
                launch()
                self._seq_len = seq + 1
                self._device_seq_current = True  # the kernel wrote state[0] = seq + 1
                return
            slot = self._take_slot()
            ring, launch = self._fp8_appends[dt]
            stage = ring[slot]
            stage[0] = k_tok.reshape(-1)
            stage[1] = v_tok.reshape(-1)
            n, h = 2 * self.row_elems * dt.itemsize, self._h
            at = slot * self._stage_kv.shape[1]
            src = self._dev_stage.ptr + at
            check(_memcpy_htod(src, self._stage_kv_addr + at, n, h), "cuMemcpyHtoDAsync")
            launch.slots[0], launch.slots[1], launch.slots[8] = src, src + n // 2, seq
            launch()
            self._seq_len = seq + 1
            if self._eager_seq:
                self._stage_seq[slot] = seq + 1
                drv("cuMemcpyHtoDAsync", self.state.ptr, self._stage_seq_addr + 4 * slot, 4, h)
            else:
                self._device_seq_current = False
            self._done_slot(slot)

    def _extend_fp8(self, seq: int, k_rows: np.ndarray, v_rows: np.ndarray, n: int) -> None:
        """``extend``'s copies for an fp8 cache: the rows in their dtype (float32 when K's
        and V's differ) to the device, quantized there into tokens seq .. seq + n (waits
        for it: the device copies are freed)."""
        dt = k_rows.dtype if k_rows.dtype == v_rows.dtype else ROW_DTYPES[0]
        shape = (n, self.row_elems)
        with (empty(shape, dt, device=self.device) as k_dev,
              empty(shape, dt, device=self.device) as v_dev):  # fmt: skip
            k_dev.copy_from_host(np.ascontiguousarray(k_rows, dt).reshape(shape), self.stream)
            v_dev.copy_from_host(np.ascontiguousarray(v_rows, dt).reshape(shape), self.stream)
            self._quantize_rows(k_dev, v_dev, n, seq)
            self.stream.synchronize()

    def _quantize_rows(self, k_dev: DeviceArray, v_dev: DeviceArray, n: int, seq: int) -> None:
        """Quantize ``n`` device rows of K and V (float32, float16 or bfloat16) into tokens
        seq .. seq + n of an fp8 cache, on the cache's stream."""
        blocks = min(1024, -(-n * self.row_elems // 256))
        quantize_kernel(self.fp8, self.device, dtype_name(k_dev.dtype)).launch(
            blocks, 256,
            (k_dev, v_dev, self._k, self._v, self.kv_scales, np.int32(self.n_kv_heads),
             np.int32(self.head_dim), np.int32(n), np.int32(seq), self.state,
             np.int32(self.capacity)),
            stream=self.stream,
        )  # fmt: skip

    def extend(self, k_rows: ArrayLike, v_rows: ArrayLike, *, stream: StreamLike = None) -> None:
        """Append many tokens (a prefill): one copy for K, one for V.

        Rows are numpy arrays or device arrays (PyTorch CUDA tensors, DeviceArray, CuPy, any
        ``__dlpack__`` or ``__cuda_array_interface__`` object on the cache's device,
        C-contiguous): device rows are copied device to device (an fp8 cache quantizes
        them there), on the cache's stream, ordered after the work queued so far on
        ``stream`` (None: PyTorch's current stream for PyTorch tensors, else the legacy
        default stream), whose later work then waits for the copies: the rows may be
        freed or overwritten on ``stream`` at once. Not capturable (the position is the
        host's): a graph appends with `kv_append_async`.

        Args:
            k_rows: ``(n, n_kv_heads, head_dim)``, ``(n, n_kv_heads*head_dim)`` or flat.
            v_rows: like ``k_rows``.
            stream: with device rows, the stream they were written on; numpy rows ignore
                it.

        Raises:
            TypeError, ValueError: bad arrays, or K and V with different token counts.
            KVCapacityError: they would not fit. Nothing was written in either case.
            ClosedError: the cache or its stream was closed.
            FerroxError: device rows with ``stream`` being captured into a graph.
        """
        if not (isinstance(k_rows, np.ndarray) and isinstance(v_rows, np.ndarray)):
            return self._extend_device(k_rows, v_rows, ("k_rows", "v_rows"), False, stream)
        self._check_rows(k_rows, "k_rows", one=False)
        self._check_rows(v_rows, "v_rows", one=False)
        n = k_rows.size // self.row_elems
        if v_rows.size != k_rows.size:
            raise ValueError(
                f"v_rows: expected {n} tokens like k_rows, got {v_rows.size // self.row_elems}"
            )
        with self._lock:
            seq = self.seq_len
            if seq + n > self.capacity:
                raise KVCapacityError(seq, self.capacity, n)
            if n == 0:
                return
            self.device.activate()
            if self.fp8:
                self._extend_fp8(seq, k_rows, v_rows, n)
            else:
                k_src = np.ascontiguousarray(k_rows)
                v_src = np.ascontiguousarray(v_rows)
                offset, nbytes = seq * self.row_bytes, n * self.row_bytes
                # From pageable memory the driver stages the bytes before returning, so the
                # caller may reuse its arrays at once.
                drv("cuMemcpyHtoDAsync", self._k_ptr + offset, k_src.ctypes.data, nbytes,
                    self._h)  # fmt: skip
                drv("cuMemcpyHtoDAsync", self._v_ptr + offset, v_src.ctypes.data, nbytes,
                    self._h)  # fmt: skip
            self._seq_len = seq + n
            self._device_seq_current = False
            self.device_length()  # a prefill is rare: keep the device's copy current

    def _extend_device(
        self, k: Any, v: Any, names: tuple[str, str], one: bool, stream: Any
    ) -> None:
        """``append`` (``one``) or ``extend`` of device rows: checked, then copied (an fp8
        cache: quantized) device to device into tokens seq .. seq + n on the cache's
        stream, joined to the caller's (``_join``)."""
        kr, vr = array_ref(k, names[0]), array_ref(v, names[1])
        if kr is None or vr is None:
            raise TypeError(
                f"{names[0]}, {names[1]}: pass both as numpy arrays or both as device arrays"
            )
        for ref, name in ((kr, names[0]), (vr, names[1])):
            _, shape, dt, ordinal, contiguous, _ = ref
            if self.fp8 and dt not in ROW_DTYPES:
                raise TypeError(
                    f"{name}: expected float32, float16 or bfloat16 rows (quantized into the "
                    f"{self.dtype} cache), got {dt}"
                )
            if not self.fp8 and dt != self.dtype:
                raise TypeError(f"{name}: expected dtype {self.dtype} (the cache's), got {dt}")
            if ordinal != self.device.ordinal:
                raise ValueError(
                    f"{name}: on device {ordinal}, but the cache is on device {self.device.ordinal}"
                )
            if not contiguous:
                raise ValueError(f"{name}: must be C-contiguous, got a strided view of shape "
                                 f"{tuple(shape)}")  # fmt: skip
            self._check_row_shape(shape, name, one)
        n, n_v = math.prod(kr[1]) // self.row_elems, math.prod(vr[1]) // self.row_elems
        if n_v != n:
            raise ValueError(f"{names[1]}: expected {n} tokens like {names[0]}, got {n_v}")
        if kr[2] != vr[2]:
            raise TypeError(f"{names[1]}: expected {names[0]}'s dtype {kr[2]}, got {vr[2]}")
        sid = stream_key(call_stream(stream, k, kr[3]))
        with self._lock:
            if self._closed or self.stream._closed:
                self._check_open()
            if self._host_seq_valid and self._seq_len + n > self.capacity:  # (no join)
                raise KVCapacityError(self._seq_len, self.capacity, *(() if one else (n,)))
            self.device.activate()
            joined = self._join(sid, "append" if one else "extend", "kv_append_async")
            try:
                seq = self._seq_len if self._host_seq_valid else self.seq_len
                if seq + n > self.capacity:
                    raise KVCapacityError(seq, self.capacity, *(() if one else (n,)))
                if n == 0:
                    return
                if self.fp8:
                    rows = (n * self.row_elems,)
                    self._quantize_rows(
                        DeviceArray._wrap(kr[0], rows, kr[2], self.device, None),
                        DeviceArray._wrap(vr[0], rows, vr[2], self.device, None), n, seq,
                    )  # fmt: skip
                else:
                    offset, nbytes = seq * self.row_bytes, n * self.row_bytes
                    drv("cuMemcpyDtoDAsync", self._k_ptr + offset, kr[0], nbytes, self._h)
                    drv("cuMemcpyDtoDAsync", self._v_ptr + offset, vr[0], nbytes, self._h)
                self._seq_len = seq + n
                self._device_seq_current = False
                if self._eager_seq or not one:  # (as host appends: see append and extend)
                    self.device_length()
            finally:
                if joined:
                    self._rejoin(sid)

    def _join(self, sid: int, call: str, instead: str) -> bool:
        """Order the cache's stream after the work queued so far on the caller's stream
        ``sid`` (where the caller wrote the device arrays it passes); returns whether it
        is another stream than the cache's (then ``_rejoin`` orders the caller's later
        work after the cache's). Two events, recorded and waited on, no host waiting.

        Raises:
            FerroxError: ``sid`` (or a ferrox stream on this thread) is being captured:
                ``KVCache.<call>`` reads the length on the host; ``instead`` reads it on
                the device.
        """
        if sid == self.stream._handle_int:
            return False
        if getattr(_capture_state, "depth", 0) or (sid and stream_capturing(sid)):
            raise FerroxError(
                f"stream: KVCache.{call} with device arrays cannot be captured into a graph "
                f"(it reads the cache's length on the host): capture fd.{instead}(kv, ...) "
                f"instead, which reads it on the device"
            )
        if self._join_events is None:
            self._join_events = (Event(timing=False, device=self.device),
                                 Event(timing=False, device=self.device))  # fmt: skip
        ready = self._join_events[0].handle
        drv("cuEventRecord", ready, stream_of(sid))
        drv("cuStreamWaitEvent", self._h, ready, 0)
        return True

    def _rejoin(self, sid: int) -> None:
        """Make the caller's stream ``sid`` wait for the work queued on the cache's."""
        assert self._join_events is not None
        done = self._join_events[1].handle
        drv("cuEventRecord", done, self._h)
        drv("cuStreamWaitEvent", stream_of(sid), done, 0)

    def clear(self) -> None:
        """Forget every token (a new sequence); the memory stays allocated.

        Raises:
            ClosedError: the cache or its stream was closed.
        """
        with self._lock:
            self._check_open()
            self.device.activate()
            self._seq_len = 0
            self._host_seq_valid = not self._graph_appends
            self._device_seq_current = False
            self.device_length()
            self._reset_overflow()

    # -- reading -------------------------------------------------------------------
    def to_host(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the cached K and V, each (seq_len, n_kv_heads, head_dim), in the
        cache's dtype (an fp8 cache's: its bytes; ``dequantized`` scales them)."""
        with self._lock:
            seq = self.seq_len
            shape = (seq, self.n_kv_heads, self.head_dim)
            return self._k.view(shape).to_host(self.stream), self._v.view(shape).to_host(
                self.stream
            )

    def dequantized(self) -> tuple[np.ndarray, np.ndarray]:
        """K and V as float32, as the kernels read them: an fp8 cache's values times each
        KV head's scale (a float32 product); the values themselves for other dtypes."""
        k, v = self.to_host()
        if not self.fp8:
            return k.astype(np.float32), v.astype(np.float32)
        n = self.n_kv_heads
        ks, vs = self._scales[:n, None], self._scales[n:, None]
        return k.astype(np.float32) * ks, v.astype(np.float32) * vs

    @property
    def k_scale(self) -> np.ndarray | None:
        """An fp8 cache's K scales (float32, one per KV head; None for other dtypes)."""
        return self._scales[: self.n_kv_heads].copy() if self.fp8 else None

    @property
    def v_scale(self) -> np.ndarray | None:
        """An fp8 cache's V scales (float32, one per KV head; None for other dtypes)."""
        return self._scales[self.n_kv_heads :].copy() if self.fp8 else None

    def set_scales(self, k_scale: HostArrayLike = None, v_scale: HostArrayLike = None) -> None:
        """Replace an fp8 cache's K and/or V scales (None: keep), on the device in stream
        order: later appends quantize with them and every later decode (graphs captured
        before included) reads every token, stored ones too, with them.

        Raises:
            ValueError: not an fp8 cache, or scales not positive, finite, one per KV head.
        """
        if not self.fp8:
            raise ValueError("k_scale: only fp8 caches take scales")
        n = self.n_kv_heads
        new = self._scales.copy()
        if k_scale is not None:
            new[:n] = check_scales(k_scale, n, "k_scale")
        if v_scale is not None:
            new[n:] = check_scales(v_scale, n, "v_scale")
        with self._lock:
            self._check_open()
            assert self.kv_scales is not None
            self.device.activate()
            self.stream.synchronize()  # (the copy below is from pageable memory)
            self.kv_scales.copy_from_host(new, self.stream)
            self.stream.synchronize()
            self._scales = new

    @overload
    def decode(
        self,
        q: np.ndarray,
        *,
        n_heads: int | None = None,
        stream: StreamLike = None,
        algorithm: str = "auto",
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: ArrayLike = None,
        alibi_slopes: ArrayLike = None,
        scale: float | None = None,
        return_lse: Literal[False] = False,
    ) -> np.ndarray: ...
    @overload
    def decode(
        self,
        q: np.ndarray,
        *,
        n_heads: int | None = None,
        stream: StreamLike = None,
        algorithm: str = "auto",
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: ArrayLike = None,
        alibi_slopes: ArrayLike = None,
        scale: float | None = None,
        return_lse: Literal[True],
    ) -> tuple[np.ndarray, np.ndarray]: ...
    @overload
    def decode(
        self,
        q: DeviceArrayLike,
        *,
        n_heads: int | None = None,
        stream: StreamLike = None,
        algorithm: str = "auto",
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: ArrayLike = None,
        alibi_slopes: ArrayLike = None,
        scale: float | None = None,
        return_lse: Literal[False] = False,
    ) -> DeviceArray: ...
    @overload
    def decode(
        self,
        q: DeviceArrayLike,
        *,
        n_heads: int | None = None,
        stream: StreamLike = None,
        algorithm: str = "auto",
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: ArrayLike = None,
        alibi_slopes: ArrayLike = None,
        scale: float | None = None,
        return_lse: Literal[True],
    ) -> tuple[DeviceArray, DeviceArray]: ...
    def decode(
        self,
        q: ArrayLike,
        *,
        n_heads: int | None = None,
        stream: StreamLike = None,
        algorithm: str = "auto",
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: ArrayLike = None,
        alibi_slopes: ArrayLike = None,
        scale: float | None = None,
        return_lse: bool = False,
    ) -> np.ndarray | DeviceArray | tuple[np.ndarray, np.ndarray] | tuple[DeviceArray, DeviceArray]:
        """Decode one query against the resident cache.

        numpy in, numpy out (copied in and back, complete: one graph launch, one wait);
        device arrays in (a PyTorch CUDA tensor, DeviceArray, CuPy...), a DeviceArray out
        (``torch.from_dlpack`` takes it without a copy), queued with no host round trip
        on the cache's stream, ordered after the work queued so far on ``stream``, whose
        later work then waits for the result. Not capturable (a graph decodes with
        `gqa_decode_async`).

        Args:
            q: ``(n_heads*head_dim,)``, ``(n_heads, head_dim)`` or PyTorch SDPA's ``(1,
                n_heads, 1, head_dim)``, cache dtype (an fp8 cache: float16 or bfloat16);
                the result has q's shape.
            n_heads: query heads, a multiple of ``n_kv_heads`` (default: read from q's
                shape; given, checked against it).
            stream: with a device q, the stream it was written on and the result is
                wanted on (None: PyTorch's current stream for a PyTorch tensor, else the
                legacy default stream); a numpy q ignores it.
            algorithm: ``"auto"`` or ``"parity"``.
            sliding_window: as `gqa_decode`.
            logits_soft_cap: as `gqa_decode`.
            sinks: as `gqa_decode` (numpy: copied in with q; with a device q, a float32
                device array too).
            alibi_slopes: like ``sinks``.
            scale: as `gqa_decode`.
            return_lse: also return the log-sum-exp per query head (float32, numpy or a
                device array like the result).

        Returns:
            An array of q's shape and dtype (numpy or a DeviceArray, as q); with
                ``return_lse``, ``(out, lse)``, lse float32 of shape (n_heads,).

        Raises:
            TypeError, ValueError: bad q, n_heads or features, naming them.
            ClosedError: the cache or its stream was closed.
            FerroxError: a device q with ``stream`` being captured into a graph.
        """
        if not isinstance(q, np.ndarray):
            return self._decode_device(
                q, n_heads, stream, algorithm,
                dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                     sinks=sinks, alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse),
            )  # fmt: skip
        if n_heads is None:
            n_heads = q_heads(q.shape, self.head_dim)
        if not (
            sliding_window is None and logits_soft_cap is None and sinks is None
            and alibi_slopes is None and scale is None and return_lse is False
        ):  # fmt: skip
            return self._decode_features(
                q, n_heads, algorithm,
                dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                     sinks=sinks, alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse),
            )  # fmt: skip
        with self._lock:  # the staging and the result are the cache's: one decode at a time
            if self._closed or self.stream._closed:
                self._check_open()
            qdt = q.dtype if self.fp8 and type(q) is np.ndarray else self.dtype
            try:
                dec = self._decoders.get((n_heads, algorithm, qdt))
            except TypeError:  # an unhashable argument, which the checks name
                dec = None
            if dec is None:
                n_heads, _, _ = check_dims(n_heads, self.n_kv_heads, self.head_dim)
                algorithm = check_algorithm(algorithm)
                self._check_q_dtype(q, algorithm)
                check_q(ArrayInfo(q.shape, q.dtype, False), n_heads, self.head_dim)
                dec = _HostDecoder(self, n_heads, algorithm, q_dtype=qdt)
                self._decoders[n_heads, algorithm, qdt] = dec
            if not (type(q) is np.ndarray and q.dtype == dec.q_dtype and q.shape in dec.shapes):
                self._check_q_dtype(q, algorithm)
                check_q(ArrayInfo(q.shape, q.dtype, False), n_heads, self.head_dim)
            check_host_extent(q, "q")
            seq = self._seq_len if self._host_seq_valid else self.seq_len
            if seq == 0:
                return np.zeros(q.shape, q.dtype)
            self.device.activate()
            np.copyto(dec.q_stage, q.reshape(-1))
            if not self._device_seq_current:
                self.device_length()
            result = _graph_launch(*dec.launch_args)
            if result[0] is not _OK:
                check(result, "cuGraphLaunch")
            result = _stream_sync(self._h)
            if result[0] is not _OK:
                check(result, "cuStreamSynchronize")
            return dec.out_stage.reshape(q.shape).copy()

    def _check_q_dtype(self, q: Any, algorithm: str) -> None:
        """q for a decode of this cache: a numpy array of the cache's dtype (an fp8
        cache's: float16 or bfloat16; the split kernels only)."""
        if not isinstance(q, np.ndarray):
            raise TypeError(f"q: expected a numpy array, got {type(q).__name__}")
        check_host_extent(q, "q")
        self._check_q_dtype_of(q.dtype, algorithm)

    def _check_q_dtype_of(self, dtype: np.dtype, algorithm: str) -> None:
        if self.fp8:
            if dtype not in ROW_DTYPES[1:]:
                raise TypeError(
                    f"q: expected float16 or bfloat16 for the {self.dtype} cache, got {dtype}"
                )
            if algorithm == "parity":
                raise ValueError("algorithm: fp8 caches decode with the split kernels ('auto')")
        elif dtype != self.dtype:
            raise TypeError(f"q: expected dtype {self.dtype} (the cache's), got {dtype}")

    def _decode_device(
        self, q: Any, n_heads: Any, stream: Any, algorithm: Any, kw: dict[str, Any]
    ) -> Any:
        """KVCache.decode of a device q: checked, then `gqa_decode_async` into an output
        block of the caller's stream's pool, on the cache's stream joined to the caller's
        (``_join``); numpy sinks and slopes are copied into device buffers of the cache's
        stream first."""
        from ..driver.pool import stream_buffer as _stream_buffer
        from .device_ops import gqa_decode_async

        ref = array_ref(q, "q")
        assert ref is not None  # (numpy arrays take the host path)
        _, shape, dtype, ordinal, contiguous, _ = ref
        if ordinal != self.device.ordinal:
            raise ValueError(
                f"q: on device {ordinal}, but the cache is on device {self.device.ordinal}"
            )
        if not contiguous:
            raise ValueError(f"q: must be C-contiguous, got a strided view of shape {shape}")
        self._check_q_dtype_of(dtype, check_algorithm(algorithm))
        n_heads, _, _ = check_dims(q_heads(shape, self.head_dim, n_heads), self.n_kv_heads,
                                   self.head_dim)  # fmt: skip
        feats = check_features(n_heads, **kw)
        sid = stream_key(call_stream(stream, q, ordinal))
        with self._lock:
            self._check_open()
            self.device.activate()
            joined = self._join(sid, "decode", "gqa_decode_async")
            try:
                nbytes = math.prod(shape) * dtype.itemsize
                out = output_pool(self.device, sid, nbytes).take(tuple(shape), dtype)
                lse = None
                if feats.return_lse:
                    lse = output_pool(self.device, sid, 4 * n_heads).take((n_heads,), _F32)
                per_head = {}
                for role in ("sinks", "alibi_slopes"):
                    values = getattr(feats, role)
                    if isinstance(values, np.ndarray):  # into this cache stream's buffer
                        buf = _stream_buffer(self.device, self.stream._handle_int, role, n_heads)
                        buf.copy_from_host(values.astype(np.float32), self.stream)
                        values = buf
                    per_head[role] = values
                gqa_decode_async(
                    q, self, out, n_heads=n_heads, stream=self.stream, algorithm=algorithm,
                    out_lse=lse, sliding_window=feats.sliding_window,
                    logits_soft_cap=feats.logits_soft_cap, scale=feats.scale, **per_head,
                )  # fmt: skip
            finally:
                if joined:
                    self._rejoin(sid)
        return (out, lse) if lse is not None else out

    def _decode_features(self, q: Any, n_heads: Any, algorithm: Any, kw: dict[str, Any]) -> Any:
        """KVCache.decode with features: checked, then one launch of a graph made once per
        (n_heads, algorithm, which features, their scalars) that copies q and the per-head
        arrays in, decodes and copies the result (and the LSE) out."""
        n_heads, _, _ = check_dims(n_heads, self.n_kv_heads, self.head_dim)
        algorithm = check_algorithm(algorithm)
        if algorithm == "parity":
            raise ValueError("algorithm: the features need the split kernels ('auto')")
        feats = check_features(n_heads, **kw, allow_device=False)
        self._check_q_dtype(q, algorithm)
        check_q(ArrayInfo(q.shape, q.dtype, False), n_heads, self.head_dim)
        key = (n_heads, algorithm, abi.feature_bits_of(feats), feats.sliding_window,
               feats.logits_soft_cap, feats.scale, q.dtype)  # fmt: skip
        with self._lock:
            self._check_open()
            dec = self._feature_decoders.get(key)
            if dec is None:
                dec = _HostDecoder(self, n_heads, algorithm, feats, q_dtype=q.dtype)
                self._feature_decoders[key] = dec
            self.device.activate()
            np.copyto(dec.q_stage, q.reshape(-1))
            for role, values in (("sinks", feats.sinks), ("alibi_slopes", feats.alibi_slopes)):
                if values is not None:
                    np.copyto(dec.stages[role][0], values)  # float64 -> float32
            if not self._device_seq_current:
                self.device_length()
            check(_graph_launch(*dec.launch_args), "cuGraphLaunch")
            check(_stream_sync(self._h), "cuStreamSynchronize")
            out = dec.out_stage.reshape(q.shape).copy()
            return (out, dec.stages["lse"][0].copy()) if feats.return_lse else out

    def decode_record(
        self,
        q_dev: DeviceArray,
        out_dev: DeviceArray,
        n_heads: int,
        algorithm: str,
        stream: Any,
        *,
        length_on_device: bool,
        features: tuple[int, Any] | None = None,
    ) -> DecodeRecord:
        """The launch record of decodes of ``n_heads`` query heads against this cache on
        ``stream`` (made once per signature): the length read on the device
        (``length_on_device``, for graphs and ``gqa_decode_async``) or written per call.

        Every decode of a cache is planned for its capacity (with a window, for at most the
        window), so the eager path and graphs captured once chunk the sequence identically
        and agree bit for bit. ``features``: (F_* bits, abi.FeatureArgs), whose values
        the record keeps (a key of their own)."""
        self._check_open()
        aligned = ((q_dev.ptr | out_dev.ptr) & 15) == 0
        sid = stream_key(stream)
        bits, fargs = features if features is not None else (0, None)
        fkey = None if fargs is None else feature_key(fargs)
        key = (n_heads, algorithm, aligned, sid, length_on_device, attention.OVERRIDES, bits, fkey,
               q_dev.dtype)  # fmt: skip
        record = self._records.get(key)
        if record is None:
            seq_dev = self.state if length_on_device else None
            seq_len = self.capacity if length_on_device else 0
            n_kv, hd = self.n_kv_heads, self.head_dim
            if algorithm == "parity":
                launches = parity_launches(
                    q_dev, self._k, self._v, out_dev, n_heads=n_heads, n_kv_heads=n_kv,
                    head_dim=hd, seq_len=seq_len, seq_len_dev=seq_dev,
                )  # fmt: skip
            else:
                plan = plan_split(
                    self.device, q_dev.dtype if self.fp8 else self.dtype, n_heads,
                    self.n_kv_heads, self.head_dim, self._plan_seq(fargs), aligned, bits,
                    self.fp8,
                )  # fmt: skip
                ws = self.split_workspace(n_heads, plan.workspace_floats(n_heads, self.head_dim))
                launches = split_launches(
                    plan, q_dev, self._k, self._v, out_dev, ws, n_heads=n_heads,
                    n_kv_heads=n_kv, head_dim=hd, seq_len=seq_len, seq_len_dev=seq_dev,
                    features=fargs, kv_scales=self.kv_scales,
                )  # fmt: skip
            record = self._records[key] = DecodeRecord(
                launches, self.device, stream_handle(sid), None
            )
        return record

    def launch_decode(
        self,
        q_dev: DeviceArray,
        out_dev: DeviceArray,
        *,
        n_heads: int,
        stream: Any,
        algorithm: str = "auto",
        length_on_device: bool = False,
    ) -> None:
        """Queue a decode of validated device arrays against this cache (no checks)."""
        with self._lock:
            record = self.decode_record(
                q_dev, out_dev, n_heads, algorithm, stream, length_on_device=length_on_device
            )
            if length_on_device:
                self.device_length()
            record.run((q_dev.ptr, self._k_ptr, self._v_ptr, out_dev.ptr, self._seq_len))

    def prepare(
        self,
        n_heads: int,
        algorithm: str = "auto",
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: DeviceArrayLike = None,
        alibi_slopes: DeviceArrayLike = None,
        scale: float | None = None,
        return_lse: bool = False,
        q_dtype: DTypeLike = None,
    ) -> None:
        """Load the kernels and allocate the scratch that decodes of ``n_heads`` query heads
        (with the features given, as `gqa_decode_async` takes them; ``return_lse`` for its
        ``out_lse``) need, so that they can then be captured into a graph (allocation and
        module loading are not capturable), and bring the device's copy of the length up
        to date, keeping it so after every host append. DecodeGraph does this itself.
        ``q_dtype``: an fp8 cache's q (float16 or bfloat16; default bfloat16); others
        take their own dtype.

        Raises:
            ClosedError: the cache or its stream was closed.
        """
        n_heads, _, _ = check_dims(n_heads, self.n_kv_heads, self.head_dim)
        algorithm = check_algorithm(algorithm)
        feats = check_features(
            n_heads, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            sinks=sinks, alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse,
        )  # fmt: skip
        bits = abi.feature_bits_of(feats)
        qdt = self._q_dtype_for(q_dtype, algorithm)
        with self._lock:
            self._prepare(n_heads, algorithm, bits, feats.sliding_window, qdt)

    def _q_dtype_for(self, q_dtype: DTypeLike, algorithm: str) -> np.dtype:
        """The q dtype of this cache's decodes: its own, or an fp8 cache's ``q_dtype``
        (float16 or bfloat16, default bfloat16; the split kernels only)."""
        if not self.fp8:
            if q_dtype is not None and as_dtype(q_dtype, "q_dtype") != self.dtype:
                raise TypeError(f"q_dtype: the {self.dtype} cache decodes {self.dtype} q")
            return self.dtype
        qdt = ROW_DTYPES[2] if q_dtype is None else as_dtype(q_dtype, "q_dtype")
        if qdt not in ROW_DTYPES[1:]:
            raise TypeError(f"q_dtype: expected float16 or bfloat16 for an fp8 cache, got {qdt}")
        if algorithm == "parity":
            raise ValueError("algorithm: fp8 caches decode with the split kernels ('auto')")
        return qdt

    def _plan_seq(self, fargs: Any) -> int:
        """The length decodes of this cache are planned for: its capacity, or the window."""
        if fargs is None or not fargs.window:
            return self.capacity
        return min(self.capacity, fargs.window)

    def _prepare(
        self, n_heads: int, algorithm: str, bits: int = 0, window: int | None = None,
        q_dtype: np.dtype | None = None,
    ) -> None:  # fmt: skip
        self._check_open()
        qdt = self.dtype if q_dtype is None else q_dtype
        if self.fp8:
            quantize_kernel(self.fp8, self.device)  # (one module: every row dtype's kernel)
        else:
            append_kernel(self.device)
        self.device_length()
        self._eager_seq = True  # a graph will read the length: host appends keep it current
        if not bits:
            with empty((n_heads * self.head_dim,), qdt, device=self.device) as probe:
                self.decode_record(probe, probe, n_heads, algorithm, self.stream,
                                   length_on_device=True)  # fmt: skip
        if algorithm != "parity":
            aligned = ((self._k_ptr | self._v_ptr) & 15) == 0
            plan_seq = self.capacity if window is None else min(self.capacity, window)
            plan = plan_split(
                self.device, qdt, n_heads, self.n_kv_heads, self.head_dim,
                plan_seq, aligned, bits, self.fp8,
            )  # fmt: skip
            self.split_workspace(n_heads, plan.workspace_floats(n_heads, self.head_dim))
            combine = plan.combine_spec(qdt)
            if combine is not None:  # a cluster plan has none
                split_kernel(combine, self.device)

    @property
    def dtype_name(self) -> str:
        """``f32``, ``f16`` or ``bf16``; an fp8 cache's format, ``e4m3`` or ``e5m2``."""
        return self.fp8 or dtype_name(self.dtype)

    def split_workspace(self, n_heads: int, floats: int) -> DeviceArray | None:
        """Scratch for decodes of ``n_heads`` query heads (None where the plan needs none:
        ``floats`` 0). Graphs bake its address in, so it lives as long as the cache; a plan
        that needs more (arrays not 16-byte aligned take other kernels) grows it, and the
        outgrown buffer too stays until the cache is closed."""
        if floats <= 0:
            return None
        ws = self._workspaces.get(n_heads)
        if ws is None or ws.size < floats:
            grown = allocate_scratch(
                floats,
                self.device,
                f"n_heads: the decode scratch for {n_heads} heads must exist before a capture "
                f"starts: call kv.prepare(n_heads={n_heads}) (or decode once) before capturing",
            )
            if ws is not None:
                self._outgrown.append(ws)
            ws = self._workspaces[n_heads] = grown
        return ws

    # -- lifetime ------------------------------------------------------------------
    def close(self) -> None:
        """Free the device buffers, the staging memory and (if its own) the stream, once
        queued work is done. Buffers a captured graph still uses are freed with the last
        such graph. Every later use raises `ClosedError`; closing again does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._release()

    def _release(self) -> None:
        with contextlib.suppress(Exception):  # closing must not fail on a broken context
            if self.stream._closed:  # its work is still ordered on the device
                self.device.synchronize()
            else:
                self.stream.synchronize()
        workspaces = [*self._workspaces.values(), *self._outgrown]
        fp8 = (self.kv_scales, self._dev_stage) if self.fp8 and self.kv_scales is not None else ()
        for arr in (self._k, self._v, self.state, *workspaces, *fp8):
            arr.close()
        for dec in (*self._decoders.values(), *self._feature_decoders.values()):
            dec.close()
        self._decoders.clear()
        self._feature_decoders.clear()
        self._records.clear()
        self._appenders.clear()
        self._async_records.clear()
        self._workspaces.clear()
        self._outgrown.clear()
        for ev in (*self._group_events, *(self._join_events or ())):
            ev.close()
        self._stage_k = self._stage_v = self._stage_seq = np.empty(0)
        if self._owns_stream:
            self.stream.close()

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"seq_len={self._seq_len}"
        return (
            f"KVCache(n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
            f"capacity={self.capacity}, dtype={self.dtype.name}, {state})"
        )


class LayerKVCache:
    """One `KVCache` per layer, sharing one stream; memory allocated once.

    Args:
        n_layers: number of layers.
        n_kv_heads: as `KVCache`.
        head_dim: as `KVCache`.
        capacity: as `KVCache`, per layer.
        dtype: as `KVCache`.
        device: as `KVCache`.
        stream: the stream every layer uses (default: a stream of its own).
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        dtype: DTypeLike = np.float32,
        device: DeviceLike = None,
        stream: Stream | None = None,
    ) -> None:
        n_layers = check_int(n_layers, "n_layers", 1)
        check_kv_shape(n_kv_heads, head_dim)
        check_int(capacity, "capacity", 1, MAX_TOKENS)
        dtype = check_dtype(dtype, "dtype")
        self.device = resolve(device)
        self._owns_stream = stream is None
        self.stream = Stream(self.device) if stream is None else stream
        self.layers: list[KVCache] = []
        try:
            for _ in range(n_layers):
                self.layers.append(
                    KVCache(
                        n_kv_heads,
                        head_dim,
                        capacity,
                        dtype=dtype,
                        device=self.device,
                        stream=self.stream,
                    )
                )
        except BaseException:
            self.close()
            raise
        self.n_kv_heads, self.head_dim, self.capacity = n_kv_heads, head_dim, capacity
        self.dtype = dtype

    _closed = False

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("LayerKVCache")

    def __getitem__(self, layer: int) -> KVCache:
        self._check_open()
        return self.layers[layer]

    def __len__(self) -> int:
        self._check_open()
        return len(self.layers)

    def __iter__(self) -> Any:
        self._check_open()
        return iter(self.layers)

    def clear(self) -> None:
        """Clear every layer (a new sequence)."""
        self._check_open()
        for layer in self.layers:
            layer.clear()

    def close(self) -> None:
        """Free every layer's memory (see `KVCache.close`); closing again does nothing."""
        self._closed = True
        for layer in self.layers:
            layer.close()
        self.layers = []
        if self._owns_stream:
            self.stream.close()

    def __enter__(self) -> LayerKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
