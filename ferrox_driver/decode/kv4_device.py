"""4-bit (q4) caches on the device, groundwork for the cache that will hold them: rows
quantized by ``cuda_src/kv_quantize4.cu`` bit for bit as `kv4.quantize_q4` does on the host
(K rotated first where asked, as `kv4.hadamard`), and decoded by the rows kernels
(``records.launches_for(..., fp8="q4", q4_scales=..., rotate=...)``).

Internal: a KVCache of ``dtype="int4"`` comes with these (its storage: values ``uint8
(capacity, n_kv_heads, head_dim // 2)`` and float16 scales ``(capacity, n_kv_heads,
head_dim // 32)`` for K and for V).
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

__all__ = ["Q4_FILE", "Q4_HEAD_DIMS", "q4_quantize_kernel", "quantize_q4_async"]

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


def quantize_q4_async(
    k_rows: DeviceArray, v_rows: DeviceArray, k_vals: DeviceArray, v_vals: DeviceArray,
    k_scales: DeviceArray, v_scales: DeviceArray, *, first: int, stream: Any,
    rotate_k: bool = True, state: DeviceArray | None = None, capacity: int = 0,
) -> None:  # fmt: skip
    """Queue the quantization of rows ``(n, n_kv_heads, head_dim)`` of K and V (float32,
    float16, bfloat16, C-contiguous, validated by the caller) into rows ``first ..`` of a q4
    cache's values and scales (``first`` -1: one row at the device length ``state[0]``,
    then bumped; -2: at the device length, not bumped; ``capacity`` bounds both, past it
    the overflow flag ``state[1]`` is set and nothing written)."""
    n, n_kv, d = k_rows.shape
    kernel = q4_quantize_kernel(
        k_rows.device, dtype_name(k_rows.dtype), d, d // k_scales.shape[-1], rotate_k
    )
    warps = n * n_kv
    grid = 1 if first == -1 else max(1, -(-warps // _WARPS))
    args = (
        k_rows, v_rows, k_vals, v_vals, k_scales, v_scales, np.int32(n_kv), np.int32(n),
        np.int32(first), state, np.int32(capacity), np.float32(1.0 / math.sqrt(d)),
    )  # fmt: skip
    kernel.launch((grid, 1, 1), (32 * _WARPS, 1, 1), args, stream=stream)
