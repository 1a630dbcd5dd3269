"""CUDA graphs: stream capture, graphs and their executable instances."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ._driver import capturing, cu, drv, finalizer, release
from .device import Device
from .errors import CudaError
from .stream import Stream, stream_handle
from .types import StreamLike

__all__ = ["Graph", "GraphExec", "capture", "graph_stats"]


@dataclass
class GraphStats:
    """Counters for tests and diagnostics."""

    captures: int = 0
    instantiations: int = 0
    updates: int = 0


graph_stats = GraphStats()


class Graph:
    """A captured CUDA graph. Made by ``Stream.capture()``.

    Objects the graph's nodes refer to (host staging, device buffers) can be attached with
    `keep_alive`; they live as long as the graph and every GraphExec made from it.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self._handle: Any = None
        self._finalizer = finalizer(self, None)
        self._keep: list[Any] = []

    def _adopt(self, handle: Any) -> None:
        self._handle = handle
        self._finalizer = finalizer(self, "cuGraphDestroy", handle)

    @property
    def handle(self) -> Any:
        """The ``CUgraph`` handle (None until the capture has ended)."""
        if self._handle is None:
            raise ValueError("graph: the capture has not ended yet, or the graph was closed")
        return self._handle

    def keep_alive(self, *objects: object) -> None:
        """Keep ``objects`` alive as long as this graph and its executables."""
        self._keep.extend(objects)

    def node_count(self) -> int:
        """Number of nodes captured."""
        _, count = drv("cuGraphGetNodes", self.handle, 0)
        return int(count)

    def instantiate(self) -> GraphExec:
        """An executable instance of this graph."""
        return GraphExec(self)

    def close(self) -> None:
        """Destroy the graph (executables already made stay valid: they keep what its nodes
        point at themselves) and drop its references to those buffers."""
        self._finalizer()
        self._handle = None
        self._keep = []


class GraphExec:
    """An instantiated graph: launched as one unit, replayed as often as needed."""

    def __init__(self, graph: Graph) -> None:
        self.device = graph.device
        self.device.activate()
        self._handle = drv("cuGraphInstantiate", graph.handle, 0)
        self._finalizer = finalizer(self, "cuGraphExecDestroy", self._handle)
        self._keep = list(graph._keep)  # what the nodes point at outlives the graph
        self.node_count = graph.node_count()
        graph_stats.instantiations += 1

    @property
    def handle(self) -> Any:
        """The ``CUgraphExec`` handle."""
        return self._handle

    def launch(self, stream: StreamLike = None) -> None:
        """Queue one replay of the graph on ``stream``."""
        self.device.activate()
        drv("cuGraphLaunch", self._handle, stream_handle(stream))

    def update(self, graph: Graph) -> None:
        """Update this executable in place to ``graph`` (same topology, new parameters).

        Raises:
            CudaError: the driver refused; ``.name`` then carries its update result
                (e.g. ``CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED``).
        """
        self.device.activate()
        result = cu.cuGraphExecUpdate(self._handle, graph.handle)
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
        """Destroy the executable graph."""
        self._finalizer()
        self._keep = []

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
    if int(stream.handle) == 0:
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
        # records) lives as long as the graph.
        graph.keep_alive(*kept)
    graph_stats.captures += 1
