"""The split kernels' machine code at a git revision against the working tree's, on sm_80,
sm_90 and sm_100 (NVRTC, no GPU): each kernel's code, its constant bank and its shared
memory, and its ptxas report (registers, stack, spills); kernels added or removed are listed
apart. (Not .nv.info: it names symbols by their index, which moves when a kernel is added.)
A change that leaves the kernels of both alike needs no timing run for them; one that does
not says where to look. Exit status 1 when any kernel of both differs.

    python3 benchmarks/code_compare.py REV [arch ...]

(A tidy-up once compiled to the same code on sm_90 and sm_80 but spilled on sm_100, which
the CPU compile test caught: docs/design.md. So all three by default.)
"""

from __future__ import annotations

import hashlib
import sys
from concurrent.futures import ProcessPoolExecutor

from _common import source_at

from ferrox_driver.compiler import Program, compile_source, kernel_source

ARCHS = ["sm_80", "sm_90", "sm_100"]
KERNEL_SECTIONS = (".text.", ".nv.constant0.", ".nv.shared.")


def sections(program: Program) -> dict[str, str]:
    """A digest of each kernel's sections of a program's cubin, by section name
    (.nv.shared.* holds no bytes: its size)."""
    return {
        name: f"{data} bytes" if isinstance(data, int) else hashlib.sha256(data).hexdigest()
        for name, data in program.sections().items()
        if name.startswith(KERNEL_SECTIONS)
    }


def report(job: tuple[str, str, str]) -> tuple[str, str, dict[str, str], dict[str, object]]:
    label, arch, src = job
    program = compile_source(src, arch=arch, name="gqa_decode_split.cu")
    return label, arch, sections(program), dict(program.resources)


def main() -> None:
    rev, archs = sys.argv[1], sys.argv[2:] or ARCHS
    sources = {rev: source_at(rev), "working tree": kernel_source("gqa_decode_split.cu")}
    jobs = [(label, arch, src) for label, src in sources.items() for arch in archs]
    with ProcessPoolExecutor(len(jobs)) as pool:
        done = {(label, arch): (secs, res) for label, arch, secs, res in pool.map(report, jobs)}
    differ = 0
    for arch in archs:
        (old_secs, old_res), (new_secs, new_res) = (done[label, arch] for label in sources)
        kernels = sorted(set(old_res) & set(new_res))
        for label, names in (
            ("only at " + rev, set(old_res) - set(new_res)),
            ("only in the working tree", set(new_res) - set(old_res)),
        ):
            if names:
                print(f"{arch} {label}: {', '.join(sorted(names))}")
        for k in kernels:
            names = sorted(n for n in set(old_secs) | set(new_secs) if n.endswith("." + k))
            changed = [n.rsplit(".", 1)[0] for n in names if old_secs.get(n) != new_secs.get(n)]
            if changed or old_res.get(k) != new_res.get(k):
                differ += 1
                print(
                    f"{arch} {k}: {', '.join(changed) or 'same sections'}; "
                    f"{old_res.get(k)} -> {new_res.get(k)}"
                )
        print(f"{arch}: {len(kernels)} kernels in both, {differ} differ so far", flush=True)
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
