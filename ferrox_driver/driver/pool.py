"""Per-stream device memory reused across calls: output blocks lent to the arrays a call
returns (`OutputPool`), and float32 buffers kept per (stream, role) (`stream_buffer`)."""

from __future__ import annotations

import numpy as np

from ._bindings import drv, release
from .device import Device
from .memory import DeviceArray, empty

__all__ = ["POOL_KEEP", "OutputPool", "output_pool", "stream_buffer"]

POOL_KEEP = 8  # free blocks kept per (context, stream, size); more are freed


class _PoolBlock:
    """A block of a pool's memory, lent to the DeviceArrays that view it: when the last of
    them goes, the block goes back to its free list (or is freed when the list is full).
    ``free`` None: never returned (a graph captured elsewhere may still write it)."""

    __slots__ = ("__weakref__", "free", "ptr")

    def __init__(self, ptr: int, free: list[int] | None) -> None:
        self.ptr, self.free = ptr, free

    def __del__(self) -> None:
        try:
            free = self.free
            if free is None:
                return
            if len(free) < POOL_KEEP:
                free.append(self.ptr)
            else:
                release("cuMemFree", self.ptr)
        except Exception:  # at interpreter shutdown, say
            pass


class OutputPool:
    """Device memory for results, reused in stream order: blocks of one size that come
    back when their arrays are collected, handed out again for work on the same stream
    (which runs after whatever used them before). An array handed to work on another
    stream must stay referenced until that work is done, as with PyTorch's allocator.

    Args:
        device: where the memory lives.
        nbytes: the size of every block.
    """

    def __init__(self, device: Device, nbytes: int) -> None:
        self.device, self.nbytes = device, nbytes
        self.free: list[int] = []

    def take(self, shape: tuple[int, ...], dtype: np.dtype, *, keep: bool = True) -> DeviceArray:
        """A DeviceArray over a block of the pool (a new one when none is free).
        ``keep=False``: the block never comes back (a foreign capture may write it).

        Raises:
            CudaError: the allocation failed (e.g. inside a stream capture).
        """
        free = self.free
        if not free:
            self.device.activate()
        ptr = free.pop() if free else int(drv("cuMemAlloc", max(self.nbytes, 1)))
        arr = DeviceArray.__new__(DeviceArray)  # _wrap's work, with the size known
        arr.shape, arr.dtype, arr.device, arr.nbytes = shape, dtype, self.device, self.nbytes
        arr._ptr, arr._base, arr._parent, arr._closed = (
            ptr, _PoolBlock(ptr, free if keep else None), None, False,
        )  # fmt: skip
        return arr

    def close(self) -> None:
        """Free the blocks not in use."""
        free, self.free = self.free, []
        for ptr in free:
            release("cuMemFree", ptr)


_pools: dict[tuple[int, int, int], OutputPool] = {}


def output_pool(device: Device, stream: int, nbytes: int) -> OutputPool:
    """The pool of ``nbytes`` blocks for work on ``stream`` (an int handle) on ``device``."""
    key = (device.context_handle, stream, nbytes)
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = OutputPool(device, nbytes)
    return pool


# Per (context, stream, role, elements): a float32 device buffer that work on that stream
# reuses (its work is ordered on it), so no free waits for queued work.
_stream_buffers: dict[tuple[int, int, str, int], DeviceArray] = {}


def stream_buffer(dev: Device, sid: int, role: str, n: int) -> DeviceArray:
    """The float32 buffer of ``n`` elements for ``role`` on stream ``sid`` (made once)."""
    key = (dev.context_handle, sid, role, n)
    buf = _stream_buffers.get(key)
    if buf is None or buf.closed:
        buf = _stream_buffers[key] = empty((n,), np.float32, device=dev)
    return buf
