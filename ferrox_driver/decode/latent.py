"""``mla_decode``: multi-head latent attention (DeepSeek V2/V3's MLA) decode over a latent
cache, on tensor cores (cuda_src/split_latent.cuh, planned by ``latent_plan``), and its
float64 reference.

The absorbed form: each query head's q is ``(q_nope W_UK, q_rope)``, 512 + 64 = 576 wide,
against one latent row per token, ``(c_kv, k_rope)``, 576 wide; the values are the latent
rows' first 512 columns, so the output is in the latent space (the caller applies W_UV).
Two launches: the latent kernel (chunks of the sequence x blocks of 16 or 32 query rows,
partials into a float32 workspace) and the verify rows' combine (the window's start, the
sinks, the LSE). Every argument is checked before any device work; the workspace is a
per-stream buffer of the plan's size, which depends on the cache's capacity, not on the
length, so a call with ``out`` (and ``lse``) given and a device length queues no
allocation and captures into a CUDA graph that serves every length.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from ..driver.calls import stream_sync_raw
from ..driver.device import Device, device_for, resolve
from ..driver.interop import array_ref, is_torch
from ..driver.memory import DeviceArray, empty, to_device, view_of
from ..driver.pool import stream_buffer
from ..driver.stream import stream_handle, stream_key, torch_stream
from ..errors import CudaError, FerroxError
from ..kernels import abi
from ..kernels.spec import LATENT_MAX_HEAD_DIM, kernel_dtype
from ..types import ArrayLike, DeviceArrayLike, DeviceLike, HostArrayLike, StreamLike
from . import plan as planner
from .features import check_features
from .latent_plan import LatentPlan, latent_plan
from .plan import COMBINE_THREADS
from .queries import check_query_count
from .reference import reference_gqa_decode
from .verify import per_head_operand

__all__ = ["MLA_MAX_HEADS", "MLA_MAX_QUERIES", "mla_decode", "reference_mla_decode"]

MLA_MAX_HEADS = 128  # query heads (DeepSeek V3's 128; any count up to it)
MLA_MAX_QUERIES = 16  # query tokens a call (multi-token prediction, speculative verify)
_Q_DTYPES = ("float16", "bfloat16")
# a latent cache's fp8 formats (uint8: e4m3's bytes, as a torch float8 tensor viewed)
_FP8_CACHE = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2", "uint8": "e4m3"}


def reference_mla_decode(
    q: HostArrayLike, ckv: HostArrayLike, *, head_dim_v: int = 512, kv_scale: float = 1.0,
    scale: float | None = None, sliding_window: int | None = None,
    logits_soft_cap: float | None = None, sinks: HostArrayLike | None = None,
    return_lse: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """`mla_decode` in float64 on the CPU: `reference_gqa_decode` of one latent KV head
    whose first ``head_dim_v`` columns are the values (an fp8 cache's values times
    ``kv_scale``).

    Args:
        q: ``(n_heads, head_dim)`` or ``(n_q, n_heads, head_dim)``.
        ckv: ``(seq_len, head_dim)``, any float dtype (uint8: float8_e4m3fn's bytes).
        head_dim_v: the values' width.
        kv_scale: an fp8 cache's scale (its values are ``byte * kv_scale``).
        scale: the score scale (default ``1/sqrt(head_dim)``).
        sliding_window: attend to the last ``sliding_window`` tokens (each query's own).
        logits_soft_cap: scores become ``cap * tanh(score / cap)``.
        sinks: one logit per query head in the softmax's denominator.
        return_lse: also return the log-sum-exp per row.

    Returns:
        float64 ``(n_heads, head_dim_v)`` or ``(n_q, n_heads, head_dim_v)``; with
            ``return_lse``, ``(out, lse)``.
    """
    c = np.asarray(ckv)
    if c.dtype == np.uint8:
        import ml_dtypes

        c = c.view(ml_dtypes.float8_e4m3fn)
    rows = c.astype(np.float64) * float(kv_scale)
    return reference_gqa_decode(
        q, rows.reshape(rows.shape[0], 1, -1), None, head_dim_v=head_dim_v, scale=scale,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
        return_lse=return_lse,
    )  # fmt: skip


def _shape_dtype(obj: Any, ref: Any, name: str) -> tuple[tuple[int, ...], np.dtype]:
    if ref is not None:
        return tuple(ref[1]), np.dtype(ref[2])
    if not isinstance(obj, np.ndarray):
        raise TypeError(f"{name}: expected a numpy or device array, got {type(obj).__name__}")
    return obj.shape, obj.dtype


def _check_length(seq_len: Any, capacity: int) -> tuple[int, Any]:
    """The host length (the capacity for a device length) and the device length's array
    (None on the host)."""
    if seq_len is None:
        return capacity, None
    if isinstance(seq_len, (int, np.integer)) and not isinstance(seq_len, bool):
        if not 0 <= seq_len <= capacity:
            raise ValueError(f"seq_len: expected 0..{capacity} (ckv's rows), got {seq_len}")
        return int(seq_len), None
    ref = array_ref(seq_len, "seq_len") if not isinstance(seq_len, (bool, float)) else None
    if ref is None or tuple(ref[1]) not in ((), (1,)) or np.dtype(ref[2]) != np.int32:
        raise TypeError("seq_len: expected None, an int, or a one-element int32 device array "
                        "(a length read on the device)")  # fmt: skip
    return capacity, ref


def mla_decode(
    q: ArrayLike,
    ckv: ArrayLike,
    seq_len: int | DeviceArrayLike | None = None,
    *,
    head_dim_v: int = 512,
    out: DeviceArrayLike = None,
    lse: DeviceArrayLike = None,
    return_lse: bool = False,
    scale: float | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: ArrayLike = None,
    kv_scale: float | DeviceArrayLike | None = None,
    stream: StreamLike = None,
    device: DeviceLike = None,
) -> np.ndarray | DeviceArray | tuple[np.ndarray | DeviceArray, np.ndarray | DeviceArray]:
    """Multi-head latent attention of one query token (or of n_q) over a latent cache, on
    tensor cores: every query head reads the one latent row of each token.

    Args:
        q: ``(n_heads, head_dim)`` or ``(n_q, n_heads, head_dim)``: the absorbed queries
            (q_nope W_UK, then the rope part), float16 or bfloat16; n_heads 1 to 128,
            n_q 1 to 16. With n_q queries, query t is the cache's token ``seq_len - n_q +
            t`` and sees the tokens up to it (causal).
        ckv: the latent cache ``(capacity, head_dim)``, head_dim a multiple of 64 up to 576
            (DeepSeek: 512 latent + 64 rope), of q's dtype or fp8 (``float8_e4m3fn``,
            ``float8_e5m2``, or uint8 holding e4m3 bytes). Its first ``head_dim_v``
            columns are the values.
        seq_len: the tokens to attend to: None (all of ``ckv``), an int up to its rows, or
            a one-element int32 device array read on the device (a captured graph serves
            every length; the plan is made for the capacity).
        head_dim_v: the values' width, a multiple of 128 up to head_dim (default 512).
        out: a device array ``(n_heads, head_dim_v)`` / ``(n_q, n_heads, head_dim_v)`` of
            q's dtype to write (device inputs only; default: a new one).
        lse: a float32 device array ``(n_heads,)`` / ``(n_q, n_heads)`` for the LSE
            (implies ``return_lse``).
        return_lse: also return the log-sum-exp of the scores per row (natural log).
        scale: the score scale (default ``1/sqrt(head_dim)``; DeepSeek uses
            ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`` times its mscale).
        sliding_window: attend to the last ``sliding_window`` tokens (each query's own).
        logits_soft_cap: scores become ``cap * tanh(score / cap)``.
        sinks: one float32 logit per query head in the softmax's denominator.
        kv_scale: an fp8 cache's scale (values are ``byte * kv_scale``): a positive float
            or a one-element float32 device array (default 1.0); refused for a 16-bit cache.
        stream: where the work runs (as `gqa_decode`'s).
        device: the device for numpy inputs.

    Returns:
        The output, of q's dtype (numpy for numpy inputs, else a DeviceArray queued on
            ``stream``), with the LSE ``(out, lse)`` where asked. seq_len 0 gives zeros
            (and an LSE of -inf, or the sink's logit).

    Raises:
        ValueError, TypeError: naming the argument, before any device work.
    """
    qref, cref = array_ref(q, "q"), array_ref(ckv, "ckv")
    q_shape, q_dtype = _shape_dtype(q, qref, "q")
    c_shape, c_dtype = _shape_dtype(ckv, cref, "ckv")
    if (qref is None) != (cref is None):
        raise ValueError("q, ckv: pass both on the device or both on the host")
    on_device = qref is not None
    if q_dtype.name not in _Q_DTYPES:
        raise TypeError(f"q: expected float16 or bfloat16, got {q_dtype}")
    if len(q_shape) not in (2, 3) or 0 in q_shape:
        raise ValueError(f"q: expected (n_heads, head_dim) or (n_q, n_heads, head_dim), got "
                         f"{q_shape}")  # fmt: skip
    n_q = q_shape[0] if len(q_shape) == 3 else 1
    n_heads, head_dim = q_shape[-2], q_shape[-1]
    if not (head_dim % 64 == 0 and head_dim <= LATENT_MAX_HEAD_DIM):
        raise ValueError(f"q: head_dim (its last axis) a multiple of 64 up to "
                         f"{LATENT_MAX_HEAD_DIM}, got {head_dim}")  # fmt: skip
    if n_heads > MLA_MAX_HEADS:
        raise ValueError(f"q: up to {MLA_MAX_HEADS} query heads, got {n_heads}")
    if n_q > MLA_MAX_QUERIES:
        raise ValueError(f"q: up to {MLA_MAX_QUERIES} query tokens, got {n_q}")
    if len(c_shape) != 2 or c_shape[1] != head_dim:
        raise ValueError(f"ckv: expected (capacity, {head_dim}) (q's head_dim), got {c_shape}")
    fp8 = "" if c_dtype == q_dtype else _FP8_CACHE.get(c_dtype.name)
    if fp8 is None:
        raise TypeError(f"ckv: expected q's dtype {q_dtype} or fp8 (float8_e4m3fn, "
                        f"float8_e5m2, uint8 e4m3 bytes), got {c_dtype}")  # fmt: skip
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, (int, np.integer)):
        raise TypeError(f"head_dim_v: expected an int, got {head_dim_v!r}")
    if not (0 < head_dim_v <= head_dim and head_dim_v % 128 == 0):
        raise ValueError(f"head_dim_v: a multiple of 128 up to head_dim {head_dim}, got "
                         f"{head_dim_v}")  # fmt: skip
    host_seq, len_ref = _check_length(seq_len, c_shape[0])
    if len_ref is not None and not on_device:
        raise ValueError("seq_len: a device length takes device arrays q and ckv")
    if len(q_shape) == 3 and len_ref is None:
        check_query_count(n_q, host_seq)
    feats = check_features(n_heads, sliding_window=sliding_window,
                           logits_soft_cap=logits_soft_cap, sinks=sinks, scale=scale,
                           return_lse=return_lse or lse is not None)  # fmt: skip
    scale_value, scale_ref = _check_kv_scale(kv_scale, fp8)
    out_shape = (*q_shape[:-1], head_dim_v)
    lse_shape = q_shape[:-1]
    if not on_device:
        for value, name in ((out, "out"), (lse, "lse"), (scale_ref, "kv_scale")):
            if value is not None:
                raise TypeError(f"{name}: only with device inputs; numpy inputs return new arrays")
        stream_key(stream)
        if host_seq == 0:
            zeros = np.zeros(out_shape, q_dtype)
            if not feats.return_lse:
                return zeros
            sink = (-np.inf if feats.sinks is None
                    else np.asarray(feats.sinks, np.float64).reshape(n_heads))  # fmt: skip
            return zeros, np.broadcast_to(sink, lse_shape).astype(np.float32)
        dev = resolve(device)
    else:
        assert qref is not None and cref is not None
        ordinal = qref[3]
        refs = [(cref, "ckv"), (len_ref, "seq_len"), (scale_ref, "kv_scale")]
        for ref, name in refs:
            if ref is not None and ref[3] != ordinal:
                raise ValueError(f"{name}: on another device than q")
        for ref, name in ((qref, "q"), (cref, "ckv")):
            if not ref[4]:
                raise ValueError(f"{name}: expected a C-contiguous array")
            if ref[0] % 16:
                raise ValueError(f"{name}: expected a 16-byte aligned array")
        if device is not None and resolve(device).ordinal != ordinal:
            raise ValueError(f"device: the arrays are on device {ordinal}")
        dev = device_for(ordinal)
        if stream is None and is_torch(q):
            stream = torch_stream(ordinal)
    out_ref = _check_out(out, "out", out_shape, q_dtype, on_device, qref)
    lse_ref = _check_out(lse, "lse", lse_shape, np.dtype(np.float32), on_device, qref)
    sid = stream_key(stream)

    # planned for the capacity (one plan and one workspace for every length of a cache)
    window = feats.sliding_window
    plan_seq = c_shape[0] if window is None else min(c_shape[0], window + n_q - 1)
    bits, _ = abi.feature_args(feats, head_dim)
    found = _plan(dev, kernel_dtype(q_dtype), fp8, n_q, n_heads, head_dim, head_dim_v,
                  max(plan_seq, 1), bits)  # fmt: skip
    made: list[DeviceArray] = []
    try:
        if on_device:
            assert qref is not None and cref is not None
            q_d, c_d = view_of(qref, q, "q"), view_of(cref, ckv, "ckv")
            out_d = view_of(out_ref, out, "out") if out_ref is not None else None
        else:
            q_d = to_device(np.ascontiguousarray(q), stream, device=dev)
            c_d = to_device(np.ascontiguousarray(ckv), stream, device=dev)
            made += [q_d, c_d]
            out_d = None
        if out_d is None:
            out_d = empty(out_shape, q_dtype, device=dev)
            if not on_device:
                made.append(out_d)
        lse_d = None
        if feats.return_lse:
            lse_d = view_of(lse_ref, lse, "lse") if lse_ref is not None else None
            if lse_d is None:
                lse_d = empty(lse_shape, np.float32, device=dev)
                if not on_device:
                    made.append(lse_d)
        sinks_d = per_head_operand(feats.sinks, "sinks", dev, stream, made)
        len_d = view_of(len_ref, seq_len, "seq_len") if len_ref is not None else None
        scale_d = view_of(scale_ref, kv_scale, "kv_scale") if scale_ref is not None else None
        values = abi.FeatureArgs(feats.score_scale(head_dim), feats.logits_soft_cap or 1.0,
                                 window or 0, None, sinks_d, lse_d)  # fmt: skip
        rows = n_q * n_heads
        try:
            workspace = stream_buffer(dev, sid, "latent_workspace", found.workspace_floats(rows))
        except CudaError as exc:
            if exc.name == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED":
                raise FerroxError("mla_decode: its workspace is made on a first call outside "
                                  "the capture (make one eager call first)") from exc  # fmt: skip
            raise
        for launch in latent_launches(found, q_d, c_d, out_d, workspace, n_q=n_q,
                                      n_heads=n_heads, seq_len=host_seq, seq_len_dev=len_d,
                                      features=values, kv_scale=scale_value,
                                      kv_scale_dev=scale_d):  # fmt: skip
            launch.run(stream, dev)
        if on_device:  # (the caller's own objects where given: a torch tensor stays one)
            got = out if out is not None else out_d
            if lse_d is None:
                return got
            return got, (lse if lse is not None else lse_d)
        host = out_d.to_host(stream)
        return (host, lse_d.to_host(stream)) if lse_d is not None else host
    except BaseException:
        with contextlib.suppress(Exception):
            stream_sync_raw(stream_handle(stream))
        raise
    finally:
        for a in made:
            a.close()


def _check_kv_scale(kv_scale: Any, fp8: str) -> tuple[float, Any]:
    """An fp8 cache's scale: (a value passed to the kernel, a device array's ref or None)."""
    if kv_scale is None:
        return 1.0, None
    if not fp8:
        raise ValueError("kv_scale: only for an fp8 cache (ckv is of q's dtype)")
    if isinstance(kv_scale, (int, float, np.integer, np.floating)) and not isinstance(
        kv_scale, bool
    ):
        value = float(kv_scale)
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"kv_scale: expected a positive finite number, got {kv_scale!r}")
        return value, None
    ref = array_ref(kv_scale, "kv_scale") if not isinstance(kv_scale, bool) else None
    if ref is None or tuple(ref[1]) not in ((), (1,)) or np.dtype(ref[2]) != np.float32:
        raise TypeError("kv_scale: expected a positive float or a one-element float32 device "
                        "array")  # fmt: skip
    return 1.0, ref


def _check_out(
    value: Any, name: str, shape: tuple[int, ...], dtype: np.dtype, on_device: bool, qref: Any
) -> Any:
    if value is None:
        return None
    ref = array_ref(value, name)
    if ref is None or not on_device:
        raise TypeError(f"{name}: only with device inputs; numpy inputs return new arrays")
    if tuple(ref[1]) != shape or np.dtype(ref[2]) != dtype or not ref[4]:
        raise ValueError(f"{name}: expected a C-contiguous device array {shape} of {dtype}, "
                         f"got {tuple(ref[1])} of {np.dtype(ref[2])}")  # fmt: skip
    if ref[3] != qref[3]:
        raise ValueError(f"{name}: on another device than q")
    return ref


_plans: dict[tuple[Any, ...], LatentPlan] = {}


def _plan(
    dev: Device, dtype: str, fp8: str, n_q: int, n_heads: int, head_dim: int, head_dim_v: int,
    plan_seq: int, bits: int, n_kv_heads: int = 1, own_v: bool = False,
) -> LatentPlan:  # fmt: skip
    """`latent_plan` for ``dev``, memoised (planning is pure; the kernels load on first use)."""
    key = (dev.context_handle, dtype, fp8, n_q, n_heads, head_dim, head_dim_v, plan_seq, bits,
           n_kv_heads, own_v, planner.OVERRIDES.latent_wgmma,
           planner.OVERRIDES.latent_wg_min_chunk)  # fmt: skip
    found = _plans.get(key)
    if found is None:
        if len(_plans) >= 1024:
            _plans.clear()
        found = _plans[key] = latent_plan(
            dtype, fp8, n_q, n_heads, n_kv_heads, head_dim, head_dim_v, plan_seq, bits,
            multiprocessor_count=dev.multiprocessor_count,
            shared_per_block=dev.max_shared_per_block_optin,
            compute_capability=dev.compute_capability, own_v=own_v,
            wgmma=planner.OVERRIDES.latent_wgmma,
            wg_min_chunk=planner.OVERRIDES.latent_wg_min_chunk,
        )  # fmt: skip
    return found


def latent_launches(
    plan: LatentPlan, q: DeviceArray, ckv: DeviceArray, out: DeviceArray,
    workspace: DeviceArray, *, n_q: int, n_heads: int, seq_len: int,
    seq_len_dev: DeviceArray | None, features: abi.FeatureArgs, kv_scale: float = 1.0,
    kv_scale_dev: DeviceArray | None = None, v: DeviceArray | None = None,
    n_kv_heads: int = 1, strides: tuple[int, int, int, int] | None = None,
    v_scale_dev: DeviceArray | None = None, head_major: bool = False,
) -> list[abi.Launch]:  # fmt: skip
    """The two launches of an MLA decode: the latent kernel of ``plan`` (its partials into
    ``workspace``, ``plan.workspace_floats``), then the verify rows' combine into ``out``
    with the sinks and the LSE (``features``), launched early.

    A value cache of its own (``plan.spec.own_v``, decode/values.py) comes as ``v``, with
    ``n_kv_heads`` KV heads and ``strides``, in elements: (K's token rows, V's token rows,
    K's heads, V's heads) apart; by default one latent head of contiguous rows, ``ckv``.
    An fp8 cache's scales: ``kv_scale_dev`` (per KV head; K's and V's alike unless
    ``v_scale_dev`` gives V's), else ``kv_scale``. The launches' roles name q, k, v, out,
    the host length, the sinks, the LSE and (``head_major``: the heads' stride is the
    call's head-major stride) the heads' strides, for a launch record to rewrite."""
    spec = plan.spec
    dk, dv = spec.head_dim, spec.head_dim_v
    k_row, v_row, k_head, v_head = strides if strides is not None else (dk, dk, 0, 0)
    rows = n_q * n_heads
    n_partial = rows * plan.splits
    ws_ml = workspace.view((n_partial * 2,), np.float32, offset=n_partial * dv * 4)
    splits, tile = np.int32(plan.splits), np.int32(plan.tile)
    args = (
        q, ckv, ckv if v is None else v, workspace, ws_ml, np.int32(n_heads),
        np.int32(n_kv_heads), np.int32(n_q), np.int32(seq_len), seq_len_dev, splits, tile,
        np.int64(k_row), np.int64(v_row), np.int64(k_head), np.int64(v_head),
        np.float32(features.scale), np.float32(features.cap),
        np.int32(features.window), kv_scale_dev,
        kv_scale_dev if v_scale_dev is None else v_scale_dev, np.float32(kv_scale),
    )  # fmt: skip
    on_host = seq_len_dev is None
    roles: abi.Roles = (*abi.QKV, *(((8, "seq"),) if on_host else ()),
                        *(((14, "heads"), (15, "heads")) if head_major else ()))  # fmt: skip
    combine_roles: abi.Roles = (
        (0, "out"), *(((4, "seq"),) if on_host else ()), (11, "sinks"), (12, "lse"),
    )  # fmt: skip
    combine_args = (
        out, workspace, ws_ml, np.int32(dv), np.int32(seq_len), seq_len_dev, splits, tile,
        np.int32(n_heads), np.int32(n_q), np.int32(features.window), features.sinks,
        features.lse,
    )  # fmt: skip
    return [
        abi.Launch(spec, plan.grid(n_kv_heads), plan.threads, args, plan.shared_bytes,
                   roles=roles),
        abi.Launch(plan.combine_spec(), (rows, -(-dv // 32), 1), COMBINE_THREADS, combine_args,
                   early=planner.OVERRIDES.early_combine, roles=combine_roles),
    ]  # fmt: skip
