"""One sequence's KV cache split across ranks (decode context parallelism): each rank (one
per GPU in the usual NCCL model, or several on one device: `LocalGroup`) holds a share of
the tokens, decodes its share to a partial output and log-sum-exp, the ranks exchange
the partials (an all-gather of ``n_heads * (head_dim + 1)`` values each) and every rank
merges them exactly (`merge_states`) on its device.

Token ``g`` belongs to rank ``(g // block) % world`` (``block=1``: round robin), so every
rank holds an equal share, within a block. The sequence's length and each rank's share
live on the device, so one captured graph of ``append_async`` + ``decode_async`` serves
every token. A group is anything with ``rank``, ``world``, ``device``,
``gather_buffer(shape, dtype)`` and ``all_gather(send, recv, stream=)``: `LocalGroup`
here, ``ferrox_driver.parallel.distributed.NcclGroup`` over NCCL (the ``[distributed]`` extra).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Any, Protocol

import numpy as np

from ..cache.four_bit import refuse_four_bit
from ..cache.graphs import gqa_decode_async
from ..decode.checks import (
    MAX_HEAD_DIM,
    MAX_INT32,
    MAX_KV_HEADS,
    MAX_TOKENS,
    SUPPORTED_DTYPES,
    check_dims,
    check_host_extent,
    check_int,
)
from ..decode.merge import merge_states
from ..driver.calls import drv
from ..driver.device import Device, resolve
from ..driver.interop import array_ref
from ..driver.memory import DeviceArray, as_dtype, empty, zeros
from ..driver.stream import stream_handle
from ..errors import ClosedError, KVCapacityError
from ..kernels.catalogue import get_kernel
from ..types import DeviceArrayLike, DeviceLike, DTypeLike, StreamLike

__all__ = [
    "Group",
    "LocalGroup",
    "ShardedDecoder",
    "ShardedKVCache",
    "shard_count",
    "shard_owner",
    "shard_slot",
]


def shard_owner(token: int, world: int, block: int = 1) -> int:
    """The rank that holds token ``token`` of the sequence."""
    return (token // block) % world


def shard_slot(token: int, world: int, block: int = 1) -> int:
    """Where token ``token`` lies in its rank's cache."""
    return (token // (block * world)) * block + token % block


def shard_count(length: int, rank: int, world: int, block: int = 1) -> int:
    """How many of the first ``length`` tokens rank ``rank`` holds."""
    rounds, rest = divmod(length, block * world)
    return rounds * block + min(max(rest - rank * block, 0), block)


class Group(Protocol):
    """What a sharded cache needs of its ranks' group."""

    rank: int
    world: int
    device: Device

    def gather_buffer(self, shape: tuple[int, ...], dtype: DTypeLike) -> DeviceArray:
        """A ``(world, *shape)`` array that ``all_gather`` fills."""
        ...

    def all_gather(self, send: DeviceArray, recv: DeviceArray, *, stream: StreamLike) -> None:
        """Every rank's ``send`` into slot ``rank`` of every rank's ``recv`` (queued on
        ``stream``; capturable)."""
        ...


class _Board:
    """The gather buffers that a LocalGroup's ranks share, in the order they ask."""

    def __init__(self, world: int, device: Device) -> None:
        self.world, self.device = world, device
        self.buffers: list[DeviceArray] = []


class LocalGroup:
    """``world`` ranks in this process on one device: the shards as separate caches, for
    tests and for splitting a sequence on one GPU. Make them with ``LocalGroup.ranks``.

    Their gather buffers are shared: rank r's ``all_gather`` writes its slot of the one
    buffer that every rank merges from. So, unlike NCCL's, its all-gather is complete only
    once every rank has made it: run every rank's ``partial_async`` (and
    ``exchange_async``) before any rank's ``merge_async`` (`ShardedDecoder.decode_all`).
    """

    def __init__(self, rank: int, world: int, board: _Board) -> None:
        self.rank, self.world, self.device = rank, world, board.device
        self._board = board
        self._asked = 0

    @classmethod
    def ranks(cls, world: int, device: DeviceLike = None) -> list[LocalGroup]:
        """The ``world`` ranks of a new group on ``device`` (a Device, an int, a
        ``torch.device`` or ``"cuda:N"``; default: device 0)."""
        world = check_int(world, "world", 1, MAX_INT32)
        board = _Board(world, resolve(device))
        return [cls(r, world, board) for r in range(world)]

    def gather_buffer(self, shape: tuple[int, ...], dtype: DTypeLike) -> DeviceArray:
        """The group's shared ``(world, *shape)`` buffer for this rank's next ask."""
        board, i = self._board, self._asked
        self._asked += 1
        if i == len(board.buffers):
            board.buffers.append(empty((self.world, *shape), dtype, device=self.device))
        buf = board.buffers[i]
        if buf.shape != (self.world, *shape) or buf.dtype != np.dtype(dtype):
            raise ValueError(
                f"LocalGroup rank {self.rank}: gather buffer {i} asked as {shape} {dtype}, "
                f"rank 0 asked {buf.shape[1:]} {buf.dtype} (every rank makes the same "
                f"caches and decoders, in the same order)"
            )
        return buf

    def all_gather(self, send: DeviceArray, recv: DeviceArray, *, stream: StreamLike) -> None:
        """``send`` into this rank's slot of ``recv`` (a no-op where it is already there)."""
        if recv.ptr + self.rank * send.nbytes != send.ptr:  # not already in place
            dst = recv.ptr + self.rank * send.nbytes
            drv("cuMemcpyDtoDAsync", dst, send.ptr, send.nbytes, stream_handle(stream))


class ShardedKVCache:
    """This rank's share of one sequence's K and V (token-major ``(tokens, n_kv_heads,
    head_dim)``), of at most ``capacity`` tokens in all.

    Every rank is given every token (the same rows on every rank: ``extend`` or ``append``
    on the host, ``append_async`` from device arrays) and keeps its own. ``seq_len`` is
    the sequence's length, ``local_len`` this rank's share.

    Args:
        n_kv_heads: KV heads of a token's row.
        head_dim: elements per head, 1..512.
        capacity: the sequence's most tokens (this rank holds ``shard_count(capacity,
            ...)`` of them).
        group: the ranks (`LocalGroup`, ``distributed.NcclGroup``).
        block: tokens dealt to a rank at a time (1: round robin).
        dtype: float32, float16 or bfloat16.
    """

    def __init__(self, n_kv_heads: int, head_dim: int, capacity: int, *, group: Group,
                 block: int = 1, dtype: DTypeLike = np.float32) -> None:  # fmt: skip
        n_kv_heads = check_int(n_kv_heads, "n_kv_heads", 1, MAX_KV_HEADS)
        head_dim = check_int(head_dim, "head_dim", 1, MAX_HEAD_DIM)
        capacity = check_int(capacity, "capacity", 1, MAX_TOKENS)  # (the kernels: int32)
        block = check_int(block, "block", 1, MAX_INT32)
        refuse_four_bit(dtype, "ShardedKVCache")
        dt = as_dtype(dtype, "dtype")
        if dt not in SUPPORTED_DTYPES:
            raise TypeError(f"dtype: expected float32, float16 or bfloat16, got {dt}")
        self.n_kv_heads, self.head_dim, self.capacity, self.block = (
            n_kv_heads, head_dim, capacity, block
        )  # fmt: skip
        self.group, self.rank, self.world = group, group.rank, group.world
        self.device, self.dtype = group.device, dt
        self.local_capacity = shard_count(capacity, self.rank, self.world, block)
        rows = (max(self.local_capacity, 1), n_kv_heads, head_dim)
        self.k = zeros(rows, dt, device=self.device)
        self.v = zeros(rows, dt, device=self.device)
        # [sequence length, this rank's tokens, overflow, -]: what the kernels read
        self._state = zeros((4,), np.int32, device=self.device)
        self.local_len_dev = self._state.view((1,), np.int32, offset=4)
        self._host = np.zeros(4, np.int32)  # the state, where no device append ran since
        self._host_valid = True
        self._append = get_kernel("kv_cache.cu", "kv_append_shard", self.device)
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_arrays, self.k, self.v, self._state)

    @property
    def row_elems(self) -> int:
        return self.n_kv_heads * self.head_dim

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("ShardedKVCache")

    def _read_state(self) -> np.ndarray:
        self._check_open()
        if not self._host_valid:
            self.device.synchronize()
            self._host = self._state.to_host()
            self._host_valid = True
        return self._host

    @property
    def seq_len(self) -> int:
        """The sequence's length (all ranks' tokens; synchronizes after device appends)."""
        return int(self._read_state()[0])

    @property
    def local_len(self) -> int:
        """This rank's tokens."""
        return int(self._read_state()[1])

    def extend(self, k_rows: np.ndarray, v_rows: np.ndarray) -> None:
        """Append host rows ``(n, n_kv_heads, head_dim)`` (or ``(n, n_kv_heads *
        head_dim)``) of the sequence's next ``n`` tokens: this rank copies its own.

        Raises:
            KVCapacityError: past ``capacity`` (nothing written).
            ValueError, TypeError: naming the argument.
        """
        k = self._rows(k_rows, "k_rows")
        v = self._rows(v_rows, "v_rows")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"v_rows: {v.shape[0]} rows, k_rows {k.shape[0]}")
        state = self._read_state()
        if state[2]:
            raise KVCapacityError(int(state[0]), self.capacity)
        g0, local, n = int(state[0]), int(state[1]), k.shape[0]
        if g0 + n > self.capacity:
            raise KVCapacityError(g0, self.capacity, n)
        owners = (np.arange(g0, g0 + n) // self.block) % self.world
        mine = np.nonzero(owners == self.rank)[0]
        m = len(mine)
        if m:
            row_bytes = self.row_elems * self.dtype.itemsize
            for dst, src in ((self.k, k), (self.v, v)):
                view = dst.view((m, self.row_elems), self.dtype, offset=local * row_bytes)
                view.copy_from_host(np.ascontiguousarray(src[mine]))
        new = np.array([g0 + n, local + m, 0, 0], np.int32)
        self._state.copy_from_host(new)
        self._host = new

    def set_length(self, length: int) -> None:
        """Declare the sequence's first ``length`` tokens in place: their rows written into
        ``k`` and ``v`` at their slots by the caller (a prefill of its own, a benchmark's
        fill), so that both counts follow.

        Raises:
            ValueError: ``length`` outside ``[0, capacity]``.
        """
        self._check_open()
        length = check_int(length, "length", 0, self.capacity)
        local = shard_count(length, self.rank, self.world, self.block)
        self._host = np.array([length, local, 0, 0], np.int32)
        self._state.copy_from_host(self._host)
        self._host_valid = True

    def truncate(self, n: int) -> None:
        """Keep the sequence's first ``n`` tokens (a speculative draft's rejected tokens
        forgotten): each rank keeps its share of them; nothing copied. On the host only
        (``fd.kv_truncate_async`` refuses a sharded cache: the shards' counts are computed
        here).

        Raises:
            ValueError: ``n`` outside ``[0, seq_len]``, naming it (nothing changed).
        """
        self.set_length(check_int(n, "n", 0, self.seq_len))

    def append(self, k_tok: np.ndarray, v_tok: np.ndarray) -> None:
        """Append one token's host rows (``(n_kv_heads, head_dim)`` each)."""
        self.extend(np.asarray(k_tok)[None], np.asarray(v_tok)[None])

    def append_async(self, k_dev: DeviceArrayLike, v_dev: DeviceArrayLike, *,
                     stream: StreamLike) -> None:  # fmt: skip
        """Queue the next token's device rows (``n_kv_heads * head_dim`` elements each, the
        cache's dtype): the owner stores them, every rank counts the token. No host work:
        capturable. Past ``capacity`` nothing is written and ``synchronize`` raises."""
        self._check_open()
        ptrs = []
        for obj, name in ((k_dev, "k_dev"), (v_dev, "v_dev")):
            ref = array_ref(obj, name)
            if ref is None:
                raise TypeError(f"{name}: expected a device array, got a host array")
            ptr, shape, dtype, ordinal, contiguous, _ = ref
            if dtype != self.dtype or math.prod(shape) != self.row_elems or not contiguous:
                raise ValueError(f"{name}: expected {self.row_elems} contiguous {self.dtype}, "
                                 f"got {shape} {dtype}")  # fmt: skip
            if ordinal != self.device.ordinal:
                raise ValueError(f"{name}: on device {ordinal}, the cache on {self.device.ordinal}")
            ptrs.append(DeviceArray._wrap(ptr, (self.row_elems,), dtype, self.device, obj))
        row_bytes = self.row_elems * self.dtype.itemsize
        args = (ptrs[0], ptrs[1], self.k, self.v, self._state, np.int64(row_bytes),
                np.int32(self.capacity), np.int32(self.rank), np.int32(self.world),
                np.int32(self.block))  # fmt: skip
        self._append.launch(1, 128, args, stream=stream)
        self._host_valid = False

    def synchronize(self) -> None:
        """Wait for the device; raise KVCapacityError if an ``append_async`` overflowed."""
        self._host_valid = False
        state = self._read_state()
        if state[2]:
            raise KVCapacityError(int(state[0]), self.capacity)

    def _rows(self, rows: Any, name: str) -> np.ndarray:
        if not isinstance(rows, np.ndarray):
            raise TypeError(f"{name}: expected a numpy array, got {type(rows).__name__}")
        if rows.dtype != self.dtype:
            raise TypeError(f"{name}: expected {self.dtype}, got {rows.dtype}")
        if rows.ndim < 2 or math.prod(rows.shape[1:]) != self.row_elems:
            raise ValueError(f"{name}: expected (n, {self.n_kv_heads}, {self.head_dim}), "
                             f"got {rows.shape}")  # fmt: skip
        check_host_extent(rows, name)
        return rows.reshape(rows.shape[0], self.row_elems)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the device memory (idempotent)."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> ShardedKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_arrays(*arrays: DeviceArray) -> None:
    for a in arrays:
        with contextlib.suppress(Exception):  # a finalizer never raises
            a.close()


class ShardedDecoder:
    """The decode of one query over a `ShardedKVCache`: this rank's share to a partial
    output and LSE (``partial_async``), the all-gather (``exchange_async``), the exact
    merge (``merge_async``); ``decode_async`` queues all three (capturable, once run
    eagerly: the first run makes the launches). Every rank gets the whole result.

    Features: ``logits_soft_cap`` and ``scale``; ``sinks`` (float32 device array, one per
    query head) counted once, by rank 0. ``sliding_window`` and ``alibi_slopes`` need
    each token's place in the sequence, which a shard does not have: refused.
    """

    def __init__(
        self,
        cache: ShardedKVCache,
        *,
        n_heads: int,
        logits_soft_cap: float | None = None,
        scale: float | None = None,
        sinks: DeviceArrayLike = None,
        sliding_window: int | None = None,
        alibi_slopes: DeviceArrayLike = None,
    ) -> None:
        n_heads, _, _ = check_dims(n_heads, cache.n_kv_heads, cache.head_dim)
        for name, value in (("sliding_window", sliding_window), ("alibi_slopes", alibi_slopes)):
            if value is not None:
                raise ValueError(f"{name}: not for a sharded cache (a shard does not hold "
                                 f"the tokens' places in the sequence)")  # fmt: skip
        given = {"logits_soft_cap": logits_soft_cap, "scale": scale, "sinks": sinks}
        self.cache, self.n_heads = cache, n_heads
        self.features: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        if cache.rank != 0:
            self.features.pop("sinks", None)
        hd = cache.head_dim
        self.recv_out = cache.group.gather_buffer((n_heads, hd), cache.dtype)
        self.recv_lse = cache.group.gather_buffer((n_heads,), np.float32)
        r = cache.rank
        slot = r * n_heads * hd * cache.dtype.itemsize
        self.part_out = self.recv_out.view((n_heads, hd), cache.dtype, offset=slot)
        self.part_lse = self.recv_lse.view((n_heads,), np.float32, offset=r * n_heads * 4)
        # the merged LSE where the caller wants none (made here: never inside a capture)
        self._lse = empty((n_heads,), np.float32, device=cache.device)

    def partial_async(self, q_dev: DeviceArrayLike, *, stream: StreamLike) -> None:
        """This rank's share: its partial output and LSE, into its slot of the gather."""
        c = self.cache
        gqa_decode_async(q_dev, (c.k, c.v), self.part_out, n_heads=self.n_heads, stream=stream,
                         seq_len=c.local_len_dev, out_lse=self.part_lse,
                         **self.features)  # fmt: skip

    def exchange_async(self, *, stream: StreamLike) -> None:
        """The all-gather of every rank's partial output and LSE."""
        group = self.cache.group
        group.all_gather(self.part_out, self.recv_out, stream=stream)
        group.all_gather(self.part_lse, self.recv_lse, stream=stream)

    def merge_async(self, out_dev: DeviceArrayLike, *, stream: StreamLike,
                    out_lse: DeviceArrayLike = None) -> None:  # fmt: skip
        """The whole sequence's result from the gathered partials."""
        lse = out_lse if out_lse is not None else self._lse
        merge_states(self.recv_out, self.recv_lse, stream=stream, out=out_dev, out_lse=lse)

    def decode_async(self, q_dev: DeviceArrayLike, out_dev: DeviceArrayLike, *,
                     stream: StreamLike, out_lse: DeviceArrayLike = None) -> None:  # fmt: skip
        """``partial_async``, ``exchange_async`` and ``merge_async`` (a group whose
        all-gather is a collective: NCCL; for a LocalGroup, `decode_all`)."""
        self.partial_async(q_dev, stream=stream)
        self.exchange_async(stream=stream)
        self.merge_async(out_dev, stream=stream, out_lse=out_lse)

    @staticmethod
    def decode_all(decoders: list[ShardedDecoder], q_dev: DeviceArrayLike,
                   outs: list[DeviceArrayLike], *, stream: StreamLike) -> None:  # fmt: skip
        """Every rank of a LocalGroup: each rank's partial and exchange, then each rank's
        merge into its ``outs[rank]`` (capturable)."""
        for d in decoders:
            d.partial_async(q_dev, stream=stream)
            d.exchange_async(stream=stream)
        for d, out in zip(decoders, outs, strict=True):
            d.merge_async(out, stream=stream)

    def close(self) -> None:
        """Free the decoder's own buffers (a LocalGroup's gather buffers are the group's),
        once no graph it was captured into runs again; idempotent."""
        owned = [self._lse]
        if not isinstance(self.cache.group, LocalGroup):
            owned += [self.recv_out, self.recv_lse]
        for a in owned:
            a.close()

    def __enter__(self) -> ShardedDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
