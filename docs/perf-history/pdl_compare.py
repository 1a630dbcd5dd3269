"""The combine kernel launched early (programmatic dependent launch) against an ordinary
launch, for the combine plans plan_split makes, back to back over rotated KV sets: the
same bits out, and the time per decode with the split kernels letting the combine start
at their end (implicit), after their main loops, or at their entry (FX_PDL_TRIGGER).

    PYTHONPATH=. python3 docs/perf-history/pdl_compare.py [shape ...] [--variants plain,loop]

Each variant is timed twice, alternating, and the faster of its two times is printed.
"""

from __future__ import annotations

import sys

import numpy as np
from points import load_variant, points

import ferrox_driver as fd
from ferrox_driver import attention
from ferrox_driver.attention import stream_workspace
from ferrox_driver.compiler import kernel_source

CASES = [
    ((32, 8, 128), "bf16", [4096, 32768]),
    ((64, 8, 128), "bf16", [4096, 32768]),
    ((28, 4, 128), "bf16", [4096, 32768]),
    ((32, 32, 128), "bf16", [4096, 32768]),
    ((16, 2, 64), "bf16", [4096, 32768, 131072]),
    ((8, 1, 256), "bf16", [4096, 32768]),
    ((32, 8, 128), "f32", [4096]),
    ((32, 32, 128), "f32", [4096]),
    ((8, 1, 256), "f32", [512, 4096]),
]
# variant: (launched early, FX_PDL_TRIGGER); all four by default, "plain loop" for two
VARIANTS = {"plain": (False, 1), "exit": (True, 0), "loop": (True, 1), "entry": (True, 2)}


def main() -> None:
    args = sys.argv[1:]
    names = list(VARIANTS)
    if "--variants" in args:
        i = args.index("--variants")
        names = args[i + 1].split(",")
        del args[i : i + 2]
    stream = fd.Stream()
    src = kernel_source("gqa_decode_split.cu")
    by_trigger = {
        t: load_variant(f"#define FX_PDL_TRIGGER {t}\n" + src, f"pdl{t}.cu")
        for t in {VARIANTS[name][1] for name in names}
    }
    modules = {name: by_trigger[VARIANTS[name][1]] for name in names}
    for p in points(CASES, stream, args):
        plan = p.plan()
        if plan.cluster:
            print(f"{p.label} {plan.kernel}: a cluster plan, no combine kernel", flush=True)
            continue
        combine = f"gqa_split_combine_{p.dtype_name}"
        kernels = {
            k: (m.get_function(plan.kernel), m.get_function(combine)) for k, m in modules.items()
        }
        ws = stream_workspace(stream.device, stream, plan.workspace_floats(p.n_heads, p.head_dim))
        bits = {}
        for name, (split, comb) in kernels.items():
            attention.EARLY_COMBINE = VARIANTS[name][0]
            p.out.fill_bytes(0xFF, stream)  # NaN: an unwritten output shows
            p.decode(plan, ws, split, combine=comb)
            stream.synchronize()
            bits[name] = p.out.to_host().view(np.uint8).copy()
        same = all(np.array_equal(bits["plain"], b) for b in bits.values())
        times: dict[str, float] = {}
        for _ in range(2):
            for name, (split, comb) in kernels.items():
                attention.EARLY_COMBINE = VARIANTS[name][0]
                us = p.time(plan, split, combine=comb)
                times[name] = min(times.get(name, us), us)
        base = times["plain"]
        cells = ", ".join(
            f"{name} {us:.2f}" + ("" if name == "plain" else f" ({100 * (us / base - 1):+.1f}%)")
            for name, us in times.items()
        )
        print(
            f"{p.label} {plan.kernel} ({plan.splits} chunks): {cells} us, "
            f"{'same bits' if same else 'BITS DIFFER'}",
            flush=True,
        )
    attention.EARLY_COMBINE = True


if __name__ == "__main__":
    main()
