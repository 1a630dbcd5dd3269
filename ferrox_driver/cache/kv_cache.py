"""Device-resident KV caches: one-row asynchronous appends, multi-layer caches.

Layout is ferrox-cuda's, [token][kv_head][head_dim], so one token is one contiguous row and
one copy. The sequence length lives on the device as well as on the host: kernels and
captured graphs read it there, so one captured graph serves every token.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from ..decode.checks import (
    MAX_HEAD_DIM,
    MAX_KV_HEADS,
    MAX_TOKENS,
    check_dtype,
    check_int,
    layout_shape,
)
from ..decode.fp8 import (
    FP8_DTYPES,
    MIN_COMPUTE_CAPABILITY,
    ROW_DTYPES,
    check_scales,
)
from ..driver.device import resolve
from ..driver.memory import DeviceArray, as_dtype, empty
from ..driver.stream import Stream, stream_handle
from ..kernels.spec import FOUR_BIT_FORMATS, NVFP4_FORMAT, Q4_FORMAT
from ..types import DeviceLike, DTypeLike, HostArrayLike
from .appends import Appends, append_kernel, truncate_kernel
from .decoding import Decodes
from .four_bit import (
    FourBitStore,
    check_four_bit,
    check_four_bit_device,
    check_four_bit_layout,
    check_mixed,
    check_mixed_device,
    format_dtype,
    four_bit_format,
)
from .own_values import OwnValues, check_head_dim_v
from .staging import STAGING_SLOTS

__all__ = ["KVCache", "append_kernel", "check_cache", "check_kv_shape", "truncate_kernel"]


def _four_bit_np(fmt: str) -> np.dtype:
    """A 4-bit format's numpy name (``ml_dtypes.int4``, ``float4_e2m1fn``): what the cache's
    ``dtype`` says (its bytes are decode/kv4.py's, two values to a byte)."""
    import ml_dtypes  # on first use: importing ferrox_driver does not import it

    return np.dtype(ml_dtypes.int4 if fmt == Q4_FORMAT else ml_dtypes.float4_e2m1fn)


def check_kv_shape(n_kv_heads: Any, head_dim: Any) -> tuple[int, int]:
    """Validate the per-token KV shape."""
    n_kv_heads = check_int(n_kv_heads, "n_kv_heads", 1, MAX_KV_HEADS)  # (as decodes take)
    return n_kv_heads, check_int(head_dim, "head_dim", 1, MAX_HEAD_DIM)


class KVCache(Appends, Decodes):
    """K and V of one attention layer, resident on the GPU, grown a token at a time.

    Args:
        n_kv_heads: KV heads per token.
        head_dim: elements per head, 1 to 512 (past 256 on CUDA cores; 4-bit caches: 64,
            128 or 256).
        capacity: the most tokens it will hold (memory is allocated once, up front).
        dtype: float32 (as ferrox-cuda), float16 or ``ml_dtypes.bfloat16``; or an fp8 cache,
            ``ml_dtypes.float8_e4m3fn`` or ``float8_e5m2`` (compute capability 8.9 and up,
            head_dim a multiple of 8): appended rows (float32, float16, bfloat16) are
            quantized on the device (as `quantize_fp8`), and decodes take
            float16 or bfloat16 q (the output in q's dtype). Or a 4-bit cache (head_dim
            64, 128 or 256; docs/kv4.md says which to choose): ``"int4"`` (q4: 4-bit codes
            and a float16 scale per 32 elements, 4.5 bits an element; compute capability
            8.0 and up) or ``"nvfp4"`` (e2m1 values, an e4m3 scale per 16 and a float32
            scale per KV head, ``k_scale``/``v_scale``; 8.9 and up), quantized on the
            device as `quantize_int4`/`quantize_nvfp4` do on the host.
        k_scale: an fp8 cache's K scale (float32, a scalar or one per KV head; default
            1): it stores ``x / k_scale`` and the kernels read ``byte * k_scale``
            (``set_scales`` changes it; the scales apply to every token, stored ones too);
            an nvfp4 cache's per-head scale (its blocks' e4m3 scales count in units of it:
            default 1 holds blocks whose largest magnitude lies in about 0.01 .. 2688).
        v_scale: the same for V.
        device: the device: a Device, an int, a ``torch.device`` or ``"cuda:N"``
            (default: device 0).
        stream: the stream appends and decodes run on (default: a stream of its own).
        v_dtype: V's format where it is not K's (None: as K's). Both quantized, any two
            of ``float8_e4m3fn``, ``float8_e5m2``, ``"int4"`` and ``"nvfp4"`` (fp8 K and
            int4 V, as llama.cpp's q8_0 K and q4_0 V, say): each side is stored and
            quantized as a cache of its format would (``k_scale`` for an fp8 or nvfp4 K,
            ``v_scale`` for such a V), head_dim 64, 128 or 256, decoded by the rows kernels
            (one query or several; compute capability 8.9 and up).
        head_dim_v: V's width where it is not K's (None: head_dim). A float16 or
            bfloat16 cache, token-major as every KVCache: V of (capacity, n_kv_heads,
            head_dim_v), head_dim a multiple of 64 and head_dim_v of 128 up to 512 (the
            values kernels' tiles, `gqa_decode`'s ``head_dim_v``); appends take V rows of
            that width, and ``decode`` returns ``head_dim_v`` wide rows, reading the length
            on the host (every feature but ALiBi and tree masks, up to 16 queries). Graphs,
            ``prepare``, ``gqa_decode_async`` and ``kv_append_async`` need the length on the
            device and refuse such a cache; fp8, 4-bit and float32 caches do not take it.
        rotate: a 4-bit cache's Hadamard rotation of K over the head_dim (q is rotated
            the same way in the decode, so the scores are unchanged; it spreads outlier
            channels before they are quantized). None: the measured default, on for
            int4, off for nvfp4 (K's format where V's differs). Other caches, and an fp8
            K, take None or False.
        kv_layout: a 4-bit cache of one format's storage: ``"NHD"``, token-major (values
            ``(capacity, n_kv_heads, head_dim // 2)``, block scales alike), or ``"HND"``,
            head-major (``(n_kv_heads, capacity, ...)``: each KV head's rows in one run,
            which the decode reads faster: int4 32/8/128 at 131072 tokens 58.9 against
            69.6 us on an H100). None: head-major for a 4-bit cache of one format
            (``four_bit.DEFAULT_LAYOUT``), token-major otherwise. ``to_host`` and
            ``block_scales`` return token-major rows either way. Other caches take None or
            ``"NHD"``.

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
        v_dtype: DTypeLike = None,
        rotate: bool | None = None,
        head_dim_v: int | None = None,
        kv_layout: str | None = None,
    ) -> None:
        self.n_kv_heads, self.head_dim = check_kv_shape(n_kv_heads, head_dim)
        self.capacity = check_int(capacity, "capacity", 1, MAX_TOKENS)
        own_v = check_head_dim_v(head_dim_v, self.head_dim, dtype, v_dtype, rotate)
        mixed = check_mixed(dtype, v_dtype, self.head_dim, rotate, k_scale, v_scale)
        four = four_bit_format(dtype)
        if mixed is not None:  # K and V in formats of their own: a 4-bit cache's parts hold it
            four = mixed.k_fmt
        elif rotate and not four:
            raise ValueError("rotate: only the 4-bit caches (dtype 'int4' or 'nvfp4') rotate K; "
                             "pass None or False")  # fmt: skip
        self.head_major = check_four_bit_layout(kv_layout, four, mixed is not None)
        rotated = (mixed.rotate if mixed is not None
                   else check_four_bit(four, self.head_dim, rotate) if four else False)  # fmt: skip
        dt = np.dtype(np.uint8) if four else as_dtype(dtype, "dtype")
        # "e4m3", "e5m2", "q4", "nvfp4" or ""; K and V in formats of their own: "e4m3+q4"...
        self.fp8 = mixed.fp8 if mixed is not None else four or FP8_DTYPES.get(dt, "")
        self.dtype = (format_dtype(mixed.k_fmt) if mixed is not None
                      else _four_bit_np(four) if four else dt if self.fp8
                      else check_dtype(dt, "dtype"))  # fmt: skip
        # V's dtype (K's, but where V takes a format of its own: v_dtype)
        self.v_dtype = self.dtype if mixed is None else format_dtype(mixed.v_fmt)
        if not self.fp8 and (k_scale is not None or v_scale is not None):
            raise ValueError("k_scale: only fp8 and nvfp4 caches take scales")
        if mixed is None and four == Q4_FORMAT and (k_scale is not None or v_scale is not None):
            raise ValueError("k_scale: an int4 cache scales each group of 32 itself; only fp8 "
                             "and nvfp4 caches take scales")  # fmt: skip
        if self.fp8 and not four and self.head_dim % 8:
            raise ValueError(
                f"head_dim: fp8 caches take head_dims that are multiples of 8, got {self.head_dim}"
            )
        scales = np.concatenate([check_scales(k_scale, self.n_kv_heads, "k_scale"),
                                 check_scales(v_scale, self.n_kv_heads, "v_scale")])  # fmt: skip
        slots = check_int(staging_slots, "staging_slots", 1)
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"stream: expected a ferrox_driver.Stream, got {type(stream)}")
        self.device = resolve(device)
        if mixed is not None:
            check_mixed_device(mixed, self.device.compute_capability)
        elif four:
            check_four_bit_device(four, self.device.compute_capability)
        if self.fp8 and not four and self.device.compute_capability < MIN_COMPUTE_CAPABILITY:
            raise ValueError(
                f"dtype: fp8 caches need compute capability 8.9 or newer; device "
                f"{self.device.ordinal} has {self.device.compute_capability}"
            )
        self._owns_stream = stream is None
        self.stream = Stream(self.device) if stream is None else stream
        self._h = stream_handle(self.stream)
        self.row_elems = self.n_kv_heads * self.head_dim
        # bytes a token stores in K (and in V): a 4-bit cache's values, two to a byte (K and
        # V in formats of their own: K's; V's in its buffer's shape)
        self.row_bytes = (self.row_elems // 2 if four in FOUR_BIT_FORMATS
                          else self.row_elems * self.dtype.itemsize)  # fmt: skip
        # one token's rows: flat, (n_kv_heads, head_dim), or SDPA's (1, n_kv_heads, 1, head_dim)
        self._row_shapes = ((self.row_elems,), (self.n_kv_heads, self.head_dim),
                            (1, self.n_kv_heads, 1, self.head_dim))  # fmt: skip
        shape = (self.capacity, self.n_kv_heads, self.head_dim)
        # 4-bit: two values a byte; head-major (kv_layout "HND"): each KV head's rows in one
        # run, which the decode reads at the memory's rate where token-major rows of 64
        # bytes read at 76% of it (docs/design.md)
        packed = layout_shape("HND" if self.head_major else "NHD", self.capacity,
                              self.n_kv_heads, self.head_dim // 2)  # fmt: skip

        def values(fmt: str, dt: np.dtype) -> DeviceArray:
            four_bit = fmt in FOUR_BIT_FORMATS
            return empty(packed if four_bit else shape, np.uint8 if four_bit else dt,
                         device=self.device)  # fmt: skip

        v_fmt = four if mixed is None else mixed.v_fmt
        self._k = values(four, self.dtype)
        self._v = values(v_fmt, self.v_dtype) if own_v is None else empty(
            (self.capacity, self.n_kv_heads, own_v), self.dtype, device=self.device)  # fmt: skip
        self._k_ptr, self._v_ptr = self._k.ptr, self._v.ptr
        self._scales = scales  # the host's copy of kv_scales
        self.kv_scales = None  # fp8: n_kv K scales, then n_kv V ones
        self.four_bit: FourBitStore | None = None  # a 4-bit cache's scales and appends
        self.rotate = rotated  # K (and q, in the decode) Hadamard-rotated
        self._init_state(slots)  # the length, the staging ring, the memos, the lock
        if own_v is not None:  # V rows of their own width: their staging (own_values.py)
            self.own_v = OwnValues(self, own_v, slots)
        if four:
            if four == NVFP4_FORMAT or mixed is not None:  # float32 scales per KV head
                self.kv_scales = empty((2 * self.n_kv_heads,), np.float32, device=self.device)
                self.kv_scales.copy_from_host(self._scales, self.stream)
            four_bit = self.four_bit = FourBitStore(self, four, rotated, v_fmt)
            # the fp8 append's paths serve it: by value (one format) or staged (its launches)
            self._fp8_appends, self._dev_stage = four_bit.appends, four_bit.dev_stage
            self._fp8_value_appends = dict.fromkeys(ROW_DTYPES) if four_bit.mixed else {}
        elif self.fp8:
            self._init_fp8(slots)
        self.stream.synchronize()

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
        fp8 = (self._dev_stage,) if self.fp8 and self.four_bit is None else ()
        scales = () if self.kv_scales is None else (self.kv_scales,)
        for arr in (self._k, self._v, self.state, *workspaces, *fp8, *scales):
            arr.close()
        if self.four_bit is not None:
            self.four_bit.close()
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
            f"capacity={self.capacity}, dtype={self.dtype.name}, "
            + (f"v_dtype={self.v_dtype.name}, " if self.v_dtype != self.dtype else "")
            + (f"head_dim_v={self.head_dim_v}, " if self.own_v is not None else "")
            + f"{state})"
        )


def check_cache(kv: Any) -> KVCache:
    """``kv``, checked to be an open KVCache (the device ops' and graphs' first check)."""
    if not isinstance(kv, KVCache):
        raise TypeError(f"kv: expected a ferrox_driver.KVCache, got {type(kv).__name__}")
    if kv._closed or kv.stream._closed:
        kv.check_open()
    return kv
