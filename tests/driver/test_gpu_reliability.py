"""Faults, leaks, finalizers, threads and interpreter exit, on the GPU."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.kernels.catalogue import kernel_source

from ..helpers.gpu_helpers import rel_err

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_out_of_memory_is_a_clear_error_and_the_gpu_stays_usable(device):
    with pytest.raises(fd.CudaError) as info:
        fd.empty((device.total_memory * 2 // 4,), np.float32)
    assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert info.value.call == "cuMemAlloc"
    x = np.arange(1000, dtype=np.float32)
    assert np.array_equal(fd.to_device(x).to_host(), x)


def test_launch_error_names_the_cuda_result():
    src = kernel_source("util.cu")
    kernel = fd.ensure_module_loaded(src, "util.cu", "ferrox_axpy_f32").get_function(
        "ferrox_axpy_f32"
    )
    x = fd.zeros(4, np.float32)
    with pytest.raises(fd.CudaError) as info:
        kernel.launch(1, 4096, (np.float32(1), x, x, np.int64(4)))  # > 1024 threads
    assert info.value.call == "cuLaunchKernel"
    assert info.value.name.startswith("CUDA_ERROR_")


# 10,000 by default; fewer under compute-sanitizer, where each driver call is slow.
CYCLES = int(os.environ.get("FERROX_LEAK_CYCLES", "10000"))
HOST_SLACK = 64 * 2**20  # bytes; leaking each pinned array of the cycles below: 2.5 GiB


def _host_memory():
    """(available system memory, this process's resident memory) in bytes. Pinned host
    memory is locked by the driver, so it leaves MemAvailable whether or not it counts in
    the process's RSS (measured: it does not grow VmSize, mapped in a reserved range)."""
    available = resident = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            resident = int(line.split()[1]) * 1024
    return available, resident


def _leak_check(device, make, cycles):
    """Device bytes lost over ``cycles`` calls of ``make``; host memory (pinned included)
    is checked on the way."""
    for _ in range(3):
        make()
    device.synchronize()
    gc.collect()
    free_before, _ = device.mem_info()
    avail_before, rss_before = _host_memory()
    for _ in range(cycles):
        make()
    device.synchronize()
    gc.collect()
    free_after, _ = device.mem_info()
    avail_after, rss_after = _host_memory()
    assert avail_before - avail_after < HOST_SLACK, "system memory fell (pinned leak?)"
    assert rss_after - rss_before < HOST_SLACK, "resident memory grew"
    return free_before - free_after


def test_the_host_memory_check_sees_a_pinned_leak(device):
    """The check above can fail: 1 GiB of pinned arrays kept alive shows."""
    avail_before, _ = _host_memory()
    kept = [fd.pinned_empty((1 << 22,), np.float32) for _ in range(64)]
    avail_after, _ = _host_memory()
    kept.clear()
    assert avail_before - avail_after > 8 * HOST_SLACK


def _graph_cycle():
    with fd.Stream() as s:
        arr = fd.zeros(16, np.float32)
        with s.capture() as g:
            arr.fill_bytes(0, s)
        exe = g.instantiate()
        exe.launch(s)
        s.synchronize()
        exe.close()
        g.close()
        arr.close()


def _close(obj):
    obj.close()


LEAK_CASES = {
    "device array": (lambda: _close(fd.empty((1 << 20,), np.float32)), CYCLES),
    "pinned array": (lambda: fd.pinned_empty((1 << 16,), np.float32), CYCLES),
    "stream": (lambda: _close(fd.Stream()), CYCLES),
    "event": (lambda: _close(fd.Event()), CYCLES),
    "graph + exec": (_graph_cycle, CYCLES),
    "kv cache": (lambda: _close(fd.KVCache(8, 128, 256, dtype=np.float16)), CYCLES),
}


@pytest.mark.parametrize("kind", list(LEAK_CASES))
def test_create_close_cycles_leave_device_and_host_memory_where_they_were(device, kind):
    make, cycles = LEAK_CASES[kind]
    assert _leak_check(device, make, cycles) < 4 * 2**20


def test_decode_graph_create_close_cycles_do_not_leak(device):
    kv = fd.KVCache(8, 128, 64)

    def make():
        fd.DecodeGraph(kv, n_heads=32).close()

    try:
        assert _leak_check(device, make, CYCLES) < 4 * 2**20
    finally:
        kv.close()


def test_objects_dropped_without_close_are_freed_by_their_finalizers(device):
    gc.collect()
    free_before, _ = device.mem_info()
    arrays = [fd.empty((1 << 26,), np.float32) for _ in range(4)]  # 1 GiB
    assert device.mem_info()[0] < free_before - 2**29
    del arrays
    gc.collect()
    assert device.mem_info()[0] > free_before - 2**26


def test_interpreter_exit_with_live_objects_is_silent():
    code = (
        "import numpy as np, ferrox_driver as fd\n"
        "kv = fd.KVCache(8, 128, 64); g = fd.DecodeGraph(kv, n_heads=32)\n"
        "a = fd.empty(100, np.float32); s = fd.Stream(); e = fd.Event().record(s)\n"
        "p = fd.pinned_empty(10, np.float32)\n"
        "g(np.ones((32, 128), np.float32), np.ones((8, 128), np.float32),"
        " np.ones((8, 128), np.float32))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0
    assert done.stdout == "" and done.stderr == ""


def test_eight_threads_each_with_a_stream_and_cache_decode_concurrently(rng):
    n_heads, n_kv, hd, tokens = 16, 4, 64, 300
    data = [
        (
            rng.standard_normal((tokens, n_kv, hd)).astype(np.float32),
            rng.standard_normal((tokens, n_kv, hd)).astype(np.float32),
            rng.standard_normal((n_heads, hd)).astype(np.float32),
        )
        for _ in range(8)
    ]
    results: dict[int, float] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def worker(i):
        try:
            k, v, q = data[i]
            with fd.KVCache(n_kv, hd, tokens) as kv:
                barrier.wait()
                for t in range(tokens):
                    kv.append(k[t], v[t])
                    if t % 50 == 49 or t == tokens - 1:
                        out = kv.decode(q, n_heads=n_heads)
                        ref = fd.reference_gqa_decode(
                            q, k[: t + 1], v[: t + 1], n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd
                        )
                        results[i] = max(results.get(i, 0.0), rel_err(out, ref))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 8 and max(results.values()) < 1e-5
