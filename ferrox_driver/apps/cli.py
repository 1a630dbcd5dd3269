"""Command line: ``python -m ferrox_driver info | demo | bench | cache``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["main"]

DEFAULT_ARCH = "sm_90"


def _print(line: str = "") -> None:
    print(line, flush=True)


def cmd_info(args: argparse.Namespace) -> int:
    """Versions, devices, cache directory. Exits 0 with or without a GPU."""
    import numpy as np

    import ferrox_driver as fd

    from .. import archs
    from ..driver import calls, module_cache
    from ..driver.compiler import nvrtc_version_string

    _print(f"ferrox_driver  {fd.__version__}")
    _print(f"cuda-bindings  {calls.bindings_version()}")
    try:
        _print(f"NVRTC          {nvrtc_version_string()}")
    except fd.FerroxError as exc:
        _print(f"NVRTC          unavailable: {exc}")
    _print(f"numpy          {np.__version__}")
    ver = calls.driver_version()
    if ver is None:
        _print(
            "driver         none: no CUDA driver/device found (CPU-only use: compile, reference)"
        )
    else:
        _print(f"driver         CUDA {ver // 1000}.{(ver % 1000) // 10}")
    if fd.cuda_available():
        for i in range(fd.device_count()):
            try:
                dev = fd.Device(i)
            except fd.UnsupportedDeviceError as exc:
                _print(f"device {i}       unsupported: {exc}")
                continue
            free, total = dev.mem_info()
            _print(
                f"device {i}       {dev.name}, {dev.arch}, {dev.multiprocessor_count} SMs, "
                f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free)"
            )
            dev.close()
    else:
        _print("devices        none: no CUDA driver/device found")
    low = ".".join(map(str, archs.MIN_COMPUTE_CAPABILITY))
    _print(f"GPUs           compute capability {low} or newer (plans checked for "
           f"{', '.join(archs.supported_archs())})")  # fmt: skip
    _print(f"kernel cache   {_cache_line(module_cache.disk_cache_state())}")
    return 0


def _cache_line(state: Any) -> str:
    """The disk cache's state (module_cache.disk_cache_state) in one line."""
    if state["path"] is None:
        return f"not used: {state['why']}"
    if not state["exists"]:
        return f"{state['path']} (not created yet; made private to this user on first use)"
    kept = f"{state['path']}: {state['n_files']} file(s), {state['bytes'] / 2**20:.1f} MiB"
    if not state["trusted"]:
        return f"{kept}; NOT used: {state['why']} (clear it: cache --clear)"
    return kept


def cmd_cache(args: argparse.Namespace) -> int:
    """The disk cache of compiled kernels: where, how much, whether it is used; --clear
    empties it."""
    from ..driver import module_cache

    state = module_cache.disk_cache_state()
    if not args.clear:
        _print(f"kernel cache   {_cache_line(state)}")
        return 0
    if state["path"] is None:
        _print(f"kernel cache   nothing to clear: {state['why']}")
        return 0
    removed = module_cache.clear_disk_cache()
    _print(f"kernel cache   removed {removed} file(s) from {state['path']}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The decode loop on the GPU; without one, the reference decode, the plan a GPU of
    ``--arch`` would run and its kernels compiled for it."""
    import ferrox_driver as fd

    from .demo import DemoConfig, run_cpu_demo, run_demo

    cfg = DemoConfig(
        layers=args.layers,
        tokens=args.tokens,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        model_context=0 if args.no_model else args.model_context,
        model_shape=args.model_shape,
    )
    if not fd.cuda_available():
        _print(f"no CUDA driver/device found: what ferrox_driver does without one, for a GPU of "
               f"{args.arch} (--arch)\n")  # fmt: skip
        return run_cpu_demo(cfg, args.arch)
    return run_demo(cfg)


def cmd_bench_kv4(args: argparse.Namespace) -> int:
    """``bench --only kv4``: on a GPU, the 4-bit caches' speed table and the toy model's
    logits with each format (first: they take seconds); then the KV cache formats'
    accuracy table, on the CPU (minutes)."""
    from pathlib import Path

    import ferrox_driver as fd

    from .bench.kv4 import KV4_CASES, accuracy_table, print_accuracy

    toy: dict[str, float] = {}
    if not fd.cuda_available():
        _print("speed and the toy model's logits: no GPU here (they run where there is one)")
    else:
        from .bench.kv4_speed import speed_table

        _print("speed, one query token, graph-replayed, KV rotated past L2 (TB/s: values "
               "and scales read per us):")  # fmt: skip
        shapes = ["32/8/128"] if args.quick else ["32/8/128", "28/4/128", "8/1/256"]
        seqs = [32768, 131072] if args.quick else [4096, 32768, 131072]
        if args.shapes:  # (parsed as (q_heads, kv_heads, head_dim))
            shapes = ["/".join(str(x) for x in shape) for shape in args.shapes]
        speed_table(shapes, args.seqs or seqs)
        toy = _toy_logits_errors(quick=args.quick)
    cases = KV4_CASES[:3] if args.quick else KV4_CASES
    _print(
        "\nrelative error of the attention output against the float64 reference on the "
        "unquantized cache, medians of 3 draws (32/8/128 at 4096 tokens; the long row "
        "8/2/128 at 131072):"
    )
    table = accuracy_table(cases=cases)
    print_accuracy(table)
    if args.out:
        import json

        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_kv4.json").write_text(
            json.dumps({"accuracy": table, "toy_logits": toy}, indent=1)
        )
    return 0


def _toy_logits_errors(quick: bool) -> dict[str, float]:
    """The toy Llama-shaped model's logits after 512 tokens with each cache format,
    against its bf16 KVCache (printed; {} without PyTorch)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        _print("the toy model's logits: needs PyTorch")
        return {}
    import ml_dtypes

    from .toy_llama import SMALL, ToyLlama, cache_logits_errors

    model = ToyLlama(4 if quick else 8, **SMALL)
    dtypes = {"e4m3": ml_dtypes.float8_e4m3fn, "int4": "int4", "nvfp4": "nvfp4"}
    errors = cache_logits_errors(model, 512, dtypes)
    _print("\nthe toy Llama-shaped model's logits after 512 tokens, relative error against "
           "its bf16 cache: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))  # fmt: skip
    return errors


def cmd_bench(args: argparse.Namespace) -> int:
    """Benchmarks (GPU only, but for ``--only kv4``'s accuracy table)."""
    import ferrox_driver as fd

    if args.only == "kv4":
        return cmd_bench_kv4(args)
    if not fd.cuda_available():
        print(f"{args.prog} bench: no CUDA driver/device found; the benchmarks need a GPU",
              file=sys.stderr)  # fmt: skip
        return 1
    from pathlib import Path

    if args.only == "torch":  # each table in its own process (bench/torch_bench.py)
        from .bench.torch_bench import TABLES, run_torch_bench

        result = run_torch_bench(
            args.tables or TABLES, Path(args.out) if args.out else None, quick=args.quick
        )
        return 1 if any("error" in t for t in result["tables"].values()) else 0

    from .bench.decode import (
        SEQ_LENS,
        SHAPES,
        import_torch,
        measure_fixed_costs,
        measure_step_latency,
        run_decode_bench,
        run_features_bench,
        run_fp8_bench,
        run_headdim_bench,
    )
    from .bench.quick import time_appends, time_decode

    if args.only == "verify":
        from .bench.verify import run_verify_bench

        import_torch()
        quick = dict(shapes=[(32, 8, 128)], seqs=[4096], n_qs=(1, 2, 8), toy=False)
        run_verify_bench(
            Path(args.out) if args.out else None,
            **(quick if args.quick else {"shapes": args.shapes, "seqs": args.seqs}),
        )
        return 0
    if args.only == "scale":
        from .bench.scale import SCALE_SEQS, run_scale_bench, scale_table

        gpus = [n for n in (1, 2, 4, 8) if n <= fd.device_count()]
        rows = run_scale_bench(gpus, args.seqs or SCALE_SEQS)
        _print("one 32/8/128 bf16 sequence sharded over N GPUs, per token and layer:")
        _print(scale_table(rows))
        if args.out:
            import json

            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "scale_bench.json").write_text(json.dumps(rows, indent=1))
        return 0
    if args.only in ("decode", "step", "host", "all", "headdim", "fp8"):
        import_torch()
    if args.only == "fp8":
        run_fp8_bench(Path(args.out) if args.out else None)
    if args.only == "features":
        run_features_bench(Path(args.out) if args.out else None)
    if args.only == "headdim":
        run_headdim_bench(
            Path(args.out) if args.out else None,
            seq_lens=args.seqs or SEQ_LENS,
            dtypes=args.dtypes or ["bf16", "f16"],
        )
    if args.only in ("host", "all"):
        from .bench.host import run_host_bench

        run_host_bench(out=Path(args.out) if args.out else None)
    if args.only == "overhead":
        _print(f"  {'us per item':<40} {'back to back':>12} {'single':>8}")
        for name, (chained_us, single_us) in measure_fixed_costs().items():
            _print(f"  {name:<40} {chained_us:12.2f} {single_us:8.2f}")
    if args.only in ("step", "all"):
        _print("per-token step at seq_len 4096, 32/8/128 (append + decode, host to host):")
        for dtype in ("bf16", "f32"):
            for path, us in measure_step_latency(dtype=dtype).items():
                _print(f"  {dtype:<5} {path:<28} {us:8.1f} us")

    if args.only in ("append", "all"):
        _print(f"{'strategy':<30} {'capacity':>8} {'append us':>10} {'append+decode us':>17}")
        for cap in (4096, 32768):
            for r in time_appends(cap):
                _print(
                    f"{r.strategy:<30} {r.capacity:>8} {r.append_us:>10.1f} "
                    f"{r.append_decode_us:>17.1f}"
                )
    if args.only in ("parity", "all"):
        _print(f"{'kernel':<8} {'shape':<9} {'dtype':<5} {'seq_len':>7} {'us':>9} {'TB/s':>7}")
        for seq in (4096, 32768):
            t = time_decode(32, 8, 128, seq, algorithm="parity", iters=10)
            _print(f"parity   32/8/128  f32   {seq:>7} {t.median_us:9.1f} {t.tbs:7.4f}")
    if args.only in ("decode", "all"):
        shapes = args.shapes or SHAPES
        seqs = args.seqs or SEQ_LENS
        if args.quick:
            shapes, seqs = shapes[:1], seqs[:2]
        dtypes = args.dtypes or ["f32", "f16", "bf16"]
        result = run_decode_bench(Path(args.out) if args.out else None, shapes, seqs, dtypes)
        _print("gqa_decode_async captured once at seq_len 1 (capacity 32768, 32/8/128 bf16):")
        for seq, replay in result["growing_graph"].items():
            _print(
                f"  replayed at seq_len {int(seq):>6}: {replay['graph_us']:7.1f} us back to "
                f"back, {replay['single_us']:7.1f} us single"
            )
    return 0


def _shape(text: str) -> tuple[int, int, int]:
    """A ``q_heads/kv_heads/head_dim`` shape such as ``32/8/128``."""
    try:
        heads, kv_heads, head_dim = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected q_heads/kv_heads/head_dim such as 32/8/128, got {text!r}"
        ) from None
    if min(heads, kv_heads, head_dim) < 1 or heads % kv_heads or head_dim > 512:
        raise argparse.ArgumentTypeError(
            f"{text!r}: heads and kv_heads >= 1 with heads a multiple of kv_heads, head_dim 1..512"
        )
    return heads, kv_heads, head_dim


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _head_dim(text: str) -> int:
    value = _positive(text)
    if value > 512:
        raise argparse.ArgumentTypeError(f"expected 1..512, got {value}")
    return value


def _torch_tables(text: str) -> list[str]:
    """A comma-separated list of ``bench --only torch`` tables."""
    from .bench.torch_bench import TABLES

    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TABLES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {','.join(TABLES)}, got {text!r}"
        )
    return names


def _arch(text: str) -> str:
    from ..archs import ARCHS
    from ..driver.compiler import normalize_arch

    try:
        arch = normalize_arch(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("arch: ")) from None
    if arch not in ARCHS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a supported architecture (supported: {', '.join(ARCHS)})"
        )
    return arch


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``prog: error: ...``), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


DESCRIPTION = (
    "Single-sequence GQA attention decode on NVIDIA GPUs (compute capability 7.5 or newer), "
    "over the CUDA driver API. info: versions, devices and the kernel cache; demo: a "
    "multi-layer decode loop, eager and as CUDA graphs (without a GPU: the reference decode, "
    "the plan a GPU of --arch would run and its kernels compiled); bench: decode and "
    "host-time benchmarks against PyTorch (needs a GPU); cache: the disk cache of compiled "
    "kernels (--clear empties it)."
)


def build_parser(prog: str = "ferrox-driver") -> argparse.ArgumentParser:
    """The command line's parser (``prog``: how the program is invoked)."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    from .._version import __version__

    parser = _Parser(prog=prog, description=DESCRIPTION, formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,demo,bench,cache}")
    sub.add_parser("info", help="versions, devices and the kernel cache", formatter_class=fmt)
    demo = sub.add_parser(
        "demo", help="multi-layer decode loop: eager vs CUDA graph", formatter_class=fmt
    )
    demo.add_argument("--layers", type=_positive, default=32, help="attention layers")
    demo.add_argument("--tokens", type=_positive, default=256, help="tokens decoded per layer")
    demo.add_argument("--heads", type=_positive, default=32, help="query heads")
    demo.add_argument("--kv-heads", type=_positive, default=8, help="KV heads (divides --heads)")
    demo.add_argument("--head-dim", type=_head_dim, default=128, help="elements per head, 1..512")
    demo.add_argument(
        "--dtype", choices=("f32", "f16", "bf16"), default="bf16", help="cache and query dtype"
    )
    demo.add_argument(
        "--arch",
        type=_arch,
        default=DEFAULT_ARCH,
        help="without a GPU: the architecture to plan and compile for (sm_75, sm_80, sm_86, "
        "sm_89, sm_90, sm_100, sm_120)",
    )
    demo.add_argument(
        "--model-context",
        type=_positive,
        default=4096,
        help="tokens of context of the toy Llama-shaped model (where PyTorch sees the GPU)",
    )
    demo.add_argument(
        "--model-shape",
        choices=("llama-3-8b", "small"),
        default="llama-3-8b",
        help="the toy model's widths (--layers layers): Llama-3-8B's, or narrow",
    )
    demo.add_argument("--no-model", action="store_true", help="skip the toy model")
    bench = sub.add_parser("bench", help="decode and host-time benchmarks", formatter_class=fmt)
    bench.add_argument(
        "--only",
        choices=(
            "all",
            "append",
            "parity",
            "step",
            "decode",
            "overhead",
            "host",
            "headdim",
            "features",
            "fp8",
            "scale",
            "torch",
            "verify",
            "kv4",
        ),
        default="all",
        help="which benchmark to run (all: every one but headdim, the head_dim sweep, "
        "features, what each attention feature costs, fp8, an fp8 cache against bf16, and "
        "scale, one sequence sharded over the GPUs, which needs the [distributed] extra, and "
        "torch, ferrox in PyTorch and transformers against SDPA: an 8B-shaped generate "
        "compiled and eager, an fp8 cache, growing caches, the ops under torch.compile; each "
        "table in its own process; verify, a speculative verify of n_q tokens against one "
        "token and SDPA, and the toy model's verify step; kv4, the KV cache formats' "
        "accuracy, on the CPU)",
    )
    bench.add_argument(
        "--out",
        help="directory for bench_decode.json, bench_decode.png, host_bench.json and "
        "torch_bench.json",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="one shape, two lengths (torch: 4096 tokens, 8 steps, one warm-up call)",
    )
    bench.add_argument(
        "--tables",
        type=_torch_tables,
        help="with --only torch: a comma-separated subset of compiled,eager,fp8,growing,explain",
    )
    bench.add_argument(
        "--shapes", nargs="+", type=_shape, help="q_heads/kv_heads/head_dim shapes, e.g. 32/8/128"
    )
    bench.add_argument("--seqs", nargs="+", type=_positive, help="sequence lengths")
    bench.add_argument("--dtypes", nargs="+", choices=("f32", "f16", "bf16"), help="dtypes")
    cache = sub.add_parser("cache", help="the disk cache of compiled kernels", formatter_class=fmt)
    cache.add_argument("--clear", action="store_true", help="remove the cached kernels")
    parser.set_defaults(prog=prog, demo_parser=demo, bench_parser=bench)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "ferrox-driver") -> int:
    """Run the command line; returns the exit status (2 for a bad argument)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.command == "bench" and args.tables and args.only != "torch":
        args.bench_parser.error(
            f"argument --tables: applies to --only torch, not --only {args.only}"
        )
    if args.command == "demo" and args.heads % args.kv_heads:
        args.demo_parser.error(
            f"argument --heads: {args.heads} is not a multiple of --kv-heads {args.kv_heads}"
        )
    commands = {"info": cmd_info, "demo": cmd_demo, "bench": cmd_bench, "cache": cmd_cache}
    from ..errors import NoDeviceError

    try:
        status = commands[args.command](args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        # the reader left (``| head``): stop quietly, and point stdout at devnull so that
        # the flush at exit does not raise again (Python's documented recipe)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except NoDeviceError as exc:  # no driver, no such device, a GPU older than Turing
        print(f"{prog} {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
