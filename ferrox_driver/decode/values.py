"""``gqa_decode(..., head_dim_v=...)``: values of a width of their own (issue 50), on the
latent kernels (cuda_src/split_latent.cuh with V rows of their own, ``_sv``).

Those kernels already take what such a cache needs: K rows of DK and V rows of DV, KV heads
read by groups of query heads, K's and V's token rows and heads any distance apart (a view
of a larger cache, head-major or token-major). So this module only checks the arguments
(all of them, before any device work), plans through ``latent_plan`` and launches through
``latent_launches`` with V's pointer and the four strides. It refuses what those kernels
cannot do rather than compute it some other way: a float32 q (the kernels are fp16/bf16
tensor-core ones), ALiBi and tree masks (not in the kernel), widths off their tiles.

A plan is made for the length rounded up to a power of two (at least LATENT_MIN_CHUNK), so a
cache growing by a token per call meets a handful of plans, not one per length; the chunks
themselves are cut from the actual length on the device. A length on the device (``seq_len``
an int32 device scalar, as `mla_decode` and the pair decodes take it) is planned for K's and
V's token count, its bound, so one captured graph serves every length up to it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from ..driver.calls import stream_sync_raw
from ..driver.device import device_for, ordinal_of, resolve
from ..driver.interop import array_ref, is_torch
from ..driver.memory import DeviceArray, empty, to_device, view_of
from ..driver.pool import stream_buffer
from ..driver.stream import stream_handle, stream_key, torch_stream
from ..errors import CudaError, FerroxError
from ..kernels import abi
from ..kernels.spec import LATENT_MAX_HEAD_DIM, kernel_dtype
from .checks import _element_strides, check_kv_layout
from .features import check_features
from .latent import _check_out, _plan, _shape_dtype, latent_launches
from .latent_plan import LATENT_MIN_CHUNK
from .plan import check_algorithm
from .queries import check_query_count
from .verify import per_head_operand

__all__ = [
    "VALUES_MAX_HEAD_DIM_V",
    "VALUES_MAX_QUERIES",
    "plan_length",
    "takes_own_width",
    "value_strides",
    "values_decode",
]

VALUES_MAX_HEAD_DIM_V = 512  # the latent kernel's V rows of their own (KernelSpec own_v)
VALUES_MAX_QUERIES = 16  # query tokens a call (as mla_decode: the n_q its tests cover)
_MAX_ROW_BLOCKS = 65535  # the kernel's grid.y: KV heads x blocks of query rows
_Q_DTYPES = ("float16", "bfloat16")


def _check_width(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {value!r}")
    return int(value)


def takes_own_width(q: Any, head_dim: Any, head_dim_v: Any) -> bool:
    """Whether a `gqa_decode` given ``head_dim_v`` has values of another width than K's
    (``head_dim``, else q's last axis) and so is `values_decode`'s; a bad ``head_dim_v``
    is too (it names it)."""
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, (int, np.integer)):
        return True
    width = head_dim
    if width is None:
        ref = array_ref(q, "q")
        shape = tuple(getattr(q, "shape", ())) if ref is None else tuple(ref[1])
        width = shape[-1] if shape else None
    return bool(width != head_dim_v)


def _check_length(seq_len: Any, tokens: int) -> tuple[int, Any]:
    """The host length (K's ``tokens``, the bound, for a device length) and the device
    length's ref (None on the host). (latent.py's for ``ckv``, in K's words.)"""
    if seq_len is None:
        return tokens, None
    if isinstance(seq_len, (int, np.integer)) and not isinstance(seq_len, bool):
        if not 0 <= seq_len <= tokens:
            raise ValueError(f"seq_len: expected 0..{tokens} (k_cache's tokens), got {seq_len}")
        return int(seq_len), None
    ref = array_ref(seq_len, "seq_len") if not isinstance(seq_len, (bool, float)) else None
    if ref is None or tuple(ref[1]) not in ((), (1,)) or np.dtype(ref[2]) != np.int32:
        raise TypeError("seq_len: expected None, an int, or a one-element int32 device array "
                        "(a length read on the device)")  # fmt: skip
    return tokens, ref


def plan_length(tokens: int, window: int | None, n_q: int) -> int:
    """The length a decode of up to ``tokens`` tokens is planned for: the tokens it can
    read (at most the window's, each query's own), at least LATENT_MIN_CHUNK, rounded up
    to a power of two (a growing cache meets a handful of plans)."""
    bound = max(tokens if window is None else min(tokens, window + n_q - 1), LATENT_MIN_CHUNK)
    return 1 << (bound - 1).bit_length()


def _kv_shape(
    shape: tuple[int, ...], layout: str, name: str, width: int, what: str
) -> tuple[int, int]:
    """(seq_len, n_kv_heads) of a K or V array of rows ``width`` wide in ``layout``."""
    if layout == "NHD":
        ok, seq, n_kv = len(shape) == 3, 0, 0
        if ok:
            seq, n_kv = shape[0], shape[1]
        expected = f"(seq_len, n_kv_heads, {width})"
    else:
        ok = len(shape) == 3 or (len(shape) == 4 and shape[0] == 1)
        seq = shape[-2] if ok else 0
        n_kv = shape[-3] if ok else 0
        expected = f"(n_kv_heads, seq_len, {width}) or (1, n_kv_heads, seq_len, {width})"
    if not ok or shape[-1] != width:
        raise ValueError(f"{name}: expected a {layout} array {expected} ({what}), got {shape}")
    if n_kv < 1:
        raise ValueError(f"{name}: expected at least one KV head, got {shape}")
    return seq, n_kv


def value_strides(
    obj: Any, shape: tuple[int, ...], layout: str, width: int, itemsize: int, ptr: int,
    contiguous: bool, name: str,
) -> tuple[int, int]:  # fmt: skip
    """(token rows apart, KV heads apart), in elements, of a K or V device array whose rows
    are contiguous: a whole array's, or a view's (``cache[:n]``, ``cache[:, :, :n]``, a
    ``torch.split`` of wider rows) read through its strides. Every row must start on a
    16-byte boundary (the kernel copies rows in 16-byte pieces).

    Raises:
        ValueError: naming ``name``: rows not contiguous, or off 16-byte boundaries.
    """
    seq, n_kv = shape[-2], shape[-3]
    if layout == "NHD":
        seq, n_kv = shape[0], shape[1]
    canon = (n_kv * width, width) if layout == "NHD" else (width, seq * width)
    if contiguous:
        row, head = canon
    else:
        strides = _element_strides(obj, itemsize)
        if strides is None or strides[-1] != 1:
            raise ValueError(f"{name}: each token's row of {width} must be contiguous, got "
                             f"strides {strides} (elements) for shape {shape}")  # fmt: skip
        if layout == "NHD":
            row, head = strides[0], strides[1]
        else:
            row, head = strides[-2], strides[-3]
        row = row if seq > 1 else canon[0]  # (a stride of one row or head is never used)
        head = head if n_kv > 1 else canon[1]
        if row < width or head < 0:
            raise ValueError(f"{name}: token rows {row} elements apart (strides {strides}) "
                             f"overlap rows of {width}, or run backwards")  # fmt: skip
    if ptr % 16 or (row * itemsize) % 16 or (head * itemsize) % 16:
        raise ValueError(
            f"{name}: every row must start on a 16-byte boundary: got a pointer {ptr % 16} "
            f"bytes past one, rows {row} and heads {head} elements of {itemsize} bytes apart "
            f"(copy it contiguous)"
        )
    return row, head


def values_decode(
    q: Any, k_cache: Any, v_cache: Any, head_dim_v: Any, *, n_heads: Any = None,
    n_kv_heads: Any = None, head_dim: Any = None, stream: Any = None, algorithm: Any = "auto",
    device: Any = None, out: Any = None, sliding_window: Any = None,
    logits_soft_cap: Any = None, sinks: Any = None, alibi_slopes: Any = None,
    scale: Any = None, return_lse: Any = False, kv_layout: Any = "NHD", tree_mask: Any = None,
    seq_len: Any = None, lse: Any = None,
) -> Any:  # fmt: skip
    """`gqa_decode` with values ``head_dim_v`` wide (differing from K's head_dim), on the
    latent kernels: the arguments as gqa_decode's, but for these, and the length apart.

    Args:
        q: ``(n_heads, head_dim)`` or ``(n_q, n_heads, head_dim)`` (n_q 1 to 16, the
            cache's last n_q tokens, causal), float16 or bfloat16; head_dim a multiple of
            64 up to 576.
        k_cache: ``(seq_len, n_kv_heads, head_dim)`` (NHD) or, with ``kv_layout="HND"``,
            ``(n_kv_heads, seq_len, head_dim)`` / ``(1, n_kv_heads, seq_len, head_dim)``,
            of q's dtype. A device array's rows contiguous, its tokens and heads any
            distance apart where every row starts 16-byte aligned.
        v_cache: like ``k_cache`` with rows ``head_dim_v`` wide.
        head_dim_v: the values' width, a multiple of 128 up to 512.
        out: a C-contiguous device array ``q.shape[:-1] + (head_dim_v,)`` of q's dtype.
        seq_len: the tokens to attend to: None (all of K's and V's), an int up to their
            tokens, or a one-element int32 device array read on the device (device inputs;
            planned for K's and V's tokens, so a captured graph serves every length up to
            them; it must stay within them: the kernels read it, nothing checks it). Rows
            past the length are never read.
        lse: a C-contiguous float32 device array ``q.shape[:-1]`` for the LSE (implies
            ``return_lse``; device inputs only), so a captured call writes the caller's.

    Returns:
        The output ``q.shape[:-1] + (head_dim_v,)`` of q's dtype (numpy for numpy inputs,
            else queued on ``stream``); with ``return_lse``, ``(out, lse)``.

    Raises:
        ValueError, TypeError: naming the argument, before any device work.
    """
    dv = _check_width(head_dim_v, "head_dim_v")
    if tree_mask is not None:
        raise ValueError("tree_mask: not with head_dim_v (its kernels are causal only)")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: not with head_dim_v (its kernels have no ALiBi)")
    if check_algorithm(algorithm) == "parity":
        raise ValueError("algorithm: head_dim_v runs on the split kernels ('auto' or 'split')")
    layout = check_kv_layout(kv_layout)
    names = ("q", "k_cache", "v_cache")
    refs = [array_ref(a, n) for a, n in zip((q, k_cache, v_cache), names, strict=True)]
    (q_shape, q_dt), (k_shape, k_dt), (v_shape, v_dt) = (
        _shape_dtype(a, r, n) for a, r, n in zip((q, k_cache, v_cache), refs, names, strict=True)
    )
    on_device = refs[0] is not None
    if any((r is not None) != on_device for r in refs):
        raise TypeError("q, k_cache, v_cache: pass all three as numpy arrays or all three as "
                        "device arrays")  # fmt: skip
    if q_dt.name not in _Q_DTYPES:
        raise TypeError(f"q: head_dim_v (values of their own width) needs float16 or bfloat16 "
                        f"q (its kernels are fp16/bf16 tensor-core ones), got {q_dt}")  # fmt: skip
    for dt, name in ((k_dt, "k_cache"), (v_dt, "v_cache")):
        if dt != q_dt:
            raise TypeError(f"{name}: expected q's dtype {q_dt}, got {dt}")
    if len(q_shape) not in (2, 3) or 0 in q_shape:
        raise ValueError(f"q: expected (n_heads, head_dim) or (n_q, n_heads, head_dim) with "
                         f"head_dim_v, got {q_shape}")  # fmt: skip
    n_q = q_shape[0] if len(q_shape) == 3 else 1
    h, d = q_shape[-2], q_shape[-1]
    for given, got, name in ((n_heads, h, "n_heads"), (head_dim, d, "head_dim")):
        if given is not None and _check_width(given, name) != got:
            raise ValueError(f"{name}: {given} given, but q's shape {q_shape} says {got}")
    if not (d % 64 == 0 and d <= LATENT_MAX_HEAD_DIM):
        raise ValueError(f"head_dim: with head_dim_v, a multiple of 64 up to "
                         f"{LATENT_MAX_HEAD_DIM} (q's last axis), got {d}")  # fmt: skip
    if not (0 < dv <= VALUES_MAX_HEAD_DIM_V and dv % 128 == 0):
        raise ValueError(f"head_dim_v: a multiple of 128 up to {VALUES_MAX_HEAD_DIM_V}, got {dv}")
    if n_q > VALUES_MAX_QUERIES:
        raise ValueError(f"q: up to {VALUES_MAX_QUERIES} query tokens with head_dim_v, got {n_q}")
    seq, n_kv = _kv_shape(k_shape, layout, "k_cache", d, "q's head_dim")
    v_seq, v_kv = _kv_shape(v_shape, layout, "v_cache", dv, "head_dim_v")
    if (v_seq, v_kv) != (seq, n_kv):
        raise ValueError(f"v_cache: expected k_cache's {seq} tokens of {n_kv} KV heads, got "
                         f"{v_seq} of {v_kv}")  # fmt: skip
    if n_kv_heads is not None and _check_width(n_kv_heads, "n_kv_heads") != n_kv:
        raise ValueError(f"n_kv_heads: {n_kv_heads} given, but k_cache's shape {k_shape} says "
                         f"{n_kv}")  # fmt: skip
    if h % n_kv:
        raise ValueError(f"n_heads: {h} query heads are not groups of k_cache's {n_kv} KV heads")
    host_seq, len_ref = _check_length(seq_len, seq)
    if len_ref is not None and not on_device:
        raise ValueError("seq_len: a device length takes device arrays q, k_cache, v_cache")
    if len(q_shape) == 3:
        check_query_count(n_q, host_seq)
    rows_kv = n_q * (h // n_kv)
    if n_kv * -(-rows_kv // 16) > _MAX_ROW_BLOCKS:
        raise ValueError(f"n_kv_heads: {n_kv} KV heads of {rows_kv} query rows pass the "
                         f"kernel's {_MAX_ROW_BLOCKS} blocks of rows")  # fmt: skip
    feats = check_features(h, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                           sinks=sinks, scale=scale,
                           return_lse=return_lse or lse is not None)  # fmt: skip
    out_shape, lse_shape = (*q_shape[:-1], dv), q_shape[:-1]
    qref, kref, vref = refs
    lse_ref = _check_out(lse, "lse", lse_shape, np.dtype(np.float32), on_device, qref)
    if on_device:
        assert qref is not None and kref is not None and vref is not None
        ordinal = qref[3]
        if kref[3] != ordinal or vref[3] != ordinal:
            raise ValueError("q, k_cache, v_cache: pass all three on one device")
        if len_ref is not None and len_ref[3] != ordinal:
            raise ValueError("seq_len: on another device than q")
        if not qref[4] or qref[0] % 16:
            raise ValueError("q: expected a C-contiguous, 16-byte aligned array")
        k_row, k_head = value_strides(k_cache, k_shape, layout, d, q_dt.itemsize, kref[0],
                                      kref[4], "k_cache")  # fmt: skip
        v_row, v_head = value_strides(v_cache, v_shape, layout, dv, q_dt.itemsize, vref[0],
                                      vref[4], "v_cache")  # fmt: skip
        if device is not None and ordinal_of(device) != ordinal:
            raise ValueError(f"device: {device!r} given, but q is on device {ordinal}")
        dev = device_for(ordinal)
        if stream is None and is_torch(q):
            stream = torch_stream(ordinal)
    else:
        if out is not None:
            raise TypeError("out: only accepted with device inputs; numpy inputs return a new "
                            "array")  # fmt: skip
        stream_key(stream)
        (k_row, k_head), (v_row, v_head) = (
            (n_kv * w, w) if layout == "NHD" else (w, seq * w) for w in (d, dv)
        )
        if host_seq == 0:  # (nothing to read: no device needed)
            zeros = np.zeros(out_shape, q_dt)
            if not feats.return_lse:
                return zeros
            sink = (-np.inf if feats.sinks is None
                    else np.asarray(feats.sinks, np.float64).reshape(h))  # fmt: skip
            return zeros, np.broadcast_to(sink, lse_shape).astype(np.float32)
        dev = resolve(device)
    out_ref = _check_out(out, "out", out_shape, q_dt, on_device, qref)
    sid = stream_key(stream)

    window = feats.sliding_window
    plan_seq = plan_length(host_seq, window, n_q)  # (a device length's: K's tokens)
    bits, _ = abi.feature_args(feats, d)
    found = _plan(dev, kernel_dtype(q_dt), "", n_q, h, d, dv, plan_seq, bits, n_kv_heads=n_kv,
                  own_v=True)  # fmt: skip
    made: list[DeviceArray] = []
    try:
        if on_device:
            assert qref is not None and kref is not None and vref is not None
            wrap = DeviceArray._wrap
            q_d = wrap(qref[0], tuple(qref[1]), q_dt, dev, q)
            k_d = wrap(kref[0], tuple(k_shape), q_dt, dev, k_cache)
            v_d = wrap(vref[0], tuple(v_shape), q_dt, dev, v_cache)
            out_d = wrap(out_ref[0], out_shape, q_dt, dev, out) if out_ref is not None else None
        else:
            q_d, k_d, v_d = (to_device(np.ascontiguousarray(a), stream, device=dev)
                             for a in (q, k_cache, v_cache))  # fmt: skip
            made += [q_d, k_d, v_d]
            out_d = None
        if out_d is None:
            out_d = empty(out_shape, q_dt, device=dev)
            if not on_device:
                made.append(out_d)
        lse_d = None
        if lse_ref is not None:
            lse_d = view_of(lse_ref, lse, "lse")
        elif feats.return_lse:
            lse_d = empty(lse_shape, np.float32, device=dev)
            if not on_device:
                made.append(lse_d)
        len_d = view_of(len_ref, seq_len, "seq_len") if len_ref is not None else None
        sinks_d = per_head_operand(feats.sinks, "sinks", dev, stream, made)
        values = abi.FeatureArgs(feats.score_scale(d), feats.logits_soft_cap or 1.0,
                                 window or 0, None, sinks_d, lse_d)  # fmt: skip
        try:
            workspace = stream_buffer(dev, sid, "latent_workspace", found.workspace_floats(n_q * h))
        except CudaError as exc:
            if exc.name == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED":
                raise FerroxError(
                    "gqa_decode: head_dim_v's workspace is made on a first call outside the "
                    "capture (make one eager call first)"
                ) from exc
            raise
        for launch in latent_launches(found, q_d, k_d, out_d, workspace, n_q=n_q, n_heads=h,
                                      seq_len=host_seq, seq_len_dev=len_d, features=values, v=v_d,
                                      n_kv_heads=n_kv,
                                      strides=(k_row, v_row, k_head, v_head)):  # fmt: skip
            launch.run(stream, dev)
        if on_device:  # (the caller's own objects where given: a torch tensor stays one)
            result = out if out is not None else out_d
            return result if lse_d is None else (result, lse if lse is not None else lse_d)
        host = out_d.to_host(stream)
        return (host, lse_d.to_host(stream)) if lse_d is not None else host
    except BaseException:
        with contextlib.suppress(Exception):
            stream_sync_raw(stream_handle(stream))
        raise
    finally:
        for arr in made:
            arr.close()
