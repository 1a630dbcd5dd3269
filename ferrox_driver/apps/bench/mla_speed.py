"""``benchmarks/mla_speed.py``: MLA decode (``fd.mla_decode``) over latent caches of 576
columns, bf16 and fp8 (e4m3), against the read floor of the same bytes (a kernel that only
reads the latent) and, where PyTorch is importable, SDPA computing the same attention from
the latent as one shared K/V head (``enable_gqa``), in one process; mla_decode
graph-replayed over latent copies rotated past L2, the median of events: what issue 50's
MLA targets ask (90% of the floor from 32768 tokens).

    PYTHONPATH=. python benchmarks/mla_speed.py [--heads 16 64 128] [--n-q 1 2]
        [--seqs 4096 32768 131072] [--formats bf16 e4m3] [--no-sdpa]

Prints us per decode, the latent's TB/s (its bytes read once / time), the floor's us and
the share of it reached, all as the plan takes it with the warpgroup-MMA latent kernel on
(past 32 rows on an sm_90 GPU, chunks of ``latent_wg_min_chunk`` tokens or more), 'sync
us': the same decode with it off (the mma.sync latent kernel; the same kernel as 'us'
where the plan does not take the wgmma one), and SDPA's us (eager, its own rotation; "-"
where it does not run).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Any

import ml_dtypes
import numpy as np

from ...decode import plan as planner
from ...decode.latent import mla_decode
from ...driver.device import default_device
from ...driver.memory import DeviceArray, empty
from ...driver.module_cache import ensure_module_loaded
from .harness import RotatedKV, bench_stream, fill_uniform, rotated_graph_us, rotation

DK, DV = 576, 512
FORMATS: dict[str, Any] = {"bf16": ml_dtypes.bfloat16, "e4m3": ml_dtypes.float8_e4m3fn}

FLOOR_SOURCE = r"""
// Block b reads rows [b chunk, (b + 1) chunk) of the latent (n16 16-byte units a row); the
// xor keeps the loads alive.
extern "C" __global__ void __launch_bounds__(256) read_latent_rows(
    const uint4* c, int seq, int chunk, int n16, unsigned* sink) {
    const int start = blockIdx.x * chunk, end = min(seq, start + chunk);
    unsigned acc = 0;
    const long long first = (long long)start * n16, units = (long long)(end - start) * n16;
#pragma unroll 4
    for (long long i = threadIdx.x; i < units; i += 256) {
        const uint4 a = __ldcg(c + first + i);
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}
"""


MMA_SOURCE = r"""
// Tensor-core issue rate: each warp chains independent bf16 m16n8k16 mma.sync (8
// accumulators, operands in registers), as the latent kernel issues them; no memory.
extern "C" __global__ void __launch_bounds__(256) mma_only(int steps, float* sink) {
    unsigned a0 = threadIdx.x, a1 = a0 * 3u, a2 = a0 ^ 5u, a3 = a0 + 7u, b0 = a0 * 11u, b1 = 1u;
    float c[8][4] = {};
    for (int s = 0; s < steps; ++s) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
            asm volatile(
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc += c[j][0] + c[j][1] + c[j][2] + c[j][3];
    if (acc == 1.2345f) sink[0] = acc;
}
"""
MMA_STEPS = 4096


def mma_tflops(stream: Any, dev: Any) -> float:
    """The GPU's bf16 mma.sync m16n8k16 rate (TFLOPS), 8 warps a block, two blocks per
    multiprocessor: what bounds the latent kernel where it is not bound by reading."""
    module = ensure_module_loaded(MMA_SOURCE, "mma_only.cu", "mma_only", device=dev)
    kernel = module.get_function("mma_only")
    sink = empty((1,), np.float32, device=dev)
    blocks = 2 * dev.multiprocessor_count
    rotated = RotatedKV([(sink, sink)], 8, sink)

    def run(_: int) -> None:
        kernel.launch(blocks, 256, (np.int32(MMA_STEPS), sink), stream=stream)

    us = rotated_graph_us(run, rotated, stream, 10)
    sink.close()
    flops = blocks * 8 * MMA_STEPS * 8 * 16 * 8 * 16 * 2
    return flops / us / 1e6


def _sets(seq: int, fmt: str, stream: Any, dev: Any) -> RotatedKV:
    dt = np.dtype(FORMATS[fmt])
    one = seq * DK * dt.itemsize
    n_sets, chain = rotation(one)
    pool = empty((n_sets * one,), np.uint8, device=dev)
    sets = []
    for i in range(n_sets):
        c = pool.view((seq, DK), dt, offset=i * one)
        fill_uniform(c, 100 + i, stream)
        sets.append((c, c))
    return RotatedKV(sets, chain, pool)


def _floor_us(rotated: RotatedKV, seq: int, itemsize: int, stream: Any, dev: Any) -> float:
    module = ensure_module_loaded(FLOOR_SOURCE, "read_latent_floor.cu", "read_latent_rows",
                                  device=dev)  # fmt: skip
    kernel = module.get_function("read_latent_rows")
    blocks = 4 * dev.multiprocessor_count
    chunk = -(-seq // blocks)
    sink = empty((1,), np.uint32, device=dev)
    n16 = DK * itemsize // 16

    def read(i: int) -> None:
        c = rotated.sets[i % len(rotated.sets)][0]
        args = (c, np.int32(seq), np.int32(chunk), np.int32(n16), sink)
        kernel.launch(blocks, 256, args, stream=stream)

    return rotated_graph_us(read, rotated, stream, 20)


def _sdpa_us(q: np.ndarray, rotated: RotatedKV, n_q: int, seq: int, fmt: str) -> float | None:
    """SDPA's eager us over the same latent sets (the latent as one K/V head, widened to
    bf16 per call for an fp8 cache), or None without PyTorch or where it fails."""
    try:
        import torch
        import torch.nn.functional as F
    except Exception:
        return None
    try:
        qt = torch.tensor(q.astype(np.float32), device="cuda").to(torch.bfloat16)
        qt = qt.reshape(n_q, -1, DK).transpose(0, 1).unsqueeze(0)  # (1, H, n_q, DK)
        lat = [torch.from_dlpack(c) for c, _ in rotated.sets]
        pos = torch.arange(seq, device="cuda")
        mask = pos[None, :] <= (seq - n_q + torch.arange(n_q, device="cuda"))[:, None]
        times = []
        for rep in range(3 * len(lat)):
            c = lat[rep % len(lat)]
            if fmt == "e4m3":
                c = c.view(torch.uint8).view(torch.float8_e4m3fn).to(torch.bfloat16)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            k = c.view(1, 1, seq, DK)
            F.scaled_dot_product_attention(qt, k, k[..., :DV], attn_mask=mask, enable_gqa=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times[len(lat) :] or times)
    except Exception:
        return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--n-q", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--formats", nargs="+", default=["bf16", "e4m3"], choices=list(FORMATS))
    parser.add_argument("--no-sdpa", action="store_true")
    args = parser.parse_args(argv)
    dev = default_device()
    stream = bench_stream(dev)
    rng = np.random.default_rng(0)
    tflops = mma_tflops(stream, dev)
    print(f"# {dev.name}: MLA decode, latent {DK} (values {DV}); us per decode, graph-replayed;"
          f" mma.sync bf16 {tflops:.0f} TFLOPS measured: 'mma us' = the decode's "
          f"n_q x heads x seq x {DK + DV} x 2 flops at that rate")  # fmt: skip
    print(f"{'fmt':>5} {'seq':>7} {'heads':>5} {'n_q':>3} {'us':>9} {'TB/s':>6} "
          f"{'floor us':>9} {'% floor':>7} {'mma us':>8} {'sync us':>8} "
          f"{'sdpa us':>9}")  # fmt: skip
    for fmt in args.formats:
        fp8 = fmt != "bf16"
        itemsize = np.dtype(FORMATS[fmt]).itemsize
        for seq in args.seqs:
            rotated = _sets(seq, fmt, stream, dev)
            floor = _floor_us(rotated, seq, itemsize, stream, dev)
            latent_bytes = seq * DK * itemsize
            for heads in args.heads:
                for n_q in args.n_q:
                    q = rng.standard_normal((n_q, heads, DK)).astype(ml_dtypes.bfloat16)
                    q_d = empty(q.shape, q.dtype, device=dev)
                    q_d.copy_from_host(q, stream)
                    out = empty((n_q, heads, DV), q.dtype, device=dev)
                    kw = {"kv_scale": 0.05} if fp8 else {}

                    def decode(i: int, q_d: DeviceArray = q_d, out: DeviceArray = out,
                               kw: dict[str, Any] = kw,
                               sets: Any = rotated.sets) -> None:  # fmt: skip
                        mla_decode(q_d, sets[i % len(sets)][0], out=out, stream=stream, **kw)

                    before = planner.OVERRIDES
                    try:
                        planner.OVERRIDES = dataclasses.replace(before, latent_wgmma=True)
                        us = rotated_graph_us(decode, rotated, stream, 20)
                        planner.OVERRIDES = dataclasses.replace(before, latent_wgmma=False)
                        sync_us = rotated_graph_us(decode, rotated, stream, 20)
                    finally:
                        planner.OVERRIDES = before
                    sdpa = None if args.no_sdpa else _sdpa_us(q, rotated, n_q, seq, fmt)
                    mma_us = n_q * heads * seq * (DK + DV) * 2 / tflops / 1e6
                    print(f"{fmt:>5} {seq:>7} {heads:>5} {n_q:>3} {us:>9.2f} "
                          f"{latent_bytes / us / 1e6:>6.2f} {floor:>9.2f} "
                          f"{100 * floor / us:>6.1f}% {mma_us:>8.2f} {sync_us:>8.2f} "
                          f"{'-' if sdpa is None else f'{sdpa:.1f}':>9}", flush=True)  # fmt: skip
                    q_d.close()
                    out.close()
            rotated.close()


if __name__ == "__main__":
    main()
