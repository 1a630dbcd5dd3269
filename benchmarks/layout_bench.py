"""Head-major (kv_layout="HND") against token-major decodes: the benchmark's shapes, graph-
replayed over rotated KV sets past L2, the two alternating in one process (two rounds, the
faster of each kept), and the ratio. HND reads the same bytes as rows of one KV head's
tokens, so what it can cost is the access pattern alone.

    PYTHONPATH=. python3 benchmarks/layout_bench.py [bf16|f16|f32] [SEQ,SEQ,...] [H/KV/D,...]

With shapes named (e.g. 32/8/72,32/8/80), PyTorch's SDPA (head-major, as it reads its
cache) on the same shapes too, in the same run.
"""

from __future__ import annotations

import sys

import ferrox_driver as fd
from ferrox_driver.apps.bench.decode import SHAPES, measure_features_point, measure_point
from ferrox_driver.apps.bench.torch_baseline import import_torch, with_torch


def main(argv: list[str]) -> int:
    dtype = argv[1] if len(argv) > 1 else "bf16"
    seqs = [int(x) for x in argv[2].split(",")] if len(argv) > 2 else [4096, 32768, 131072]
    shapes = SHAPES
    torch = len(argv) > 3
    if torch:
        shapes = [tuple(int(x) for x in s.split("/")) for s in argv[3].split(",")]
        import_torch()
    device = fd.Device(0)
    print(f"{dtype}, us per decode (graph replay): token-major (NHD) vs head-major (HND)")
    print(f"{'shape':<10} {'seq':>7} {'NHD us':>8} {'HND us':>8} {'HND/NHD':>8}"
          + (f" {'torch us':>9}" if torch else ""))  # fmt: skip
    for shape in shapes:
        for seq in seqs:
            nhd, hnd = [], []
            for _ in range(2):
                nhd.append(measure_point(shape, seq, dtype, 30, device).graph_us)
                hnd.append(measure_features_point(shape, seq, dtype, {"kv_layout": "HND"},
                                                  30, device))  # fmt: skip
            a, b = min(nhd), min(hnd)
            line = f"{'/'.join(map(str, shape)):<10} {seq:>7} {a:8.1f} {b:8.1f} {b / a:8.3f}"
            if torch:
                point = with_torch(measure_point(shape, seq, dtype, 30, device), shape, 30)
                line += f" {point.torch_us:9.1f}"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
