"""4-bit caches (q4, nvfp4) on the device, groundwork for the cache that will hold them:
rows quantized by ``cuda_src/kv_quantize4.cu`` bit for bit as `kv4.quantize_q4` and
`kv4.quantize_nvfp4` do on the host (K rotated first where asked, as `kv4.hadamard`), and
decoded by the rows kernels (``records.launches_for(..., fp8="q4" or "nvfp4",
q4_scales=..., rotate=...)``, an nvfp4 cache's per-head scales as ``kv_scales``).

Internal: a KVCache of ``dtype="int4"`` or ``"nvfp4"`` comes with these (its storage,
head-major by default: values ``uint8 (n_kv_heads, capacity, head_dim // 2)`` for K and
for V, and scales ``(n_kv_heads, capacity, head_dim // 32)`` float16 for q4,
``(n_kv_heads, capacity, head_dim // 16)`` e4m3 bytes for nvfp4; with
``kv_layout="NHD"``, or K and V in formats of their own, token-major ``(capacity,
n_kv_heads, ...)``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..driver.device import Device
from ..driver.launch import Kernel
from ..driver.memory import DeviceArray
from ..kernels.catalogue import get_kernel
from .checks import dtype_name

__all__ = [
    "Q4_FILE",
    "Q4_HEAD_DIMS",
    "by_value_append4_kernel",
    "nvfp4_quantize_kernel",
    "q4_quantize_kernel",
    "quantize_4bit_async",
]

Q4_FILE = "kv_quantize4.cu"
Q4_HEAD_DIMS = (64, 128, 256)  # a row a warp, 32 x a power of two (the rows kernels' too)
_C_TYPES = {"f32": "float", "f16": "fx_half", "bf16": "fx_bf16"}
_WARPS = 4  # per block of the quantizing kernel


def q4_quantize_kernel(
    device: Device, rows: str, head_dim: int, group: int = 32, rotate_k: bool = True
) -> Kernel:
    """The kernel quantizing rows of kernel dtype ``rows`` (f32, f16, bf16) into a q4
    cache of ``head_dim`` in groups of ``group``, K rotated where ``rotate_k``."""
    name = f"kv_quantize_q4_{rows}_d{head_dim}_g{group}" + ("_rk" if rotate_k else "")
    entry = (
        f"FX_QUANTIZE_Q4_ENTRY({name}, {_C_TYPES[rows]}, {head_dim}, {group}, "
        f"{'true' if rotate_k else 'false'})"
    )
    return get_kernel(Q4_FILE, name, device, select=entry)


def nvfp4_quantize_kernel(device: Device, rows: str, head_dim: int, rotate_k: bool) -> Kernel:
    """The kernel quantizing rows of kernel dtype ``rows`` into an nvfp4 cache of
    ``head_dim``, K rotated where ``rotate_k``."""
    name = f"kv_quantize_nvfp4_{rows}_d{head_dim}" + ("_rk" if rotate_k else "")
    entry = (
        f"FX_QUANTIZE_NVFP4_ENTRY({name}, {_C_TYPES[rows]}, {head_dim}, "
        f"{'true' if rotate_k else 'false'})"
    )
    return get_kernel(Q4_FILE, name, device, select=entry)


def by_value_append4_kernel(
    device: Device, fmt: str, rows: str, head_dim: int, rotate_k: bool, n: int
) -> Kernel:
    """The kernel that quantizes one token's K and V rows of ``n`` values of kernel dtype
    ``rows`` (f32, f16, bf16), passed by value, into a 4-bit cache of format ``fmt`` ("q4"
    in groups of 32, "nvfp4") and ``head_dim``, K rotated where ``rotate_k`` (compiled for
    this ``n`` alone)."""
    name = f"kv_append4_{fmt}_{rows}_d{head_dim}" + ("_rk" if rotate_k else "") + f"_n{n}"
    group = 32 if fmt == "q4" else 0
    entry = (
        f"FX_APPEND4_ENTRY({name}, {_C_TYPES[rows]}, {head_dim}, {group}, "
        f"{'true' if rotate_k else 'false'}, {n})"
    )
    return get_kernel(Q4_FILE, name, device, select=entry)


def quantize_4bit_async(
    k_rows: DeviceArray, v_rows: DeviceArray, k_vals: DeviceArray, v_vals: DeviceArray,
    k_scales: DeviceArray, v_scales: DeviceArray, *, first: int, stream: Any,
    rotate_k: bool = True, state: DeviceArray | None = None, capacity: int = 0,
    globals_: DeviceArray | None = None, head_rows: int = 0,
) -> None:  # fmt: skip
    """Queue the quantization of rows ``(n, n_kv_heads, head_dim)`` of K and V (float32,
    float16, bfloat16, C-contiguous, validated by the caller) into rows ``first ..`` of a
    4-bit cache's values and block scales: q4 where the scales are float16, nvfp4 where
    they are e4m3 bytes (``globals_``: its float32 scales per KV head, K's then V's).
    ``first`` -1: one row at the device length ``state[0]``, then bumped; -2: at the device
    length, not bumped; ``capacity`` bounds both, past it the overflow flag ``state[1]`` is
    set and nothing written. ``head_rows``: the cache is head-major, this many rows a KV
    head (values ``(n_kv_heads, head_rows, head_dim // 2)``, scales likewise); 0,
    token-major."""
    n, n_kv, d = k_rows.shape
    rows, dev = dtype_name(k_rows.dtype), k_rows.device
    nvfp4 = k_scales.dtype.itemsize == 1
    if nvfp4 and globals_ is None:
        raise ValueError("globals_: an nvfp4 cache's scales per KV head are needed")
    kernel = (
        nvfp4_quantize_kernel(dev, rows, d, rotate_k) if nvfp4
        else q4_quantize_kernel(dev, rows, d, d // k_scales.shape[-1], rotate_k)
    )  # fmt: skip
    warps = n * n_kv
    grid = 1 if first == -1 else max(1, -(-warps // _WARPS))
    args: tuple[Any, ...] = (
        k_rows, v_rows, k_vals, v_vals, k_scales, v_scales, np.int32(n_kv), np.int32(n),
        np.int32(first), state, np.int32(capacity), np.float32(1.0 / math.sqrt(d)),
    )  # fmt: skip
    if nvfp4:
        args += (globals_,)
    args += (np.int64(head_rows),)
    kernel.launch((grid, 1, 1), (32 * _WARPS, 1, 1), args, stream=stream)
