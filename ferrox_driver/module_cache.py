"""ensure_module_loaded(): compile once per key, load once per context, cache cubins on disk.

Mirrors ferrox-cuda's ``ensure_module_loaded``. The in-process cache is thread-safe: many
threads asking for one module at once compile it once. The disk cache stores cubins under
a SHA-256 key over labelled fields (format and package version, source, prelude, every
NVRTC option, NVRTC version, arch: cache_key);
files are written to a temporary name and renamed, and carry a checksum, so a torn or
corrupt file is a miss that recompiles and rewrites, never an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ._version import __version__
from .compiler import (
    KernelResources,
    Program,
    compile_source,
    kernel_source,
    normalize_arch,
    nvrtc_options,
    prelude_source,
)
from .compiler import nvrtc_version_string as _nvrtc_version
from .device import Device, resolve
from .launch import Kernel, Module
from .progress import announce

__all__ = [
    "cache_dir",
    "cache_key",
    "clear_memory_cache",
    "ensure_module_loaded",
    "get_kernel",
    "get_program",
]

CACHE_FORMAT = 1
_MAGIC = b"FERROX-CUBIN\n"


@dataclass
class CacheStats:
    """Counters of what the module cache did (for tests and ``info``)."""

    compiles: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    disk_misses: int = 0
    disk_writes: int = 0
    loads: int = 0


stats = CacheStats()
_lock = threading.Lock()
_stats_lock = threading.Lock()
_key_locks: dict[str, threading.Lock] = {}
_programs: dict[str, Program] = {}
_modules: dict[tuple[int, str], Module] = {}
_warned_dirs: set[str] = set()


def cache_dir() -> Path | None:
    """The disk cache directory, or None when ``FERROX_DISK_CACHE=0``.

    ``FERROX_CACHE_DIR`` sets it; otherwise ``$XDG_CACHE_HOME/ferrox_driver`` or
    ``~/.cache/ferrox_driver``.
    """
    if os.environ.get("FERROX_DISK_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if explicit := os.environ.get("FERROX_CACHE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ferrox_driver"


def cache_key(source: str, options: Sequence[str], arch: str, nvrtc: str) -> str:
    """SHA-256 over labelled, length-prefixed fields holding everything that can change the
    cubin: the source (its parts already in place), the prelude NVRTC pre-includes, every
    option NVRTC is given (the fixed ones too), NVRTC's version, the arch and this
    package's version. Equal keys mean identical cubins."""
    h = hashlib.sha256()
    fields = [
        ("format", str(CACHE_FORMAT)),
        ("package", __version__),
        ("source", source),
        ("prelude", prelude_source()),
        ("options", "\0".join(nvrtc_options(arch, options))),
        ("nvrtc", nvrtc),
        ("arch", arch),
    ]
    for label, value in fields:
        data = value.encode()
        h.update(label.encode() + b"=" + struct.pack("<Q", len(data)) + data)
    return h.hexdigest()


def _encode(program: Program) -> bytes:
    meta = {
        "log": program.log,
        "arch": program.arch,
        "options": list(program.options),
        "name": program.name,
        "resources": {k: vars(v) for k, v in program.resources.items()},
    }
    meta_bytes = json.dumps(meta).encode()
    payload = struct.pack("<Q", len(meta_bytes)) + meta_bytes + program.cubin
    return _MAGIC + hashlib.sha256(payload).digest() + payload


def _decode(blob: bytes) -> Program | None:
    """The Program in a cache file, or None when the file is not intact."""
    head = len(_MAGIC) + 32
    if len(blob) < head + 8 or not blob.startswith(_MAGIC):
        return None
    digest, payload = blob[len(_MAGIC) : head], blob[head:]
    if hashlib.sha256(payload).digest() != digest:
        return None
    try:
        (n,) = struct.unpack_from("<Q", payload)
        meta = json.loads(payload[8 : 8 + n])
        cubin = payload[8 + n :]
        resources = {k: KernelResources(**v) for k, v in meta["resources"].items()}
        return Program(
            cubin, meta["log"], meta["arch"], tuple(meta["options"]), meta["name"], resources
        )
    except (ValueError, KeyError, TypeError, struct.error):
        return None


def _read_disk(directory: Path, key: str) -> Program | None:
    try:
        blob = (directory / f"{key}.cubin").read_bytes()
    except OSError:
        return None
    return _decode(blob)


def _write_disk(directory: Path, key: str, program: Program) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_encode(program))
            os.replace(tmp, directory / f"{key}.cubin")
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _count("disk_writes")
    except OSError as exc:
        if str(directory) not in _warned_dirs:
            _warned_dirs.add(str(directory))
            warnings.warn(
                f"ferrox_driver: cannot write the kernel cache in {directory} ({exc}); "
                f"kernels stay cached in memory only. Set FERROX_CACHE_DIR to a writable "
                f"directory, or FERROX_DISK_CACHE=0 to silence this.",
                RuntimeWarning,
                stacklevel=4,
            )


def _count(field: str) -> None:
    with _stats_lock:
        setattr(stats, field, getattr(stats, field) + 1)


def _key_lock(key: str) -> threading.Lock:
    with _lock:
        return _key_locks.setdefault(key, threading.Lock())


def get_program(
    source: str, *, arch: str, options: Sequence[str] = (), name: str = "kernel.cu"
) -> Program:
    """The compiled Program for (source, options, arch): from memory, disk, or NVRTC."""
    arch = normalize_arch(arch)
    opts = tuple(options)
    key = cache_key(source, opts, arch, _nvrtc_version())
    program = _programs.get(key)
    if program is not None:
        _count("memory_hits")
        return program
    with _key_lock(key):
        program = _programs.get(key)
        if program is not None:
            _count("memory_hits")
            return program
        directory = cache_dir()
        if directory is not None:
            program = _read_disk(directory, key)
            if program is not None:
                _count("disk_hits")
            else:
                _count("disk_misses")
        if program is None:
            note = f"ferrox_driver: compiling {name} for {arch} (first use; cached afterwards)"
            with announce(note):
                program = compile_source(source, arch=arch, options=opts, name=name)
            _count("compiles")
            if directory is not None:
                _write_disk(directory, key, program)
        _programs[key] = program
        return program


def ensure_module_loaded(
    source: str,
    module_name: str,
    function_name: str,
    *,
    options: Sequence[str] = (),
    device: Device | None = None,
) -> Module:
    """Compile (once) and load (once per context) the module holding ``function_name``.

    Args:
        source: the kernel source text.
        module_name: a label for the module (used as the source's file name in logs).
        function_name: a kernel the module must contain; checked on load.
        options: extra NVRTC options (part of the cache key).
        device: the device whose context loads it (default: device 0).

    Returns:
        The loaded Module; ``module.get_function(function_name)`` is ready.

    Raises:
        CompileError: NVRTC rejected the source.
        ValueError: the module has no kernel ``function_name``.
    """
    dev = resolve(device)
    opts = tuple(options)
    key = cache_key(source, opts, dev.arch, _nvrtc_version())
    mod_key = (dev.context_handle, key)
    module = _modules.get(mod_key)
    if module is None or module._closed:  # a closed module is loaded afresh
        with _key_lock("load:" + key):
            module = _modules.get(mod_key)
            if module is None or module._closed:
                program = get_program(source, arch=dev.arch, options=opts, name=module_name)
                dev.activate()
                module = Module(program, dev)
                _count("loads")
                _modules[mod_key] = module
    module.get_function(function_name)
    return module


def clear_memory_cache() -> None:
    """Forget compiled programs and loaded modules (the disk cache stays)."""
    with _lock:
        for module in _modules.values():
            module.close()
        _modules.clear()
        _programs.clear()
        _kernels.clear()
        _key_locks.clear()


def disk_usage() -> tuple[int, int]:
    """(files, bytes) in the disk cache."""
    directory = cache_dir()
    if directory is None or not directory.is_dir():
        return 0, 0
    files = list(directory.glob("*.cubin"))
    return len(files), sum(f.stat().st_size for f in files if f.is_file())


_kernels: dict[tuple[int, str, str], Kernel] = {}


def get_kernel(
    filename: str, function_name: str, device: Device | None = None, *, select: str | None = None
) -> Kernel:
    """A kernel from one of the package's ``cuda_src`` files, memoised per context so hot
    paths skip hashing the source.

    ``select``: compile only this instantiation (a line of the file's own macros, e.g.
    ``FX_COMBINE_ENTRY(gqa_split_combine_f16, fx_half)``) in a module of its own, the
    file's instantiations left out (``FX_SELECTED``): a first use compiles its kernels,
    not the file's every kernel.
    """
    dev = resolve(device)
    key = (dev.context_handle, filename, function_name)
    kernel = _kernels.get(key)
    if kernel is None or kernel.module._closed:
        source = kernel_source(filename)
        if select is not None:
            source = f"#define FX_SELECTED 1\n{source}\n{select}\n"
        module = ensure_module_loaded(source, filename, function_name, device=dev)
        kernel = _kernels[key] = module.get_function(function_name)
    return kernel
