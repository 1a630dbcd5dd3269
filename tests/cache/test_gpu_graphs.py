"""CUDA graphs: capture, DecodeGraph replay per token, async ops inside foreign graphs."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.decode import plan as attention
from ferrox_driver.driver.graph import graph_stats
from ferrox_driver.kernels.catalogue import kernel_source

from ..helpers.gpu_helpers import DTYPES, TOL, rel_err, torch_or_cupy

pytestmark = pytest.mark.gpu

N_HEADS, N_KV, HD = 32, 8, 128


def axpy_kernel():
    src = kernel_source("util.cu")
    return fd.ensure_module_loaded(src, "util.cu", "ferrox_axpy_f32").get_function(
        "ferrox_axpy_f32"
    )


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_decode_graph_matches_reference_and_eager_for_500_tokens_captured_once(rng, dtype):
    dt = DTYPES[dtype]
    steps = 500
    qs = rng.standard_normal((steps, N_HEADS, HD)).astype(dt)
    ks = rng.standard_normal((steps, N_KV, HD)).astype(dt)
    vs = rng.standard_normal((steps, N_KV, HD)).astype(dt)
    with (
        fd.KVCache(N_KV, HD, steps, dtype=dt) as kv_graph,
        fd.KVCache(N_KV, HD, steps, dtype=dt) as kv_eager,
    ):
        with fd.DecodeGraph(kv_graph, n_heads=N_HEADS) as step:
            for t in range(steps):
                if t == 1:  # both graphs (the step's, KVCache.decode's) made by now
                    before = graph_stats.instantiations
                got = step(qs[t], ks[t], vs[t])
                kv_eager.append(ks[t], vs[t])
                eager = kv_eager.decode(qs[t], n_heads=N_HEADS)
                assert np.array_equal(got.view(np.uint8), eager.view(np.uint8)), t
                ref = fd.reference_gqa_decode(
                    qs[t], ks[: t + 1], vs[: t + 1], n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=HD
                )
                assert rel_err(got, ref) < TOL[dtype], t
        assert graph_stats.instantiations == before  # none per token
        assert kv_graph.seq_len == steps


def test_overflow_inside_a_graph_raises_and_leaves_the_cache_intact(rng):
    cap = 16
    k = rng.standard_normal((cap, N_KV, HD)).astype(np.float32)
    v = rng.standard_normal((cap, N_KV, HD)).astype(np.float32)
    with fd.KVCache(N_KV, HD, cap) as kv, fd.DecodeGraph(kv, n_heads=N_HEADS) as step:
        kv.extend(k, v)
        step.q[...] = rng.standard_normal(step.q.shape)
        step.k[...] = 7.0
        step.v[...] = 7.0
        step.launch()  # bypasses the host-side check: the device must refuse
        with pytest.raises(fd.KVCapacityError):
            step.synchronize()
        assert kv.seq_len == cap
        got_k, got_v = kv.to_host()
        assert np.array_equal(got_k, k) and np.array_equal(got_v, v)
        with pytest.raises(fd.KVCapacityError):  # the host-side check
            step(step.q.copy(), step.k.copy(), step.v.copy())
        kv.synchronize()  # the flag was reported once and cleared


def test_async_ops_inside_a_foreign_cuda_graph_give_the_reference_for_100_replays(rng):
    kind, lib = torch_or_cupy()
    steps = 100
    qs = rng.standard_normal((steps, N_HEADS * HD)).astype(np.float32)
    ks = rng.standard_normal((steps, N_KV * HD)).astype(np.float32)
    vs = rng.standard_normal((steps, N_KV * HD)).astype(np.float32)

    def check(t: int, got: np.ndarray) -> None:
        k, v = ks[: t + 1].reshape(-1), vs[: t + 1].reshape(-1)
        ref = fd.reference_gqa_decode(qs[t], k, v, n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=HD)
        assert rel_err(got, ref) < 1e-5, t

    with fd.KVCache(N_KV, HD, steps + 1) as kv:
        if kind == "torch":
            torch = lib
            q_t, k_t, v_t = (
                torch.zeros(n, device="cuda") for n in (N_HEADS * HD, N_KV * HD, N_KV * HD)
            )
            out_t = torch.zeros(N_HEADS * HD, device="cuda")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up: load the kernels outside the capture
                fd.kv_append_async(kv, k_t, v_t, stream=side.cuda_stream)
                fd.gqa_decode_async(q_t, kv, out_t, n_heads=N_HEADS, stream=side.cuda_stream)
            torch.cuda.synchronize()
            kv.clear()
            kv.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                s = torch.cuda.current_stream().cuda_stream
                fd.kv_append_async(kv, k_t, v_t, stream=s)
                fd.gqa_decode_async(q_t, kv, out_t, n_heads=N_HEADS, stream=s)
            for t in range(steps):
                q_t.copy_(torch.from_numpy(qs[t]))
                k_t.copy_(torch.from_numpy(ks[t]))
                v_t.copy_(torch.from_numpy(vs[t]))
                graph.replay()
                check(t, out_t.cpu().numpy())
        else:
            cp = lib
            q_t, k_t, v_t = (cp.zeros(n, cp.float32) for n in (N_HEADS * HD, N_KV * HD, N_KV * HD))
            out_t = cp.zeros(N_HEADS * HD, cp.float32)
            stream = cp.cuda.Stream(non_blocking=True)
            fd.kv_append_async(kv, k_t, v_t, stream=stream.ptr)
            fd.gqa_decode_async(q_t, kv, out_t, n_heads=N_HEADS, stream=stream.ptr)
            stream.synchronize()
            kv.clear()
            kv.synchronize()
            with stream:
                stream.begin_capture()
                fd.kv_append_async(kv, k_t, v_t, stream=stream.ptr)
                fd.gqa_decode_async(q_t, kv, out_t, n_heads=N_HEADS, stream=stream.ptr)
                graph = stream.end_capture()
            for t in range(steps):
                q_t.set(qs[t], stream=stream)
                k_t.set(ks[t], stream=stream)
                v_t.set(vs[t], stream=stream)
                graph.launch(stream)
                check(t, out_t.get(stream=stream))
        assert kv.seq_len == steps


def test_exception_inside_capture_ends_it_and_leaves_the_stream_usable(rng):
    kernel = axpy_kernel()
    x = fd.to_device(np.ones(1024, np.float32))
    y = fd.to_device(np.zeros(1024, np.float32))
    with fd.Stream() as stream:
        with pytest.raises(RuntimeError, match="boom"), stream.capture():
            kernel.launch(4, 256, (np.float32(1), x, y, np.int64(1024)), stream=stream)
            raise RuntimeError("boom")
        kernel.launch(4, 256, (np.float32(2), x, y, np.int64(1024)), stream=stream)
        stream.synchronize()
        assert (y.to_host(stream) == 2).all()  # the captured launch never ran


def test_garbage_collected_inside_a_capture_is_freed_after_it_not_during_it():
    """A finalizer run by the garbage collector inside a capture (a device array, a module
    and a stream caught in reference cycles) must not free during the capture: cuMemFree or
    cuModuleUnload there would invalidate it. They are freed when the capture ends."""
    kernel = axpy_kernel()
    x = fd.to_device(np.ones(256, np.float32))
    y = fd.zeros(256, np.float32)
    gc.collect()
    gc.disable()  # only the collect() below may collect
    try:
        junk: list = [fd.empty((1 << 20,), np.float32), fd.Stream()]
        junk.append(fd.Module(fd.compile_source(kernel_source("util.cu"), name="util.cu")))
        junk.append(junk)  # a cycle: only the collector frees it
        freed = [weakref.ref(obj) for obj in junk[:3]]
        free_before = fd.Device(0).mem_info()[0]
        del junk
        with fd.Stream() as stream:
            with stream.capture() as graph:
                kernel.launch(1, 256, (np.float32(1), x, y, np.int64(256)), stream=stream)
                assert gc.collect() > 0
                assert all(ref() is None for ref in freed)  # collected, release held back
                kernel.launch(1, 256, (np.float32(2), x, y, np.int64(256)), stream=stream)
            free_after = fd.Device(0).mem_info()[0]
            exe = graph.instantiate()
            exe.launch(stream)
            stream.synchronize()
            assert (y.to_host() == 3).all()
            exe.close()
            graph.close()
    finally:
        gc.enable()
    assert free_after >= free_before + (1 << 22) - (1 << 20)  # the 4 MiB came back


def test_captured_graph_replays_and_updates_in_place(rng):
    kernel = axpy_kernel()
    x = fd.to_device(np.ones(256, np.float32))
    y = fd.zeros(256, np.float32)
    with fd.Stream() as stream:
        with stream.capture() as g1:
            kernel.launch(1, 256, (np.float32(1), x, y, np.int64(256)), stream=stream)
        with stream.capture() as g2:
            kernel.launch(1, 256, (np.float32(10), x, y, np.int64(256)), stream=stream)
        with stream.capture() as g3:
            kernel.launch(1, 256, (np.float32(1), x, y, np.int64(256)), stream=stream)
            kernel.launch(1, 256, (np.float32(1), x, y, np.int64(256)), stream=stream)
        assert g3.node_count() == 2
        exe = g1.instantiate()
        exe.launch(stream)
        exe.launch(stream)
        exe.update(g2)
        exe.launch(stream)
        stream.synchronize()
        assert (y.to_host() == 12).all()
        with pytest.raises(fd.CudaError, match="cuGraphExecUpdate") as info:
            exe.update(g3)
        assert info.value.name == "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE"
        assert "TOPOLOGY_CHANGED" in str(info.value)
        exe.close()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_decode_captured_at_seq_len_one_stays_correct_as_the_cache_grows(rng, dtype):
    dt = DTYPES[dtype]
    cap = 3000
    k = rng.standard_normal((cap, N_KV, HD)).astype(dt)
    v = rng.standard_normal((cap, N_KV, HD)).astype(dt)
    q = rng.standard_normal((N_HEADS, HD)).astype(dt)
    with fd.KVCache(N_KV, HD, cap, dtype=dt) as kv, fd.Stream() as stream:
        kv.extend(k[:1], v[:1])
        kv.synchronize()
        q_d = fd.to_device(q)
        out = fd.empty((N_HEADS, HD), dt)
        fd.gqa_decode_async(q_d, kv, out, n_heads=N_HEADS, stream=stream)  # loads kernels
        stream.synchronize()
        with stream.capture() as graph:
            fd.gqa_decode_async(q_d, kv, out, n_heads=N_HEADS, stream=stream)
        exe = graph.instantiate()
        for seq in [1, 63, 64, 65, 200, 1000, 2999, 3000]:
            kv.extend(k[kv.seq_len : seq], v[kv.seq_len : seq])
            kv.synchronize()
            out.fill_bytes(0xFF)
            exe.launch(stream)
            stream.synchronize()
            ref = fd.reference_gqa_decode(
                q, k[:seq], v[:seq], n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=HD
            )
            assert rel_err(out.to_host(), ref) < TOL[dtype], seq
        exe.close()


def _forget_records():
    """Drop every launch record and validated call, as an LRU full of other shapes would."""
    from ferrox_driver.decode import eager as decode
    from ferrox_driver.decode import records

    records.store.clear()
    decode._calls.clear()
    decode._families.clear()


def _record_of(qd, kd, vd, out, stream):
    from ferrox_driver.decode import records

    return records.decode_record(
        qd, kd, vd, out, n_heads=N_HEADS, n_kv_heads=N_KV, head_dim=HD,
        seq_len=kd.shape[0], stream=stream, plan_seq=records.length_bound(kd.shape[0]),
    )  # fmt: skip


def assert_replay_writes_only_its_own_memory(exe, stream, out, q, k, v, scratch_size):
    """Replay ``exe`` (a bf16 decode of q, k, v into ``out``) on ``stream`` after allocating
    eight arrays of the scratch's size: were the scratch it writes freed, they could take
    its memory and the replay would overwrite them."""
    kw = {"n_heads": N_HEADS, "n_kv_heads": N_KV, "head_dim": HD}
    others = [fd.to_device(np.full(scratch_size, 7.0, np.float32)) for _ in range(8)]
    out.fill_bytes(0xFF, stream)
    exe.launch(stream)
    got = out.to_host(stream)
    assert rel_err(got, fd.reference_gqa_decode(q, k, v, **kw)) < TOL["bf16"]
    for arr in others:
        assert (arr.to_host() == 7.0).all()


def test_a_graph_keeps_its_decode_scratch_after_the_record_and_stream_are_gone(rng, monkeypatch):
    """The graph's combine kernel reads the partials its split kernel wrote to the launch
    record's scratch: with the record dropped from the LRU and the stream closed, that
    scratch must live on with the graph (were it freed, the arrays allocated next could
    take its memory and the replay would write into them), and go with it."""
    monkeypatch.setattr(attention, "OVERRIDES", attention.Overrides(wide=False))
    dt = DTYPES["bf16"]
    kw = {"n_heads": N_HEADS, "n_kv_heads": N_KV, "head_dim": HD}
    q = rng.standard_normal((N_HEADS, HD)).astype(dt)
    k, v = (rng.standard_normal((4096, N_KV, HD)).astype(dt) for _ in range(2))
    qd, kd, vd = fd.to_device(q), fd.to_device(k), fd.to_device(v)
    out = fd.empty((N_HEADS, HD), dt)
    stream = fd.Stream()
    fd.gqa_decode(qd, kd, vd, out=out, stream=stream, **kw)  # the record made outside
    stream.synchronize()
    record = _record_of(qd, kd, vd, out, stream)
    assert record.workspace is not None  # the combine kernel runs: partials in scratch
    with stream.capture() as graph:
        fd.gqa_decode(qd, kd, vd, out=out, stream=stream, **kw)
    exe = graph.instantiate()
    graph.close()
    ws, size = weakref.ref(record.workspace), record.workspace.size
    del record
    _forget_records()
    stream.close()
    gc.collect()
    assert ws() is not None  # the executable graph holds it
    with fd.Stream() as replay:
        assert_replay_writes_only_its_own_memory(exe, replay, out, q, k, v, size)
    exe.close()
    gc.collect()
    assert ws() is None  # and only it: gone with the graph


def test_a_dropped_record_frees_its_scratch(rng, monkeypatch):
    monkeypatch.setattr(attention, "OVERRIDES", attention.Overrides(cluster=False))
    dt = DTYPES["bf16"]
    kw = {"n_heads": N_HEADS, "n_kv_heads": N_KV, "head_dim": HD}
    q = fd.to_device(rng.standard_normal((N_HEADS, HD)).astype(dt))
    k, v = (fd.to_device(rng.standard_normal((64, N_KV, HD)).astype(dt)) for _ in range(2))
    with fd.Stream() as stream:
        out = fd.gqa_decode(q, k, v, stream=stream, **kw)
        ws = weakref.ref(_record_of(q, k, v, out, stream).workspace)
        stream.synchronize()
        _forget_records()
        gc.collect()
        assert ws() is None


def test_a_decode_merged_on_chip_needs_no_scratch(rng):
    from ferrox_driver.decode.launches import plan_split

    dt = DTYPES["bf16"]
    kw = {"n_heads": N_HEADS, "n_kv_heads": N_KV, "head_dim": HD}
    assert plan_split(fd.Device(0), dt, N_HEADS, N_KV, HD, 64).cluster  # compute capability 9.0
    q = rng.standard_normal((N_HEADS, HD)).astype(dt)
    k, v = (rng.standard_normal((64, N_KV, HD)).astype(dt) for _ in range(2))
    with fd.Stream() as stream:
        qd, kd, vd = fd.to_device(q), fd.to_device(k), fd.to_device(v)
        out = fd.empty((N_HEADS, HD), dt)
        out.fill_bytes(0xFF, stream)
        fd.gqa_decode(qd, kd, vd, out=out, stream=stream, **kw)
        assert rel_err(out.to_host(stream), fd.reference_gqa_decode(q, k, v, **kw)) < TOL["bf16"]
        assert _record_of(qd, kd, vd, out, stream).workspace is None


def test_a_first_decode_inside_a_capture_gives_a_working_graph_or_a_clear_error(rng, monkeypatch):
    monkeypatch.setattr(attention, "OVERRIDES", attention.Overrides(cluster=False))
    dt = DTYPES["bf16"]
    q = rng.standard_normal((N_HEADS, HD)).astype(dt)
    k, v = (rng.standard_normal((64, N_KV, HD)).astype(dt) for _ in range(2))
    k_big, v_big = (rng.standard_normal((4096, N_KV, HD)).astype(dt) for _ in range(2))
    kw = {"n_heads": N_HEADS, "n_kv_heads": N_KV, "head_dim": HD}
    ref = fd.reference_gqa_decode(q, k_big, v_big, **kw)
    with fd.Stream() as stream:
        qd, kd, vd = fd.to_device(q), fd.to_device(k), fd.to_device(v)
        kd_big, vd_big = fd.to_device(k_big), fd.to_device(v_big)
        out = fd.empty((N_HEADS, HD), dt)
        fd.gqa_decode(qd, kd, vd, out=out, stream=stream, **kw)  # kernels loaded
        stream.synchronize()
        try:
            with stream.capture() as graph:
                fd.gqa_decode(qd, kd_big, vd_big, out=out, stream=stream, **kw)
        except fd.FerroxError as exc:
            assert "inside a capture" in str(exc)
        else:  # the driver allowed the allocation: then the graph must work
            exe = graph.instantiate()
            graph.close()
            out.fill_bytes(0xFF, stream)
            exe.launch(stream)
            assert rel_err(out.to_host(stream), ref) < TOL["bf16"]
            exe.close()
        # either way the stream works and a decode there is right
        out.fill_bytes(0xFF, stream)
        fd.gqa_decode(qd, kd_big, vd_big, out=out, stream=stream, **kw)
        assert rel_err(out.to_host(stream), ref) < TOL["bf16"]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_a_layer_decode_graph_steps_every_layer_of_a_token_in_one_graph(rng, dtype):
    dt, n_layers, steps = DTYPES[dtype], 4, 70
    ks = rng.standard_normal((steps, n_layers, N_KV, HD)).astype(dt)
    vs = rng.standard_normal((steps, n_layers, N_KV, HD)).astype(dt)
    dims = {"n_heads": N_HEADS, "n_kv_heads": N_KV, "head_dim": HD}
    with (
        fd.LayerKVCache(n_layers, N_KV, HD, steps, dtype=dt) as layers,
        fd.LayerDecodeGraph(layers, n_heads=N_HEADS, sliding_window=50) as step,
    ):
        for t in range(steps):
            q = rng.standard_normal((n_layers, N_HEADS, HD)).astype(dt)
            step.out.fill(np.nan)  # (the graph writes every element)
            out = step(q, ks[t], vs[t])
            assert out.shape == (n_layers, N_HEADS, HD)
            if t in (0, 1, 49, 50, steps - 1):
                for i in range(n_layers):
                    k_ref, v_ref = (np.ascontiguousarray(a[: t + 1, i]) for a in (ks, vs))
                    ref = fd.reference_gqa_decode(q[i], k_ref, v_ref, sliding_window=50, **dims)
                    assert rel_err(out[i], ref) < TOL[dtype], (t, i)
        for i in range(n_layers):
            assert layers[i].seq_len == steps
            k_host, v_host = layers[i].to_host()
            np.testing.assert_array_equal(k_host, ks[:, i])
            np.testing.assert_array_equal(v_host, vs[:, i])
        q = np.zeros((n_layers, N_HEADS, HD), dt)
        with pytest.raises(fd.KVCapacityError):
            step(q, ks[0], vs[0])
        assert [layer.seq_len for layer in layers] == [steps] * n_layers
        with pytest.raises(TypeError, match="q: expected a numpy array of"):
            step(q[:2], ks[0], vs[0])
    with pytest.raises(fd.ClosedError):
        step(q, ks[0], vs[0])
