# ruff: noqa: B023  (closures are called before the loop moves on)
"""Is the decode's fixed cost instruction fetch? Time, back to back in one graph, kernels that
execute about the same work from very different amounts of code.

    PYTHONPATH=. python3 docs/perf-history/fixed_cost.py

- empty: nothing.
- loop N: N dependent-free FMAs per thread in a rolled loop (a few hundred bytes of code).
- straight N: the same FMAs fully unrolled (16 bytes each: N=2048 is 32 KB, like the split
  kernel).
If "straight" costs microseconds more than "loop" at the same N, cold instruction fetch is a
fixed cost of every launch, and the split kernels (30-115 KB) pay it. Grid: 132 x 128 threads
(one block per SM, as the split kernel at short lengths).
"""

from __future__ import annotations

import numpy as np
from points import cubin_sections

import ferrox_driver as fd
from ferrox_driver.bench_decode import captured, time_events
from ferrox_driver.compiler import compile_source
from ferrox_driver.launch import Module

SOURCE = r"""
#ifndef N
#define N 2048
#endif
extern "C" __global__ void empty_kernel(float*, float) {}

// Eight independent chains so issue, not latency, bounds the time.
#define FX_BODY(UNROLL)                                                        \
    float x[8];                                                                \
    for (int j = 0; j < 8; ++j) x[j] = threadIdx.x + j;                        \
    UNROLL                                                                     \
    for (int i = 0; i < N / 8; ++i) {                                          \
        _Pragma("unroll") for (int j = 0; j < 8; ++j) x[j] = fmaf(x[j], a, 1.f); \
    }                                                                          \
    float s = 0.f;                                                             \
    for (int j = 0; j < 8; ++j) s += x[j];                                     \
    if (s == 12345.f) out[0] = s;

extern "C" __global__ void loop_kernel(float* out, float a) { FX_BODY(_Pragma("unroll 1")) }
extern "C" __global__ void straight_kernel(float* out, float a) { FX_BODY(_Pragma("unroll")) }
"""


def text_sizes(cubin: bytes) -> dict[str, int]:
    """Bytes of machine code per kernel (the ELF's .text.<kernel> sections)."""
    return {
        name[6:]: len(data)
        for name, data in cubin_sections(cubin).items()
        if name.startswith(".text.") and isinstance(data, bytes)
    }


def main() -> None:
    dev = fd.Device(0)
    stream = fd.Stream()
    out = fd.zeros(1, np.float32)
    print(f"{'kernel':<20} {'code B':>8} {'us back to back':>16}")
    split = compile_source(fd.compiler.kernel_source("gqa_decode_split.cu"))
    for name, size in sorted(text_sizes(split.cubin).items()):
        print(f"  (split source) {name:<34} {size:>7} B")
    for n in (256, 2048, 8192):
        prog = compile_source(SOURCE, options=(f"-DN={n}",), name="fixed_cost.cu")
        module = Module(prog, dev)
        for name in ("empty_kernel", "loop_kernel", "straight_kernel"):
            if name == "empty_kernel" and n != 256:
                continue
            kern = module.get_function(name)

            def body() -> None:
                kern.launch(dev.multiprocessor_count, 128, (out, np.float32(0.999)), stream=stream)

            exe = captured(stream, body, 20)
            us = time_events(lambda i: exe.launch(stream), stream, 50, 5, 20)
            exe.close()
            label = name if name == "empty_kernel" else f"{name} N={n}"
            print(f"{label:<20} {text_sizes(prog.cubin)[name]:>8} {us:16.2f}")


if __name__ == "__main__":
    main()
