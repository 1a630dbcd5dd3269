"""fd.merge_states: the exact combine of attention over disjoint parts of one sequence,
on the host (numpy) or the device (one kernel, capturable)."""

from __future__ import annotations

import math
from typing import overload

import numpy as np

from ..driver.device import Device, device_for
from ..driver.interop import ArrayRef, array_ref
from ..driver.memory import DeviceArray, empty
from ..driver.stream import call_stream
from ..kernels.catalogue import get_kernel
from ..types import ArrayLike, DeviceArrayLike, HostArrayLike, StreamLike
from .checks import MAX_INT32, SUPPORTED_DTYPES, dtype_name
from .reference import merge_states_host

__all__ = ["merge_states"]

MERGE_THREADS = 128


@overload
def merge_states(
    outs: HostArrayLike, lses: HostArrayLike, *, stream: StreamLike = None,
    out: None = None, out_lse: None = None,
) -> tuple[np.ndarray, np.ndarray]: ...  # fmt: skip
@overload
def merge_states(
    outs: DeviceArrayLike, lses: DeviceArrayLike, *, stream: StreamLike = None,
    out: DeviceArrayLike = None, out_lse: DeviceArrayLike = None,
) -> tuple[DeviceArray, DeviceArray]: ...  # fmt: skip
def merge_states(
    outs: ArrayLike,
    lses: ArrayLike,
    *,
    stream: StreamLike = None,
    out: DeviceArrayLike = None,
    out_lse: DeviceArrayLike = None,
) -> tuple[np.ndarray, np.ndarray] | tuple[DeviceArray, DeviceArray]:
    """The exact combine of attention over disjoint parts of one sequence, from each part's
    output and log-sum-exp (``return_lse=True``): ``out = sum_p w_p out_p / sum_p w_p`` and
    ``lse = log(sum_p exp(lse_p))``, ``w_p = exp(lse_p)``. A part with ``lse = -inf`` (no
    tokens) contributes nothing; a head every part of which is empty gets zeros and -inf.

    Args:
        outs: ``(parts, n_heads, head_dim)`` (or ``(parts, n_heads * head_dim)``): numpy
            (any float) or a device array (float32, float16 or bfloat16).
        lses: ``(parts, n_heads)``, natural log: numpy, or a float32 device array.
        stream: the device form's stream (no host work: capturable; None: PyTorch's
            current stream for PyTorch tensors, else the legacy default stream).
        out: the device form's output, ``(n_heads, head_dim)`` elements of outs' dtype
            (default: a new device array).
        out_lse: the device form's LSE output, ``n_heads`` float32 (default: new).

    Returns:
        ``(out, lse)``: out ``(n_heads, head_dim)`` (or ``(n_heads * head_dim,)``) in
            outs' dtype and lse ``(n_heads,)``: numpy for numpy inputs (computed in
            float64, lse in lses' dtype), device arrays for device inputs (float32 math).

    Raises:
        ValueError, TypeError: naming the argument, before any device work.
    """
    oref, lref = array_ref(outs, "outs"), array_ref(lses, "lses")
    if oref is None and lref is None:
        if out is not None or out_lse is not None:
            raise TypeError("out, out_lse: only with device inputs")
        return merge_states_host(outs, lses)
    if oref is None or lref is None:
        raise TypeError("outs, lses: pass both as numpy arrays or both as device arrays")
    optr, oshape, odtype, ordinal, ocontig, _ = oref
    lptr, lshape, ldtype, lordinal, lcontig, _ = lref
    if odtype not in SUPPORTED_DTYPES:
        raise TypeError(f"outs: expected float32, float16 or bfloat16, got {odtype}")
    if ldtype != np.float32:
        raise TypeError(f"lses: expected float32, got {ldtype}")
    if len(lshape) != 2 or min(lshape) < 1 or not lcontig:
        raise ValueError(f"lses: expected contiguous (parts, n_heads), at least one of each, "
                         f"got {lshape}")  # fmt: skip
    parts, n_heads = lshape
    if (
        len(oshape) not in (2, 3) or not ocontig or oshape[0] != parts
        or (len(oshape) == 3 and oshape[1] != n_heads) or math.prod(oshape[1:]) % n_heads
    ):  # fmt: skip
        raise ValueError(f"outs: expected contiguous (parts, n_heads, head_dim) with parts = "
                         f"{parts}, n_heads = {n_heads} (lses), got {oshape}")  # fmt: skip
    if lordinal != ordinal:
        raise ValueError(f"lses: on device {lordinal}, but outs on device {ordinal}")
    stream = call_stream(stream, outs, ordinal)
    head_dim = math.prod(oshape[1:]) // n_heads
    if max(parts, n_heads, head_dim) > MAX_INT32:  # (the kernel's arguments are int32)
        raise ValueError(f"outs: {parts} parts, {n_heads} heads, head_dim {head_dim}: each "
                         f"at most {MAX_INT32}")  # fmt: skip
    out_ref = _output_ref(out, "out", (n_heads, head_dim), odtype, ordinal)
    lse_ref = _output_ref(out_lse, "out_lse", (n_heads,), np.dtype(np.float32), ordinal)
    dev = device_for(ordinal)
    result = _output(out, out_ref, (n_heads, head_dim), odtype, dev)
    result_lse = _output(out_lse, lse_ref, (n_heads,), np.dtype(np.float32), dev)
    kernel = get_kernel("merge_states.cu", f"merge_states_{dtype_name(odtype)}", dev)
    o_in = DeviceArray._wrap(optr, oshape, odtype, dev, outs)
    l_in = DeviceArray._wrap(lptr, lshape, ldtype, dev, lses)
    args = (o_in, l_in, result, result_lse, np.int32(parts), np.int32(n_heads),
            np.int32(head_dim))  # fmt: skip
    kernel.launch(n_heads, MERGE_THREADS, args, stream=stream)
    return result, result_lse


def _output_ref(
    obj: object, name: str, shape: tuple[int, ...], dtype: np.dtype, ordinal: int
) -> ArrayRef | None:
    """An output ``obj`` checked (before any device work), or None for a new one."""
    if obj is None:
        return None
    ref = array_ref(obj, name)
    if ref is None:
        raise TypeError(f"{name}: expected a device array, got {type(obj).__name__}")
    _, oshape, odtype, oordinal, contiguous, _ = ref
    if odtype != dtype or math.prod(oshape) != math.prod(shape) or not contiguous:
        raise ValueError(f"{name}: expected {math.prod(shape)} contiguous {dtype}, got shape "
                         f"{oshape} of {odtype}")  # fmt: skip
    if oordinal != ordinal:
        raise ValueError(f"{name}: on device {oordinal}, the inputs on device {ordinal}")
    return ref


def _output(
    obj: object, ref: ArrayRef | None, shape: tuple[int, ...], dtype: np.dtype, dev: Device
) -> DeviceArray:
    if ref is None:
        return empty(shape, dtype, device=dev)
    return DeviceArray._wrap(ref[0], shape, dtype, dev, obj)
