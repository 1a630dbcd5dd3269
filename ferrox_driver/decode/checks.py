"""Argument checks shared by the decode entry points: run before any device work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..driver.dtypes import DTypeTable
from ..driver.memory import as_dtype

__all__ = [
    "REFERENCE_MAX_HEAD_DIM",
    "DecodeSpec",
    "SUPPORTED_DTYPES",
    "check_decode_args",
    "check_decode_infos",
    "check_dims",
    "dtype_name",
]

MAX_HEAD_DIM = 512  # the kernels' widest head (past 256: CUDA cores, decode/plan.py)
# the float64 reference's widest head (MLA's 576 = 512 + 64 rope dims, and room past it)
REFERENCE_MAX_HEAD_DIM = 1024
# The kernels take their counts as 32-bit ints (tokens, heads, head_dim; a cache's length
# on the device is an int32) and, past a sequence's end, reach at most one chunk of
# tokens further in 32 bits (FX_MAX_SPLITS x (FX_TILE + 1) plus a ring's steps, under 2^17
# tokens): MAX_TOKENS leaves 2^20 of room. Offsets in elements and bytes are 64-bit.
MAX_TOKENS = 2**31 - 2**20
MAX_INT32 = 2**31 - 1
# A launch grid's y and z hold at most 65535 blocks; the split kernels put the KV heads
# there, two blocks each for groups of 9-16 (two tiles of 8 query heads).
MAX_KV_HEADS = 65535 // 2
# by name: looking a dtype up does not import ml_dtypes (dtypes.py)
SUPPORTED_DTYPES = DTypeTable({"float32": "f32", "float16": "f16", "bfloat16": "bf16"})


def dtype_name(dtype: Any) -> str:
    """The kernel suffix of a supported dtype: ``f32``, ``f16`` or ``bf16``."""
    return SUPPORTED_DTYPES[np.dtype(dtype)]


def check_int(value: Any, name: str, low: int = 1, high: int | None = None) -> int:
    """``value`` as an int within [low, high], or a TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name}: expected {bound}, got {value}")
    return int(value)


def check_dims(
    n_heads: Any, n_kv_heads: Any, head_dim: Any, max_head_dim: int = MAX_HEAD_DIM
) -> tuple[int, int, int]:
    """Validate the attention shape (before any device work; ``max_head_dim``: the widest
    head the caller takes, the kernels' unless the float64 reference asks)."""
    n_heads = check_int(n_heads, "n_heads", 1, MAX_INT32)
    n_kv_heads = check_int(n_kv_heads, "n_kv_heads", 1, MAX_KV_HEADS)
    head_dim = check_int(head_dim, "head_dim", 1, max_head_dim)
    if n_heads % n_kv_heads:
        raise ValueError(
            f"n_heads: must be a multiple of n_kv_heads, got n_heads={n_heads}, "
            f"n_kv_heads={n_kv_heads} (each KV head serves a whole group of query heads)"
        )
    return n_heads, n_kv_heads, head_dim


def check_tokens(n: int, name: str) -> int:
    """``n`` tokens if the kernels can count them (at most MAX_TOKENS), else a ValueError
    naming ``name``."""
    if n > MAX_TOKENS:
        raise ValueError(
            f"{name}: {n} tokens, more than the {MAX_TOKENS} (2^31 - 2^20) that the kernels "
            f"count in 32 bits"
        )
    return n


def check_host_extent(arr: np.ndarray, name: str) -> None:
    """Refuse a numpy view that reaches past the memory it views (``as_strided`` over a
    smaller buffer, which numpy does not check): copying it, or computing with it, would
    read memory it does not own. numpy's own views (an ndarray base) are in bounds by
    construction; memory whose size numpy cannot see is taken as it is."""
    base = arr.base
    if base is None or type(base) is np.ndarray or arr.size == 0:
        return
    lo, hi = _byte_bounds(arr)
    owner = base
    while (deeper := getattr(owner, "base", None)) is not None:  # as_strided's DummyArray...
        owner = deeper
    try:
        olo, ohi = _byte_bounds(
            owner if isinstance(owner, np.ndarray) else np.frombuffer(owner, np.uint8)
        )
    except (TypeError, ValueError, BufferError):
        return
    if lo < olo or hi > ohi:
        raise ValueError(
            f"{name}: a view of shape {arr.shape} and strides {arr.strides} spans bytes "
            f"{lo - olo}..{hi - olo} of a buffer of {ohi - olo} (an as_strided view past "
            f"the memory it views)"
        )


def _byte_bounds(arr: np.ndarray) -> tuple[int, int]:
    try:
        from numpy.lib.array_utils import byte_bounds
    except ImportError:  # numpy < 2
        byte_bounds = np.byte_bounds  # type: ignore[attr-defined]
    lo, hi = byte_bounds(arr)
    return int(lo), int(hi)


def check_dtype(dtype: Any, name: str) -> np.dtype:
    """``dtype`` (any form ``memory.as_dtype`` takes) if ferrox's kernels support it."""
    dt = as_dtype(dtype, name)
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: expected float32, float16 or bfloat16, got {dt}")
    return dt


@dataclass(frozen=True)
class ArrayInfo:
    shape: tuple[int, ...]
    dtype: np.dtype
    on_device: bool


def array_info(obj: Any, name: str, *, allow_device: bool = True) -> ArrayInfo:
    """Shape, dtype and placement of a numpy or device array, checking contiguity."""
    from ..driver.interop import array_ref

    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(
                f"{name}: must be C-contiguous, got strides {obj.strides} for shape "
                f"{obj.shape} (use numpy.ascontiguousarray)"
            )
        check_host_extent(obj, name)
        return ArrayInfo(obj.shape, obj.dtype, False)
    if not allow_device:
        raise TypeError(f"{name}: expected a numpy array, got {type(obj).__name__}")
    ref = array_ref(obj, name)
    assert ref is not None  # numpy arrays are handled above
    if not ref[4]:
        raise ValueError(f"{name}: must be C-contiguous, got a strided view of shape {ref[1]}")
    return ArrayInfo(ref[1], ref[2], True)


@dataclass(frozen=True)
class DecodeSpec:
    """What validation learned about a decode call."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    seq_len: int
    dtype: np.dtype
    q_shape: tuple[int, ...]
    on_device: bool


def check_q(info: ArrayInfo, n_heads: int, head_dim: int, name: str = "q") -> None:
    """q of ``n_heads`` heads of ``head_dim``: flat, ``(n_heads, head_dim)`` or PyTorch
    SDPA's one token of a batch of one, ``(1, n_heads, 1, head_dim)``."""
    flat = (n_heads * head_dim,)
    if info.shape not in (flat, (n_heads, head_dim), (1, n_heads, 1, head_dim)):
        raise ValueError(
            f"{name}: expected shape {flat}, {(n_heads, head_dim)} or "
            f"{(1, n_heads, 1, head_dim)} for n_heads={n_heads}, head_dim={head_dim}, got "
            f"{tuple(info.shape)}"
        )


def q_heads(shape: tuple[int, ...], head_dim: int, n_heads: Any = None, name: str = "q") -> int:
    """The query heads of a q of ``shape`` over heads of ``head_dim``, read from the shape
    (flat, ``(n_heads, head_dim)`` or ``(1, n_heads, 1, head_dim)``); ``n_heads``, when
    given, must agree.

    Raises:
        TypeError, ValueError: naming ``n_heads`` (not an int, or not what q holds) or
            ``name`` (a shape of no whole heads).
    """
    if n_heads is not None:
        n_heads = check_int(n_heads, "n_heads")
    qs = tuple(shape)
    found = 0
    if len(qs) == 2 and qs[1] == head_dim:
        found = qs[0]
    elif len(qs) == 4 and qs[0] == 1 and qs[2] == 1 and qs[3] == head_dim:
        found = qs[1]
    elif len(qs) == 1 and qs[0] % head_dim == 0:
        found = qs[0] // head_dim
    if found < 1:
        if n_heads is not None:
            check_q(ArrayInfo(qs, np.dtype(np.float32), False), n_heads, head_dim, name)
        raise ValueError(
            f"{name}: expected shape (n_heads*{head_dim},), (n_heads, {head_dim}) or "
            f"(1, n_heads, 1, {head_dim}) with n_heads >= 1, got {qs}"
        )
    if n_heads is not None and n_heads != found:
        raise ValueError(
            f"n_heads: {n_heads} given, but {name} of shape {qs} holds {found} heads of "
            f"head_dim {head_dim}"
        )
    return found


def read_dims(
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    n_heads: Any,
    n_kv_heads: Any,
    head_dim: Any,
    *,
    layout: str = "NHD",
    names: tuple[str, str] = ("q", "k_cache"),
    max_head_dim: int = MAX_HEAD_DIM,
) -> tuple[int, int, int]:
    """``(n_heads, n_kv_heads, head_dim)`` of a decode: each given one checked (an int in
    range; the three together as `check_dims`), the others read from the shapes: K's
    ``(seq_len, n_kv_heads, head_dim)`` (``layout`` "NHD") or ``([1,] n_kv_heads, seq_len,
    head_dim)`` ("HND"), then q's (`q_heads`). A given value the shapes contradict is a
    ValueError naming it; one no shape says (a flat K) and not given, a TypeError naming it.
    """
    q_name, k_name = names
    n_heads = None if n_heads is None else check_int(n_heads, "n_heads")
    n_kv_heads = None if n_kv_heads is None else check_int(n_kv_heads, "n_kv_heads")
    head_dim = None if head_dim is None else check_int(head_dim, "head_dim", 1, max_head_dim)
    if n_heads is not None and n_kv_heads is not None and head_dim is not None:
        check_dims(n_heads, n_kv_heads, head_dim, max_head_dim)  # (agree among themselves)
    ks, qs = tuple(k_shape), tuple(q_shape)
    if layout == "NHD" and len(ks) == 4:
        raise ValueError(
            f"{k_name}: expected (seq_len, n_kv_heads, head_dim) or flat, got shape {ks}: a "
            f"4-D cache (1, n_kv_heads, seq_len, head_dim) is PyTorch SDPA's head-major "
            f"layout: pass kv_layout='HND'"
        )
    if layout == "NHD":
        shaped = ks[1:] if len(ks) == 3 else None
        form = "(seq_len, n_kv_heads, head_dim)"
    else:
        shaped = (ks[-3], ks[-1]) if len(ks) == 3 or (len(ks) == 4 and ks[0] == 1) else None
        form = "([1,] n_kv_heads, seq_len, head_dim), kv_layout='HND'"
    if shaped is not None:
        for given, found, name, what in (
            (n_kv_heads, shaped[0], "n_kv_heads", "KV heads"),
            (head_dim, shaped[1], "head_dim", "elements per head"),
        ):  # fmt: skip
            if given is not None and given != found:
                raise ValueError(
                    f"{name}: {given} given, but {k_name} of shape {ks} holds {found} {what} "
                    f"(read as {form})"
                )
        n_kv_heads, head_dim = shaped
        where = f"read from {k_name}'s shape {ks}"
    elif head_dim is None:
        if len(qs) not in (2, 4):
            raise TypeError(
                f"head_dim: required: neither {k_name} of shape {ks} nor {q_name} of shape "
                f"{qs} says it"
            )
        head_dim, where = qs[-1], f"read from {q_name}'s shape {qs}"
    else:
        where = "given"
    if n_kv_heads is None:
        raise TypeError(f"n_kv_heads: required: a flat {k_name} (shape {ks}) does not say it")
    for value, name, high in (
        (n_kv_heads, "n_kv_heads", None),
        (head_dim, "head_dim", max_head_dim),
    ):
        if value < 1 or (high is not None and value > high):
            bound = f"1..{high}" if high is not None else ">= 1"
            raise ValueError(f"{name}: expected {bound}, got {value} ({where})")
    n_heads = q_heads(qs, head_dim, n_heads, q_name)
    return check_dims(n_heads, n_kv_heads, head_dim, max_head_dim)


def kv_rows(info: ArrayInfo, n_kv_heads: int, head_dim: int, name: str) -> int:
    """Number of tokens in a flat or (seq_len, n_kv_heads, head_dim) K/V array."""
    row = n_kv_heads * head_dim
    if len(info.shape) == 1:
        if info.shape[0] % row:
            raise ValueError(
                f"{name}: length {info.shape[0]} is not a multiple of n_kv_heads*head_dim = "
                f"{n_kv_heads}*{head_dim} = {row}"
            )
        return info.shape[0] // row
    if len(info.shape) == 3 and info.shape[1:] == (n_kv_heads, head_dim):
        return info.shape[0]
    raise ValueError(
        f"{name}: expected shape (seq_len*{row},) or (seq_len, {n_kv_heads}, {head_dim}), "
        f"got {info.shape}"
    )


def check_decode_args(
    q: Any,
    k: Any,
    v: Any,
    n_heads: Any,
    n_kv_heads: Any,
    head_dim: Any,
    *,
    allow_device: bool = True,
    names: tuple[str, str, str] = ("q", "k_cache", "v_cache"),
) -> DecodeSpec:
    """Validate a decode call's arguments (``names``: how the caller calls q, K and V;
    dims None: read from the shapes, `read_dims`); raise naming the first bad one.
    ``allow_device=False`` (the float64 reference): numpy arrays of any floating dtype."""
    qi, ki, vi = (
        array_info(a, n, allow_device=allow_device) for a, n in zip((q, k, v), names, strict=True)
    )
    if not allow_device:
        for info, name in zip((qi, ki, vi), names, strict=True):
            _check_float(info, name)
        dims = read_dims(qi.shape, ki.shape, n_heads, n_kv_heads, head_dim, names=names[:2],
                         max_head_dim=REFERENCE_MAX_HEAD_DIM)  # fmt: skip
        return _check_shapes(qi, ki, vi, *dims, qi.dtype, names)
    if not qi.on_device == ki.on_device == vi.on_device:
        raise TypeError(
            "q, k_cache, v_cache: pass all three as numpy arrays or all three as device "
            f"arrays (got q on {'device' if qi.on_device else 'host'}, k_cache on "
            f"{'device' if ki.on_device else 'host'}, v_cache on "
            f"{'device' if vi.on_device else 'host'})"
        )
    return check_decode_infos(qi, ki, vi, n_heads, n_kv_heads, head_dim)


# ml_dtypes' floating formats, by name (numpy calls them kind "V")
_ML_FLOATS = frozenset(
    ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
     "float8_e4m3b11fnuz", "float8_e4m3", "float8_e3m4", "float8_e8m0fnu", "float6_e2m3fn",
     "float6_e3m2fn", "float4_e2m1fn")
)  # fmt: skip


def _check_float(info: ArrayInfo, name: str) -> None:
    """A host array the float64 reference reads: any floating dtype, ml_dtypes' included."""
    if info.dtype.kind != "f" and info.dtype.name not in _ML_FLOATS:
        raise TypeError(
            f"{name}: expected a floating-point array (float64, float32, float16, bfloat16, "
            f"float8), got {info.dtype}"
        )


def check_decode_infos(
    qi: ArrayInfo, ki: ArrayInfo, vi: ArrayInfo, n_heads: Any, n_kv_heads: Any, head_dim: Any
) -> DecodeSpec:
    """Validate what a decode's kernels need of q, K and V (dtypes, shapes; dims None: read
    from the shapes); raise naming the first bad one."""
    dims = read_dims(qi.shape, ki.shape, n_heads, n_kv_heads, head_dim)
    return _check_shapes(qi, ki, vi, *dims, _check_dtypes(qi, ki, vi))


def _check_dtypes(qi: ArrayInfo, ki: ArrayInfo, vi: ArrayInfo) -> np.dtype:
    """q's dtype, if the kernels take it and K and V have it too."""
    dtype = check_dtype(qi.dtype, "q")
    for info, name in ((ki, "k_cache"), (vi, "v_cache")):
        check_dtype(info.dtype, name)
        if info.dtype != dtype:
            raise TypeError(f"{name}: expected q's dtype {dtype}, got {info.dtype}")
    return dtype


def _check_shapes(
    qi: ArrayInfo,
    ki: ArrayInfo,
    vi: ArrayInfo,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    dtype: np.dtype,
    names: tuple[str, str, str] = ("q", "k_cache", "v_cache"),
) -> DecodeSpec:
    q_name, k_name, v_name = names
    check_q(qi, n_heads, head_dim, q_name)
    seq_k = kv_rows(ki, n_kv_heads, head_dim, k_name)
    seq_v = kv_rows(vi, n_kv_heads, head_dim, v_name)
    if ki.shape != vi.shape:
        raise ValueError(
            f"{v_name}: expected {k_name}'s shape {ki.shape} ({seq_k} tokens), got {vi.shape} "
            f"({seq_v} tokens)"
        )
    check_tokens(seq_k, k_name)
    return DecodeSpec(n_heads, n_kv_heads, head_dim, seq_k, dtype, qi.shape, qi.on_device)


KV_LAYOUTS = ("NHD", "HND")


def check_kv_layout(value: Any) -> str:
    """``value`` if it names a KV layout: "NHD" ([token][kv_head][head_dim], the default)
    or "HND" ([kv_head][token][head_dim], PyTorch SDPA's and transformers' caches)."""
    if not isinstance(value, str) or value not in KV_LAYOUTS:
        raise ValueError(
            "kv_layout: expected 'NHD' ([token][kv_head][head_dim]) or 'HND' "
            f"([kv_head][token][head_dim]), got {value!r}"
        )
    return value


def layout_shape(layout: str, capacity: int, n_kv: int, last: int) -> tuple[int, int, int]:
    """The shape of a cache's rows of ``last`` elements in ``layout``: ``(capacity, n_kv,
    last)`` token-major ("NHD"), ``(n_kv, capacity, last)`` head-major ("HND")."""
    return (n_kv, capacity, last) if layout == "HND" else (capacity, n_kv, last)


def layout_dims(layout: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """(capacity, n_kv) of a cache's 3-D ``shape`` in ``layout`` (`layout_shape`'s
    inverse)."""
    return (shape[1], shape[0]) if layout == "HND" else (shape[0], shape[1])


def _element_strides(obj: Any, itemsize: int) -> tuple[int, ...] | None:
    """``obj``'s strides in elements, where it says (numpy, PyTorch, CUDA array interface);
    None: it does not say (read as C-contiguous where it is)."""
    if isinstance(obj, np.ndarray):
        return tuple(s // itemsize for s in obj.strides)
    stride = getattr(obj, "stride", None)  # torch.Tensor.stride()
    if callable(stride):
        try:
            return tuple(int(s) for s in stride())
        except TypeError:
            pass
    cai = getattr(obj, "__cuda_array_interface__", None)
    if isinstance(cai, dict) and cai.get("strides") is not None:
        if any(int(s) % itemsize for s in cai["strides"]):
            return None  # (no whole number of elements: not rows the kernels can read)
        return tuple(int(s) // itemsize for s in cai["strides"])
    return None


def head_major_rows(
    obj: Any, name: str, n_kv_heads: int, head_dim: int, *, allow_device: bool = True
) -> tuple[ArrayInfo, int, int]:
    """A head-major K or V array: ``(n_kv_heads, seq_len, head_dim)``, ``(1, n_kv_heads,
    seq_len, head_dim)`` (a batch of one) or flat. A device array's rows must be contiguous,
    its KV heads any whole number of rows apart from ``seq_len`` on (a view of the first
    tokens of a larger cache, as ``cache[:, :, :seq_len]``); a numpy array may have any
    strides (it is copied in, contiguous). Returns its info, seq_len and the elements from
    one KV head's rows to the next's (a numpy array's once copied).
    """
    from ..driver.interop import array_ref

    ptr = 0
    if isinstance(obj, np.ndarray):  # (any strides: the host path copies it, contiguous)
        check_host_extent(obj, name)
        info, contiguous = ArrayInfo(obj.shape, obj.dtype, False), True
    elif not allow_device:
        raise TypeError(f"{name}: expected a numpy array, got {type(obj).__name__}")
    else:
        ref = array_ref(obj, name)
        assert ref is not None
        info, contiguous, ptr = ArrayInfo(tuple(ref[1]), ref[2], True), ref[4], ref[0]
    shape = info.shape
    expected = (
        f"{name}: expected a head-major array of shape (n_kv_heads, seq_len, head_dim) = "
        f"({n_kv_heads}, seq_len, {head_dim}), (1, {n_kv_heads}, seq_len, {head_dim}) or "
        f"(n_kv_heads*seq_len*head_dim,), got {shape}"
    )
    if len(shape) == 1:
        if shape[0] % (n_kv_heads * head_dim) or not contiguous:
            raise ValueError(expected)
        seq = check_tokens(shape[0] // (n_kv_heads * head_dim), name)
        return info, seq, seq * head_dim
    if not (
        (len(shape) == 3 or (len(shape) == 4 and shape[0] == 1))
        and shape[-3] == n_kv_heads and shape[-1] == head_dim
    ):  # fmt: skip
        raise ValueError(expected)
    seq = check_tokens(shape[-2], name)
    if contiguous:
        return info, seq, seq * head_dim
    strides = _element_strides(obj, info.dtype.itemsize)
    if strides is None or (seq > 1 and strides[-2] != head_dim) or (
        head_dim > 1 and strides[-1] != 1
    ):  # fmt: skip
        raise ValueError(
            f"{name}: each token's row must be contiguous (strides (..., {head_dim}, 1) in "
            f"elements), got strides {strides} for shape {shape}"
        )
    head_stride = strides[-3] if n_kv_heads > 1 else seq * head_dim
    if head_stride < seq * head_dim:
        raise ValueError(
            f"{name}: KV heads {head_stride} elements apart overlap their {seq} tokens of "
            f"{head_dim} (strides {strides})"
        )
    # the kernels place a KV head's rows at head * head_stride (64-bit, signed): the last
    # row's end must be an address they can reach (a view cannot lie past that)
    end = ((n_kv_heads - 1) * head_stride + seq * head_dim) * info.dtype.itemsize
    if ptr + end >= 2**63:
        raise ValueError(
            f"{name}: KV heads {head_stride} elements apart end {end} bytes past its start, "
            f"beyond the 64-bit offsets the kernels compute (strides {strides})"
        )
    return info, seq, head_stride


def check_head_major_args(
    q: Any,
    k: Any,
    v: Any,
    n_heads: Any,
    n_kv_heads: Any,
    head_dim: Any,
    *,
    allow_device: bool = True,
    names: tuple[str, str, str] = ("q", "k_cache", "v_cache"),
) -> tuple[DecodeSpec, int]:
    """``check_decode_args`` for head-major K and V (``head_major_rows``): the spec, and
    the elements from one KV head's rows to the next's, which K and V share."""
    q_name, k_name, v_name = names
    qi = array_info(q, q_name, allow_device=allow_device)
    n_heads, n_kv_heads, head_dim = read_dims(
        qi.shape, _shape(k, k_name, allow_device), n_heads, n_kv_heads, head_dim,
        layout="HND", names=(q_name, k_name),
        max_head_dim=MAX_HEAD_DIM if allow_device else REFERENCE_MAX_HEAD_DIM,
    )  # fmt: skip
    ki, seq_k, stride_k = head_major_rows(
        k, k_name, n_kv_heads, head_dim, allow_device=allow_device
    )
    vi, _, stride_v = head_major_rows(v, v_name, n_kv_heads, head_dim, allow_device=allow_device)
    if not qi.on_device == ki.on_device == vi.on_device:
        raise TypeError(
            "q, k_cache, v_cache: pass all three as numpy arrays or all three as device arrays"
        )
    if allow_device:
        dtype = _check_dtypes(qi, ki, vi)
    else:
        dtype = qi.dtype
        for info, name in zip((qi, ki, vi), names, strict=True):
            _check_float(info, name)
    check_q(qi, n_heads, head_dim, q_name)
    if ki.shape != vi.shape or stride_k != stride_v:
        raise ValueError(
            f"{v_name}: expected {k_name}'s shape {ki.shape} and head stride {stride_k}, got "
            f"{vi.shape} and {stride_v}"
        )
    spec = DecodeSpec(n_heads, n_kv_heads, head_dim, seq_k, dtype, qi.shape, qi.on_device)
    return spec, stride_k


def _shape(obj: Any, name: str, allow_device: bool) -> tuple[int, ...]:
    """The shape of a numpy or device array (TypeError naming ``name`` for anything else)."""
    if isinstance(obj, np.ndarray):
        return obj.shape
    if not allow_device:
        raise TypeError(f"{name}: expected a numpy array, got {type(obj).__name__}")
    from ..driver.interop import array_ref

    ref = array_ref(obj, name)
    assert ref is not None  # numpy arrays are handled above
    return tuple(ref[1])
