"""What PyTorch's work changes that makes combine plans ~1 us slower for the rest of the
process (placement-probe-torch-v13.log: after one SDPA, every 32/8/128 bf16 combine plan
at 512 and 4096 tokens, whatever its workspace's address). Each round times, back to back:
the whole decode, the split kernel alone, the combine alone, the cluster plan, and a chain
of empty kernels, over KV sets allocated one by one; the two plans again over KV sets
carved out of one allocation (`pooled`); between rounds, one PyTorch action from the
command line, and the context's limits and cache configuration when they change.

    PYTHONPATH=. python3 docs/perf-history/mode_probe.py ones mm sdpa ...

Actions: ones (torch.ones), mm (a bf16 matmul), sdpa_math (SDPA on the math backend),
sdpa_flash / sdpa_efficient / sdpa_cudnn (SDPA on one backend), sdpa (SDPA's choice),
eager (FERROX_EARLY_COMBINE off from then on), idle (two seconds' sleep). Each row
starts with the wall clock, to set beside nvidia-smi's clocks.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import numpy as np
from points import Point, points

import ferrox_driver as fd
from ferrox_driver import attention
from ferrox_driver._driver import cu, drv
from ferrox_driver.bench_decode import captured, fill_uniform, time_events
from ferrox_driver.compiler import compile_source
from ferrox_driver.launch import Module

CASES = [((32, 8, 128), "bf16", [512, 4096])]
EMPTY = 'extern "C" __global__ void fx_empty(int* p) { if (p) *p = 0; }'


def context_state() -> str:
    limits = []
    for name in dir(cu.CUlimit):
        if name.startswith("CU_LIMIT_") and name != "CU_LIMIT_MAX":
            err, value = cu.cuCtxGetLimit(getattr(cu.CUlimit, name))
            if err == cu.CUresult.CUDA_SUCCESS:
                limits.append(f"{name[9:].lower()}={value}")
    return f"cache config {drv('cuCtxGetCacheConfig')}; " + " ".join(limits)


def empty_chain(module: Module, stream: fd.Stream, n: int = 64) -> float:
    kernel = module.get_function("fx_empty")
    exe = captured(stream, lambda: kernel.launch(1, 32, (np.uint64(0),), stream=stream), n)
    us = time_events(lambda i: exe.launch(stream), stream, 30, 3, n)
    exe.close()
    return us


def separate_sets(p: Point) -> tuple[list[fd.DeviceArray], Point]:
    """``p`` with KV sets of their own allocation each (filled alike), and those arrays
    (the caller closes them). points() carves its sets out of one allocation since this
    probe (bench_decode.rotated_kv_sets); when the log was taken, they were separate and
    these were the pooled ones."""
    k0 = p.sets[0][0]
    arrays = [fd.empty(k0.shape, k0.dtype) for _ in range(2 * len(p.sets))]
    for i, a in enumerate(arrays):
        fill_uniform(a, 100 + i, p.stream)
    sets = list(zip(arrays[::2], arrays[1::2], strict=True))
    return arrays, dataclasses.replace(p, sets=sets)


def act(name: str) -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "eager":
        attention.EARLY_COMBINE = False
        return
    if name == "idle":
        time.sleep(2)
        return
    if name == "ones":
        torch.ones(1, device="cuda")
    elif name == "mm":
        a = torch.rand(1024, 1024, device="cuda", dtype=torch.bfloat16)
        a @ a
    else:
        q = torch.rand(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        kv = torch.rand(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
        backend = {
            "sdpa_math": SDPBackend.MATH,
            "sdpa_flash": SDPBackend.FLASH_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
            "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        }.get(name)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if backend is None:
            sdpa(q, kv, kv, enable_gqa=True)
        else:
            with sdpa_kernel(backend):
                sdpa(q, kv, kv, enable_gqa=True)
    torch.cuda.synchronize()


def main() -> None:
    stream = fd.Stream()
    module = Module(compile_source(EMPTY, name="fx_empty.cu"))
    state = ""
    for action in ["(none)", *sys.argv[1:]]:
        if action != "(none)":
            act(action)
        now = context_state()
        if now != state:
            print(f"   context: {now}", flush=True)
            state = now
        cells = [f"{time.time():.1f} after {action:14}", f"empty {empty_chain(module, stream):.2f}"]
        for p in points(CASES, stream):
            plan = p.plan(clusters=False)
            arrays, sep = separate_sets(p)
            cells.append(
                f"{p.seq}: both {sep.time(plan):.2f} split {sep.time(plan, parts='main'):.2f} "
                f"combine {sep.time(plan, parts='combine'):.2f} cluster {sep.time(p.plan()):.2f} "
                f"pooled both {p.time(plan):.2f} cluster {p.time(p.plan()):.2f}"
            )
            for a in arrays:
                a.close()
        print(" | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
