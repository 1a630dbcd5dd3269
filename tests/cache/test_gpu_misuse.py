"""A careless user on the GPU: every use of a closed object (or of one that depends on a
closed one) is a ClosedError naming it, raised before any driver call; memory a graph
still uses outlives close(); the process and the GPU stay usable after each case."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.driver._bindings import cu
from ferrox_driver.kernels.catalogue import kernel_source

from ..helpers.gpu_helpers import random_decode_inputs, rel_err

pytestmark = pytest.mark.gpu

H, KV, D = 8, 2, 64
KW = {"n_heads": H, "n_kv_heads": KV, "head_dim": D}


@pytest.fixture(autouse=True)
def _gpu_still_works(rng):
    """After each case: a decode on the GPU, eager and from a cache, equals the reference
    (the context is alive and nothing was corrupted)."""
    yield
    q, k, v = random_decode_inputs(rng, H, KV, D, 37, np.float32)
    ref = fd.reference_gqa_decode(q, k, v, **KW)
    assert rel_err(fd.gqa_decode(q, k, v, **KW), ref) < 1e-5
    with fd.KVCache(KV, D, 64) as kv:
        kv.extend(k, v)
        assert rel_err(kv.decode(q, n_heads=H), ref) < 1e-5


def _rows(rng, n):
    k = rng.standard_normal((n, KV, D)).astype(np.float32)
    v = rng.standard_normal((n, KV, D)).astype(np.float32)
    return k, v


def _cache(rng, n=5, **kwargs):
    kv = fd.KVCache(KV, D, 32, **kwargs)
    k, v = _rows(rng, n)
    kv.extend(k, v)
    return kv, k, v


def _closed(what, because=None):
    text = f"this {what} was closed" if because is None else f"this {what} {because}"
    return pytest.raises(fd.ClosedError, match=text)


# -- the cases the issue found -----------------------------------------------------------
def test_a_decode_graph_whose_cache_was_closed(rng):
    kv, _, _ = _cache(rng)
    graph = fd.DecodeGraph(kv, n_heads=H)
    q = rng.standard_normal((H, D)).astype(np.float32)
    k, v = _rows(rng, 1)
    kv.close()
    for call in (lambda: graph(q, k[0], v[0]), graph.launch, graph.synchronize):
        with _closed("DecodeGraph", "uses a KVCache that was closed"):
            call()
    graph.close()
    graph.close()


def test_a_closed_stream(rng):
    s = fd.Stream()
    s.close()
    ev = fd.Event()
    q, k, v = random_decode_inputs(rng, H, KV, D, 9, np.float32)
    q_d, k_d, v_d = (fd.to_device(a) for a in (q, k, v))
    for call in (
        s.synchronize,
        lambda: s.wait(ev),
        s.capture,
        lambda: s.handle,
        s.__cuda_stream__,
        lambda: ev.record(s),
        lambda: fd.gqa_decode(q_d, k_d, v_d, **KW, stream=s),
        lambda: fd.gqa_decode(q, k, v, **KW, stream=s),
        lambda: fd.to_device(q, s),
        lambda: fd.KVCache(KV, D, 8, stream=s),
    ):
        with _closed("Stream"):
            call()
    assert s.closed and "closed" in repr(s)
    s.close()


@pytest.mark.parametrize("op", ["decode", "append", "extend", "clear", "seq_len", "sync"])
def test_a_cache_whose_stream_was_closed(rng, op):
    s = fd.Stream()
    kv, k, v = _cache(rng, stream=s)
    kv.decode(rng.standard_normal((H, D)).astype(np.float32), n_heads=H)
    s.close()
    calls = {
        "decode": lambda: kv.decode(rng.standard_normal((H, D)).astype(np.float32), n_heads=H),
        "append": lambda: kv.append(k[0], v[0]),
        "extend": lambda: kv.extend(k, v),
        "clear": kv.clear,
        "seq_len": lambda: kv.seq_len,
        "sync": kv.synchronize,
    }
    with _closed("KVCache", "runs on a Stream that was closed"):
        calls[op]()
    assert kv.closed
    kv.close()  # frees its memory without touching the destroyed stream


@pytest.mark.parametrize(
    "op",
    ["decode", "append", "extend", "clear", "seq_len", "k", "v", "k_buffer", "to_host",
     "prepare", "sync", "device_length", "append_async", "decode_async", "decode_graph"],
)  # fmt: skip
def test_a_closed_cache(rng, op):
    kv, k, v = _cache(rng)
    q = rng.standard_normal((H, D)).astype(np.float32)
    kv.decode(q, n_heads=H)
    q_d, out_d, k_d = fd.to_device(q), fd.empty((H * D,)), fd.to_device(k[0])
    kv.close()
    calls = {
        "decode": lambda: kv.decode(q, n_heads=H),
        "append": lambda: kv.append(k[0], v[0]),
        "extend": lambda: kv.extend(k, v),
        "clear": kv.clear,
        "seq_len": lambda: kv.seq_len,
        "k": lambda: kv.k,
        "v": lambda: kv.v,
        "k_buffer": lambda: kv.k_buffer,
        "to_host": kv.to_host,
        "prepare": lambda: kv.prepare(H),
        "sync": kv.synchronize,
        "device_length": kv.device_length,
        "append_async": lambda: fd.kv_append_async(kv, k_d, k_d, stream=fd.Stream()),
        "decode_async": lambda: fd.gqa_decode_async(q_d, kv, out_d, n_heads=H, stream=fd.Stream()),
        "decode_graph": lambda: fd.DecodeGraph(kv, n_heads=H),
    }
    with _closed("KVCache"):
        calls[op]()
    assert kv.closed and "closed" in repr(kv)
    kv.close()


def test_a_closed_layer_cache(rng):
    layers = fd.LayerKVCache(2, KV, D, 16)
    first = layers[0]
    layers.close()
    for call in (lambda: layers[0], lambda: len(layers), lambda: iter(layers), layers.clear):
        with _closed("LayerKVCache"):
            call()
    with _closed("KVCache"):
        first.append(*(r[0] for r in _rows(rng, 1)))
    layers.close()


def test_a_closed_array_and_its_views(rng):
    q, k, v = random_decode_inputs(rng, H, KV, D, 9, np.float32)
    k_d = fd.to_device(k)
    view = k_d.view((4, KV, D))
    view_of_view = view.view((2, KV, D))
    q_d, v_d = fd.to_device(q), fd.to_device(v)
    k_d.close()
    for arr, what in ((k_d, None), (view, "view"), (view_of_view, "view")):
        because = None if what is None else "is a view of a DeviceArray that was closed"
        for call in (
            lambda a=arr: a.ptr,
            lambda a=arr: a.to_host(),
            lambda a=arr: a.copy_from_host(np.zeros(a.shape, np.float32)),
            lambda a=arr: a.fill_bytes(0),
            lambda a=arr: a.view((1,)),
            lambda a=arr: a.reshape(a.size),
            lambda a=arr: a.__dlpack__(),
            lambda a=arr: a.__cuda_array_interface__,
        ):
            with _closed("DeviceArray", because):
                call()
        assert arr.closed and "closed" in repr(arr)
        assert arr.shape and arr.nbytes  # the description stays readable
    with _closed("DeviceArray"):
        fd.gqa_decode(q_d, k_d, v_d, **KW)
    with _closed("DeviceArray", "is a view of a DeviceArray that was closed"):
        fd.gqa_decode(q_d, view_of_view, view_of_view, **KW)
    out = fd.empty((H, D))
    out.close()
    with _closed("DeviceArray"):
        fd.gqa_decode(q_d, v_d, v_d, **KW, out=out)
    k_d.close()


def test_closing_a_view_closes_only_the_view(rng):
    a = fd.to_device(np.arange(16, dtype=np.float32))
    view = a.view((4,))
    view.close()
    with _closed("DeviceArray"):
        view.to_host()
    assert np.array_equal(a.to_host(), np.arange(16, dtype=np.float32))


def test_a_closed_decode_graph(rng):
    kv, _, _ = _cache(rng)
    graph = fd.DecodeGraph(kv, n_heads=H)
    graph.close()
    q = rng.standard_normal((H, D)).astype(np.float32)
    k, v = _rows(rng, 1)
    for call in (lambda: graph(q, k[0], v[0]), graph.launch, graph.synchronize):
        with _closed("DecodeGraph"):
            call()
    assert graph.closed
    graph.close()
    assert kv.seq_len == 5  # the cache is untouched and usable
    kv.append(k[0], v[0])
    assert kv.seq_len == 6
    kv.close()


def _captured_decode(rng, kv, s):
    """A graph of kv_append_async + gqa_decode_async captured on ``s``, with its operands."""
    q = rng.standard_normal((H * D,)).astype(np.float32)
    k, v = _rows(rng, 1)
    ops = [fd.to_device(x) for x in (q, k[0].reshape(-1), v[0].reshape(-1))]
    out = fd.empty((H * D,))
    kv.prepare(H)
    with s.capture() as graph:
        fd.kv_append_async(kv, ops[1], ops[2], stream=s)
        fd.gqa_decode_async(ops[0], kv, out, n_heads=H, stream=s)
    exec_ = graph.instantiate()
    graph.close()
    return exec_, ops, out, (q, k, v)


def test_a_closed_graph_exec_and_graph(rng):
    kv, _, _ = _cache(rng)
    s = fd.Stream()
    exec_, _, _, _ = _captured_decode(rng, kv, s)
    exec_.close()
    for call in (lambda: exec_.launch(s), lambda: exec_.handle):
        with _closed("GraphExec"):
            call()
    with s.capture() as graph:
        pass
    graph.close()
    for call in (graph.instantiate, graph.node_count, lambda: graph.keep_alive(1)):
        with _closed("Graph"):
            call()
    exec_.close()
    graph.close()
    s.close()
    kv.close()


def test_an_event_closed(rng):
    start, end = fd.Event().record(), fd.Event().record()
    end.synchronize()
    end.close()
    with _closed("Event"):
        start.elapsed_ms(end)
    for call in (end.record, end.synchronize, end.query, lambda: end.elapsed_ms(start)):
        with _closed("Event"):
            call()
    with _closed("Event"):
        fd.Stream().wait(end)
    assert end.closed
    end.close()
    later = fd.Event().record()
    later.synchronize()
    assert start.elapsed_ms(later) >= 0.0  # the open one still works


def test_a_closed_module_and_its_kernels():
    src = kernel_source("util.cu")
    module = fd.ensure_module_loaded(src, "util.cu", "ferrox_axpy_f32")
    kernel = module.get_function("ferrox_axpy_f32")
    module.close()
    with _closed("Module"):
        module.get_function("ferrox_axpy_f32")
    x = fd.zeros(4, np.float32)
    with _closed("Kernel", r"\(ferrox_axpy_f32\) belongs to a Module that was closed"):
        kernel.launch(1, 4, (np.float32(1), x, x, np.int64(4)))
    fresh = fd.ensure_module_loaded(src, "util.cu", "ferrox_axpy_f32")
    assert fresh is not module and not fresh.closed
    y = fd.to_device(np.ones(4, np.float32))
    fresh.get_function("ferrox_axpy_f32").launch(1, 4, (np.float32(2), y, x, np.int64(4)))
    assert np.array_equal(x.to_host(), np.full(4, 2, np.float32))  # x += 2 * y
    module.close()


def test_a_closed_device(rng):
    dev = fd.Device(0)
    made = fd.to_device(np.arange(8, dtype=np.float32), device=dev)
    dev.close()
    for call in (dev.synchronize, dev.mem_info, lambda: fd.empty((4,), device=dev)):
        with _closed("Device"):
            call()
    # what was made through it lives on in the process's context
    assert np.array_equal(made.to_host(), np.arange(8, dtype=np.float32))
    dev.close()


# -- lifetimes follow use --------------------------------------------------------------
def _raw_launch(exec_, stream):
    """Launch an executable graph as a graph made outside ferrox (PyTorch's, CuPy's)
    would be launched: with no ferrox check in the way."""
    status = cu.cuGraphLaunch(exec_._handle, stream.handle)[0]
    assert status == cu.CUresult.CUDA_SUCCESS, status
    stream.synchronize()


@pytest.mark.alone
def test_closing_what_a_graph_uses_keeps_its_memory_until_the_graph_goes(rng, device):
    s = fd.Stream()
    kv = fd.KVCache(KV, D, 2**19)  # 256 MiB per K and V buffer
    k0, v0 = _rows(rng, 7)
    kv.extend(k0, v0)
    exec_, ops, out, (q, k, v) = _captured_decode(rng, kv, s)
    exec_.launch(s)
    s.synchronize()
    k_all, v_all = np.concatenate([k0, k]), np.concatenate([v0, v])
    ref = fd.reference_gqa_decode(q, k_all, v_all, **KW)
    assert rel_err(out.to_host(), ref) < 1e-5
    device.synchronize()
    gc.collect()
    free_before, _ = device.mem_info()
    kv.close()
    for arr in ops:
        arr.close()
    gc.collect()
    free_closed, _ = device.mem_info()
    assert free_closed - free_before < 2**26  # the 2 x 256 MiB buffers are still there
    # ferrox's own executable refuses to run over what its owners closed...
    with pytest.raises(fd.ClosedError, match=r"this GraphExec uses a (KVCache|DeviceArray)"):
        exec_.launch(s)
    # ...and one launched from elsewhere runs over memory that is still there: it appends
    # its row again (a 9th token) and decodes the 9.
    _raw_launch(exec_, s)
    ref9 = fd.reference_gqa_decode(q, np.concatenate([k_all, k]), np.concatenate([v_all, v]), **KW)
    assert rel_err(out.to_host(), ref9) < 1e-5
    exec_.close()
    del exec_
    gc.collect()
    free_after, _ = device.mem_info()
    assert free_after - free_closed > 2**28  # the buffers went with the graph
    s.close()


def test_a_dlpack_consumer_keeps_the_memory_of_a_closed_array():
    torch = pytest.importorskip("torch")
    a = fd.to_device(np.arange(1 << 20, dtype=np.float32))
    t = torch.from_dlpack(a)
    a.close()
    torch.cuda.synchronize()
    filler = fd.zeros(1 << 20, np.float32)  # would reuse the block were it freed
    assert t[-1].item() == float((1 << 20) - 1) and t.sum().item() == pytest.approx(
        (1 << 20) * ((1 << 20) - 1) / 2, rel=1e-6
    )
    filler.close()


def test_close_twice_and_context_managers_never_raise(rng):
    with fd.Stream() as s, fd.Event() as e, fd.KVCache(KV, D, 8, stream=s) as kv:
        e.record(s)
        kv.append(*(r[0] for r in _rows(rng, 1)))
    for obj in (s, e, kv):
        obj.close()
    assert s.closed and e.closed and kv.closed
