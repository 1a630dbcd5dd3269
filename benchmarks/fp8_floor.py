"""What the fp8 targets ask of the hardware: for each fp8 benchmark shape, the read floor
of its fp8 bytes (benchmarks/read_floor.py's kernel, rows of head_dim bytes, the best of
several block counts; graph replay over rotated sets past L2) next to the fp8 decode, the
bf16 decode and PyTorch's bf16 SDPA, all in one process, and the times that 1.8x bf16 and
2x PyTorch would take. A target whose time is below the floor is below what the memory
allows.

    PYTHONPATH=. python3 benchmarks/fp8_floor.py [SEQ,SEQ,...]
"""

from __future__ import annotations

import sys

from read_floor import floor_us  # benchmarks/ is the script's path

import ferrox_driver as fd
from ferrox_driver.apps.bench.decode import FP8_SHAPES, measure_fp8_point, measure_point
from ferrox_driver.apps.bench.torch_baseline import with_torch

SPLITS = (16, 32, 64, 128)  # chunks per KV head


def main(argv: list[str]) -> int:
    seqs = [int(x) for x in argv[1].split(",")] if len(argv) > 1 else [32768, 131072]
    device = fd.Device(0)
    print("e4m3 cache, bf16 q, us (graph replay); floor: a read-only kernel of the fp8 bytes")
    print(f"{'shape':<10} {'seq':>7} {'floor':>7} {'fp8':>7} {'of floor':>8} {'bf16':>7} "
          f"{'torch':>7} {'bf16/1.8':>8} {'torch/2':>8}")  # fmt: skip
    for shape in FP8_SHAPES:
        _, n_kv, hd = shape
        for seq in seqs:
            # an fp8 row of hd bytes is a bf16 row of hd / 2 elements: the same bytes
            floor = min(floor_us(seq, n_kv, hd // 2, "bf16", device, s) for s in SPLITS)
            fp8 = measure_fp8_point(shape, seq, "e4m3", 30, device)
            bf16 = with_torch(measure_point(shape, seq, "bf16", 30, device), shape, 30)
            torch = bf16.torch_us or float("nan")
            print(f"{'/'.join(map(str, shape)):<10} {seq:>7} {floor:7.1f} {fp8:7.1f} "
                  f"{100 * floor / fp8:7.0f}% {bf16.graph_us:7.1f} {torch:7.1f} "
                  f"{bf16.graph_us / 1.8:8.1f} {torch / 2:8.1f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
