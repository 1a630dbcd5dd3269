"""Device arrays, page-locked host arrays, and host <-> device copies."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._driver import drv, finalizer
from .device import Device, resolve
from .stream import stream_handle

__all__ = [
    "DeviceArray",
    "as_device_array",
    "empty",
    "pinned_empty",
    "to_device",
    "zeros",
]

Shape = int | Sequence[int]


def _normalize_shape(shape: Shape, name: str = "shape") -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"{name}: expected ints, got {shape!r}")
        if d < 0:
            raise ValueError(f"{name}: dimensions must be >= 0, got {shape!r}")
    return tuple(int(d) for d in dims)


def _normalize_dtype(dtype: Any, name: str = "dtype") -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{name}: not a numpy dtype: {dtype!r}") from exc
    if dt.hasobject or dt.itemsize == 0:
        raise TypeError(f"{name}: {dt} cannot live in device memory")
    return dt


class DeviceArray:
    """A C-contiguous array in device memory.

    Made by :func:`empty`, :func:`zeros` and :func:`to_device`, or as a view of another
    array. It exposes ``__cuda_array_interface__`` so CuPy, PyTorch and Numba can wrap it
    without a copy.
    """

    def __init__(
        self,
        shape: Shape,
        dtype: Any,
        *,
        device: Device | None = None,
        _ptr: int | None = None,
        _base: Any = None,
    ) -> None:
        self.shape = _normalize_shape(shape)
        self.dtype = _normalize_dtype(dtype)
        self.device = resolve(device)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self._base = _base
        if _ptr is not None:  # a view: the memory belongs to _base
            self._ptr = int(_ptr)
            self._finalizer = finalizer(self, None)
        elif self.nbytes == 0:
            self._ptr = 0
            self._finalizer = finalizer(self, None)
        else:
            self._ptr = int(drv("cuMemAlloc", self.nbytes))
            self._finalizer = finalizer(self, "cuMemFree", self._ptr)

    @property
    def ptr(self) -> int:
        """The device address as an int."""
        if not self._finalizer.alive and self._base is None and self.nbytes:
            raise ValueError("this DeviceArray was closed")
        return self._ptr

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr, False),
            "strides": None,
            "version": 3,
            "stream": None,
        }

    def view(self, shape: Shape, dtype: Any = None, *, offset: int = 0) -> DeviceArray:
        """A view over part of this array's memory (no copy).

        Args:
            shape: the view's shape.
            dtype: the view's dtype (default: this array's).
            offset: byte offset from the start of this array.
        """
        dt = self.dtype if dtype is None else _normalize_dtype(dtype)
        shp = _normalize_shape(shape)
        need = offset + math.prod(shp) * dt.itemsize
        if offset < 0 or need > self.nbytes:
            raise ValueError(f"shape: a view of {need} bytes does not fit in {self.nbytes} bytes")
        return DeviceArray(shp, dt, device=self.device, _ptr=self.ptr + offset, _base=self)

    def reshape(self, *shape: Any) -> DeviceArray:
        """The same memory with another shape of the same size."""
        shp = _normalize_shape(shape[0] if len(shape) == 1 else shape)
        if math.prod(shp) != self.size:
            raise ValueError(f"shape: cannot reshape {self.shape} into {shp}")
        return self.view(shp)

    def to_host(self, stream: Any = None, *, out: np.ndarray | None = None) -> np.ndarray:
        """Copy to a new numpy array (or into ``out``), waiting for the copy to finish."""
        if out is None:
            out = np.empty(self.shape, self.dtype)
        elif out.nbytes != self.nbytes or not out.flags.c_contiguous:
            raise ValueError(f"out: expected a C-contiguous array of {self.nbytes} bytes")
        if self.nbytes:
            self.device.activate()
            h = stream_handle(stream)
            drv("cuMemcpyDtoHAsync", out.ctypes.data, self.ptr, self.nbytes, h)
            drv("cuStreamSynchronize", h)
        return out

    def copy_from_host(self, array: Any, stream: Any = None) -> None:
        """Copy a host array of the same size and dtype into this array.

        With ``stream`` given the copy is queued on it; pass page-locked memory
        (:func:`pinned_empty`) for a truly asynchronous copy. Without, it completes on return.
        """
        src = np.asarray(array)
        if src.dtype != self.dtype:
            raise TypeError(f"array: expected dtype {self.dtype}, got {src.dtype}")
        if src.size != self.size:
            raise ValueError(f"array: expected {self.size} elements, got {src.size}")
        src = np.ascontiguousarray(src)
        if not self.nbytes:
            return
        self.device.activate()
        if stream is None:
            drv("cuMemcpyHtoD", self.ptr, src.ctypes.data, self.nbytes)
        else:
            drv("cuMemcpyHtoDAsync", self.ptr, src.ctypes.data, self.nbytes, stream_handle(stream))

    def fill_bytes(self, value: int, stream: Any = None) -> None:
        """Set every byte to ``value`` (e.g. 0xFF poisons float arrays with NaN)."""
        if self.nbytes:
            self.device.activate()
            drv("cuMemsetD8Async", self.ptr, int(value) & 0xFF, self.nbytes, stream_handle(stream))

    def close(self) -> None:
        """Free the device memory now (views just drop their reference)."""
        self._base = None
        self._finalizer()

    def __enter__(self) -> DeviceArray:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d DeviceArray")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, ptr=0x{self._ptr:x})"


def empty(shape: Shape, dtype: Any = np.float32, *, device: Device | None = None) -> DeviceArray:
    """Allocate an uninitialised device array."""
    return DeviceArray(shape, dtype, device=device)


def zeros(
    shape: Shape, dtype: Any = np.float32, *, device: Device | None = None, stream: Any = None
) -> DeviceArray:
    """Allocate a device array of zero bytes (complete on return when ``stream`` is None)."""
    arr = DeviceArray(shape, dtype, device=device)
    arr.fill_bytes(0, stream)
    if stream is None and arr.nbytes:
        drv("cuStreamSynchronize", stream_handle(None))
    return arr


def to_device(array: Any, stream: Any = None, *, device: Device | None = None) -> DeviceArray:
    """Copy a host array to a new device array of the same shape and dtype."""
    src = np.ascontiguousarray(array)
    out = DeviceArray(src.shape, src.dtype, device=device)
    out.copy_from_host(src, stream)
    return out


def pinned_empty(shape: Shape, dtype: Any = np.float32) -> np.ndarray:
    """A numpy array over page-locked host memory (fast, truly asynchronous copies).

    The memory is freed when the array and every view of it are gone.
    """
    shp = _normalize_shape(shape)
    dt = _normalize_dtype(dtype)
    nbytes = math.prod(shp) * dt.itemsize
    resolve(None)
    ptr = int(drv("cuMemHostAlloc", max(nbytes, 1), 0))
    buf = (ctypes.c_byte * max(nbytes, 1)).from_address(ptr)
    finalizer(buf, "cuMemFreeHost", ptr)
    raw = np.frombuffer(buf, dtype=np.uint8, count=nbytes)  # type: ignore[call-overload]
    return raw.view(dt).reshape(shp)


def check_c_contiguous(
    shape: tuple[int, ...], strides: Sequence[int] | None, itemsize: int, name: str
) -> None:
    """Raise ValueError naming ``name`` unless the strides describe a C-contiguous array."""
    if strides is None:
        return
    step = itemsize
    for d, s in zip(reversed(shape), reversed(tuple(strides)), strict=True):
        if d > 1 and s != step:
            raise ValueError(f"{name}: must be C-contiguous, got strides {tuple(strides)}")
        step *= d


def as_device_array(obj: Any, name: str = "array") -> DeviceArray:
    """View ``obj`` (a DeviceArray or any ``__cuda_array_interface__`` object) as a
    DeviceArray without a copy; the view keeps ``obj`` alive.

    Raises:
        TypeError: ``obj`` is not a device array.
        ValueError: it is not C-contiguous.
    """
    if isinstance(obj, DeviceArray):
        return obj
    try:
        cai = obj.__cuda_array_interface__
    except Exception as exc:
        raise TypeError(
            f"{name}: expected a numpy array or a device array, got {type(obj).__name__}"
        ) from exc
    shape = tuple(int(d) for d in cai["shape"])
    dtype = np.dtype(cai["typestr"])
    check_c_contiguous(shape, cai.get("strides"), dtype.itemsize, name)
    ptr = int(cai["data"][0])
    return DeviceArray(shape, dtype, _ptr=ptr, _base=obj)
