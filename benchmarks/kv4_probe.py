r"""Where a 4-bit decode's time goes: the swapped q4 kernel as built against the same kernel
with parts of its loop taken out (FX_Q4_PROBE in split_mma_swapped.cuh: 1 copies only, 2
compute only on the ring's first bytes, 3 one mask a pair in place of the widening, 4 the
values' copies only, 5 neither copies nor compute: what is left is the fixed cost) or other
traits, and the read floor, in one process, graph-replayed, each variant timed twice,
alternating (docs/design.md, issue 49).

    PYTHONPATH=. python benchmarks/kv4_probe.py [--shapes 32/8/128 8/1/256] [--seqs 131072]
        [--variants base FX_Q4_PROBE=2 FX_Q4_PROBE=2,FX_WARPS4_D128=16,FX_STAGES4_D128=3 ...]
        [--floors] [--launches]

--floors: each read floor kernel's time apart (by rows of one head, flat); --launches: each
decode's kernels, grids and blocks. Compute alone (FX_Q4_PROBE=2) takes the same time on an
H100 and an H200 (the same multiprocessors and clocks), so it is the H200's compute bound
measured on either.

The runs issue 49 still owes (docs/design.md), in one device command:

    python3 benchmarks/kv4_probe.py --shapes 32/8/128 8/1/256   # every probe, on an H200
    python3 benchmarks/kv4_probe.py --variants base FX_Q4_PROBE=2 \
        FX_Q4_PROBE=2,FX_WARPS4_D128=16,FX_STAGES4_D128=3 \
        FX_Q4_PROBE=2,FX_WARPS4_D128=8,FX_STAGES4_D128=6 --shapes 32/8/128 --seqs 131072
    python3 benchmarks/kv4_probe.py --floors --launches --variants base FX_Q4_PROBE=1 \
        --shapes 32/8/128 16/4/256 8/1/256
    ncu -k regex:gqa_split_mma_.*q4 -c 1 --section SchedulerStats --section WarpStateStats \
        python3 benchmarks/kv4_probe.py --variants FX_Q4_PROBE=2 --shapes 32/8/128 --seqs 131072
"""

from __future__ import annotations

import argparse

from ferrox_driver.apps.bench import kv4_speed as ks
from ferrox_driver.kernels import catalogue
from ferrox_driver.kernels.traits import SPLIT_TRAITS

DEFAULTS = dict(SPLIT_TRAITS, FX_Q4_PROBE=0)


def set_variant(spec: str) -> None:
    """Traits as DEFAULTS but for ``spec`` (NAME=VALUE,...; "base": none), sources rebuilt."""
    SPLIT_TRAITS.clear()
    SPLIT_TRAITS.update(DEFAULTS)
    ks.set_traits([pair for pair in spec.split(",") if pair and pair != "base"])
    catalogue.kernel_source.cache_clear()
    catalogue._kernels.clear()


def floors(shape: tuple[int, ...], seq: int, fmt: str) -> str:
    """Each read floor kernel's best, apart: by rows (per head) and flat."""
    out = []
    for label, attr in (("rows", "FLOOR_BLOCKS"), ("flat", "FLOOR_SPLITS")):
        saved = getattr(ks, attr)
        setattr(ks, attr, ())
        try:
            _, _, fl = ks.four_bit_us(shape, seq, 1, fmt, floor=True)  # type: ignore[arg-type]
        finally:
            setattr(ks, attr, saved)
        out.append(f"{label} {fl:.2f}")
    return ", ".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=["32/8/128", "8/1/256"])
    parser.add_argument("--seqs", nargs="+", type=int, default=[32768, 131072])
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["base", *(f"FX_Q4_PROBE={p}" for p in range(1, 6))],
    )
    parser.add_argument("--fmt", default="q4")
    parser.add_argument("--floors", action="store_true", help="each floor kernel apart")
    parser.add_argument("--launches", action="store_true", help="print each decode's launches")
    args = parser.parse_args()
    if args.launches:
        inner = ks.launches_for
        seen: set[str] = set()

        def shown(*a, **kw):  # type: ignore[no-untyped-def]
            got = inner(*a, **kw)
            for launch in got[0]:
                line = (f"  {launch.spec.name} grid {launch.grid} block {launch.block} "
                        f"smem {launch.shared_mem}")  # fmt: skip
                if line not in seen:
                    seen.add(line)
                    print(line, flush=True)
            return got

        ks.launches_for = shown  # type: ignore[assignment]
    for i, v in enumerate(args.variants):
        print(f"v{i}: {v}")
    print(
        f"{'shape':>9} {'seq':>7} {'floor':>7} "
        + " ".join(f"{'v' + str(i):>7}" for i in range(len(args.variants)))
    )
    for shape_s in args.shapes:
        shape = tuple(int(x) for x in shape_s.split("/"))
        for seq in args.seqs:
            best = [float("inf")] * len(args.variants)
            floor = float("nan")
            for rnd in range(2):
                for i, v in enumerate(args.variants):
                    set_variant(v)
                    us, _, fl = ks.four_bit_us(shape, seq, 1, args.fmt, floor=rnd == 0 and i == 0)  # type: ignore[arg-type]
                    best[i] = min(best[i], us)
                    if fl == fl:
                        floor = fl
            extra = f"  ({floors(shape, seq, args.fmt)})" if args.floors else ""
            print(
                f"{shape_s:>9} {seq:>7} {floor:7.2f} "
                + " ".join(f"{b:7.2f}" for b in best)
                + extra,
                flush=True,
            )
    set_variant("base")


if __name__ == "__main__":
    main()
