"""A KV cache's state and its length protocol: the sequence length on the host and on the
device, who brings the device copy up to date (host appends, device appends, graph
replays), streams joining the cache's own, and the checks every use makes first. The one
place that reads or writes that state; `KVCache` (appends, decodes, lifetime) and the
device ops and graphs over caches go through its methods."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..decode.checks import (
    check_int,
    dtype_name,
)
from ..decode.records import Kept
from ..driver.calls import (
    capture_keep,
    drv,
    stream_of,
)
from ..driver.calls import capture_state as _capture_state
from ..driver.device import Device
from ..driver.graph import keep_for_capture, stream_capturing
from ..driver.launch import PackedLaunch
from ..driver.memory import DeviceArray, empty
from ..driver.stream import Event, Stream
from ..errors import ClosedError, FerroxError, KVCapacityError
from .host_decode import HostDecoder
from .staging import StagingRing

__all__ = ["CacheState", "capturing"]


def capturing(sid: int) -> bool:
    """Whether work queued now on the stream with int handle ``sid`` would be captured into
    a graph: a ferrox capture open on this thread, or any capture of that stream."""
    return bool(getattr(_capture_state, "depth", 0) or (sid and stream_capturing(sid)))


class CacheState:
    """What every part of `KVCache` shares: its buffers, staging and length state
    (declared here, set by `KVCache.__init__` and ``_init_state``), and the length
    protocol's methods."""

    _kind = "KVCache"  # the cache's name in errors (a LatentCache's store names its own)
    # V rows of a width of their own (KVCache(head_dim_v=...)): their sizes, staging, appends
    # and decode (own_values.OwnValues); None for every other cache, whose paths never look
    own_v: Any = None

    n_kv_heads: int
    head_dim: int
    capacity: int
    fp8: str
    dtype: np.dtype
    device: Device
    stream: Stream
    row_elems: int
    row_bytes: int
    state: DeviceArray
    kv_scales: DeviceArray | None
    four_bit: Any  # a 4-bit cache's FourBitStore (block scales, appends), else None
    rotate: bool
    lock: Any
    appenders: dict[tuple[Any, ...], Any]
    async_records: Kept
    feature_decoders: dict[tuple[Any, ...], HostDecoder]
    _owns_stream: bool
    _h: Any
    _row_shapes: Any
    _k: DeviceArray
    _v: DeviceArray
    _k_ptr: int
    _v_ptr: int
    _scales: Any
    _ring: StagingRing
    _stage_k: np.ndarray
    _stage_v: np.ndarray
    _stage_seq: np.ndarray
    _stage_kv: np.ndarray
    _stage_k_addr: int
    _stage_v_addr: int
    _stage_seq_addr: int
    _stage_kv_addr: int
    _dev_stage: Any
    _take_slot: Any
    _done_slot: Any
    _seq_len: int
    _host_seq_valid: bool
    _device_seq_current: bool
    _eager_seq: bool
    _graph_appends: Any
    _workspaces: dict[int, DeviceArray]
    _outgrown: list[DeviceArray]
    _records: Kept
    _decoders: dict[tuple[int, str, np.dtype], HostDecoder]
    _join_events: tuple[Event, Event] | None
    _closed: bool
    _fp8_appends: dict[np.dtype, tuple[np.ndarray, PackedLaunch]]
    _fp8_value_appends: dict[np.dtype, tuple[np.ndarray, PackedLaunch] | None]

    def _init_state(self, slots: int) -> None:
        """The length's device copy, the staging ring of ``slots``, the length flags, the
        memos and the lock: what a cache sets up once its shape, dtype, device, stream and
        buffers are set (``KVCache.__init__``; a LatentCache's store)."""
        # state[0] = seq_len, state[1] = a flag set by kernels, read by the host (1: an append
        # past the capacity; 2: kv_truncate_async given a negative length).
        self.state = empty((2,), np.int32, device=self.device)
        self.state.fill_bytes(0, self.stream)
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
            self._stage_kv_addr = ring.kv.ctypes.data
        self._seq_len = 0
        self._host_seq_valid = True
        self._device_seq_current = True  # state[0] == seq_len once queued work has run
        self._eager_seq = False  # a graph captured elsewhere reads state[0]: keep it current
        # A graph captured elsewhere (PyTorch, CuPy) appends: ferrox cannot see its replays,
        # so the host length is never trusted again (each host use reads the device's).
        self._graph_appends = False
        self._workspaces = {}
        self._outgrown = []  # graphs captured earlier may still write them
        self._records = Kept()  # this cache's launch records, by signature
        self._decoders = {}
        self.feature_decoders = {}  # (host_decode's)
        self.appenders = {}  # kv_append_async's packed launches
        self.async_records = Kept()  # gqa_decode_async's validated calls
        self._join_events = None  # (made at a device call's join)
        self._closed = False
        # Appends, decodes and the state they share (length, staging ring, scratch) are
        # ordered by one lock: re-entrant, as a decode may synchronize to read the length.
        self.lock = threading.RLock()  # (public: the device ops and graphs take it too)

    # -- lifetime checks -------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (or the cache's stream was closed)."""
        return self._closed or self.stream._closed

    def check_open(self, user: str = "") -> None:
        """Raise ClosedError when the cache, or the stream it runs on, was closed; naming
        ``user`` (``"DecodeGraph"``...), the object that uses the cache, where given."""
        if self._closed and user:
            raise ClosedError(user, f"uses a {self._kind} that was closed")
        if self._closed:
            raise ClosedError(self._kind)
        if self.stream._closed:
            raise ClosedError(user or self._kind, "runs on a Stream that was closed")

    def _resources(self) -> tuple[Any, ...]:
        """The device memory a graph that uses this cache must hold (see Graph)."""
        self.check_open()
        scales = () if self.kv_scales is None else (self.kv_scales,)
        if self.four_bit is not None:
            scales += (self.four_bit.k_scales, self.four_bit.v_scales)
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
                if state[1] == 2:
                    raise FerroxError(
                        "n_dev: kv_truncate_async was given a negative length; the cache kept "
                        f"its {self._seq_len} tokens"
                    )
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

    def length_for_step(self, user: str, adding: int = 1) -> int:
        """The length a host-ordered step that appends ``adding`` tokens (a graph's replay)
        starts at: the host's, or the device's where device work changed it.

        Raises:
            ClosedError: the cache or its stream was closed, naming ``user``.
            KVCapacityError: the tokens would not fit.
        """
        if self._closed or self.stream._closed:
            self.check_open(user)
        seq = self._seq_len if self._host_seq_valid else self.seq_len
        if seq > self.capacity - adding:
            raise KVCapacityError(seq, self.capacity, adding)
        return seq

    def appending_on_device(self) -> None:
        """Before a replay of a graph that appends on the device: the device's length
        brought up to date, and the host's no longer trusted until known again."""
        if not self._device_seq_current:
            self.device_length()
        self._host_seq_valid = False

    def replay_appended(self, seq: int, adding: int = 1) -> None:
        """After a synchronized replay that appended ``adding`` tokens at ``seq`` (checked
        to fit, so it cannot have overflowed): the length is ``seq + adding``, known without
        reading the device (unless a graph ferrox cannot see appends too)."""
        self._seq_len, self._host_seq_valid = seq + adding, not self._graph_appends

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
        """Device view of the ``seq_len`` K rows, shape (seq_len, n_kv_heads, head_dim).

        Raises:
            ValueError: a 4-bit cache (packed values and block scales: ``to_host``,
                ``block_scales``, ``dequantized``, ``k_buffer``).
        """
        self._refuse_packed("k")
        return self._k.view((self.seq_len, self.n_kv_heads, self.head_dim))

    def _refuse_packed(self, name: str) -> None:
        if self.four_bit is not None:
            raise ValueError(
                f"{name}: a 4-bit cache's rows are packed values with block scales, not "
                f"rows of head_dim elements: read them with to_host() and block_scales(), "
                f"as float32 with dequantized(), or whole with {name}_buffer"
            )

    @property
    def head_dim_v(self) -> int:
        """V's width: ``head_dim``, or the cache's ``head_dim_v`` where it differs."""
        return self.head_dim if self.own_v is None else self.own_v.head_dim_v

    @property
    def v(self) -> DeviceArray:
        """Device view of the ``seq_len`` V rows, shape (seq_len, n_kv_heads, head_dim_v)
        (a 4-bit cache: ValueError, as ``k``)."""
        self._refuse_packed("v")
        if self.own_v is not None:
            return self._v.view((self.seq_len, self.n_kv_heads, self.own_v.head_dim_v))
        return self._v.view((self.seq_len, self.n_kv_heads, self.head_dim))

    @property
    def k_buffer(self) -> DeviceArray:
        """The whole K buffer, (capacity, n_kv_heads, head_dim); a 4-bit cache's packed
        values, uint8 (n_kv_heads, capacity, head_dim // 2), head-major (the default), or
        (capacity, n_kv_heads, head_dim // 2) where it is token-major (``kv_layout="NHD"``,
        or K and V in formats of their own)."""
        self.check_open()
        return self._k

    @property
    def v_buffer(self) -> DeviceArray:
        """The whole V buffer, (capacity, n_kv_heads, head_dim_v) (a 4-bit cache's: as
        ``k_buffer``)."""
        self.check_open()
        return self._v

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
        if capturing(sid):
            raise FerroxError(
                f"stream: {self._kind}.{call} with device arrays cannot be captured into a graph "
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

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens and forget the rest (a speculative draft's rejected
        tokens): O(1), nothing copied or cleared, every token below ``n`` as it was; the
        next append writes token ``n``. From a count known only on the device (a captured
        verify loop): ``fd.kv_truncate_async``.

        Raises:
            ValueError: ``n`` outside ``[0, seq_len]``, naming it (nothing changed).
            TypeError: ``n`` not an int.
            ClosedError: the cache or its stream was closed.
        """
        with self.lock:
            seq = self.seq_len  # (after device appends: waits, reads the device's)
            n = check_int(n, "n", 0, seq)
            if n == seq:
                return
            self.device.activate()
            self._seq_len = n
            self._host_seq_valid = not self._graph_appends
            self._device_seq_current = False
            self.device_length()

    # -- reading -------------------------------------------------------------------
    def to_host(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the cached K and V, each (seq_len, n_kv_heads, head_dim), in the
        cache's dtype (an fp8 cache's: its bytes; ``dequantized`` scales them); a 4-bit
        cache's packed values, uint8 (seq_len, n_kv_heads, head_dim // 2) (its block
        scales: ``block_scales()``). K and V in formats of their own: each as its format
        stores it."""
        with self.lock:
            seq = self.seq_len
            k, v = self._k, self._v
            if self.four_bit is not None:  # (its rows in either layout)
                return self.four_bit.tokens(k, seq), self.four_bit.tokens(v, seq)
            return k.view((seq, *k.shape[1:])).to_host(self.stream), v.view(
                (seq, *v.shape[1:])
            ).to_host(self.stream)

    @property
    def dtype_name(self) -> str:
        """``f32``, ``f16`` or ``bf16``; an fp8 cache's format, ``e4m3`` or ``e5m2``."""
        return self.fp8 or dtype_name(self.dtype)

    def _queue_seq(self, slot: int, seq_len: int) -> None:
        self._stage_seq[slot] = seq_len
        drv("cuMemcpyHtoDAsync", self.state.ptr, self._stage_seq_addr + 4 * slot, 4, self._h)
        self._done_slot(slot)
        self._device_seq_current = True


class _AppendsTo:
    """Kept by a ferrox graph that appends to ``kv``: each launch of it tells the cache
    that its length changed on the device (see GraphExec.launch)."""

    def __init__(self, kv: CacheState) -> None:
        self.kv = kv

    def _on_graph_launch(self) -> None:
        self.kv.mark_device_appends()
