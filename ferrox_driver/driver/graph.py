"""CUDA graphs: stream capture, graphs and their executable instances."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import ClosedError, CudaError
from ..types import StreamLike
from ._bindings import capture_keep, capturing, cu, drv, finalizer, release
from .device import Device
from .stream import Stream, stream_handle

__all__ = [
    "Graph",
    "GraphExec",
    "capture",
    "graph_stats",
    "keep_for_capture",
    "relaxed_capture",
    "stream_capturing",
]

_CAPTURING = cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
_captured: list[Any] = []  # what graphs captured outside ferrox use, kept for the process


def stream_capturing(handle: int) -> bool:
    """Whether the stream with int handle ``handle`` is being captured into a graph."""
    result = cu.cuStreamIsCapturing(cu.CUstream(handle))
    return len(result) > 1 and result[1] == _CAPTURING


@contextlib.contextmanager
def relaxed_capture() -> Iterator[None]:
    """This thread's stream-capture mode relaxed for the block: allocating device memory
    and loading a module (a decode's first use: its scratch, its kernels) are then allowed
    while another library's capture (PyTorch's, whose mode is thread-local or global) is
    open; neither is captured. The thread's own mode comes back at the end."""
    relaxed = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    before = drv("cuThreadExchangeStreamCaptureMode", relaxed)
    try:
        yield
    finally:
        drv("cuThreadExchangeStreamCaptureMode", before)


def keep_for_capture(stream_id: int, foreign: bool, *objects: Any) -> bool:
    """When the stream is being captured, keep ``objects`` alive as long as the graph can
    run: with the graph for ferrox's own captures, for the process for any other (a
    PyTorch or CuPy graph, whose life ferrox cannot see). Returns whether it is captured.
    Only ``foreign`` streams (not ferrox's, not the legacy default) are asked of the
    driver: the legacy default stream cannot be captured, and ferrox's captures mark the
    thread."""
    if capture_keep(*objects):
        return True
    if foreign and stream_capturing(stream_id):
        _captured.extend(objects)
        return True
    return False


@dataclass
class GraphStats:
    """Counters for tests and diagnostics."""

    captures: int = 0
    instantiations: int = 0
    updates: int = 0


graph_stats = GraphStats()


def _kept(objects: tuple[object, ...], *, strict: bool = True) -> list[Any]:
    """``objects`` and the device resources each holds (``_resources()``: a DeviceArray's
    memory, a cache's buffers), so that closing one of them later frees nothing a graph
    still uses.

    Raises:
        ClosedError: ``strict``, and one of them is closed already (not strict: it is kept
            as it is, and instantiating the graph raises).
    """
    kept: list[Any] = []
    for obj in objects:
        kept.append(obj)
        resources = getattr(obj, "_resources", None)
        if resources is not None:
            try:
                kept.extend(resources())
            except ClosedError:
                if strict:
                    raise
    return kept


def _guards(kept: list[Any]) -> tuple[Any, ...]:
    """The kept objects that can be closed (one per identity)."""
    seen: dict[int, Any] = {}
    for obj in kept:
        if hasattr(obj, "_check_open") and not isinstance(obj, type):
            seen.setdefault(id(obj), obj)
    return tuple(seen.values())


def _hooks(kept: list[Any]) -> tuple[Any, ...]:
    """What each launch must call first (``_on_graph_launch`` of kept objects)."""
    return tuple(obj._on_graph_launch for obj in kept if hasattr(obj, "_on_graph_launch"))


class Graph:
    """A captured CUDA graph. Made by ``Stream.capture()``.

    What the captured work uses (device arrays, caches, pooled outputs, launch records)
    is held by the graph and by every GraphExec made from it; more can be attached with
    `keep_alive`. Closing such an object frees nothing while a graph holds it, and a
    GraphExec refuses to launch once one of them was closed (`ClosedError`).
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self._handle: Any = None
        self._closed = False
        self._finalizer = finalizer(self, None)
        self._keep: list[Any] = []

    def _adopt(self, handle: Any) -> None:
        self._handle = handle
        self._finalizer = finalizer(self, "cuGraphDestroy", handle)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("Graph")

    @property
    def handle(self) -> Any:
        """The ``CUgraph`` handle.

        Raises:
            ClosedError: the graph was closed.
            ValueError: the capture has not ended yet.
        """
        if self._handle is None:
            self._check_open()
            raise ValueError("graph: the capture has not ended yet")
        return self._handle

    def keep_alive(self, *objects: object) -> None:
        """Keep ``objects`` (and the device memory they hold) alive as long as this graph
        and its executables.

        Raises:
            ClosedError: one of them is closed already.
        """
        self._check_open()
        self._keep.extend(_kept(objects))

    def node_count(self) -> int:
        """Number of nodes captured."""
        _, count = drv("cuGraphGetNodes", self.handle, 0)
        return int(count)

    def instantiate(self) -> GraphExec:
        """An executable instance of this graph."""
        return GraphExec(self)

    def close(self) -> None:
        """Destroy the graph (executables already made stay valid: they keep what its nodes
        point at themselves) and drop its references to those buffers. Closing again
        does nothing."""
        self._closed = True
        self._finalizer()
        self._handle = None
        self._keep = []


class GraphExec:
    """An instantiated graph: launched as one unit, replayed as often as needed.

    It holds what the graph's work uses (see `Graph`): ``launch`` raises `ClosedError`
    when one of those objects (an array, a cache, a stream it depends on) was closed,
    rather than run kernels over memory its owner gave up.
    """

    def __init__(self, graph: Graph) -> None:
        self.device = graph.device
        handle = graph.handle
        for guard in _guards(graph._keep):
            guard._check_open()
        self.device.activate()
        self._handle = drv("cuGraphInstantiate", handle, 0)
        self._closed = False
        self._finalizer = finalizer(self, "cuGraphExecDestroy", self._handle)
        self._keep = list(graph._keep)  # what the nodes point at outlives the graph
        self._guards = _guards(self._keep)
        self._hooks = _hooks(self._keep)
        self.node_count = graph.node_count()
        graph_stats.instantiations += 1

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("GraphExec")

    @property
    def handle(self) -> Any:
        """The ``CUgraphExec`` handle.

        Raises:
            ClosedError: it was closed.
        """
        if self._closed:
            raise ClosedError("GraphExec")
        return self._handle

    def launch(self, stream: StreamLike = None) -> None:
        """Queue one replay of the graph on ``stream``.

        Raises:
            ClosedError: this executable, ``stream``, or an object the graph uses was
                closed (nothing is launched).
        """
        handle, s = self.handle, stream_handle(stream)
        for guard in self._guards:
            try:
                guard._check_open()
            except ClosedError as exc:
                raise ClosedError(
                    "GraphExec", f"uses a {exc.what} that was closed: {exc}"
                ) from None
        for hook in self._hooks:  # e.g. a cache appended to learns its length changed
            hook()
        self.device.activate()
        drv("cuGraphLaunch", handle, s)

    def update(self, graph: Graph) -> None:
        """Update this executable in place to ``graph`` (same topology, new parameters).

        Raises:
            CudaError: the driver refused; ``.name`` then carries its update result
                (e.g. ``CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED``).
        """
        handle, new = self.handle, graph.handle
        self.device.activate()
        result = cu.cuGraphExecUpdate(handle, new)
        status, info = result[0], result[1] if len(result) > 1 else None
        if status != cu.CUresult.CUDA_SUCCESS:
            raise CudaError(
                int(status),
                status.name,
                "cuGraphExecUpdate",
                f"the executable graph cannot take the new graph's changes "
                f"(update result: {self._update_result(info, graph)})",
                "capture the new graph with the same kernels and copies, or instantiate it",
            )
        self._keep = list(graph._keep)
        self._guards = _guards(self._keep)
        self._hooks = _hooks(self._keep)
        graph_stats.updates += 1

    def _update_result(self, info: Any, graph: Graph) -> str:
        """The driver's CUgraphExecUpdateResult, or our best reading of it: cuda-bindings
        returns no result info when the update fails."""
        result = getattr(info, "result", None)
        if result is not None:
            return str(getattr(result, "name", result))
        new_nodes = graph.node_count()
        if new_nodes != self.node_count:
            return (
                f"CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED ({self.node_count} nodes "
                f"instantiated, {new_nodes} in the new graph)"
            )
        return "CU_GRAPH_EXEC_UPDATE_ERROR (a node's kind, function or context changed)"

    def close(self) -> None:
        """Destroy the executable graph and let go of what it held; closing again does
        nothing."""
        self._closed = True
        self._finalizer()
        self._keep = []
        self._guards = ()
        self._hooks = ()

    def __enter__(self) -> GraphExec:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def capture(stream: Stream) -> Iterator[Graph]:
    """Capture the work queued on ``stream`` inside the block into a Graph.

    An exception inside the block ends the capture, discards what was captured and leaves
    the stream usable; the exception propagates.
    """
    if not isinstance(stream, Stream):
        raise TypeError(f"stream: expected a ferrox_driver.Stream, got {type(stream).__name__}")
    if int(stream.handle) == 0:  # (a closed stream raises ClosedError here)
        raise ValueError("stream: the legacy default stream cannot be captured; use Stream()")
    stream.device.activate()
    graph = Graph(stream.device)
    mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    with capturing() as kept:  # frees and unloads by finalizers wait for the capture's end
        drv("cuStreamBeginCapture", stream.handle, mode)
        try:
            yield graph
        except BaseException:
            result = cu.cuStreamEndCapture(stream.handle)
            if len(result) > 1 and result[1] is not None and int(result[1]):
                release("cuGraphDestroy", result[1])
            raise
        graph._adopt(drv("cuStreamEndCapture", stream.handle))
        # What the captured work writes or reads (decode scratch, pooled outputs, launch
        # records, the arrays and caches it was given) lives as long as the graph.
        graph._keep.extend(_kept(tuple(kept), strict=False))
    graph_stats.captures += 1
