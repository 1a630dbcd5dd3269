"""What each building block of an eager call costs the host, in microseconds per call: the
driver calls through cuda.bindings (a launch with a pre-packed argument block, a launch with
a cluster configuration, a one-row copy, an event record, a capture query, a pointer query)
and the reads of a torch tensor's pointer, shape, dtype and device. Lower bounds for the
entry points that ``bench --only host`` times.

    python3 benchmarks/host_primitives.py
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable

import numpy as np
import torch  # first: importing it after ferrox's GPU work failed on the H200 image

import ferrox_driver as fd
from ferrox_driver.driver._bindings import cu
from ferrox_driver.kernels.catalogue import get_kernel

N = 20000


def per_call(fn: Callable[[], object], sync: Callable[[], None], n: int = N) -> float:
    """The fastest burst's host microseconds per call: bursts of 200, a synchronize between
    them not counted, so the GPU's queue never fills and the time is the host's."""
    for _ in range(100):
        fn()
    sync()
    best = float("inf")
    for _ in range(max(n // 200, 1)):
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        best = min(best, (time.perf_counter() - t0) / 200 * 1e6)
        sync()
    return best


def main() -> None:
    dev = fd.Device(0)
    stream = fd.Stream(dev)
    h = stream.handle
    sync = stream.synchronize
    noop = get_kernel("util.cu", "ferrox_noop", dev)
    f = noop.handle
    slots = (ctypes.c_uint64 * 8)()
    ptrs = (ctypes.c_void_p * 8)(*[ctypes.addressof(slots) + 8 * i for i in range(8)])
    addr = ctypes.addressof(ptrs)
    rows: dict[str, float] = {}
    rows["cuLaunchKernel (packed args)"] = per_call(
        lambda: cu.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, h, addr, 0), sync
    )
    config = noop._ex_config((2, 1, 1), (32, 1, 1), 0, h, 2, False)
    rows["cuLaunchKernelEx (cluster of 2)"] = per_call(
        lambda: cu.cuLaunchKernelEx(config, f, addr, 0), sync
    )
    rows["Kernel.launch (ferrox, 1 arg)"] = per_call(
        lambda: noop.launch(1, 32, (np.int32(1),), stream=stream), sync
    )
    pinned = fd.pinned_empty((2048,), np.float32)
    dst = fd.empty((2048,), np.float32)
    src_addr, dst_ptr = pinned.ctypes.data, dst.ptr
    rows["cuMemcpyHtoDAsync 2 KiB pinned"] = per_call(
        lambda: cu.cuMemcpyHtoDAsync(dst_ptr, src_addr, 2048, h), sync
    )
    page = np.zeros(512, np.float32)
    page_addr = page.ctypes.data
    rows["cuMemcpyHtoDAsync 2 KiB pageable"] = per_call(
        lambda: cu.cuMemcpyHtoDAsync(dst_ptr, page_addr, 2048, h), sync
    )
    ev = fd.Event(timing=False)
    evh = ev.handle
    rows["cuEventRecord"] = per_call(lambda: cu.cuEventRecord(evh, h), sync)
    rows["cuStreamIsCapturing"] = per_call(lambda: cu.cuStreamIsCapturing(h), sync)
    attr = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
    rows["cuPointerGetAttribute (ordinal)"] = per_call(
        lambda: cu.cuPointerGetAttribute(attr, dst_ptr), sync
    )
    rows["cuStreamSynchronize (idle)"] = per_call(lambda: cu.cuStreamSynchronize(h), sync)
    rows["cuCtxGetCurrent"] = per_call(cu.cuCtxGetCurrent, sync)
    t = torch.empty(32, 128, device="cuda", dtype=torch.bfloat16)
    rows["tensor.data_ptr()"] = per_call(t.data_ptr, sync)
    rows["tensor.shape"] = per_call(lambda: t.shape, sync)
    rows["tensor.dtype"] = per_call(lambda: t.dtype, sync)
    rows["tensor.is_contiguous()"] = per_call(t.is_contiguous, sync)
    rows["tensor.get_device()"] = per_call(t.get_device, sync)
    rows["tensor.device.index"] = per_call(lambda: t.device.index, sync)
    th = t.half()
    rows["tensor.__cuda_array_interface__ (fp16)"] = per_call(
        lambda: th.__cuda_array_interface__, sync, 2000
    )
    rows["tensor.__dlpack__()"] = per_call(t.__dlpack__, sync, 2000)
    s = torch.cuda.current_stream()
    rows["torch current_stream().cuda_stream"] = per_call(
        lambda: torch.cuda.current_stream().cuda_stream, sync
    )
    rows["stream.cuda_stream"] = per_call(lambda: s.cuda_stream, sync)
    a = fd.empty((32, 128), np.float16)
    rows["fd.empty (driver alloc + free)"] = per_call(
        lambda: fd.empty((32, 128), np.float16), sync, 2000
    )
    rows["DeviceArray.view"] = per_call(lambda: a.view((32, 128)), sync)
    for name, us in rows.items():
        print(f"  {name:<42} {us:7.2f} us")


if __name__ == "__main__":
    main()
