"""Reading other libraries' device arrays without a copy, fast.

``array_ref(obj, name)`` gives ``(ptr, shape, dtype, ordinal, contiguous, owner)`` for a
ferrox DeviceArray, a PyTorch tensor or a CuPy array (their attributes read directly: no
protocol dict is built, and torch is never imported), any other ``__dlpack__`` object
(DLPack first), or an ``__cuda_array_interface__`` object, whose device is asked of the
driver (``cuPointerGetAttribute``), never assumed. The reader is chosen once per type.
A numpy array gives None: the caller's host path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import dlpack
from ._bindings import cu, drv
from .dtypes import named

__all__ = [
    "ArrayRef",
    "array_ref",
    "is_torch",
    "pointer_ordinal",
    "read_dlpack",
    "register_reader",
]

# (ptr, shape, dtype, device ordinal, C-contiguous, owner to keep alive or None)
ArrayRef = tuple[int, tuple[int, ...], np.dtype, int, bool, Any]
Reader = Callable[[Any, str], ArrayRef]

_TORCH_DTYPE_NAMES = {  # numpy names: ml_dtypes is imported on meeting one of its own
    "torch.float32": "float32",
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float64": "float64",
    "torch.int8": "int8",
    "torch.int16": "int16",
    "torch.int32": "int32",
    "torch.int64": "int64",
    "torch.uint8": "uint8",
    "torch.bool": "bool",
    "torch.float8_e4m3fn": "float8_e4m3fn",
    "torch.float8_e5m2": "float8_e5m2",
}
_torch_dtypes: dict[Any, np.dtype] = {}  # torch.dtype -> numpy dtype, filled as met


def _not_on_device(obj: Any, name: str, where: str) -> TypeError:
    return TypeError(
        f"{name}: expected a numpy array or a CUDA device array, got a "
        f"{type(obj).__module__}.{type(obj).__name__} on {where}"
    )


def _torch_dtype(obj: Any, name: str) -> np.dtype:
    dt = obj.dtype
    found = _torch_dtypes.get(dt)
    if found is None:
        npdt = _TORCH_DTYPE_NAMES.get(str(dt))
        if npdt is None:
            raise TypeError(f"{name}: torch dtype {dt} has no ferrox equivalent")
        found = _torch_dtypes[dt] = named(npdt)
    return found


def _read_torch(obj: Any, name: str) -> ArrayRef:
    ordinal = obj.get_device()  # -1 on the CPU
    if ordinal < 0:
        raise _not_on_device(obj, name, str(obj.device))
    dtype = _torch_dtypes.get(obj.dtype) or _torch_dtype(obj, name)
    # obj.shape is a torch.Size: a tuple, kept as it is (hashes and compares as one)
    return obj.data_ptr(), obj.shape, dtype, ordinal, obj.is_contiguous(), obj


def _read_cupy(obj: Any, name: str) -> ArrayRef:
    return (
        int(obj.data.ptr),
        tuple(obj.shape),
        np.dtype(obj.dtype),
        int(obj.device.id),
        bool(obj.flags.c_contiguous),
        obj,
    )


def read_dlpack(obj: Any, name: str) -> ArrayRef:
    """An ArrayRef of the tensor ``obj.__dlpack__()`` describes (the owner keeps it)."""
    try:
        capsule = obj.__dlpack__(max_version=dlpack.VERSION)
    except TypeError:  # a producer that predates DLPack 1.0's keywords
        capsule = obj.__dlpack__()
    imported = dlpack.import_capsule(capsule)
    if imported.device_type not in (dlpack.CUDA, dlpack.CUDA_MANAGED):
        raise _not_on_device(obj, name, f"DLPack device type {imported.device_type}")
    if imported.dtype is None:
        raise TypeError(f"{name}: DLPack type (code, bits, lanes) {imported.type_code} unknown")
    return (
        imported.ptr,
        imported.shape,
        imported.dtype,
        imported.device_id,
        imported.contiguous,
        imported,
    )


def pointer_ordinal(ptr: int) -> int:
    """The ordinal of the device that holds the memory at ``ptr``, asked of the driver."""
    attr = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    return int(drv("cuPointerGetAttribute", attr, ptr))


def _read_cai(obj: Any, name: str) -> ArrayRef:
    cai = obj.__cuda_array_interface__
    shape = tuple(int(d) for d in cai["shape"])
    dtype = np.dtype(cai["typestr"])
    strides = cai.get("strides")
    contiguous = True
    if strides is not None:
        step = dtype.itemsize
        for d, s in zip(reversed(shape), reversed(tuple(strides)), strict=True):
            if d > 1 and s != step:
                contiguous = False
            step *= d
    ptr = int(cai["data"][0])
    ordinal = pointer_ordinal(ptr) if ptr else 0
    return ptr, shape, dtype, ordinal, contiguous, obj


_readers: dict[type, Reader | None] = {np.ndarray: None}


def register_reader(cls: type, reader: Reader) -> None:
    """Read arrays of ``cls`` with ``reader`` (the memory module registers DeviceArray)."""
    _readers[cls] = reader


def _reader_for(cls: type, obj: Any, name: str) -> Reader | None:
    module = cls.__module__.split(".", 1)[0]
    if isinstance(obj, np.ndarray):
        return None
    if module == "torch" and hasattr(obj, "data_ptr"):
        return _read_torch
    if module == "cupy" and hasattr(obj, "data"):
        return _read_cupy
    if hasattr(cls, "__dlpack__"):
        return read_dlpack
    if hasattr(obj, "__cuda_array_interface__"):
        return _read_cai
    raise TypeError(f"{name}: expected a numpy array or a device array, got {cls.__name__}")


def is_torch(obj: Any) -> bool:
    """Whether ``obj`` is a PyTorch tensor (read by the torch reader; torch is not imported).
    One dict lookup once ``array_ref`` has met the type."""
    reader = _readers.get(type(obj), _UNSEEN)
    if reader is _UNSEEN:
        return type(obj).__module__.split(".", 1)[0] == "torch" and hasattr(obj, "data_ptr")
    return reader is _read_torch


_UNSEEN: Any = object()  # is_torch: a type array_ref has not met yet


def array_ref(obj: Any, name: str) -> ArrayRef | None:
    """``obj`` as an ArrayRef, or None for a numpy array (a host array).

    Raises:
        TypeError: ``obj`` is neither a numpy array nor a device array (a host tensor of
            another library, a list...), or has a dtype ferrox cannot name.
    """
    cls = type(obj)
    try:
        reader = _readers[cls]
    except KeyError:
        reader = _readers[cls] = _reader_for(cls, obj, name)
    return None if reader is None else reader(obj, name)
