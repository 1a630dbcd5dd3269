"""Loaded modules and their kernels, launched with typed arguments."""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ClosedError
from ..types import KernelArg, StreamLike
from ._bindings import _capture, capture_keep, check, cu, driver_version, drv, finalizer
from .compiler import Program
from .device import Device, resolve
from .memory import DeviceArray
from .stream import stream_handle

__all__ = ["Kernel", "LaunchSequence", "Module", "PackedLaunch", "pack_args"]

Dim3 = int | Sequence[int]


class _Loaded:
    """A loaded module's handle, unloaded when the last holder lets go: the Module and
    every Kernel of it (which launch records and graphs hold)."""

    __slots__ = ("__weakref__", "handle")

    def __init__(self, cubin: bytes) -> None:
        self.handle = drv("cuModuleLoadData", cubin)
        finalizer(self, "cuModuleUnload", self.handle)


class Module:
    """A cubin loaded into one device's context.

    Made by `ferrox_driver.ensure_module_loaded` (cached). ``close()`` unloads it once no
    kernel of it is still in use (a launch record, a graph); meanwhile its kernels raise
    `ClosedError`, and ``ensure_module_loaded`` loads it afresh.
    """

    def __init__(self, program: Program, device: Device | None = None) -> None:
        self.device = resolve(device)
        self.program = program
        self._loaded: _Loaded | None = _Loaded(program.cubin)
        self._handle = self._loaded.handle
        self._closed = False
        self._kernels: dict[str, Kernel] = {}

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("Module")

    def get_function(self, name: str) -> Kernel:
        """The kernel ``name`` (an ``extern "C"`` entry point) of this module.

        Raises:
            ValueError: the module has no such kernel (the message lists those it has).
        """
        self._check_open()
        kernel = self._kernels.get(name)
        if kernel is None:
            known = sorted(self.program.resources)
            if known and name not in known:
                raise ValueError(
                    f"function_name: {self.program.name} has no kernel {name!r}; "
                    f"it has {', '.join(known)}"
                )
            self.device.activate()
            kernel = Kernel(drv("cuModuleGetFunction", self._handle, name.encode()), name, self)
            self._kernels[name] = kernel
        return kernel

    def close(self) -> None:
        """Unload the module once nothing uses its kernels; they raise `ClosedError` from
        now on. Closing again does nothing."""
        self._closed = True
        self._kernels.clear()
        self._loaded = None


if sys.byteorder != "little":  # pragma: no cover - CUDA hosts are little-endian
    raise ImportError("ferrox_driver packs kernel arguments for little-endian hosts only")


def _bits(mask: int) -> Any:
    return lambda a: int(a) & mask


# Each numpy scalar type's value as the integer whose little-endian bytes are its C value
# (floats by their bit patterns): one 8-byte slot per argument, the driver copying from
# each slot as many bytes as the kernel's parameter has.
_SCALAR_BITS: dict[np.dtype, Any] = {
    np.dtype(np.int8): _bits(0xFF),
    np.dtype(np.int16): _bits(0xFFFF),
    np.dtype(np.int32): _bits(0xFFFF_FFFF),
    np.dtype(np.int64): _bits(0xFFFF_FFFF_FFFF_FFFF),
    np.dtype(np.uint8): int,
    np.dtype(np.uint16): int,
    np.dtype(np.uint32): int,
    np.dtype(np.uint64): int,
    np.dtype(np.float32): lambda a: int(a.view(np.uint32)),
    np.dtype(np.float64): lambda a: int(a.view(np.uint64)),
    np.dtype(np.bool_): int,
}


def _arg_bits_slow(arg: Any, index: int) -> int:
    if isinstance(arg, DeviceArray):
        return arg.ptr
    if isinstance(arg, np.generic):
        bits = _SCALAR_BITS.get(arg.dtype)
        if bits is None:
            raise TypeError(f"args[{index}]: numpy scalar of dtype {arg.dtype} is not supported")
        return int(bits(arg))
    if isinstance(arg, (bool, int, float)):
        raise TypeError(
            f"args[{index}]: a bare Python {type(arg).__name__} ({arg!r}) has no C type; "
            f"wrap it, e.g. numpy.int32({arg!r}) or numpy.float32({arg!r})"
        )
    cai = getattr(arg, "__cuda_array_interface__", None)
    if cai is not None:
        return int(cai["data"][0])
    raise TypeError(
        f"args[{index}]: expected a device array, None (null pointer) or a numpy scalar, "
        f"got {type(arg).__name__}"
    )


# The common argument types by exact type: one dict lookup each on the launch path.
_BITS_BY_TYPE: dict[type, Any] = {
    DeviceArray: lambda a: a.ptr,
    type(None): lambda a: 0,  # a null pointer
    **{dt.type: f for dt, f in _SCALAR_BITS.items()},
}


def _arg_bits(args: Sequence[Any]) -> list[int]:
    out = []
    for i, a in enumerate(args):
        f = _BITS_BY_TYPE.get(type(a))
        out.append(_arg_bits_slow(a, i) if f is None else f(a))
    return out


def _slot_arrays(n: int) -> tuple[Any, Any]:
    """An array of ``n`` 8-byte argument slots and the ``void*[]`` of their addresses."""
    slots = (ctypes.c_uint64 * max(n, 1))()
    base = ctypes.addressof(slots)
    return slots, (ctypes.c_void_p * max(n, 1))(*range(base, base + 8 * max(n, 1), 8))


def pack_args(args: Sequence[Any]) -> tuple[int, list[Any]]:
    """Pack kernel arguments into a ``void*[]``: each argument's value in an 8-byte slot
    (pointers, and scalars of up to 8 bytes in little-endian order), each slot's address in
    the array.

    Returns:
        The array's address for cuLaunchKernel, and the objects that must stay alive
        until the launch call returns.
    """
    bits = _arg_bits(args)
    slots, ptrs = _slot_arrays(len(bits))
    slots[: len(bits)] = bits
    return ctypes.addressof(ptrs), [slots, ptrs]


_launch_slots = threading.local()


def _pack_for_launch(args: Sequence[Any]) -> int:
    """pack_args into this thread's arrays for ``len(args)`` arguments, made once and
    refilled: the driver copies the arguments before a launch call returns, so the next
    launch on this thread may overwrite them (an eager decode's hot path)."""
    arrays = getattr(_launch_slots, "by_count", None)
    if arrays is None:
        arrays = _launch_slots.by_count = {}
    bits = _arg_bits(args)  # before touching the slots: a bad argument leaves them as they were
    entry = arrays.get(len(bits))
    if entry is None:
        slots, ptrs = _slot_arrays(len(bits))
        entry = arrays[len(bits)] = (slots, ctypes.addressof(ptrs), ptrs)
    entry[0][: len(bits)] = bits
    return int(entry[1])


def _dim3(value: Dim3, name: str) -> tuple[int, int, int]:
    if type(value) is int and value > 0:  # the common cases first, on the launch path
        return value, 1, 1
    if type(value) is tuple and len(value) == 3:
        x, y, z = value
        if type(x) is int and type(y) is int and type(z) is int and min(x, y, z) > 0:
            return x, y, z
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(
        isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in dims
    ):
        raise ValueError(f"{name}: expected 1 to 3 positive ints, got {value!r}")
    full = [int(d) for d in dims] + [1] * (3 - len(dims))
    return full[0], full[1], full[2]


_MAX_CONFIGS = 64  # cuLaunchKernelEx configurations kept per kernel
# Programmatic dependent launch: compute capability 9.0, and a driver of CUDA 12.3 or later
# (the first to keep it as a programmatic edge when a stream capture records the launch).
PDL_DRIVER = 12030


@functools.cache
def _pdl_driver() -> bool:
    return (driver_version() or 0) >= PDL_DRIVER


class Kernel:
    """One kernel of a loaded Module."""

    def __init__(self, handle: Any, name: str, module: Module) -> None:
        self._handle = handle
        self.name = name
        self.module = module
        self._loaded = module._loaded  # the module stays loaded while this kernel lives
        self._max_dynamic_shared: int | None = None  # asked of the driver when first needed
        self._non_portable_clusters = False  # clusters of more than 8 blocks allowed
        # cuLaunchKernelEx configurations (clusters, early launches) by (grid, block,
        # shared, stream, cluster, early): built once, as a decode relaunches the same one;
        # the driver reads them at each call.
        self._ex_configs: dict[tuple[Any, ...], Any] = {}

    def _check_open(self) -> None:
        if self.module._closed:
            raise ClosedError("Kernel", f"({self.name}) belongs to a Module that was closed")

    @property
    def handle(self) -> Any:
        """The ``CUfunction`` handle.

        Raises:
            ClosedError: its module was closed.
        """
        self._check_open()
        return self._handle

    def allow_shared(self, shared_mem: int) -> None:
        """Let launches use ``shared_mem`` bytes of dynamic shared memory (past 48 KiB less
        the kernel's static shared memory, the driver must be told first)."""
        if shared_mem == 0:
            return
        if self._max_dynamic_shared is None:
            self.module.device.activate()
            self._max_dynamic_shared = int(
                drv(
                    "cuFuncGetAttribute",
                    cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    self._handle,
                )
            )
        if shared_mem > self._max_dynamic_shared:
            self.module.device.activate()
            drv(
                "cuFuncSetAttribute",
                self._handle,
                cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                int(shared_mem),
            )
            self._max_dynamic_shared = int(shared_mem)

    def max_active_blocks(self, block_threads: int, shared_mem: int = 0) -> int:
        """Blocks of ``block_threads`` threads (with ``shared_mem`` bytes of dynamic shared
        memory) one multiprocessor holds at once."""
        self.allow_shared(shared_mem)
        self.module.device.activate()
        return int(
            drv(
                "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                self._handle,
                block_threads,
                int(shared_mem),
            )
        )

    def _allow_cluster(self, cluster: int) -> None:
        if cluster > 8 and not self._non_portable_clusters:
            self.module.device.activate()
            drv(
                "cuFuncSetAttribute",
                self._handle,
                cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                1,
            )
            self._non_portable_clusters = True

    def _ex_config(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: Any,
        cluster: int,
        early: bool,
    ) -> Any:
        """A cuLaunchKernelEx configuration: blocks in clusters of ``cluster`` along x
        (0: none), launched early (programmatic stream serialization) or not."""
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes = int(shared_mem)
        config.hStream = stream_handle(stream)
        attrs = []
        if cluster:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            dim = attr.value.clusterDim
            dim.x, dim.y, dim.z = cluster, 1, 1
            attrs.append(attr)
        if early:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        config.attrs = attrs
        config.numAttrs = len(attrs)
        return config

    def max_active_clusters(self, cluster: int, block_threads: int, shared_mem: int = 0) -> int:
        """Clusters of ``cluster`` blocks (along x) of ``block_threads`` threads each, with
        ``shared_mem`` bytes of dynamic shared memory per block, the device holds at once
        (0 where it cannot run such a cluster; compute capability 9.0 and up)."""
        self.allow_shared(shared_mem)
        self._allow_cluster(cluster)
        self.module.device.activate()
        config = self._ex_config(
            (cluster, 1, 1), (block_threads, 1, 1), shared_mem, None, cluster, False
        )
        return int(drv("cuOccupancyMaxActiveClusters", self._handle, config))

    def launch(
        self,
        grid: Dim3,
        block: Dim3,
        args: Sequence[KernelArg],
        *,
        shared_mem: int = 0,
        stream: StreamLike = None,
        cluster: int = 0,
        early: bool = False,
    ) -> None:
        """Queue one launch of this kernel.

        Args:
            grid: blocks, as an int or (x, y, z).
            block: threads per block, as an int or (x, y, z).
            args: DeviceArray / ``__cuda_array_interface__`` objects (pointers), numpy
                scalars (``np.int32(n)``, ``np.float32(a)``...) or None (null pointer).
                A bare Python int or float is refused: its C type is ambiguous.
            shared_mem: dynamic shared memory in bytes.
            stream: the stream to launch on (default: the legacy default stream).
            cluster: blocks per thread block cluster along x (compute capability 9.0 and
                up; the grid's x must be a multiple); 0 launches without clusters.
            early: let this launch start before the kernel queued ahead of it on the
                stream has finished (programmatic dependent launch: compute capability
                9.0 and a CUDA 12.3 driver or later; elsewhere an ordinary launch). Only
                for a kernel that executes ``griddepcontrol.wait`` before it reads what
                that kernel writes (and in every block, so that it ends after it).

        Raises:
            TypeError: an argument without a C type.
            ValueError: bad grid/block.
            ClosedError: the module, an array argument or the stream was closed.
            CudaError: the driver refused the launch.
        """
        self._check_open()
        gx, gy, gz = _dim3(grid, "grid")
        bx, by, bz = _dim3(block, "block")
        address = _pack_for_launch(args)
        if getattr(_capture, "depth", 0):  # a ferrox capture: the graph keeps the arrays
            capture_keep(self, *(a for a in args if isinstance(a, DeviceArray)))
        self.module.device.activate()
        if shared_mem:
            self.allow_shared(shared_mem)
        handle = stream_handle(stream)
        early = early and self.module.device.compute_capability >= (9, 0) and _pdl_driver()
        if cluster or early:
            key = (gx, gy, gz, bx, by, bz, shared_mem, int(handle), cluster, early)
            config = self._ex_configs.get(key)
            if config is None:
                self._allow_cluster(cluster)
                if len(self._ex_configs) >= _MAX_CONFIGS:
                    self._ex_configs.clear()
                config = self._ex_config(
                    (gx, gy, gz), (bx, by, bz), shared_mem, handle, cluster, early
                )
                self._ex_configs[key] = config
            drv("cuLaunchKernelEx", config, self._handle, address, 0)
            return
        drv(
            "cuLaunchKernel",
            self._handle,
            gx,
            gy,
            gz,
            bx,
            by,
            bz,
            int(shared_mem),
            handle,
            address,
            0,
        )

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"


_OK = cu.CUresult.CUDA_SUCCESS
_cuLaunchKernel = cu.cuLaunchKernel
_cuLaunchKernelEx = cu.cuLaunchKernelEx


class PackedLaunch:
    """One launch of a kernel with everything but some argument values fixed: grid,
    block, shared memory, stream, cluster and early-launch configuration, and an argument
    block packed once. ``slots[i] = value`` changes argument ``i`` (a pointer or a scalar's
    bits, see ``pack_args``); calling it launches.

    Args:
        kernel: the kernel.
        grid, block, args, shared_mem, stream, cluster, early: as for ``Kernel.launch``.
    """

    def __init__(
        self,
        kernel: Kernel,
        grid: Dim3,
        block: Dim3,
        args: Sequence[Any],
        *,
        shared_mem: int = 0,
        stream: Any = None,
        cluster: int = 0,
        early: bool = False,
    ) -> None:
        self.kernel = kernel
        self.dims = (*_dim3(grid, "grid"), *_dim3(block, "block"))
        bits = _arg_bits(args)
        self.slots, self._ptrs = _slot_arrays(len(bits))
        self.slots[: len(bits)] = bits
        self._address = ctypes.addressof(self._ptrs)
        self._blobs: tuple[np.ndarray, ...] = ()  # arguments passed by value (by_value)
        kernel.module.device.activate()
        kernel.allow_shared(shared_mem)
        self.shared_mem = int(shared_mem)
        self._stream = stream_handle(stream)
        early = early and kernel.module.device.compute_capability >= (9, 0) and _pdl_driver()
        self._config = None
        handle = kernel.handle
        if cluster or early:
            kernel._allow_cluster(cluster)
            self._config = kernel._ex_config(
                self.dims[:3], self.dims[3:], shared_mem, self._stream, cluster, early
            )
            self._call, self._name = _cuLaunchKernelEx, "cuLaunchKernelEx"
            self._args: tuple[Any, ...] = (self._config, handle, self._address, 0)
        else:
            self._call, self._name = _cuLaunchKernel, "cuLaunchKernel"
            self._args = (handle, *self.dims, self.shared_mem, self._stream, self._address, 0)

    def by_value(self, index: int, blob: np.ndarray) -> None:
        """Pass argument ``index`` (a struct the kernel takes by value) from ``blob``'s
        bytes rather than its slot. The driver copies them when it queues each launch, so
        ``blob`` may be rewritten right after; it must stay alive (this launch holds it)."""
        if not blob.flags.c_contiguous:
            raise ValueError("blob: expected a C-contiguous array")
        self._blobs = (*self._blobs, blob)
        self._ptrs[index] = blob.ctypes.data

    def __call__(self) -> None:
        """Queue the launch with the slots as they are now.

        Raises:
            CudaError: the driver refused the launch.
        """
        result = self._call(*self._args)
        if result[0] is not _OK:
            check(result, self._name)


class LaunchSequence:
    """Packed launches queued in order, with named argument roles: ``run(values)`` writes
    ``values[r]`` into every slot that role ``r`` names, then launches each in turn.

    Args:
        launches: the packed launches.
        roles: role names, in the order ``run`` takes their values.
        slots: for each launch, ``(slot index, role name)`` pairs.
        device: the device whose context must be current.
    """

    def __init__(
        self,
        launches: Sequence[PackedLaunch],
        roles: Sequence[str],
        slots: Sequence[Sequence[tuple[int, str]]],
        device: Device,
    ) -> None:
        position = {r: i for i, r in enumerate(roles)}
        self.launches = tuple(launches)
        self.device = device
        self._writes = tuple(
            (launch.slots, index, position[role])
            for launch, pairs in zip(launches, slots, strict=True)
            for index, role in pairs
        )
        self._last: tuple[Any, ...] | None = None
        # the slots are shared: a thread's values stay in them until its launches are queued
        self._lock = threading.Lock()

    def run(self, values: tuple[int, ...]) -> None:
        """Write ``values`` (pointers and integers, by role) and queue every launch."""
        with self._lock:
            if values != self._last:
                for slots, index, role in self._writes:
                    slots[index] = values[role]
                self._last = values
            self.device.activate()
            for launch in self.launches:
                result = launch._call(*launch._args)
                if result[0] is not _OK:
                    check(result, launch._name)
