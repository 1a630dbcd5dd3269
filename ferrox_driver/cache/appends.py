"""KVCache's appends: host rows (one row, many rows), device rows, and an fp8 cache's
quantizing appends and scales. A mixin of `KVCache`, which holds the state."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..decode.checks import (
    check_host_extent,
    dtype_name,
)
from ..decode.fp8 import (
    ROW_DTYPES,
    ROWS_BY_VALUE_MAX,
    by_value_append_kernel,
    check_scales,
    quantize_kernel,
)
from ..decode.kv4_device import by_value_append4_kernel
from ..driver.calls import (
    SUCCESS,
    check,
    driver_version,
    drv,
    memcpy_htod_raw,
)
from ..driver.device import Device
from ..driver.interop import array_ref
from ..driver.launch import Kernel, PackedLaunch
from ..driver.memory import DeviceArray, empty
from ..driver.stream import call_stream, stream_key
from ..errors import KVCapacityError
from ..kernels.catalogue import get_kernel
from ..kernels.spec import FOUR_BIT_FORMATS as _FOUR_BIT
from ..kernels.spec import NVFP4_FORMAT, Q4_FORMAT
from ..types import ArrayLike, HostArrayLike, StreamLike
from .four_bit import quantize_grid
from .state import CacheState

_OK = SUCCESS
_memcpy_htod = memcpy_htod_raw  # (bound once: the per-token paths call them)

__all__ = ["Appends", "append_kernel"]


def append_kernel(device: Device) -> Kernel:
    """The device-side append kernel (reads and bumps the device sequence length)."""
    return get_kernel("kv_cache.cu", "kv_append_row", device)


def truncate_kernel(device: Device) -> Kernel:
    """The device-side roll-back of the sequence length (``kv_truncate_async``)."""
    return get_kernel("kv_cache.cu", "kv_truncate", device)


class Appends(CacheState):
    """The append half of `KVCache` (its methods take the cache's state as ``self``)."""

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
                four = self.four_bit  # (a 4-bit cache of one format: a kernel of its own)
                args: tuple[Any, ...]
                if four is not None:
                    kernel = by_value_append4_kernel(self.device, four.fmt, dtype_name(dt),
                                                     self.head_dim, four.rotate,
                                                     self.row_elems)  # fmt: skip
                    args = four.by_value_args(self)
                    threads = quantize_grid(1, self.n_kv_heads)[1]
                else:
                    kernel = by_value_append_kernel(self.fp8, self.device, dtype_name(dt),
                                                    self.row_elems)  # fmt: skip
                    args = (np.uint64(0), self._k, self._v, self.kv_scales,
                            np.int32(self.n_kv_heads), np.int32(self.head_dim), np.int32(0),
                            self.state)  # fmt: skip
                    threads = min(256, -(-self.row_elems // 32) * 32)
                blob = np.zeros((2, self.row_elems), dt)
                launch = PackedLaunch(kernel, 1, threads, args, stream=self.stream)
                launch.by_value(0, blob)
                entry = (blob, launch)
            self._fp8_value_appends[dt] = entry
        return self._fp8_value_appends[dt]

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
        if self.own_v is not None:  # V rows head_dim_v wide (KVCache(head_dim_v=...))
            return self.own_v.append(self, k_tok, v_tok, True, stream)
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
        """``append`` into an fp8 or 4-bit cache: one launch quantizing the rows into the
        cache, the rows (in their dtype; float32 when K's and V's differ) passed in its
        arguments, or, where they do not fit there (a 4-bit cache: always), staged and
        copied to the device first."""
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
        # V is K (a latent cache's one buffer, given the same rows): one copy to the device
        k_dev = empty(shape, dt, device=self.device)
        pairs = [(k_rows, k_dev)]
        if not (v_rows is k_rows and self._v_ptr == self._k_ptr):
            pairs.append((v_rows, empty(shape, dt, device=self.device)))
        try:
            for rows, dev in pairs:
                dev.copy_from_host(np.ascontiguousarray(rows, dt).reshape(shape), self.stream)
            self._quantize_rows(k_dev, pairs[-1][1], n, seq)
            self.stream.synchronize()
        finally:
            for _, dev in pairs:
                dev.close()

    def _quantize_rows(self, k_dev: DeviceArray, v_dev: DeviceArray, n: int, seq: int) -> None:
        """Quantize ``n`` device rows of K and V (float32, float16 or bfloat16) into tokens
        seq .. seq + n of an fp8 or 4-bit cache, on the cache's stream."""
        if self.four_bit is not None:
            self.four_bit.quantize(self, k_dev, v_dev, n, seq)
            return
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
        if self.own_v is not None:  # V rows head_dim_v wide (KVCache(head_dim_v=...))
            return self.own_v.append(self, k_rows, v_rows, False, stream)
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
                if self._v_ptr != self._k_ptr:  # (V is K in a latent cache: one copy)
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
                    if self._v_ptr != self._k_ptr:  # (V is K in a latent cache: one copy)
                        drv("cuMemcpyDtoDAsync", self._v_ptr + offset, vr[0], nbytes, self._h)
                self._seq_len = seq + n
                self._device_seq_current = False
                if self._eager_seq or not one:  # (as host appends: see append and extend)
                    self.device_length()
            finally:
                if joined:
                    self.rejoin(sid)

    def dequantized(self) -> tuple[np.ndarray, np.ndarray]:
        """K and V as float32, as the kernels read them: an fp8 cache's values times each
        KV head's scale (a float32 product); a 4-bit cache's decoded (`dequantize_int4`,
        `dequantize_nvfp4`) with K's rotation undone; the values themselves for other
        dtypes. K and V in formats of their own: each side as its format reads."""
        with self.lock:  # (values and scales of the same tokens)
            k, v = self.to_host()
            if self.four_bit is not None:
                four = self.four_bit
                return four.dequantized(k, v, *self._block_scales(four), self._scales)
        if not self.fp8:
            return k.astype(np.float32), v.astype(np.float32)
        n = self.n_kv_heads
        ks, vs = self._scales[:n, None], self._scales[n:, None]
        return k.astype(np.float32) * ks, v.astype(np.float32) * vs

    def block_scales(self) -> tuple[Any, Any]:
        """A 4-bit cache's block scales of its ``seq_len`` tokens, K's and V's: float16
        ``(seq_len, n_kv_heads, head_dim // 32)`` (int4) or ``ml_dtypes.float8_e4m3fn``
        ``(seq_len, n_kv_heads, head_dim // 16)`` (nvfp4), as `quantize_int4` and
        `quantize_nvfp4` return them. K and V in formats of their own: each side's, None
        for an fp8 side (it stores none).

        Raises:
            ValueError: not a 4-bit cache (nor one with a 4-bit side).
        """
        four = self.four_bit
        if four is None or (four.fmt not in _FOUR_BIT and four.v_fmt not in _FOUR_BIT):
            raise ValueError("block_scales: only 4-bit caches (dtype 'int4', 'nvfp4') have them")
        return self._block_scales(four)

    def _block_scales(self, four: Any) -> tuple[Any, Any]:
        with self.lock:
            seq = self.seq_len
            ks, vs = (self._side_scales(fmt, arr, seq) for fmt, arr in (
                (four.fmt, four.k_scales), (four.v_fmt, four.v_scales)))  # fmt: skip
        return ks, vs

    def _side_scales(self, fmt: str, scales: DeviceArray, seq: int) -> np.ndarray | None:
        """``block_scales``' side of format ``fmt`` (None: an fp8 side's)."""
        if fmt not in _FOUR_BIT:
            return None
        out = self.four_bit.tokens(scales, seq)
        if fmt == NVFP4_FORMAT:
            import ml_dtypes

            out = out.view(ml_dtypes.float8_e4m3fn)
        return out

    @property
    def k_scale(self) -> np.ndarray | None:
        """An fp8 or nvfp4 cache's K scales (float32, one per KV head; None for other
        dtypes and for an int4 K)."""
        if self.kv_scales is None or self._unscaled("k"):
            return None
        return self._scales[: self.n_kv_heads].copy()

    @property
    def v_scale(self) -> np.ndarray | None:
        """An fp8 or nvfp4 cache's V scales (float32, one per KV head; None for other
        dtypes and for an int4 V)."""
        if self.kv_scales is None or self._unscaled("v"):
            return None
        return self._scales[self.n_kv_heads :].copy()

    def _unscaled(self, side: str) -> bool:
        """Whether K (``side`` "k") or V is int4 beside a side of another format (its
        groups scale themselves: the per-head scale is unread)."""
        four = self.four_bit
        return four is not None and (four.fmt if side == "k" else four.v_fmt) == Q4_FORMAT

    def set_scales(self, k_scale: HostArrayLike = None, v_scale: HostArrayLike = None) -> None:
        """Replace an fp8 cache's K and/or V scales (None: keep), on the device in stream
        order: later appends quantize with them and every later decode (graphs captured
        before included) reads every token, stored ones too, with them.

        Raises:
            ValueError: not an fp8 cache, or scales not positive, finite, one per KV head;
                a scale for an int4 side (K and V in formats of their own).
        """
        if self.kv_scales is None:
            raise ValueError("k_scale: only fp8 and nvfp4 caches take scales")
        for side, scale in (("k", k_scale), ("v", v_scale)):
            if scale is not None and self._unscaled(side):
                raise ValueError(
                    f"{side}_scale: {side.upper()} is int4 here (each group of 32 scales "
                    f"itself); only the fp8 and nvfp4 sides take scales"
                )
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
