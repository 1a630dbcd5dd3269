"""Launch records: a decode's plan, kernels, grids, packed arguments and scratch, made once
per signature and kept (LRU) in one store; a call writes the pointers that changed and
launches.

A record serves every length up to the one it was planned for: the kernels cut their chunks
from the length a call writes (the "seq" role), so an eager decode over a growing cache
plans once per length bucket (``length_bound``), not once per length, and packs a record
once per plan (the buckets of one plan share it).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from ..archs import FP8_FROM, TENSOR_CORES_FROM
from ..driver.device import Device
from ..driver.graph import keep_for_capture
from ..driver.launch import LaunchSequence
from ..driver.memory import DeviceArray
from ..driver.stream import Stream, stream_handle, stream_key
from ..kernels.abi import FeatureArgs, Launch
from ..kernels.spec import FOUR_BIT_FORMATS, FP8_FORMATS, kernel_dtype, kv_formats
from ..kernels.traits import F_ALIBI, F_HND
from . import plan as attention
from .checks import MAX_TOKENS
from .launches import (
    TAIL_FEATURES,
    allocate_scratch,
    parity_launches,
    plan_four_bit,
    plan_rows,
    plan_split,
    rows_launches,
    split_launches,
    verify_launches,
    verify_workspace_floats,
)
from .plan import SplitPlan

__all__ = [
    "FEATURE_ROLES",
    "MAX_RECORDS",
    "VERIFY_ROLES",
    "WIDE_TC_HEAD_DIMS",
    "ROLES",
    "DecodeRecord",
    "Kept",
    "assemble",
    "feature_record",
    "launches_for",
    "length_bound",
    "planned",
    "decode_record",
    "launch_decode",
    "lock",
    "store",
    "wide_launches",
]

ROLES = ("q", "k", "v", "out", "seq")
# a feature decode's record also takes, per call, its per-head arrays (ALiBi slopes, sinks),
# its LSE output and a head-major cache's head stride (elements from one KV head's rows to
# the next's, which changes with the length for a contiguous (n_kv_heads, seq_len, D) array)
FEATURE_ROLES = (*ROLES, "slopes", "sinks", "lse", "heads")
# ... and a verify's (n_q queries), its tree mask too
VERIFY_ROLES = (*FEATURE_ROLES, "mask")
SPLIT_BITS = TAIL_FEATURES  # a verify's split kernel: the features the tail has too
MAX_RECORDS = 256  # launch records kept (LRU); a record in use lives on while referenced


class Kept(OrderedDict[Any, Any]):
    """The one store of things made once per signature: launch records (the process's, and
    each cache's own) and validated calls (eager, pair, async). Reads are plain dict
    lookups on the hot path; ``keep`` adds and, past ``limit``, drops the least recently
    kept (an entry still in use lives on while referenced)."""

    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        self.limit = limit

    def keep(self, key: Any, value: Any) -> Any:
        """Store ``value`` under ``key`` and return it."""
        self[key] = value
        if self.limit is not None:
            while len(self) > self.limit:
                self.popitem(last=False)
        return value

    def touch(self, key: Any) -> None:
        """Mark ``key`` as recently used (another thread may have dropped it: no error)."""
        try:  # noqa: SIM105 (a hot path: try costs nothing when it holds, suppress does)
            self.move_to_end(key)
        except KeyError:
            pass


class DecodeRecord:
    """The launches of one decode signature, packed once; ``run(values)`` writes the
    call's values of ``roles`` (q, k, v, out, seq_len; a feature record's FEATURE_ROLES
    too) and launches (see ``LaunchSequence``).

    Args:
        launches: the decode's launches (``split_launches`` or ``parity_launches``).
        device: the device.
        stream: the stream they are packed for.
        workspace: the scratch they write (kept alive with the record).
        roles: the roles its calls write, in the order ``run`` takes them; a launch's
            other roles keep the values it was packed with.
    """

    def __init__(
        self,
        launches: list[Launch],
        device: Device,
        stream: Any,
        workspace: DeviceArray | None,
        roles: tuple[str, ...] = ROLES,
    ) -> None:
        self.sequence = LaunchSequence(
            [launch.packed(stream, device) for launch in launches],
            roles,
            [tuple(pair for pair in launch.roles if pair[1] in roles) for launch in launches],
            device,
        )
        self.run = self.sequence.run
        self.workspace = workspace
        self.kernels = tuple(launch.kernel for launch in launches)
        self.captured = False  # a graph made elsewhere may use it: never dropped


store = Kept(MAX_RECORDS)  # the process's launch records, by signature
lock = threading.RLock()  # making records and calls (the hot path only reads them)

# Length buckets: 8 tokens wide below 256, then 16 per octave (the 2^(k-4) lengths of a
# bucket of [2^k, 2^(k+1)) share a record), each planned for its last length
# (``length_bound``). The plan for that bound must be the one each of its lengths would
# get. A plan depends on the length through its chunk count, ceil(seq / tile) up to a cap
# (tiles are powers of two, 8 to 64 tokens), and through thresholds at powers of two (wide
# plans from 1024/2048/16384 tokens, paired from 16384/32768): buckets aligned to their
# power-of-two width never straddle a threshold, and where a bucket is at most a tile wide
# only a length that is a whole number of tiles plans one chunk more (an idle block: the
# chunks are cut from the length the call writes). Over 1..131072 with sm_90's traits: bf16
# 32/8/128 differs at 15 lengths (64, 128, ... 960); fp32 8/8/72 (CUDA cores, chunks up to
# 115) at 924 and fp32 8/1/128 (split TF32, up to 132 chunks) at 4352, a few chunks more
# below ~8k tokens; 8 buckets per octave: 1254 and 5864 (tests/decode/test_growing.py).
# Records up to 8192 tokens: 112 buckets; up to 131072: 176.
BUCKET_MIN_SHIFT = 3  # lengths below 256 in buckets of 8
BUCKET_OCTAVE_SHIFT = 5  # 2^(5-1) = 16 buckets per octave above


def length_bound(n: int) -> int:
    """The length a record serving ``n`` tokens is planned for: the last of ``n``'s bucket
    (``n`` itself where that bound would pass what the kernels count, MAX_TOKENS)."""
    bound = n | ((1 << max(BUCKET_MIN_SHIFT, n.bit_length() - BUCKET_OCTAVE_SHIFT)) - 1)
    return bound if bound <= MAX_TOKENS else n


def decode_record(
    q: DeviceArray,
    k: DeviceArray,
    v: DeviceArray,
    out: DeviceArray,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    seq_len: int,
    stream: Any,
    algorithm: str = "auto",
    plan_seq: int | None = None,
) -> DecodeRecord:
    """The launch record for decodes of this signature on ``stream`` (made on first use,
    kept in an LRU of MAX_RECORDS). The arrays only give the signature (device, dtype,
    alignment): their pointers are the call's to write, and so is the length: a record
    planned for ``plan_seq`` tokens (default ``seq_len``) serves every length up to it, and
    is the record of every ``plan_seq`` whose plan is the same (the buckets of a long cache
    mostly share one: the chunks are cut on the device)."""
    aligned = ((q.ptr | k.ptr | v.ptr) & 15) == 0
    sid = stream_key(stream)
    plan_for = seq_len if plan_seq is None else plan_seq
    dev = q.device
    # keyed by the plan, not the length: the buckets of one plan share a record
    by = plan_for if algorithm == "parity" else plan_split(
        dev, q.dtype, n_heads, n_kv_heads, head_dim, plan_for, aligned
    )  # fmt: skip
    key = (dev.context_handle, q.dtype, n_heads, n_kv_heads, head_dim, by, aligned, algorithm,
           sid, attention.OVERRIDES)  # fmt: skip
    return kept_record(key, lambda: assemble(
        q, k, v, out, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        seq_len=seq_len, plan_seq=plan_for, aligned=aligned, algorithm=algorithm,
        workspace=lambda floats: shared_scratch(floats, dev, sid), stream=stream_handle(sid),
    ))  # fmt: skip


def kept_record(key: Any, make: Callable[[], DecodeRecord]) -> DecodeRecord:
    """The record in ``store`` under ``key``, or the one ``make`` makes (under ``lock``,
    checked again there: another thread may have made it), kept."""
    record = store.get(key)
    if record is not None:
        store.touch(key)
        return record
    with lock:
        record = store.get(key)
        if record is None:
            record = store.keep(key, make())
    return record


# The scratch the eager records of one stream share, by (context, stream, size class): work
# on a stream is ordered, so its records never write their partials at once. Held by the
# records (and by a graph that captured one of them), dropped with the last of them.
_scratch: weakref.WeakValueDictionary[tuple[int, int, int], DeviceArray] = (
    weakref.WeakValueDictionary()
)
SCRATCH_CLASS_MIN = 1 << 14  # floats: the smallest class (64 KiB)


def shared_scratch(floats: int, dev: Device, sid: int) -> DeviceArray:
    """At least ``floats`` float32 of decode scratch for the records of stream ``sid``: one
    buffer per power-of-two size class, shared by the records of that class while any of
    them (or a graph holding one) lives, so a cache growing through many length buckets
    allocates once per class, not once per bucket.

    Raises:
        FerroxError: SCRATCH_IN_CAPTURE when it must allocate inside a stream capture.
    """
    size = max(SCRATCH_CLASS_MIN, 1 << (floats - 1).bit_length())
    key = (dev.context_handle, sid, size)
    buf = _scratch.get(key)
    if buf is None or buf.closed:
        buf = _scratch[key] = allocate_scratch(size, dev, SCRATCH_IN_CAPTURE)
    return buf


SCRATCH_IN_CAPTURE = (
    "stream: the first decode of this shape on this stream cannot allocate its "
    "scratch inside a capture: run it once before capturing (or use a KVCache "
    "with gqa_decode_async)"
)


def feature_record(
    q: DeviceArray,
    k: DeviceArray,
    v: DeviceArray,
    out: DeviceArray,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    plan_seq: int,
    aligned: bool,
    bits: int,
    values: FeatureArgs,
    stream: Any,
) -> DecodeRecord:
    """The launch record of a decode with features or a head-major cache (``bits``),
    planned for ``plan_seq`` tokens (made on first use, kept in ``store``; scratch shared with
    its stream's records, `shared_scratch`, as ``decode_record``'s). The scalars of
    ``values`` (scale, cap, window) are the record's; the per-head arrays, the LSE output
    and the head stride are roles its calls write (FEATURE_ROLES), with q, k, v, out and the
    length."""
    sid = stream_key(stream)
    dev = q.device
    plan = plan_split(dev, q.dtype, n_heads, n_kv_heads, head_dim, plan_seq, aligned, bits)
    key = ("features", dev.context_handle, q.dtype, n_heads, n_kv_heads, head_dim, plan,
           aligned, bits, values.scale, values.cap, values.window, sid,
           attention.OVERRIDES)  # fmt: skip
    return kept_record(key, lambda: assemble(
        q, k, v, out, stream=stream_handle(sid), roles=FEATURE_ROLES, n_heads=n_heads,
        n_kv_heads=n_kv_heads, head_dim=head_dim, seq_len=plan_seq, plan_seq=plan_seq,
        aligned=aligned, bits=bits, features=FeatureArgs(values.scale, values.cap, values.window),
        workspace=lambda floats: shared_scratch(floats, dev, sid),
    ))  # fmt: skip


def planned(
    device: Device,
    dtype: np.dtype,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    plan_seq: int,
    aligned: bool,
    bits: int,
    fp8: str,
    workspace: Callable[[int], DeviceArray | None] | DeviceArray | None,
) -> tuple[SplitPlan, DeviceArray | None]:
    """The split plan for ``plan_seq`` tokens and the workspace it writes, from
    ``workspace``: a function of the float count (each caller's lifetime policy: per record,
    per cache, per stream), asked only by plans that write one; or a buffer already made."""
    plan = plan_split(device, dtype, n_heads, n_kv_heads, head_dim, plan_seq, aligned, bits, fp8)
    floats = plan.workspace_floats(n_heads, head_dim)
    made = (workspace(floats) if floats else None) if callable(workspace) else workspace
    return plan, made


WIDE_TC_HEAD_DIMS = (384, 512)  # head_dims past 256 that `wide_launches` takes
_WIDE_TC_MAX_QUERIES = 16  # (decode/values.py's VALUES_MAX_QUERIES)


def wide_launches(
    q: DeviceArray, k: DeviceArray, v: DeviceArray, out: DeviceArray, *, n_heads: int,
    n_kv_heads: int, head_dim: int, seq_len: int, plan_seq: int, aligned: bool, algorithm: str,
    seq_len_dev: DeviceArray | None, workspace: Callable[[int], DeviceArray | None]
    | DeviceArray | None, qdt: np.dtype, bits: int, fp8: str,
    features: FeatureArgs | None, kv_scales: DeviceArray | None, n_q: int,
    mask: DeviceArray | None,
) -> tuple[list[Launch], DeviceArray] | None:  # fmt: skip
    """A head_dim 384 or 512 decode of fp16/bf16 q over a 16-bit or fp8 (e4m3, e5m2)
    cache on the latent tensor-core kernels with V rows of their own (split_latent.cuh,
    DK = DV = head_dim): the launches and their workspace, or None where those kernels do
    not take it (ALiBi, a tree mask, the parity algorithm, fp32, unaligned rows, more than
    16 queries, a GPU before compute capability 8.0 / 8.9 for fp8, or
    ``OVERRIDES.wide_tensor_cores`` off): the CUDA-core ``_d512`` kernels take it then.
    Measured on an H100 (benchmarks/wide_speed.py, bf16, 4 KV heads, groups 1-8): 96-99% of
    head_dim 128's TB/s on the same bytes from 32768 tokens, against 27-96% on CUDA cores."""
    dev = q.device
    if (
        head_dim not in WIDE_TC_HEAD_DIMS
        or not attention.OVERRIDES.wide_tensor_cores
        or algorithm == "parity"
        or mask is not None
        or not aligned
        or bits & F_ALIBI
        or fp8 not in ("", *FP8_FORMATS)
        or np.dtype(qdt).name not in ("float16", "bfloat16")
        or not 1 <= n_q <= _WIDE_TC_MAX_QUERIES
        or n_kv_heads * -(-(n_q * n_heads // n_kv_heads) // 16) > 65535
        or dev.compute_capability < (FP8_FROM if fp8 else TENSOR_CORES_FROM)
    ):
        return None
    from .latent import _plan, latent_launches  # (latent imports verify, which imports us)

    found = _plan(dev, kernel_dtype(qdt), fp8, n_q, n_heads, head_dim, head_dim,
                  max(1, plan_seq), bits & ~F_HND, n_kv_heads=n_kv_heads, own_v=True)  # fmt: skip
    floats = found.workspace_floats(n_q * n_heads)
    made = workspace(floats) if callable(workspace) else workspace
    if made is None or made.size * made.dtype.itemsize < 4 * floats:
        return None
    values = features or FeatureArgs(scale=head_dim**-0.5)
    head_major = bool(bits & F_HND)
    row, head = (head_dim, values.head_stride) if head_major else (n_kv_heads * head_dim, head_dim)
    v_scales = None
    if fp8:
        if kv_scales is None:
            raise ValueError("kv_scales: an fp8 plan reads the cache's scales")
        v_scales = kv_scales.view((n_kv_heads,), np.float32, offset=4 * n_kv_heads)
    launches = latent_launches(
        found, q, k, out, made, n_q=n_q, n_heads=n_heads, seq_len=seq_len,
        seq_len_dev=seq_len_dev, features=values, kv_scale_dev=kv_scales, v=v,
        n_kv_heads=n_kv_heads, strides=(row, row, head, head), v_scale_dev=v_scales,
        head_major=head_major,
    )  # fmt: skip
    return launches, made


def four_bit_layout(
    four_bit: bool, n_kv_heads: int, bits: int, head_stride: int
) -> tuple[int, int]:
    """The kernel bits and head stride (bytes of values) a 4-bit decode reads its cache
    with: head-major (F_HND and the stride) where ``head_stride`` is given, but one KV
    head's head-major bytes are token-major's, which the token-major kernels read faster
    (H100, nvfp4 8/1/256 at 131072 tokens: 27.5 against 29.1 us), so those get neither."""
    if four_bit and n_kv_heads == 1:
        return bits & ~F_HND, 0
    return (bits | F_HND, head_stride) if head_stride else (bits, 0)


def launches_for(
    q: DeviceArray,
    k: DeviceArray,
    v: DeviceArray,
    out: DeviceArray,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    seq_len: int,
    plan_seq: int,
    aligned: bool,
    algorithm: str = "auto",
    seq_len_dev: DeviceArray | None = None,
    workspace: Callable[[int], DeviceArray | None] | DeviceArray | None = None,
    dtype: np.dtype | None = None,
    bits: int = 0,
    fp8: str = "",
    features: FeatureArgs | None = None,
    kv_scales: DeviceArray | None = None,
    n_q: int = 1,
    mask: DeviceArray | None = None,
    mask_mode: int = 0,
    q4_scales: tuple[DeviceArray, DeviceArray] | None = None,
    rotate: bool = False,
    q4_head_stride: int = 0,
) -> tuple[list[Launch], DeviceArray | None]:
    """THE plan -> workspace -> launches assembly that every decode entry point uses.

    Plans the split (or takes the parity kernel) for ``plan_seq`` tokens of ``dtype`` q
    (default q's; an fp8 cache plans for its q), gets the workspace (`planned`), and returns
    the launches with the workspace they write. ``seq_len_dev``: an int32 device scalar the
    kernels read instead of ``seq_len``, which then bounds the tokens a launch may see.
    ``n_q`` > 1: a verify of n_q queries (`launches.verify_launches`; ``mask``/``mask_mode``
    its tree mask), planned for n_q x n_heads rows over ``plan_seq`` - n_q tokens. ``fp8``
    "q4" or "nvfp4" (a 4-bit cache, ``q4_scales`` its block scales, an nvfp4 cache's per
    head ``kv_scales``, K rotated where ``rotate``): one query on the swapped split kernels
    where they take it (``launches.plan_four_bit``), else the rows kernel. K and V in
    formats of their own (``fp8`` a ``spec.mixed_format``, "e4m3+q4"; ``q4_scales`` the
    4-bit sides' block scales): the rows kernel, for every n_q. ``q4_head_stride``: a 4-bit
    cache of one format stored head-major (values ``[n_kv][rows][head_dim / 2]``, block
    scales ``[n_kv][rows][...]``), the bytes of values from one KV head's rows to the
    next's (``rows * head_dim / 2``); 0, token-major.

    Raises:
        ValueError: a 4-bit decode the rows kernel does not take (a head_dim other than
            64, 128 or 256, fp32 q; K and V in formats of their own, head-major).
    """
    dims: dict[str, Any] = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim}
    if head_dim in WIDE_TC_HEAD_DIMS:
        wide = wide_launches(
            q, k, v, out, **dims, seq_len=seq_len, plan_seq=plan_seq, aligned=aligned,
            algorithm=algorithm, seq_len_dev=seq_len_dev, workspace=workspace,
            qdt=q.dtype if dtype is None else dtype, bits=bits, fp8=fp8, features=features,
            kv_scales=kv_scales, n_q=n_q, mask=mask,
        )  # fmt: skip
        if wide is not None:
            return wide
    k_fmt, v_fmt = kv_formats(fp8)
    mixed = k_fmt != v_fmt  # (the rows kernel alone reads K and V of formats of their own)
    four_bit = fp8 in FOUR_BIT_FORMATS
    if q4_head_stride and not four_bit:
        raise ValueError("q4_head_stride: a 4-bit cache of one format's (fp8 'q4', 'nvfp4')")
    bits, q4_head_stride = four_bit_layout(four_bit, n_kv_heads, bits, q4_head_stride)
    if q4_head_stride:  # a head-major 4-bit cache: the kernels' head-major bit and stride
        features = dataclasses.replace(
            features or FeatureArgs(scale=head_dim**-0.5), head_stride=q4_head_stride
        )
    if four_bit and n_q == 1 and algorithm != "parity":  # the swapped split kernels, if they can
        qdt = q.dtype if dtype is None else dtype
        split4 = plan_four_bit(q.device, qdt, n_heads, n_kv_heads, head_dim, max(1, plan_seq),
                               aligned, bits, fp8, rotate)  # fmt: skip
        if split4 is not None:
            floats = split4.workspace_floats(n_heads, head_dim)
            made = (workspace(floats) if floats else None) if callable(workspace) else workspace
            launches = split_launches(
                split4, q, k, v, out, made, **dims, seq_len=seq_len, seq_len_dev=seq_len_dev,
                features=features, kv_scales=kv_scales,
                q4_scales=q4_scales,
            )  # fmt: skip
            return launches, made
    if n_q > 1 or four_bit or mixed:
        if algorithm == "parity":
            what = ("a 4-bit cache" if four_bit else "K and V in formats of their own" if mixed
                    else "a decode of several queries")  # fmt: skip
            raise ValueError(f"algorithm: {what} needs the split kernels")
        qdt = q.dtype if dtype is None else dtype
        values = features or FeatureArgs(scale=head_dim**-0.5)
        rows = plan_rows(
            q.device, qdt, n_q, n_heads, n_kv_heads, head_dim, max(1, plan_seq), aligned,
            bits, fp8, rotate,
        )  # fmt: skip
        if rows is None and (four_bit or mixed):
            what = "a 4-bit cache is" if four_bit else "K and V in formats of their own are"
            raise ValueError(
                f"dtype: {what} read by the rows kernel alone, which takes fp16/bf16 q, "
                f"head_dim 64, 128 or 256 (K and V in formats of their own: token-major "
                f"rows; nvfp4 and fp8: compute capability 8.9 and up; got q "
                f"{np.dtype(qdt)}, head_dim {head_dim})"
            )
        if rows is not None:
            made = workspace(rows.workspace_floats(n_q * n_heads, head_dim)) if callable(
                workspace) else workspace  # fmt: skip
            if made is None:
                raise ValueError("workspace: a decode of several queries needs one")
            launches = rows_launches(
                rows, q, k, v, out, made, n_q=n_q, **dims, seq_len=seq_len,
                seq_len_dev=seq_len_dev, features=values, mask=mask, mask_mode=mask_mode,
                kv_scales=kv_scales, q4_scales=q4_scales,
            )  # fmt: skip
            return launches, made
        plan = plan_split(
            q.device, qdt, n_q * n_heads, n_kv_heads, head_dim, max(1, plan_seq - n_q),
            aligned, bits & SPLIT_BITS, fp8, verify=True,
        )  # fmt: skip
        floats = verify_workspace_floats(plan, n_q, n_heads, head_dim, np.dtype(qdt).itemsize)
        made = workspace(floats) if callable(workspace) else workspace
        if made is None:
            raise ValueError("workspace: a decode of several queries needs one")
        launches = verify_launches(
            plan, q, k, v, out, made, n_q=n_q, **dims, seq_len=seq_len, seq_len_dev=seq_len_dev,
            features=values, bits=bits, mask=mask, mask_mode=mask_mode, kv_scales=kv_scales,
        )  # fmt: skip
        return launches, made
    if algorithm == "parity":
        return parity_launches(q, k, v, out, **dims, seq_len=seq_len, seq_len_dev=seq_len_dev), None
    plan, made = planned(
        q.device, q.dtype if dtype is None else dtype, n_heads, n_kv_heads, head_dim, plan_seq,
        aligned, bits, fp8, workspace,
    )  # fmt: skip
    launches = split_launches(
        plan, q, k, v, out, made, **dims, seq_len=seq_len, seq_len_dev=seq_len_dev,
        features=features, kv_scales=kv_scales,
    )  # fmt: skip
    return launches, made


def assemble(
    q: DeviceArray,
    k: DeviceArray,
    v: DeviceArray,
    out: DeviceArray,
    *,
    stream: Any,
    keep_workspace: bool = True,
    roles: tuple[str, ...] = ROLES,
    **how: Any,
) -> DecodeRecord:
    """A launch record of `launches_for`'s launches, packed for ``stream`` (``how``: its
    arguments). ``keep_workspace``: the record holds the workspace (False where its owner,
    a cache or a stream's buffer, outlives the record anyway). ``roles``: what its calls
    write (``DecodeRecord``)."""
    launches, ws = launches_for(q, k, v, out, **how)
    return DecodeRecord(launches, q.device, stream, ws if keep_workspace else None, roles)


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
    workspace: DeviceArray | None = None,
    plan_seq: int | None = None,
) -> None:
    """Queue a decode on device arrays already validated (no checks, no host work).

    ``seq_len_dev``, when given, is an int32 device scalar the kernels read instead of
    ``seq_len``, which then only sizes the launch (the most tokens it may see); that form
    needs ``workspace`` for plans with a combine kernel. ``plan_seq`` sizes the split grid
    (default ``seq_len``); decodes planned for the same length chunk the sequence
    identically, so their results agree bit for bit.
    """
    dims: dict[str, Any] = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim}
    if seq_len_dev is None and workspace is None:
        record = decode_record(
            q, k, v, out, **dims, seq_len=seq_len, stream=stream, algorithm=algorithm,
            plan_seq=plan_seq,
        )  # fmt: skip
        sid = stream_key(stream)
        keep_for_capture(sid, sid != 0 and not isinstance(stream, Stream), record)
        record.run((q.ptr, k.ptr, v.ptr, out.ptr, seq_len))
        return
    launches, _ = launches_for(
        q, k, v, out, **dims, seq_len=seq_len, seq_len_dev=seq_len_dev, algorithm=algorithm,
        plan_seq=seq_len if plan_seq is None else plan_seq, workspace=workspace,
        aligned=((q.ptr | k.ptr | v.ptr) & 15) == 0,
    )  # fmt: skip
    for launch in launches:
        launch.run(stream, q.device)
