"""fp8 caches at 32768 tokens are bound by each warp's chain of steps (32 steps of 16 tokens
per warp at 0.5-0.6 us each for 32/8/128), not by their bytes: does a block of 8 warps on
the same full-wave plan (half the steps per warp) pay? Times the shipped fp8 plan against
that variant (the swapped body with 8 warps, its ring of the same steps), alternating, bf16
q, e4m3 cache, graph-replayed over rotated KV sets; checks that both write the same bits.

    python3 benchmarks/fp8_warps.py [shape ...]
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import ml_dtypes
import numpy as np

import ferrox_driver as fd
from ferrox_driver.apps.bench.harness import (
    bench_stream,
    captured,
    fill_uniform,
    rotated_kv_sets,
    time_replays,
)
from ferrox_driver.decode import launches
from ferrox_driver.decode import plan as attention
from ferrox_driver.driver.compiler import compile_source
from ferrox_driver.kernels.catalogue import kernel_source
from ferrox_driver.kernels.spec import ENTRY_TYPES, FP8_FORMATS, SPLIT_FILE

SHAPES = [(32, 8, 128), (64, 8, 128), (28, 4, 128)]
SEQS = (32768, 131072)
WARPS = 8


def variant(plan: attention.SplitPlan, device: fd.Device) -> tuple[attention.SplitPlan, fd.Kernel]:
    """The plan's fp8 kernel with WARPS warps (its ring's steps unchanged, no reserve)."""
    spec = plan.spec  # FX_MMA8_KERNELS(NAME, QT, Q8, D, DR, TILED, F)'s fields
    name, qt, q8 = spec.name, ENTRY_TYPES[spec.dtype], FP8_FORMATS[spec.fp8]
    d, dr, f = spec.head_dim, spec.row_dim, spec.features
    tiled = "true" if spec.tiles == 2 else "false"
    body = (
        f'extern "C" __global__ void __launch_bounds__({WARPS * 32}, 1) {name}('
        f"const {qt}* q, const unsigned char* k, const unsigned char* v, float* ws_o, "
        "float* ws_ml, int n_heads, int n_kv_heads, int seq_len, const int* seq_len_dev, "
        "int splits, int tile, const float* kv_scales, float scale, float cap, int window, "
        "const float* slopes) {\n"
        "    const FxFeat feat{scale, cap, window, slopes, nullptr, nullptr};\n"
        f"    gqa_split_mma_swapped<fx_half, {d}, false, {WARPS}, {dr}, {tiled}, {f}, 1, {q8}, "
        f"{qt}>(q, k, v, ws_o, ws_ml, nullptr, n_heads, n_kv_heads, seq_len, seq_len_dev, "
        "splits, tile, feat, kv_scales);\n}\n"
    )
    src = f"#define FX_SELECTED 1\n{kernel_source(SPLIT_FILE)}\n{body}"
    program = compile_source(src, arch=device.arch, name=f"{name}_w{WARPS}.cu")
    kernel = fd.Module(program, device=device).get_function(name)
    wide = dataclasses.replace(plan, threads=32 * WARPS, reserve_stages=plan.stages)
    return wide, kernel


def measure(shape: tuple[int, int, int], seq: int, device: fd.Device, stream: fd.Stream) -> str:
    """One point: the shipped plan and the variant, their bits compared, each timed twice
    alternating (the faster kept)."""
    n_heads, n_kv, hd = shape
    q_dt = np.dtype(ml_dtypes.bfloat16)
    q = fd.empty((n_heads, hd), q_dt, device=device)
    out = fd.empty((n_heads, hd), q_dt, device=device)
    fill_uniform(q, 7, stream)
    scales = fd.to_device(np.full(2 * n_kv, 0.01, np.float32), device=device)
    plan = launches.plan_split(device, q_dt, n_heads, n_kv, hd, seq, True, 0, "e4m3")
    assert not plan.cluster, plan  # (the combine plans: the variant has no cluster twin)
    wide, kernel = variant(plan, device)
    ws = fd.zeros((plan.workspace_floats(n_heads, hd),), np.float32, device=device)
    rotated = rotated_kv_sets(seq, n_kv, hd, np.dtype(ml_dtypes.float8_e4m3fn), stream, device)
    sets, chain = rotated.sets, rotated.chain
    cases = {"shipped": (plan, None), f"{WARPS} warps": (wide, kernel)}

    def eager(label: str, i: int) -> None:
        p, swap = cases[label]
        k, v = sets[i % len(sets)]
        for launch in launches.split_launches(
            p, q, k, v, out, ws, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd, seq_len=seq,
            seq_len_dev=None, kv_scales=scales,
        ):  # fmt: skip
            launch.run(stream, device, swap if launch.kernel == p.kernel else None)

    def all_sets(label: str) -> None:
        for i in range(chain):
            eager(label, i)

    bits = {}
    for label in cases:
        eager(label, 0)
        bits[label] = out.to_host(stream).view(np.uint16).copy()
    same = np.array_equal(*bits.values())
    times: dict[str, list[float]] = {label: [] for label in cases}
    for _ in range(2):  # alternating
        for label in cases:
            execs = [captured(stream, functools.partial(eager, label, i)) for i in range(len(sets))]
            chained = captured(stream, functools.partial(all_sets, label))
            times[label].append(time_replays(chained, chain, execs, stream, 30)[0])
            for e in [*execs, chained]:
                e.close()
    rotated.close()
    for arr in (q, out, scales, ws):
        arr.close()
    best = "  ".join(f"{label} {min(ts):.1f} us" for label, ts in times.items())
    return f"{n_heads}/{n_kv}/{hd} {seq:>6}: {best}; same bits: {same}"


def main() -> None:
    only = sys.argv[1:]
    device = fd.Device(0)
    stream = bench_stream(device)
    for shape in SHAPES:
        if only and "/".join(map(str, shape)) not in only:
            continue
        for seq in SEQS:
            print(measure(shape, seq, device, stream), flush=True)


if __name__ == "__main__":
    main()
