"""Loaded modules and their kernels, launched with typed arguments."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._driver import cu, drv, finalizer
from .compiler import Program
from .device import Device, resolve
from .memory import DeviceArray
from .stream import stream_handle

__all__ = ["Kernel", "Module", "pack_args"]

Dim3 = int | Sequence[int]


class Module:
    """A cubin loaded into one device's context.

    Made by :func:`ferrox_driver.ensure_module_loaded` (cached).
    """

    def __init__(self, program: Program, device: Device | None = None) -> None:
        self.device = resolve(device)
        self.program = program
        self._handle = drv("cuModuleLoadData", program.cubin)
        self._finalizer = finalizer(self, "cuModuleUnload", self._handle)
        self._kernels: dict[str, Kernel] = {}

    def get_function(self, name: str) -> Kernel:
        """The kernel ``name`` (an ``extern "C"`` entry point) of this module.

        Raises:
            ValueError: the module has no such kernel (the message lists those it has).
        """
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
        """Unload the module (its kernels become unusable)."""
        self._kernels.clear()
        self._finalizer()


_SCALAR_CTYPES: dict[np.dtype, Any] = {
    np.dtype(t): c
    for t, c in [
        (np.int8, ctypes.c_int8),
        (np.int16, ctypes.c_int16),
        (np.int32, ctypes.c_int32),
        (np.int64, ctypes.c_int64),
        (np.uint8, ctypes.c_uint8),
        (np.uint16, ctypes.c_uint16),
        (np.uint32, ctypes.c_uint32),
        (np.uint64, ctypes.c_uint64),
        (np.float32, ctypes.c_float),
        (np.float64, ctypes.c_double),
        (np.bool_, ctypes.c_bool),
    ]
}


def _as_ctype(arg: Any, index: int) -> Any:
    if isinstance(arg, DeviceArray):
        return ctypes.c_void_p(arg.ptr)
    if arg is None:
        return ctypes.c_void_p(0)  # a null pointer
    if isinstance(arg, np.generic):
        ctype = _SCALAR_CTYPES.get(arg.dtype)
        if ctype is None:
            raise TypeError(f"args[{index}]: numpy scalar of dtype {arg.dtype} is not supported")
        return ctype(arg.item())
    if isinstance(arg, (bool, int, float)):
        raise TypeError(
            f"args[{index}]: a bare Python {type(arg).__name__} ({arg!r}) has no C type; "
            f"wrap it, e.g. numpy.int32({arg!r}) or numpy.float32({arg!r})"
        )
    cai = getattr(arg, "__cuda_array_interface__", None)
    if cai is not None:
        return ctypes.c_void_p(int(cai["data"][0]))
    raise TypeError(
        f"args[{index}]: expected a device array, None (null pointer) or a numpy scalar, "
        f"got {type(arg).__name__}"
    )


def pack_args(args: Sequence[Any]) -> tuple[int, list[Any]]:
    """Pack kernel arguments into a ``void*[]``.

    Returns:
        The array's address for cuLaunchKernel, and the objects that must stay alive
        until the launch call returns.
    """
    values = [_as_ctype(a, i) for i, a in enumerate(args)]
    ptrs = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])
    return ctypes.addressof(ptrs), [values, ptrs]


def _dim3(value: Dim3, name: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or any(
        isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in dims
    ):
        raise ValueError(f"{name}: expected 1 to 3 positive ints, got {value!r}")
    full = [int(d) for d in dims] + [1] * (3 - len(dims))
    return full[0], full[1], full[2]


class Kernel:
    """One kernel of a loaded Module."""

    def __init__(self, handle: Any, name: str, module: Module) -> None:
        self._handle = handle
        self.name = name
        self.module = module
        self._max_dynamic_shared: int | None = None  # asked of the driver when first needed
        self._non_portable_clusters = False  # clusters of more than 8 blocks allowed

    @property
    def handle(self) -> Any:
        """The ``CUfunction`` handle."""
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

    def _cluster_config(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        stream: Any,
        cluster: int,
    ) -> Any:
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes = int(shared_mem)
        config.hStream = stream_handle(stream)
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
        config.attrs = [attr]
        config.numAttrs = 1
        return config

    def max_active_clusters(self, cluster: int, block_threads: int, shared_mem: int = 0) -> int:
        """Clusters of ``cluster`` blocks (along x) of ``block_threads`` threads each, with
        ``shared_mem`` bytes of dynamic shared memory per block, the device holds at once
        (0 where it cannot run such a cluster; compute capability 9.0 and up)."""
        self.allow_shared(shared_mem)
        self._allow_cluster(cluster)
        self.module.device.activate()
        config = self._cluster_config(
            (cluster, 1, 1), (block_threads, 1, 1), shared_mem, None, cluster
        )
        return int(drv("cuOccupancyMaxActiveClusters", self._handle, config))

    def launch(
        self,
        grid: Dim3,
        block: Dim3,
        args: Sequence[Any],
        *,
        shared_mem: int = 0,
        stream: Any = None,
        cluster: int = 0,
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

        Raises:
            TypeError: an argument without a C type.
            ValueError: bad grid/block.
            CudaError: the driver refused the launch.
        """
        gx, gy, gz = _dim3(grid, "grid")
        bx, by, bz = _dim3(block, "block")
        address, keep = pack_args(args)
        self.module.device.activate()
        self.allow_shared(shared_mem)
        if cluster:
            self._allow_cluster(cluster)
            config = self._cluster_config((gx, gy, gz), (bx, by, bz), shared_mem, stream, cluster)
            drv("cuLaunchKernelEx", config, self._handle, address, 0)
            del keep
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
            stream_handle(stream),
            address,
            0,
        )
        del keep

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"
