"""The driver calls that code above the driver layer makes, by name.

``drv(name, *args)`` calls a driver function and checks its status (a missing driver
becomes NoDeviceError, a failure CudaError naming the call). The per-token paths (appends,
graph replays) call three functions so often that a checked, looked-up call shows in their
cost: they get the raw callables, bound once, and check the status themselves against
``SUCCESS``. ``capture_state`` is the thread's record of ferrox's open captures (its
``depth`` attribute is non-zero inside one), read directly on the hot path for the same
reason. The ``cu`` namespace itself stays in the driver layer.
"""

from __future__ import annotations

from typing import Any

from ._bindings import _capture as capture_state
from ._bindings import (
    bindings_version,
    capture_keep,
    check,
    cu,
    driver_version,
    drv,
    nvrtc_version,
)

__all__ = [
    "SUCCESS",
    "bindings_version",
    "capture_keep",
    "capture_state",
    "check",
    "driver_version",
    "drv",
    "graph_launch_raw",
    "memcpy_htod_raw",
    "nvrtc_version",
    "stream_of",
    "stream_sync_raw",
]

SUCCESS = cu.CUresult.CUDA_SUCCESS
memcpy_htod_raw = cu.cuMemcpyHtoDAsync  # (dst, src, nbytes, stream) -> (CUresult,)
graph_launch_raw = cu.cuGraphLaunch  # (exec, stream) -> (CUresult,)
stream_sync_raw = cu.cuStreamSynchronize  # (stream) -> (CUresult,)


def stream_of(handle: int) -> Any:
    """The driver's stream object for an int handle (0: the legacy default stream)."""
    return cu.CUstream(handle)
