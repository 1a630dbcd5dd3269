"""Launch records: a decode's plan, kernels, grids, packed arguments and scratch, made once
per signature and kept (LRU) in one store; a call writes the pointers that changed and
launches."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from typing import Any

from ..driver.device import Device
from ..driver.graph import keep_for_capture
from ..driver.launch import LaunchSequence
from ..driver.memory import DeviceArray
from ..driver.stream import Stream, stream_handle, stream_key
from . import plan as attention
from .plan import Launch, allocate_scratch, parity_launches, plan_split, split_launches

__all__ = [
    "MAX_RECORDS",
    "ROLES",
    "DecodeRecord",
    "decode_record",
    "launch_decode",
    "lock",
    "store",
]

ROLES = ("q", "k", "v", "out", "seq")
MAX_RECORDS = 256  # launch records kept (LRU); a record in use lives on while referenced


class DecodeRecord:
    """The launches of one decode signature, packed once; ``run(values)`` writes the
    call's (q, k, v, out, seq_len) and launches (see ``LaunchSequence``).

    Args:
        launches: the decode's launches (``split_launches`` or ``parity_launches``).
        device: the device.
        stream: the stream they are packed for.
        workspace: the scratch they write (kept alive with the record).
    """

    def __init__(
        self,
        launches: list[Launch],
        device: Device,
        stream: Any,
        workspace: DeviceArray | None,
    ) -> None:
        self.sequence = LaunchSequence(
            [launch.packed(stream, device) for launch in launches],
            ROLES,
            [launch.roles for launch in launches],
            device,
        )
        self.run = self.sequence.run
        self.workspace = workspace
        self.kernels = tuple(launch.kernel for launch in launches)
        self.captured = False  # a graph made elsewhere may use it: never dropped


store: OrderedDict[tuple[Any, ...], DecodeRecord] = OrderedDict()
lock = threading.RLock()  # making records and calls (the hot path only reads them)


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
    alignment): their pointers are the call's to write."""
    aligned = ((q.ptr | k.ptr | v.ptr) & 15) == 0
    sid = stream_key(stream)
    plan_for = seq_len if plan_seq is None else plan_seq
    dev = q.device
    key = (dev.context_handle, q.dtype, n_heads, n_kv_heads, head_dim, seq_len, plan_for,
           aligned, algorithm, sid, attention.OVERRIDES)  # fmt: skip
    record = store.get(key)
    if record is not None:
        with contextlib.suppress(KeyError):  # another thread may have dropped it
            store.move_to_end(key)
        return record
    with lock:
        record = store.get(key)
        if record is None:
            record = make_record(key, q, k, v, out, n_heads, n_kv_heads, head_dim, seq_len,
                                  plan_for, aligned, algorithm, sid)  # fmt: skip
    return record


def make_record(
    key: tuple[Any, ...],
    q: DeviceArray,
    k: DeviceArray,
    v: DeviceArray,
    out: DeviceArray,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    seq_len: int,
    plan_for: int,
    aligned: bool,
    algorithm: str,
    sid: int,
) -> DecodeRecord:
    dev = q.device
    dims: dict[str, Any] = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim}
    workspace = None
    if algorithm == "parity":
        launches = parity_launches(q, k, v, out, **dims, seq_len=seq_len, seq_len_dev=None)
    else:
        plan = plan_split(dev, q.dtype, n_heads, n_kv_heads, head_dim, plan_for, aligned)
        floats = plan.workspace_floats(n_heads, head_dim)
        if floats:
            workspace = allocate_scratch(
                floats,
                dev,
                "stream: the first decode of this shape on this stream cannot allocate its "
                "scratch inside a capture: run it once before capturing (or use a KVCache "
                "with gqa_decode_async)",
            )
        launches = split_launches(
            plan, q, k, v, out, workspace, **dims, seq_len=seq_len, seq_len_dev=None
        )
    record = store[key] = DecodeRecord(launches, dev, stream_handle(sid), workspace)
    while len(store) > MAX_RECORDS:
        store.popitem(last=False)  # freed once nothing (a call, a graph) holds it
    return record


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
    if algorithm == "parity":
        launches = parity_launches(q, k, v, out, **dims, seq_len=seq_len, seq_len_dev=seq_len_dev)
    else:
        plan_for = seq_len if plan_seq is None else plan_seq
        aligned = ((q.ptr | k.ptr | v.ptr) & 15) == 0
        plan = plan_split(q.device, q.dtype, n_heads, n_kv_heads, head_dim, plan_for, aligned)
        launches = split_launches(
            plan, q, k, v, out, workspace, **dims, seq_len=seq_len, seq_len_dev=seq_len_dev
        )
    for launch in launches:
        launch.run(stream, q.device)
