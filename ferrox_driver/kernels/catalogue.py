"""The package's kernel files: their text with the host-written parts in place, and their
kernels, compiled on first use and memoised per context."""

from __future__ import annotations

from functools import cache

from ..driver.compiler import expand_includes, source_dir
from ..driver.device import Device, resolve
from ..driver.launch import Kernel
from ..driver.module_cache import ensure_module_loaded
from .spec import KernelSpec
from .traits import GENERATED_PARTS

__all__ = ["get_kernel", "kernel_source", "split_kernel"]


@cache
def kernel_source(filename: str) -> str:
    """The text of one kernel file from the source directory, its parts in place
    (`expand_includes`, with the traits header the host writes): the one string is all
    that NVRTC compiles and all that the module cache keys on."""
    return expand_includes(filename, source_dir(), GENERATED_PARTS)


# a kernel per (context, file, function); a module closed by clear_memory_cache is reloaded
_kernels: dict[tuple[int, str, str], Kernel] = {}


def get_kernel(
    filename: str, function_name: str, device: Device | None = None, *,
    select: str | None = None, arch_suffix: str = "",
) -> Kernel:  # fmt: skip
    """A kernel from one of the package's ``cuda_src`` files, memoised per context so hot
    paths skip hashing the source.

    ``select``: compile only this instantiation (a line of the file's own macros, e.g.
    ``FX_COMBINE_ENTRY(gqa_split_combine_f16, fx_half)``) in a module of its own, the
    file's instantiations left out (``FX_SELECTED``): a first use compiles its kernels,
    not the file's every kernel. ``arch_suffix``: compile for the device's target with it
    (``"a"``: sm_90a, for a kernel of that target's own instructions).
    """
    dev = resolve(device)
    key = (dev.context_handle, filename, function_name)
    kernel = _kernels.get(key)
    if kernel is None or kernel.module.closed:
        source = kernel_source(filename)
        if select is not None:
            source = f"#define FX_SELECTED 1\n{source}\n{select}\n"
        arch = dev.arch + arch_suffix if arch_suffix else None
        module = ensure_module_loaded(source, filename, function_name, device=dev, arch=arch)
        kernel = _kernels[key] = module.get_function(function_name)
    return kernel


def split_kernel(spec: KernelSpec, device: Device | None = None) -> Kernel:
    """The kernel ``spec`` names, compiled (on first use) in a module of its own (its entry
    line alone; the parity kernel's file whole)."""
    return get_kernel(
        spec.file, spec.name, device, select=spec.select, arch_suffix=spec.arch_suffix
    )
