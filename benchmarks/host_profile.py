"""Where an eager call's host time goes, piece by piece (32/8/128 at 4096 tokens): each step
of gqa_decode's hot path timed alone, the raw driver calls it makes, and the floors of the
calls that wait for their result (the same GPU work replayed as a graph with no Python
around it). Then cProfile of the whole call.

    python3 benchmarks/host_profile.py [bf16|f16|f32]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from collections.abc import Callable

import numpy as np
import torch  # first: importing it after ferrox's GPU work failed on the H200 image

import ferrox_driver as fd
from ferrox_driver.decode import eager as decode
from ferrox_driver.driver import interop
from ferrox_driver.driver._bindings import cu

DT = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def burst_us(fn: Callable[[], object], sync: Callable[[], None], bursts: int = 20) -> float:
    """Median host microseconds per call over bursts of 200 (synchronized between)."""
    for _ in range(50):
        fn()
    sync()
    times = []
    for _ in range(bursts):
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        times.append((time.perf_counter() - t0) / 200 * 1e6)
        sync()
    return float(np.median(times))


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    tdt = DT[name]
    sync = torch.cuda.synchronize
    q = torch.randn(32, 128, device="cuda", dtype=tdt)
    k = torch.randn(4096, 8, 128, device="cuda", dtype=tdt)
    v = torch.randn(4096, 8, 128, device="cuda", dtype=tdt)
    kw = {"n_heads": 32, "n_kv_heads": 8, "head_dim": 128}
    stream = torch.cuda.current_stream()
    fd.gqa_decode(q, k, v, **kw, stream=stream)
    call = next(reversed(decode._calls.values()))
    record = call.record
    rows: dict[str, float] = {}
    rows["gqa_decode, new output"] = burst_us(
        lambda: fd.gqa_decode(q, k, v, **kw, stream=stream), sync
    )
    rows["  array_ref(torch tensor)"] = burst_us(lambda: interop.array_ref(q, "q"), sync)
    rows["  stream_key(torch stream)"] = burst_us(lambda: fd.driver.stream.stream_key(stream), sync)
    key = next(reversed(decode._calls))
    rows["  key tuple hash + lookup"] = burst_us(lambda: decode._calls.get(tuple(key)), sync)
    rows["  pool.take"] = burst_us(lambda: call.pool.take(call.shape, call.dtype), sync)
    values = (
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        call.pool.take(call.shape, call.dtype).ptr,
        4096,
    )
    rows["  record.run (the launches)"] = burst_us(lambda: record.run(values), sync)
    for launch in record.sequence.launches:
        kind = "cuLaunchKernel" if launch._config is None else "cuLaunchKernelEx"
        rows[f"  {kind} alone ({launch.kernel.name})"] = burst_us(launch, sync)
    ev = fd.Event(timing=False)
    h = cu.CUstream(stream.cuda_stream)
    rows["cuEventRecord"] = burst_us(lambda: cu.cuEventRecord(ev.handle, h), sync)
    pinned = fd.pinned_empty((4096,), np.float16)
    dst = fd.empty((4096,), np.float16)
    src, dptr = pinned.ctypes.data, dst.ptr
    rows["cuMemcpyHtoDAsync 8 KiB pinned"] = burst_us(
        lambda: cu.cuMemcpyHtoDAsync(dptr, src, 8192, h), sync
    )
    rows["cuMemcpyDtoHAsync 8 KiB pinned"] = burst_us(
        lambda: cu.cuMemcpyDtoHAsync(src, dptr, 8192, h), sync
    )
    rows["cuStreamSynchronize (idle)"] = burst_us(lambda: cu.cuStreamSynchronize(h), sync)
    # floors: the GPU work of KVCache.decode and of a DecodeGraph step, with no Python
    npdt = fd.DeviceArray._wrap(0, (1,), call.dtype, call.device, None).dtype
    with fd.KVCache(8, 128, 8192, dtype=npdt) as kv:
        prefill = np.random.default_rng(0).standard_normal((4096, 8, 128)).astype(npdt)
        kv.extend(prefill, prefill)
        qn = np.random.default_rng(1).standard_normal((32, 128)).astype(npdt)
        rows["KVCache.decode(q numpy)"] = burst_us(lambda: kv.decode(qn, n_heads=32), sync, 5)
        dec = kv._decoders[32, "auto"]
        s = fd.Stream()
        with s.capture() as g:
            nbytes = dec.q_dev.nbytes
            cu.cuMemcpyHtoDAsync(dec.q_dev.ptr, dec.q_stage.ctypes.data, nbytes, s.handle)
            fd.gqa_decode_async(dec.q_dev, kv, dec.out_dev, n_heads=32, stream=s)
            cu.cuMemcpyDtoHAsync(dec.out_stage.ctypes.data, dec.out_dev.ptr, nbytes, s.handle)
        exe = g.instantiate()
        rows["  floor: that work as one graph, launch+sync"] = burst_us(
            lambda: (exe.launch(s), s.synchronize()), sync, 5
        )
        kv.clear()
        kv.extend(prefill, prefill)
        step = fd.DecodeGraph(kv, n_heads=32)
        row = prefill[0]
        rows["DecodeGraph step"] = burst_us(lambda: step(qn, row, row), sync, 2)
        gh, sh = step._exec_handle, step._h
        rows["  floor: its graph, cuGraphLaunch+sync"] = burst_us(
            lambda: (cu.cuGraphLaunch(gh, sh), cu.cuStreamSynchronize(sh)), sync, 2
        )
        step.close()
    for label, us in rows.items():
        print(f"  {label:<52} {us:7.2f} us", flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        fd.gqa_decode(q, k, v, **kw, stream=stream)
    prof.disable()
    sync()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
