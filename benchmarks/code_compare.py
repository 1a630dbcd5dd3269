"""The split kernels' machine code at a git revision against the working tree's, on sm_80,
sm_90 and sm_100 (NVRTC, no GPU): each kernel's code, its constant bank and its shared
memory, and its ptxas report (registers, stack, spills); kernels added or removed are listed
apart. The 47 kernels of the whole file, and ON_DEMAND: kernels the host makes for a call
(padded head dims, pairs, tiles, features, head-major rows, fp8 caches) as KernelSpec values,
each family at least once, compiled as the library compiles them (FX_SELECTED and their
entry lines).
(Not .nv.info: it names symbols by their index, which moves when a kernel is added.)
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

from ferrox_driver.driver.compiler import Program, compile_source
from ferrox_driver.kernels.catalogue import kernel_source
from ferrox_driver.kernels.spec import KernelSpec

ARCHS = ["sm_80", "sm_90", "sm_100"]
M, G, T, C = "mma", "generic", "tc32", "combine"
ON_DEMAND = [
    KernelSpec(M, "bf16", 64, 40),  # gqa_split_mma_bf16_d64_r40
    KernelSpec(M, "f16", 128, 72, cluster=True),
    KernelSpec(M, "bf16", 128, 80, cluster=True),  # a ring depth of its own
    KernelSpec(M, "f16", 256, 160),
    KernelSpec(M, "bf16", 128, tiles=2, cluster=True),
    KernelSpec(M, "bf16", 64, 40, tiles=2),
    KernelSpec(M, "bf16", 128, 80, paired=True),  # gqa_split_mma_bf16_d128_r80_p2
    KernelSpec(M, "f16", 256, 144, paired=True),
    KernelSpec(M, "bf16", 128, 96, paired=True, tiles=2),
    KernelSpec(M, "bf16", 128, features=127),  # gqa_split_mma_bf16_d128_x127
    KernelSpec(M, "f16", 256, features=127, cluster=True),
    KernelSpec(M, "bf16", 64, features=63, cluster=True),
    KernelSpec(M, "bf16", 128, 80, tiles=2, features=63),
    KernelSpec(M, "bf16", 128, wide=True, features=63, cluster=True),
    KernelSpec(T, "f32", 128, features=127),  # gqa_split_tc32_f32_d128_x127
    KernelSpec(T, "f32", 64, features=63),
    KernelSpec(G, "bf16", heads_per_block=4, features=127),  # gqa_split_bf16_g4_any_x127
    KernelSpec(G, "f32", heads_per_block=8, vec=True, features=63),
    KernelSpec(C, "f32", features=25),  # gqa_split_combine_f32_x25
    KernelSpec(M, "bf16", 128, fp8="e4m3", cluster=True),  # ..._bf16_e4m3_d128_x0_cluster
    KernelSpec(M, "f16", 128, 96, fp8="e5m2", features=16),
    KernelSpec(M, "bf16", 64, tiles=2, fp8="e4m3", features=127),
    KernelSpec(M, "bf16", 256, fp8="e4m3", features=63),
    KernelSpec(M, "bf16", 128, wide=True, fp8="e4m3", cluster=True),
]


def on_demand(src: str, arch: str) -> str:
    """The split file ``src`` with the ON_DEMAND kernels' entry lines for ``arch`` (the fp8
    ones from sm_89: their conversions), as the host compiles a plan's kernels."""
    fp8 = int(arch.removeprefix("sm_")) >= 89
    entries = "\n".join(spec.entry for spec in ON_DEMAND if fp8 or not spec.fp8)
    return f"#define FX_SELECTED 1\n{src}\n{entries}\n"


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
    files = {rev: source_at(rev), "working tree": kernel_source("gqa_decode_split.cu")}
    labels = [*files, *(f"{k} (on demand)" for k in files)]
    jobs = [(label, arch, src) for label, src in files.items() for arch in archs]
    jobs += [(f"{label} (on demand)", arch, on_demand(src, arch))
             for label, src in files.items() for arch in archs]  # fmt: skip
    with ProcessPoolExecutor(min(len(jobs), 4)) as pool:
        done = {(label, arch): (secs, res) for label, arch, secs, res in pool.map(report, jobs)}
    differ = 0
    for arch, (old, new) in ((a, pair) for pair in ((0, 1), (2, 3)) for a in archs):
        (old_secs, old_res), (new_secs, new_res) = (done[labels[i], arch] for i in (old, new))
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
        what = "on-demand kernels" if old else "kernels"
        print(f"{arch}: {len(kernels)} {what} in both, {differ} differ so far", flush=True)
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
