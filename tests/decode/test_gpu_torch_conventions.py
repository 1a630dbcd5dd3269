"""On the GPU, a PyTorch user's conventions: work on torch's current stream without
``stream=`` (a side stream whose inputs arrive late, a torch.cuda.graph capture),
``device=`` as an int, a torch.device or "cuda:N", KVCache appends and decodes of torch
tensors, SDPA's shapes, and the attention shape read from the arrays; each result
against the float64 reference (outputs poisoned, inputs fresh)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.errors import FerroxError

from ..helpers.gpu_helpers import DTYPES, TOL, rel_err

pytestmark = pytest.mark.gpu

LATE = 200_000_000  # GPU cycles torch.cuda._sleep keeps a stream busy (~0.1 s)


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    assert torch.cuda.is_available(), "these tests need a CUDA build of PyTorch"
    return torch


def tdtype(torch, name):
    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[name]


def pair(torch, rng, shape, dtype, scale=1.0):
    """A fresh random CUDA tensor and the same values as numpy (ml_dtypes for bf16)."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    t = torch.from_numpy(x).to("cuda").to(tdtype(torch, dtype))
    return t, t.float().cpu().numpy().astype(DTYPES[dtype])


def host(t):
    """A tensor's values as float64 numpy (waits on the current stream)."""
    return t.double().cpu().numpy()


# -- stream=None: torch's current stream ---------------------------------------------------


def test_gqa_decode_inside_a_torch_stream_waits_for_the_inputs_written_there(torch, rng):
    n_heads, n_kv, hd, seq = 32, 8, 128, 3000
    tensors = [pair(torch, rng, s, "f16") for s in ((n_heads, hd), (seq, n_kv, hd),
                                                    (seq, n_kv, hd))]  # fmt: skip
    ref = fd.reference_gqa_decode(*(a for _, a in tensors))
    pinned = [t.cpu().pin_memory() for t, _ in tensors]
    inputs = [torch.full_like(t, float("nan")) for t, _ in tensors]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fd.gqa_decode(*inputs)  # warm-up: kernels and this stream's launch record
    side.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(LATE)  # the inputs arrive late on side
        for dst, src in zip(inputs, pinned, strict=True):
            dst.copy_(src, non_blocking=True)
        out = fd.gqa_decode(*inputs)  # no stream=: side (the legacy stream would not wait)
        got = torch.from_dlpack(out).clone()  # on side, after the decode
    side.synchronize()
    assert rel_err(host(got), ref) < TOL["f16"]


def test_a_torch_graph_captures_gqa_decode_called_without_a_stream(torch, rng):
    n_heads, n_kv, hd, seq = 16, 4, 128, 1000
    q_t = torch.zeros(n_heads, hd, dtype=torch.bfloat16, device="cuda")
    k_t = torch.zeros(seq, n_kv, hd, dtype=torch.bfloat16, device="cuda")
    v_t = torch.zeros_like(k_t)
    out = torch.empty_like(q_t)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fd.gqa_decode(q_t, k_t, v_t, out=out)  # warm-up on the capture stream
    side.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fd.gqa_decode(q_t, k_t, v_t, out=out)  # captured: it runs on side
    for _ in range(3):
        (q, qn), (k, kn), (v, vn) = (pair(torch, rng, t.shape, "bf16") for t in (q_t, k_t, v_t))
        q_t.copy_(q), k_t.copy_(k), v_t.copy_(v)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(host(out), fd.reference_gqa_decode(qn, kn, vn)) < TOL["bf16"]


def test_a_torch_graph_captures_kv_cache_appends_and_decodes_on_its_stream(torch, rng):
    n_heads, n_kv, hd = 16, 4, 64
    with fd.KVCache(n_kv, hd, 64, dtype="bf16") as kv:
        kv.prepare(n_heads)
        kv.synchronize()  # (the length's update is queued on the cache's stream)
        q_t = torch.zeros(1, n_heads, 1, hd, dtype=torch.bfloat16, device="cuda")
        k_t = torch.zeros(n_kv, hd, dtype=torch.bfloat16, device="cuda")
        v_t = torch.zeros_like(k_t)
        out = torch.empty_like(q_t)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on the capture stream, then forgotten
            fd.kv_append_async(kv, k_t, v_t, stream=None)
            fd.gqa_decode_async(q_t, kv, out, stream=None)  # n_heads: q's size
        side.synchronize()
        kv.clear()
        kv.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            fd.kv_append_async(kv, k_t, v_t, stream=None)
            fd.gqa_decode_async(q_t, kv, out, stream=None)
        ks, vs = [], []
        for _ in range(4):
            (q, qn), (k, kn), (v, vn) = (pair(torch, rng, t.shape, "bf16") for t in (q_t, k_t, v_t))
            q_t.copy_(q), k_t.copy_(k), v_t.copy_(v)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            ks.append(kn)
            vs.append(vn)
            ref = fd.reference_gqa_decode(qn, np.stack(ks), np.stack(vs))
            assert ref.shape == (1, n_heads, 1, hd)
            assert rel_err(host(out), ref) < TOL["bf16"]
        assert kv.seq_len == 4


def test_kv_append_async_without_a_stream_waits_for_rows_written_on_torchs_stream(torch, rng):
    n_kv, hd = 4, 64
    with fd.KVCache(n_kv, hd, 8, dtype="f16") as kv:
        k_t = torch.full((n_kv, hd), float("nan"), dtype=torch.float16, device="cuda")
        v_t = torch.full_like(k_t, float("nan"))
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            fd.kv_append_async(kv, k_t, v_t, stream=None)  # warm-up: the append kernel
        side.synchronize()
        kv.clear()
        kv.synchronize()
        (k, kn), (v, vn) = pair(torch, rng, (n_kv, hd), "f16"), pair(torch, rng, (n_kv, hd), "f16")
        k_pin, v_pin = k.cpu().pin_memory(), v.cpu().pin_memory()
        with torch.cuda.stream(side):
            torch.cuda._sleep(LATE)
            k_t.copy_(k_pin, non_blocking=True)
            v_t.copy_(v_pin, non_blocking=True)
            fd.kv_append_async(kv, k_t, v_t, stream=None)
        side.synchronize()
        got_k, got_v = kv.to_host()
        np.testing.assert_array_equal(got_k, kn[None])
        np.testing.assert_array_equal(got_v, vn[None])


# -- device= -------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["int", "str", "str0", "torch", "torch0"])
def test_device_takes_an_int_a_torch_device_or_a_cuda_string(torch, rng, form):
    device = {"int": 0, "str": "cuda", "str0": "cuda:0", "torch": torch.device("cuda"),
              "torch0": torch.device("cuda", 0)}[form]  # fmt: skip
    q = rng.standard_normal((8, 64)).astype(np.float32)
    k, v = (rng.standard_normal((50, 2, 64)).astype(np.float32) for _ in range(2))
    got = fd.gqa_decode(q, k, v, device=device)
    assert rel_err(got, fd.reference_gqa_decode(q, k, v)) < TOL["f32"]
    with fd.KVCache(2, 64, 64, device=device) as kv:
        assert kv.device.ordinal == 0
        kv.extend(k, v)
        assert rel_err(kv.decode(q), fd.reference_gqa_decode(q, k, v)) < TOL["f32"]
    with fd.LayerKVCache(2, 2, 64, 8, device=device) as layers:
        assert layers.device.ordinal == 0
    with fd.Stream(device) as s:
        arr = fd.to_device(q, s, device=device)
        np.testing.assert_array_equal(arr.to_host(s), q)
    assert fd.empty((3,), device=device).device.ordinal == 0


# -- KVCache of torch tensors --------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_a_kv_cache_takes_torch_rows_and_a_torch_q(torch, rng, dtype):
    n_heads, n_kv, hd, prefill = 16, 4, 128, 300
    with fd.KVCache(n_kv, hd, 512, dtype=DTYPES[dtype]) as kv:
        (k_t, k), (v_t, v) = (pair(torch, rng, (prefill, n_kv, hd), dtype) for _ in range(2))
        kv.extend(k_t, v_t)  # device to device
        ks, vs = [k], [v]
        for i in range(4):  # torch rows (SDPA's one-token shape among them) and numpy ones
            shape = (1, n_kv, 1, hd) if i % 2 else (n_kv, hd)
            (kr_t, kr), (vr_t, vr) = (pair(torch, rng, shape, dtype) for _ in range(2))
            if i == 2:
                kv.append(kr, vr)
            else:
                kv.append(kr_t, vr_t)
            ks.append(kr.reshape(1, n_kv, hd))
            vs.append(vr.reshape(1, n_kv, hd))
        k_all, v_all = np.concatenate(ks), np.concatenate(vs)
        got_k, got_v = kv.to_host()
        np.testing.assert_array_equal(got_k, k_all)  # the copies are exact
        np.testing.assert_array_equal(got_v, v_all)
        q_t, q = pair(torch, rng, (1, n_heads, 1, hd), dtype)
        out = kv.decode(q_t)  # n_heads from q's shape
        assert isinstance(out, fd.DeviceArray) and out.shape == (1, n_heads, 1, hd)
        assert out.dtype == DTYPES[dtype]
        got = torch.from_dlpack(out)
        assert got.shape == q_t.shape
        ref = fd.reference_gqa_decode(q, k_all, v_all)
        assert rel_err(host(got), ref) < TOL[dtype]
        assert rel_err(kv.decode(q).astype(np.float64), ref) < TOL[dtype]  # numpy, no n_heads


def test_kv_cache_device_calls_wait_for_torchs_stream_and_it_for_them(torch, rng):
    n_heads, n_kv, hd = 8, 2, 64
    with fd.KVCache(n_kv, hd, 16, dtype="f16") as kv:
        k_t = torch.full((n_kv, hd), float("nan"), dtype=torch.float16, device="cuda")
        v_t = torch.full_like(k_t, float("nan"))
        q_t = torch.full((n_heads, hd), float("nan"), dtype=torch.float16, device="cuda")
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # warm-up (kernels, records), then forgotten
            kv.append(k_t, v_t)
            kv.decode(q_t)
        side.synchronize()
        kv.clear()
        (k, kn), (v, vn), (q, qn) = (pair(torch, rng, t.shape, "f16") for t in (k_t, v_t, q_t))
        pinned = [x.cpu().pin_memory() for x in (k, v, q)]
        with torch.cuda.stream(side):
            torch.cuda._sleep(LATE)  # the rows and q arrive late on side
            for dst, src in zip((k_t, v_t, q_t), pinned, strict=True):
                dst.copy_(src, non_blocking=True)
            kv.append(k_t, v_t)
            out = kv.decode(q_t)
            got = torch.from_dlpack(out).clone()  # on side: after the decode
        side.synchronize()
        ref = fd.reference_gqa_decode(qn, kn[None], vn[None])
        assert rel_err(host(got), ref) < TOL["f16"]


def test_a_kv_cache_decode_of_a_torch_q_takes_the_features(torch, rng):
    n_heads, n_kv, hd, seq = 16, 4, 64, 200
    with fd.KVCache(n_kv, hd, 256, dtype="bf16") as kv:
        (k_t, k), (v_t, v) = (pair(torch, rng, (seq, n_kv, hd), "bf16") for _ in range(2))
        kv.extend(k_t, v_t)
        q_t, q = pair(torch, rng, (n_heads, hd), "bf16")
        sinks = rng.standard_normal(n_heads).astype(np.float32)
        kw = dict(sliding_window=64, logits_soft_cap=20.0, return_lse=True)
        out, lse = kv.decode(q_t, sinks=sinks, **kw)
        ref, ref_lse = fd.reference_gqa_decode(q, k, v, sinks=sinks, **kw)
        assert rel_err(host(torch.from_dlpack(out)), ref) < TOL["bf16"]
        np.testing.assert_allclose(lse.to_host(), ref_lse, rtol=1e-3, atol=1e-3)
        sinks_t = torch.from_numpy(sinks).to("cuda")  # a device array works as well
        out = kv.decode(q_t, sinks=sinks_t, sliding_window=64, logits_soft_cap=20.0)
        assert rel_err(host(torch.from_dlpack(out)), ref) < TOL["bf16"]


def test_an_fp8_cache_quantizes_torch_rows_on_the_device(torch, rng):
    n_heads, n_kv, hd, n = 16, 4, 64, 33
    fmt = ml_dtypes.float8_e4m3fn
    k_scale = rng.uniform(0.01, 0.05, n_kv).astype(np.float32)
    with fd.KVCache(n_kv, hd, 64, dtype=fmt, k_scale=k_scale, v_scale=0.02) as kv:
        assert kv.dtype_name == "e4m3"
        (k_t, k), (v_t, v) = (pair(torch, rng, (n, n_kv, hd), "bf16") for _ in range(2))
        kv.extend(k_t[:-1], v_t[:-1])
        kv.append(k_t[-1], v_t[-1])
        got_k, got_v = kv.to_host()
        want_k, want_v = fd.quantize_fp8(k, fmt, k_scale), fd.quantize_fp8(v, fmt, 0.02)
        np.testing.assert_array_equal(got_k.view(np.uint8), want_k.view(np.uint8))
        np.testing.assert_array_equal(got_v.view(np.uint8), want_v.view(np.uint8))
        q_t, q = pair(torch, rng, (n_heads, hd), "bf16")
        out = kv.decode(q_t)
        ref = fd.reference_gqa_decode(q, *kv.dequantized())
        assert rel_err(host(torch.from_dlpack(out)), ref) < 1e-2


def test_kv_cache_device_calls_inside_a_torch_capture_name_the_capturable_calls(torch):
    n_kv, hd = 2, 64
    with fd.KVCache(n_kv, hd, 8, dtype="f16") as kv:
        k_t = torch.zeros(n_kv, hd, dtype=torch.float16, device="cuda")
        q_t = torch.zeros(8, hd, dtype=torch.float16, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        appending = pytest.raises(FerroxError, match=r"KVCache.append .* fd.kv_append_async")
        with appending, torch.cuda.graph(graph, stream=side):
            kv.append(k_t, k_t)
        graph = torch.cuda.CUDAGraph()
        decoding = pytest.raises(FerroxError, match=r"KVCache.decode .* fd.gqa_decode_async")
        with decoding, torch.cuda.graph(graph, stream=side):
            kv.decode(q_t)
        assert kv.seq_len == 0  # nothing was appended


# -- SDPA's shapes and dims read from the arrays -------------------------------------------


def test_sdpa_shaped_q_and_head_major_cache_without_dims(torch, rng):
    n_heads, n_kv, hd, seq = 32, 8, 128, 777
    q_t, q = pair(torch, rng, (1, n_heads, 1, hd), "bf16")
    (k_t, k), (v_t, v) = (pair(torch, rng, (1, n_kv, seq, hd), "bf16") for _ in range(2))
    out = fd.gqa_decode(q_t, k_t, v_t, kv_layout="HND")
    assert out.shape == (1, n_heads, 1, hd)
    got = host(torch.from_dlpack(out))
    ref = fd.reference_gqa_decode(q, k, v, kv_layout="HND")
    assert rel_err(got, ref) < TOL["bf16"]
    want = torch.nn.functional.scaled_dot_product_attention(
        q_t.double(), k_t.double(), v_t.double(), enable_gqa=True
    )  # an independent float64 answer
    assert rel_err(got, host(want)) < TOL["bf16"]


def test_dims_are_read_from_the_shapes_on_every_path(torch, rng):
    n_heads, n_kv, hd, seq = 16, 4, 64, 300
    q = rng.standard_normal((n_heads, hd)).astype(np.float16)
    k, v = (rng.standard_normal((seq, n_kv, hd)).astype(np.float16) for _ in range(2))
    ref = fd.reference_gqa_decode(q, k, v, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd)
    assert rel_err(fd.gqa_decode(q, k, v), ref) < TOL["f16"]  # numpy
    assert rel_err(fd.gqa_decode(q, k, v, scale=1 / math.sqrt(hd)), ref) < TOL["f16"]
    got = fd.gqa_decode(q.reshape(-1), k.reshape(-1), v.reshape(-1), n_kv_heads=n_kv,
                        head_dim=hd)  # fmt: skip
    assert rel_err(got.reshape(n_heads, hd), ref) < TOL["f16"]
    dq, dk, dv = (fd.to_device(a) for a in (q, k, v))
    assert rel_err(fd.gqa_decode(dq, dk, dv).to_host(), ref) < TOL["f16"]  # device arrays
    with pytest.raises(ValueError, match="n_heads: 8 given, but q of shape"):
        fd.gqa_decode(dq, dk, dv, n_heads=8)
    with fd.KVCache(n_kv, hd, 512, dtype=np.float16) as kv:
        kv.extend(k, v)
        assert rel_err(kv.decode(q), ref) < TOL["f16"]
        out = fd.empty((n_heads, hd), np.float16)
        out.fill_bytes(0xFF, kv.stream)
        fd.gqa_decode_async(dq, kv, out, stream=kv.stream)  # n_heads from q_dev's size
        assert rel_err(out.to_host(kv.stream), ref) < TOL["f16"]
