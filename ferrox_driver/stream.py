"""Streams and events."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._driver import cu, drv, finalizer
from .device import Device, resolve

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from .graph import Graph

__all__ = ["Event", "Stream", "stream_handle"]


class Stream:
    """A CUDA stream: an ordered queue of device work.

    Args:
        device: the device to create it on (default: device 0).
        non_blocking: when True the stream does not synchronise with the legacy default
            stream (``CU_STREAM_NON_BLOCKING``).
    """

    def __init__(self, device: Device | None = None, *, non_blocking: bool = False) -> None:
        self.device = resolve(device)
        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING if non_blocking else 0
        self._handle = drv("cuStreamCreate", flags)
        self._before_destroy: list[Callable[[Any], None]] = []
        self._finalizer = finalizer(self, _destroy_stream, self._handle, self._before_destroy)

    @classmethod
    def from_handle(cls, handle: int, device: Device | None = None) -> Stream:
        """Wrap a stream made elsewhere (e.g. ``torch.cuda.current_stream().cuda_stream``).

        The stream is borrowed: closing the wrapper does not destroy it.
        """
        self = cls.__new__(cls)
        self.device = resolve(device)
        self._handle = cu.CUstream(int(handle))
        self._before_destroy = []  # never run: a borrowed stream is not destroyed here
        self._finalizer = finalizer(self, None)
        return self

    def before_destroy(self, hook: Callable[[Any], None]) -> None:
        """Run ``hook(handle)`` when this stream is destroyed, by ``close()`` or when the
        object is collected, just before the destroy (held back, like frees, until a
        capture on this thread ends); never for a borrowed stream (``from_handle``). It
        must not refer to this Stream object. Scratch kept per stream is released this way."""
        if self._finalizer.alive:
            self._before_destroy.append(hook)

    @property
    def handle(self) -> Any:
        """The ``CUstream`` handle."""
        return self._handle

    def synchronize(self) -> None:
        """Block the host until all work queued on this stream has finished."""
        self.device.activate()
        drv("cuStreamSynchronize", self._handle)

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (no host blocking)."""
        self.device.activate()
        drv("cuStreamWaitEvent", self._handle, event.handle, 0)

    def capture(self) -> AbstractContextManager[Graph]:
        """Capture the work queued on this stream inside a ``with`` block into a Graph.

        Returns:
            A context manager yielding the (still empty) Graph, filled when the block ends.
        """
        from .graph import capture

        return capture(self)

    def close(self) -> None:
        """Destroy the stream (pending work still completes)."""
        self._finalizer()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Stream(handle=0x{int(self._handle):x})"


def _destroy_stream(handle: Any, hooks: list[Callable[[Any], None]]) -> None:
    for hook in hooks:
        with contextlib.suppress(Exception):
            hook(handle)
    cu.cuStreamDestroy(handle)


def stream_handle(stream: Any) -> Any:
    """The CUstream for ``stream``: a Stream, None (the legacy default stream), an int
    handle, or an object exposing ``cuda_stream`` (PyTorch) or ``ptr`` (CuPy)."""
    if stream is None:
        return cu.CUstream(0)
    if isinstance(stream, Stream):
        return stream.handle
    if isinstance(stream, cu.CUstream):
        return stream
    if isinstance(stream, int) and not isinstance(stream, bool):
        return cu.CUstream(stream)
    for attr in ("cuda_stream", "ptr"):
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return cu.CUstream(value)
    raise TypeError(
        f"stream: expected a ferrox_driver.Stream, None, an int handle or a PyTorch/CuPy "
        f"stream, got {type(stream).__name__}"
    )


class Event:
    """A CUDA event: a marker in a stream, for ordering and timing.

    Args:
        timing: record timestamps (needed for :meth:`elapsed_ms`).
        device: the device (default: device 0).
    """

    def __init__(self, timing: bool = True, *, device: Device | None = None) -> None:
        self.device = resolve(device)
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT
        if not timing:
            flags = cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.timing = timing
        self._handle = drv("cuEventCreate", flags)
        self._finalizer = finalizer(self, "cuEventDestroy", self._handle)

    @property
    def handle(self) -> Any:
        """The ``CUevent`` handle."""
        return self._handle

    def record(self, stream: Any = None) -> Event:
        """Record this event on ``stream`` (default: the legacy default stream)."""
        self.device.activate()
        drv("cuEventRecord", self._handle, stream_handle(stream))
        return self

    def synchronize(self) -> None:
        """Block the host until the work before the recorded point has finished."""
        self.device.activate()
        drv("cuEventSynchronize", self._handle)

    def query(self) -> bool:
        """True when the recorded work has finished; never blocks."""
        self.device.activate()
        status = cu.cuEventQuery(self._handle)[0]
        if status == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        drv("cuEventQuery", self._handle)  # raises for any real error
        return True

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds between this event and ``end`` (both recorded and finished)."""
        if not (self.timing and end.timing):
            raise ValueError("end: both events need timing=True to measure elapsed time")
        self.device.activate()
        return float(drv("cuEventElapsedTime", self._handle, end.handle))

    def close(self) -> None:
        """Destroy the event."""
        self._finalizer()

    def __enter__(self) -> Event:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
