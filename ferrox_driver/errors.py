"""Exception types raised by ferrox_driver."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class FerroxError(Exception):
    """Base class of every error ferrox_driver raises (besides ValueError/TypeError)."""


class NoDeviceError(FerroxError):
    """No NVIDIA driver or no CUDA device: GPU work is impossible in this process."""


class CudaError(FerroxError):
    """A CUDA driver or NVRTC call failed.

    Attributes:
        code: the numeric CUresult / nvrtcResult.
        name: its symbolic name, e.g. ``CUDA_ERROR_INVALID_IMAGE``.
        call: the API function that returned it, e.g. ``cuModuleLoadData``.
        description: the driver's own explanation.
    """

    def __init__(self, code: int, name: str, call: str, description: str, hint: str = "") -> None:
        self.code = code
        self.name = name
        self.call = call
        self.description = description
        self.hint = hint
        text = f"{call} failed: {name} ({code}): {description}"
        if hint:
            text += f". {hint}"
        super().__init__(text)

    def __reduce__(self) -> Any:  # (picklable: raised in a worker process, say)
        return type(self), (self.code, self.name, self.call, self.description, self.hint)


class CompileError(FerroxError):
    """NVRTC rejected a kernel source.

    Attributes:
        log: the full NVRTC log (errors with file and line).
        options: the options the compiler was given.
        source_name: the file name the source was compiled under.
    """

    def __init__(self, source_name: str, log: str, options: Sequence[str]) -> None:
        self.source_name = source_name
        self.log = log
        self.options = tuple(options)
        super().__init__(
            f"NVRTC could not compile {source_name} (options: {' '.join(self.options)}):\n"
            f"{log.strip()}"
        )

    def __reduce__(self) -> Any:
        return type(self), (self.source_name, self.log, self.options)


class KVCapacityError(FerroxError):
    """A KV cache is full: appending would go past its capacity. Nothing was written."""

    def __init__(self, seq_len: int, capacity: int, adding: int = 1) -> None:
        self.seq_len = seq_len
        self.capacity = capacity
        self.adding = adding
        super().__init__(
            f"KV cache is full: seq_len={seq_len}, capacity={capacity}, cannot add {adding} "
            f"token(s); nothing was written. Create the cache with a larger capacity "
            f"or clear() it for a new sequence."
        )

    def __reduce__(self) -> Any:
        return type(self), (self.seq_len, self.capacity, self.adding)


class ClosedError(FerroxError, ValueError):
    """An object was used after ``close()``: a DeviceArray (or a view of one), Stream,
    Event, Graph, GraphExec, Module, Kernel, Device, KVCache, LayerKVCache or DecodeGraph,
    or an object that depends on one that was closed (a cache whose stream was closed, a
    graph whose cache was). Raised before any driver call: a closed object's handle is
    never used. A subclass of ValueError, as for a closed file."""

    def __init__(self, what: str, because: str = "") -> None:
        self.what = what
        self.because = because
        text = f"this {what} was closed" if not because else f"this {what} {because}"
        super().__init__(text)

    def __reduce__(self) -> Any:
        return type(self), (self.what, self.because)


class UnsupportedDeviceError(NoDeviceError):
    """A CUDA device older than ferrox_driver supports (compute capability below 7.5, before
    Turing): refused when a Device opens, before its context is touched. A NoDeviceError:
    code that falls back to the CPU without a GPU does so here too.

    Attributes:
        ordinal: the device's index.
        device_name: its name, e.g. ``Tesla V100-SXM2-16GB``.
        compute_capability: (major, minor).
        minimum: the oldest compute capability supported.
    """

    def __init__(
        self,
        ordinal: int,
        device_name: str,
        compute_capability: tuple[int, int],
        minimum: tuple[int, int],
    ) -> None:
        self.ordinal = ordinal
        self.device_name = device_name
        self.compute_capability = compute_capability
        self.minimum = minimum
        (major, minor), (low, low_minor) = compute_capability, minimum
        super().__init__(
            f"device {ordinal} ({device_name}) has compute capability {major}.{minor}, and "
            f"ferrox_driver needs {low}.{low_minor} or newer (Turing or later: T4, RTX 20xx, "
            f"A100, RTX 30xx-50xx, L4/L40S, H100/H200, B200)"
        )

    def __reduce__(self) -> Any:
        return type(self), (
            self.ordinal, self.device_name, self.compute_capability, self.minimum
        )  # fmt: skip
