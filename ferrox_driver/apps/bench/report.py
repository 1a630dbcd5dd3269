"""The decode benchmark's report: its points, and them as a console table, a Markdown table,
JSON and a plot."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DecodePoint", "markdown_table", "plot", "print_table", "write_results"]


@dataclass
class DecodePoint:
    """One benchmark point. ``graph_us``/``torch_us``: per decode, in one graph replaying
    decodes back to back over rotated KV sets (a model's layers); ``*_single_us``: one
    decode per graph replay, each timed alone (adds the launch and event round trip)."""

    shape: str
    dtype: str
    seq_len: int
    kv_bytes: int
    graph_us: float
    single_us: float
    eager_us: float
    torch_us: float | None
    torch_single_us: float | None

    def tbs(self, us: float | None) -> float | None:
        return None if not us else self.kv_bytes / (us * 1e-6) / 1e12


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
    """Per shape, two panels against seq_len: latency (us, log scale) and % of the read
    ceiling. ferrox solid with filled markers, PyTorch dashed with hollow ones; one color
    and marker per dtype; one legend for the figure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return
    ceiling = result["read_ceiling_tbs"]
    pts = result["points"]
    shapes = list(dict.fromkeys(p["shape"] for p in pts))
    styles = {"f32": ("tab:blue", "o"), "f16": ("tab:green", "s"), "bf16": ("tab:red", "D")}
    # fp16 and bf16 take the same time: nudge each dtype's points sideways so none hides
    dodge = {"f32": 1.0, "f16": 0.88, "bf16": 1.14}
    cols = 3
    groups = math.ceil(len(shapes) / cols)
    fig, axes = plt.subplots(
        2 * groups, cols, figsize=(4.6 * cols, 3.0 * 2 * groups), squeeze=False, sharex=True
    )
    for i, shape in enumerate(shapes):
        top, bottom = axes[2 * (i // cols), i % cols], axes[2 * (i // cols) + 1, i % cols]
        for dtype, (color, marker) in styles.items():
            sel = sorted(
                (p for p in pts if p["shape"] == shape and p["dtype"] == dtype),
                key=lambda p: p["seq_len"],
            )
            if not sel:
                continue
            xs = [p["seq_len"] * dodge[dtype] for p in sel]
            for key, line, face in (("graph_us", "-", color), ("torch_us", "--", "none")):
                if not all(p[key] for p in sel):
                    continue
                us = [p[key] for p in sel]
                pct = [100 * p["kv_bytes"] / p[key] / 1e6 / ceiling for p in sel]
                kw = {"color": color, "marker": marker, "markerfacecolor": face, "ms": 5}
                top.plot(xs, us, line, **kw)
                bottom.plot(xs, pct, line, **kw)
        top.set_title(f"{shape} (q heads/kv heads/head_dim)", fontsize=10)
        top.set_yscale("log")
        top.set_ylabel("us per decode")
        bottom.set_ylim(0, 105)
        bottom.set_ylabel("% of read ceiling")
        bottom.set_xlabel("seq_len")
        seqs = sorted({p["seq_len"] for p in pts if p["shape"] == shape})
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqs, [str(x) for x in seqs])
            ax.minorticks_off()
            ax.grid(alpha=0.3)
    for j in range(len(shapes), groups * cols):
        axes[2 * (j // cols), j % cols].axis("off")
        axes[2 * (j // cols) + 1, j % cols].axis("off")
    handles = [
        Line2D(
            [],
            [],
            color=c,
            marker=m,
            ls=ls,
            markerfacecolor=c if ls == "-" else "none",
            label=f"{who} {dtype}",
        )
        for who, ls in (("ferrox", "-"), ("PyTorch", "--"))
        for dtype, (c, m) in styles.items()
    ]
    fig.legend(handles=handles, loc="lower center", ncol=6, frameon=False)
    fig.suptitle(
        f"GQA decode on {result['device']}: graph-replayed, back to back; "
        f"read ceiling {ceiling:.2f} TB/s"
    )
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}")
