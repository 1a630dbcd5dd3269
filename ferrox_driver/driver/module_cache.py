"""ensure_module_loaded(): compile once per key, load once per context, cache cubins on disk.

Mirrors ferrox-cuda's ``ensure_module_loaded``. The in-process cache is thread-safe: many
threads asking for one module at once compile it once. The disk cache stores cubins under
a SHA-256 key over labelled fields (format and package version, source, prelude, every
NVRTC option, NVRTC version, arch: cache_key);
files are written to a temporary name and renamed, and carry a checksum, so a torn or
corrupt file is a miss that recompiles and rewrites, never an error.

Every input of the key is public, so a file in the cache is run only if no other user can
have written it: the directory is created 0700 and the files 0600, and before a read the
opened directory and the opened file (fstat of the descriptors, the file opened with
O_NOFOLLOW relative to the directory's descriptor) must belong to this user and be writable
by no group or other user. Checking the opened inodes, not the path, makes the parents'
permissions irrelevant: a directory swapped in through a writable parent is someone else's
or one of ours, and is checked as it is. A directory that fails is neither read nor written
(the kernel is compiled in memory) and warned about once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import stat
import struct
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from .._version import __version__
from .compiler import (
    KernelResources,
    Program,
    compile_source,
    normalize_arch,
    nvrtc_options,
    prelude_source,
)
from .compiler import nvrtc_version_string as _nvrtc_version
from .device import Device, resolve
from .launch import Module
from .notice import announce

__all__ = [
    "cache_dir",
    "cache_key",
    "clear_disk_cache",
    "clear_memory_cache",
    "disk_cache_state",
    "ensure_module_loaded",
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


# The only names the cache writes: what clear_disk_cache may remove.
_CUBIN_NAME = re.compile(r"[0-9a-f]{64}\.cubin")
_TEMP_NAME = re.compile(r"\.[0-9a-f]{16}\.[0-9a-f]{16}\.tmp")


def _not_private(st: os.stat_result, what: str) -> str:
    """Why the inode ``st`` is not this user's alone ("" when it is)."""
    uid = os.geteuid()
    if st.st_uid != uid:
        return f"the {what} is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & 0o022:
        mode = stat.S_IMODE(st.st_mode)
        return f"the {what} is writable by its group or by others (mode {mode:04o})"
    return ""


def _warn_once(directory: Path, message: str) -> None:
    with _stats_lock:
        if str(directory) in _warned_dirs:
            return
        _warned_dirs.add(str(directory))
    warnings.warn(message, RuntimeWarning, stacklevel=5)


def _warn_untrusted(directory: Path, why: str) -> None:
    _warn_once(
        directory,
        f"ferrox_driver: not using the kernel cache in {directory}: {why}, so another user "
        f"could have planted kernels there; kernels are compiled and kept in memory only. "
        f"Make it private (chown to this user and chmod 700 {directory}) or set "
        f"FERROX_CACHE_DIR to a directory of your own.",
    )


def _open_private_dir(directory: Path) -> int | None:
    """A descriptor of ``directory`` when it is this user's alone; None (warned once) when it
    is not. Raises OSError when it cannot be opened."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    why = _not_private(os.fstat(fd), "directory")
    if why:
        os.close(fd)
        _warn_untrusted(directory, why)
        return None
    return fd


def _make_private_dir(directory: Path) -> None:
    """Create ``directory`` 0700 (its missing parents with the umask, as mkdir -p does)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        return  # an existing directory is checked as it is, not changed
    os.chmod(directory, 0o700)  # mkdir's mode went through the umask


def _read_disk(directory: Path, key: str) -> Program | None:
    """The Program cached for ``key``, or None: absent, damaged, or not trusted."""
    try:
        dir_fd = _open_private_dir(directory)
    except OSError:
        return None  # no cache directory yet (or not a directory): a miss
    if dir_fd is None:
        return None
    try:
        name = f"{key}.cubin"
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP: a symbolic link where a file should be
            _warn_untrusted(directory, f"{name} cannot be opened as a plain file ({exc})")
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            why = "" if stat.S_ISREG(st.st_mode) else f"{name} is not a regular file"
            why = why or _not_private(st, f"file {name}")
            if why:
                _warn_untrusted(directory, why)
                return None
            blob = f.read()
    except OSError:
        return None
    finally:
        os.close(dir_fd)
    return _decode(blob)


def _write_disk(directory: Path, key: str, program: Program) -> None:
    try:
        _make_private_dir(directory)
        dir_fd = _open_private_dir(directory)
        if dir_fd is None:
            return  # not ours alone: never write where others can read or replace
        try:
            tmp = f".{key[:16]}.{secrets.token_hex(8)}.tmp"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            try:
                with os.fdopen(fd, "wb") as f:
                    os.fchmod(f.fileno(), 0o600)  # the umask may have taken bits of 0600
                    f.write(_encode(program))
                os.replace(tmp, f"{key}.cubin", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise
        finally:
            os.close(dir_fd)
        _count("disk_writes")
    except OSError as exc:
        _warn_once(
            directory,
            f"ferrox_driver: cannot write the kernel cache in {directory} ({exc}); "
            f"kernels stay cached in memory only. Set FERROX_CACHE_DIR to a writable "
            f"directory, or FERROX_DISK_CACHE=0 to silence this.",
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
    arch: str | None = None,
) -> Module:
    """Compile (once) and load (once per context) the module holding ``function_name``.

    Args:
        source: the kernel source text.
        module_name: a label for the module (used as the source's file name in logs).
        function_name: a kernel the module must contain; checked on load.
        options: extra NVRTC options (part of the cache key).
        device: the device whose context loads it (default: device 0).
        arch: the target (default: the device's, e.g. ``"sm_90"``; ``"sm_90a"`` for a
            kernel of that target's own instructions, such as wgmma).

    Returns:
        The loaded Module; ``module.get_function(function_name)`` is ready.

    Raises:
        CompileError: NVRTC rejected the source.
        ValueError: the module has no kernel ``function_name``.
    """
    dev = resolve(device)
    opts = tuple(options)
    target = dev.arch if arch is None else normalize_arch(arch)
    key = cache_key(source, opts, target, _nvrtc_version())
    mod_key = (dev.context_handle, key)
    module = _modules.get(mod_key)
    if module is None or module._closed:  # a closed module is loaded afresh
        with _key_lock("load:" + key):
            module = _modules.get(mod_key)
            if module is None or module._closed:
                program = get_program(source, arch=target, options=opts, name=module_name)
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
        _key_locks.clear()


def disk_usage() -> tuple[int, int]:
    """(files, bytes) in the disk cache."""
    state = disk_cache_state()
    return state["n_files"], state["bytes"]


def _own_entries(directory: Path) -> list[os.DirEntry[str]]:
    """The entries of ``directory`` that carry a name the cache writes."""
    try:
        with os.scandir(directory) as it:
            return [e for e in it if _CUBIN_NAME.fullmatch(e.name) or _TEMP_NAME.fullmatch(e.name)]
    except OSError:
        return []


class DiskCacheState(TypedDict):
    """What disk_cache_state() reports (a plain dict at run time)."""

    path: str | None
    exists: bool
    trusted: bool
    why: str
    n_files: int
    bytes: int


def disk_cache_state() -> DiskCacheState:
    """Where the disk cache is and whether it is used (for ``info`` and ``cache``).

    Returns:
        ``path`` (str, None when ``FERROX_DISK_CACHE=0``), ``exists`` (bool), ``trusted``
        (bool: the directory is this user's alone and will be read; a directory not created
        yet is, since it will be created 0700), ``why`` (str: why it is not trusted, ""
        when it is), ``n_files`` and ``bytes`` (the cached kernels in it).
    """
    directory = cache_dir()
    if directory is None:
        why = "disabled (FERROX_DISK_CACHE=0)"
        return DiskCacheState(path=None, exists=False, trusted=False, why=why, n_files=0, bytes=0)
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        return DiskCacheState(
            path=str(directory), exists=False, trusted=True, why="", n_files=0, bytes=0
        )
    except OSError as exc:
        why = f"cannot be read ({exc})"
        return DiskCacheState(
            path=str(directory), exists=False, trusted=False, why=why, n_files=0, bytes=0
        )
    why = _not_private(st, "directory") if stat.S_ISDIR(st.st_mode) else "not a directory"
    n_files = size = 0
    for entry in _own_entries(directory):
        with contextlib.suppress(OSError):
            est = entry.stat(follow_symlinks=False)
            if _CUBIN_NAME.fullmatch(entry.name) and stat.S_ISREG(est.st_mode):
                n_files += 1
                size += est.st_size
    return DiskCacheState(
        path=str(directory), exists=True, trusted=not why, why=why, n_files=n_files, bytes=size
    )


def clear_disk_cache() -> int:
    """Remove the disk cache's files (only names the cache writes); returns how many.

    Links and files of those names are removed whoever owns them (clearing is the remedy for
    a directory that was not private); anything else in the directory stays.
    """
    directory = cache_dir()
    if directory is None:
        return 0
    removed = 0
    for entry in _own_entries(directory):
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                continue
            os.unlink(entry.path)
            removed += 1
    return removed
