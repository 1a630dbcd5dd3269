"""The performance page's headline: its bf16 table and its plot against PyTorch, from the
benchmark's JSON (`python -m ferrox_driver bench` writes docs/assets/bench_decode.json).

    python benchmarks/plot_decode.py          # writes docs/assets/decode_vs_pytorch.svg
    python benchmarks/plot_decode.py --check  # exit 1 where that SVG is not what the JSON gives

It prints the page's table too.

The SVG is written by hand (no matplotlib): two panels, us per decode for 32/8/128 against
tokens (ferrox, PyTorch's SDPA and the time the read ceiling allows) and the speed-up over
SDPA for every shape. FlashInfer was measured side by side in another harness; where its
per-point bf16 XQA times are in docs/assets/flashinfer_h200.json (`{"version", "date",
"source", "bf16_us": {shape: {tokens: us}}}`) they are drawn too, labelled with their
version, date and source; otherwise the plot carries the run's summary line (FLASHINFER).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "docs" / "assets"
HEADLINE = "32/8/128"
# The side-by-side run of FlashInfer (its Hopper default, XQA) against ferrox and SDPA, bf16,
# 6 shapes at 512-131072 tokens on one H200: only its ratios are published in this repository.
FLASHINFER = (
    "FlashInfer 0.7.2.post1 (XQA, its Hopper default), measured side by side on an H200 on "
    "2026-12-03: ferrox 1.03-3.72x faster at all 30 bf16 points"
)
FERROX, TORCH, FI, CEIL = "#1f5fa8", "#c0392b", "#2e8b57", "#888888"
SHAPE_COLOURS = ["#1f5fa8", "#c0392b", "#2e8b57", "#8e44ad", "#d68910", "#17a2b8"]


def headline_rows(data: dict) -> list[dict]:
    """The bf16 HEADLINE points, by tokens: ferrox and SDPA us, speed-up, % of the ceiling."""
    rows = []
    for p in data["points"]:
        if p["shape"] == HEADLINE and p["dtype"] == "bf16":
            tbs = p["kv_bytes"] / (p["graph_us"] * 1e-6) / 1e12
            rows.append(
                dict(
                    tokens=p["seq_len"],
                    ferrox=p["graph_us"],
                    torch=p["torch_us"],
                    speedup=p["torch_us"] / p["graph_us"],
                    ceiling=100 * tbs / data["read_ceiling_tbs"],
                    floor=p["kv_bytes"] / (data["read_ceiling_tbs"] * 1e12) * 1e6,
                )
            )
    return sorted(rows, key=lambda r: r["tokens"])


def table(data: dict) -> str:
    lines = [
        "| tokens | ferrox us | PyTorch SDPA us | speed-up | % of read ceiling |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in headline_rows(data):
        lines.append(
            f"| {r['tokens']} | {r['ferrox']:.1f} | {r['torch']:.1f} | {r['speedup']:.2f}x "
            f"| {r['ceiling']:.0f}% |"
        )
    return "\n".join(lines)


class Panel:
    """A log-log (or log-linear) plot area: data coordinates to SVG pixels."""

    def __init__(self, name: str, x0: float, y0: float, w: float, h: float, xs: tuple, ys: tuple,
                 logy: bool = True):  # fmt: skip
        self.name, self.x0, self.y0, self.w, self.h = name, x0, y0, w, h
        self.xs, self.ys, self.logy = xs, ys, logy

    def clip(self) -> str:
        """The clip path that keeps lines inside the plot area."""
        box = attrs(dict(x=self.x0, y=self.y0, width=self.w, height=self.h))
        return f'<clipPath id="{self.name}"><rect{box}/></clipPath>'

    def px(self, x: float) -> float:
        lo, hi = (math.log(v) for v in self.xs)
        return self.x0 + (math.log(x) - lo) / (hi - lo) * self.w

    def py(self, y: float) -> float:
        f = math.log if self.logy else (lambda v: v)
        lo, hi = (f(v) for v in self.ys)
        return self.y0 + self.h - (f(y) - lo) / (hi - lo) * self.h


def attrs(kw: dict) -> str:
    """SVG attributes from keywords (stroke_width -> stroke-width); numbers to 0.1 px."""
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)  # noqa: E731
    return "".join(f' {k.replace("_", "-")}="{fmt(v)}"' for k, v in kw.items())


def text(x: float, y: float, s: str, size: int = 12, anchor: str = "middle", **kw: str) -> str:
    s = s.replace("&", "&amp;").replace("<", "&lt;")
    return f"<text{attrs(dict(x=x, y=y, font_size=size, text_anchor=anchor, **kw))}>{s}</text>"


def segment(x1: float, y1: float, x2: float, y2: float, stroke: str, **kw: str) -> str:
    return f"<line{attrs(dict(x1=x1, y1=y1, x2=x2, y2=y2, stroke=stroke, **kw))}/>"


def line(panel: Panel, pts: list[tuple[float, float]], colour: str, dash: str = "") -> list[str]:
    """A polyline with a dot at each point, cut off at the panel's edges."""
    d = " ".join(f"{panel.px(x):.1f},{panel.py(y):.1f}" for x, y in pts)
    dashed = f' stroke-dasharray="{dash}"' if dash else ""
    out = [f'<g clip-path="url(#{panel.name})">']
    out.append(f'<polyline points="{d}" fill="none" stroke="{colour}" stroke-width="2"{dashed}/>')
    out += [
        f'<circle cx="{panel.px(x):.1f}" cy="{panel.py(y):.1f}" r="3" fill="{colour}"/>'
        for x, y in pts
    ]
    return [*out, "</g>"]


def axes(panel: Panel, xticks: list, yticks: list, ylabel: str, title: str) -> list[str]:
    out = [
        f'<rect x="{panel.x0}" y="{panel.y0}" width="{panel.w}" height="{panel.h}" '
        'fill="none" stroke="#444"/>',
        text(panel.x0 + panel.w / 2, panel.y0 - 10, title, 13, font_weight="bold"),
        text(panel.x0 + panel.w / 2, panel.y0 + panel.h + 34, "tokens in the cache", 12),
    ]
    for x in xticks:
        px = panel.px(x)
        label = f"{x // 1024}k" if x >= 1024 else str(x)
        out.append(segment(px, panel.y0, px, panel.y0 + panel.h, "#e4e4e4"))
        out.append(text(px, panel.y0 + panel.h + 16, label, 11))
    for y in yticks:
        py = panel.py(y)
        out.append(segment(panel.x0, py, panel.x0 + panel.w, py, "#e4e4e4"))
        out.append(text(panel.x0 - 6, py + 4, f"{y:g}", 11, anchor="end"))
    cy = panel.y0 + panel.h / 2
    out.append(text(panel.x0 - 40, cy, ylabel, 12, transform=f"rotate(-90 {panel.x0 - 40} {cy})"))
    return out


def legend(x: float, y: float, items: list[tuple[str, str, str]], rows: int = 9) -> list[str]:
    """Line samples and labels, ``rows`` to a column (columns 110 px apart)."""
    out = []
    for i, (label, colour, dash) in enumerate(items):
        xx, yy = x + 110 * (i // rows), y + 16 * (i % rows)
        dashed = {"stroke_dasharray": dash} if dash else {}
        out.append(segment(xx, yy, xx + 22, yy, colour, stroke_width="2", **dashed))
        out.append(text(xx + 28, yy + 4, label, 11, anchor="start"))
    return out


def svg(data: dict, flashinfer: dict | None) -> str:
    rows = headline_rows(data)
    tokens = [r["tokens"] for r in rows]
    xs = (tokens[0] / 1.4, tokens[-1] * 1.4)
    left = Panel("left", 70, 50, 330, 250, xs, (2, 300))
    right = Panel("right", 500, 50, 330, 250, xs, (0.8, 3.6), logy=False)
    parts = [
        '<svg xmlns="http://www.w3.org/2000/svg" width="880" height="400" '
        'viewBox="0 0 880 400" font-family="DejaVu Sans, Arial, sans-serif">',
        '<rect width="880" height="400" fill="white"/>',
        f"<defs>{left.clip()}{right.clip()}</defs>",
    ]
    parts += axes(left, tokens, [2, 5, 10, 20, 50, 100, 200], "us per decode (log)",
                  f"{HEADLINE} bf16: time per decode")  # fmt: skip
    parts += line(left, [(r["tokens"], r["floor"]) for r in rows], CEIL, "4 3")
    parts += line(left, [(r["tokens"], r["torch"]) for r in rows], TORCH)
    parts += line(left, [(r["tokens"], r["ferrox"]) for r in rows], FERROX)
    items = [
        ("ferrox", FERROX, ""),
        ("PyTorch SDPA", TORCH, ""),
        ("at the read ceiling", CEIL, "4 3"),
    ]
    if flashinfer is not None:
        fi = flashinfer["bf16_us"].get(HEADLINE, {})
        pts = sorted((int(t), us) for t, us in fi.items())
        parts += line(left, pts, FI, "6 2")
        items.append((f"FlashInfer {flashinfer['version']} XQA ({flashinfer['date']})", FI, "6 2"))
    parts += legend(left.x0 + 12, left.y0 + 16, items)

    parts += axes(right, tokens, [1, 1.5, 2, 2.5, 3, 3.5], "SDPA time / ferrox time",
                  "bf16: speed-up over PyTorch SDPA")  # fmt: skip
    one = right.py(1)
    parts.append(segment(right.x0, one, right.x0 + right.w, one, "#444", stroke_dasharray="2 2"))
    shapes = sorted({p["shape"] for p in data["points"]}, key=lambda s: (s != HEADLINE, s))
    keyed = list(zip(SHAPE_COLOURS, shapes, strict=True))
    for colour, shape in keyed:
        pts = sorted(
            (p["seq_len"], p["torch_us"] / p["graph_us"])
            for p in data["points"]
            if p["shape"] == shape and p["dtype"] == "bf16"
        )
        parts += line(right, pts, colour)
    parts += legend(right.x0 + 100, right.y0 + 16, [(s, c, "") for c, s in keyed], rows=3)

    source = (
        f"{data['device']}, read ceiling {data['read_ceiling_tbs']:.2f} TB/s measured in the run; "
        "us: medians of CUDA-event-timed graph replays (docs/assets/bench_decode.json)"
    )
    note = f"FlashInfer: {flashinfer['source']}" if flashinfer is not None else FLASHINFER
    parts += [text(440, 366, source, 11, fill="#333"), text(440, 384, note, 11, fill="#333")]
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare, do not write")
    args = ap.parse_args()
    data = json.loads((ASSETS / "bench_decode.json").read_text())
    fi_path = ASSETS / "flashinfer_h200.json"
    flashinfer = json.loads(fi_path.read_text()) if fi_path.is_file() else None
    out = ASSETS / "decode_vs_pytorch.svg"
    drawn = svg(data, flashinfer)
    if args.check:
        same = out.is_file() and out.read_text() == drawn
        print(f"{out.name}: {'up to date' if same else 'STALE: run benchmarks/plot_decode.py'}")
        return 0 if same else 1
    out.write_text(drawn)
    print(f"wrote {out}\n\n{table(data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
