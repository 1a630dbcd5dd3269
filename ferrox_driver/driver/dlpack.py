"""DLPack: tensors in and out of ferrox without a copy, bf16 and fp16 included.

``export`` wraps a device pointer in a DLPack capsule (versioned DLPack 1.x where the
consumer asks for it, the legacy ``dltensor`` otherwise) that keeps its owner alive until the
consumer calls the deleter; ``import_capsule`` reads a producer's capsule, takes ownership
(the capsule is renamed ``used_...``, as the protocol says) and gives the deleter back when
the returned holder is collected. Plain ctypes: no compiled extension.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from .dtypes import DTypeTable, named

__all__ = ["CPU", "CUDA", "CUDA_MANAGED", "Imported", "export", "import_capsule"]

CPU, CUDA, CUDA_HOST, CUDA_MANAGED = 1, 2, 3, 13  # DLDeviceType
_INT, _UINT, _FLOAT, _BFLOAT, _BOOL = 0, 1, 2, 4, 6  # DLDataTypeCode
_F8_E4M3FN, _F8_E5M2 = 10, 12
VERSION = (1, 0)
READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY

_NAMES = {
    "float16": (_FLOAT, 16),
    "float32": (_FLOAT, 32),
    "float64": (_FLOAT, 64),
    "bfloat16": (_BFLOAT, 16),
    "float8_e4m3fn": (_F8_E4M3FN, 8),
    "float8_e5m2": (_F8_E5M2, 8),
    "bool": (_BOOL, 8),
    **{f"int{b}": (_INT, b) for b in (8, 16, 32, 64)},
    **{f"uint{b}": (_UINT, b) for b in (8, 16, 32, 64)},
}
_CODES = DTypeTable(_NAMES)  # by name: ml_dtypes is imported only to make one of its dtypes
_DTYPE_NAMES = {code: name for name, code in _NAMES.items()}


def _dtype_of(code: tuple[int, int, int]) -> np.dtype | None:
    """The numpy dtype of a DLPack (code, bits, lanes), None where there is none."""
    name = _DTYPE_NAMES.get(code[:2]) if code[2] == 1 else None
    return None if name is None else named(name)


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _Managed(ctypes.Structure):  # DLManagedTensor (DLPack < 1.0)
    _fields_ = [
        ("dl_tensor", _Tensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _ManagedVersioned(ctypes.Structure):  # DLManagedTensorVersioned (DLPack 1.x)
    _fields_ = [
        ("version", _Version),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _Tensor),
    ]


_NAME = b"dltensor"
_USED = b"used_dltensor"
_NAME_V = b"dltensor_versioned"
_USED_V = b"used_dltensor_versioned"

_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_api = ctypes.pythonapi
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, _Deleter)(
    ("PyCapsule_New", _api)
)
_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api)
)
_raw_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api)
)
_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api)
)
_raw_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api)
)
_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", _api)
)

# What an exported capsule must keep alive until its consumer calls the deleter: the
# structure, its shape and strides, and the owner of the memory, by the structure's address.
_exported: dict[int, tuple[Any, ...]] = {}
_exported_lock = threading.Lock()


def _release_export(address: int | None) -> None:
    if address is not None:
        with _exported_lock:
            _exported.pop(address, None)


_deleter = _Deleter(_release_export)
_deleter_address = ctypes.cast(_deleter, ctypes.c_void_p).value


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _capsule_destructor(capsule: int | None) -> None:
    """A capsule collected unconsumed (still named dltensor...) releases its tensor."""
    try:
        for name in (_NAME, _NAME_V):
            if _raw_is_valid(capsule, name):
                _release_export(_raw_get_pointer(capsule, name))
                return
    except Exception:  # a destructor must not raise (it may run at shutdown)
        pass


def export(
    ptr: int,
    shape: tuple[int, ...],
    dtype: np.dtype,
    device_type: int,
    device_id: int,
    owner: Any,
    *,
    versioned: bool,
    read_only: bool = False,
) -> Any:
    """A DLPack capsule over C-contiguous memory at ``ptr`` that keeps ``owner`` alive.

    Raises:
        BufferError: ``dtype`` has no DLPack type code.
    """
    code = _CODES.get(np.dtype(dtype))
    if code is None:
        raise BufferError(f"dtype: {dtype} has no DLPack type code")
    ndim = len(shape)
    dims = (ctypes.c_int64 * max(ndim, 1))(*shape)
    strides = (ctypes.c_int64 * max(ndim, 1))()
    step = 1
    for i in range(ndim - 1, -1, -1):
        strides[i] = step
        step *= shape[i]
    managed: Any = _ManagedVersioned() if versioned else _Managed()
    t = managed.dl_tensor
    t.data = ptr or None
    t.device.device_type, t.device.device_id = device_type, device_id
    t.ndim = ndim
    t.dtype.code, t.dtype.bits, t.dtype.lanes = code[0], code[1], 1
    t.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0
    managed.deleter = _deleter_address
    if versioned:
        managed.version.major, managed.version.minor = VERSION
        managed.flags = READ_ONLY if read_only else 0
    address = ctypes.addressof(managed)
    with _exported_lock:
        _exported[address] = (managed, dims, strides, owner)
    return _capsule_new(address, _NAME_V if versioned else _NAME, _capsule_destructor)


@dataclass
class Imported:
    """What a producer's capsule describes; the producer's memory stays valid while this
    object lives (its finalizer calls the producer's deleter)."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None  # in elements; None: C-contiguous
    dtype: np.dtype | None  # None: a type ferrox has no numpy dtype for
    type_code: tuple[int, int, int]  # (code, bits, lanes), for messages
    device_type: int
    device_id: int

    @property
    def contiguous(self) -> bool:
        """Whether the strides describe a C-contiguous array."""
        if self.strides is None:
            return True
        step = 1
        for d, s in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if d > 1 and s != step:
                return False
            step *= d
        return True


def _call_deleter(deleter: int, managed: int) -> None:
    with contextlib.suppress(Exception):  # a finalizer must not raise
        _Deleter(deleter)(managed)


def import_capsule(capsule: Any) -> Imported:
    """Take a producer's DLPack capsule (legacy or versioned) and read its tensor.

    Raises:
        TypeError: ``capsule`` is not an unconsumed DLPack capsule.
    """
    kinds = ((_NAME_V, _USED_V, _ManagedVersioned), (_NAME, _USED, _Managed))
    found = next((k for k in kinds if _is_valid(capsule, k[0])), None)
    if found is None:
        raise TypeError("expected an unconsumed DLPack capsule (named 'dltensor')")
    name, used, kind = found
    address = _get_pointer(capsule, name)
    managed = kind.from_address(address)
    if kind is _ManagedVersioned and managed.version.major > VERSION[0]:
        raise TypeError(
            f"DLPack {managed.version.major}.{managed.version.minor} capsule: ferrox reads "
            f"DLPack 1.x"
        )
    t = managed.dl_tensor
    shape = tuple(int(t.shape[i]) for i in range(t.ndim))
    strides = tuple(int(t.strides[i]) for i in range(t.ndim)) if t.strides else None
    code = (int(t.dtype.code), int(t.dtype.bits), int(t.dtype.lanes))
    imported = Imported(
        int(t.data or 0) + int(t.byte_offset),
        shape,
        strides,
        _dtype_of(code),
        code,
        int(t.device.device_type),
        int(t.device.device_id),
    )
    _set_name(capsule, used)  # ours now: the producer must not free it
    if managed.deleter:
        weakref.finalize(imported, _call_deleter, managed.deleter, address).atexit = False
    return imported
