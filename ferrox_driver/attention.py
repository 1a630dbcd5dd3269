"""GQA decode: one query token attending over a KV cache, on the GPU."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .compiler import kernel_source
from .device import Device, resolve
from .launch import Kernel
from .memory import DeviceArray, as_device_array, empty, to_device
from .module_cache import ensure_module_loaded
from .validation import array_info, check_decode_args, dtype_name

__all__ = ["ALGORITHMS", "gqa_decode", "launch_decode"]

ALGORITHMS = ("auto", "parity")


def check_algorithm(algorithm: Any) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")
    return str(algorithm)


def check_out(out: Any, shape: tuple[int, ...], dtype: np.dtype, on_device: bool) -> DeviceArray:
    """Validate a caller-supplied output array."""
    if not on_device:
        raise TypeError("out: only accepted with device inputs; numpy inputs return a new array")
    info = array_info(out, "out")
    if not info.on_device:
        raise TypeError(f"out: expected a device array, got {type(out).__name__}")
    if info.dtype != dtype or math.prod(info.shape) != math.prod(shape):
        raise ValueError(
            f"out: expected {math.prod(shape)} elements of {dtype}, got shape "
            f"{info.shape} of {info.dtype}"
        )
    return as_device_array(out, "out")


def parity_kernel(dtype: np.dtype, device: Device | None = None) -> Kernel:
    """The seed-equivalent kernel (one warp per query head) for ``dtype``."""
    name = f"gqa_decode_{dtype_name(dtype)}"
    module = ensure_module_loaded(
        kernel_source("gqa_decode.cu"), "gqa_decode.cu", name, device=device
    )
    return module.get_function(name)


def launch_decode(
    q: DeviceArray,
    k: DeviceArray,
    v: DeviceArray,
    out: DeviceArray,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    seq_len: int,
    seq_len_dev: DeviceArray | None = None,
    stream: Any = None,
    algorithm: str = "auto",
) -> None:
    """Queue a decode on device arrays already validated (no checks, no host work).

    ``seq_len_dev``, when given, is an int32 device scalar the kernel reads instead of
    ``seq_len`` (which then only bounds the work the launch is sized for).
    """
    kernel = parity_kernel(q.dtype, q.device)
    kernel.launch(
        n_heads,
        32,
        (
            q,
            k,
            v,
            out,
            np.int32(n_heads),
            np.int32(n_kv_heads),
            np.int32(head_dim),
            np.int32(seq_len),
            seq_len_dev,
        ),
        stream=stream,
    )


def gqa_decode(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    stream: Any = None,
    algorithm: str = "auto",
    device: Device | None = None,
    out: Any = None,
) -> Any:
    """Attention of one query token over a KV cache, on the GPU (mirror of the seed's
    ``launch_gqa_decode``).

    Args:
        q: ``(n_heads*head_dim,)`` or ``(n_heads, head_dim)``.
        k_cache, v_cache: ``(seq_len*n_kv_heads*head_dim,)`` or
            ``(seq_len, n_kv_heads, head_dim)``, layout [token][kv_head][head_dim].
        n_heads, n_kv_heads, head_dim: attention shape; ``n_heads % n_kv_heads == 0``,
            ``1 <= head_dim <= 256``.
        stream: stream for the work (default: the legacy default stream).
        algorithm: ``"auto"`` (fastest) or ``"parity"`` (the seed's kernel, corrected).
        device: the device for numpy inputs (default: device 0).
        out: with device inputs, a device array of q's shape and dtype to write into
            (default: a new one).

    Returns:
        numpy inputs: a numpy array (copied back, complete). Device inputs (DeviceArray or
        any ``__cuda_array_interface__`` object, all three): a DeviceArray queued on
        ``stream`` with no host round trip. Shape and dtype are q's. seq_len 0 gives zeros.

    Raises:
        ValueError, TypeError: bad shapes, dtypes, layouts; raised before any device work.
    """
    spec = check_decode_args(q, k_cache, v_cache, n_heads, n_kv_heads, head_dim)
    algorithm = check_algorithm(algorithm)
    if not spec.on_device and spec.seq_len == 0:
        return np.zeros(spec.q_shape, spec.dtype)
    if spec.on_device:
        q_d = as_device_array(q, "q")
        k_d = as_device_array(k_cache, "k_cache")
        v_d = as_device_array(v_cache, "v_cache")
        dev = q_d.device
    else:
        dev = resolve(device)
        q_d = to_device(q, stream, device=dev)
        k_d = to_device(k_cache, stream, device=dev)
        v_d = to_device(v_cache, stream, device=dev)
    if out is None:
        out = empty(spec.q_shape, spec.dtype, device=dev)
    else:
        out = check_out(out, spec.q_shape, spec.dtype, spec.on_device)
    launch_decode(
        q_d,
        k_d,
        v_d,
        out,
        n_heads=spec.n_heads,
        n_kv_heads=spec.n_kv_heads,
        head_dim=spec.head_dim,
        seq_len=spec.seq_len,
        stream=stream,
        algorithm=algorithm,
    )
    if spec.on_device:
        return out
    return out.to_host(stream)
