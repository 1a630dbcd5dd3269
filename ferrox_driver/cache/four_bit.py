"""A 4-bit KVCache's own parts (and those of a cache whose K and V take formats of their
own, e.g. fp8 K and 4-bit V): its formats' names, the block scales beside the packed
values, and the quantizing appends (host rows staged and quantized on the device by
``cuda_src/kv_quantize4.cu``, device rows quantized in place, ``kv_append_async``'s
capturable launches). The decodes are the rows kernels' (``records.launches_for(...,
fp8="q4" or "nvfp4")``); the bytes are `decode.kv4`'s, so a CPU computes what the GPU
stores.

A 4-bit cache stores, per token and KV head, ``head_dim / 2`` bytes of values (K's and V's
buffers, ``k_buffer``/``v_buffer``) and its block scales (``k_block_scales``/
``v_block_scales``): q4 (``dtype="int4"``), float16 per 32 elements; nvfp4, e4m3 bytes per
16 and a float32 scale per KV head (``k_scale``/``v_scale``, as an fp8 cache's). K and V
in formats of their own (``v_dtype``, `check_mixed`): each side stored as a cache of its
format stores it (an fp8 side's bytes ``[token][n_kv_heads][head_dim]``, no block scales),
quantized by ``kv_quantize4.cu``'s mixed kernels, read by the rows kernels.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..decode.checks import dtype_name, layout_shape
from ..decode.fp8 import FP8_DTYPES, ROW_DTYPES
from ..decode.kv4 import (
    NVFP4_BLOCK,
    Q4_DEFAULT_GROUP,
    dequantize_nvfp4,
    dequantize_q4,
    hadamard,
)
from ..decode.kv4_device import Q4_FILE, Q4_HEAD_DIMS, nvfp4_quantize_kernel, q4_quantize_kernel
from ..driver.launch import Kernel, LaunchSequence, PackedLaunch
from ..driver.memory import DeviceArray, as_dtype, empty
from ..kernels.catalogue import get_kernel
from ..kernels.spec import (
    ENTRY_TYPES,
    FOUR_BIT_FORMATS,
    NVFP4_FORMAT,
    Q4_FORMAT,
    QUANTIZED_Q8,
    mixed_format,
)

__all__ = [
    "DEFAULT_LAYOUT",
    "FOUR_BIT_DTYPES",
    "FourBitStore",
    "MixedFormats",
    "check_four_bit",
    "check_four_bit_layout",
    "check_mixed",
    "check_four_bit_device",
    "four_bit_format",
    "refuse_four_bit",
]

# KVCache's dtype names -> the kernels' format: "int4" is DESIGN.md's name, "q4" the
# format's own (decode/kv4.py)
FOUR_BIT_DTYPES = {"int4": Q4_FORMAT, "q4": Q4_FORMAT, "nvfp4": NVFP4_FORMAT}
# the measured defaults (docs/design.md, the kv4 accuracy table): q4's K rotated, nvfp4's not
DEFAULT_ROTATE = {Q4_FORMAT: True, NVFP4_FORMAT: False}
# KVCache(kv_layout=None)'s storage of a 4-bit cache of one format (and FourBitCache's):
# head-major, each KV head's rows in one run, which the decode reads faster than
# token-major rows 64 bytes wide (docs/design.md, issue 49).
DEFAULT_LAYOUT = "HND"


def check_four_bit_layout(kv_layout: Any, four: str, mixed: bool) -> bool:
    """Whether a KVCache of ``four`` (its 4-bit format, or "") stores its rows head-major,
    from ``kv_layout`` (None: `DEFAULT_LAYOUT` for a 4-bit cache of one format).

    Raises:
        ValueError: naming ``kv_layout``: not None, "NHD" or "HND"; "HND" for a cache that
            is not a 4-bit cache of one format.
    """
    if kv_layout not in (None, "NHD", "HND"):
        raise ValueError(f"kv_layout: expected None, 'NHD' or 'HND', got {kv_layout!r}")
    one_format = four in FOUR_BIT_FORMATS and not mixed
    if kv_layout == "HND" and not one_format:
        raise ValueError(
            "kv_layout: a KVCache stores head-major ('HND') only as a 4-bit cache of one "
            "format (dtype 'int4' or 'nvfp4', no v_dtype); others are token-major ('NHD')"
        )
    return one_format and (kv_layout or DEFAULT_LAYOUT) == "HND"


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


class MixedFormats(NamedTuple):
    """A cache's K and V formats where they differ (`check_mixed`)."""

    k_fmt: str  # "e4m3", "e5m2", "q4" or "nvfp4"
    v_fmt: str
    rotate: bool  # K rotated (a 4-bit K only)

    @property
    def fp8(self) -> str:
        """The cache's format for the kernels (``spec.mixed_format``: "e4m3+q4")."""
        return mixed_format(self.k_fmt, self.v_fmt)


_FORMAT_NAMES = {Q4_FORMAT: "int4", NVFP4_FORMAT: "nvfp4", "e4m3": "float8_e4m3fn",
                 "e5m2": "float8_e5m2"}  # fmt: skip
_NEEDS = {Q4_FORMAT: (8, 0), NVFP4_FORMAT: (8, 9), "e4m3": (8, 9), "e5m2": (8, 9)}
_QUANTIZED = "float8_e4m3fn, float8_e5m2, 'int4' or 'nvfp4'"


def _quantized_format(dtype: Any, name: str) -> str:
    """``dtype``'s quantized format ("q4", "nvfp4", "e4m3", "e5m2"), or "" (16/32-bit)."""
    return four_bit_format(dtype) or FP8_DTYPES.get(as_dtype(dtype, name), "")


def check_mixed(
    dtype: Any, v_dtype: Any, head_dim: int, rotate: bool | None, k_scale: Any, v_scale: Any,
) -> MixedFormats | None:  # fmt: skip
    """K's and V's formats where ``v_dtype`` takes V a format of its own (None where it is
    None or K's): both quantized (fp8 e4m3/e5m2, int4, nvfp4), a head_dim the rows kernels
    read (64, 128, 256), the rotation a 4-bit K's, the scales the fp8 and nvfp4 sides'.

    Raises:
        TypeError, ValueError: naming ``v_dtype``, ``head_dim``, ``rotate``, ``k_scale`` or
            ``v_scale`` (before any device work).
    """
    if v_dtype is None:
        return None
    k_fmt, v_fmt = _quantized_format(dtype, "dtype"), _quantized_format(v_dtype, "v_dtype")
    if k_fmt == v_fmt and (k_fmt or as_dtype(v_dtype, "v_dtype") == as_dtype(dtype, "dtype")):
        return None  # (V as K)
    if not (k_fmt and v_fmt):
        raise ValueError(
            f"v_dtype: K and V in formats of their own are both quantized ({_QUANTIZED}: "
            f"fp8 K and int4 V, say); got dtype {dtype!r} and v_dtype {v_dtype!r} (None: V "
            f"as K)"
        )
    if head_dim not in Q4_HEAD_DIMS:
        raise ValueError(
            f"head_dim: K and V in formats of their own take head_dim 64, 128 or 256 (a row "
            f"a warp, read by the rows kernels), got {head_dim}"
        )
    if rotate is not None and not isinstance(rotate, (bool, np.bool_)):
        raise TypeError(f"rotate: expected None, True or False, got {type(rotate).__name__}")
    if k_fmt not in FOUR_BIT_FORMATS:
        if rotate:
            raise ValueError(f"rotate: only a 4-bit K is rotated, K here is "
                             f"{_FORMAT_NAMES[k_fmt]}; pass None or False")  # fmt: skip
        rotated = False
    else:
        rotated = DEFAULT_ROTATE[k_fmt] if rotate is None else bool(rotate)
    for fmt, scale, name in ((k_fmt, k_scale, "k_scale"), (v_fmt, v_scale, "v_scale")):
        if fmt == Q4_FORMAT and scale is not None:
            side = "K" if name == "k_scale" else "V"
            raise ValueError(f"{name}: {side} in int4 scales each group of 32 itself; only the "
                             f"fp8 and nvfp4 sides take scales")  # fmt: skip
    return MixedFormats(k_fmt, v_fmt, rotated)


def check_mixed_device(mixed: MixedFormats, compute_capability: tuple[int, int]) -> None:
    """Raise ValueError naming ``dtype`` or ``v_dtype`` where the device cannot read a side."""
    for fmt, name in ((mixed.k_fmt, "dtype"), (mixed.v_fmt, "v_dtype")):
        if compute_capability < _NEEDS[fmt]:
            need = ".".join(map(str, _NEEDS[fmt]))
            raise ValueError(
                f"{name}: {_FORMAT_NAMES[fmt]} needs compute capability {need} or newer; "
                f"this device has {compute_capability}"
            )


def format_dtype(fmt: str) -> np.dtype:
    """A quantized format's numpy dtype (``ml_dtypes``' int4, float4_e2m1fn, float8_*)."""
    import ml_dtypes  # on first use: importing ferrox_driver does not import it

    return np.dtype(getattr(ml_dtypes, "int4" if fmt == Q4_FORMAT else "float4_e2m1fn"
                            if fmt == NVFP4_FORMAT else _FORMAT_NAMES[fmt]))  # fmt: skip


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


def mixed_quantize_kernel(
    device: Any, rows: str, head_dim: int, k_fmt: str, v_fmt: str, rotate: bool
) -> Kernel:
    """The kernel quantizing rows of kernel dtype ``rows`` (f32, f16, bf16) into a cache of
    K in ``k_fmt`` and V in ``v_fmt`` (``kv_quantize4.cu``'s mixed kernels), K rotated
    where ``rotate`` (a 4-bit K)."""
    name = f"kv_quantize_{k_fmt}{'r' if rotate else ''}_v{v_fmt}_{rows}_d{head_dim}"
    entry = (
        f"FX_QUANTIZE_MIXED_ENTRY({name}, {ENTRY_TYPES[rows]}, {head_dim}, {QUANTIZED_Q8[k_fmt]}, "
        f"{QUANTIZED_Q8[v_fmt]}, {'true' if rotate else 'false'})"
    )
    return get_kernel(Q4_FILE, name, device, select=entry)


def _kernel(fmt: str, device: Any, rows: str, head_dim: int, rotate: bool,
            v_fmt: str = "") -> Kernel:  # fmt: skip
    if v_fmt and v_fmt != fmt:
        return mixed_quantize_kernel(device, rows, head_dim, fmt, v_fmt, rotate)
    if fmt == Q4_FORMAT:
        return q4_quantize_kernel(device, rows, head_dim, Q4_DEFAULT_GROUP, rotate)
    return nvfp4_quantize_kernel(device, rows, head_dim, rotate)


def quantize_grid(n: int, n_kv: int) -> tuple[int, int]:
    """The 4-bit quantizing kernels' launch shape for ``n`` rows of ``n_kv`` KV heads (a
    row a warp): one block bumping the length for one row, else blocks of 8 warps."""
    if n == 1:
        return 1, 32 * min(n_kv, _WARPS_MAX)
    return max(1, min(4096, -(-n * n_kv // 8))), 256


def append_sequence(
    device: Any, launch: PackedLaunch, state: Any, n: int, capacity: int, stream: Any
) -> LaunchSequence:
    """An append of ``n`` rows as a packed sequence: ``launch`` (its first two arguments
    the rows' addresses, roles k and v) and, for several rows, the length bumped after
    every block has read it (``kv_bump``)."""
    launches = [launch]
    if n > 1:
        bump = get_kernel("kv_cache.cu", "kv_bump", device)
        launches.append(PackedLaunch(bump, 1, 1, (state, np.int32(n), np.int32(capacity)),
                                     stream=stream))  # fmt: skip
    slots = [((0, "k"), (1, "v"))] + [()] * (len(launches) - 1)
    return LaunchSequence(launches, ("k", "v"), slots, device)


class FourBitStore:
    """The block scales of a 4-bit cache ``kv`` (made by its ``__init__``), its device
    staging for host rows and its quantizing launches, one per row dtype (float32, float16,
    bfloat16), packed once: a one-row append writes the staged rows' address and the
    position, and launches.

    A cache of K and V in formats of their own (``v_fmt``) is held the same way: each side
    its own format's block scales (an fp8 side's ``k_scales``/``v_scales`` a placeholder
    the kernels never read), one kernel quantizing both sides.

    Args:
        kv: the cache (its values buffers, state, staging ring and kv_scales made).
        fmt: ``"q4"`` or ``"nvfp4"``; with ``v_fmt``, K's format (or ``"e4m3"``, ``"e5m2"``).
        rotate: whether K is rotated (the Hadamard transform over the head_dim).
        v_fmt: V's format where it is not K's (None: K's).
    """

    def __init__(self, kv: Any, fmt: str, rotate: bool, v_fmt: str | None = None) -> None:
        self.fmt, self.rotate = fmt, rotate
        self.v_fmt = fmt if v_fmt is None else v_fmt
        self.mixed = self.v_fmt != fmt
        d, n_kv, cap = kv.head_dim, kv.n_kv_heads, kv.capacity
        self.n_kv, self.head_dim, self.capacity = n_kv, d, cap
        self.device, self.stream = kv.device, kv.stream
        # head-major (kv.head_major): values and block scales [n_kv][capacity][...]; the
        # kernels take the rows a head (the quantizers) or the values' bytes a head (the
        # decodes' head stride); token-major: 0
        self.head_rows = cap if kv.head_major else 0
        self.head_stride = self.head_rows * (d // 2)

        def block_scales(side: str) -> DeviceArray:
            per = d // (Q4_DEFAULT_GROUP if side == Q4_FORMAT else NVFP4_BLOCK)
            shape = layout_shape("HND" if self.head_rows else "NHD", cap, n_kv, per)
            if side == Q4_FORMAT:
                return empty(shape, np.float16, device=kv.device)
            if side == NVFP4_FORMAT:
                return empty(shape, np.uint8, device=kv.device)
            return empty((16,), np.uint8, device=kv.device)  # (an fp8 side: none)

        self.k_scales = block_scales(fmt)
        self.v_scales = block_scales(self.v_fmt)
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
                _kernel(fmt, kv.device, dtype_name(dt), d, rotate, self.v_fmt), 1, threads,
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
        if self.fmt == NVFP4_FORMAT or self.mixed:  # (mixed: the fp8 and nvfp4 sides')
            args += (kv.kv_scales,)
        if not self.mixed:  # (the rows a KV head: head-major)
            args += (np.int64(self.head_rows),)
        return args

    def by_value_args(self, kv: Any) -> tuple[Any, ...]:
        """The by-value append kernel's arguments (``kv_append4_*``; the rows, slot 0,
        and the position, slot 6, written per call)."""
        return (np.uint64(0), kv.k_buffer, kv.v_buffer, self.k_scales, self.v_scales,
                np.int32(self.n_kv), np.int32(0), kv.state, self.inv_sqrt,
                np.uint64(0) if kv.kv_scales is None else kv.kv_scales,
                np.int64(self.head_rows))  # fmt: skip

    def tokens(self, arr: DeviceArray, seq: int) -> np.ndarray:
        """The first ``seq`` tokens of a values or block-scales buffer of this cache on
        the host, token-major ``(seq, n_kv_heads, ...)`` whatever the layout."""
        per = arr.shape[-1]
        if seq == 0:
            return np.zeros((0, self.n_kv, per), arr.dtype)
        if not self.head_rows:
            return arr.view((seq, self.n_kv, per)).to_host(self.stream)
        out = np.empty((seq, self.n_kv, per), arr.dtype)
        for h in range(self.n_kv):  # (one copy a head: its first seq rows)
            at = h * self.head_rows * per * arr.dtype.itemsize
            out[:, h] = arr.view((seq, per), offset=at).to_host(self.stream)
        return out

    def quantize(self, kv: Any, k_dev: DeviceArray, v_dev: DeviceArray, n: int, seq: int) -> None:
        """Queue the quantization of ``n`` device rows of K and V (one dtype of ROW_DTYPES,
        C-contiguous) into tokens ``seq .. seq + n`` on the cache's stream."""
        kernel = _kernel(self.fmt, self.device, dtype_name(k_dev.dtype), self.head_dim,
                         self.rotate, self.v_fmt)  # fmt: skip
        warps = n * self.n_kv
        grid = max(1, min(4096, -(-warps // 8)))
        kernel.launch(grid, 256, self.args(kv, k_dev, v_dev, n, seq), stream=self.stream)

    def device_append(self, kv: Any, rows: np.dtype, n: int, stream: Any) -> LaunchSequence:
        """``kv_append_async``'s launches for ``n`` device rows of dtype ``rows`` at the
        device's length (roles k, v: the rows' addresses): one launch that bumps the
        length for one row; for n, the rows' launch then the bump."""
        kernel = _kernel(self.fmt, self.device, dtype_name(rows), self.head_dim, self.rotate,
                         self.v_fmt)  # fmt: skip
        grid, threads = quantize_grid(n, self.n_kv)
        args = self.args(kv, None, None, n, -1 if n == 1 else -2)
        launch = PackedLaunch(kernel, grid, threads, args, stream=stream)
        return append_sequence(self.device, launch, kv.state, n, self.capacity, stream)

    def dequantized(
        self, k_vals: np.ndarray, v_vals: np.ndarray, k_scales: np.ndarray | None,
        v_scales: np.ndarray | None, globals_: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """K and V as float32 ``(seq, n_kv_heads, head_dim)`` from the cache's values and
        block scales (``KVCache.to_host``, ``block_scales``): each side's format decoded
        (an fp8 side: its values times its KV head's scale, a float32 product), K's
        rotation undone (exact in float32 up to rounding: the rotation is its own
        inverse)."""
        n = self.n_kv

        def side(fmt: str, vals: np.ndarray, scales: Any, g: np.ndarray) -> np.ndarray:
            if fmt == Q4_FORMAT:
                return dequantize_q4(vals, scales)
            if fmt == NVFP4_FORMAT:
                return dequantize_nvfp4(vals, scales, g)
            return vals.astype(np.float32) * g[:, None]  # (as an fp8 cache's dequantized)

        k = side(self.fmt, k_vals, k_scales, globals_[:n])
        v = side(self.v_fmt, v_vals, v_scales, globals_[n:])
        if self.rotate and k.shape[0]:
            k = hadamard(k)
        return k, v

    def close(self) -> None:
        for arr in (self.k_scales, self.v_scales, self.dev_stage):
            arr.close()
