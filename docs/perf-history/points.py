"""The setup the docs/perf-history experiments share: for each (shape, dtype, seq_len) point,
q and out (q uniform in [-1, 1)), the benchmark's rotated KV sets, and the decode, timing
and bookkeeping helpers; everything is closed when the caller moves on. And kernel
variants: the split-kernel file with anchored edits, compiled and loaded.

    for p in points(CASES, stream, only):
        us = p.time(p.plan())
        print(p.label, f"{us:.1f} us ({p.pct(us):.0f}%)")
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import ferrox_driver as fd
from ferrox_driver.attention import SplitPlan, launch_split, plan_split, stream_workspace
from ferrox_driver.bench_decode import KVSets, fill_uniform, rotated_kv_sets, time_split_plan
from ferrox_driver.compiler import compile_source, expand_includes, kernel_source
from ferrox_driver.launch import Module
from ferrox_driver.reference import reference_gqa_decode

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}
CEILING = 4.35e12  # bytes/s: the percentages' nominal read ceiling (the bench measures its own)
Case = tuple[tuple[int, int, int], str, Sequence[int]]  # (q heads, kv heads, head_dim), dtype
Run = tuple[str, SplitPlan, Any]  # label, plan, its split kernel (None: the library's)
# The fp32 tensor-core points (groups of 4 went to CUDA cores above 32768 until v17)
TC32_SEQS = [512, 4096, 32768, 131072]
TC32_CASES: list[Case] = [
    ((32, 8, 128), "f32", [512, 4096, 32768]),
    ((64, 8, 128), "f32", TC32_SEQS),
    ((28, 4, 128), "f32", [512, 4096, 32768]),
    ((16, 2, 64), "f32", TC32_SEQS),
    ((8, 1, 256), "f32", TC32_SEQS),
]


@dataclass
class Point:
    n_heads: int
    n_kv: int
    head_dim: int
    dtype_name: str
    seq: int
    q: fd.DeviceArray
    out: fd.DeviceArray
    sets: KVSets
    chain: int  # decodes in one back-to-back graph
    stream: fd.Stream

    @property
    def dtype(self) -> Any:
        return DTYPES[self.dtype_name]

    @property
    def label(self) -> str:
        return f"{self.n_heads}/{self.n_kv}/{self.head_dim} {self.dtype_name} {self.seq:>6}"

    @property
    def kv_bytes(self) -> int:
        return 2 * self.seq * self.n_kv * self.head_dim * np.dtype(self.dtype).itemsize

    def pct(self, us: float) -> float:
        """Percent of CEILING that reading the KV cache in ``us`` microseconds is."""
        return 100 * self.kv_bytes / (us * 1e-6) / CEILING

    def plan(self, plan_seq: int | None = None, clusters: bool = True) -> SplitPlan:
        """plan_split's plan for this point (or for ``plan_seq`` tokens); with
        ``clusters=False`` the plan with the combine kernel (FERROX_CLUSTER=0)."""
        saved = os.environ.get("FERROX_CLUSTER")
        if not clusters:
            os.environ["FERROX_CLUSTER"] = "0"
        try:
            return plan_split(
                self.q.device, self.dtype, self.n_heads, self.n_kv, self.head_dim,
                self.seq if plan_seq is None else plan_seq,
            )  # fmt: skip
        finally:
            if saved is None:
                os.environ.pop("FERROX_CLUSTER", None)
            else:
                os.environ["FERROX_CLUSTER"] = saved

    def time(
        self, plan: SplitPlan, kernel: Any = None, parts: str = "both", combine: Any = None
    ) -> float:
        """Microseconds per decode, back to back over the rotated sets (time_split_plan)."""
        return time_split_plan(
            plan, self.q, self.out, self.sets, self.chain, self.stream, kernel, parts=parts,
            combine=combine,
        )  # fmt: skip

    def decode(
        self,
        plan: SplitPlan,
        workspace: fd.DeviceArray | None,
        kernel: Any = None,
        kv: tuple[fd.DeviceArray, fd.DeviceArray] | None = None,
        combine: Any = None,
    ) -> None:
        """Queue one decode of ``plan`` (``kernel`` and ``combine`` replacing its kernels)
        over ``kv`` (default: the first set) into ``out``."""
        k, v = kv or self.sets[0]
        launch_split(
            plan, self.q, k, v, self.out, workspace, n_heads=self.n_heads, n_kv_heads=self.n_kv,
            head_dim=self.head_dim, seq_len=self.seq, seq_len_dev=None, stream=self.stream,
            kernel=kernel, combine=combine,
        )  # fmt: skip

    def outputs(self, runs: Sequence[Run]) -> dict[str, np.ndarray]:
        """Each run's output (float64) over the first KV set, ``out`` poisoned with NaN
        before each, so an unwritten element shows."""
        outs = {}
        for label, plan, kern in runs:
            floats = plan.workspace_floats(self.n_heads, self.head_dim)
            ws = stream_workspace(self.stream.device, self.stream, floats) if floats else None
            self.out.fill_bytes(0xFF, self.stream)
            self.decode(plan, ws, kern)
            self.stream.synchronize()
            outs[label] = self.out.to_host().astype(np.float64)
        return outs

    def errors(self, outs: dict[str, np.ndarray]) -> dict[str, float]:
        """Each output's largest error against the float64 reference over the first KV
        set, relative to the reference's largest magnitude (max |out - ref| / max |ref|)."""
        k, v = self.sets[0]
        ref = reference_gqa_decode(
            self.q.to_host().astype(np.float64), k.to_host().astype(np.float64),
            v.to_host().astype(np.float64),
            n_heads=self.n_heads, n_kv_heads=self.n_kv, head_dim=self.head_dim,
        )  # fmt: skip
        scale = np.abs(ref).max()
        return {label: float(np.abs(out - ref).max() / scale) for label, out in outs.items()}

    def fastest(self, runs: Sequence[Run], rounds: int = 3) -> dict[str, float]:
        """Each run's fastest time (``time``) over ``rounds`` rounds of the runs in turn."""
        best: dict[str, float] = {}
        for _ in range(rounds):
            for label, plan, kern in runs:
                us = self.time(plan, kern)
                best[label] = min(best.get(label, us), us)
        return best


def plan_kind(plan: SplitPlan) -> str:
    """How a plan merges: "cluster N" or "N chunks" (the combine kernel)."""
    return f"cluster {plan.cluster}" if plan.cluster else f"{plan.splits} chunks"


def against(best: dict[str, float], outs: dict[str, np.ndarray], ref: str) -> list[str]:
    """Each run's time and its difference from run ``ref``'s, flagged where its output's
    bits differ from ``ref``'s."""
    return [
        f"{k} {v:.2f} ({100 * (v / best[ref] - 1):+.1f}%"
        + ("" if np.array_equal(outs[k], outs[ref]) else ", BITS DIFFER")
        + ")"
        for k, v in best.items()
    ]


def new_against_old(p: Point, runs: Sequence[Run], new: str, old: str) -> list[str]:
    """Time two kernels on point ``p`` (``fastest``): each run's time, run ``new``'s change
    against run ``old``'s, and each output's error against the float64 reference up to
    32768 tokens (past that, the largest difference between the two outputs: the host
    reference would take minutes)."""
    outs = p.outputs(runs)
    best = p.fastest(runs)
    cells = [f"{k} {v:.2f}" for k, v in best.items()]
    cells.append(f"({100 * (best[new] / best[old] - 1):+.1f}%)")
    if p.seq <= 32768:
        cells += [f"{label} err {e:.1e}" for label, e in p.errors(outs).items()]
    else:
        cells.append(f"{new} - {old} {np.abs(outs[new] - outs[old]).max():.1e}")
    return cells


def points(cases: Iterable[Case], stream: fd.Stream, only: Sequence[str] = ()) -> Iterator[Point]:
    """Each case's points in turn (``only``: shapes such as "16/2/64" to keep; all when
    empty), the arrays of one closed before the next is made."""
    dev = stream.device
    for (n_heads, n_kv, hd), dtype_name, seqs in cases:
        if only and f"{n_heads}/{n_kv}/{hd}" not in only:
            continue
        dt = DTYPES[dtype_name]
        q = fd.empty((n_heads, hd), dt, device=dev)
        out = fd.empty((n_heads, hd), dt, device=dev)
        fill_uniform(q, 1, stream)
        try:
            for seq in seqs:
                kv = rotated_kv_sets(seq, n_kv, hd, dt, stream, dev)
                try:
                    yield Point(
                        n_heads, n_kv, hd, dtype_name, seq, q, out, kv.sets, kv.chain, stream
                    )
                finally:
                    kv.close()
        finally:
            q.close()
            out.close()


def cubin_sections(cubin: bytes) -> dict[str, bytes | int]:
    """The sections of a cubin (ELF64) by name: their bytes, or the size of one that holds
    none in the file (NOBITS, as .nv.shared.<kernel>)."""
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    entsize, count, names_at = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * entsize) for i in range(count)]
    names = headers[names_at][4]
    out: dict[str, bytes | int] = {}
    for name_at, kind, _flags, _addr, offset, size in headers:
        name = cubin[names + name_at : cubin.index(b"\0", names + name_at)].decode()
        out[name] = size if kind == 8 else cubin[offset : offset + size]
    return out


def source_at(rev: str, filename: str = "gqa_decode_split.cu") -> str:
    """The kernel file ``filename`` as it was at git revision ``rev``, its parts in place (as
    kernel_source reads the working tree's)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout

    with tempfile.TemporaryDirectory() as tmp:
        for path in git("ls-tree", "--full-tree", "--name-only", rev, "cuda_src/").split():
            (Path(tmp) / Path(path).name).write_text(git("show", f"{rev}:{path}"))
        return expand_includes(filename, Path(tmp))


def edited_source(edits: Iterable[tuple[str, str]], src: str | None = None) -> str:
    """``src`` (default: the split-kernel file) with each (anchor, replacement) applied; an
    anchor must occur exactly once, so an edit cannot silently miss after the file moves."""
    src = kernel_source("gqa_decode_split.cu") if src is None else src
    for anchor, replacement in edits:
        assert src.count(anchor) == 1, anchor
        src = src.replace(anchor, replacement)
    return src


def tc32_only(src: str) -> str:
    """The split-kernel file ``src`` with only the fp32 tensor-core entries (and the
    combine kernels) left: the others only slow a variant's compile down."""
    return re.sub(r"^(FX_GENERIC_FOR_TYPE|FX_MMA_ENTRY)\(.*$", "", src, flags=re.MULTILINE)


def load_variant(src: str, name: str, device: Any = None) -> Module:
    """Compile a kernel-file variant and load it."""
    return Module(compile_source(src, name=name), device)


def ring_variant(head_dim: int, warps: int, stages: int, device: Any = None) -> Module:
    """The split-kernel file with the fp16/bf16 head_dim ``head_dim`` kernel's ring set to
    ``warps`` x ``stages`` steps, compiled and loaded (the defines are prepended, so they
    come before the file's own #ifndef defaults)."""
    defines = f"#define FX_WARPS_D{head_dim} {warps}\n#define FX_STAGES_D{head_dim} {stages}\n"
    return load_variant(defines + kernel_source("gqa_decode_split.cu"),
                        f"ring{head_dim}_{warps}x{stages}.cu", device)  # fmt: skip
