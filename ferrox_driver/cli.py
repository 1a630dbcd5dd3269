"""Command line: ``python -m ferrox_driver info | demo | bench``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]

KERNEL_FILES = ("gqa_decode.cu",)
DEFAULT_ARCH = "sm_90"


def _print(line: str = "") -> None:
    print(line, flush=True)


def cmd_info(args: argparse.Namespace) -> int:
    """Versions, devices, cache directory. Exits 0 with or without a GPU."""
    import numpy as np

    import ferrox_driver as fd

    from . import _driver, module_cache
    from .compiler import nvrtc_version_string

    _print(f"ferrox_driver  {fd.__version__}")
    _print(f"cuda-bindings  {_driver.bindings_version()}")
    try:
        _print(f"NVRTC          {nvrtc_version_string()}")
    except fd.FerroxError as exc:
        _print(f"NVRTC          unavailable: {exc}")
    _print(f"numpy          {np.__version__}")
    ver = _driver.driver_version()
    if ver is None:
        _print(
            "driver         none: no CUDA driver/device found (CPU-only use: compile, reference)"
        )
    else:
        _print(f"driver         CUDA {ver // 1000}.{(ver % 1000) // 10}")
    if fd.cuda_available():
        for i in range(fd.device_count()):
            dev = fd.Device(i)
            free, total = dev.mem_info()
            _print(
                f"device {i}       {dev.name}, {dev.arch}, {dev.multiprocessor_count} SMs, "
                f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free)"
            )
            dev.close()
    else:
        _print("devices        none: no CUDA driver/device found")
    directory = module_cache.cache_dir()
    files, size = module_cache.disk_usage()
    where = "disabled (FERROX_DISK_CACHE=0)" if directory is None else str(directory)
    _print(f"kernel cache   {where}: {files} file(s), {size / 2**20:.1f} MiB")
    return 0


def show_resources(arch: str) -> None:
    """Compile every kernel file for ``arch`` and print the ptxas report."""
    from .compiler import kernel_source
    from .module_cache import get_program

    _print(f"ptxas report for {arch}:")
    _print(f"  {'kernel':<34} {'regs':>5} {'stack':>6} {'spills':>7} {'smem':>6}")
    for filename in KERNEL_FILES:
        program = get_program(kernel_source(filename), arch=arch, name=filename)
        for name, r in sorted(program.resources.items()):
            spills = r.spill_stores + r.spill_loads
            _print(
                f"  {name:<34} {r.registers:>5} {r.stack_bytes:>6} {spills:>7} {r.shared_bytes:>6}"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ferrox_driver", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices and the kernel cache")
    args = parser.parse_args(argv)
    if args.command == "info":
        return cmd_info(args)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
