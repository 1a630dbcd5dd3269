"""``LatentCache``: an MLA (multi-head latent attention) cache, one latent row per token,
grown a row at a time on the GPU and decoded by `mla_decode`.

A DeepSeek V2/V3 layer caches ``(c_kv, k_rope)`` per token, ``kv_lora_rank + rope_dim``
(512 + 64) columns, read as the key by every query head and, its first ``kv_lora_rank``
columns, as the value. The cache holds those rows in bf16/fp16, or fp8 quantized on the
device as they arrive, and keeps its length as a `KVCache` does (on the host and on the
device, so one captured graph serves every token).

It is built on the KVCache machinery, not beside it: its store is a KVCache of one KV head
of the latent's width whose V is its K (one buffer), so the staging ring, the length
protocol, the fp8 quantizing appends, device appends, ``kv_append_async`` and
``kv_truncate_async`` are the KVCache's own; what writes K and V writes the same row to the
same place. Its decodes are `mla_decode` over that buffer, reading the device's length.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from ..archs import FP8_FROM, TENSOR_CORES_FROM
from ..decode.checks import MAX_TOKENS, check_host_extent, check_int
from ..decode.features import check_features
from ..decode.fp8 import FP8_DTYPES, ROW_DTYPES, check_scales
from ..decode.latent import MLA_MAX_HEADS, MLA_MAX_QUERIES, mla_decode
from ..decode.queries import check_query_count
from ..driver.calls import check, drv, memcpy_htod_raw
from ..driver.device import Device, resolve
from ..driver.graph import relaxed_capture
from ..driver.interop import array_ref
from ..driver.memory import DeviceArray, as_dtype, empty
from ..driver.pool import output_pool
from ..driver.stream import Stream, call_stream, stream_handle, stream_key
from ..errors import FerroxError, KVCapacityError
from ..kernels.spec import LATENT_MAX_HEAD_DIM
from ..types import ArrayLike, DeviceArrayLike, DeviceLike, DTypeLike, StreamLike
from .device_ops import kv_append_async, kv_truncate_async
from .four_bit import refuse_four_bit
from .kv_cache import KVCache, append_kernel
from .staging import STAGING_SLOTS
from .state import capturing

__all__ = ["LatentCache", "check_latent_queries", "check_latent_rows"]

_HALF = ("float16", "bfloat16")
_F32 = np.dtype(np.float32)


def check_latent_rows(
    shape: tuple[int, ...], dtype: np.dtype, width: int, cache_dtype: np.dtype, fp8: str
) -> int:
    """The tokens in latent rows of ``shape`` and ``dtype`` for a cache of rows ``width``
    wide: one row ``(width,)`` or ``(1, width)``, or n rows ``(n, width)``; of the cache's
    dtype, or float32/float16/bfloat16 for an fp8 cache (``fp8``: its format, else "").

    Raises:
        TypeError, ValueError: naming ``rows``.
    """
    if fp8 and dtype not in ROW_DTYPES:
        raise TypeError(f"rows: expected float32, float16 or bfloat16 rows (quantized into the "
                        f"{cache_dtype} cache), got {dtype}")  # fmt: skip
    if not fp8 and dtype != cache_dtype:
        raise TypeError(f"rows: expected {cache_dtype} (the cache's dtype), got {dtype}")
    shape = tuple(shape)
    if shape == (width,):
        return 1
    if len(shape) == 2 and shape[1] == width:
        return int(shape[0])
    raise ValueError(f"rows: expected one latent row ({width},) or rows (n, {width}), got {shape}")


def check_latent_queries(
    shape: tuple[int, ...], dtype: np.dtype, width: int, cache_dtype: np.dtype, fp8: str
) -> tuple[int, int]:
    """``(n_q, n_heads)`` of queries of ``shape`` and ``dtype`` for a cache of rows
    ``width`` wide: ``(n_heads, width)`` (n_q 1) or ``(n_q, n_heads, width)``, up to 128
    heads and 16 queries; of the cache's dtype, or float16/bfloat16 for an fp8 cache.

    Raises:
        TypeError, ValueError: naming ``q``.
    """
    if fp8 and np.dtype(dtype).name not in _HALF:
        raise TypeError(f"q: expected float16 or bfloat16 for an fp8 latent cache, got {dtype}")
    if not fp8 and dtype != cache_dtype:
        raise TypeError(f"q: expected {cache_dtype} (the cache's dtype), got {dtype}")
    shape = tuple(shape)
    if len(shape) not in (2, 3) or shape[-1] != width or 0 in shape:
        raise ValueError(f"q: expected (n_heads, {width}) or (n_q, n_heads, {width}) (the "
                         f"absorbed queries, the latent's width), got {shape}")  # fmt: skip
    n_q, n_heads = (int(shape[0]) if len(shape) == 3 else 1), int(shape[-2])
    if n_heads > MLA_MAX_HEADS:
        raise ValueError(f"q: up to {MLA_MAX_HEADS} query heads, got {n_heads}")
    if n_q > MLA_MAX_QUERIES:
        raise ValueError(f"q: up to {MLA_MAX_QUERIES} query tokens, got {n_q}")
    return n_q, n_heads


class _LatentStore(KVCache):
    """A latent cache's rows, as a KVCache of one KV head ``width`` wide whose V buffer is
    its K buffer: the KVCache's appends, length protocol and device ops serve it, each
    writing a row's K and V (the same row) to the one place. Built by `LatentCache`, whose
    arguments are checked; never handed to a user."""

    _kind = "LatentCache"

    def __init__(
        self, width: int, capacity: int, dtype: np.dtype, fp8: str, scale: float,
        device: Device, stream: Stream | None, slots: int,
    ) -> None:  # fmt: skip
        # (KVCache.__init__ checks and allocates a K/V pair; the store sets what it needs)
        self.n_kv_heads, self.head_dim, self.capacity = 1, width, capacity
        self.fp8, self.dtype, self.v_dtype = fp8, dtype, dtype
        self.device = device
        self._owns_stream = stream is None
        self.stream = Stream(device) if stream is None else stream
        self._h = stream_handle(self.stream)
        self.row_elems, self.row_bytes = width, width * dtype.itemsize
        self._row_shapes = ((width,), (1, width))
        self._k = self._v = empty((capacity, 1, width), dtype, device=device)
        self._k_ptr = self._v_ptr = self._k.ptr
        self._scales = np.full(2, scale, np.float32)  # (K's and V's scale: the one scale)
        self.kv_scales = None
        self.four_bit = None
        self.rotate = False
        self._init_state(slots)
        # decodes read the length on the device: every host append keeps it current there
        self._eager_seq = True
        if fp8:
            self._init_fp8(slots)
        # the device-side appends' module (one row, n rows, the bump, the roll-back) loaded
        # now, so that a capture of append_async or truncate_async need not load it
        append_kernel(device)
        self.stream.synchronize()

    def append_row(self, row: np.ndarray) -> None:
        """One checked numpy row of the cache's 16-bit dtype: staged, then one
        ``cuMemcpyHtoDAsync`` (as ``KVCache.append``'s, V being K), and the length."""
        with self.lock:
            if self._closed or self.stream._closed:
                self.check_open()
            seq = self._seq_len if self._host_seq_valid else self.seq_len
            if seq >= self.capacity:
                raise KVCapacityError(seq, self.capacity)
            self.device.activate()
            slot = self._take_slot()
            self._stage_k[slot] = row.reshape(-1)
            n, h = self.row_bytes, self._h
            src = self._stage_k_addr + slot * n
            check(memcpy_htod_raw(self._k_ptr + seq * n, src, n, h), "cuMemcpyHtoDAsync")
            self._seq_len = seq + 1
            if self._eager_seq:
                self._stage_seq[slot] = seq + 1
                drv("cuMemcpyHtoDAsync", self.state.ptr, self._stage_seq_addr + 4 * slot, 4, h)
            else:
                self._device_seq_current = False
            self._done_slot(slot)


class LatentCache:
    """The latent rows of one MLA layer (DeepSeek V2/V3, Kimi K2), resident on the GPU,
    grown a token at a time and decoded by `mla_decode`.

    Args:
        capacity: the most tokens it will hold (memory is allocated once, up front).
        kv_lora_rank: the latent's width, the values' (512 in DeepSeek V2/V3): a multiple
            of 128.
        rope_dim: the rope part of the key after it (64): the row is ``kv_lora_rank +
            rope_dim`` wide, a multiple of 64 up to 576.
        dtype: ``bfloat16`` (default) or ``float16``: rows and queries of that dtype; or
            fp8, ``ml_dtypes.float8_e4m3fn`` or ``float8_e5m2`` (compute capability 8.9
            and up): rows appended in float32, float16 or bfloat16 are quantized on the
            device (as `quantize_fp8` with ``kv_scale``), queries are float16 or bfloat16
            and the output is in q's dtype.
        kv_scale: an fp8 cache's scale (a positive float, default 1): it stores ``x /
            kv_scale`` and the decode reads ``byte * kv_scale``.
        device: the device (a Device, an int, a ``torch.device`` or ``"cuda:N"``;
            default: device 0). Compute capability 8.0 and up (the latent kernels).
        stream: the stream appends and decodes run on (default: a stream of its own).
        staging_slots: page-locked slots host rows are staged through (as `KVCache`'s).

    Appends and decodes are ordered on the cache's stream, and the length is kept on the
    host and on the device: ``decode`` and ``decode_async`` read it on the device, so a
    graph that captured ``append_async`` and ``decode_async`` once serves every token.
    Thread-safe as a KVCache is (one lock per cache). ``close()`` (or ``with``) frees the
    buffers unless a captured graph still uses them; a cache that is dropped unclosed frees
    them with its arrays' own finalizers. Every later use raises `ClosedError`.

    Attributes:
        width: ``kv_lora_rank + rope_dim``, the row's (and q's head's) width.
        fp8: the fp8 format (``"e4m3"``, ``"e5m2"``), or ``""`` for a 16-bit cache.
        kv_scale: an fp8 cache's scale, else None.
    """

    def __init__(
        self,
        capacity: int,
        *,
        kv_lora_rank: int = 512,
        rope_dim: int = 64,
        dtype: DTypeLike = "bfloat16",
        kv_scale: float | None = None,
        device: DeviceLike = None,
        stream: Stream | None = None,
        staging_slots: int = STAGING_SLOTS,
    ) -> None:
        self.capacity = check_int(capacity, "capacity", 1, MAX_TOKENS)
        self.kv_lora_rank = check_int(kv_lora_rank, "kv_lora_rank", 1, LATENT_MAX_HEAD_DIM)
        self.rope_dim = check_int(rope_dim, "rope_dim", 0, LATENT_MAX_HEAD_DIM)
        if self.kv_lora_rank % 128:
            raise ValueError(f"kv_lora_rank: a multiple of 128 (the values' width), got "
                             f"{kv_lora_rank}")  # fmt: skip
        self.width = self.kv_lora_rank + self.rope_dim
        if self.width % 64 or self.width > LATENT_MAX_HEAD_DIM:
            raise ValueError(f"rope_dim: kv_lora_rank + rope_dim must be a multiple of 64 up to "
                             f"{LATENT_MAX_HEAD_DIM}, got {kv_lora_rank} + {rope_dim}")  # fmt: skip
        refuse_four_bit(dtype, "LatentCache")
        dt = as_dtype(dtype, "dtype")
        self.fp8: str = FP8_DTYPES.get(dt, "")
        if not self.fp8 and dt.name not in _HALF:
            raise TypeError(f"dtype: expected bfloat16, float16, float8_e4m3fn or float8_e5m2 "
                            f"(what the latent kernels read), got {dt}")  # fmt: skip
        self.dtype = dt
        if kv_scale is not None and not self.fp8:
            raise ValueError(f"kv_scale: only an fp8 cache takes a scale ({dt} rows are "
                             "stored as they are)")  # fmt: skip
        scale = float(check_scales(kv_scale, 1, "kv_scale")[0])
        self.kv_scale = scale if self.fp8 else None
        slots = check_int(staging_slots, "staging_slots", 1)
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"stream: expected a ferrox_driver.Stream, got {type(stream)}")
        self.device = resolve(device)
        cc = self.device.compute_capability
        if cc < TENSOR_CORES_FROM:
            raise ValueError(f"device: the latent kernels need compute capability "
                             f"{TENSOR_CORES_FROM} or newer; device {self.device.ordinal} has "
                             f"{cc}")  # fmt: skip
        if self.fp8 and cc < FP8_FROM:
            raise ValueError(f"dtype: an fp8 latent cache needs compute capability {FP8_FROM} or "
                             f"newer; device {self.device.ordinal} has {cc}")  # fmt: skip
        store = self._store = _LatentStore(self.width, self.capacity, dt, self.fp8, scale,
                                           self.device, stream, slots)  # fmt: skip
        self.stream = store.stream
        # what mla_decode reads, as views made once: the rows, the device's length, the scale
        self._ckv = store._k.view((self.capacity, self.width))
        self._length = store.state.view((1,), np.int32)
        self._scale_d = None if store.kv_scales is None else store.kv_scales.view((1,), _F32)

    # -- state ---------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        """Tokens in the cache. After device-side appends (``append_async`` in a graph)
        this waits for the cache's stream and reads the device's length."""
        return self._store.seq_len

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (or the cache's stream was closed)."""
        return self._store.closed

    @property
    def latent(self) -> DeviceArray:
        """Device view of the ``seq_len`` rows, shape (seq_len, width), in the cache's dtype
        (an fp8 cache's: its bytes)."""
        return self._ckv.view((self.seq_len, self.width))

    @property
    def latent_buffer(self) -> DeviceArray:
        """The whole buffer, (capacity, width): what the torch op ``ferrox::mla_decode``
        takes as ``latent`` (``torch.from_dlpack`` views it without a copy)."""
        self._store.check_open()
        return self._ckv

    @property
    def length(self) -> DeviceArray:
        """The device's copy of the length, one int32 (the torch op's ``seq_len``), current
        in the order of the cache's stream."""
        self._store.check_open()
        return self._length

    def to_host(self) -> np.ndarray:
        """A copy of the ``seq_len`` rows, (seq_len, width), in the cache's dtype (an fp8
        cache's: its bytes; ``dequantized`` scales them)."""
        store = self._store
        with store.lock:
            return self._ckv.view((store.seq_len, self.width)).to_host(store.stream)

    def dequantized(self) -> np.ndarray:
        """The rows as float32, as the decode reads them: an fp8 cache's values times
        ``kv_scale``, a 16-bit cache's values."""
        rows = self.to_host().astype(np.float32)
        return rows * np.float32(self.kv_scale) if self.fp8 else rows

    def synchronize(self) -> None:
        """Wait for the work queued on the cache's stream and read the device's length.

        Raises:
            KVCapacityError: an ``append_async`` found the cache full (nothing was written).
            ClosedError: the cache or its stream was closed.
        """
        self._store.synchronize()

    def clear(self) -> None:
        """Forget every token (a new sequence); the memory stays allocated.

        Raises:
            ClosedError: the cache or its stream was closed.
        """
        self._store.clear()

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens and forget the rest (a rejected draft's): O(1),
        nothing copied; the next append writes token ``n``.

        Raises:
            ValueError: ``n`` outside ``[0, seq_len]`` (nothing changed).
            TypeError: ``n`` not an int.
            ClosedError: the cache or its stream was closed.
        """
        self._store.truncate(n)

    def truncate_async(self, n_dev: DeviceArrayLike, *, stream: StreamLike) -> None:
        """Queue a roll-back to the first ``n_dev[0]`` tokens, a count read on the device
        (as `kv_truncate_async`): capturable.

        Args:
            n_dev: one int32 on the cache's device.
            stream: where to queue it (None: PyTorch's current stream for a PyTorch
                ``n_dev``, else the legacy default stream).

        Raises:
            TypeError, ValueError: naming ``n_dev``, before any device work.
        """
        stream = call_stream(stream, n_dev)
        with _relaxed_if_captured(stream):
            kv_truncate_async(self._store, n_dev, stream=stream)

    # -- appends -------------------------------------------------------------------
    def append(self, rows: ArrayLike, *, stream: StreamLike = None) -> None:
        """Append one token's latent row, ``(width,)`` or ``(1, width)``, or n tokens' rows
        ``(n, width)``: ``(c_kv, k_rope)`` of each, in the cache's dtype (an fp8 cache:
        float32, float16 or bfloat16, quantized on the device).

        Queued on the cache's stream; returns without waiting. numpy rows: one row is
        staged in page-locked memory and copied by one ``cuMemcpyHtoDAsync`` (an fp8 row
        goes in the arguments of the launch that quantizes it), n rows by one copy. Device
        rows (a PyTorch CUDA tensor, DeviceArray, CuPy...) are copied (or quantized)
        device to device, after the work queued so far on ``stream``, whose later work
        waits for them. Not capturable: a graph appends with ``append_async``.

        Args:
            rows: the rows.
            stream: with device rows, the stream they were written on (None: PyTorch's
                current stream for a PyTorch tensor, else the legacy default stream);
                numpy rows ignore it.

        Raises:
            TypeError, ValueError: rows of the wrong type, dtype or width.
            KVCapacityError: they would not fit. Nothing was written in either case.
            ClosedError: the cache or its stream was closed.
            FerroxError: device rows with ``stream`` being captured into a graph.
        """
        store = self._store
        if isinstance(rows, np.ndarray):
            n = check_latent_rows(rows.shape, rows.dtype, self.width, self.dtype, self.fp8)
            check_host_extent(rows, "rows")
            if n != 1:
                store.extend(rows, rows)
            elif self.fp8:  # (KVCache.append's quantizing append, V being K)
                store.append(rows, rows)
            else:
                store.append_row(rows)
            return
        ref, n = self._device_rows(rows)
        sid = stream_key(call_stream(stream, rows, ref[3]))
        if capturing(sid):
            raise FerroxError("stream: LatentCache.append of device rows cannot be captured "
                              "into a graph (it reads the cache's length on the host): capture "
                              "LatentCache.append_async, which reads it on the device")  # fmt: skip
        store._extend_device(rows, rows, ("rows", "rows"), n == 1, stream)

    def append_async(self, rows: DeviceArrayLike, *, stream: StreamLike) -> None:
        """Queue a device-side append of one row ``(width,)``/``(1, width)`` or n rows
        ``(n, width)`` at the length read on the device, which is then bumped by n (as
        `kv_append_async`): capturable into a graph (ferrox's, PyTorch's, CuPy's).

        A cache too full for the rows gets none of them: the device sets a flag and
        ``synchronize()`` raises KVCapacityError.

        Args:
            rows: device rows, of the cache's dtype (an fp8 cache: float32, float16 or
                bfloat16, quantized on the device).
            stream: where to queue it (None: PyTorch's current stream for a PyTorch
                tensor, else the legacy default stream).

        Raises:
            TypeError, ValueError: naming ``rows``, before any device work.
        """
        stream = call_stream(stream, rows)
        ref, n = self._device_rows(rows)
        if n < 1:
            raise ValueError(f"rows: expected one row or more, got shape {tuple(ref[1])}")
        # n rows as the KVCache's (n, n_kv_heads, head_dim), a view of the caller's memory
        view = rows if n == 1 else DeviceArray._wrap(ref[0], (n, 1, self.width), ref[2],
                                                     self.device, rows)  # fmt: skip
        with _relaxed_if_captured(stream):
            kv_append_async(self._store, view, view, stream=stream)

    def _device_rows(self, rows: Any) -> tuple[Any, int]:
        """``rows``' array ref and tokens, checked to be device rows on the cache's device,
        contiguous.

        Raises:
            TypeError, ValueError: naming ``rows``.
        """
        ref = array_ref(rows, "rows")
        if ref is None:
            raise TypeError("rows: expected a device array, got a numpy array (LatentCache."
                            "append takes numpy rows)")  # fmt: skip
        n = check_latent_rows(ref[1], ref[2], self.width, self.dtype, self.fp8)
        if ref[3] != self.device.ordinal:
            raise ValueError(f"rows: on device {ref[3]}, but the cache is on device "
                             f"{self.device.ordinal}")  # fmt: skip
        if not ref[4]:
            raise ValueError(f"rows: must be C-contiguous, got a strided view of shape "
                             f"{tuple(ref[1])}")  # fmt: skip
        return ref, n

    # -- decodes -------------------------------------------------------------------
    def decode(
        self,
        q: ArrayLike,
        *,
        out: DeviceArrayLike = None,
        lse: DeviceArrayLike = None,
        return_lse: bool = False,
        scale: float | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: ArrayLike = None,
        stream: StreamLike = None,
    ) -> ArrayLike | tuple[ArrayLike, ArrayLike]:
        """Multi-head latent attention of one query token (or of the last n_q) over every
        token in the cache: `mla_decode` over its rows, reading the length on the device.

        numpy q in, numpy out (copied in and back, complete). A device q (PyTorch CUDA
        tensor, DeviceArray, CuPy...) gives a DeviceArray (or ``out``), queued on the
        cache's stream after the work queued so far on ``stream``, whose later work then
        waits for the result. Not capturable: a graph decodes with ``decode_async``.

        Args:
            q: ``(n_heads, width)`` or ``(n_q, n_heads, width)``: the absorbed queries
                (q_nope W_UK, then q_rope), of the cache's dtype (an fp8 cache: float16 or
                bfloat16); 1 to 128 heads. With n_q queries, query t is the cache's token
                ``seq_len - n_q + t`` (append their rows first), causal; n_q up to 16.
            out: with a device q, a device array ``(n_heads, kv_lora_rank)`` (``(n_q,
                n_heads, kv_lora_rank)``) of q's dtype to write.
            lse: with a device q, a float32 device array ``(n_heads,)`` (``(n_q,
                n_heads)``) for the LSE (implies ``return_lse``).
            return_lse: also return the log-sum-exp of the scores per row (natural log).
            scale: the score scale (default ``1/sqrt(width)``; DeepSeek's is
                ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`` times its mscale).
            sliding_window: attend to the last ``sliding_window`` tokens.
            logits_soft_cap: scores become ``cap * tanh(score / cap)``.
            sinks: one float32 logit per query head in the softmax's denominator.
            stream: with a device q, the stream it was written on (None: PyTorch's current
                stream for a PyTorch tensor, else the legacy default stream).

        Returns:
            The output in the latent space, ``q.shape[:-1] + (kv_lora_rank,)`` in q's
                dtype (apply W_UV and W_O after it); with the LSE, ``(out, lse)``. No
                tokens give zeros (and an LSE of -inf, or the sink's logit).

        Raises:
            TypeError, ValueError: naming the argument, before any device work.
            ClosedError: the cache or its stream was closed.
            FerroxError: a device q with ``stream`` being captured into a graph.
        """
        host = isinstance(q, np.ndarray)
        ref = None if host else array_ref(q, "q")
        shape, dtype = (q.shape, q.dtype) if ref is None else (tuple(ref[1]), np.dtype(ref[2]))
        n_q, n_heads = check_latent_queries(shape, dtype, self.width, self.dtype, self.fp8)
        feats = dict(scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                     sinks=sinks)  # fmt: skip
        want_lse = check_features(n_heads, return_lse=return_lse, **feats).return_lse
        store = self._store
        out_shape = (*shape[:-1], self.kv_lora_rank)
        if host:
            for given, name in ((out, "out"), (lse, "lse")):
                if given is not None:
                    raise TypeError(f"{name}: only with a device q; a numpy q returns new arrays")
            with store.lock:
                store.check_open()
                if len(shape) == 3:
                    check_query_count(n_q, store.seq_len)
                dev, s = self.device, store.stream
                sid = stream_key(s)
                dev.activate()
                store.device_length()  # (current already: host appends keep it so)
                q_d = output_pool(dev, sid, q.nbytes).take(shape, dtype)
                q_d.copy_from_host(np.ascontiguousarray(q), s)
                out_d = output_pool(dev, sid, _nbytes(out_shape, dtype)).take(out_shape, dtype)
                lse_d = (output_pool(dev, sid, 4 * n_q * n_heads).take(shape[:-1], _F32)
                         if want_lse else None)  # fmt: skip
                self._mla(q_d, out_d, lse_d, s, feats)
                got = out_d.to_host(s)
                return got if lse_d is None else (got, lse_d.to_host(s))
        assert ref is not None
        if ref[3] != self.device.ordinal:
            raise ValueError(f"q: on device {ref[3]}, but the cache is on device "
                             f"{self.device.ordinal}")  # fmt: skip
        sid = stream_key(call_stream(stream, q, ref[3]))
        if capturing(sid):
            raise FerroxError("stream: LatentCache.decode of a device q cannot be captured into "
                              "a graph (it joins the cache's stream on the host): capture "
                              "LatentCache.decode_async instead")  # fmt: skip
        with store.lock:
            store.check_open()
            if len(shape) == 3:
                check_query_count(n_q, store.seq_len)
            dev = self.device
            dev.activate()
            joined = store.join(sid, "decode", "LatentCache.decode_async")
            try:
                if out is None:
                    out = output_pool(dev, sid, _nbytes(out_shape, dtype)).take(out_shape, dtype)
                store.device_length()  # (current already: host appends keep it so)
                if lse is None and want_lse:
                    lse = output_pool(dev, sid, 4 * n_q * n_heads).take(shape[:-1], _F32)
                return self._mla(q, out, lse, store.stream, feats)
            finally:
                if joined:
                    store.rejoin(sid)

    def decode_async(
        self,
        q: DeviceArrayLike,
        out: DeviceArrayLike,
        *,
        lse: DeviceArrayLike = None,
        scale: float | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: DeviceArrayLike = None,
        stream: StreamLike,
    ) -> None:
        """Queue `mla_decode` of device ``q`` into ``out`` over the cache's rows, the length
        read on the device: capturable into a graph (ferrox's, PyTorch's, CuPy's), which
        then serves every length. Ordering it after the cache's appends (the cache's
        stream, or ``append_async`` on ``stream``) is the caller's, as for
        `gqa_decode_async`.

        Args:
            q: device queries ``(n_heads, width)`` or ``(n_q, n_heads, width)``, as for
                ``decode``.
            out: a device array ``q.shape[:-1] + (kv_lora_rank,)`` of q's dtype.
            lse: a float32 device array ``q.shape[:-1]`` for the LSE, or None.
            scale: as ``decode``.
            sliding_window: as ``decode``.
            logits_soft_cap: as ``decode``.
            sinks: a float32 device array, one logit per query head (read at each run).
            stream: where to queue it (None: PyTorch's current stream for a PyTorch q,
                else the legacy default stream).

        Raises:
            TypeError, ValueError: naming the argument, before any device work.
            ClosedError: the cache or its stream was closed.
        """
        stream = call_stream(stream, q)
        qr, outr = array_ref(q, "q"), array_ref(out, "out")
        if qr is None or outr is None:
            raise TypeError(f"{'q' if qr is None else 'out'}: expected a device array, got a "
                            "numpy array (decode takes numpy)")  # fmt: skip
        shape, dtype = tuple(qr[1]), np.dtype(qr[2])
        n_q, n_heads = check_latent_queries(shape, dtype, self.width, self.dtype, self.fp8)
        if n_q > self.capacity:
            check_query_count(n_q, self.capacity)
        if qr[3] != self.device.ordinal:
            raise ValueError(f"q: on device {qr[3]}, but the cache is on device "
                             f"{self.device.ordinal}")  # fmt: skip
        _check_out(outr, "out", (*shape[:-1], self.kv_lora_rank), dtype, qr[3])
        if lse is not None:
            _check_out(array_ref(lse, "lse"), "lse", shape[:-1], _F32, qr[3])
        if sinks is not None and array_ref(sinks, "sinks") is None:
            raise TypeError("sinks: expected a float32 device array (a graph reads it at each "
                            "run), got a numpy array")  # fmt: skip
        feats = dict(scale=scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                     sinks=sinks)  # fmt: skip
        check_features(n_heads, return_lse=lse is not None, **feats)
        sid = stream_key(stream)
        store = self._store
        foreign = sid != 0 and not isinstance(stream, Stream)
        kept = tuple(x for x in (lse, sinks) if x is not None)
        with store.lock:  # (the length protocol: brought up to date, or kept with a graph)
            store.check_open()
            store.queue_decode(lambda _ptrs: self._mla(q, out, lse, stream, feats), qr[0],
                               outr[0], sid, foreign, qr, outr, (q, out), kept)  # fmt: skip

    def _mla(self, q: Any, out: Any, lse: Any, stream: Any, feats: dict[str, Any]) -> Any:
        """`mla_decode` of device ``q`` over the rows to the device's length, on
        ``stream``."""
        with _relaxed_if_captured(stream):
            return mla_decode(q, self._ckv, self._length, head_dim_v=self.kv_lora_rank, out=out,
                              lse=lse, stream=stream, kv_scale=self._scale_d,
                              return_lse=lse is not None, **feats)  # fmt: skip

    # -- lifetime ------------------------------------------------------------------
    def _resources(self) -> tuple[Any, ...]:
        """The device memory a graph that uses this cache must hold (see Graph)."""
        return self._store._resources()

    def close(self) -> None:
        """Free the buffers, the staging memory and (if its own) the stream, once queued
        work is done; buffers a captured graph still uses go with the last such graph.
        Every later use raises `ClosedError`; closing again does nothing."""
        self._store.close()

    def __enter__(self) -> LatentCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"seq_len={self._store._seq_len}"
        return (f"LatentCache(capacity={self.capacity}, kv_lora_rank={self.kv_lora_rank}, "
                f"rope_dim={self.rope_dim}, dtype={self.dtype.name}, {state})")  # fmt: skip


def _relaxed_if_captured(stream: Any) -> contextlib.AbstractContextManager[None]:
    """Inside a capture of ``stream``, this thread's capture mode relaxed: a first use may
    load its kernels and make its workspace there (neither is captured)."""
    return relaxed_capture() if capturing(stream_key(stream)) else contextlib.nullcontext()


def _nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _check_out(ref: Any, name: str, shape: tuple[int, ...], dtype: np.dtype, ordinal: int) -> None:
    """A device output ``name`` (its array ref, None for a numpy array), checked to be
    C-contiguous ``shape`` of ``dtype`` on device ``ordinal``.

    Raises:
        TypeError, ValueError: naming ``name``.
    """
    if ref is None:
        raise TypeError(f"{name}: expected a device array, got a numpy array")
    if tuple(ref[1]) != shape or np.dtype(ref[2]) != dtype or not ref[4]:
        raise ValueError(f"{name}: expected a C-contiguous device array {shape} of {dtype}, got "
                         f"{tuple(ref[1])} of {np.dtype(ref[2])}")  # fmt: skip
    if ref[3] != ordinal:
        raise ValueError(f"{name}: on another device than q")
