"""The latent kernels (split_latent.cuh, split_latent_wg.cuh) of the working tree against
the split-kernel file before a change, in one process: MLA decodes over latents rotated
past L2 (mla_speed's harness) or head_dim 512 GQA decodes (wide_speed's), graph-replayed,
each variant timed in turn (new, old, +files, new again: both of the new's times are
printed, so the run's drift shows). Each variant's kernels are compiled from its whole
source as the library compiles them (the catalogue's kernel file swapped, its kernels
cleared), so the plans stay the library's: a variant must keep their launches (shared
memory, grid, arguments).

    python3 benchmarks/latent_compare.py OLD [+try.cu ...] [--what mla|wide]
        [--seqs 32768 131072] [--heads 16 64 128] [--n-q 1 2] [--formats bf16 e4m3]
        [--sync]

OLD: the kernel file before the change, as a git revision (e.g. HEAD~3; its parts in
place) or a file holding the whole source; +FILE: a further whole source, labelled by its
name. --sync: MLA on the mma.sync latent kernel only (``Overrides.latent_wgmma`` off).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
from _common import source_at

from ferrox_driver.apps.bench import mla_speed, wide_speed
from ferrox_driver.apps.bench.harness import bench_stream, rotated_graph_us
from ferrox_driver.decode import plan as planner
from ferrox_driver.decode.latent import mla_decode
from ferrox_driver.driver.device import default_device
from ferrox_driver.driver.memory import empty
from ferrox_driver.kernels import catalogue

SPLIT_FILE = "gqa_decode_split.cu"
ITERS = 20


def _whole(arg: str) -> str:
    path = Path(arg)
    return path.read_text() if path.is_file() else source_at(arg, SPLIT_FILE)


def use(source: str | None) -> None:
    """Compile the split kernels from ``source`` from now on (None: the working tree's)."""
    catalogue._kernels.clear()

    def swapped(filename: str) -> str:
        return source if filename == SPLIT_FILE and source is not None else _TREE(filename)

    catalogue.kernel_source = swapped  # type: ignore[assignment]


_TREE = catalogue.kernel_source


def timed(variants: dict[str, str | None], run: Callable[[], float]) -> dict[str, float]:
    """Each variant's us by ``run``, the new first and last."""
    out: dict[str, float] = {}
    for name in [*variants, "new'"]:
        use(variants.get(name.rstrip("'")))
        out[name] = run()
    use(None)
    return out


def mla(variants: dict[str, str | None], args: argparse.Namespace) -> None:
    dev = default_device()
    stream = bench_stream(dev)
    rng = np.random.default_rng(0)
    names = [*variants, "new'"]
    print(f"{'fmt':>5} {'seq':>7} {'heads':>5} {'n_q':>3} "
          + " ".join(f"{n:>9}" for n in names) + f" {'floor':>7}")  # fmt: skip
    before = planner.OVERRIDES
    planner.OVERRIDES = dataclasses.replace(before, latent_wgmma=not args.sync)
    try:
        for fmt in args.formats:
            fp8 = fmt != "bf16"
            for seq in args.seqs:
                rot = mla_speed._sets(seq, fmt, stream, dev)
                floor = mla_speed._floor_us(rot, seq, 1 if fp8 else 2, stream, dev)
                for heads in args.heads:
                    for n_q in args.n_q:
                        q = rng.standard_normal((n_q, heads, 576)).astype(ml_dtypes.bfloat16)
                        q_d = empty(q.shape, q.dtype, device=dev)
                        q_d.copy_from_host(q, stream)
                        out = empty((n_q, heads, 512), q.dtype, device=dev)
                        kw = {"kv_scale": 0.05} if fp8 else {}

                        def decode(i: int, q_d=q_d, out=out, kw=kw, sets=rot.sets) -> None:  # type: ignore[no-untyped-def]
                            mla_decode(q_d, sets[i % len(sets)][0], out=out, stream=stream, **kw)

                        run = functools.partial(rotated_graph_us, decode, rot, stream, ITERS)
                        us = timed(variants, run)
                        print(f"{fmt:>5} {seq:>7} {heads:>5} {n_q:>3} "
                              + " ".join(f"{us[n]:>9.2f}" for n in names)
                              + f" {floor:>7.2f}", flush=True)  # fmt: skip
                        q_d.close()
                        out.close()
                rot.close()
    finally:
        planner.OVERRIDES = before


def wide(variants: dict[str, str | None], args: argparse.Namespace) -> None:
    names = [*variants, "new'"]
    print(f"{'shape':>10} {'seq':>7} " + " ".join(f"{n:>9}" for n in names))
    for heads in args.heads:
        shape = (heads, 4, 512)
        for seq in args.seqs:
            run = functools.partial(wide_speed._decode_us, shape, seq, 1, ml_dtypes.bfloat16, "tc")
            us = timed(variants, run)
            print(f"{f'{heads}/4/512':>10} {seq:>7} "
                  + " ".join(f"{us[n]:>9.2f}" for n in names), flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("--what", choices=("mla", "wide"), default="mla")
    parser.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--heads", type=int, nargs="+", help="MLA: 16 64 128; wide: 4 8 16 32")
    parser.add_argument("--n-q", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--formats", nargs="+", default=["bf16", "e4m3"])
    parser.add_argument("--sync", action="store_true")
    args, extra = parser.parse_known_args()
    args.heads = args.heads or ([16, 64, 128] if args.what == "mla" else [4, 8, 16, 32])
    variants: dict[str, str | None] = {"new": None, "old": _whole(args.old)}
    for arg in extra:
        if not arg.startswith("+"):
            parser.error(f"unknown argument {arg!r}")
        variants[Path(arg[1:]).name] = Path(arg[1:]).read_text()
    print(f"# {default_device().name}: us per decode, graph-replayed; new = the working tree, "
          f"old = {args.old}")  # fmt: skip
    (mla if args.what == "mla" else wide)(variants, args)


if __name__ == "__main__":
    main()
