"""``gqa_decode`` of several query tokens at once (a speculative verify): q ``(n_q, n_heads,
head_dim)``, the cache's last n_q tokens, causal or under a tree mask
(`launches.verify_launches`, cuda_src/split_verify.cuh). Every argument is checked at every
call (the one-token checks on the first query, then the queries' count, the mask and
``out``); the launches are made per call from the plans remembered per device, on the
stream's workspace."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from ..driver.calls import stream_sync_raw
from ..driver.device import Device, device_for, resolve
from ..driver.interop import array_ref, is_torch
from ..driver.memory import DeviceArray, empty, to_device
from ..driver.pool import stream_buffer
from ..driver.stream import stream_handle, stream_key, torch_stream
from ..kernels import abi
from .checks import check_decode_args, check_head_major_args
from .features import check_features
from .plan import check_algorithm
from .queries import check_query_count, check_tree_mask, split_queries, tree_mask_packed
from .records import launches_for

__all__ = ["check_mask", "is_many_queries", "mask_operand", "per_head_operand", "verify_decode"]


def is_many_queries(shape: Any) -> bool:
    """Whether a q of ``shape`` is of the many-query form ``(n_q, n_heads, head_dim)`` (n_q
    1 included: one query, its result ``(1, n_heads, head_dim)``)."""
    return len(shape) == 3


def check_mask(tree_mask: Any, mref: Any, n_q: int) -> int:
    """The kernels' mask mode of a tree mask (``mref``: its ArrayRef, None on the host),
    checked: 1 a device mask of bytes, 2 of bits (a host mask: checked whole, then packed).

    Raises:
        TypeError, ValueError: naming ``tree_mask``.
    """
    if mref is None:
        check_tree_mask(tree_mask, n_q)
        return 2
    packed = tree_mask_packed(mref[1], mref[2], n_q)
    if not mref[4]:
        raise ValueError("tree_mask: expected a C-contiguous device array")
    return 2 if packed else 1


def mask_operand(
    tree_mask: Any, mref: Any, n_q: int, dev: Device, stream: Any, made: list[DeviceArray]
) -> DeviceArray | None:
    """The mask the kernels read: None (causal), a device mask as it is, or a host mask
    packed into bits and copied in (appended to ``made``, freed by the caller)."""
    if tree_mask is None:
        return None
    if mref is not None:
        return DeviceArray._wrap(mref[0], mref[1], mref[2], dev, tree_mask)
    bits = np.packbits(check_tree_mask(tree_mask, n_q), axis=1, bitorder="little")
    made.append(to_device(bits, stream, device=dev))
    return made[-1]


def per_head_operand(
    value: Any, name: str, dev: Device, stream: Any, made: list[DeviceArray]
) -> DeviceArray | None:
    """A per-head float32 feature on the device: a device array as given, a host one copied
    in (appended to ``made``)."""
    if value is None:
        return None
    ref = array_ref(value, name)
    if ref is not None:
        return DeviceArray._wrap(ref[0], ref[1], ref[2], dev, value)
    made.append(to_device(np.ascontiguousarray(value, np.float32), stream, device=dev))
    return made[-1]


def _token(q: Any, ref: Any, shape: tuple[int, ...], dev: Device | None) -> Any:
    """The first query token of q, for the one-token checks: a numpy slice, or a
    DeviceArray over the device array's first rows."""
    if isinstance(q, np.ndarray):
        return q[0]
    assert dev is not None
    return DeviceArray._wrap(ref[0], shape, ref[2], dev, None)


def verify_decode(
    q: Any, k_cache: Any, v_cache: Any, n_heads: Any, n_kv_heads: Any, head_dim: Any,
    stream: Any, algorithm: Any, device: Any, out: Any, kw: dict[str, Any], layout: str,
    tree_mask: Any,
) -> Any:  # fmt: skip
    """`gqa_decode` of q ``(n_q, n_heads, head_dim)`` (see there); ``kw``: the features."""
    qref = array_ref(q, "q")
    shape = tuple(q.shape) if qref is None else tuple(qref[1])
    n_q, token_shape = split_queries(shape)
    on_device = qref is not None
    dev: Device | None = device_for(qref[3]) if qref is not None else None
    q0 = _token(q, qref, token_shape, dev)
    if layout == "HND":
        spec, head_stride = check_head_major_args(q0, k_cache, v_cache, n_heads, n_kv_heads,
                                                  head_dim)  # fmt: skip
        if not spec.on_device:
            k_cache, v_cache = np.ascontiguousarray(k_cache), np.ascontiguousarray(v_cache)
            head_stride = spec.seq_len * spec.head_dim
    else:
        spec = check_decode_args(q0, k_cache, v_cache, n_heads, n_kv_heads, head_dim)
        head_stride = 0
    if spec.on_device != on_device:
        raise ValueError("q, k_cache, v_cache: pass all three on the device or all on the host")
    if token_shape != (spec.n_heads, spec.head_dim):
        raise ValueError(
            f"q: expected (n_q, n_heads, head_dim) = (n_q, {spec.n_heads}, {spec.head_dim}), "
            f"got {shape}"
        )
    check_query_count(n_q, spec.seq_len)
    feats = check_features(spec.n_heads, **kw)
    if check_algorithm(algorithm) == "parity":
        raise ValueError("algorithm: a decode of several queries needs the split kernels")
    mref = None if tree_mask is None else array_ref(tree_mask, "tree_mask")
    mask_mode = 0 if tree_mask is None else check_mask(tree_mask, mref, n_q)
    out_shape = (n_q, spec.n_heads, spec.head_dim)
    refs: list[Any] = []
    if on_device:
        assert qref is not None
        refs = [qref, array_ref(k_cache, "k_cache"), array_ref(v_cache, "v_cache")]
        ordinal = qref[3]
        if any(r is None or r[3] != ordinal for r in refs):
            raise ValueError("q, k_cache, v_cache: pass all three on one device")
        if not qref[4]:
            raise ValueError("q: expected a C-contiguous (n_q, n_heads, head_dim) array")
        if mref is not None and mref[3] != ordinal:
            raise ValueError("tree_mask: on another device than q")
        out_ref: Any = None
        if out is not None:
            out_ref = array_ref(out, "out")
            if out_ref is None or tuple(out_ref[1]) != out_shape or out_ref[2] != spec.dtype:
                raise ValueError(f"out: expected a device array of {out_shape} {spec.dtype}")
            if out_ref[3] != ordinal or not out_ref[4]:
                raise ValueError("out: expected a C-contiguous device array on q's device")
        if device is not None and resolve(device).ordinal != ordinal:
            raise ValueError(f"device: the arrays are on device {ordinal}")
        if stream is None and is_torch(q):
            stream = torch_stream(ordinal)
    elif out is not None:
        raise TypeError("out: only accepted with device inputs; numpy inputs return a new array")
    sid = stream_key(stream)
    dev = device_for(refs[0][3]) if on_device else resolve(device)
    made: list[DeviceArray] = []
    try:
        if on_device:
            q_d, k_d, v_d = (DeviceArray._wrap(r[0], r[1], r[2], dev, None) for r in refs if r)
            out_d = (
                empty(out_shape, spec.dtype, device=dev) if out_ref is None
                else DeviceArray._wrap(out_ref[0], out_shape, spec.dtype, dev, out)
            )  # fmt: skip
        else:
            q_d, k_d, v_d = (to_device(np.ascontiguousarray(a), stream, device=dev)
                             for a in (q, k_cache, v_cache))  # fmt: skip
            out_d = empty(out_shape, spec.dtype, device=dev)
            made += [q_d, k_d, v_d, out_d]
        mask_d = mask_operand(tree_mask, mref, n_q, dev, stream, made)
        lse_d = empty((n_q, spec.n_heads), np.float32, device=dev) if feats.return_lse else None
        if lse_d is not None and not on_device:
            made.append(lse_d)
        slopes = per_head_operand(feats.alibi_slopes, "alibi_slopes", dev, stream, made)
        sinks = per_head_operand(feats.sinks, "sinks", dev, stream, made)
        bits, values = abi.feature_args(feats, spec.head_dim, lse=lse_d, slopes=slopes,
                                        sinks=sinks)  # fmt: skip
        bits |= abi.F_HND if layout == "HND" else 0
        values = abi.FeatureArgs(values.scale, values.cap, values.window, slopes, sinks, lse_d,
                                 head_stride)  # fmt: skip
        seq = spec.seq_len
        plan_seq = seq if feats.sliding_window is None else min(seq, feats.sliding_window)
        aligned = ((q_d.ptr | k_d.ptr | v_d.ptr | head_stride * spec.dtype.itemsize) & 15) == 0
        launches, _ = launches_for(
            q_d, k_d, v_d, out_d, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads,
            head_dim=spec.head_dim, seq_len=seq, plan_seq=max(plan_seq, 1), aligned=aligned,
            bits=bits, features=values, n_q=n_q, mask=mask_d, mask_mode=mask_mode,
            workspace=lambda floats: stream_buffer(dev, sid, "workspace", floats),
        )  # fmt: skip
        for launch in launches:
            launch.run(stream, dev)
        if on_device:
            return (out_d, lse_d) if lse_d is not None else out_d
        host = out_d.to_host(stream)
        return (host, lse_d.to_host(stream)) if lse_d is not None else host
    except BaseException:
        with contextlib.suppress(Exception):
            stream_sync_raw(stream_handle(stream))
        raise
    finally:
        for a in made:
            a.close()
