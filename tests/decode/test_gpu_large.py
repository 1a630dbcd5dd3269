"""Caches past 2^31 elements: 32/8/128 over 2.3M tokens (2.36e9 elements, 4.7 GB a bf16 K),
filled on the device, decoded by each kernel family in both layouts, through a KVCache (bf16
and fp8 e4m3) and a sharded cache, against the float64 reference computed in chunks of
tokens on the GPU and merged by the LSE formula; rows appended past 2^31 elements (one row,
many rows, device rows) read back bit for bit. Outputs poisoned (NaN) before each decode.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.decode import launches
from ferrox_driver.decode import plan as attention
from ferrox_driver.driver.device import default_device

from ..helpers.gpu_helpers import rel_err

pytestmark = pytest.mark.gpu

H, KV, D = 32, 8, 128
N = 2_300_000  # tokens: N * KV * D = 2.36e9 elements
assert N * KV * D > 2**31
LSE_TOL = 1e-3


@pytest.fixture(scope="module")
def torch() -> Any:
    """PyTorch on the GPU: the fills, the float64 reference in chunks (fails, not skips,
    without it)."""
    import torch

    assert torch.cuda.is_available(), "the large-cache tests fill and check with torch"
    return torch


@pytest.fixture(autouse=True)
def _freed(torch: Any) -> Any:
    """Each test's gigabytes go back before the next one allocates."""
    yield
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def chunked_reference(
    torch: Any, q: Any, k: Any, v: Any, n: int, *, layout: str = "NHD", scales: Any = None,
    chunk: int = 1 << 18,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """The float64 decode of q (H, D) over tokens [0, n) of k and v (NHD: (tokens, KV, D);
    HND: (KV, tokens, D); fp8 bytes times ``scales`` = (k_scale, v_scale) per KV head), a
    chunk of tokens at a time, the chunks merged by their log-sum-exp: (out, lse), numpy."""
    h, d = q.shape
    kv = k.shape[1] if layout == "NHD" else k.shape[0]
    qg = q.double().view(kv, h // kv, d) * d**-0.5
    m = torch.full((kv, h // kv), -math.inf, dtype=torch.float64, device=q.device)
    s = torch.zeros_like(m)
    o = torch.zeros((kv, h // kv, d), dtype=torch.float64, device=q.device)
    eq = "gjd,cgd->gjc" if layout == "NHD" else "gjd,gcd->gjc"
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        rows = []
        for i, x in enumerate((k, v)):
            x = x[start:end] if layout == "NHD" else x[:, start:end]
            if scales is not None:  # fp8 bytes: the value times its KV head's scale
                per_head = torch.as_tensor(scales[i], dtype=torch.float64, device=q.device)
                per_head = per_head.view(1, kv, 1) if layout == "NHD" else per_head.view(kv, 1, 1)
                x = x.view(torch.float8_e4m3fn).double() * per_head
            rows.append(x.double())
        scores = torch.einsum(eq, qg, rows[0])
        mc = scores.amax(-1)
        p = torch.exp(scores - mc[..., None])
        oc = torch.einsum(eq.replace("gjd,", "gjc,").replace("->gjc", "->gjd"), p, rows[1])
        new = torch.maximum(m, mc)
        a, b = torch.exp(m - new), torch.exp(mc - new)
        o = o * a[..., None] + oc * b[..., None]
        s = s * a + p.sum(-1) * b
        m = new
    out = (o / s[..., None]).reshape(h, d)
    return out.cpu().numpy(), (m + torch.log(s)).reshape(h).cpu().numpy()


def _poisoned(torch: Any, dtype: Any = None, shape: tuple[int, int] = (H, D)) -> Any:
    return torch.full(shape, math.nan, dtype=dtype or torch.bfloat16, device="cuda")


def _decode(torch: Any, q: Any, k: Any, v: Any, **kw: Any) -> tuple[np.ndarray, Any]:
    """gqa_decode of torch tensors into a poisoned output: (out, lse or None), numpy."""
    out = _poisoned(torch, q.dtype, q.shape)
    n_kv = k.shape[-3] if kw.get("kv_layout") == "HND" else k.shape[1]
    got = fd.gqa_decode(q, k, v, n_heads=q.shape[0], n_kv_heads=n_kv, head_dim=q.shape[1],
                        out=out, **kw)  # fmt: skip
    torch.cuda.synchronize()
    lse = got[1].to_host() if isinstance(got, tuple) else None
    return out.double().cpu().numpy(), lse


def _kernel(dtype: Any, seq: int, aligned: bool = True, bits: int = 0,
            shape: tuple[int, int, int] = (H, KV, D)) -> str:  # fmt: skip
    """The split kernel a decode of ``shape`` (n_heads, n_kv_heads, head_dim) runs."""
    return launches.plan_split(default_device(), np.dtype(dtype), *shape, seq, aligned,
                                bits).kernel  # fmt: skip


def test_the_chunked_reference_is_the_float64_reference(torch, rng):
    n = 3001
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((H, D), (n, KV, D),
                                                                   (n, KV, D)))  # fmt: skip
    want, want_lse = fd.reference_gqa_decode(q, k, v, n_heads=H, n_kv_heads=KV, head_dim=D,
                                             return_lse=True)  # fmt: skip
    tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
    for layout, kk, vv in (("NHD", tk, tv), ("HND", tk.transpose(0, 1), tv.transpose(0, 1))):
        out, lse = chunked_reference(torch, tq, kk, vv, n, layout=layout, chunk=700)
        assert np.abs(out - want).max() < 1e-12 and np.abs(lse - want_lse).max() < 1e-12
    scales = (rng.uniform(0.25, 2.0, KV).astype(np.float32),) * 2
    k8, v8 = (fd.quantize_fp8(x, ml_dtypes.float8_e4m3fn, scales[0]) for x in (k, v))
    kq, vq = (x.astype(np.float64) * scales[0][:, None] for x in (k8, v8))
    want = fd.reference_gqa_decode(q, kq, vq, n_heads=H, n_kv_heads=KV, head_dim=D)
    bytes_k, bytes_v = (torch.as_tensor(x.view(np.uint8), device="cuda") for x in (k8, v8))
    out, _ = chunked_reference(torch, tq, bytes_k, bytes_v, n, scales=scales, chunk=1000)
    assert np.abs(out - want).max() < 1e-12


def _filled(torch: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    x = torch.empty(shape, dtype=dtype, device="cuda")
    return x.normal_()


def test_bf16_decodes_past_2_31_elements_token_major_in_every_family(torch, monkeypatch):
    """The default plan (tensor cores), the combine kernel's (no clusters), the CUDA-core
    kernel (K and V one element off 16-byte alignment), the features' kernel (the LSE) and
    the parity kernel, each over 2.36e9 elements."""
    kbuf = _filled(torch, (N + 1, KV, D), torch.bfloat16)
    vbuf = _filled(torch, (N + 1, KV, D), torch.bfloat16)
    q = torch.randn((H, D), device="cuda").to(torch.bfloat16)
    k, v = kbuf[:N], vbuf[:N]
    want, want_lse = chunked_reference(torch, q, k, v, N)
    assert "mma" in _kernel(ml_dtypes.bfloat16, N)
    got, _ = _decode(torch, q, k, v)
    assert rel_err(got, want) < 1e-2
    got, lse = _decode(torch, q, k, v, return_lse=True)
    assert rel_err(got, want) < 1e-2
    np.testing.assert_allclose(lse, want_lse, rtol=LSE_TOL, atol=LSE_TOL)
    got, _ = _decode(torch, q, k, v, algorithm="parity")
    assert rel_err(got, want) < 1e-2
    monkeypatch.setattr(attention, "OVERRIDES",
                        dataclasses.replace(attention.OVERRIDES, cluster=False))  # fmt: skip
    assert "cluster" not in _kernel(ml_dtypes.bfloat16, N)
    got, _ = _decode(torch, q, k, v)
    assert rel_err(got, want) < 1e-2
    # one element on: not 16-byte aligned, so the CUDA-core kernel reads it
    k1 = kbuf.view(-1)[1 : 1 + N * KV * D].view(N, KV, D)
    v1 = vbuf.view(-1)[1 : 1 + N * KV * D].view(N, KV, D)
    assert _kernel(ml_dtypes.bfloat16, N, aligned=False).startswith("gqa_split_bf16_g")
    got, _ = _decode(torch, q, k1, v1)
    assert rel_err(got, chunked_reference(torch, q, k1, v1, N)[0]) < 1e-2


def test_bf16_decode_of_a_head_major_view_past_2_31_elements(torch, monkeypatch):
    """(1, KV, N, D) views of a (1, KV, N + 1000, D) cache: KV heads (N + 1000) * D elements
    apart, the last one 2.06e9 elements in; with and without clusters."""
    kbuf = _filled(torch, (1, KV, N + 1000, D), torch.bfloat16)
    vbuf = _filled(torch, (1, KV, N + 1000, D), torch.bfloat16)
    k, v = kbuf[:, :, :N], vbuf[:, :, :N]
    q = torch.randn((H, D), device="cuda").to(torch.bfloat16)
    want, want_lse = chunked_reference(torch, q, k[0], v[0], N, layout="HND")
    got, lse = _decode(torch, q, k, v, kv_layout="HND", return_lse=True)
    assert rel_err(got, want) < 1e-2
    np.testing.assert_allclose(lse, want_lse, rtol=LSE_TOL, atol=LSE_TOL)
    monkeypatch.setattr(attention, "OVERRIDES",
                        dataclasses.replace(attention.OVERRIDES, cluster=False))  # fmt: skip
    got, _ = _decode(torch, q, k, v, kv_layout="HND")
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize(
    "shape,family",
    [((8, 1, 256), "gqa_split_mma_bf16_d256"),  # heads as the mma's rows, MQA
     ((64, 4, 64), "gqa_split_mma_bf16_d64_t2"),  # groups of 16: two tiles of 8 heads
     ((32, 8, 80), "gqa_split_mma_bf16_d128_r80"),  # a head_dim padded to the kernel's
     ((24, 8, 40), "gqa_split_mma_bf16_d128_r80_p2")],  # KV heads read in pairs
)  # fmt: skip
def test_the_other_tensor_core_families_past_2_31_elements(torch, shape, family):
    h, kv, d = shape
    n = 2**31 // (kv * d) + 100_000
    k = _filled(torch, (n, kv, d), torch.bfloat16)
    v = _filled(torch, (n, kv, d), torch.bfloat16)
    q = torch.randn((h, d), device="cuda").to(torch.bfloat16)
    assert _kernel(ml_dtypes.bfloat16, n, shape=shape).removesuffix("_cluster") == family
    got, _ = _decode(torch, q, k, v)
    assert rel_err(got, chunked_reference(torch, q, k, v, n)[0]) < 1e-2


def test_fp32_decodes_past_2_31_elements_on_tensor_and_cuda_cores(torch, monkeypatch):
    k = _filled(torch, (N, KV, D), torch.float32)
    v = _filled(torch, (N, KV, D), torch.float32)
    q = torch.randn((H, D), device="cuda")
    want, _ = chunked_reference(torch, q, k, v, N)
    assert "tc32" in _kernel(np.float32, N)
    got, _ = _decode(torch, q, k, v)
    _fp32_close(got, want)
    monkeypatch.setattr(attention, "OVERRIDES",
                        dataclasses.replace(attention.OVERRIDES, tc32=False))  # fmt: skip
    assert _kernel(np.float32, N).startswith("gqa_split_f32_g")
    got, _ = _decode(torch, q, k, v)
    _fp32_close(got, want)


def _fp32_close(got: np.ndarray, want: np.ndarray) -> None:
    """fp32 over 2.3M tokens, in the rows' own units. The output averages 2.3M random rows of
    size 1, so it is about 1/sqrt(N) = 7e-4 in size, and fp32 rounding of the rows (a few eps,
    about 1e-7) is 1e-4 of it: the relative error 1e-5 of shorter caches measured 8.3e-5 on
    the H200 (the split TF32 kernel). A chunk of 2^20 tokens read from the wrong place moves
    the output by about sqrt(2^20) / N = 4e-4, so 2e-6 still sees it."""
    assert np.abs(got - want).max() < 2e-6
    assert rel_err(got, want) < 1e-3


def _set_length(kv: fd.KVCache, n: int) -> None:
    """Declare the first ``n`` tokens of a cache written on the device (as a prefill kernel
    of the caller's would): the device's length, then the host told."""
    kv.state.copy_from_host(np.array([n, 0], np.int32), kv.stream)
    kv.mark_device_appends()
    assert kv.seq_len == n


def test_a_bf16_kv_cache_past_2_31_elements_decodes_and_appends_bit_for_bit(torch, rng):
    extra = 8
    with fd.KVCache(KV, D, N + extra, dtype=ml_dtypes.bfloat16) as kv:
        kc, vc = torch.from_dlpack(kv.k_buffer), torch.from_dlpack(kv.v_buffer)
        kc.normal_()
        vc.normal_()
        q = torch.randn((H, D), device="cuda").to(torch.bfloat16)
        out = _poisoned(torch)
        torch.cuda.synchronize()  # (the cache's stream reads them next)
        _set_length(kv, N)
        want, _ = chunked_reference(torch, q, kc, vc, N)
        q_host = q.float().cpu().numpy().astype(ml_dtypes.bfloat16)
        assert rel_err(kv.decode(q_host, n_heads=H), want) < 1e-2  # (a graph's decode)
        fd.gqa_decode_async(q, kv, out, n_heads=H, stream=kv.stream)
        kv.stream.synchronize()
        assert rel_err(out.double().cpu().numpy(), want) < 1e-2
        # rows past 2^31 elements (byte offsets past 2^32): one host row, three, a device row
        rows = rng.standard_normal((2, 5, KV, D)).astype(ml_dtypes.bfloat16)
        kv.append(rows[0, 0], rows[1, 0])
        kv.extend(rows[0, 1:4], rows[1, 1:4])
        k_dev, v_dev = (fd.to_device(r[4].reshape(-1)) for r in rows)
        fd.kv_append_async(kv, k_dev, v_dev, stream=kv.stream)
        kv.synchronize()
        assert kv.seq_len == N + 5
        for cache, r in ((kc, rows[0]), (vc, rows[1])):
            back = cache[N : N + 5].view(torch.int16).cpu().numpy().view(np.uint16)
            assert np.array_equal(back, r.view(np.uint16)), "rows past 2^31 elements changed"
        want, _ = chunked_reference(torch, q, kc, vc, N + 5)
        assert rel_err(kv.decode(q_host, n_heads=H), want) < 1e-2


def test_an_fp8_kv_cache_past_2_31_elements_decodes_and_quantizes_bit_for_bit(torch, rng):
    extra = 8
    k_scale, v_scale = (rng.uniform(0.25, 2.0, KV).astype(np.float32) for _ in range(2))
    e4m3 = ml_dtypes.float8_e4m3fn
    with fd.KVCache(KV, D, N + extra, dtype=e4m3, k_scale=k_scale, v_scale=v_scale) as kv:
        kc = torch.from_dlpack(kv.k_buffer.view((N + extra, KV, D), np.uint8))
        vc = torch.from_dlpack(kv.v_buffer.view((N + extra, KV, D), np.uint8))
        step = 1 << 20
        for start in range(0, N + extra, step):  # (in chunks: no 9 GB float32 at once)
            end = min(N + extra, start + step)
            for cache in (kc, vc):
                values = torch.randn((end - start, KV, D), device="cuda") * 4
                cache[start:end] = values.to(torch.float8_e4m3fn).view(torch.uint8)
        torch.cuda.synchronize()
        _set_length(kv, N)
        q = torch.randn((H, D), device="cuda").to(torch.bfloat16)
        want, _ = chunked_reference(torch, q, kc, vc, N, scales=(k_scale, v_scale))
        q_host = q.float().cpu().numpy().astype(ml_dtypes.bfloat16)
        assert rel_err(kv.decode(q_host, n_heads=H), want) < 1e-2
        # rows quantized past 2^31 elements: float32 and bfloat16 host rows, three at once,
        # a device row (quantized at the device's length)
        rows = rng.standard_normal((2, 6, KV, D)).astype(np.float32) * 3
        kv.append(rows[0, 0], rows[1, 0])
        kv.append(rows[0, 1].astype(ml_dtypes.bfloat16), rows[1, 1].astype(ml_dtypes.bfloat16))
        kv.extend(rows[0, 2:5], rows[1, 2:5])
        k_dev, v_dev = (fd.to_device(r[5].reshape(-1)) for r in rows)
        fd.kv_append_async(kv, k_dev, v_dev, stream=kv.stream)
        kv.synchronize()
        assert kv.seq_len == N + 6
        rows[:, 1] = rows[:, 1].astype(ml_dtypes.bfloat16).astype(np.float32)
        for cache, r, scale in ((kc, rows[0], k_scale), (vc, rows[1], v_scale)):
            want_bytes = fd.quantize_fp8(r, e4m3, scale).view(np.uint8)
            assert np.array_equal(cache[N : N + 6].cpu().numpy(), want_bytes)
        want, _ = chunked_reference(torch, q, kc, vc, N + 6, scales=(k_scale, v_scale))
        assert rel_err(kv.decode(q_host, n_heads=H), want) < 1e-2


def test_a_sharded_cache_of_two_ranks_past_2_31_elements_each(torch):
    """Two ranks on one device, N tokens each (2.36e9 elements a rank): each rank's share
    decoded, exchanged and merged equals the whole sequence's reference (attention without
    positions does not depend on the tokens' order)."""
    from ferrox_driver.parallel.sharded import LocalGroup, ShardedDecoder, ShardedKVCache

    groups = LocalGroup.ranks(2)
    caches = [ShardedKVCache(KV, D, 2 * N, group=g, dtype=ml_dtypes.bfloat16) for g in groups]
    decoders = [ShardedDecoder(c, n_heads=H) for c in caches]
    try:
        shares = []
        for c in caches:
            k, v = torch.from_dlpack(c.k), torch.from_dlpack(c.v)
            k.normal_()
            v.normal_()
            shares.append((k, v))
        q = torch.randn((H, D), device="cuda").to(torch.bfloat16)
        outs = [_poisoned(torch) for _ in caches]
        torch.cuda.synchronize()  # (ferrox's stream reads them next)
        for c in caches:
            c.set_length(2 * N)
        stream = fd.Stream()
        ShardedDecoder.decode_all(decoders, fd.from_dlpack(q), [fd.from_dlpack(o) for o in outs],
                                  stream=stream)  # fmt: skip
        stream.synchronize()
        k = torch.cat([s[0] for s in shares])  # (2N, KV, D): 9.4 GB, read in chunks
        v = torch.cat([s[1] for s in shares])
        want, _ = chunked_reference(torch, q, k, v, 2 * N)
        for out in outs:
            assert rel_err(out.double().cpu().numpy(), want) < 1e-2
    finally:
        for d in decoders:
            d.close()
        for c in caches:
            c.close()
