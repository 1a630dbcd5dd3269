"""gqa_decode_async over a caller's (k_cache, v_cache) pair of device arrays, read in place.

A pair is a static cache of ``capacity`` tokens whose length is an int32 device scalar of
the caller's (a transformers StaticCache layer, an SDPA cache's buffers): the decode is
planned for the capacity and reads the length on the device, so it can be captured. A call
seen before (same shapes, strides, dtypes, features, length array and stream) skips the
checks and only writes the pointers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import numpy as np

from ..driver.calls import capture_state as _capture_state
from ..driver.device import Device, device_for
from ..driver.graph import keep_for_capture, relaxed_capture, stream_capturing
from ..driver.interop import ArrayRef, array_ref
from ..driver.memory import DeviceArray
from ..driver.pool import stream_buffer as _stream_buffer
from ..driver.stream import Stream, stream_handle, stream_key
from ..errors import FerroxError
from ..kernels import abi
from ..kernels.spec import FOUR_BIT_FORMATS, NVFP4_FORMAT, Q4_FORMAT
from . import plan as attention
from .checks import (
    SUPPORTED_DTYPES,
    _element_strides,
    check_dims,
    check_kv_layout,
    check_tokens,
    head_major_rows,
    layout_dims,
    layout_shape,
)
from .features import check_features
from .fp8 import FP8_DTYPES, MIN_COMPUTE_CAPABILITY
from .plan import check_algorithm
from .queries import check_query_count, query_heads, single_query_only
from .records import DecodeRecord, Kept, assemble
from .records import lock as _records_lock
from .records import store as _records
from .verify import check_mask

__all__ = [
    "FourBitScales",
    "as_queries",
    "checked_operand",
    "device_mask",
    "decode_async_pair",
    "feature_array",
    "feature_key",
    "feature_ptr",
    "q_heads_of",
    "query_count",
]


def query_count(q_dev: Any, head_dim: int, n_heads: Any = None) -> int:
    """The query tokens of device array ``q_dev``: n_q of a 3-D ``(n_q, n_heads,
    head_dim)`` (its heads and head_dim checked against ``n_heads`` and ``head_dim``), else
    1 (one token's q of any shape of whole heads).

    Raises:
        TypeError, ValueError: naming ``q_dev`` or ``n_heads``.
    """
    ref = array_ref(q_dev, "q_dev")
    if ref is None:
        raise TypeError("q_dev: expected a device array, got a numpy array")
    if len(ref[1]) != 3:
        single_query_only(ref[1], "q_dev")  # SDPA's (1, n_heads, n_q, head_dim): n_q > 1
        return 1
    return query_heads(ref[1], head_dim, n_heads, "q_dev").n_q


def as_queries(
    q_dev: Any, out_dev: Any, n_queries: Any, n_heads: Any, head_dim: int | None
) -> tuple[Any, Any]:
    """``q_dev`` and ``out_dev`` as ``(n_queries, n_heads, head_dim)`` views where
    ``n_queries`` says how many query tokens a buffer of another shape holds (a flat one, or
    ``(n_queries * n_heads, head_dim)``, C-contiguous); as they are where they already have
    that shape, or hold one token (n_queries 1). ``head_dim``: the cache's (None: not known
    yet, a bad pair: the arrays go on as they are, for its checks to name).

    Raises:
        TypeError, ValueError: naming ``n_queries``, ``q_dev`` or ``out_dev``.
    """
    if isinstance(n_queries, bool) or not isinstance(n_queries, (int, np.integer)):
        raise TypeError(f"n_queries: expected an int, got {type(n_queries).__name__}")
    n = int(n_queries)
    if n < 1:
        raise ValueError(f"n_queries: expected at least 1 query token, got {n}")
    if head_dim is None:
        return q_dev, out_dev
    checked: list[tuple[Any, ArrayRef | None, int]] = []  # all checked before any view
    for obj, name in ((q_dev, "q_dev"), (out_dev, "out_dev")):
        ref = array_ref(obj, name)
        if ref is None:
            raise TypeError(f"{name}: expected a device array, got a numpy array")
        shape = tuple(ref[1])
        if len(shape) == 3:
            if shape[0] != n:
                raise ValueError(f"n_queries: {n}, but {name} of shape {shape} holds "
                                 f"{shape[0]} query tokens")  # fmt: skip
            checked.append((obj, None, 0))
            continue
        if n == 1:
            checked.append((obj, None, 0))
            continue
        size = math.prod(shape)
        if len(shape) == 4 and shape[2] > 1:  # SDPA's (1, n_heads, n_q, head_dim)
            raise ValueError(f"{name}: shape {shape} holds its queries head by head; pass "
                             f"(n_q, n_heads, head_dim), or a buffer in that order")  # fmt: skip
        if size == 0 or size % (n * head_dim) or not ref[4]:
            raise ValueError(f"{name}: expected a C-contiguous buffer of n_queries ({n}) x "
                             f"n_heads x head_dim ({head_dim}) elements, got shape "
                             f"{shape}")  # fmt: skip
        heads = size // (n * head_dim)
        if n_heads is not None and n_heads != heads:
            raise ValueError(f"n_heads: {n_heads}, but {name} holds {heads} heads of "
                             f"{n} query tokens")  # fmt: skip
        checked.append((obj, ref, heads))
    views = [
        obj if ref is None else DeviceArray._wrap(
            ref[0], (n, heads, head_dim), ref[2], device_for(ref[3]),
            obj if ref[5] is None else ref[5],
        )
        for obj, ref, heads in checked
    ]  # fmt: skip
    return views[0], views[1]


def q_heads_of(n_heads: Any, q_dev: Any, head_dim: int) -> Any:
    """``n_heads`` as given (checked later), or read from device array ``q_dev``: the heads
    of a 3-D ``(n_q, n_heads, head_dim)``, or of any one-token shape holding whole heads of
    ``head_dim`` (``(n_heads, head_dim)``, SDPA's ``(1, n_heads, 1, head_dim)``, flat...).

    Raises:
        TypeError, ValueError: ``q_dev`` is no device array, or holds no whole heads.
    """
    if n_heads is not None:
        return n_heads
    ref = array_ref(q_dev, "q_dev")
    if ref is None:
        raise TypeError("q_dev: expected a device array, got a numpy array")
    if len(ref[1]) == 3:
        return query_heads(ref[1], head_dim, None, "q_dev").n_heads
    single_query_only(ref[1], "q_dev")  # SDPA's (1, n_heads, n_q, head_dim): not n_q*n_heads
    size = math.prod(ref[1])
    if size == 0 or size % head_dim:
        raise ValueError(
            f"q_dev: shape {tuple(ref[1])} holds no whole number of heads of head_dim "
            f"{head_dim} (n_heads not given: read from q_dev's size)"
        )
    return size // head_dim


def feature_array(obj: Any, name: str, n: int, device: Device) -> DeviceArray | None:
    """A per-head float32 device array of a graph-safe decode (None stays None)."""
    ptr = feature_ptr(obj, name, n, device.ordinal)
    return None if ptr is None else DeviceArray._wrap(ptr, (n,), np.dtype(np.float32), device, None)


def feature_ptr(obj: Any, name: str, n: int, ordinal: int) -> int | None:
    """``feature_array``'s checks, with no device work: the array's pointer."""
    if obj is None:
        return None
    ref = array_ref(obj, name)
    if ref is None:
        raise TypeError(f"{name}: expected a float32 device array (the kernel reads it), got "
                        "a numpy array")  # fmt: skip
    ptr, shape, dtype, at, contiguous, _ = ref
    if dtype != np.float32 or math.prod(shape) != n or not contiguous:
        raise ValueError(f"{name}: expected {n} contiguous float32, got shape {shape} of {dtype}")
    if at != ordinal:
        raise ValueError(f"{name}: on device {at}, the cache on {ordinal}")
    return int(ptr)


@dataclasses.dataclass(frozen=True)
class FourBitScales:
    """What a 4-bit pair is read with besides its values (uint8, token-major ``(capacity,
    n_kv_heads, head_dim // 2)`` or, with ``kv_layout="HND"``, head-major ``(n_kv_heads,
    capacity, head_dim // 2)``, as a 4-bit KVCache of that layout stores them): ``fmt``
    "q4" or "nvfp4", K's and V's block scales (device arrays in the values' layout; q4: float16
    ``(capacity, n_kv_heads, head_dim // 32)``, nvfp4: e4m3 bytes ``(capacity, n_kv_heads,
    head_dim // 16)``; head-major, ``(n_kv_heads, capacity, ...)``) and whether K is
    rotated (q then rotated in the decode). An nvfp4 pair's per-head scales are its
    ``kv_scales``."""

    fmt: str
    k_scales: Any
    v_scales: Any
    rotate: bool


_FOUR_BIT_GROUP = {Q4_FORMAT: 32, NVFP4_FORMAT: 16}  # elements per block scale
_FOUR_BIT_HEAD_DIMS = (64, 128, 256)  # the kernels' (decode.kv4_device.Q4_HEAD_DIMS)


def check_four_bit_pair(
    pair: tuple[Any, ...], four: FourBitScales, kv_scales: Any, kv_layout: Any = "NHD"
) -> tuple[int, int, int, tuple[ArrayRef, ...]]:
    """A 4-bit pair's values, block scales and per-head scales checked on the host, in
    layout ``kv_layout`` ("NHD": token-major ``(capacity, n_kv_heads, ...)``; "HND":
    head-major ``(n_kv_heads, capacity, ...)``, values and block scales alike): (capacity,
    n_kv_heads, head_dim, refs of k, v, the block scales and kv_scales or None).

    Raises:
        TypeError, ValueError: naming the argument.
    """
    layout = check_kv_layout(kv_layout)
    hnd = layout == "HND"
    form = ("(n_kv_heads, capacity, head_dim // 2), head-major" if hnd
            else "(capacity, n_kv_heads, head_dim // 2), token-major")  # fmt: skip
    if four.fmt not in FOUR_BIT_FORMATS:
        raise ValueError(f"kv_format: expected 'int4' or 'nvfp4', got {four.fmt!r}")
    name = "int4" if four.fmt == Q4_FORMAT else four.fmt
    if not isinstance(four.rotate, (bool, np.bool_)):
        raise TypeError(f"rotate_k: expected True or False, got {type(four.rotate).__name__}")
    if len(pair) != 2:
        raise TypeError(f"kv: expected a pair (k_cache, v_cache), got {len(pair)} items")
    kr, vr = array_ref(pair[0], "k_cache"), array_ref(pair[1], "v_cache")
    if kr is None or vr is None:
        raise TypeError("k_cache, v_cache: expected device arrays, got a numpy array")
    shape = tuple(kr[1])
    if kr[2] != np.uint8 or len(shape) != 3 or not kr[4]:
        raise ValueError(
            f"k_cache: a {name} cache's values are C-contiguous uint8 {form} (kv_layout "
            f"{layout!r}); got shape {shape} of {kr[2]}{'' if kr[4] else ' (strided)'}"
        )
    (capacity, n_kv), half = layout_dims(layout, shape), shape[2]
    hd = 2 * half
    if hd not in _FOUR_BIT_HEAD_DIMS:
        raise ValueError(f"k_cache: {name} caches take head_dim 64, 128 or 256 (k_cache's last "
                         f"dimension 32, 64 or 128), got {hd}")  # fmt: skip
    check_tokens(capacity, "k_cache")
    if tuple(vr[1]) != shape or vr[2] != np.uint8 or not vr[4]:
        raise ValueError(f"v_cache: expected k_cache's shape {shape} of uint8, contiguous, got "
                         f"{tuple(vr[1])} of {vr[2]}")  # fmt: skip
    per = hd // _FOUR_BIT_GROUP[four.fmt]
    refs: list[Any] = [kr, vr]
    for obj, arg in ((four.k_scales, "k_block_scales"), (four.v_scales, "v_block_scales")):
        ref = array_ref(obj, arg) if obj is not None else None
        if obj is not None and ref is None:
            raise TypeError(f"{arg}: expected a device array, got a numpy array")
        want = "float16" if four.fmt == Q4_FORMAT else "uint8 (e4m3 bytes)"
        good = ref is not None and (
            ref[2] == np.float16 if four.fmt == Q4_FORMAT else ref[2].itemsize == 1
        )
        expected = layout_shape(layout, capacity, n_kv, per)
        if ref is None or not good or tuple(ref[1]) != expected or not ref[4]:
            got = "None" if ref is None else f"shape {tuple(ref[1])} of {ref[2]}"
            raise ValueError(f"{arg}: a {name} cache's block scales are contiguous {want} "
                             f"{expected} (kv_layout {layout!r}, the values'), got "
                             f"{got}")  # fmt: skip
        refs.append(ref)
    scales = None
    if four.fmt == NVFP4_FORMAT:
        if kv_scales is None:
            raise TypeError("kv_scales: an nvfp4 cache is read with its float32 scales per KV "
                            "head, n_kv_heads K scales then n_kv_heads V ones")  # fmt: skip
        scales = array_ref(kv_scales, "kv_scales")
        if scales is None:
            raise TypeError("kv_scales: expected a device array, got a numpy array")
        if scales[2] != np.float32 or math.prod(scales[1]) != 2 * n_kv or not scales[4]:
            raise ValueError(f"kv_scales: expected {2 * n_kv} contiguous float32, got shape "
                             f"{tuple(scales[1])} of {scales[2]}")  # fmt: skip
    elif kv_scales is not None:
        raise TypeError("kv_scales: an int4 cache scales each group of 32 itself; only fp8 and "
                        "nvfp4 caches take kv_scales")  # fmt: skip
    refs.append(scales)
    for ref, arg in zip(refs[1:], ("v_cache", "k_block_scales", "v_block_scales", "kv_scales"),
                        strict=True):  # fmt: skip
        if ref is not None and ref[3] != kr[3]:
            raise ValueError(f"{arg}: on device {ref[3]}, k_cache on device {kr[3]}")
    return capacity, n_kv, hd, tuple(refs)


def check_four_bit_capability(fmt: str, compute_capability: tuple[int, int]) -> None:
    """Raise ValueError naming ``kv_format`` where the device cannot read the format."""
    need = (8, 9) if fmt == NVFP4_FORMAT else (8, 0)
    if compute_capability < need:
        raise ValueError(
            f"kv_format: {'int4' if fmt == Q4_FORMAT else fmt} caches need compute capability "
            f"{need[0]}.{need[1]} or newer; this GPU has {compute_capability}"
        )


@dataclasses.dataclass(frozen=True)
class _Pair:
    """A caller's (k_cache, v_cache) pair, checked: the refs, its shape and layout."""

    k: ArrayRef
    v: ArrayRef
    n_kv_heads: int
    head_dim: int
    capacity: int
    # elements from one KV head's rows to the next's (HND; a 4-bit pair's: bytes of its
    # values, capacity rows), else 0
    head_stride: int
    layout: str
    fp8: str = ""  # an fp8 cache's format (its bytes read with kv_scales), else ""


def _check_pair(
    pair: tuple[Any, ...], kv_layout: Any, fp8_ok: bool = False,
    four_bit: FourBitScales | None = None, kv_scales: Any = None,
) -> _Pair:  # fmt: skip
    """A ``(k_cache, v_cache)`` pair of device arrays in layout ``kv_layout``, checked
    (``fp8_ok``: kv_scales came with it, so an fp8 pair is read; ``four_bit``: a 4-bit
    pair, its block scales and ``kv_scales`` checked too, token-major or head-major)."""
    layout = check_kv_layout(kv_layout)
    if four_bit is not None:  # (head-major: a KV head's values capacity rows apart)
        capacity, n_kv, hd, refs = check_four_bit_pair(pair, four_bit, kv_scales, layout)
        stride = capacity * (hd // 2) if layout == "HND" else 0
        return _Pair(refs[0], refs[1], n_kv, hd, capacity, stride, layout, four_bit.fmt)
    if len(pair) != 2:
        raise TypeError(
            f"kv: expected a KVCache or a pair (k_cache, v_cache), got {len(pair)} items"
        )
    k, v = pair
    kr, vr = array_ref(k, "k_cache"), array_ref(v, "v_cache")
    if kr is None or vr is None:
        raise TypeError(
            "k_cache, v_cache: expected device arrays (a pair is read in place on the "
            "device), got a numpy array"
        )
    shape, dtype = tuple(kr[1]), kr[2]
    fp8 = FP8_DTYPES.get(dtype, "")
    if fp8 and not fp8_ok:
        raise TypeError(
            f"k_cache: an fp8 cache ({dtype}) is read with its scales: pass kv_scales (float32, "
            "n_kv_heads K scales then n_kv_heads V ones)"
        )
    if not fp8 and dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"k_cache: expected float32, float16, bfloat16 or an fp8 format (with kv_scales), "
            f"got {dtype}"
        )
    if layout == "HND":
        if len(shape) not in (3, 4) or (len(shape) == 4 and shape[0] != 1):
            raise ValueError(
                "k_cache: expected a head-major array (n_kv_heads, capacity, head_dim) or "
                f"(1, n_kv_heads, capacity, head_dim), got shape {shape}"
            )
        n_kv, hd = shape[-3], shape[-1]
        _, capacity, stride = head_major_rows(k, "k_cache", n_kv, hd)
        _, _, stride_v = head_major_rows(v, "v_cache", n_kv, hd)
    else:
        if len(shape) != 3 or not kr[4]:
            raise ValueError(
                "k_cache: expected a C-contiguous token-major array (capacity, n_kv_heads, "
                f"head_dim), got shape {shape}{'' if kr[4] else ' (strided)'}"
            )
        capacity, n_kv, hd = shape
        check_tokens(capacity, "k_cache")
        stride = stride_v = 0
    if tuple(vr[1]) != shape or vr[2] != dtype or stride_v != stride:
        raise ValueError(
            f"v_cache: expected k_cache's shape {shape}, dtype {dtype} and layout, got "
            f"{tuple(vr[1])} of {vr[2]}"
        )
    if layout == "NHD" and not vr[4]:
        raise ValueError(f"v_cache: must be C-contiguous, got a strided view of shape {shape}")
    if kr[3] != vr[3]:
        raise ValueError(f"v_cache: on device {vr[3]}, k_cache on device {kr[3]}")
    return _Pair(kr, vr, n_kv, hd, capacity, stride, layout, fp8)


def checked_operand(obj: Any, name: str, size: int, dtype: np.dtype, ordinal: int) -> ArrayRef:
    """A device array of ``size`` contiguous elements of ``dtype`` on device ``ordinal``."""
    ref = array_ref(obj, name)
    if ref is None:
        raise TypeError(f"{name}: expected a device array, got a numpy array")
    _, shape, got, at, contiguous, _ = ref
    if got != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {got}")
    if math.prod(shape) != size or not contiguous:
        raise ValueError(f"{name}: expected {size} contiguous elements, got shape {shape}")
    if at != ordinal:
        raise ValueError(f"{name}: on device {at}, the cache on device {ordinal}")
    return ref


# The eager pair decode's calls, by everything its checks read: a repeated call (the same
# shapes, strides, dtypes, features, seq_len array and stream; new q/k/v/out pointers)
# skips the checks and the record lookup and only writes the pointers. The oldest go first
# past MAX_PAIR_CALLS; the records themselves live in the process's record store.
MAX_PAIR_CALLS = 256
_pair_calls = Kept(MAX_PAIR_CALLS)
_PAIR_ROLES = ("q_dev", "k_cache", "v_cache", "out_dev", "seq_len", "sinks", "alibi_slopes",
               "out_lse", "kv_scales", "tree_mask", "k_block_scales",
               "v_block_scales")  # fmt: skip


def decode_async_pair(
    q_dev: Any, pair: tuple[Any, ...], out_dev: Any, n_heads: Any, stream: Any,
    algorithm: Any, seq_len: Any, kv_layout: Any, kw: dict[str, Any], out_lse: Any,
    kv_scales: Any = None, torch_owned: bool = False, tree_mask: Any = None,
    four_bit: FourBitScales | None = None,
) -> None:  # fmt: skip
    """gqa_decode_async over a caller's (k_cache, v_cache): a call seen before (`_pair_calls`)
    queued with its pointers; a new one checked (`_pair_checked`) and remembered.

    ``kv_scales``: an fp8 pair's scales (float32, n_kv K scales then n_kv V ones).
    ``tree_mask``: a verify's (q ``(n_q, n_heads, head_dim)``) mask on the device.
    ``four_bit``: a 4-bit pair's block scales and rotation (its per-head nvfp4 scales in
    ``kv_scales``), token-major or, ``kv_layout="HND"``, head-major.
    ``torch_owned``: the arrays are PyTorch's and so are the graphs that capture this call
    (the torch ops): nothing is kept for a capture (PyTorch keeps what its graphs use), and a
    first call inside PyTorch's capture makes its record with the capture mode relaxed."""
    sid = stream_key(stream)
    found = _pair_call_key(q_dev, pair, out_dev, n_heads, sid, algorithm, seq_len, kv_layout,
                           kw, out_lse, kv_scales, tree_mask, four_bit)  # fmt: skip
    entry = None if found is None else _pair_calls.get(found[0])
    if entry is None:
        entry = _pair_checked(q_dev, pair, out_dev, n_heads, stream, sid, algorithm, seq_len,
                              kv_layout, kw, out_lse, kv_scales, torch_owned,
                              tree_mask, four_bit)  # fmt: skip
        if found is not None:
            with _records_lock:
                _pair_calls.keep(found[0], entry)
    record, dev, foreign = entry
    dev.activate()  # this thread's context current before any driver call
    objs = (q_dev, pair[0], pair[1], out_dev, seq_len, kw.get("sinks"), kw.get("alibi_slopes"),
            out_lse, kv_scales, tree_mask, *_block_scales(four_bit))  # fmt: skip
    refs: list[Any] = found[1] if found is not None else [
        None if o is None else array_ref(o, n) for o, n in zip(objs, _PAIR_ROLES, strict=True)
    ]  # fmt: skip
    if not torch_owned and (
        bool(getattr(_capture_state, "depth", 0)) or (foreign and stream_capturing(sid))
    ):
        owners = [o if r[5] is None else r[5] for r, o in zip(refs, objs, strict=True) if r]
        keep_for_capture(sid, foreign, record, *owners)
    record.run((refs[0][0], refs[1][0], refs[2][0], refs[3][0], 0))


def _pair_call_key(
    q_dev: Any, pair: Any, out_dev: Any, n_heads: Any, sid: int, algorithm: Any, seq_len: Any,
    kv_layout: Any, kw: dict[str, Any], out_lse: Any, kv_scales: Any = None,
    tree_mask: Any = None, four_bit: FourBitScales | None = None,
) -> tuple[tuple[Any, ...], list[Any]] | None:  # fmt: skip
    """The key of a pair decode's call in `_pair_calls` and its arrays' refs, or None where
    the call is not one to remember (anything the checks would refuse goes to them)."""
    if not isinstance(pair, tuple) or len(pair) != 2:
        return None
    objs = (q_dev, pair[0], pair[1], out_dev, seq_len, kw.get("sinks"), kw.get("alibi_slopes"),
            out_lse, kv_scales, tree_mask, *_block_scales(four_bit))  # fmt: skip
    refs: list[Any] = []
    sigs: list[Any] = []
    for obj, role in zip(objs, _PAIR_ROLES, strict=True):
        if obj is None:
            if len(refs) < 4:  # (q, k, v, out missing: the checks name them)
                return None
            refs.append(None)
            sigs.append(None)
            continue
        ref = array_ref(obj, role)
        if ref is None:
            return None
        sig: tuple[Any, ...] = (ref[1], ref[2], ref[3], ref[4])
        if not ref[4]:  # (a head-major view: its strides place the heads)
            sig += (_element_strides(obj, ref[2].itemsize),)
        refs.append(ref)
        sigs.append(sig)
    # q, k, v and out change pointers from call to call (their 16-byte alignment matters);
    # seq_len's and the features' arrays are the record's own
    aligned = ((refs[0][0] | refs[1][0] | refs[2][0] | refs[3][0]) & 15) == 0
    held = tuple(0 if r is None else r[0] for r in refs[4:])
    four = None if four_bit is None else (four_bit.fmt, four_bit.rotate)
    key = (sid, n_heads, algorithm, kv_layout, kw.get("sliding_window"),
           kw.get("logits_soft_cap"), kw.get("scale"), aligned, held, *sigs,
           attention.OVERRIDES, four)  # fmt: skip
    try:
        hash(key)
    except TypeError:
        return None
    return key, refs


def _block_scales(four_bit: FourBitScales | None) -> tuple[Any, Any]:
    return (None, None) if four_bit is None else (four_bit.k_scales, four_bit.v_scales)


def _pair_checked(
    q_dev: Any, pair: tuple[Any, ...], out_dev: Any, n_heads: Any, stream: Any, sid: int,
    algorithm: Any, seq_len: Any, kv_layout: Any, kw: dict[str, Any], out_lse: Any,
    kv_scales: Any = None, torch_owned: bool = False, tree_mask: Any = None,
    four_bit: FourBitScales | None = None,
) -> tuple[Any, Device, bool]:  # fmt: skip
    """A pair decode's every argument checked, and its record (made on first use, outside
    a capture, or inside PyTorch's with ``torch_owned``), device and whether its stream is
    another library's."""
    kv = _check_pair(pair, kv_layout, fp8_ok=kv_scales is not None, four_bit=four_bit,
                     kv_scales=kv_scales)  # fmt: skip
    n_q = query_count(q_dev, kv.head_dim, n_heads)
    n_heads = q_heads_of(n_heads, q_dev, kv.head_dim)
    n_heads, n_kv, hd = check_dims(n_heads, kv.n_kv_heads, kv.head_dim)
    if check_algorithm(algorithm) == "parity":
        raise ValueError("algorithm: a (k_cache, v_cache) pair needs the split kernels ('auto')")
    if n_q > max(kv.capacity, 1):
        check_query_count(n_q, kv.capacity, "q_dev")
    if seq_len is None:
        raise TypeError(
            "seq_len: a (k_cache, v_cache) pair needs its length, an int32 device scalar"
        )
    ordinal, dtype = kv.k[3], np.dtype(kv.k[2])
    seq = checked_operand(seq_len, "seq_len", 1, np.dtype(np.int32), ordinal)
    size = n_q * n_heads * hd
    scales = None
    if four_bit is not None:  # q and out 16-bit; an nvfp4 pair's per-head scales
        q_ref = array_ref(q_dev, "q_dev")
        dtype = np.dtype(q_ref[2]) if q_ref is not None else dtype
        if dtype.name not in ("float16", "bfloat16"):
            raise TypeError(f"q_dev: expected float16 or bfloat16 for a 4-bit cache, got {dtype}")
        if kv_scales is not None:
            scales = checked_operand(kv_scales, "kv_scales", 2 * n_kv, np.dtype(np.float32),
                                     ordinal)  # fmt: skip
    elif kv.fp8:  # q and out of their own 16-bit dtype; the scales the kernels multiply by
        q_ref = array_ref(q_dev, "q_dev")
        dtype = np.dtype(q_ref[2]) if q_ref is not None else dtype
        if dtype.name not in ("float16", "bfloat16"):
            raise TypeError(f"q_dev: expected float16 or bfloat16 for an fp8 cache, got {dtype}")
        if kv.head_dim % 8:
            raise ValueError(f"k_cache: an fp8 cache needs a head_dim divisible by 8, got {hd}")
        scales = checked_operand(kv_scales, "kv_scales", 2 * n_kv, np.dtype(np.float32), ordinal)
    elif kv_scales is not None:
        raise TypeError(f"kv_scales: only for fp8 caches, k_cache is {dtype}")
    q = checked_operand(q_dev, "q_dev", size, dtype, ordinal)
    out = checked_operand(out_dev, "out_dev", size, dtype, ordinal)
    feats = check_features(n_heads, **kw, return_lse=out_lse is not None)
    for obj, name in ((feats.sinks, "sinks"), (feats.alibi_slopes, "alibi_slopes")):
        feature_ptr(obj, name, n_heads, ordinal)  # (checked before the device is asked)
    feature_ptr(out_lse, "out_lse", n_q * n_heads, ordinal)
    mask, mask_mode = device_mask(tree_mask, n_q, ordinal)
    dev = device_for(ordinal)
    if four_bit is not None:
        check_four_bit_capability(four_bit.fmt, dev.compute_capability)
    elif kv.fp8 and dev.compute_capability < MIN_COMPUTE_CAPABILITY:
        raise ValueError(
            f"k_cache: fp8 caches need compute capability 8.9 or newer, this GPU has "
            f"{dev.compute_capability}"
        )
    sinks = feature_array(feats.sinks, "sinks", n_heads, dev)
    slopes = feature_array(feats.alibi_slopes, "alibi_slopes", n_heads, dev)
    lse = feature_array(out_lse, "out_lse", n_q * n_heads, dev)
    bits, fargs = abi.feature_args(feats, hd, slopes=slopes, sinks=sinks, lse=lse)
    if kv.layout == "HND":
        bits |= abi.F_HND
        fargs = dataclasses.replace(fargs, head_stride=kv.head_stride)
    # (16-byte loads need whole heads aligned: the stride in the cache's bytes)
    heads_at = kv.head_stride * np.dtype(kv.k[2]).itemsize
    aligned = ((q[0] | kv.k[0] | kv.v[0] | out[0] | heads_at) & 15) == 0
    foreign = sid != 0 and not isinstance(stream, Stream)
    dev.activate()  # this thread's context current before any driver call
    key = ("pair", dev.context_handle, dtype, n_heads, n_kv, hd, kv.capacity, kv.head_stride,
           aligned, sid, seq[0], bits, feature_key(fargs), attention.OVERRIDES, kv.fp8,
           0 if scales is None else scales[0], n_q, 0 if mask is None else mask[0],
           mask_mode, *_four_key(four_bit))  # fmt: skip
    captured = bool(getattr(_capture_state, "depth", 0)) or (foreign and stream_capturing(sid))
    record = _records.get(key)
    if record is None:
        if captured and not torch_owned:
            raise FerroxError(
                "stream: the first decode of this (k_cache, v_cache) signature cannot load "
                "its kernels or allocate its scratch inside a capture: run it once before "
                "capturing"
            )
        with contextlib.ExitStack() as relaxed, _records_lock:
            if captured:  # PyTorch's capture (the torch ops): neither step is captured
                relaxed.enter_context(relaxed_capture())
            record = _pair_record(key, dev, kv, q, out, seq, n_heads, dtype, aligned, bits,
                                  fargs, feats.sliding_window, sid, scales,
                                  (n_q, mask, mask_mode), four_bit)  # fmt: skip
    return record, dev, foreign


def _four_key(four_bit: FourBitScales | None) -> tuple[Any, ...]:
    """A 4-bit pair's part of its record's key: its block scales' addresses (the record
    reads them) and its rotation."""
    if four_bit is None:
        return ()
    refs = [array_ref(s, "block_scales") for s in _block_scales(four_bit)]
    return (*(0 if r is None else r[0] for r in refs), bool(four_bit.rotate))


def _pair_record(
    key: tuple[Any, ...], dev: Device, kv: _Pair, q: ArrayRef, out: ArrayRef, seq: ArrayRef,
    n_heads: int, dtype: np.dtype, aligned: bool, bits: int, fargs: Any,
    window: int | None, sid: int, scales: ArrayRef | None = None,
    queries: tuple[int, ArrayRef | None, int] = (1, None, 0),
    four_bit: FourBitScales | None = None,
) -> DecodeRecord:  # fmt: skip
    """The launches of a pair's decode, planned for its capacity (at most the window); an
    fp8 pair's read with ``scales``; ``queries``: (n_q, the tree mask's ref, its mode); a
    4-bit pair's with its block scales and rotation (``four_bit``)."""
    record = _records.get(key)
    if record is not None:
        return record
    plan_seq = kv.capacity if window is None else min(kv.capacity, window)
    n_kv, hd = kv.n_kv_heads, kv.head_dim
    n_q, mask, mask_mode = queries
    q_d, out_d = (DeviceArray._wrap(r[0], (n_q * n_heads * hd,), dtype, dev, None)
                  for r in (q, out))  # fmt: skip
    mask_d = (
        None
        if mask is None
        else DeviceArray._wrap(mask[0], tuple(mask[1]), np.dtype(mask[2]), dev, None)
    )
    k_d, v_d = (DeviceArray._wrap(r[0], tuple(r[1]), np.dtype(r[2]), dev, None)
                for r in (kv.k, kv.v))  # fmt: skip
    seq_d = DeviceArray._wrap(seq[0], (1,), np.dtype(np.int32), dev, None)
    fp8: dict[str, Any] = {}
    if scales is not None:
        fp8 = dict(dtype=dtype, fp8=kv.fp8, kv_scales=DeviceArray._wrap(
            scales[0], (2 * n_kv,), np.dtype(np.float32), dev, None))  # fmt: skip
    if four_bit is not None:  # (as a 4-bit KVCache's decode_record passes its own)
        per = hd // _FOUR_BIT_GROUP[kv.fp8]  # the block scales in the values' layout
        shape = layout_shape(kv.layout, kv.capacity, n_kv, per)
        sdt = np.dtype(np.float16 if kv.fp8 == Q4_FORMAT else np.uint8)
        block = tuple(
            DeviceArray._wrap(array_ref(s, "block_scales")[0], shape, sdt, dev, None)  # type: ignore[index]
            for s in _block_scales(four_bit)
        )  # fmt: skip
        # head-major: the values' bytes from one KV head's rows to the next's (0: token-major)
        fp8 = dict(fp8, dtype=dtype, fp8=kv.fp8, q4_scales=block, rotate=bool(four_bit.rotate),
                   q4_head_stride=kv.head_stride)  # fmt: skip
        fp8.setdefault("kv_scales", None)
    record = _records.keep(key, assemble(
        q_d, k_d, v_d, out_d, stream=stream_handle(sid), keep_workspace=False, n_heads=n_heads,
        n_kv_heads=n_kv, head_dim=hd, seq_len=kv.capacity, seq_len_dev=seq_d,
        plan_seq=max(plan_seq, 1), aligned=aligned, bits=bits, features=fargs,
        workspace=lambda floats: _stream_buffer(dev, sid, "workspace", floats), **fp8,
        n_q=n_q, mask=mask_d, mask_mode=mask_mode,
    ))  # fmt: skip
    return record


def device_mask(tree_mask: Any, n_q: int, ordinal: int) -> tuple[ArrayRef | None, int]:
    """A capturable decode's tree mask: (its ref, the kernels' mask mode), (None, 0) for
    none (causal). The kernels read it at each run, so it must be on the device.

    Raises:
        TypeError, ValueError: naming ``tree_mask``.
    """
    if tree_mask is None:
        return None, 0
    ref = array_ref(tree_mask, "tree_mask")
    if ref is None:
        raise TypeError("tree_mask: expected a device array (the kernels read it at each run), "
                        "got a numpy array")  # fmt: skip
    mode = check_mask(tree_mask, ref, n_q)  # (a device mask: its shape, dtype and layout)
    if ref[3] != ordinal:
        raise ValueError(f"tree_mask: on device {ref[3]}, the cache on device {ordinal}")
    return ref, mode


def feature_key(fargs: Any) -> tuple[Any, ...]:
    """What identifies a decode's feature values in a record's key: the scalars and the
    per-head arrays' addresses (the kernels read the arrays, so new values in the same
    arrays need no new record)."""

    def ptr(a: Any) -> int:
        return 0 if a is None else int(a.ptr)

    return (fargs.scale, fargs.cap, fargs.window, ptr(fargs.slopes), ptr(fargs.sinks),
            ptr(fargs.lse))  # fmt: skip
