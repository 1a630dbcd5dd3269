"""Streams and events."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import ClosedError
from ..types import DeviceLike, StreamLike
from ._bindings import cu, drv, finalizer
from .device import resolve
from .interop import is_torch

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from .graph import Graph

__all__ = ["Event", "Stream", "call_stream", "stream_handle", "stream_key", "torch_stream"]


class Stream:
    """A CUDA stream: an ordered queue of device work.

    Args:
        device: the device to create it on (a Device, an int, a ``torch.device`` or
            ``"cuda:N"``; default: device 0).
        non_blocking: when True the stream does not synchronise with the legacy default
            stream (``CU_STREAM_NON_BLOCKING``).
    """

    def __init__(self, device: DeviceLike = None, *, non_blocking: bool = False) -> None:
        self.device = resolve(device)
        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING if non_blocking else 0
        self._handle = drv("cuStreamCreate", flags)
        self._handle_int = int(self._handle)
        self._closed = False
        self._finalizer = finalizer(self, "cuStreamDestroy", self._handle)

    @classmethod
    def from_handle(cls, handle: int, device: DeviceLike = None) -> Stream:
        """Wrap a stream made elsewhere (e.g. ``torch.cuda.current_stream().cuda_stream``).

        The stream is borrowed: closing the wrapper does not destroy it.
        """
        self = cls.__new__(cls)
        self.device = resolve(device)
        self._handle = cu.CUstream(int(handle))
        self._handle_int = int(handle)
        self._closed = False
        self._finalizer = finalizer(self, None)
        return self

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("Stream")

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol (cuda.core, PyTorch, CuPy): (version 0, handle)."""
        self._check_open()
        return 0, self._handle_int

    @property
    def handle(self) -> Any:
        """The ``CUstream`` handle.

        Raises:
            ClosedError: the stream was closed (as every method then does).
        """
        if self._closed:
            raise ClosedError("Stream")
        return self._handle

    def synchronize(self) -> None:
        """Block the host until all work queued on this stream has finished."""
        handle = self.handle
        self.device.activate()
        drv("cuStreamSynchronize", handle)

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (no host blocking)."""
        handle = self.handle
        self.device.activate()
        drv("cuStreamWaitEvent", handle, event.handle, 0)

    def capture(self) -> AbstractContextManager[Graph]:
        """Capture the work queued on this stream inside a ``with`` block into a Graph.

        Returns:
            A context manager yielding the (still empty) Graph, filled when the block ends.
        """
        from .graph import capture

        self._check_open()
        return capture(self)

    def close(self) -> None:
        """Destroy the stream (pending work still completes). Every later use of it raises
        `ClosedError`, as does a cache made on it; closing again does nothing."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return "Stream(closed)" if self._closed else f"Stream(handle=0x{self._handle_int:x})"


def stream_handle(stream: Any) -> Any:
    """The CUstream for ``stream``: a Stream, None (the legacy default stream), an int
    handle, or any object with ``__cuda_stream__`` (cuda.core, PyTorch, CuPy) or a
    ``cuda_stream`` (PyTorch) or ``ptr`` (CuPy) attribute."""
    if stream is None:
        return cu.CUstream(0)
    if isinstance(stream, Stream):
        return stream.handle  # raises ClosedError for a closed one
    if isinstance(stream, cu.CUstream):
        return stream
    return cu.CUstream(stream_key(stream))


def stream_key(stream: Any) -> int:
    """The integer handle of ``stream`` (any form ``stream_handle`` takes); 0 for the legacy
    default stream.

    Raises:
        TypeError: ``stream`` is none of those forms.
    """
    if stream is None:
        return 0
    if type(stream) is Stream:
        if stream._closed:
            raise ClosedError("Stream")
        return stream._handle_int
    if isinstance(stream, int) and not isinstance(stream, bool):
        if stream < 0:
            raise ValueError(f"stream: a handle is >= 0, got {stream}")
        return stream
    value = getattr(stream, "cuda_stream", None)  # PyTorch (cheaper than its protocol)
    if isinstance(value, int):
        return value
    if isinstance(stream, Stream):
        stream._check_open()
        return stream._handle_int
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        pair = protocol()
        if isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], int):
            return pair[1]
    if isinstance(stream, cu.CUstream):
        return int(stream)
    value = getattr(stream, "ptr", None)  # CuPy
    if isinstance(value, int):
        return value
    raise TypeError(
        f"stream: expected a ferrox_driver.Stream, None, an int handle or an object with "
        f"__cuda_stream__ (PyTorch, CuPy, cuda.core), got {type(stream).__name__}"
    )


_torch_current: Callable[[int], int] | None = None  # torch's current-stream reader, once found


def torch_stream(ordinal: int) -> int:
    """The int handle of PyTorch's current stream on device ``ordinal``
    (``torch.cuda.current_stream(ordinal).cuda_stream``): what ``stream=None`` means for
    calls on PyTorch tensors. Only called once a tensor was passed, so torch is imported
    already; its raw reader (the one Inductor's generated code calls) is looked up once."""
    read = _torch_current
    if read is None:
        read = _find_torch_current()
    return read(ordinal)


def _find_torch_current() -> Callable[[int], int]:
    global _torch_current
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def public(ordinal: int) -> int:
        return int(torch.cuda.current_stream(ordinal).cuda_stream)

    _torch_current = read = public if raw is None else raw
    return read


def call_stream(stream: Any, array: Any, ordinal: int | None = None) -> Any:
    """The stream a call on device array ``array`` runs on: ``stream`` as given, or for
    ``stream=None`` with a PyTorch CUDA tensor, the int handle of PyTorch's current stream
    on its device (``ordinal``, default the tensor's), so that work inside ``with
    torch.cuda.stream(s)`` or a ``torch.cuda.graph`` capture runs on ``s``. Costs one dict
    lookup otherwise."""
    if stream is None and is_torch(array):
        at = array.get_device() if ordinal is None else ordinal
        if at >= 0:  # (a CPU tensor: refused by the caller's checks)
            return torch_stream(at)
    return stream


class Event:
    """A CUDA event: a marker in a stream, for ordering and timing.

    Args:
        timing: record timestamps (needed for `elapsed_ms`).
        device: the device (default: device 0).
    """

    def __init__(self, timing: bool = True, *, device: DeviceLike = None) -> None:
        self.device = resolve(device)
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT
        if not timing:
            flags = cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.timing = timing
        self._handle = drv("cuEventCreate", flags)
        self._closed = False
        self._finalizer = finalizer(self, "cuEventDestroy", self._handle)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("Event")

    @property
    def handle(self) -> Any:
        """The ``CUevent`` handle.

        Raises:
            ClosedError: the event was closed (as every method then does).
        """
        if self._closed:
            raise ClosedError("Event")
        return self._handle

    def record(self, stream: StreamLike = None) -> Event:
        """Record this event on ``stream`` (default: the legacy default stream)."""
        handle, s = self.handle, stream_handle(stream)
        self.device.activate()
        drv("cuEventRecord", handle, s)
        return self

    def synchronize(self) -> None:
        """Block the host until the work before the recorded point has finished."""
        handle = self.handle
        self.device.activate()
        drv("cuEventSynchronize", handle)

    def query(self) -> bool:
        """True when the recorded work has finished; never blocks."""
        handle = self.handle
        self.device.activate()
        status = cu.cuEventQuery(handle)[0]
        if status == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        drv("cuEventQuery", handle)  # raises for any real error
        return True

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds between this event and ``end`` (both recorded and finished).

        Raises:
            ClosedError: either event was closed.
        """
        if not isinstance(end, Event):
            raise TypeError(f"end: expected a ferrox_driver.Event, got {type(end).__name__}")
        start, stop = self.handle, end.handle
        if not (self.timing and end.timing):
            raise ValueError("end: both events need timing=True to measure elapsed time")
        self.device.activate()
        return float(drv("cuEventElapsedTime", start, stop))

    def close(self) -> None:
        """Destroy the event; closing again does nothing."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> Event:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
