"""Several waves of blocks with two or more resident per multiprocessor, against the
one-wave plans, for long decodes (fp16/bf16 tensor-core kernels).

The one-wave plans give every block an equal chunk fixed at launch; the blocks' loops end
over a wide spread (block_timeline.py: 98-134 us at 131072 tokens on 32/8/128), so the
decode waits for the slowest multiprocessor. More, shorter chunks in several waves let the
hardware hand the next block to whichever multiprocessor frees first; v9 found that with
one block per multiprocessor each new block's ramp (first loads, epilogue) costs more than
that gains (wave_variants.py). Here a smaller ring gives two or three resident blocks per
multiprocessor, so one block's ramp overlaps another's streaming. Each chunk is still a
fixed range of tokens with its own partial, merged by the combine kernel in a fixed order:
the result is as reproducible as today's.

    PYTHONPATH=. python3 docs/perf-history/occupancy_waves.py [32/32/128 ...]

A cell "S=s w x m" is a ring of s steps per warp, w warps, m waves of (blocks per SM x 132)
blocks; "plan" is what plan_split picks.
"""

from __future__ import annotations

import dataclasses
import re
import sys

from points import edited_source, points

import ferrox_driver as fd
from ferrox_driver.attention import MAX_SPLITS, stream_workspace
from ferrox_driver.compiler import compile_source
from ferrox_driver.launch import Module

CASES = [
    ((32, 32, 128), "bf16", [32768, 131072]),
    ((32, 8, 128), "bf16", [32768, 131072]),
    ((16, 2, 64), "bf16", [32768, 131072]),
    ((8, 1, 256), "bf16", [131072]),
]
# head_dim -> (stages, warps) of the variants
RINGS = {128: [(2, 4), (3, 4)], 64: [(2, 8), (4, 4)], 256: [(2, 2), (3, 2)]}
WAVES = (1, 2, 4, 8)


def variant_kernels(dev: fd.Device, head_dim: int, name: str) -> list[tuple[int, int, object]]:
    """(stages, warps, kernel) for head_dim's rings, compiled from the current source with
    -D options (only the fp16/bf16 tensor-core entries kept: a shorter compile)."""
    src = edited_source([])
    src = re.sub(r"^FX_(GENERIC_FOR_TYPE|TC32_ENTRY)\(.*$", "", src, flags=re.MULTILINE)
    out = []
    for stages, warps in RINGS[head_dim]:
        opts = (f"-DFX_STAGES_D{head_dim}={stages}", f"-DFX_WARPS_D{head_dim}={warps}")
        prog = compile_source(src, options=opts, name=f"ring_s{stages}_w{warps}.cu")
        out.append((stages, warps, Module(prog, dev).get_function(name)))
    return out


def result(p, plan, kern=None):  # type: ignore[no-untyped-def]
    """The decode's output as float32 (a sanity check that a variant computes the same)."""
    floats = plan.workspace_floats(p.n_heads, p.head_dim)
    ws = stream_workspace(p.q.device, p.stream, floats) if floats else None
    p.decode(plan, ws, kern)
    return p.out.to_host(p.stream).astype("float32")


def main() -> None:
    stream = fd.Stream()
    dev = stream.device
    sms = dev.multiprocessor_count
    kernels: dict[tuple[int, str], list[tuple[int, int, object]]] = {}
    for p in points(CASES, stream, sys.argv[1:]):
        plan = p.plan()
        base = dataclasses.replace(plan, kernel=plan.kernel.removesuffix("_cluster"), cluster=0)
        key = (p.head_dim, base.kernel)
        if key not in kernels:
            kernels[key] = variant_kernels(dev, p.head_dim, base.kernel)
        ref = result(p, plan)
        us = p.time(plan)
        cells = [f"plan {plan.splits}/head {us:.1f} ({p.pct(us):.0f}%)"]
        for stages, warps, kern in kernels[key]:
            c = dataclasses.replace(base, stages=stages, threads=32 * warps)
            per_sm = kern.max_active_blocks(c.threads, c.shared_bytes(p.head_dim, 2))
            for m in WAVES:
                splits = m * per_sm * sms // p.n_kv
                if splits > MAX_SPLITS or splits * c.tile > p.seq:
                    continue
                v = dataclasses.replace(c, splits=splits)
                err = float(abs(result(p, v, kern) - ref).max())
                us = p.time(v, kernel=kern)
                cells.append(
                    f"S={stages} {warps}w x{m} [{per_sm}/SM] {us:.1f} ({p.pct(us):.0f}%)"
                    + ("" if err < 1e-2 else f" DIFF {err:.2g}")
                )
        print(p.label + ": " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
