"""``bench --only kv4``'s speed table (and benchmarks/kv4_speed.py): the 4-bit caches'
decodes over raw buffers (q4, nibbles and float16 scales per 32, K rotated; nvfp4, e2m1
nibbles and e4m3 scales per 16), as the planner launches them (one query: the swapped split
kernels; with ``--rows`` the rows kernels too, as before them), against our fp8 and bf16
decodes of the same shape and length and the read floor of the same bytes (a kernel that
only reads the values and the scales), in one process, graph-replayed over sets rotated
past L2: what issue 49's speed targets ask of them (1.7x fp8 and 3.2x bf16 at 32/8/128
from 32768 tokens, 90% of the floor).

    PYTHONPATH=. python benchmarks/kv4_speed.py [--shapes 32/8/128 28/4/128 8/1/256]
        [--seqs 4096 32768 131072] [--n-q 1] [--rows] [--row-warps 1 4]
        [--traits FX_WARPS4_D128=8 ...]

Prints us per decode, each 4-bit cache's TB/s (values and scales), its share of the floor
and its speed-up over fp8 and bf16.
"""

from __future__ import annotations

import argparse
import dataclasses

import ml_dtypes
import numpy as np

from ...cache.four_bit import DEFAULT_LAYOUT
from ...decode import plan as planner
from ...decode.records import launches_for
from ...driver.device import default_device
from ...driver.memory import DeviceArray, empty, zeros
from ...driver.module_cache import ensure_module_loaded
from ...kernels.traits import SPLIT_TRAITS
from .harness import (
    RotatedKV,
    bench_stream,
    fill_uniform,
    rotated_graph_us,
    rotation,
)
from .verify import measure_verify_point

BF16 = np.dtype(ml_dtypes.bfloat16)

FLOOR_SOURCE = r"""
// Block (chunk, kv head) reads tokens [start, end) of its head's K and V values (n16 16-byte
// units a row) and block scales (nw 4-byte words a row), rows token-major or (hm) head-major;
// the xor keeps the loads alive.
extern "C" __global__ void __launch_bounds__(256) read_4bit_rows(
    const uint4* k, const uint4* v, const unsigned* ks, const unsigned* vs, int seq,
    int chunk, int n16, int nw, int n_kv, int hm, unsigned* sink) {
    const int start = blockIdx.x * chunk, end = min(seq, start + chunk);
    unsigned acc = 0;
    const int units = (end - start) * n16, words = (end - start) * nw;
    // (the block's first row)
    const long long row_at = hm ? (long long)blockIdx.y * seq + start
                                : (long long)start * n_kv + blockIdx.y;
    const int step = hm ? 1 : n_kv;
#pragma unroll 4
    for (int i = threadIdx.x; i < units; i += 256) {
        const long long at = (row_at + (long long)(i / n16) * step) * n16 + i % n16;
        const uint4 a = __ldcg(k + at), b = __ldcg(v + at);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
    }
    for (int i = threadIdx.x; i < words; i += 256) {
        const long long at = (row_at + (long long)(i / nw) * step) * nw + i % nw;
        acc ^= __ldcg(ks + at) ^ __ldcg(vs + at);
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;  // (never, in practice)
}
// ... or each array whole, front to back (n16 / s16: 16-byte units of K's values / scales)
extern "C" __global__ void __launch_bounds__(256) read_4bit_flat(
    const uint4* k, const uint4* v, const uint4* ks, const uint4* vs, long long n16,
    long long s16, unsigned* sink) {
    unsigned acc = 0;
    const long long stride = (long long)gridDim.x * 256, first = blockIdx.x * 256LL + threadIdx.x;
#pragma unroll 4
    for (long long i = first; i < n16; i += stride) {
        const uint4 a = __ldcg(k + i), b = __ldcg(v + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
    }
    for (long long i = first; i < s16; i += stride) {
        const uint4 a = __ldcg(ks + i), b = __ldcg(vs + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;  // (never, in practice)
}
"""
HEAD_MAJOR = DEFAULT_LAYOUT == "HND"  # the buffers' layout: a KVCache's default (--layout)
FLOOR_SPLITS = (16, 32, 64, 128)  # chunks per KV head (read_4bit_rows)
FLOOR_BLOCKS = (2, 4, 8, 16)  # blocks per multiprocessor (read_4bit_flat)


def four_bit_us(
    shape: tuple[int, int, int], seq: int, n_q: int, fmt: str, iters: int = 20,
    floor: bool = False,
) -> tuple[float, int, float]:  # fmt: skip
    """Graph-replayed us of a 4-bit (``fmt``: q4, nvfp4) decode, the bytes it reads and
    (``floor``) the read floor's us on the same buffers (else nan)."""
    n_heads, n_kv, d = shape
    dev = default_device()
    stream = bench_stream(dev)
    q = empty((n_q, n_heads, d), BF16, device=dev)
    out = empty((n_q, n_heads, d), BF16, device=dev)
    fill_uniform(q, 7, stream)
    nv = fmt == "nvfp4"
    sdt = np.uint8 if nv else np.float16
    per = d // (16 if nv else 32)
    # the buffers' layout: head-major where HEAD_MAJOR, else token-major
    vals, scales = (((n_kv, seq, d // 2), (n_kv, seq, per)) if HEAD_MAJOR
                    else ((seq, n_kv, d // 2), (seq, n_kv, per)))  # fmt: skip
    one = seq * n_kv * (d // 2 + d // 16)  # bytes of K (or V): values and scales
    globals_ = zeros((2 * n_kv,), np.float32, device=dev)
    globals_.copy_from_host(np.ones(2 * n_kv, np.float32), stream)
    n_sets, chain = rotation(2 * one)
    pool = empty((2 * n_sets * one,), np.uint8, device=dev)
    sets = []
    for i in range(n_sets):
        at = 2 * i * one
        parts = []
        for j, (shape_j, dt) in enumerate(
            ((vals, np.uint8), (vals, np.uint8), (scales, sdt), (scales, sdt))
        ):
            size = int(np.prod(shape_j)) * np.dtype(dt).itemsize
            parts.append(pool.view(shape_j, dt, offset=at))
            at += size
            fill_uniform(parts[-1], 100 + 4 * i + j, stream)  # (scales within +-1)
        sets.append(tuple(parts))
    held: list[DeviceArray] = []

    def workspace(floats: int) -> DeviceArray:
        if not held:
            held.append(zeros((max(floats, 1),), np.float32, device=dev))
        return held[0]

    def eager(i: int) -> None:
        kv_, vv, ks, vs = sets[i % len(sets)]
        launches = launches_for(
            q, kv_, vv, out, n_heads=n_heads, n_kv_heads=n_kv, head_dim=d, seq_len=seq,
            plan_seq=seq, aligned=True, dtype=BF16, fp8=fmt, q4_scales=(ks, vs), rotate=not nv,
            kv_scales=globals_, workspace=workspace, n_q=n_q,
            q4_head_stride=seq * d // 2 if HEAD_MAJOR else 0,
        )[0]  # fmt: skip
        for launch in launches:
            launch.run(stream, dev)

    rotated = RotatedKV([], chain, pool)
    rotated.sets.extend((s[0], s[1]) for s in sets)  # (the harness counts the sets)
    us = rotated_graph_us(eager, rotated, stream, iters)
    floor_us = float("nan")
    if floor:  # the best of both read kernels over their block counts
        module = ensure_module_loaded(FLOOR_SOURCE, "read_4bit_floor.cu", "read_4bit_rows",
                                      device=dev)  # fmt: skip
        by_rows = module.get_function("read_4bit_rows")
        flat = module.get_function("read_4bit_flat")
        sink = zeros((1,), np.uint32, device=dev)
        n16, s16 = seq * n_kv * d // 32, seq * n_kv * (d // 16) // 16  # (units of 16 bytes)
        floor_us = float("inf")
        for splits in FLOOR_SPLITS:

            def read(i: int, splits: int = splits) -> None:
                kv_, vv, ks, vs = sets[i % len(sets)]
                args = (kv_, vv, ks, vs, np.int32(seq), np.int32(-(-seq // splits)),
                        np.int32(d // 32), np.int32(d // 64), np.int32(n_kv),
                        np.int32(HEAD_MAJOR), sink)  # fmt: skip
                by_rows.launch((splits, n_kv), 256, args, stream=stream)

            floor_us = min(floor_us, rotated_graph_us(read, rotated, stream, iters))
        for per_sm in FLOOR_BLOCKS:

            def read_flat(i: int, blocks: int = per_sm * dev.multiprocessor_count) -> None:
                kv_, vv, ks, vs = sets[i % len(sets)]
                args = (kv_, vv, ks, vs, np.int64(n16), np.int64(s16), sink)
                flat.launch(blocks, 256, args, stream=stream)

            floor_us = min(floor_us, rotated_graph_us(read_flat, rotated, stream, iters))
        sink.close()
    rotated.close()
    for arr in (q, out, globals_, *held):
        arr.close()
    return us, 2 * one, floor_us


def speed_table(shapes: list[str], seqs: list[int], n_q: int = 1,
                row_warps: tuple[int, ...] = (), rows: bool = False) -> None:  # fmt: skip
    """Print the table: per shape and length, bf16's and fp8's us, each 4-bit format's us,
    TB/s, share of its read floor and speed-up (``rows``: each format again on the rows
    kernel; ``row_warps``: q4 on the rows kernel with blocks of at least these warps)."""
    dev = default_device()
    print(f"{'shape':>9} {'seq':>7} {'bf16 us':>8} {'fp8 us':>8} {'format':>9} {'us':>8} "
          f"{'TB/s':>6} {'floor':>7} {'of floor':>8} {'vs fp8':>7} {'vs bf16':>8}")  # fmt: skip
    for shape_s in shapes:
        shape = tuple(int(x) for x in shape_s.split("/"))
        for seq in seqs:
            bf16 = measure_verify_point(shape, seq, n_q, "bf16", 20, dev)  # type: ignore[arg-type]
            fp8 = measure_verify_point(shape, seq, n_q, "fp8", 20, dev)  # type: ignore[arg-type]
            variants = [("q4", -1), ("nvfp4", -1)]
            if rows:
                variants += [("q4", 0), ("nvfp4", 0)]
            variants += [("q4", w) for w in row_warps]
            floors: dict[str, float] = {}
            for fmt, w in variants:
                base = planner.OVERRIDES
                if w >= 0:  # the rows kernel (w: the fewest warps a block, 0: the default's)
                    planner.OVERRIDES = dataclasses.replace(
                        base, four_bit_split=False, rows4_warps=w or base.rows4_warps
                    )
                try:
                    us, nbytes, fl = four_bit_us(shape, seq, n_q, fmt,  # type: ignore[arg-type]
                                                 floor=fmt not in floors)  # fmt: skip
                finally:
                    planner.OVERRIDES = base
                floor = floors.setdefault(fmt, fl)
                name = fmt if w < 0 else f"{fmt}/rows" + (f"{w}" if w else "")
                print(
                    f"{shape_s:>9} {seq:>7} {bf16:8.1f} {fp8:8.1f} {name:>9} {us:8.1f} "
                    f"{nbytes / us / 1e6:6.2f} {floor:7.1f} {100 * floor / us:7.0f}% "
                    f"{fp8 / us:6.2f}x {bf16 / us:7.2f}x",
                    flush=True,
                )


def set_traits(pairs: list[str]) -> None:
    """Change SPLIT_TRAITS (and the 4-bit plans' warps and steps read from them) for this
    process; only before its first kernel is built (the kernel source is built once)."""
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in SPLIT_TRAITS:
            raise SystemExit(f"--traits: expected NAME=VALUE, NAME in SPLIT_TRAITS; got {pair!r}")
        SPLIT_TRAITS[name] = int(value)
    for d in planner.FOUR_BIT_WIDE:
        for n, kinds in (("", planner.FOUR_BIT_WIDE), ("N", planner.FOUR_BIT_NARROW)):
            kinds[d] = (SPLIT_TRAITS[f"FX_WARPS4{n}_D{d}"], SPLIT_TRAITS[f"FX_STAGES4{n}_D{d}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=["32/8/128", "28/4/128", "8/1/256"])
    parser.add_argument("--seqs", nargs="+", type=int, default=[4096, 32768, 131072])
    parser.add_argument("--n-q", type=int, default=1)
    parser.add_argument("--rows", action="store_true",
                        help="also time each format on the rows kernel")  # fmt: skip
    parser.add_argument("--row-warps", nargs="*", type=int, default=[],
                        help="also time q4 on the rows kernel with blocks of at least these "
                             "warps (Overrides.rows4_warps)")  # fmt: skip
    parser.add_argument("--traits", nargs="*", default=[], metavar="NAME=VALUE",
                        help="SPLIT_TRAITS changed for this process (e.g. FX_WARPS4_D128=8 "
                             "FX_STAGES4_D128=3), before any kernel is built")  # fmt: skip
    parser.add_argument("--layout", choices=["NHD", "HND"], default=DEFAULT_LAYOUT,
                        help="the 4-bit buffers' layout (default: a KVCache's)")  # fmt: skip
    args = parser.parse_args()
    global HEAD_MAJOR
    HEAD_MAJOR = args.layout == "HND"
    set_traits(args.traits)
    speed_table(args.shapes, args.seqs, args.n_q, tuple(args.row_warps), args.rows)


if __name__ == "__main__":
    main()
