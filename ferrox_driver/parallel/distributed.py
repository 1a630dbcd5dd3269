"""Ranks on several GPUs through NCCL, for `ferrox_driver.parallel.sharded`. Needs nccl4py, the
cuda-python project's NCCL binding (``pip install nccl4py``; from a checkout, the
``[distributed]`` extra: ``pip install '.[distributed]'``); nothing else in the package
imports this module.

One process per GPU, started by ``python -m ferrox_driver.launcher -n N script.py`` (which
hands every rank the NCCL id), by ``mpirun`` (the id broadcast over MPI, with mpi4py) or
by anything that sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``FERROX_NCCL_ID``::

    group = NcclGroup.from_env()
    cache = fd.parallel.sharded.ShardedKVCache(8, 128, 1 << 20, group=group, dtype="bf16")
"""

from __future__ import annotations

import ctypes
import os
import weakref
from typing import Any

import numpy as np

from ..driver.device import Device
from ..driver.memory import DeviceArray, empty
from ..driver.stream import stream_key
from ..errors import ClosedError
from ..types import StreamLike

__all__ = ["ID_ENV", "NcclGroup", "new_unique_id"]

INSTALL_HINT = (
    "ferrox_driver.parallel.distributed needs nccl4py (the cuda-python project's NCCL binding): "
    "pip install 'nccl4py>=0.6', or from a checkout of ferrox-driver: pip install "
    "'.[distributed]'. The NCCL library itself comes with PyTorch, the nvidia-nccl-cu12/cu13 "
    "wheels or the system."
)
ID_ENV = "FERROX_NCCL_ID"  # the NCCL unique id, hex, as the launcher hands it to the ranks
_ID_BYTES = 128


def _nccl() -> Any:
    try:
        from nccl.bindings import nccl
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "nccl":
            raise  # something nccl4py itself imports is missing: that is the message
        raise ImportError(INSTALL_HINT) from None  # the hint is the whole story
    return nccl


def new_unique_id() -> bytes:
    """A new NCCL unique id (rank 0 makes it; every rank of the group is given it)."""
    uid = _nccl().get_unique_id()
    return ctypes.string_at(uid.ptr, _ID_BYTES)


class NcclGroup:
    """Rank ``rank`` of ``world`` on ``Device(device)``: an NCCL communicator.

    Args:
        rank: this process's rank, 0..world-1.
        world: the ranks.
        unique_id: the group's id (``new_unique_id()`` on one rank, handed to all).
        device: this rank's GPU (default: ``LOCAL_RANK``, else ``rank``).

    Raises:
        ValueError: a rank, world or id out of range.
        ImportError: nccl4py is not installed.
    """

    def __init__(self, rank: int, world: int, unique_id: bytes, device: int | None = None):
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank: expected 0..{world - 1} of world {world}, got {rank}")
        if len(unique_id) != _ID_BYTES:
            raise ValueError(f"unique_id: expected {_ID_BYTES} bytes, got {len(unique_id)}")
        nccl = _nccl()
        self.rank, self.world = rank, world
        self.device = Device(rank if device is None else device)
        self.device.activate()  # NCCL takes the current context's device
        uid = nccl.UniqueId.from_buffer(bytearray(unique_id))
        self._nccl = nccl
        self._comm = nccl.comm_init_rank(world, uid, rank)
        self._finalizer = weakref.finalize(self, _destroy, nccl, self._comm)

    @classmethod
    def from_env(cls) -> NcclGroup:
        """The group of this process as the launcher (or torchrun-style variables plus
        ``FERROX_NCCL_ID``, or mpirun with mpi4py) describes it."""
        env = os.environ
        rank = env.get("RANK") or env.get("OMPI_COMM_WORLD_RANK") or env.get("PMI_RANK")
        world = env.get("WORLD_SIZE") or env.get("OMPI_COMM_WORLD_SIZE") or env.get("PMI_SIZE")
        if rank is None or world is None:
            raise ValueError("RANK, WORLD_SIZE: not set (start the ranks with "
                             "python -m ferrox_driver.launcher -n N, or mpirun)")  # fmt: skip
        local = env.get("LOCAL_RANK") or env.get("OMPI_COMM_WORLD_LOCAL_RANK") or rank
        hex_id = env.get(ID_ENV)
        if hex_id is not None:
            uid = bytes.fromhex(hex_id)
        else:  # mpirun: rank 0's id over MPI
            try:
                from mpi4py import MPI
            except ImportError as exc:
                raise ValueError(f"{ID_ENV}: not set, and no mpi4py to share an id") from exc
            uid = MPI.COMM_WORLD.bcast(new_unique_id() if int(rank) == 0 else None, root=0)
        return cls(int(rank), int(world), uid, int(local))

    def gather_buffer(self, shape: tuple[int, ...], dtype: Any) -> DeviceArray:
        """A new ``(world, *shape)`` array on this rank's device."""
        return empty((self.world, *shape), dtype, device=self.device)

    def all_gather(self, send: DeviceArray, recv: DeviceArray, *, stream: StreamLike) -> None:
        """ncclAllGather of ``send`` (bytes) into ``recv`` on ``stream`` (capturable)."""
        if recv.nbytes != self.world * send.nbytes:
            raise ValueError(f"recv: expected {self.world * send.nbytes} bytes, got {recv.nbytes}")
        self._check_open()
        uint8 = int(self._nccl.DataType.Uint8)
        self._nccl.all_gather(send.ptr, recv.ptr, send.nbytes, uint8, self._comm,
                              stream_key(stream))  # fmt: skip

    def all_gather_host(self, value: np.ndarray) -> np.ndarray:
        """Every rank's ``value`` (a small host array), stacked: a synchronous helper for
        checks and benchmarks."""
        value = np.ascontiguousarray(value)
        send = empty(value.shape, value.dtype, device=self.device)
        recv = empty((self.world, *value.shape), value.dtype, device=self.device)
        try:
            send.copy_from_host(value)
            self.all_gather(send, recv, stream=None)
            self.device.synchronize()
            return recv.to_host()
        finally:
            send.close()
            recv.close()

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise ClosedError("NcclGroup")

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Destroy the communicator (idempotent; every rank closes its own)."""
        self._finalizer()

    def __enter__(self) -> NcclGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _destroy(nccl: Any, comm: Any) -> None:
    try:
        nccl.comm_destroy(comm)
    except Exception:  # a finalizer never raises
        return
