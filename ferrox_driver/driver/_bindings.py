"""The one module that talks to cuda.bindings: calls, result checking, library discovery.

Everything else in ferrox_driver calls `drv` / `rtc` (or uses the re-exported
``cu`` enums) so that a missing driver, a failing call and a version difference between
cuda-bindings 12.x and 13.x are handled in one place.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from cuda.bindings import driver as cu
from cuda.bindings import nvrtc as _nvrtc

from ..errors import CudaError, NoDeviceError

try:  # cuda-bindings >= 12.9 finds libraries through cuda.pathfinder
    from cuda.pathfinder import DynamicLibNotFoundError as _LibNotFound
except ImportError:  # pragma: no cover - older bindings raise a plain RuntimeError
    _LibNotFound = RuntimeError

__all__ = [
    "capture_keep",
    "check",
    "cu",
    "driver_version",
    "drv",
    "init",
    "nvrtc_version",
    "rtc",
]

NO_DRIVER_MESSAGE = (
    "no NVIDIA driver found (libcuda could not be loaded): install the NVIDIA driver to use "
    "the GPU, or stay on the CPU (compile_source with arch=..., reference_gqa_decode)"
)

_NO_NVRTC_MESSAGE = (
    "the NVRTC library could not be loaded: install it with "
    "`pip install 'cuda-toolkit[nvrtc]'` (or reinstall ferrox-driver)"
)

_HINTS = {
    "CUDA_ERROR_OUT_OF_MEMORY": "the GPU has too little free memory: free buffers, or ask for less",
    "CUDA_ERROR_UNSUPPORTED_PTX_VERSION": (
        "the driver is older than NVRTC: ferrox compiles to cubin for this reason; "
        "update the driver or install an NVRTC no newer than the driver"
    ),
    "CUDA_ERROR_NO_BINARY_FOR_GPU": "the cubin was built for another architecture",
    "CUDA_ERROR_NOT_INITIALIZED": "call through ferrox_driver.Device so the driver is initialised",
    "CUDA_ERROR_INVALID_CONTEXT": "no current context on this thread: use ferrox_driver.Device",
    "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED": (
        "this operation is not allowed while the stream is being captured into a graph"
    ),
    "CUDA_ERROR_ILLEGAL_ADDRESS": (
        "a kernel read or wrote outside its buffers; the context is now unusable: restart the "
        "process"
    ),
}


def _describe_cu(err: Any) -> tuple[str, str]:
    name = getattr(err, "name", str(err))
    try:
        res, text = cu.cuGetErrorString(err)
        desc = text.decode() if res == cu.CUresult.CUDA_SUCCESS and text else name
    except Exception:  # the driver itself may be missing
        desc = name
    return name, desc


def check(result: Any, call: str) -> Any:
    """Unpack a cuda-bindings result tuple, raising CudaError on a failed status.

    Args:
        result: what a cuda.bindings function returned: ``(status, *values)``.
        call: the API function's name, used in the error.

    Returns:
        None, the single value, or a tuple of values, after the status.

    Raises:
        CudaError: when the status is not success.
    """
    if not isinstance(result, tuple):
        result = (result,)
    status, values = result[0], result[1:]
    if isinstance(status, cu.CUresult):
        if status != cu.CUresult.CUDA_SUCCESS:
            name, desc = _describe_cu(status)
            raise CudaError(int(status), name, call, desc, _HINTS.get(name, ""))
    elif isinstance(status, _nvrtc.nvrtcResult) and status != _nvrtc.nvrtcResult.NVRTC_SUCCESS:
        try:
            text = _nvrtc.nvrtcGetErrorString(status)[1].decode()
        except Exception:
            text = status.name
        raise CudaError(int(status), status.name, call, text)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


# Per thread: how many stream captures it has open, and the releases they held back.
_capture = threading.local()


def release(call: str | Callable[..., Any], *args: Any) -> None:
    """Call a driver destroy/free function (by name) or a release function from a
    finalizer: never raises, also at shutdown.

    While this thread is capturing a stream (see `capturing`) the call is held back
    until the capture ends: a free or unload inside a capture (a finalizer run by the
    garbage collector, say) would invalidate it."""
    if getattr(_capture, "depth", 0):
        _capture.held.append((call, args))
        return
    with contextlib.suppress(Exception):
        (call if callable(call) else getattr(cu, call))(*args)


@contextlib.contextmanager
def capturing() -> Iterator[list[Any]]:
    """Mark the current thread as capturing a stream for the duration of the block; the
    releases held back meanwhile run when the outermost such block ends. Yields the list of
    objects that work queued in the block asked to keep alive (``capture_keep``): the
    graph holds them."""
    depth = getattr(_capture, "depth", 0)
    if depth == 0:
        _capture.held = []
        _capture.keep = []
    _capture.depth = depth + 1
    try:
        yield _capture.keep
    finally:
        _capture.depth = depth
        if depth == 0:
            held, _capture.held = _capture.held, []
            _capture.keep = []
            for call, args in held:
                release(call, *args)


def capture_keep(*objects: Any) -> bool:
    """Inside a capture on this thread (``capturing``), keep ``objects`` alive as long as
    the graph it makes, and return True; outside one, return False."""
    if getattr(_capture, "depth", 0):
        _capture.keep.extend(objects)
        return True
    return False


def finalizer(owner: object, call: str | Callable[..., Any] | None, *args: Any) -> Any:
    """A weakref.finalize that releases a handle with ``call`` when ``owner`` goes away
    (or when called, as ``close()`` does); ``call=None`` for borrowed handles. It does not
    run at interpreter exit, where the driver reclaims everything itself."""
    fin = weakref.finalize(owner, release, call, *args) if call else weakref.finalize(owner, _noop)
    fin.atexit = False
    return fin


def _noop() -> None:
    pass


def drv(call: str, *args: Any) -> Any:
    """Call ``cuda.bindings.driver.<call>(*args)`` and check its status.

    Raises:
        NoDeviceError: when the driver library cannot be loaded.
        CudaError: when the call fails.
    """
    fn = getattr(cu, call)
    try:
        result = fn(*args)
    except _LibNotFound:
        # the sentence says it all; the loader's 40-line traceback would bury it
        raise NoDeviceError(NO_DRIVER_MESSAGE) from None
    return check(result, call)


def rtc(call: str, *args: Any) -> Any:
    """Call ``cuda.bindings.nvrtc.<call>(*args)`` and check its status."""
    fn = getattr(_nvrtc, call)
    try:
        result = fn(*args)
    except _LibNotFound:
        raise NoDeviceError(_NO_NVRTC_MESSAGE) from None
    return check(result, call)


def nvrtc_compile(prog: Any, options: Sequence[str]) -> str | None:
    """Run nvrtcCompileProgram. Returns None on success, else the failing status's name
    (the caller reads the log and raises CompileError)."""
    encoded = [o.encode() for o in options]
    result = rtc_raw("nvrtcCompileProgram", prog, len(encoded), encoded)
    status = result[0]
    return None if status == _nvrtc.nvrtcResult.NVRTC_SUCCESS else str(status.name)


def rtc_raw(call: str, *args: Any) -> Any:
    """Call an NVRTC function and return its raw result tuple (status unchecked)."""
    try:
        return getattr(_nvrtc, call)(*args)
    except _LibNotFound:
        raise NoDeviceError(_NO_NVRTC_MESSAGE) from None


_init_lock = threading.Lock()
_init_error: NoDeviceError | None = None
_initialised = False


def init() -> None:
    """Initialise the driver once per process; remember and re-raise a failure.

    Raises:
        NoDeviceError: no driver, no device, or a driver too old for these bindings.
    """
    global _initialised, _init_error
    if _initialised:
        return
    with _init_lock:
        if _initialised:
            return
        if _init_error is None:
            try:
                drv("cuInit", 0)
                _initialised = True
                return
            except NoDeviceError as exc:
                _init_error = exc
            except CudaError as exc:
                _init_error = NoDeviceError(_explain_init_failure(exc))
                _init_error.__cause__ = exc
            except (RuntimeError, OSError) as exc:  # loader errors of older bindings
                _init_error = NoDeviceError(f"{NO_DRIVER_MESSAGE} ({exc})")
        raise _again(_init_error)


def _again(error: NoDeviceError) -> NoDeviceError:
    """A fresh copy of the first failure, to raise once more: raising the stored exception
    itself would append each call's frames to its traceback."""
    again = NoDeviceError(*error.args)
    again.__cause__ = error.__cause__  # cuInit's CudaError, or None (no chained traceback)
    return again


def _explain_init_failure(exc: CudaError) -> str:
    if exc.name == "CUDA_ERROR_NO_DEVICE":
        return (
            "the NVIDIA driver is installed but sees no CUDA device (cuInit: CUDA_ERROR_NO_DEVICE)"
        )
    if exc.name == "CUDA_ERROR_INSUFFICIENT_DRIVER":
        return (
            "the NVIDIA driver is older than these cuda-bindings need "
            "(cuInit: CUDA_ERROR_INSUFFICIENT_DRIVER): update the driver or install "
            "cuda-bindings of the driver's CUDA major version"
        )
    return f"the CUDA driver failed to initialise: {exc}"


def driver_version() -> int | None:
    """The driver's CUDA version as an int (13000 for 13.0), or None without a driver."""
    try:
        return int(drv("cuDriverGetVersion"))
    except (NoDeviceError, CudaError, RuntimeError, OSError):
        return None


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor) version."""
    major, minor = rtc("nvrtcVersion")
    return int(major), int(minor)


def bindings_version() -> str:
    """The installed cuda-bindings version string."""
    try:
        from cuda.bindings import __version__

        return str(__version__)
    except ImportError:  # pragma: no cover
        return "unknown"
