"""The decode benchmark's report: console table, Markdown table, JSON and plot."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .bench_decode import DecodePoint

__all__ = ["markdown_table", "plot", "print_table", "write_results"]


def print_table(points: Sequence[DecodePoint], ceiling: float) -> None:
    """Every point on the console, times per decode and % of the ``ceiling`` (TB/s)."""
    print(
        "us per decode: 'graph' = back to back in one graph over rotated KV sets, "
        "'single' = one graph replay timed alone"
    )
    header = (
        f"{'shape':<10} {'dtype':<5} {'seq_len':>7} {'graph us':>9} {'TB/s':>6} {'%ceil':>6} "
        f"{'single':>7} {'eager':>7} {'torch us':>9} {'torch %':>7} {'t.single':>8} "
        f"{'speed-up':>8}"
    )
    print(header)
    for p in points:
        tbs = p.tbs(p.graph_us) or 0.0
        t_tbs = p.tbs(p.torch_us)
        torch_us = f"{p.torch_us:9.1f}" if p.torch_us else f"{'-':>9}"
        torch_pct = f"{100 * t_tbs / ceiling:7.1f}" if t_tbs else f"{'-':>7}"
        t_single = f"{p.torch_single_us:8.1f}" if p.torch_single_us else f"{'-':>8}"
        speedup = f"{p.torch_us / p.graph_us:7.2f}x" if p.torch_us else f"{'-':>8}"
        print(
            f"{p.shape:<10} {p.dtype:<5} {p.seq_len:>7} {p.graph_us:9.1f} {tbs:6.2f} "
            f"{100 * tbs / ceiling:6.1f} {p.single_us:7.1f} {p.eager_us:7.1f} {torch_us} "
            f"{torch_pct} {t_single} {speedup}"
        )


def write_results(result: dict[str, Any], out_dir: Path) -> None:
    """bench_decode.json, bench_decode.md (the table) and bench_decode.png into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_decode.json").write_text(json.dumps(result, indent=1))
    (out_dir / "bench_decode.md").write_text(markdown_table(result))
    plot(result, out_dir / "bench_decode.png")


def markdown_table(result: dict[str, Any]) -> str:
    """The benchmark as a Markdown table (graph-replayed times)."""
    ceiling = result["read_ceiling_tbs"]
    rows = [
        f"Measured on {result['device']}; read ceiling measured in the same run: "
        f"{ceiling:.2f} TB/s. Times are medians of CUDA-event-timed graph replays, in us per "
        "decode: 'ferrox us' and 'PyTorch us' replay decodes back to back in one graph over "
        "rotated KV sets (as a model's layers run); 'single' replays one decode per graph, "
        "each timed alone between two events (launch and event round trip included).",
        "",
        "| shape | dtype | seq_len | ferrox us | TB/s | % ceiling | single us | eager us "
        "| PyTorch us | PyTorch % | PyTorch single us | speed-up |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in result["points"]:
        tbs = p["kv_bytes"] / p["graph_us"] / 1e6
        if p["torch_us"]:
            t_pct = f"{100 * p['kv_bytes'] / p['torch_us'] / 1e6 / ceiling:.1f}"
            torch_us, speedup = f"{p['torch_us']:.1f}", f"{p['torch_us'] / p['graph_us']:.2f}x"
            t_single = f"{p['torch_single_us']:.1f}"
        else:
            t_pct = torch_us = speedup = t_single = "-"
        rows.append(
            f"| {p['shape']} | {p['dtype']} | {p['seq_len']} | {p['graph_us']:.1f} | {tbs:.2f} "
            f"| {100 * tbs / ceiling:.1f} | {p['single_us']:.1f} | {p['eager_us']:.1f} "
            f"| {torch_us} | {t_pct} | {t_single} | {speedup} |"
        )
    return "\n".join(rows) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """% of the read ceiling against seq_len, ours and PyTorch's, one panel per shape."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    ceiling = result["read_ceiling_tbs"]
    pts = result["points"]
    shapes = list(dict.fromkeys(p["shape"] for p in pts))
    cols = 3
    rows = math.ceil(len(shapes) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    colors = {"f32": "tab:blue", "f16": "tab:green", "bf16": "tab:red"}
    for ax, shape in zip(axes.flat, shapes, strict=False):
        for dtype, color in colors.items():
            sel = sorted(
                (p for p in pts if p["shape"] == shape and p["dtype"] == dtype),
                key=lambda p: p["seq_len"],
            )
            if not sel:
                continue
            xs = [p["seq_len"] for p in sel]
            ours = [100 * p["kv_bytes"] / p["graph_us"] / 1e6 / ceiling for p in sel]
            ax.plot(xs, ours, "-o", color=color, label=f"ferrox {dtype}")
            if all(p["torch_us"] for p in sel):
                theirs = [100 * p["kv_bytes"] / p["torch_us"] / 1e6 / ceiling for p in sel]
                ax.plot(xs, theirs, "--x", color=color, alpha=0.6, label=f"torch {dtype}")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 105)
        ax.set_title(f"{shape} (q heads/kv heads/head_dim)")
        ax.set_xlabel("seq_len")
        ax.set_ylabel("% of read ceiling")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(shapes) :]:
        ax.axis("off")
    fig.suptitle(f"GQA decode on {result['device']}: graph-replayed, % of {ceiling:.2f} TB/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")
