"""NVRTC: kernel source -> cubin for one architecture, with the ptxas resource report."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from ..errors import CompileError
from ._bindings import nvrtc_compile, nvrtc_version, rtc

__all__ = [
    "KernelResources",
    "Program",
    "compile_source",
    "nvrtc_options",
    "prelude_source",
    "source_dir",
    "PRELUDE_NAME",
]

PRELUDE_NAME = "ferrox_prelude.cuh"
_ARCH_RE = re.compile(r"^(sm|compute)_(\d{2,3})[af]?$")


@cache
def source_dir() -> Path:
    """Where the .cu files are: inside the installed package, or cuda_src/ of a checkout."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "cuda_src", package.parent / "cuda_src"):
        if (candidate / PRELUDE_NAME).is_file():
            return candidate
    raise FileNotFoundError(
        f"kernel sources not found in {package}: reinstall ferrox-driver "
        f"(the wheel ships ferrox_driver/cuda_src/*.cu)"
    )


_INCLUDE_RE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.M)


def expand_includes(
    filename: str, directory: Path, parts: Mapping[str, Callable[[], str]] | None = None
) -> str:
    """The text of ``directory/filename`` with each ``#include "name"`` line replaced by the
    text of ``directory/name`` (expanded the same way, each file once; the parts the host
    writes, ``parts`` (the kernel catalogue passes the traits header), from there), between
    ``#line`` marks so that NVRTC's messages name the part and its line.

    Raises:
        FileNotFoundError: the file, or a file it includes, is not in ``directory``.
    """
    return _expanded(filename, Path(directory), set(), parts or {})


def _expanded(
    filename: str, directory: Path, seen: set[str], parts: Mapping[str, Callable[[], str]]
) -> str:
    seen.add(filename)
    text = (directory / filename).read_text()
    pieces: list[str] = []
    at = 0
    for m in _INCLUDE_RE.finditer(text):
        name = m.group(1)
        generated = parts.get(name)  # written by the host (kernel_traits)
        if generated is None and not (directory / name).is_file():
            raise FileNotFoundError(f"{filename} includes {name!r}, which is not in {directory}")
        pieces.append(text[at : m.start()])
        if name not in seen:
            seen.add(name)
            body = generated() if generated is not None else _expanded(name, directory, seen, parts)
            body += "" if body.endswith("\n") else "\n"
            line = text.count("\n", 0, m.end()) + 2  # the line after the #include
            pieces.append(f'#line 1 "{name}"\n{body}#line {line} "{filename}"')
        at = m.end()
    pieces.append(text[at:])
    return "".join(pieces)


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one kernel."""

    registers: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    shared_bytes: int = 0


@dataclass(frozen=True, repr=False)
class Program:
    """A compiled kernel source.

    Attributes:
        cubin: the machine code, loadable with cuModuleLoadData.
        log: NVRTC's log (warnings and the ptxas report).
        arch: the target, e.g. ``"sm_90"``.
        resources: per-kernel ptxas report, by kernel name (empty when NVRTC returns no
            log, as seen under compute-sanitizer).
        options: the full option list NVRTC was given.
        name: the source's file name.
    """

    cubin: bytes
    log: str
    arch: str
    options: tuple[str, ...]
    name: str = "kernel.cu"
    resources: dict[str, KernelResources] = field(default_factory=dict)

    def sections(self) -> dict[str, bytes | int]:
        """The cubin's ELF sections by name: their bytes, or the size of one that holds none
        in the file (NOBITS, as ``.nv.shared.<kernel>``). A kernel's machine code is
        ``.text.<kernel>``: two builds of a kernel compare by these."""
        cubin = self.cubin
        (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
        entsize, count, names_at = struct.unpack_from("<HHH", cubin, 0x3A)
        headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
        names = headers[names_at][4]
        out: dict[str, bytes | int] = {}
        for name_at, kind, _flags, _addr, offset, size in headers:
            name = cubin[names + name_at : cubin.index(b"\0", names + name_at)].decode()
            out[name] = size if kind == 8 else cubin[offset : offset + size]
        return out

    def __repr__(self) -> str:
        kernels = ", ".join(sorted(self.resources)) or "?"
        return (
            f"Program(name={self.name!r}, arch={self.arch!r}, cubin={len(self.cubin)} bytes, "
            f"kernels=[{kernels}])"
        )


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_PROPS_RE = re.compile(r"Function properties for (\S+)")
_STACK_RE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_USED_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")


def parse_resources(log: str) -> dict[str, KernelResources]:
    """Parse ptxas ``-v`` output into a per-entry-function report."""
    entries: dict[str, dict[str, int]] = {}
    current: str | None = None
    for line in log.splitlines():
        if m := _ENTRY_RE.search(line):
            current = m.group(1)
            entries.setdefault(current, {})
        elif m := _PROPS_RE.search(line):
            current = m.group(1) if m.group(1) in entries else None
        elif current is not None and (m := _STACK_RE.search(line)):
            stack, stores, loads = (int(g) for g in m.groups())
            entries[current].update(stack_bytes=stack, spill_stores=stores, spill_loads=loads)
        elif current is not None and (m := _USED_RE.search(line)):
            entries[current]["registers"] = int(m.group(1))
            if s := _SMEM_RE.search(line):
                entries[current]["shared_bytes"] = int(s.group(1))
    return {name: KernelResources(**vals) for name, vals in entries.items()}


def normalize_arch(arch: str) -> str:
    """Validate an architecture name like ``sm_90`` (``compute_XY`` is refused: PTX is not
    loadable on drivers older than NVRTC, so ferrox always builds cubin)."""
    if not isinstance(arch, str) or not _ARCH_RE.match(arch):
        raise ValueError(f"arch: expected a name like 'sm_90', got {arch!r}")
    if arch.startswith("compute_"):
        raise ValueError(
            f"arch: {arch!r} asks for PTX; ferrox compiles to cubin (sm_XY) because a driver "
            f"older than NVRTC refuses newer PTX"
        )
    return arch


@cache
def nvrtc_archs() -> tuple[int, ...]:
    """The ``sm_XY`` targets (as XY) this NVRTC compiles for, e.g. (75, 80, ..., 121).

    Raises:
        NoDeviceError: NVRTC cannot be loaded.
    """
    return tuple(int(a) for a in rtc("nvrtcGetSupportedArchs"))


def check_nvrtc_arch(arch: str) -> None:
    """Refuse an architecture this NVRTC does not compile for, in one line naming those it
    does (NVRTC's own refusal is a log about its option parser).

    Raises:
        ValueError: ``arch`` is not one of ``nvrtc_archs()``.
    """
    m = _ARCH_RE.match(arch)
    known = nvrtc_archs()
    if m is None or int(m[2]) not in known:
        major, minor = nvrtc_version()
        raise ValueError(
            f"arch: NVRTC {major}.{minor} compiles for "
            f"{', '.join(f'sm_{a}' for a in known)}; got {arch!r}"
        )


def nvrtc_options(arch: str, options: Sequence[str] = ()) -> tuple[str, ...]:
    """Every option NVRTC is given for ``arch``: the fixed ones, then ``options``."""
    return (
        f"--gpu-architecture={arch}",
        "--std=c++17",
        "--ptxas-options=-v",
        f"--pre-include={PRELUDE_NAME}",
        *options,
    )


def prelude_source() -> str:
    """The text pre-included into every compile (``ferrox_prelude.cuh``)."""
    return _prelude()


@cache
def _prelude() -> str:
    return expand_includes(PRELUDE_NAME, source_dir())


def compile_source(
    source: str,
    *,
    arch: str | None = None,
    options: Sequence[str] = (),
    name: str = "kernel.cu",
) -> Program:
    """Compile CUDA C++ to a cubin with NVRTC.

    The source is compiled with ferrox's prelude pre-included (INFINITY, NAN, fp16/bf16
    conversions), C++17, and ``--ptxas-options=-v`` so the resource report is available.

    Args:
        source: the kernel source text.
        arch: target such as ``"sm_90"``; default: the current device's. No GPU is needed
            when it is given.
        options: extra NVRTC options, e.g. ``("-DBLOCK=128",)``.
        name: file name used in the log.

    Returns:
        The Program (cubin, log, per-kernel resources).

    Raises:
        CompileError: NVRTC rejected the source; the error carries the log.
        ValueError: bad ``arch`` (or one this NVRTC does not compile for) or options.
        NoDeviceError: ``arch`` omitted and no GPU present.
    """
    if not isinstance(source, str):
        raise TypeError(f"source: expected str, got {type(source).__name__}")
    if isinstance(options, str) or not all(isinstance(o, str) for o in options):
        raise TypeError(f"options: expected a sequence of str, got {options!r}")
    if arch is None:
        from .device import default_device

        arch = default_device().arch
    arch = normalize_arch(arch)
    check_nvrtc_arch(arch)
    opts = nvrtc_options(arch, options)
    prelude = prelude_source().encode()
    prog = rtc(
        "nvrtcCreateProgram", source.encode(), name.encode(), 1, [prelude], [PRELUDE_NAME.encode()]
    )
    try:
        status = nvrtc_compile(prog, opts)
        size = rtc("nvrtcGetProgramLogSize", prog)
        buf = bytearray(size)  # (never b" " * size: at size 1 that is Python's shared b" ")
        rtc("nvrtcGetProgramLog", prog, buf)
        log = buf.rstrip(b"\0 ").decode(errors="replace")
        if status is not None:
            raise CompileError(name, log or str(status), opts)
        size = rtc("nvrtcGetCUBINSize", prog)
        cubin = bytearray(size)
        rtc("nvrtcGetCUBIN", prog, cubin)
    finally:
        rtc("nvrtcDestroyProgram", prog)
    return Program(bytes(cubin), log, arch, opts, name, parse_resources(log))


def nvrtc_version_string() -> str:
    major, minor = nvrtc_version()
    return f"{major}.{minor}"
