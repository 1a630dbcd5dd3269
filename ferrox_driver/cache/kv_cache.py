"""Device-resident KV caches: one-row asynchronous appends, multi-layer caches.

Layout is ferrox-cuda's, [token][kv_head][head_dim], so one token is one contiguous row and
one copy. The sequence length lives on the device as well as on the host: kernels and
captured graphs read it there, so one captured graph serves every token.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
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
from ..decode.launches import allocate_scratch
from ..decode.pair import feature_key
from ..decode.plan import check_algorithm
from ..decode.records import DecodeRecord, Kept, assemble, planned
from ..driver.calls import (
    SUCCESS,
    capture_keep,
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
from ..driver.graph import keep_for_capture, stream_capturing
from ..driver.interop import array_ref
from ..driver.launch import Kernel, PackedLaunch
from ..driver.memory import DeviceArray, as_dtype, empty
from ..driver.stream import Event, Stream, call_stream, stream_handle, stream_key
from ..errors import ClosedError, FerroxError, KVCapacityError
from ..kernels import abi
from ..kernels.catalogue import get_kernel, split_kernel
from ..types import ArrayLike, DeviceArrayLike, DeviceLike, DTypeLike, HostArrayLike, StreamLike
from .host_decode import HostDecoder, check_q_dtype, decode_features
from .staging import STAGING_SLOTS, StagingRing

__all__ = ["KVCache", "append_kernel", "check_cache", "check_kv_shape"]


def check_kv_shape(n_kv_heads: Any, head_dim: Any) -> tuple[int, int]:
    """Validate the per-token KV shape."""
    n_kv_heads = check_int(n_kv_heads, "n_kv_heads", 1, MAX_KV_HEADS)  # (as decodes take)
    return n_kv_heads, check_int(head_dim, "head_dim", 1, MAX_HEAD_DIM)


def append_kernel(device: Device) -> Kernel:
    """The device-side append kernel (reads and bumps the device sequence length)."""
    return get_kernel("kv_cache.cu", "kv_append_row", device)


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
        # page-locked staging for host rows (an fp8 cache's K and V of a slot side by side,
        # in the rows' dtype: one copy, see _init_fp8); bound once for the per-token path
        ring = self._ring = StagingRing(slots, self.row_elems, None if self.fp8 else self.dtype,
                                        self.device, self._h)  # fmt: skip
        self._stage_k, self._stage_v, self._stage_seq = ring.k, ring.v, ring.seq
        self._stage_k_addr, self._stage_v_addr = ring.k_addr, ring.v_addr
        self._stage_seq_addr = ring.seq_addr
        self._take_slot, self._done_slot = ring.take, ring.done
        if self.fp8:
            self._stage_kv = ring.kv
        self._seq_len = 0
        self._host_seq_valid = True
        self._device_seq_current = True  # state[0] == seq_len once queued work has run
        self._eager_seq = False  # a graph captured elsewhere reads state[0]: keep it current
        # A graph captured elsewhere (PyTorch, CuPy) appends: ferrox cannot see its replays,
        # so the host length is never trusted again (each host use reads the device's).
        self._graph_appends = False
        self._workspaces: dict[int, DeviceArray] = {}
        self._outgrown: list[DeviceArray] = []  # graphs captured earlier may still write them
        self._records = Kept()  # this cache's launch records, by signature
        self._decoders: dict[tuple[int, str, np.dtype], HostDecoder] = {}
        self.feature_decoders: dict[tuple[Any, ...], HostDecoder] = {}  # (host_decode's)
        self.appenders: dict[tuple[Any, ...], Any] = {}  # kv_append_async's packed launches
        self.async_records = Kept()  # gqa_decode_async's validated calls
        self._join_events: tuple[Event, Event] | None = None  # (made at a device call's join)
        self._closed = False
        # Appends, decodes and the state they share (length, staging ring, scratch) are
        # ordered by one lock: re-entrant, as a decode may synchronize to read the length.
        self.lock = threading.RLock()  # (public: the device ops and graphs take it too)
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

    def check_open(self, user: str = "") -> None:
        """Raise ClosedError when the cache, or the stream it runs on, was closed; naming
        ``user`` (``"DecodeGraph"``...), the object that uses the cache, where given."""
        if self._closed and user:
            raise ClosedError(user, "uses a KVCache that was closed")
        if self._closed:
            raise ClosedError("KVCache")
        if self.stream._closed:
            raise ClosedError(user or "KVCache", "runs on a Stream that was closed")

    def _resources(self) -> tuple[Any, ...]:
        """The device memory a graph that uses this cache must hold (see Graph)."""
        self.check_open()
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
            self.check_open()
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
        with self.lock:
            self.check_open()
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
        self.check_open()
        if not self._device_seq_current:
            with self.lock:
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
        self.check_open()
        if not self._device_seq_current:
            raise FerroxError(
                f"kv: {self._seq_len} tokens were appended on the host since the device's "
                f"copy of the length was last updated, and that update cannot be captured: "
                f"call kv.prepare(n_heads) (or kv.synchronize()) before capturing"
            )
        self._eager_seq = True
        return self.state

    # The work queued against the cache by others (device ops, graphs) keeps the length
    # protocol through these methods; each does in one call what the per-token paths need.
    def queue_append(
        self, run: Any, k_ptr: int, v_ptr: int, sid: int, foreign: bool, kr: Any, vr: Any,
        objs: tuple[Any, Any],
    ) -> None:  # fmt: skip
        """Queue ``run((k_ptr, v_ptr))``, a device-side append on stream ``sid`` (``foreign``:
        another library's), after bringing the device's length up to date; inside a capture
        keep the cache and the rows (refs ``kr``, ``vr`` of ``objs``) with the graph, and
        from then on learn of the graph's replays (``_AppendsTo``) or, for a graph ferrox
        cannot see run, never trust the host's length again. Called under ``lock``."""
        self.device.activate()  # this thread's context current before any driver call
        if getattr(_capture_state, "depth", 0) or (foreign and stream_capturing(sid)):
            self._captured(sid, foreign, kr, vr, objs, ())
            if not capture_keep(_AppendsTo(self)):  # a graph ferrox cannot see run
                self._graph_appends = True
        elif not self._device_seq_current:
            self.device_length()
        run((k_ptr, v_ptr))
        self._host_seq_valid = False

    def queue_decode(
        self, run: Any, q_ptr: int, out_ptr: int, sid: int, foreign: bool, qr: Any, outr: Any,
        objs: tuple[Any, Any], keep: tuple[Any, ...] = (),
    ) -> None:  # fmt: skip
        """Queue ``run`` of a decode record reading the length on the device (q at
        ``q_ptr``, the result to ``out_ptr``) on stream ``sid``, after bringing the
        device's length up to date; inside a capture keep the cache, q and out (refs
        ``qr``, ``outr`` of ``objs``) and ``keep`` with the graph. Called under ``lock``."""
        self.device.activate()  # this thread's context current before any driver call
        if getattr(_capture_state, "depth", 0) or (foreign and stream_capturing(sid)):
            self._captured(sid, foreign, qr, outr, objs, keep)
        elif not self._device_seq_current:
            self.device_length()
        run((q_ptr, self._k_ptr, self._v_ptr, out_ptr, 0))

    def _captured(
        self, sid: int, foreign: bool, a: Any, b: Any, objs: tuple[Any, Any], keep: tuple[Any, ...]
    ) -> None:
        """Work on ``sid`` is being captured: the cache and the operands (refs ``a``, ``b``
        of ``objs``: their owners where the refs name one) kept with the graph, and the
        device's length kept current from now on (see ``device_length_for``)."""
        owners = (objs[0] if a[5] is None else a[5], objs[1] if b[5] is None else b[5])
        keep_for_capture(sid, foreign, self, *owners, *keep)
        self.device_length_for(True)

    def length_for_step(self, user: str) -> int:
        """The length a host-ordered step that appends one token (a graph's replay) starts
        at: the host's, or the device's where device work changed it.

        Raises:
            ClosedError: the cache or its stream was closed, naming ``user``.
            KVCapacityError: the cache is full.
        """
        if self._closed or self.stream._closed:
            self.check_open(user)
        seq = self._seq_len if self._host_seq_valid else self.seq_len
        if seq >= self.capacity:
            raise KVCapacityError(seq, self.capacity)
        return seq

    def appending_on_device(self) -> None:
        """Before a replay of a graph that appends on the device: the device's length
        brought up to date, and the host's no longer trusted until known again."""
        if not self._device_seq_current:
            self.device_length()
        self._host_seq_valid = False

    def replay_appended(self, seq: int) -> None:
        """After a synchronized replay that appended one token at ``seq`` (below the
        capacity, so it cannot have overflowed): the length is ``seq + 1``, known without
        reading the device (unless a graph ferrox cannot see appends too)."""
        self._seq_len, self._host_seq_valid = seq + 1, not self._graph_appends

    @contextlib.contextmanager
    def replays_update_length(self) -> Iterator[None]:
        """Around the capture of a graph whose every replay first brings the device's
        length up to date itself (``appending_on_device``): the capture keeps it current at
        every host append (``prepare``); after it, host appends defer that again as before."""
        eager_seq = self._eager_seq
        try:
            yield
        finally:
            self._eager_seq = eager_seq

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
        self.check_open()
        return self._k

    @property
    def v_buffer(self) -> DeviceArray:
        """The whole V buffer, (capacity, n_kv_heads, head_dim)."""
        self.check_open()
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
        with self.lock:
            if self._closed or self.stream._closed:
                self.check_open()
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
        with self.lock:
            if self._closed or self.stream._closed:
                self.check_open()
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
        with self.lock:
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
        stream, joined to the caller's (``join``)."""
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
        with self.lock:
            if self._closed or self.stream._closed:
                self.check_open()
            if self._host_seq_valid and self._seq_len + n > self.capacity:  # (no join)
                raise KVCapacityError(self._seq_len, self.capacity, *(() if one else (n,)))
            self.device.activate()
            joined = self.join(sid, "append" if one else "extend", "kv_append_async")
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
                    self.rejoin(sid)

    def join(self, sid: int, call: str, instead: str) -> bool:
        """Order the cache's stream after the work queued so far on the caller's stream
        ``sid`` (where the caller wrote the device arrays it passes); returns whether it
        is another stream than the cache's (then ``rejoin`` orders the caller's later
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

    def rejoin(self, sid: int) -> None:
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
        with self.lock:
            self.check_open()
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
        with self.lock:
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
        with self.lock:
            self.check_open()
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
            from .device_ops import decode_device  # (device_ops imports this module)

            return decode_device(
                self, q, n_heads, stream, algorithm,
                dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                     sinks=sinks, alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse),
            )  # fmt: skip
        if n_heads is None:
            n_heads = q_heads(q.shape, self.head_dim)
        if not (
            sliding_window is None and logits_soft_cap is None and sinks is None
            and alibi_slopes is None and scale is None and return_lse is False
        ):  # fmt: skip
            return decode_features(
                self, q, n_heads, algorithm,
                dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                     sinks=sinks, alibi_slopes=alibi_slopes, scale=scale, return_lse=return_lse),
            )  # fmt: skip
        with self.lock:  # the staging and the result are the cache's: one decode at a time
            if self._closed or self.stream._closed:
                self.check_open()
            qdt = q.dtype if self.fp8 and type(q) is np.ndarray else self.dtype
            try:
                dec = self._decoders.get((n_heads, algorithm, qdt))
            except TypeError:  # an unhashable argument, which the checks name
                dec = None
            if dec is None:
                n_heads, _, _ = check_dims(n_heads, self.n_kv_heads, self.head_dim)
                algorithm = check_algorithm(algorithm)
                check_q_dtype(self, q, algorithm)
                check_q(ArrayInfo(q.shape, q.dtype, False), n_heads, self.head_dim)
                dec = HostDecoder(self, n_heads, algorithm, q_dtype=qdt)
                self._decoders[n_heads, algorithm, qdt] = dec
            if not (type(q) is np.ndarray and q.dtype == dec.q_dtype and q.shape in dec.shapes):
                check_q_dtype(self, q, algorithm)
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
        self.check_open()
        aligned = ((q_dev.ptr | out_dev.ptr) & 15) == 0
        sid = stream_key(stream)
        bits, fargs = features if features is not None else (0, None)
        fkey = None if fargs is None else feature_key(fargs)
        key = (n_heads, algorithm, aligned, sid, length_on_device, attention.OVERRIDES, bits, fkey,
               q_dev.dtype)  # fmt: skip
        record = self._records.get(key)
        if record is None:
            record = self._records.keep(key, assemble(
                q_dev, self._k, self._v, out_dev, stream=stream_handle(sid), keep_workspace=False,
                n_heads=n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                seq_len=self.capacity if length_on_device else 0,
                seq_len_dev=self.state if length_on_device else None,
                plan_seq=self._plan_seq(fargs), aligned=aligned, algorithm=algorithm,
                dtype=q_dev.dtype if self.fp8 else self.dtype, bits=bits, fp8=self.fp8,
                features=fargs, kv_scales=self.kv_scales,
                workspace=lambda floats: self.split_workspace(n_heads, floats),
            ))  # fmt: skip
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
        with self.lock:
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
        qdt = self.q_dtype_for(q_dtype, algorithm)
        with self.lock:
            self._prepare(n_heads, algorithm, bits, feats.sliding_window, qdt)

    def q_dtype_for(self, q_dtype: DTypeLike, algorithm: str) -> np.dtype:
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
        self.check_open()
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
            plan, _ = planned(
                self.device, qdt, n_heads, self.n_kv_heads, self.head_dim, plan_seq, aligned,
                bits, self.fp8, lambda floats: self.split_workspace(n_heads, floats),
            )  # fmt: skip
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
        with self.lock:
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
        for dec in (*self._decoders.values(), *self.feature_decoders.values()):
            dec.close()
        self._decoders.clear()
        self.feature_decoders.clear()
        self._records.clear()
        self.appenders.clear()
        self.async_records.clear()
        self._workspaces.clear()
        self._outgrown.clear()
        self._ring.close()
        for ev in self._join_events or ():
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


def check_cache(kv: Any) -> KVCache:
    """``kv``, checked to be an open KVCache (the device ops' and graphs' first check)."""
    if not isinstance(kv, KVCache):
        raise TypeError(f"kv: expected a ferrox_driver.KVCache, got {type(kv).__name__}")
    if kv._closed or kv.stream._closed:
        kv.check_open()
    return kv


class _AppendsTo:
    """Kept by a ferrox graph that appends to ``kv``: each launch of it tells the cache
    that its length changed on the device (see GraphExec.launch)."""

    def __init__(self, kv: KVCache) -> None:
        self.kv = kv

    def _on_graph_launch(self) -> None:
        self.kv.mark_device_appends()
