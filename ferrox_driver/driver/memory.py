"""Device arrays, page-locked host arrays, and host <-> device copies."""

from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ClosedError
from ..types import DeviceArrayLike, DTypeLike, HostArrayLike, StreamLike
from . import dlpack, interop
from ._bindings import capture_keep, drv, finalizer
from .device import Device, device_for, resolve
from .dtypes import ML_DTYPE_NAMES, named
from .stream import stream_handle

__all__ = [
    "DeviceArray",
    "as_device_array",
    "as_dtype",
    "empty",
    "from_dlpack",
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


_DTYPE_NAMES = {
    "f32": "float32", "float32": "float32", "fp32": "float32",
    "f16": "float16", "float16": "float16", "fp16": "float16", "half": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    **{n: n for n in ML_DTYPE_NAMES},
}  # fmt: skip


def as_dtype(dtype: Any, name: str) -> np.dtype:
    """``dtype`` as a numpy dtype: a numpy dtype or type, ``ml_dtypes.bfloat16``, a name
    (``"bf16"``, ``"bfloat16"``, ``"f16"``, ``"float32"``...) or a torch dtype.

    Raises:
        TypeError: naming ``name``, for anything else (None included).
    """
    if dtype is None:
        raise TypeError(f"{name}: expected float32, float16 or bfloat16, got None")
    key = str(dtype).removeprefix("torch.") if type(dtype).__module__ == "torch" else dtype
    if isinstance(key, str) and key.lower() in _DTYPE_NAMES:
        return named(_DTYPE_NAMES[key.lower()])
    try:
        return np.dtype(dtype)
    except TypeError:
        if isinstance(dtype, str) and "ml_dtypes" not in sys.modules:
            import ml_dtypes  # noqa: F401  (registers its names: "float8_e4m3fnuz"...)

            return as_dtype(dtype, name)
        raise TypeError(
            f"{name}: expected float32, float16 or bfloat16 (or 'f32', 'f16', 'bf16'), "
            f"got {dtype!r}"
        ) from None


def _normalize_dtype(dtype: Any, name: str = "dtype") -> np.dtype:
    dt = as_dtype(dtype, name)
    if dt.hasobject or dt.itemsize == 0:
        raise TypeError(f"{name}: {dt} cannot live in device memory")
    return dt


class Memory:
    """A device allocation, freed (``cuMemFree``) when the last object holding it lets go:
    the DeviceArray that made it, and any graph, DLPack capsule or cache that uses it.
    So closing an array that a captured graph still uses frees nothing under the graph."""

    __slots__ = ("__weakref__", "ptr")

    def __init__(self, nbytes: int) -> None:
        self.ptr = int(drv("cuMemAlloc", nbytes))
        finalizer(self, "cuMemFree", self.ptr)


class DeviceArray:
    """A C-contiguous array in device memory.

    Made by `empty`, `zeros`, `to_device` and `from_dlpack`, or as a view of another
    array. Other libraries take it without a copy through DLPack
    (`torch.from_dlpack(arr)`, bf16 included) or ``__cuda_array_interface__``.

    ``close()`` gives the memory back at once unless something still uses it (a captured
    graph, a DLPack consumer such as a torch tensor): then it goes when they let go. After
    ``close()`` the array and every view of it raise `ClosedError`; its ``shape``,
    ``dtype`` and ``nbytes`` stay readable.
    """

    _closed: bool
    _base: Any  # what keeps the memory: a Memory, a pool block, another library's array
    _parent: DeviceArray | None  # for a view: the array whose memory it views

    def __init__(
        self,
        shape: Shape,
        dtype: DTypeLike,
        *,
        device: Device | None = None,
        _ptr: int | None = None,
        _base: object = None,
    ) -> None:
        self.shape = _normalize_shape(shape)
        self.dtype = _normalize_dtype(dtype)
        self.device = resolve(device)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self._base = _base
        self._parent = None
        self._closed = False
        if _ptr is not None:  # memory that belongs to _base
            self._ptr = int(_ptr)
        elif self.nbytes == 0:
            self._ptr = 0
        else:
            self._base = Memory(self.nbytes)
            self._ptr = self._base.ptr

    @classmethod
    def _wrap(
        cls, ptr: int, shape: tuple[int, ...], dtype: np.dtype, device: Device, base: Any
    ) -> DeviceArray:
        """A view of memory owned by ``base``, with no checks (for the hot paths: shape,
        dtype and device already validated)."""
        self = cls.__new__(cls)
        self.shape, self.dtype, self.device = shape, dtype, device
        self.nbytes = math.prod(shape) * dtype.itemsize
        self._ptr, self._base, self._parent, self._closed = ptr, base, None, False
        return self

    def _check_open(self) -> None:
        """Raise ClosedError when this array, or the array it views, was closed."""
        if self._closed:
            raise ClosedError("DeviceArray")
        parent = self._parent
        if parent is not None and parent._closed:
            raise ClosedError("DeviceArray", "is a view of a DeviceArray that was closed")

    def _owner(self) -> Any:
        """What keeps this array's memory alive (hold it to use the memory later)."""
        self._check_open()
        return self._base if self._parent is None else self._parent._base

    def _resources(self) -> tuple[Any, ...]:
        """What a graph that uses this array must hold."""
        return (self._owner(),)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (on this array or the one it views)."""
        parent = self._parent
        return self._closed or (parent is not None and parent._closed)

    @property
    def ptr(self) -> int:
        """The device address as an int.

        Raises:
            ClosedError: the array (or the one it views) was closed.
        """
        if self._closed or self._parent is not None:
            self._check_open()
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

    def view(self, shape: Shape, dtype: DTypeLike = None, *, offset: int = 0) -> DeviceArray:
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
        view = DeviceArray._wrap(self.ptr + offset, shp, dt, self.device, None)
        view._parent = self if self._parent is None else self._parent
        return view

    def reshape(self, *shape: int | Sequence[int]) -> DeviceArray:
        """The same memory with another shape of the same size."""
        shp = _normalize_shape(shape[0] if len(shape) == 1 else shape)  # type: ignore[arg-type]
        if math.prod(shp) != self.size:
            raise ValueError(f"shape: cannot reshape {self.shape} into {shp}")
        return self.view(shp)

    def to_host(self, stream: StreamLike = None, *, out: np.ndarray | None = None) -> np.ndarray:
        """Copy to a new numpy array (or into ``out``), waiting for the copy to finish."""
        ptr = self.ptr
        if out is None:
            out = np.empty(self.shape, self.dtype)
        elif out.nbytes != self.nbytes or not out.flags.c_contiguous:
            raise ValueError(f"out: expected a C-contiguous array of {self.nbytes} bytes")
        if self.nbytes:
            self.device.activate()
            h = stream_handle(stream)
            drv("cuMemcpyDtoHAsync", out.ctypes.data, ptr, self.nbytes, h)
            drv("cuStreamSynchronize", h)
        return out

    def copy_from_host(self, array: HostArrayLike, stream: StreamLike = None) -> None:
        """Copy a host array of the same size and dtype into this array.

        With ``stream`` given the copy is queued on it; pass page-locked memory
        (`pinned_empty`) for a truly asynchronous copy. Without, it completes on return.
        """
        ptr = self.ptr
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
            drv("cuMemcpyHtoD", ptr, src.ctypes.data, self.nbytes)
        else:
            handle = stream_handle(stream)
            capture_keep(self._owner(), src)  # a captured copy reads src whenever it runs
            drv("cuMemcpyHtoDAsync", ptr, src.ctypes.data, self.nbytes, handle)

    def fill_bytes(self, value: int, stream: StreamLike = None) -> None:
        """Set every byte to ``value`` (e.g. 0xFF poisons float arrays with NaN)."""
        ptr = self.ptr
        if self.nbytes:
            self.device.activate()
            handle = stream_handle(stream)
            capture_keep(self._owner())
            drv("cuMemsetD8Async", ptr, int(value) & 0xFF, self.nbytes, handle)

    def close(self) -> None:
        """Let go of the memory: it is freed now unless a graph or a DLPack consumer still
        uses it, then when the last of them goes. Views of a closed array are closed too;
        closing a view closes only the view. Closing again does nothing."""
        self._closed = True
        self._base = None
        self._parent = None

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule over this array (no copy): versioned DLPack 1.x when the
        consumer's ``max_version`` allows, the legacy form otherwise. The capsule keeps the
        array's memory alive. ``stream`` is not waited on: order the work that wrote the
        array before the consumer's as for any device array.

        Raises:
            BufferError: a copy or another device was asked for.
        """
        if copy:
            raise BufferError("copy: ferrox exports its arrays without a copy only")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(f"dl_device: this array is on {self.__dlpack_device__()}")
        versioned = max_version is not None and max_version[0] >= 1
        # The capsule holds the memory, not this array: closing the array later leaves the
        # consumer's tensor valid.
        owner = self._owner()
        return dlpack.export(
            self.ptr, self.shape, self.dtype, dlpack.CUDA, self.device.ordinal,
            self if owner is None else owner, versioned=versioned,
        )  # fmt: skip

    def __dlpack_device__(self) -> tuple[int, int]:
        """(kDLCUDA, device ordinal)."""
        return dlpack.CUDA, self.device.ordinal

    def __enter__(self) -> DeviceArray:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d DeviceArray")
        return self.shape[0]

    def __repr__(self) -> str:
        where = "closed" if self.closed else f"ptr=0x{self._ptr:x}"
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, {where})"


def empty(
    shape: Shape, dtype: DTypeLike = np.float32, *, device: Device | None = None
) -> DeviceArray:
    """Allocate an uninitialised device array.

    Args:
        shape: the array's shape (an int or a sequence of ints).
        dtype: its element type (any form `DTypeLike` takes).
        device: the device (default: device 0).

    Returns:
        A DeviceArray; its memory is freed by `close()` or when it is collected.
    """
    return DeviceArray(shape, dtype, device=device)


def zeros(
    shape: Shape,
    dtype: DTypeLike = np.float32,
    *,
    device: Device | None = None,
    stream: StreamLike = None,
) -> DeviceArray:
    """Allocate a device array of zero bytes.

    Args:
        shape: the array's shape.
        dtype: its element type.
        device: the device (default: device 0).
        stream: where the zeroing is queued; None: complete on return.
    """
    arr = DeviceArray(shape, dtype, device=device)
    arr.fill_bytes(0, stream)
    if stream is None and arr.nbytes:
        drv("cuStreamSynchronize", stream_handle(None))
    return arr


def to_device(
    array: HostArrayLike, stream: StreamLike = None, *, device: Device | None = None
) -> DeviceArray:
    """Copy a host array to a new device array of the same shape and dtype.

    Args:
        array: the host data (made C-contiguous first if it is not).
        stream: where the copy is queued (from pageable memory the driver stages it before
            returning); None: the legacy default stream.
        device: the device (default: device 0).
    """
    src = np.ascontiguousarray(array)
    out = DeviceArray(src.shape, src.dtype, device=device)
    out.copy_from_host(src, stream)
    return out


def pinned_empty(shape: Shape, dtype: DTypeLike = np.float32) -> np.ndarray:
    """A numpy array over page-locked host memory (fast, truly asynchronous copies).

    Args:
        shape: the array's shape.
        dtype: its element type.

    Returns:
        The array; the memory is freed when it and every view of it are gone.
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
    """View ``obj`` (a DeviceArray, a PyTorch tensor or CuPy array on the GPU, any
    ``__dlpack__`` or ``__cuda_array_interface__`` object) as a DeviceArray without a copy;
    the view keeps ``obj`` alive.

    Raises:
        TypeError: ``obj`` is not a device array.
        ValueError: it is not C-contiguous.
    """
    if isinstance(obj, DeviceArray):
        return obj
    ref = interop.array_ref(obj, name)
    if ref is None:
        raise TypeError(f"{name}: expected a device array, got a numpy array")
    return view_of(ref, obj, name)


def view_of(ref: interop.ArrayRef, obj: Any, name: str) -> DeviceArray:
    """The DeviceArray over what ``ref`` (read from ``obj``) describes.

    Raises:
        ValueError: it is not C-contiguous.
    """
    ptr, shape, dtype, ordinal, contiguous, owner = ref
    if not contiguous:
        raise ValueError(f"{name}: must be C-contiguous (use .contiguous() or a copy)")
    return DeviceArray._wrap(
        ptr, shape, dtype, device_for(ordinal), obj if owner is None else owner
    )


def from_dlpack(obj: DeviceArrayLike) -> DeviceArray:
    """A zero-copy DeviceArray view of any object with ``__dlpack__`` (a PyTorch tensor,
    a CuPy or JAX array...) on a CUDA device; it keeps the producer's memory alive.

    Raises:
        TypeError: ``obj`` has no ``__dlpack__``, or its memory is not on a CUDA device.
        ValueError: it is not C-contiguous.
    """
    if isinstance(obj, DeviceArray):
        return obj
    if not hasattr(obj, "__dlpack__"):
        raise TypeError(f"obj: expected an object with __dlpack__, got {type(obj).__name__}")
    return view_of(interop.read_dlpack(obj, "obj"), obj, "obj")


interop.register_reader(
    DeviceArray, lambda a, name: (a.ptr, a.shape, a.dtype, a.device.ordinal, True, None)
)
