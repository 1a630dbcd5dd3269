"""Appends into a caller's (k_cache, v_cache) pair at a length held on the device.

The pair form of ``kv_append_async``: a static token-major cache of the caller's (PyTorch
tensors, CuPy arrays, DeviceArrays) and its ``state``, two int32 on the device (the length
and an overflow flag), as a KVCache keeps them. One token or several: the rows go to
``[state[0], state[0] + n)``, then ``state[0] += n``; rows that would pass the capacity are
not written and set the flag instead. fp8 pairs quantize on the way in with ``kv_scales``,
as an fp8 KVCache does, and 4-bit pairs (``FourBitScales``: values and block scales
token-major or, ``kv_layout="HND"``, head-major, as a 4-bit KVCache of that layout stores
them) with the
quantizing kernels of decode/kv4_device.py, bit for bit as ``fd.quantize_int4`` /
``fd.quantize_nvfp4`` (of ``fd.hadamard(k)`` where K is rotated). No host work after a
signature's first call: capturable.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np

from ..decode.checks import SUPPORTED_DTYPES, check_kv_layout, dtype_name
from ..decode.fp8 import FP8_DTYPES, MIN_COMPUTE_CAPABILITY, ROW_DTYPES, quantize_kernel
from ..decode.kv4_device import nvfp4_quantize_kernel, q4_quantize_kernel
from ..decode.pair import FourBitScales, check_four_bit_capability, check_four_bit_pair
from ..decode.records import Kept
from ..decode.records import lock as records_lock
from ..driver.device import Device, device_for
from ..driver.graph import keep_for_capture, relaxed_capture, stream_capturing
from ..driver.interop import ArrayRef, array_ref
from ..driver.launch import LaunchSequence, PackedLaunch
from ..driver.memory import DeviceArray
from ..driver.stream import Stream, stream_handle, stream_key
from ..kernels.catalogue import get_kernel
from ..kernels.spec import Q4_FORMAT
from .four_bit import append_sequence, quantize_grid

__all__ = ["append_async_pair", "append_launches", "four_bit_launches"]

THREADS = 256
MAX_BLOCKS = 1024  # a multi-row append's grid (grid-stride loops past it)
MAX_APPENDERS = 256
_appenders = Kept(MAX_APPENDERS)  # packed appends, by signature


def _ref(obj: Any, name: str) -> ArrayRef:
    ref = array_ref(obj, name)
    if ref is None:
        raise TypeError(f"{name}: expected a device array, got a numpy array")
    return ref


def _check(
    pair: tuple[Any, ...], k_rows: Any, v_rows: Any, state: Any, kv_scales: Any
) -> tuple[tuple[Any, ...], int, int, int, str, np.dtype]:
    """Every argument checked: (refs of k_cache, v_cache, k_rows, v_rows, state, kv_scales or
    None), capacity, n_kv_heads * head_dim, the rows' count, the fp8 format, the rows' dtype.

    Raises:
        TypeError, ValueError: naming the argument.
    """
    if len(pair) != 2:
        raise TypeError(f"kv: expected a KVCache or a pair (k_cache, v_cache), got {len(pair)} "
                        "items")  # fmt: skip
    kc, vc = _ref(pair[0], "k_cache"), _ref(pair[1], "v_cache")
    shape, dtype = tuple(kc[1]), np.dtype(kc[2])
    if len(shape) != 3 or not kc[4]:
        raise ValueError(
            "k_cache: appends need a C-contiguous token-major cache (capacity, n_kv_heads, "
            f"head_dim), got shape {shape}{'' if kc[4] else ' (strided)'}"
        )
    if tuple(vc[1]) != shape or vc[2] != dtype or not vc[4]:
        raise ValueError(f"v_cache: expected k_cache's shape {shape} and dtype {dtype}, "
                         f"contiguous, got {tuple(vc[1])} of {vc[2]}")  # fmt: skip
    fp8 = FP8_DTYPES.get(dtype, "")
    if not fp8 and dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"k_cache: expected float32, float16, bfloat16 or fp8, got {dtype}")
    capacity, n_kv, hd = shape
    row = n_kv * hd
    kr, vr = _ref(k_rows, "k_rows"), _ref(v_rows, "v_rows")
    rshape = tuple(kr[1])
    if len(rshape) == 2:
        n = 1
    elif len(rshape) == 3:
        n = rshape[0]
    else:
        n = -1
    if n < 1 or rshape[-2:] != (n_kv, hd) or not kr[4]:
        raise ValueError(
            f"k_rows: expected contiguous ({n_kv}, {hd}) or (n, {n_kv}, {hd}) rows with n >= 1, "
            f"got {rshape}"
        )
    if tuple(vr[1]) != rshape or vr[2] != kr[2] or not vr[4]:
        raise ValueError(f"v_rows: expected k_rows' shape {rshape} and dtype {kr[2]}, "
                         f"contiguous, got {tuple(vr[1])} of {vr[2]}")  # fmt: skip
    rows_dtype = np.dtype(kr[2])
    if fp8 and rows_dtype not in ROW_DTYPES:
        raise TypeError(f"k_rows: expected float32, float16 or bfloat16 rows for an fp8 cache, "
                        f"got {rows_dtype}")  # fmt: skip
    if not fp8 and rows_dtype != dtype:
        raise TypeError(f"k_rows: expected the cache's dtype {dtype}, got {rows_dtype}")
    st = _ref(state, "state")
    if st[2] != np.int32 or math.prod(st[1]) != 2 or not st[4]:
        raise ValueError(f"state: expected 2 contiguous int32 (the length, the overflow flag), "
                         f"got shape {tuple(st[1])} of {st[2]}")  # fmt: skip
    scales = None
    if fp8:
        if kv_scales is None:
            raise TypeError("kv_scales: an fp8 cache quantizes with its scales (float32, "
                            "n_kv_heads K scales then n_kv_heads V ones)")  # fmt: skip
        scales = _ref(kv_scales, "kv_scales")
        if scales[2] != np.float32 or math.prod(scales[1]) != 2 * n_kv or not scales[4]:
            raise ValueError(f"kv_scales: expected {2 * n_kv} contiguous float32, got shape "
                             f"{tuple(scales[1])} of {scales[2]}")  # fmt: skip
    elif kv_scales is not None:
        raise TypeError(f"kv_scales: only for fp8 caches, k_cache is {dtype}")
    refs: tuple[ArrayRef, ...] = (kc, vc, kr, vr, st) + (() if scales is None else (scales,))
    at = kc[3]
    for ref, name in zip(refs[1:], ("v_cache", "k_rows", "v_rows", "state", "kv_scales"),
                         strict=False):  # fmt: skip
        if ref[3] != at:
            raise ValueError(f"{name}: on device {ref[3]}, k_cache on device {at}")
    return (*refs[:5], scales), capacity, row, n, fp8, rows_dtype


def _check_four_bit(
    pair: tuple[Any, ...], k_rows: Any, v_rows: Any, state: Any, kv_scales: Any,
    four: FourBitScales, kv_layout: str = "NHD",
) -> tuple[tuple[Any, ...], int, int, int, np.dtype]:  # fmt: skip
    """A 4-bit pair's append checked, its values and block scales in layout ``kv_layout``
    (``check_four_bit_pair``): (refs of k_cache, v_cache, k_rows, v_rows, state,
    k_block_scales, v_block_scales, kv_scales or None), capacity, n_kv_heads, the rows'
    count, their dtype.

    Raises:
        TypeError, ValueError: naming the argument.
    """
    capacity, n_kv, hd, refs = check_four_bit_pair(pair, four, kv_scales, kv_layout)
    kr, vr = _ref(k_rows, "k_rows"), _ref(v_rows, "v_rows")
    rshape = tuple(kr[1])
    n = 1 if len(rshape) == 2 else rshape[0] if len(rshape) == 3 else -1
    if n < 1 or rshape[-2:] != (n_kv, hd) or not kr[4]:
        raise ValueError(f"k_rows: expected contiguous ({n_kv}, {hd}) or (n, {n_kv}, {hd}) rows "
                         f"with n >= 1, got {rshape}")  # fmt: skip
    if tuple(vr[1]) != rshape or vr[2] != kr[2] or not vr[4]:
        raise ValueError(f"v_rows: expected k_rows' shape {rshape} and dtype {kr[2]}, "
                         f"contiguous, got {tuple(vr[1])} of {vr[2]}")  # fmt: skip
    rows_dtype = np.dtype(kr[2])
    if rows_dtype not in ROW_DTYPES:
        raise TypeError(f"k_rows: expected float32, float16 or bfloat16 rows for a 4-bit cache, "
                        f"got {rows_dtype}")  # fmt: skip
    st = _ref(state, "state")
    if st[2] != np.int32 or math.prod(st[1]) != 2 or not st[4]:
        raise ValueError(f"state: expected 2 contiguous int32 (the length, the overflow flag), "
                         f"got shape {tuple(st[1])} of {st[2]}")  # fmt: skip
    for ref, name in ((kr, "k_rows"), (vr, "v_rows"), (st, "state")):
        if ref[3] != refs[0][3]:
            raise ValueError(f"{name}: on device {ref[3]}, k_cache on device {refs[0][3]}")
    return (refs[0], refs[1], kr, vr, st, *refs[2:]), capacity, n_kv, n, rows_dtype


def four_bit_launches(
    dev: Device, refs: tuple[Any, ...], capacity: int, n_kv: int, n: int, rows_dtype: np.dtype,
    four: FourBitScales, stream: Any, head_rows: int = 0,
) -> LaunchSequence:  # fmt: skip
    """A 4-bit pair's append packed once, as a 4-bit KVCache's ``kv_append_async`` makes it
    (``FourBitStore.device_append``): one launch that bumps the length for one row; for n,
    the quantizing launch then the bump (roles k, v: the rows' addresses). ``head_rows``:
    the pair is head-major, this many rows a KV head (its capacity); 0, token-major."""
    kc, vc, _, _, st, ks, vs, sc = refs
    hd = 2 * kc[1][2]

    def wrap(ref: ArrayRef, dtype: Any) -> DeviceArray:
        return DeviceArray._wrap(ref[0], (math.prod(ref[1]),), np.dtype(dtype), dev, None)

    rows = dtype_name(rows_dtype)
    if four.fmt == Q4_FORMAT:
        kernel = q4_quantize_kernel(dev, rows, hd, 32, bool(four.rotate))
        block = (wrap(ks, np.float16), wrap(vs, np.float16))
    else:
        kernel = nvfp4_quantize_kernel(dev, rows, hd, bool(four.rotate))
        block = (wrap(ks, np.uint8), wrap(vs, np.uint8))
    state = wrap(st, np.int32)
    first = -1 if n == 1 else -2
    args: tuple[Any, ...] = (
        None, None, wrap(kc, np.uint8), wrap(vc, np.uint8), *block, np.int32(n_kv), np.int32(n),
        np.int32(first), state, np.int32(capacity), np.float32(1.0 / math.sqrt(hd)),
    )  # fmt: skip
    if sc is not None:  # nvfp4's per-head scales
        args += (wrap(sc, np.float32),)
    args += (np.int64(head_rows),)  # (the rows a KV head, head-major; 0, token-major)
    grid, threads = quantize_grid(n, n_kv)
    launch = PackedLaunch(kernel, grid, threads, args, stream=stream)
    return append_sequence(dev, launch, state, n, capacity, stream)


def append_launches(
    dev: Device, refs: tuple[Any, ...], capacity: int, row: int, n: int, fp8: str,
    rows_dtype: np.dtype, stream: Any,
) -> LaunchSequence:  # fmt: skip
    """The append's launches packed once: the rows' pointers are the call's (roles k, v)."""

    def wrap(ref: ArrayRef, shape: tuple[int, ...], dtype: Any) -> DeviceArray:
        return DeviceArray._wrap(ref[0], shape, np.dtype(dtype), dev, None)

    kc, vc, _, _, st, sc = refs
    caches = (wrap(kc, (capacity * row,), np.uint8 if fp8 else kc[2]),
              wrap(vc, (capacity * row,), np.uint8 if fp8 else vc[2]))  # fmt: skip
    state = wrap(st, (2,), np.int32)
    item = np.dtype(kc[2]).itemsize
    blocks = max(1, min(MAX_BLOCKS, -(-n * row * item // (16 * THREADS))))
    args: tuple[Any, ...]
    if fp8:
        n_kv_hd = (np.int32(row // kc[1][2]), np.int32(kc[1][2]))
        kernel = quantize_kernel(fp8, dev, dtype_name(rows_dtype))
        scales = wrap(sc, (2 * (row // kc[1][2]),), np.float32)
        first, grid = (np.int32(-1), 1) if n == 1 else (np.int32(-2), blocks)
        args = (None, None, *caches, scales, *n_kv_hd, np.int32(n), first, state,
                np.int32(capacity))  # fmt: skip
    elif n == 1 and ((row * item) | refs[2][0] | refs[3][0]) % 16 == 0:  # one block, bumping
        args = (None, None, *caches, state, np.int64(row * item), np.int32(capacity))
        kernel, grid = get_kernel("kv_cache.cu", "kv_append_row", dev), 1
    else:
        args = (None, None, *caches, state, np.int64(row * item), np.int32(n),
                np.int32(capacity))  # fmt: skip
        kernel, grid = get_kernel("kv_cache.cu", "kv_append_rows", dev), blocks
    launch = PackedLaunch(kernel, grid, THREADS, args, stream=stream)
    return append_sequence(dev, launch, state, n, capacity, stream)


def append_async_pair(
    pair: tuple[Any, ...], k_rows: Any, v_rows: Any, state: Any, kv_scales: Any, stream: Any,
    torch_owned: bool = False, four_bit: FourBitScales | None = None, kv_layout: Any = "NHD",
) -> None:  # fmt: skip
    """Queue the append of ``k_rows``/``v_rows`` (one token ``(n_kv_heads, head_dim)`` or
    ``(n, n_kv_heads, head_dim)``) into ``pair`` at ``state[0]`` (see the module). A call of
    a signature seen before writes the rows' pointers and launches. ``torch_owned``: as
    ``decode.pair.decode_async_pair``'s. ``four_bit``: a 4-bit pair's block scales and
    rotation (an nvfp4 pair's per-head scales in ``kv_scales``). ``kv_layout``: "NHD"
    (token-major), or "HND" for a head-major 4-bit pair (other pairs' appends are
    token-major).

    Raises:
        TypeError, ValueError: naming the argument.
    """
    sid = stream_key(stream)
    key: Any = None
    if len(pair) == 2:  # the caches', state's and scales' addresses; the rows' signature
        blocks = (None, None) if four_bit is None else (four_bit.k_scales, four_bit.v_scales)
        objs = (pair[0], pair[1], k_rows, v_rows, state, kv_scales, *blocks)
        refs = [None if o is None else array_ref(o, "kv") for o in objs]
        if all(r is not None for r in refs[:5]):
            four = None if four_bit is None else (four_bit.fmt, four_bit.rotate)
            key = (sid, four, kv_layout, *(None if r is None else
                                           (r[0] if i not in (2, 3) else (r[0] & 15) == 0,
                                            *r[1:5])
                                           for i, r in enumerate(refs)))  # fmt: skip
    try:
        entry = None if key is None else _appenders.get(key)
    except TypeError:
        entry = None
    if entry is None:
        layout = check_kv_layout(kv_layout)
        if four_bit is None and layout != "NHD":
            raise ValueError("kv_layout: appends into a 16-bit, 32-bit or fp8 pair are "
                             f"token-major ('NHD'); 'HND' is a 4-bit pair's; got "
                             f"{layout!r}")  # fmt: skip
        head_rows = 0
        if four_bit is not None:
            checked, capacity, n_kv, n, rows_dtype = _check_four_bit(
                pair, k_rows, v_rows, state, kv_scales, four_bit, layout)  # fmt: skip
            row, fp8 = n_kv, ""
            head_rows = capacity if layout == "HND" else 0
        else:
            checked, capacity, row, n, fp8, rows_dtype = _check(pair, k_rows, v_rows, state,
                                                                 kv_scales)  # fmt: skip
        dev = device_for(checked[0][3])
        if four_bit is not None:
            check_four_bit_capability(four_bit.fmt, dev.compute_capability)
        if fp8 and dev.compute_capability < MIN_COMPUTE_CAPABILITY:
            raise ValueError(f"k_cache: fp8 caches need compute capability 8.9 or newer, this "
                             f"GPU has {dev.compute_capability}")  # fmt: skip
        foreign = sid != 0 and not isinstance(stream, Stream)
        dev.activate()
        with contextlib.ExitStack() as relaxed, records_lock:
            if torch_owned and foreign and stream_capturing(sid):
                relaxed.enter_context(relaxed_capture())
            if four_bit is not None:
                sequence = four_bit_launches(dev, checked, capacity, row, n, rows_dtype,
                                             four_bit, stream_handle(sid), head_rows)  # fmt: skip
            else:
                sequence = append_launches(dev, checked, capacity, row, n, fp8, rows_dtype,
                                           stream_handle(sid))  # fmt: skip
        entry = (sequence, dev, foreign)
        if key is not None:
            _appenders.keep(key, entry)
    sequence, dev, foreign = entry
    dev.activate()
    kr, vr = array_ref(k_rows, "k_rows"), array_ref(v_rows, "v_rows")
    assert kr is not None and vr is not None
    if not torch_owned:  # a graph that captures it keeps what it reads and writes
        keep_for_capture(sid, foreign, sequence, pair[0], pair[1], k_rows, v_rows, state,
                         kv_scales, *(() if four_bit is None else
                                      (four_bit.k_scales, four_bit.v_scales)))  # fmt: skip
    sequence.run((kr[0], vr[0]))
