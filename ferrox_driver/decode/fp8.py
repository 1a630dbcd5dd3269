"""fp8 KV caches: the formats, their scales, and quantization as the device does it.

A cache of ``ml_dtypes.float8_e4m3fn`` or ``float8_e5m2`` holds each value x of KV head h
as ``x / scale_h`` rounded to nearest even and saturated to the format's finite range (NaN
stays NaN); the kernels read ``byte * scale_h``. ``quantize`` is that rounding on the host,
bit for bit the device's (cuda_src/kv_quantize.cu), for checking and for choosing scales
(``fd.quantize_fp8``).
"""

from __future__ import annotations

import numpy as np

from ..driver.device import Device
from ..driver.dtypes import DTypes, DTypeTable
from ..driver.launch import Kernel
from ..kernels.catalogue import get_kernel
from ..types import DTypeLike, HostArrayLike

__all__ = ["FP8_DTYPES", "check_scales", "fp8_max", "quantize_fp8"]

# the fp8 cache dtypes and their kernels' names (attention.FP8_FORMATS); tables by name, so
# that importing them does not import ml_dtypes (dtypes.py)
FP8_DTYPES = DTypeTable({"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"})
ROW_DTYPES = DTypes("float32", "float16", "bfloat16")
MIN_COMPUTE_CAPABILITY = (8, 9)  # cvt between fp8 and fp16/fp32 (Ada, Hopper and newer)


def fp8_max(dtype: DTypeLike) -> float:
    """The largest finite value of an fp8 dtype (448 for e4m3, 57344 for e5m2)."""
    import ml_dtypes  # on first use (dtypes.py)

    return float(ml_dtypes.finfo(np.dtype(dtype)).max)


def quantize_fp8(x: HostArrayLike, dtype: DTypeLike, scale: HostArrayLike = 1.0) -> np.ndarray:
    """``x`` (float32 or narrower; ``[..., n_kv_heads, head_dim]`` with per-head scales) as
    the fp8 values an fp8 `KVCache` stores, bit for bit: ``x / scale`` in float32, rounded
    to nearest even, saturated to the format's finite range (448 for e4m3, 57344 for
    e5m2); NaN stays NaN. For checking a cache (``KVCache.to_host``) and choosing scales.

    Args:
        x: the values.
        dtype: ``ml_dtypes.float8_e4m3fn`` or ``float8_e5m2``.
        scale: a scalar, or one per KV head (broadcast against ``x[..., :, None]``).

    Returns:
        An array of ``dtype`` and x's shape.
    """
    import ml_dtypes  # noqa: F401  (on first use, dtypes.py): np.dtype("float8_e4m3fn")

    dt = np.dtype(dtype)
    top = fp8_max(dt)
    s = np.asarray(scale, dtype=np.float32)
    y = np.asarray(x, dtype=np.float32) / (s if s.ndim == 0 else s[:, None])
    return np.clip(y, -top, top).astype(dt)


def check_scales(scale: HostArrayLike, n_kv_heads: int, name: str) -> np.ndarray:
    """``scale`` (None: 1; a positive finite scalar or one per KV head) as float32 per KV head.

    Raises:
        TypeError, ValueError: naming ``name``.
    """
    if scale is None:
        return np.ones(n_kv_heads, np.float32)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.ndarray, np.generic,
                                                         list, tuple)):  # fmt: skip
        raise TypeError(f"{name}: expected a float or one per KV head, got {type(scale).__name__}")
    arr = np.asarray(scale, dtype=np.float64)
    if arr.ndim == 0:
        arr = np.full(n_kv_heads, float(arr))
    if arr.shape != (n_kv_heads,):
        raise ValueError(f"{name}: expected a scalar or {n_kv_heads} values, got shape {arr.shape}")
    if not (np.isfinite(arr).all() and (arr > 0).all()):
        raise ValueError(f"{name}: expected positive finite scales, got {arr.tolist()}")
    tiny, top = np.finfo(np.float32).tiny, np.finfo(np.float32).max
    if not ((arr >= tiny) & (arr <= top)).all():
        raise ValueError(f"{name}: {arr.tolist()} are not normal float32 values")
    return arr.astype(np.float32)


def quantize_kernel(fmt: str, device: Device, rows: str = "f32") -> Kernel:
    """The kernel that quantizes rows of dtype ``rows`` (f32, f16, bf16) into an fp8 cache
    of format ``fmt``."""
    suffix = "" if rows == "f32" else f"_{rows}"
    return get_kernel("kv_quantize.cu", f"kv_quantize_{fmt}{suffix}", device)


# K and V rows of at most this many bytes are passed to the append kernel by value (CUDA
# 12.1 drivers and newer take up to 32764 bytes of arguments on compute capability 7.0+).
ROWS_BY_VALUE_MAX = 16384
_ROW_C_TYPES = {"f32": "float", "f16": "fx_half", "bf16": "fx_bf16"}


def by_value_append_kernel(fmt: str, device: Device, rows: str, n: int) -> Kernel:
    """The kernel that quantizes one token's K and V rows of ``n`` values of dtype ``rows``
    (f32, f16, bf16), passed by value, into an fp8 cache of format ``fmt`` (compiled for
    this ``n`` alone)."""
    name = f"kv_append_{fmt}_{rows}_n{n}"
    q8 = ("e4m3", "e5m2").index(fmt) + 1
    entry = f"FX_APPEND_ENTRY({name}, {q8}, {_ROW_C_TYPES[rows]}, {n})"
    return get_kernel("kv_quantize.cu", name, device, select=entry)
