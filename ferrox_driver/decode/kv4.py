"""4-bit KV formats ("q4" and "nvfp4") and the Hadamard rotation, on the host.

What a 4-bit `KVCache` (``dtype="int4"`` is q4 in groups of 32, ``"nvfp4"``) stores, bit
for bit, so a CPU can check what the GPU will hold: public as ``fd.quantize_int4``,
``fd.dequantize_int4``, ``fd.quantize_nvfp4``, ``fd.dequantize_nvfp4`` and ``fd.hadamard``
(a cache that rotates K stores ``quantize(hadamard(k))``). Every function works over the
last axis (head_dim) of arrays shaped ``(..., head_dim)``, e.g. a ``(seq, n_kv_heads,
head_dim)`` cache, in float32 (float16, bfloat16 and float64 rows are converted first), and
refuses inf and NaN: neither format has a code for them.

Bytes (the device layout). Values and scales live in separate arrays with the same leading
axes (per token and KV head, as the cache's rows):

- values: ``uint8 (..., head_dim // 2)``; byte ``i`` holds element ``2i`` in its low nibble
  (bits 0-3) and element ``2i + 1`` in its high nibble. A row is ``head_dim / 2`` bytes: a
  multiple of 16 for every head_dim that is a multiple of 32 (64: 32 B, 96: 48 B, 128: 64 B,
  256: 128 B), so rows stay 16-byte aligned and a kernel reads them with 16-byte loads;
  80 and 112 give 40 and 56 B rows (8-byte aligned). Scales interleaved with the values (as
  llama.cpp's 18-byte ``block_q4_0``) would leave no 16-byte load aligned; kept apart they
  cost one small load per row (8 bytes at head_dim 128 for either format).
- scales: ``(..., head_dim // G)``, one per group of ``G`` consecutive elements of a row.

"q4" (the DESIGN's ``int4``, q4_0-like): ``G`` = 16, 32 (default) or 64; 4 + 16/G bits per
element (4.5 at 32). The scale is float16: ``amax / 7`` (the group's largest magnitude,
float32 division) rounded to nearest even, saturated at 65504. Codes ``c = rint(x /
scale)`` (float32 division, ties to even) clipped to [-7, 7], stored offset-binary: nibble
``c + 8``. Decoding is ``(nibble - 8) * scale`` for every nibble, exact in float32. Nibble 0
(code -8) is never written: ``amax / 7`` makes the grid symmetric (+-amax land on +-7
exactly, errors unbiased in sign); llama.cpp's ``max / -8`` buys one sign an eighth more
resolution and clips the other sign's largest values at 7/8 of amax. Offset binary is what
lets a kernel convert a nibble to float16 with one OR (``0x6400 | nibble`` is ``1024 +
nibble``) and one subtraction of 1032. A zero group (or one whose scale underflows float16:
amax at most 7 * 2**-25, about 2e-7) has scale 0 and codes 0.

"nvfp4" (NVIDIA's NVFP4): e2m1 values (sign bit 3, then 2 exponent bits and 1 mantissa bit:
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; negative zero kept), one ``float8_e4m3fn`` scale per
16 elements and one float32 ``global_scale`` per KV head (axis -2); 4.5 bits per element.
``global = amax_head / (6 * 448)`` over every row of the head unless given (a head of zeros,
or with amax below 2688 times float32's smallest normal, gets 1). Per block, in float32:
``s = amax_block / 6 / global``, saturated at 448 and rounded to the nearest even e4m3;
values ``x / (s * global)`` rounded to the nearest even e2m1 and saturated at +-6 (a block
whose scale rounds to 0 stores zeros). Decoding is ``(value * s) * global``: ``value * s``
is exact (in float32, float16 or bfloat16), so a kernel can leave ``global`` for the end
(the score's scale for K, the output for V).

The rotation: ``hadamard`` multiplies the axis by ``H / sqrt(b)`` per block of ``b``
elements, ``H`` the Sylvester Hadamard matrix and ``b`` the largest power of two dividing the
size (`hadamard_block`: the whole axis for 64, 128, 256; 16 for 80 and 112, 32 for 96 and
160, 64 for 192, 8 for 72 and 40). It is orthonormal and symmetric, so it is its own inverse
and ``hadamard(q) . hadamard(k) == q . k``: rotating K and q together leaves the scores as
they were; V rotated on append is rotated back in the output. It spreads a few large
channels (as real models' K have) over the block, which shrinks the 4-bit scales. In
float32: the butterflies pair elements ``i, i + h`` for ``h = 1, 2, 4, ...`` (``(a + b, a -
b)``), then one multiplication by ``float32(1 / sqrt(b))`` (exact for b a power of four); a
kernel that keeps this order gets the same bits.
"""

from __future__ import annotations

import math

import numpy as np

from ..types import HostArrayLike
from .fp8 import check_scales

__all__ = [
    "E2M1_VALUES",
    "NVFP4_BLOCK",
    "Q4_GROUP_SIZES",
    "dequantize_int4",
    "dequantize_nvfp4",
    "dequantize_q4",
    "hadamard",
    "hadamard_block",
    "quantize_int4",
    "quantize_nvfp4",
    "quantize_q4",
]

Q4_GROUP_SIZES = (16, 32, 64)
Q4_DEFAULT_GROUP = 32
Q4_OFFSET = 8  # nibble = code + 8 (offset binary)
Q4_MAX_CODE = 7
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
_F16_MAX = 65504.0
# e2m1 code -> value: bit 3 the sign, bits 0-2 index the magnitudes
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
_E2M1_MIDPOINTS = (E2M1_VALUES[1:8] + E2M1_VALUES[:7]) / np.float32(2)


def hadamard_block(n: int) -> int:
    """The block `hadamard` rotates an axis of ``n`` elements by: the largest power of two
    dividing ``n`` (``n`` itself for a power of two; 16 for 80, 32 for 96)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"n: expected an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"n: expected a positive size, got {n}")
    return int(n) & -int(n)


def hadamard(x: HostArrayLike, axis: int = -1) -> np.ndarray:
    """``x`` rotated along ``axis`` by the orthonormal block-Hadamard transform, in float32
    (its own inverse; see the module's notes for the block and the order of operations).

    Args:
        x: floating-point values.
        axis: the axis to rotate (head_dim: the last).

    Returns:
        A float32 array of x's shape.

    Raises:
        TypeError, ValueError: naming ``x`` or ``axis``.
    """
    arr = _float_array(x, "x")
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"axis: expected an int, got {type(axis).__name__}")
    if not -arr.ndim <= axis < arr.ndim:
        raise ValueError(f"axis: expected -{arr.ndim} <= axis < {arr.ndim} for x of shape "
                         f"{arr.shape}, got {axis}")  # fmt: skip
    y = np.ascontiguousarray(np.moveaxis(arr.astype(np.float32), axis, -1))
    n = y.shape[-1]
    if n == 0:
        raise ValueError(f"x: expected at least one element along axis {axis}, got shape "
                         f"{arr.shape}")  # fmt: skip
    b, lead = hadamard_block(n), y.shape[:-1]
    h = 1
    while h < b:
        pairs = y.reshape(*lead, n // (2 * h), 2, h)
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        y = np.stack((first + second, first - second), axis=-2).reshape(*lead, n)
        h *= 2
    y *= np.float32(1.0 / math.sqrt(b))
    return np.moveaxis(y, -1, axis)


def quantize_q4(
    x: HostArrayLike, group_size: int = Q4_DEFAULT_GROUP
) -> tuple[np.ndarray, np.ndarray]:
    """``x`` in the q4 format: packed nibbles and one float16 scale per group.

    Args:
        x: finite floating-point values, ``(..., head_dim)``, head_dim a multiple of
            ``group_size``.
        group_size: 16, 32 or 64 elements per scale.

    Returns:
        ``(values, scales)``: uint8 ``(..., head_dim // 2)`` and float16 ``(..., head_dim //
            group_size)``.

    Raises:
        TypeError, ValueError: naming ``x``, ``group_size`` or ``head_dim``.
    """
    rows = _float_rows(x, "x")
    g = _check_group_size(group_size)
    d = rows.shape[-1]
    if d % g:
        raise ValueError(f"head_dim: the q4 format with group_size {g} takes head_dims that "
                         f"are multiples of {g}, got {d}")  # fmt: skip
    lead = rows.shape[:-1]
    groups = rows.reshape(*lead, d // g, g)
    amax = np.abs(groups).max(axis=-1, initial=np.float32(0))
    scales = np.minimum(amax / np.float32(Q4_MAX_CODE), np.float32(_F16_MAX)).astype(np.float16)
    s = scales.astype(np.float32)[..., None]
    y = np.divide(groups, s, out=np.zeros_like(groups), where=s > 0)
    codes = np.clip(np.rint(y), -Q4_MAX_CODE, Q4_MAX_CODE).astype(np.int8)
    nibbles = (codes + Q4_OFFSET).astype(np.uint8).reshape(*lead, d)
    return _pack(nibbles), scales


def dequantize_q4(values: HostArrayLike, scales: HostArrayLike) -> np.ndarray:
    """q4 ``values`` and ``scales`` (as `quantize_q4` makes them) as float32 ``(...,
    head_dim)``; the group size is ``head_dim // scales.shape[-1]``.

    Raises:
        TypeError, ValueError: naming ``values`` or ``scales``.
    """
    packed = _packed(values, "values")
    sc = np.asarray(scales)
    if sc.dtype != np.float16:
        raise TypeError(f"scales: expected float16 (one per group), got {sc.dtype}")
    d = 2 * packed.shape[-1]
    n_groups = sc.shape[-1] if sc.ndim else 0
    if (sc.shape[:-1] != packed.shape[:-1] or n_groups == 0 or d % n_groups
            or d // n_groups not in Q4_GROUP_SIZES):  # fmt: skip
        raise ValueError(
            f"scales: expected shape {packed.shape[:-1]} + (head_dim // group_size,) with "
            f"head_dim {d} and a group_size in {Q4_GROUP_SIZES}, got {sc.shape}"
        )
    lead = packed.shape[:-1]
    codes = _unpack(packed).astype(np.float32) - np.float32(Q4_OFFSET)
    out = codes.reshape(*lead, n_groups, d // n_groups) * sc.astype(np.float32)[..., None]
    return out.reshape(*lead, d)


quantize_int4 = quantize_q4  # DESIGN.md's name for the format (KVCache dtype "int4")
dequantize_int4 = dequantize_q4


def quantize_nvfp4(
    x: HostArrayLike, global_scale: HostArrayLike | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x`` in the nvfp4 format: packed e2m1 nibbles, an e4m3 scale per 16 elements and a
    float32 scale per KV head.

    Args:
        x: finite floating-point values, ``(..., n_kv_heads, head_dim)``, head_dim a
            multiple of 16 (a head-major cache's ``(n_kv_heads, seq, head_dim)`` rows go
            in as ``x.swapaxes(0, 1)``: the KV head is axis -2).
        global_scale: a positive scalar or one per KV head; None: ``amax / (6 * 448)`` of
            each head's values in ``x`` (a cache fixes it before its first append).

    Returns:
        ``(values, block_scales, global_scale)``: uint8 ``(..., n_kv_heads, head_dim //
            2)``, ``ml_dtypes.float8_e4m3fn`` ``(..., n_kv_heads, head_dim // 16)`` and
            float32 ``(n_kv_heads,)``.

    Raises:
        TypeError, ValueError: naming ``x``, ``head_dim`` or ``global_scale``.
    """
    import ml_dtypes  # on first use (driver/dtypes.py)

    rows = _float_rows(x, "x")
    if rows.ndim < 2:
        raise ValueError(f"x: expected (..., n_kv_heads, head_dim) (one global scale per KV "
                         f"head), got shape {rows.shape}")  # fmt: skip
    n_kv, d = rows.shape[-2:]
    if d % NVFP4_BLOCK:
        raise ValueError(f"head_dim: the nvfp4 format takes head_dims that are multiples of "
                         f"{NVFP4_BLOCK}, got {d}")  # fmt: skip
    if global_scale is None:
        amax = np.abs(rows.reshape(-1, n_kv, d)).max(axis=(0, 2), initial=np.float32(0))
        g = amax / np.float32(E2M1_MAX * E4M3_MAX)
        g = np.where(g >= np.finfo(np.float32).tiny, g, np.float32(1)).astype(np.float32)
    else:
        g = check_scales(global_scale, n_kv, "global_scale")
    blocks = rows.reshape(*rows.shape[:-1], d // NVFP4_BLOCK, NVFP4_BLOCK)
    amax_b = np.abs(blocks).max(axis=-1, initial=np.float32(0))
    s = amax_b / np.float32(E2M1_MAX) / g[:, None]
    block_scales = np.minimum(s, np.float32(E4M3_MAX)).astype(ml_dtypes.float8_e4m3fn)
    denom = block_scales.astype(np.float32)[..., None] * g[:, None, None]
    y = np.divide(blocks, denom, out=np.zeros_like(blocks), where=denom > 0)
    codes = _e2m1_codes(np.clip(y, -E2M1_MAX, E2M1_MAX)).reshape(rows.shape)
    return _pack(codes), block_scales, g


def dequantize_nvfp4(
    values: HostArrayLike, block_scales: HostArrayLike, global_scale: HostArrayLike
) -> np.ndarray:
    """nvfp4 ``values``, ``block_scales`` and ``global_scale`` (as `quantize_nvfp4` makes
    them) as float32 ``(..., n_kv_heads, head_dim)``.

    Raises:
        TypeError, ValueError: naming ``values``, ``block_scales`` or ``global_scale``.
    """
    import ml_dtypes  # on first use (driver/dtypes.py)

    packed = _packed(values, "values")
    if packed.ndim < 2:
        raise ValueError(f"values: expected (..., n_kv_heads, head_dim // 2), got shape "
                         f"{packed.shape}")  # fmt: skip
    sb = np.asarray(block_scales)
    if sb.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
        raise TypeError(f"block_scales: expected ml_dtypes.float8_e4m3fn, got {sb.dtype}")
    d = 2 * packed.shape[-1]
    want = (*packed.shape[:-1], d // NVFP4_BLOCK)
    if d % NVFP4_BLOCK or sb.shape != want:
        raise ValueError(f"block_scales: expected shape {want} (one per {NVFP4_BLOCK} of "
                         f"head_dim {d}), got {sb.shape}")  # fmt: skip
    g = check_scales(global_scale, packed.shape[-2], "global_scale")
    lead = packed.shape[:-1]
    vals = E2M1_VALUES[_unpack(packed)].reshape(*lead, d // NVFP4_BLOCK, NVFP4_BLOCK)
    out = (vals * sb.astype(np.float32)[..., None]) * g[:, None, None]
    return out.reshape(*lead, d)


def _e2m1_codes(y: np.ndarray) -> np.ndarray:
    """float32 ``y`` within +-6 as e2m1 codes (uint8 0..15), rounded to nearest even:
    ml_dtypes' float4_e2m1fn where it has one (0.5 and newer), else the table."""
    import ml_dtypes

    f4 = getattr(ml_dtypes, "float4_e2m1fn", None)
    if f4 is None:
        return _e2m1_codes_table(y)
    return np.asarray(y.astype(f4).view(np.uint8))


def _e2m1_codes_table(y: np.ndarray) -> np.ndarray:
    """`_e2m1_codes` without ml_dtypes: the nearest magnitude by the midpoints, a tie to the
    even code (mantissa bit 0), the sign bit from ``y``'s (negative zero kept)."""
    mag = np.abs(y)
    idx = np.searchsorted(_E2M1_MIDPOINTS, mag, side="right")  # a tie goes up
    below = _E2M1_MIDPOINTS[np.maximum(idx - 1, 0)]
    idx = idx - ((idx % 2 == 1) & (mag == below))  # ... unless the upper code is odd
    return (idx + np.where(np.signbit(y), 8, 0)).astype(np.uint8)


def _pack(nibbles: np.ndarray) -> np.ndarray:
    """uint8 nibbles ``(..., d)`` as bytes ``(..., d // 2)``, element 2i in the low nibble."""
    return np.ascontiguousarray(nibbles[..., 0::2] | (nibbles[..., 1::2] << 4))


def _unpack(packed: np.ndarray) -> np.ndarray:
    """`_pack` undone: uint8 ``(..., n)`` as nibbles ``(..., 2n)``."""
    return np.stack((packed & 15, packed >> 4), axis=-1).reshape(*packed.shape[:-1], -1)


def _float_array(x: HostArrayLike, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
        raise TypeError(f"{name}: expected floating-point values (float16, bfloat16, float32, "
                        f"float64), got {arr.dtype}")  # fmt: skip
    return arr


def _float_rows(x: HostArrayLike, name: str) -> np.ndarray:
    """``x`` as float32 rows ``(..., head_dim)``: floating point, finite, not a scalar."""
    arr = _float_array(x, name)
    if arr.ndim == 0 or arr.shape[-1] == 0:
        raise ValueError(f"{name}: expected (..., head_dim) with head_dim > 0, got shape "
                         f"{arr.shape}")  # fmt: skip
    with np.errstate(over="ignore"):  # refused just below
        rows = arr.astype(np.float32)
    if not np.isfinite(rows).all():
        raise ValueError(f"{name}: expected finite values (4-bit formats have no inf or NaN; "
                         f"float64 beyond float32's range overflows)")  # fmt: skip
    return rows


def _packed(values: HostArrayLike, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype != np.uint8:
        raise TypeError(f"{name}: expected uint8 (two 4-bit values a byte), got {arr.dtype}")
    if arr.ndim == 0 or arr.shape[-1] == 0:
        raise ValueError(f"{name}: expected (..., head_dim // 2), got shape {arr.shape}")
    return arr


def _check_group_size(group_size: int) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
        raise TypeError(f"group_size: expected an int, got {type(group_size).__name__}")
    if group_size not in Q4_GROUP_SIZES:
        raise ValueError(f"group_size: expected one of {Q4_GROUP_SIZES}, got {group_size}")
    return int(group_size)
