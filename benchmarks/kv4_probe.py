r"""Where a 4-bit decode's time goes: the swapped q4 kernel as built against the same kernel
with parts of its loop taken out (FX_Q4_PROBE in split_mma_swapped.cuh: 1 copies only, 2
compute only on the ring's first bytes, 3 one mask a pair in place of the widening, 4 the
values' copies only, 5 neither copies nor compute: what is left is the fixed cost;
FX_Q4_PAIR=1, the loop over two ring steps a pass, once kv4_pair.patch is applied, may join
them) or other traits ("NHD", "HND": the buffers token-major or head-major; else a 4-bit
KVCache's default), and the read floor, in one process, graph-replayed, each variant timed
twice, alternating (docs/design.md, issue 49).

    PYTHONPATH=. python benchmarks/kv4_probe.py [--shapes 32/8/128 8/1/256] [--seqs 131072]
        [--variants base FX_Q4_PROBE=2 FX_Q4_PROBE=2,FX_WARPS4_D128=16,FX_STAGES4_D128=3 ...]
        [--floors] [--launches]

--floors: each read floor kernel's time apart (by rows of one head, flat); --launches: each
decode's kernels, grids and blocks. Compute alone (FX_Q4_PROBE=2) takes the same time on an
H100 and an H200 (the same multiprocessors and clocks), so it is the H200's compute bound
measured on either.

The runs issue 49 still owes (docs/design.md) are in benchmarks/h200_tables.sh, one device
command. --apart times each variant in a process of its own: in one process (after base)
the 16- and 8-warp variants faulted (2026-12-07, H100; cause not yet found: run
compute-sanitizer on one if a fresh process faults too).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from ferrox_driver.apps.bench import kv4_speed as ks
from ferrox_driver.cache.four_bit import DEFAULT_LAYOUT
from ferrox_driver.kernels import catalogue
from ferrox_driver.kernels.traits import SPLIT_TRAITS

DEFAULTS = dict(SPLIT_TRAITS, FX_Q4_PROBE=0, FX_Q4_PAIR=0)


def set_variant(spec: str) -> None:
    """Traits as DEFAULTS but for ``spec`` (NAME=VALUE,...; "base": none; "NHD" or
    "HND": the buffers token-major or head-major, else a KVCache's default), sources
    rebuilt."""
    SPLIT_TRAITS.clear()
    SPLIT_TRAITS.update(DEFAULTS)
    parts = spec.split(",")
    layout = "HND" if "HND" in parts else "NHD" if "NHD" in parts else DEFAULT_LAYOUT
    ks.HEAD_MAJOR = layout == "HND"
    ks.set_traits([pair for pair in parts if pair and pair not in ("base", "NHD", "HND")])
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


def _shape(text: str) -> tuple[int, int, int]:
    n_heads, n_kv, d = (int(x) for x in text.split("/"))
    return n_heads, n_kv, d


_SHOWN: set[str] = set()  # (--apart --launches: the children's launch lines printed)


def _apart(variant: str, shape: str, seq: int, fmt: str, floor: bool,
           launches: bool) -> tuple[float, float]:  # fmt: skip
    """One timing of ``variant`` in a child process: (us, floor us or nan); nan and the
    child's last line where it fails (a fault there leaves this process's context alone)."""
    cmd = [sys.executable, __file__, "--child", variant, shape, str(seq), "--fmt", fmt]
    cmd += ["--floors"] if floor else []
    cmd += ["--launches"] if launches else []
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            us, fl = line.split()[1:]
            return float(us), float(fl)
        if line.startswith("  ") and line not in _SHOWN:
            _SHOWN.add(line)
            print(line, flush=True)  # (--launches)
    tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    print(f"  {variant} {shape} {seq}: {tail}", flush=True)
    return float("nan"), float("nan")


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
    parser.add_argument(
        "--apart",
        action="store_true",
        help="time each variant in a process of its own (the warp counts)",
    )
    parser.add_argument("--child", nargs=3, metavar=("VARIANT", "SHAPE", "SEQ"),
                        help=argparse.SUPPRESS)  # (--apart's one timing)  # fmt: skip
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
    if args.child:  # one variant's one timing: "RESULT us floor" (floor nan unless --floors)
        variant, shape_s, seq_s = args.child
        set_variant(variant)
        us, _, fl = ks.four_bit_us(_shape(shape_s), int(seq_s), 1, args.fmt, floor=args.floors)  # type: ignore[arg-type]
        print(f"RESULT {us} {fl}", flush=True)
        return
    for i, v in enumerate(args.variants):
        print(f"v{i}: {v}")
    print(
        f"{'shape':>9} {'seq':>7} {'floor':>7} "
        + " ".join(f"{'v' + str(i):>7}" for i in range(len(args.variants)))
    )
    for shape_s in args.shapes:
        shape = _shape(shape_s)
        for seq in args.seqs:
            best = [float("inf")] * len(args.variants)
            floor = float("nan")
            for rnd in range(2):
                for i, v in enumerate(args.variants):
                    first = rnd == 0 and i == 0
                    if args.apart:
                        us, fl = _apart(v, shape_s, seq, args.fmt, first, args.launches)
                    else:
                        set_variant(v)
                        us, _, fl = ks.four_bit_us(shape, seq, 1, args.fmt, floor=first)  # type: ignore[arg-type]
                    best[i] = min(best[i], us) if us == us else best[i]
                    if fl == fl:
                        floor = fl
            extra = f"  ({floors(shape, seq, args.fmt)})" if args.floors and not args.apart else ""
            print(
                f"{shape_s:>9} {seq:>7} {floor:7.2f} "
                + " ".join(f"{b:7.2f}" if b < float("inf") else f"{'failed':>7}" for b in best)
                + extra,
                flush=True,
            )
    set_variant("base")


if __name__ == "__main__":
    main()
