"""Devices and their primary contexts; whether CUDA is usable at all."""

from __future__ import annotations

import sys
import threading
from typing import Any

from ..archs import MIN_COMPUTE_CAPABILITY
from ..errors import ClosedError, NoDeviceError, UnsupportedDeviceError
from ..types import DeviceLike
from ._bindings import cu, drv, finalizer, init

__all__ = [
    "Device",
    "cuda_available",
    "default_device",
    "device_count",
    "device_for",
    "ordinal_of",
]

_A = cu.CUdevice_attribute
_tls = threading.local()


def cuda_available() -> bool:
    """True when a CUDA driver is installed and sees at least one device. Never raises."""
    try:
        return device_count() > 0
    except Exception:
        return False


def device_count() -> int:
    """Number of CUDA devices the driver sees.

    Raises:
        NoDeviceError: without a usable driver.
    """
    init()
    return int(drv("cuDeviceGetCount"))


class Device:
    """One CUDA device, holding a reference on its primary context.

    The primary context is the one PyTorch, CuPy and Numba use too, so device memory and
    streams can be shared with them in one process.

    Args:
        ordinal: the device index, 0-based.

    Raises:
        NoDeviceError: no driver or no such device.
        UnsupportedDeviceError: a device older than Turing (compute capability below 7.5;
            a NoDeviceError too).

    ``close()`` releases this object's reference only: the process keeps one of its own on
    each device it used, so memory and kernels made through a closed Device stay valid;
    the closed Device itself (and what is made through it later) raises `ClosedError`.
    """

    def __init__(self, ordinal: int = 0) -> None:
        self._open(ordinal)
        device_for(ordinal)  # the process's own reference keeps the context alive

    def _open(self, ordinal: int) -> None:
        self._shared = False
        if not isinstance(ordinal, int) or isinstance(ordinal, bool):
            raise TypeError(f"ordinal: expected an int, got {type(ordinal).__name__}")
        count = device_count()
        if not 0 <= ordinal < count:
            raise NoDeviceError(f"ordinal: device {ordinal} does not exist ({count} device(s))")
        self.ordinal = ordinal
        self._dev = drv("cuDeviceGet", ordinal)
        # (name and compute capability need no context: an unsupported device is refused
        # before its primary context is touched)
        self.name: str = drv("cuDeviceGetName", 256, self._dev).split(b"\0", 1)[0].decode()
        cc = (
            _A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            _A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
        )
        major, minor = (int(drv("cuDeviceGetAttribute", a, self._dev)) for a in cc)
        self.compute_capability: tuple[int, int] = (major, minor)
        if self.compute_capability < MIN_COMPUTE_CAPABILITY:
            raise UnsupportedDeviceError(
                ordinal, self.name, self.compute_capability, MIN_COMPUTE_CAPABILITY
            )
        self._ctx = drv("cuDevicePrimaryCtxRetain", self._dev)
        self._ctx_int = int(self._ctx)
        self._finalizer = finalizer(self, "cuDevicePrimaryCtxRelease", self._dev)
        self.activate()
        self.multiprocessor_count: int = self.attribute(_A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.l2_cache_bytes: int = self.attribute(_A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        self.max_shared_per_block_optin: int = self.attribute(
            _A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        )
        self.total_memory: int = int(drv("cuDeviceTotalMem", self._dev))

    @property
    def arch(self) -> str:
        """The NVRTC target of this device, e.g. ``"sm_90"``."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    @property
    def context_handle(self) -> int:
        """The primary context as an integer handle."""
        return self._ctx_int

    def attribute(self, attr: int) -> int:
        """Read one ``CU_DEVICE_ATTRIBUTE_*`` value."""
        self._check_open()
        return int(drv("cuDeviceGetAttribute", attr, self._dev))

    def activate(self) -> None:
        """Make this device's primary context current on the calling thread (cached)."""
        if getattr(_tls, "ctx", None) != self._ctx_int:
            # (a closed Device's context lives on: the process holds it, so what was made
            # through this Device keeps working)
            drv("cuCtxSetCurrent", self._ctx)
            _tls.ctx = self._ctx_int

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return not self._finalizer.alive

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise ClosedError("Device")

    def synchronize(self) -> None:
        """Wait for all work on this device to finish."""
        self._check_open()
        self.activate()
        drv("cuCtxSynchronize")

    def mem_info(self) -> tuple[int, int]:
        """(free, total) device memory in bytes."""
        self._check_open()
        self.activate()
        free, total = drv("cuMemGetInfo")
        return int(free), int(total)

    def close(self) -> None:
        """Release this object's reference on the primary context (the process-wide
        Device that calls without ``device=`` use is never closed). Closing again does
        nothing."""
        if self._shared:
            return
        self._finalizer()

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        closed = ", closed" if self.closed else ""
        return f"Device({self.ordinal}: {self.name}, {self.arch}{closed})"


_devices_lock = threading.Lock()
_devices: dict[int, Device] = {}


def device_for(ordinal: int) -> Device:
    """The process-wide Device of ``ordinal`` (made once; ``default_device`` is ordinal 0's),
    made current here.

    Raises:
        NoDeviceError: no driver or no such device.
    """
    dev = _devices.get(ordinal)
    if dev is None:
        with _devices_lock:
            dev = _devices.get(ordinal)
            if dev is None:
                dev = Device.__new__(Device)
                dev._open(ordinal)
                dev._shared = True
                _devices[ordinal] = dev
    dev.activate()
    return dev


def default_device() -> Device:
    """The process-wide Device(0) that calls without ``device=`` use, made current here."""
    return device_for(0)


def resolve(device: DeviceLike) -> Device:
    """The given device made current, or the default one: ``device`` is a Device, an int
    ordinal, a ``torch.device`` or a string ``"cuda[:N]"`` (see ``ordinal_of``).

    Raises:
        ClosedError: ``device`` was closed.
        TypeError, ValueError: ``device`` names no CUDA device (see ``ordinal_of``).
        NoDeviceError: no driver or no such device.
    """
    if device is None:
        return default_device()
    if not isinstance(device, Device):
        return device_for(ordinal_of(device))
    device._check_open()
    device.activate()
    return device


def ordinal_of(device: Any) -> int:
    """The ordinal of the device that ``device`` names, without a driver call: a Device's,
    an int (>= 0), a ``torch.device("cuda", i)`` or ``"cuda:i"``; with no index (``"cuda"``),
    PyTorch's current device where PyTorch has set up CUDA, else 0 (torch is never imported).

    Raises:
        TypeError, ValueError: naming ``device``.
    """
    if isinstance(device, Device):
        return device.ordinal
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"device: expected an ordinal >= 0, got {device}")
        return device
    cls = type(device)
    if isinstance(device, str) or (cls.__module__ == "torch" and cls.__name__ == "device"):
        kind, sep, index = str(device).partition(":")
        if kind != "cuda" or (sep and not index.isdigit()):
            raise ValueError(f"device: expected a CUDA device ('cuda' or 'cuda:N'), got {device!r}")
        if index:
            return int(index)
        torch = sys.modules.get("torch")  # (a torch.device: torch is imported)
        cuda = getattr(torch, "cuda", None)
        return int(cuda.current_device()) if cuda is not None and cuda.is_initialized() else 0
    raise TypeError(
        f"device: expected a ferrox_driver.Device, an int ordinal, a torch.device or 'cuda:N', "
        f"got {cls.__name__}"
    )
