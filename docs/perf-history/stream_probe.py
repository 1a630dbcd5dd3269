# ruff: noqa: B023  (closures are called before the loop moves on)
"""How fast can one block per multiprocessor stream the KV cache, with nothing (or a stand-in
chain) to compute? The small shapes' decodes read 72-80% of the ceiling at 131072 tokens
against 99% for the big ones (NOTES.md v18).

    PYTHONPATH=. python3 docs/perf-history/stream_probe.py [shape ...] [--rings]

Each probe kernel has the split kernels' grid (chunks x KV heads, one block per
multiprocessor), rotation (warps take 16-token steps in turn) and ring (S steps per warp, the
next S - 1 in flight). Per step it reads one 16-byte word of K and V (with READ_ALL, every
16 bytes of the step, as the mmas do) and runs a dependent chain of SPIN FMAs (a stand-in
for the step's mma/softmax chain). Timed back to back over the benchmark's rotated KV sets,
next to the library's decode of the same point (and its two kernels alone) and a flat
grid-stride read of the same bytes (8 blocks of 256 threads per multiprocessor, 16-byte
loads): the best one kernel reading them does.

- default: the library's ring, cp.async, the token orders of ORDERS (runs of g block-steps
  taken by a KV head's blocks in turn, or one contiguous chunk each) and the chains of SPINS
  (`stream-probe-orders-v18.log`).
- `--rings`: every ring of CASES, cp.async and the Tensor Memory Accelerator's bulk copies
  (one `cp.async.bulk` per K or V row, completing on an mbarrier per ring stage), contiguous
  chunks, no chain. `stream-probe-v18.log` came from the first version of this script
  (f478916: every ring at chains of 0 and 200 FMAs).
- `--short`: 512 and 4096 tokens (the issue's 4 and 7 us points) instead of SEQS
  (`stream-probe-short-v18.log`).
- `--half`: the shapes of HALF_RINGS at 4096 and 32768 tokens with half the chunks (every
  other multiprocessor idle) and deeper rings, cp.async and bulk, no chain
  (`stream-probe-half-v18.log`).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from points import points

import ferrox_driver as fd
from ferrox_driver.bench_decode import bench_stream, captured, measure_read_ceiling, time_events
from ferrox_driver.compiler import compile_source
from ferrox_driver.device import default_device
from ferrox_driver.launch import Module

SOURCE = r"""
#define TOK 16
#define STEPB (TOK * ROWB)  // bytes of one step's K (or V)
#define NT (WARPS * 32)
#ifndef READ_ALL
#define READ_ALL 0
#endif

__device__ __forceinline__ unsigned fx_smem(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// A stand-in for a step's dependent chain of work.
__device__ __forceinline__ unsigned spin(unsigned acc) {
    float x = __uint_as_float(acc & 0x3fffffffu);
#pragma unroll
    for (int i = 0; i < SPIN; ++i) x = fmaf(x, 0.999f, 1e-7f);
    return acc ^ __float_as_uint(x);
}

extern "C" __global__ void __launch_bounds__(NT, 1)
stream_cpasync(const char* __restrict__ k, const char* __restrict__ v, long long row,
               int steps, int g, unsigned* sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const char* kg = k + (long long)blockIdx.y * ROWB;
    const char* vg = v + (long long)blockIdx.y * ROWB;
    unsigned char* ring = smem + warp * S * 2 * STEPB;
    // block-step j (WARPS * TOK tokens) of this block: runs of g block-steps, the blocks
    // of a KV head taking runs in turn (g = steps: each block one contiguous chunk)
    auto t0 = [&](int j) {
        return (((j / g) * (int)gridDim.x + (int)blockIdx.x) * g + j % g) * (WARPS * TOK) +
               warp * TOK;
    };
    auto issue = [&](int j) {
        const int t = t0(j);
        if (j < steps) {
            unsigned char* ks = ring + (j % S) * 2 * STEPB;
#pragma unroll
            for (int i = 0; i < STEPB / 16 / 32; ++i) {
                const int idx = i * 32 + lane, r = idx / (ROWB / 16), c = idx % (ROWB / 16);
                const long long off = (long long)(t + r) * row + c * 16;
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                    fx_smem(ks + r * ROWB + c * 16)), "l"(kg + off));
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                    fx_smem(ks + STEPB + r * ROWB + c * 16)), "l"(vg + off));
            }
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
#pragma unroll
    for (int j = 0; j < S - 1; ++j) issue(j);
    unsigned acc = lane;
    for (int j = 0; j < steps; ++j) {
        issue(j + S - 1);
        asm volatile("cp.async.wait_group %0;" ::"n"(S - 1) : "memory");
        __syncwarp();
        const uint4* ks = reinterpret_cast<const uint4*>(ring + (j % S) * 2 * STEPB);
#if READ_ALL  // every 16 bytes of the step read once from shared memory, as the mmas do
#pragma unroll
        for (int i = 0; i < 2 * STEPB / 16 / 32; ++i) {
            const uint4 a = ks[i * 32 + lane];
            acc ^= a.x ^ a.w;
        }
#else
        const uint4 a = ks[lane], b = ks[STEPB / 16 + lane];
        acc ^= a.x ^ b.y;
#endif
        acc = spin(acc);
        __syncwarp();
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

// Every byte of K and V once, 16-byte loads, grid-stride: the best one kernel does.
extern "C" __global__ void flat_read(const uint4* __restrict__ k, const uint4* __restrict__ v,
                                     long long n16, unsigned* sink) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    unsigned acc = 0;
    for (; i < n16; i += stride) {
        const uint4 a = __ldg(k + i), b = __ldg(v + i);
        acc ^= a.x ^ b.y;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

extern "C" __global__ void __launch_bounds__(NT, 1)
stream_bulk(const char* __restrict__ k, const char* __restrict__ v, long long row, int chunk,
            unsigned* sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long bar[WARPS][S];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int start = blockIdx.x * chunk, end = start + chunk;
    const char* kg = k + (long long)blockIdx.y * ROWB;
    const char* vg = v + (long long)blockIdx.y * ROWB;
    unsigned char* ring = smem + warp * S * 2 * STEPB;
    if (lane < S)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(fx_smem(&bar[warp][lane])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncwarp();
    auto t0 = [&](int j) { return start + warp * TOK + j * (WARPS * TOK); };
    // One bulk copy per row: lanes 0-15 the step's 16 K rows, 16-31 its V rows (a row of
    // ROWB bytes per copy; ROWB / 16 * 16 bytes would need fewer lanes for wider rows).
    auto issue = [&](int j) {
        const int t = t0(j);
        if (t >= end) return;
        const int stage = j % S;
        const unsigned b = fx_smem(&bar[warp][stage]);
        if (lane == 0)
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b),
                         "r"(2 * STEPB) : "memory");
        __syncwarp();
        const int r = lane & 15;
        const char* src = (lane < 16 ? kg : vg) + (long long)(t + r) * row;
        unsigned char* dst = ring + stage * 2 * STEPB + (lane >= 16 ? STEPB : 0) + r * ROWB;
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
            "[%3];" ::"r"(fx_smem(dst)), "l"(src), "r"(ROWB), "r"(b) : "memory");
    };
#pragma unroll
    for (int j = 0; j < S - 1; ++j) issue(j);
    unsigned acc = lane;
    for (int j = 0; t0(j) < end; ++j) {
        issue(j + S - 1);
        const unsigned b = fx_smem(&bar[warp][j % S]);
        const unsigned parity = (j / S) & 1;
        asm volatile(
            "{\n .reg .pred p;\n WAIT_%=:\n"
            " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
            " @!p bra WAIT_%=;\n}" ::"r"(b), "r"(parity) : "memory");
        const uint4* ks = reinterpret_cast<const uint4*>(ring + (j % S) * 2 * STEPB);
        const uint4 a = ks[lane], bb = ks[STEPB / 16 + lane];
        acc = spin(acc ^ a.x ^ bb.y);
        __syncwarp();
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}
"""

# shape -> (row bytes of one KV head (bf16), chunks, [(method, warps, steps), ...]);
# the first ring is the library's (FX_WARPS_D* x FX_STAGES_D*)
CASES = {
    (8, 1, 256): (512, 132, [("cpasync", 4, 3), ("cpasync", 4, 2), ("bulk", 4, 3),
                             ("bulk", 4, 2), ("bulk", 2, 6)]),
    (16, 2, 64): (128, 66, [("cpasync", 8, 3), ("cpasync", 8, 4), ("bulk", 8, 3),
                            ("bulk", 8, 4), ("bulk", 4, 6)]),
    (32, 8, 128): (256, 16, [("cpasync", 4, 2), ("cpasync", 4, 4), ("bulk", 4, 2),
                             ("bulk", 4, 4)]),
    (32, 32, 128): (256, 4, [("cpasync", 4, 2), ("cpasync", 4, 4), ("bulk", 4, 2),
                             ("bulk", 4, 4)]),
}  # fmt: skip
SEQS = [32768, 131072]
# --half: half the chunks (one block on every other multiprocessor, as clusters of 8 per KV
# head would take), with deeper rings: how much can one multiprocessor pull?
HALF_RINGS = {
    (32, 8, 128): [("cpasync", 4, 2), ("cpasync", 4, 4), ("cpasync", 4, 6), ("cpasync", 8, 3),
                   ("bulk", 4, 4), ("bulk", 4, 6)],
}  # fmt: skip
SPINS = [0, 200, 800]
# Token orders for the library's ring: runs of g block-steps taken by the blocks of a KV
# head in turn (None: each block one contiguous chunk, as the split kernels read).
ORDERS = [None, 5, 1]


def main() -> None:
    half = "--half" in sys.argv
    rings_too = half or "--rings" in sys.argv  # every ring (cp.async and bulk), contiguous
    only = [a for a in sys.argv[1:] if not a.startswith("--")]
    dev = default_device()
    stream = bench_stream(dev)
    ceiling = measure_read_ceiling(dev)
    print(f"read ceiling {ceiling:.2f} TB/s (ferrox_read_sum)", flush=True)
    sink = fd.zeros(4, np.uint32, device=dev)
    modules: dict[tuple[int, int, int, int, int], Module] = {}

    def module(rowb: int, warps: int, steps: int, spin: int, read_all: int = 0) -> Module:
        key = (rowb, warps, steps, spin, read_all)
        if key not in modules:
            defines = (f"-DROWB={rowb}", f"-DWARPS={warps}", f"-DS={steps}", f"-DSPIN={spin}",
                       f"-DREAD_ALL={read_all}")  # fmt: skip
            src = compile_source(SOURCE, options=defines, name="stream_probe.cu")
            modules[key] = Module(src, dev)
        return modules[key]

    seqs = [512, 4096] if "--short" in sys.argv else [4096, 32768] if half else SEQS
    shapes = HALF_RINGS if half else CASES
    cases = [((nh, nkv, hd), "bf16", seqs) for (nh, nkv, hd) in shapes]
    for p in points(cases, stream, only):
        rowb, chunks, rings = CASES[p.n_heads, p.n_kv, p.head_dim]
        if half:
            chunks, rings = chunks // 2, HALF_RINGS[p.n_heads, p.n_kv, p.head_dim]
        plan = p.plan()
        ours = p.time(plan)
        cells = [f"decode {ours:.2f} us ({p.kv_bytes / ours / 1e6:.2f} TB/s)"]
        if not plan.cluster:  # each kernel of the decode alone
            cells += [
                f"{part} alone {p.time(plan, parts=part):.2f} us" for part in ("main", "combine")
            ]

        def timed(launch: Any, read: int, label: str) -> None:
            turn = [0]

            def body() -> None:
                k, v = p.sets[turn[0] % len(p.sets)]
                turn[0] += 1
                launch(k, v)

            exe = captured(stream, body, p.chain)
            us = time_events(lambda i: exe.launch(stream), stream, 30, 3, p.chain)
            exe.close()
            cells.append(f"{label} {us:.2f} us ({read / us / 1e6:.2f} TB/s)")

        flat = module(rowb, 4, 2, 0).get_function("flat_read")
        n16 = np.int64(p.kv_bytes // 32)
        blocks = dev.multiprocessor_count * 8
        timed(lambda k, v: flat.launch(blocks, 256, (k, v, n16, sink), stream=stream),
              p.kv_bytes, "flat")  # fmt: skip
        row = np.int64(p.n_kv * rowb)
        variants = [(spin, 0) for spin in SPINS] + [(spin, 1) for spin in SPINS]
        for spin, read_all in variants if not rings_too else [(0, 0)]:
            for method, warps, steps in rings if rings_too else rings[:1]:
                kern = module(rowb, warps, steps, spin, read_all).get_function(f"stream_{method}")
                smem = warps * steps * 2 * 16 * rowb
                bsteps = p.seq // chunks // (warps * 16)  # block-steps per block
                orders = ORDERS if method == "cpasync" and not rings_too else [None]
                for g in orders if not read_all else [None]:
                    n = bsteps if g is None else bsteps // g * g  # whole runs only
                    if n == 0:
                        continue
                    read = 2 * chunks * n * warps * 16 * p.n_kv * rowb
                    if method == "bulk":
                        args: tuple[Any, ...] = (row, np.int32(n * warps * 16), sink)
                    else:
                        args = (row, np.int32(n), np.int32(g or n), sink)
                    label = f"{method} {warps}x{steps} spin {spin}" + (
                        " read all" if read_all else ""
                    )
                    timed(
                        lambda k, v: kern.launch((chunks, p.n_kv), warps * 32, (k, v, *args),
                                                 shared_mem=smem, stream=stream),
                        read, label + (" chunks" if g is None else f" runs of {g}"),
                    )  # fmt: skip
        print(f"{p.label}: " + "; ".join(cells), flush=True)
    for m in modules.values():
        m.close()
    sink.close()


if __name__ == "__main__":
    main()
