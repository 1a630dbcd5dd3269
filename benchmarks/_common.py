"""What the benchmark scripts share: for each (shape, dtype, seq_len) point, q and out (q
uniform in [-1, 1)), the benchmark's rotated KV sets and a decode timed back to back in one
captured graph; the kernel file at a git revision; the sections of a cubin.

    for p in points(CASES, stream):
        us = p.time(p.plan())
        print(p.label, f"{us:.1f} us")
"""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import ferrox_driver as fd
from ferrox_driver.apps.bench.harness import (
    KVSets,
    captured,
    fill_uniform,
    rotated_kv_sets,
    time_events,
)
from ferrox_driver.driver.compiler import expand_includes
from ferrox_driver.experimental import SplitPlan, plan_split, split_launches

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}
Case = tuple[tuple[int, int, int], str, Sequence[int]]  # (q heads, kv heads, head_dim), dtype
Kernels = dict[str, Any]  # launch kernel name -> a variant Kernel to run in its place


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

    def plan(self) -> SplitPlan:
        """The library's plan for this point."""
        dev = self.q.device
        return plan_split(dev, self.dtype, self.n_heads, self.n_kv, self.head_dim, self.seq)

    def decode(
        self,
        plan: SplitPlan,
        kernels: Kernels | None = None,
        kv: tuple[fd.DeviceArray, fd.DeviceArray] | None = None,
    ) -> None:
        """Queue one decode of ``plan`` over ``kv`` (default: the first set) into ``out``,
        each kernel named in ``kernels`` replaced by its variant."""
        k, v = kv or self.sets[0]
        floats = plan.workspace_floats(self.n_heads, self.head_dim)
        ws = self._workspace(floats)
        for launch in split_launches(
            plan,
            self.q,
            k,
            v,
            self.out,
            ws,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv,
            head_dim=self.head_dim,
            seq_len=self.seq,
            seq_len_dev=None,
        ):
            launch.run(self.stream, self.q.device, (kernels or {}).get(launch.kernel))

    def _workspace(self, floats: int) -> fd.DeviceArray | None:
        if not floats:
            return None
        ws = getattr(self, "_ws", None)
        if ws is None or ws.size < floats:
            ws = self._ws = fd.empty((floats,), np.float32, device=self.q.device)
        return ws

    def time(self, plan: SplitPlan, kernels: Kernels | None = None, iters: int = 30) -> float:
        """Microseconds per decode: one captured graph of ``chain`` decodes over the sets
        in turn, replayed between two events; the median of ``iters``."""
        turn = [0]

        def one() -> None:
            self.decode(plan, kernels, self.sets[turn[0] % len(self.sets)])
            turn[0] += 1

        one()
        self.stream.synchronize()
        turn[0] = 0
        exe = captured(self.stream, one, self.chain)
        us = time_events(lambda i: exe.launch(self.stream), self.stream, iters, 3, self.chain)
        exe.close()
        return us


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


def source_at(rev: str, filename: str = "gqa_decode_split.cu") -> str:
    """The kernel file ``filename`` as it was at git revision ``rev``, its parts in place (as
    the package reads the working tree's; the generated ones from that revision's
    kernel_traits)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout

    # the parts the host writes, as that revision's kernel_traits wrote them (when it had one)
    # (ferrox_driver/kernels/traits.py since the package's layers; kernel_traits.py before)
    parts = None
    for traits in ("ferrox_driver/kernels/traits.py", "ferrox_driver/kernel_traits.py"):
        if traits in git("ls-tree", "-r", "--full-tree", "--name-only", rev, traits).split():
            namespace: dict[str, Any] = {"__name__": f"kernel_traits_at_{rev}"}
            exec(compile(git("show", f"{rev}:{traits}"), traits, "exec"), namespace)
            parts = namespace.get("GENERATED_PARTS")
            break
    with tempfile.TemporaryDirectory() as tmp:
        for path in git("ls-tree", "--full-tree", "--name-only", rev, "cuda_src/").split():
            (Path(tmp) / Path(path).name).write_text(git("show", f"{rev}:{path}"))
        return expand_includes(filename, Path(tmp), parts)
