"""4-bit caches as PyTorch tensors: the torch ops' checks of them, and their formats
decoded in torch (``dequantize_4bit``, ``hadamard``), bit for bit as ``fd.dequantize_int4``,
``fd.dequantize_nvfp4`` and ``fd.hadamard`` on the host.

A 4-bit cache is the storage of a ``KVCache(dtype="int4" | "nvfp4")``, as tensors of the
caller's: K's and V's values, uint8 ``(capacity, n_kv_heads, head_dim // 2)``
(token-major, ``kv_layout="NHD"``) or ``(n_kv_heads, capacity, head_dim // 2)``
(head-major, ``kv_layout="HND"``, as a ``KVCache(..., kv_layout="HND")`` stores them: a
KV head's rows in one run), element 2i in the low nibble of byte i; their block scales,
in the values' layout, ``k_block_scales`` and ``v_block_scales`` (int4: float16 ``(capacity,
n_kv_heads, head_dim // 32)``, ``amax / 7`` per group of 32; nvfp4: e4m3 bytes, uint8 or
``torch.float8_e4m3fn``, ``(capacity, n_kv_heads, head_dim // 16)``; head-major,
``(n_kv_heads, capacity, ...)``); nvfp4's float32 scales per KV head, ``kv_scales`` ``(2,
n_kv_heads)``, K's then V's; and whether K is rotated (``rotate_k``: the Hadamard
transform over the head_dim before quantizing, q rotated alike in the decode).
"""

from __future__ import annotations

import math

import torch

from ..decode.checks import layout_dims, layout_shape
from ..decode.pair import FourBitScales

__all__ = ["FORMATS", "check_rows", "dequantize_4bit", "four_bit_args", "hadamard"]

# kv_format -> the kernels' format ("int4" is DESIGN.md's name, "q4" the format's own)
FORMATS = {"int4": "q4", "q4": "q4", "nvfp4": "nvfp4"}
_GROUP = {"q4": 32, "nvfp4": 16}  # elements per block scale
_HEAD_DIMS = (64, 128, 256)
_DEFAULT_ROTATE = {"q4": True, "nvfp4": False}  # KVCache(rotate=None)'s measured defaults
_ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LAYOUTS = {  # kv_layout -> the values' shape
    "NHD": "(capacity, n_kv_heads, head_dim // 2), token-major",
    "HND": "(n_kv_heads, capacity, head_dim // 2), head-major",
}
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def four_bit_args(
    kv_format: str | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
    k_block_scales: torch.Tensor | None, v_block_scales: torch.Tensor | None,
    kv_scales: torch.Tensor | None, kv_layout: str, rotate_k: bool | None,
) -> FourBitScales | None:  # fmt: skip
    """A 4-bit cache's tensors checked (shapes and dtypes only: no device work, CPU and
    fake tensors alike), token-major (``kv_layout`` "NHD") or head-major ("HND"): its
    ``FourBitScales`` (e4m3 block scales seen as uint8; ``rotate`` the format's default
    where ``rotate_k`` is None), or None for a cache of another kind.

    Raises:
        TypeError, ValueError: naming the argument.
    """
    if kv_format is None:
        named = (("k_block_scales", k_block_scales), ("v_block_scales", v_block_scales),
                 ("rotate_k", rotate_k))  # fmt: skip
        for name, given in named:
            if given is not None:
                raise ValueError(f"{name}: only for a 4-bit cache: pass kv_format='int4' or "
                                 "'nvfp4'")  # fmt: skip
        if k_cache.dtype == torch.uint8:
            raise TypeError("k_cache: uint8 is a 4-bit cache's values: pass kv_format='int4' "
                            "or 'nvfp4', with k_block_scales and v_block_scales")  # fmt: skip
        return None
    fmt = FORMATS.get(kv_format) if isinstance(kv_format, str) else None
    if fmt is None:
        raise ValueError(f"kv_format: expected None, 'int4' or 'nvfp4', got {kv_format!r}")
    if kv_layout not in _LAYOUTS:
        raise ValueError(
            f"kv_layout: a 4-bit cache (kv_format={kv_format!r}) is 'NHD' ({_LAYOUTS['NHD']}) "
            f"or 'HND' ({_LAYOUTS['HND']}); got {kv_layout!r}"
        )
    if rotate_k is not None and not isinstance(rotate_k, bool):
        raise TypeError(f"rotate_k: expected None, True or False, got {type(rotate_k).__name__}")
    shape = tuple(k_cache.shape)
    if k_cache.dtype != torch.uint8 or len(shape) != 3 or not k_cache.is_contiguous():
        raise ValueError(
            f"k_cache: a {kv_format} cache's values are contiguous uint8 {_LAYOUTS[kv_layout]} "
            f"(kv_layout {kv_layout!r}); got shape {shape} of {k_cache.dtype}"
            f"{'' if k_cache.is_contiguous() else ' (strided)'}"
        )
    (capacity, n_kv), half = layout_dims(kv_layout, shape), shape[2]
    if 2 * half not in _HEAD_DIMS:
        raise ValueError(f"k_cache: {kv_format} caches take head_dim 64, 128 or 256 (a last "
                         f"dimension of 32, 64 or 128 bytes), got {2 * half}")  # fmt: skip
    if (v_cache.dtype != torch.uint8 or tuple(v_cache.shape) != shape
            or not v_cache.is_contiguous()):  # fmt: skip
        raise ValueError(f"v_cache: expected k_cache's shape {shape} of uint8, contiguous; got "
                         f"{tuple(v_cache.shape)} of {v_cache.dtype}")  # fmt: skip
    per = 2 * half // _GROUP[fmt]
    want = layout_shape(kv_layout, capacity, n_kv, per)  # (the values' layout)
    blocks = []
    for name, s in (("k_block_scales", k_block_scales), ("v_block_scales", v_block_scales)):
        dtypes = (torch.float16,) if fmt == "q4" else (torch.uint8, torch.float8_e4m3fn)
        if s is None or s.dtype not in dtypes or tuple(s.shape) != want or not s.is_contiguous():
            what = "float16" if fmt == "q4" else "uint8 or float8_e4m3fn (e4m3 bytes)"
            got = "None" if s is None else f"shape {tuple(s.shape)} of {s.dtype}"
            raise ValueError(f"{name}: a {kv_format} cache's block scales are contiguous {what} "
                             f"{want} (kv_layout {kv_layout!r}, the values'); got "
                             f"{got}")  # fmt: skip
        blocks.append(s.view(torch.uint8) if s.dtype == torch.float8_e4m3fn else s)
    if fmt == "nvfp4":
        if kv_scales is None:
            raise TypeError("kv_scales: an nvfp4 cache's float32 scales per KV head, (2, "
                            "n_kv_heads), K's then V's, are needed")  # fmt: skip
        if (kv_scales.dtype != torch.float32 or kv_scales.numel() != 2 * n_kv
                or not kv_scales.is_contiguous()):  # fmt: skip
            raise ValueError(f"kv_scales: expected contiguous float32 (2, {n_kv}), got shape "
                             f"{tuple(kv_scales.shape)} of {kv_scales.dtype}")  # fmt: skip
    elif kv_scales is not None:
        raise TypeError("kv_scales: an int4 cache scales each group of 32 itself; only fp8 and "
                        "nvfp4 caches take kv_scales")  # fmt: skip
    rotate = _DEFAULT_ROTATE[fmt] if rotate_k is None else rotate_k
    return FourBitScales(fmt, blocks[0], blocks[1], rotate)


def check_rows(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, kv_layout: str = "NHD"
) -> None:
    """Rows appended to a 4-bit cache of layout ``kv_layout`` (its values checked by
    ``four_bit_args``): ``(n_kv_heads, head_dim)`` or ``(n, n_kv_heads, head_dim)``,
    float32, float16 or bfloat16, K's and V's alike (token rows, whatever the cache's
    layout).

    Raises:
        TypeError, ValueError: naming ``k`` or ``v``.
    """
    n_kv, hd = layout_dims(kv_layout, tuple(k_cache.shape))[1], 2 * k_cache.shape[2]
    if k.dim() not in (2, 3) or tuple(k.shape[-2:]) != (n_kv, hd) or k.numel() == 0:
        raise ValueError(f"k: expected ({n_kv}, {hd}) or (n, {n_kv}, {hd}) rows, n >= 1, got "
                         f"{tuple(k.shape)}")  # fmt: skip
    if k.dtype not in _ROW_DTYPES:
        raise TypeError(f"k: expected float32, float16 or bfloat16 rows for a 4-bit cache, got "
                        f"{k.dtype}")  # fmt: skip
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v: expected k's shape {tuple(k.shape)} and dtype {k.dtype}, got "
                         f"{tuple(v.shape)} of {v.dtype}")  # fmt: skip


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x`` rotated over its last axis by the orthonormal block-Hadamard transform, in
    float32, as ``fd.hadamard`` computes it (the butterflies, then one multiplication by
    ``1 / sqrt(block)``; the block the largest power of two dividing the axis): its own
    inverse."""
    y = x.float()
    n = y.shape[-1]
    b, lead = n & -n, y.shape[:-1]
    h = 1
    while h < b:
        pairs = y.reshape(*lead, n // (2 * h), 2, h)
        first, second = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((first + second, first - second), dim=-2).reshape(*lead, n)
        h *= 2
    return y * (1.0 / math.sqrt(b))  # (a float32 tensor times a Python float: in float32)


def dequantize_4bit(
    values: torch.Tensor, block_scales: torch.Tensor, kv_format: str, *,
    global_scale: torch.Tensor | None = None, rotated: bool = False, kv_layout: str = "NHD",
) -> torch.Tensor:  # fmt: skip
    """A 4-bit cache's values as float32 in their own layout, computed where the tensors
    are, bit for bit as ``fd.dequantize_int4`` / ``fd.dequantize_nvfp4`` (then
    ``fd.hadamard`` where ``rotated``).

    Args:
        values: uint8 ``(..., n_kv_heads, head_dim // 2)`` (token-major, ``kv_layout``
            "NHD") or ``(n_kv_heads, n, head_dim // 2)`` (head-major, "HND").
        block_scales: in the values' layout; int4: float16 ``(..., n_kv_heads, head_dim //
            32)``; nvfp4: e4m3 (uint8 or ``torch.float8_e4m3fn``) ``(..., n_kv_heads,
            head_dim // 16)``; head-major, ``(n_kv_heads, n, ...)``.
        kv_format: ``"int4"`` or ``"nvfp4"``.
        global_scale: nvfp4's float32 scales, one per KV head ``(n_kv_heads,)``.
        rotated: undo the Hadamard rotation (a rotated K).
        kv_layout: ``"NHD"`` or ``"HND"``: where the values' KV heads are (nvfp4's
            ``global_scale`` multiplies each head's).

    Returns:
        float32 ``(..., n_kv_heads, head_dim)`` ("NHD") or ``(n_kv_heads, n, head_dim)``
        ("HND").

    Raises:
        TypeError, ValueError: naming the argument.
    """
    fmt = FORMATS.get(kv_format) if isinstance(kv_format, str) else None
    if fmt is None:
        raise ValueError(f"kv_format: expected 'int4' or 'nvfp4', got {kv_format!r}")
    if kv_layout not in _LAYOUTS:
        raise ValueError(f"kv_layout: expected 'NHD' or 'HND', got {kv_layout!r}")
    hnd = kv_layout == "HND"
    if values.dtype != torch.uint8 or (values.dim() != 3 if hnd else values.dim() < 2):
        want_shape = "(n_kv_heads, n, head_dim // 2)" if hnd else "(..., n_kv_heads, head_dim // 2)"
        raise ValueError(f"values: expected uint8 {want_shape} (kv_layout {kv_layout!r}), got "
                         f"shape {tuple(values.shape)} of {values.dtype}")  # fmt: skip
    lead, d = tuple(values.shape[:-1]), 2 * values.shape[-1]
    group = _GROUP[fmt]
    want = (*lead, d // group)
    if tuple(block_scales.shape) != want or d % group:
        raise ValueError(f"block_scales: expected shape {want} (one per {group} of head_dim "
                         f"{d}), got {tuple(block_scales.shape)}")  # fmt: skip
    nibbles = torch.stack((values & 15, values >> 4), dim=-1).reshape(*lead, d // group, group)
    if fmt == "q4":
        if block_scales.dtype != torch.float16:
            raise TypeError(f"block_scales: expected float16 for int4, got {block_scales.dtype}")
        out = (nibbles.float() - 8.0) * block_scales.float()[..., None]
    else:
        if block_scales.dtype not in (torch.uint8, torch.float8_e4m3fn):
            raise TypeError(f"block_scales: expected e4m3 bytes (uint8 or float8_e4m3fn) for "
                            f"nvfp4, got {block_scales.dtype}")  # fmt: skip
        n_kv = lead[0] if hnd else lead[-1]
        if global_scale is None or global_scale.numel() != n_kv:
            got = None if global_scale is None else tuple(global_scale.shape)
            raise ValueError(f"global_scale: nvfp4 needs one float32 scale per KV head "
                             f"({n_kv}), got {got}")  # fmt: skip
        table = torch.tensor(_E2M1, dtype=torch.float32, device=values.device)
        s = block_scales.view(torch.float8_e4m3fn).float()[..., None]
        # (each KV head's scale on its axis: the first head-major, else the one before
        # the blocks')
        g = global_scale.reshape((n_kv, 1, 1, 1) if hnd else (n_kv, 1, 1)).float()
        out = (table[nibbles.long()] * s) * g
    out = out.reshape(*lead, d)
    return hadamard(out) if rotated else out
