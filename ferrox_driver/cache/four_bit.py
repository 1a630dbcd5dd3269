"""A 4-bit KVCache's own parts: its formats' names, the block scales beside the packed
values, and the quantizing appends (host rows staged and quantized on the device by
``cuda_src/kv_quantize4.cu``, device rows quantized in place, ``kv_append_async``'s
capturable launches). The decodes are the rows kernels' (``records.launches_for(...,
fp8="q4" or "nvfp4")``); the bytes are `decode.kv4`'s, so a CPU computes what the GPU
stores.

A 4-bit cache stores, per token and KV head, ``head_dim / 2`` bytes of values (K's and V's
buffers, ``k_buffer``/``v_buffer``) and its block scales (``k_block_scales``/
``v_block_scales``): q4 (``dtype="int4"``), float16 per 32 elements; nvfp4, e4m3 bytes per
16 and a float32 scale per KV head (``k_scale``/``v_scale``, as an fp8 cache's).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..decode.checks import dtype_name
from ..decode.fp8 import ROW_DTYPES
from ..decode.kv4 import (
    NVFP4_BLOCK,
    Q4_DEFAULT_GROUP,
    dequantize_nvfp4,
    dequantize_q4,
    hadamard,
)
from ..decode.kv4_device import Q4_HEAD_DIMS, nvfp4_quantize_kernel, q4_quantize_kernel
from ..driver.launch import Kernel, LaunchSequence, PackedLaunch
from ..driver.memory import DeviceArray, empty
from ..kernels.catalogue import get_kernel
from ..kernels.spec import NVFP4_FORMAT, Q4_FORMAT

__all__ = [
    "FOUR_BIT_DTYPES",
    "FourBitStore",
    "check_four_bit",
    "check_four_bit_device",
    "four_bit_format",
    "refuse_four_bit",
]

# KVCache's dtype names -> the kernels' format: "int4" is DESIGN.md's name, "q4" the
# format's own (decode/kv4.py)
FOUR_BIT_DTYPES = {"int4": Q4_FORMAT, "q4": Q4_FORMAT, "nvfp4": NVFP4_FORMAT}
# the measured defaults (docs/design.md, the kv4 accuracy table): q4's K rotated, nvfp4's not
DEFAULT_ROTATE = {Q4_FORMAT: True, NVFP4_FORMAT: False}
_WARPS_MAX = 16  # a one-row append's block: a warp per KV head, up to this many


def four_bit_format(dtype: Any) -> str:
    """``"q4"`` or ``"nvfp4"`` for a 4-bit cache's dtype name, else ``""``."""
    return FOUR_BIT_DTYPES.get(dtype, "") if isinstance(dtype, str) else ""


def refuse_four_bit(dtype: Any, who: str) -> None:
    """Raise ValueError naming ``dtype`` where ``who`` (a cache type) is given a 4-bit
    format it does not hold (rather than reading "int4" as numpy's int32)."""
    if four_bit_format(dtype):
        raise ValueError(
            f"dtype: {who} does not hold 4-bit caches ({dtype!r}); a KVCache does "
            f"(fd.KVCache(..., dtype={dtype!r}))"
        )


def check_four_bit(fmt: str, head_dim: int, rotate: bool | None) -> bool:
    """A 4-bit cache's arguments checked (before any device work); returns whether K is
    rotated.

    Raises:
        TypeError, ValueError: naming ``head_dim`` or ``rotate``.
    """
    name = "int4" if fmt == Q4_FORMAT else fmt
    if head_dim not in Q4_HEAD_DIMS:
        raise ValueError(
            f"head_dim: {name} caches take head_dim 64, 128 or 256 (a row a warp, read by the "
            f"rows kernels), got {head_dim}; use a float8 or 16-bit cache for other widths"
        )
    if rotate is not None and not isinstance(rotate, (bool, np.bool_)):
        raise TypeError(f"rotate: expected None, True or False, got {type(rotate).__name__}")
    return DEFAULT_ROTATE[fmt] if rotate is None else bool(rotate)


def check_four_bit_device(fmt: str, compute_capability: tuple[int, int]) -> None:
    """Raise ValueError naming ``dtype`` where the device cannot read the format."""
    if compute_capability < (8, 0) or (fmt == NVFP4_FORMAT and compute_capability < (8, 9)):
        name = "int4" if fmt == Q4_FORMAT else fmt
        need = "8.9" if fmt == NVFP4_FORMAT else "8.0"
        raise ValueError(
            f"dtype: {name} caches need compute capability {need} or newer (tensor cores for "
            f"fp16/bf16{', e4m3 conversions' if fmt == NVFP4_FORMAT else ''}); this device "
            f"has {compute_capability}"
        )


def _kernel(fmt: str, device: Any, rows: str, head_dim: int, rotate: bool) -> Kernel:
    if fmt == Q4_FORMAT:
        return q4_quantize_kernel(device, rows, head_dim, Q4_DEFAULT_GROUP, rotate)
    return nvfp4_quantize_kernel(device, rows, head_dim, rotate)


class FourBitStore:
    """The block scales of a 4-bit cache ``kv`` (made by its ``__init__``), its device
    staging for host rows and its quantizing launches, one per row dtype (float32, float16,
    bfloat16), packed once: a one-row append writes the staged rows' address and the
    position, and launches.

    Args:
        kv: the cache (its values buffers, state, staging ring and kv_scales made).
        fmt: ``"q4"`` or ``"nvfp4"``.
        rotate: whether K is rotated (the Hadamard transform over the head_dim).
    """

    def __init__(self, kv: Any, fmt: str, rotate: bool) -> None:
        self.fmt, self.rotate = fmt, rotate
        d, n_kv, cap = kv.head_dim, kv.n_kv_heads, kv.capacity
        self.n_kv, self.head_dim, self.capacity = n_kv, d, cap
        self.device, self.stream = kv.device, kv.stream
        per, sdt = (
            (d // Q4_DEFAULT_GROUP, np.dtype(np.float16)) if fmt == Q4_FORMAT
            else (d // NVFP4_BLOCK, np.dtype(np.uint8))
        )  # fmt: skip
        self.k_scales = empty((cap, n_kv, per), sdt, device=kv.device)
        self.v_scales = empty((cap, n_kv, per), sdt, device=kv.device)
        self.inv_sqrt = np.float32(1.0 / np.sqrt(d))
        stage = kv._ring.kv  # a slot: K's rows then V's, in the rows' dtype
        self.dev_stage = empty(stage.shape, np.uint8, device=kv.device)
        self.slot_bytes = stage.shape[1]
        slots = stage.shape[0]
        threads = 32 * min(n_kv, _WARPS_MAX)
        # dtype -> (the staging ring seen as [slot][K|V][row] of it, its launch)
        self.appends: dict[np.dtype, tuple[np.ndarray, PackedLaunch]] = {}
        for dt in ROW_DTYPES:
            strides = (self.slot_bytes, kv.row_elems * dt.itemsize, dt.itemsize)
            view = np.ndarray((slots, 2, kv.row_elems), dt, stage, strides=strides)
            launch = PackedLaunch(
                _kernel(fmt, kv.device, dtype_name(dt), d, rotate), 1, threads,
                self.args(kv, None, None, 1, 0), stream=kv.stream,
            )  # fmt: skip
            self.appends[dt] = (view, launch)

    # the kernels' arguments: rows K, V (slots 0, 1), the cache, n_kv, n, first (slot 8)...
    def args(self, kv: Any, k_rows: Any, v_rows: Any, n: int, first: int) -> tuple[Any, ...]:
        """The quantizing kernel's arguments for ``n`` rows at ``first`` (-1: one row at
        the device's length, bumped; -2: n rows there, not bumped)."""
        args: tuple[Any, ...] = (
            k_rows, v_rows, kv.k_buffer, kv.v_buffer, self.k_scales, self.v_scales,
            np.int32(self.n_kv), np.int32(n), np.int32(first), kv.state,
            np.int32(self.capacity), self.inv_sqrt,
        )  # fmt: skip
        if self.fmt == NVFP4_FORMAT:
            args += (kv.kv_scales,)
        return args

    def quantize(self, kv: Any, k_dev: DeviceArray, v_dev: DeviceArray, n: int, seq: int) -> None:
        """Queue the quantization of ``n`` device rows of K and V (one dtype of ROW_DTYPES,
        C-contiguous) into tokens ``seq .. seq + n`` on the cache's stream."""
        kernel = _kernel(self.fmt, self.device, dtype_name(k_dev.dtype), self.head_dim,
                         self.rotate)  # fmt: skip
        warps = n * self.n_kv
        grid = max(1, min(4096, -(-warps // 8)))
        kernel.launch(grid, 256, self.args(kv, k_dev, v_dev, n, seq), stream=self.stream)

    def device_append(self, kv: Any, rows: np.dtype, n: int, stream: Any) -> LaunchSequence:
        """``kv_append_async``'s launches for ``n`` device rows of dtype ``rows`` at the
        device's length (roles k, v: the rows' addresses): one launch that bumps the
        length for one row; for n, the rows' launch then the bump."""
        kernel = _kernel(self.fmt, self.device, dtype_name(rows), self.head_dim, self.rotate)
        if n == 1:
            launch = PackedLaunch(kernel, 1, 32 * min(self.n_kv, _WARPS_MAX),
                                  self.args(kv, None, None, 1, -1), stream=stream)  # fmt: skip
            return LaunchSequence([launch], ("k", "v"), [((0, "k"), (1, "v"))], self.device)
        grid = max(1, min(4096, -(-n * self.n_kv // 8)))
        launch = PackedLaunch(kernel, grid, 256, self.args(kv, None, None, n, -2), stream=stream)
        bump = get_kernel("kv_cache.cu", "kv_bump", self.device)
        bumped = PackedLaunch(bump, 1, 1, (kv.state, np.int32(n), np.int32(self.capacity)),
                              stream=stream)  # fmt: skip
        return LaunchSequence([launch, bumped], ("k", "v"), [((0, "k"), (1, "v")), ()],
                              self.device)  # fmt: skip

    def dequantized(
        self, k_vals: np.ndarray, v_vals: np.ndarray, k_scales: np.ndarray,
        v_scales: np.ndarray, globals_: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """K and V as float32 ``(seq, n_kv_heads, head_dim)`` from the cache's values and
        block scales (``KVCache.to_host``, ``block_scales``): the format decoded, K's
        rotation undone (exact in float32 up to rounding: the rotation is its own
        inverse)."""
        if self.fmt == Q4_FORMAT:
            k, v = dequantize_q4(k_vals, k_scales), dequantize_q4(v_vals, v_scales)
        else:
            n = self.n_kv
            k = dequantize_nvfp4(k_vals, k_scales, globals_[:n])
            v = dequantize_nvfp4(v_vals, v_scales, globals_[n:])
        if self.rotate and k.shape[0]:
            k = hadamard(k)
        return k, v

    def close(self) -> None:
        for arr in (self.k_scales, self.v_scales, self.dev_stage):
            arr.close()
