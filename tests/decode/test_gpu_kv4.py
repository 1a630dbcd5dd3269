"""4-bit caches on the device (issue 49, groundwork): rows quantized by the device bit for
bit as `kv4.quantize_q4` / `kv4.quantize_nvfp4` (of `kv4.hadamard(rows)` for a rotated K) do
on the host, and a decode of the 4-bit buffers by the rows kernels against the float64
reference on the dequantized cache (K rotated back: the scores are unchanged), one query
token and several, with features, fresh random inputs, outputs poisoned."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.decode import kv4
from ferrox_driver.decode import plan as planner
from ferrox_driver.decode.kv4_device import quantize_4bit_async
from ferrox_driver.decode.records import launches_for
from ferrox_driver.kernels.abi import FeatureArgs, feature_bits

from ..helpers.gpu_helpers import DTYPES, poisoned, rel_err

pytestmark = pytest.mark.gpu


E4M3 = np.dtype("float8_e4m3fn")


def _q4_cache(rng, n, n_kv, d, rows_dtype, rotate_k, stream, fmt="q4", rows=None):
    """Rows quantized on the device: (rows, device buffers) of a 4-bit cache of ``n``
    tokens (nvfp4: its scales per KV head in ``"globals"``, host and device); ``rows``: K
    and V to take in place of random ones with outlier channels."""
    dt = DTYPES[rows_dtype]
    if rows is None:
        k = (rng.standard_normal((n, n_kv, d)) * rng.uniform(0.1, 4)).astype(dt)
        v = rng.standard_normal((n, n_kv, d)).astype(dt)
        k[:, :, rng.choice(d, 3, replace=False)] *= 20  # outlier channels
    else:
        k, v = (r.astype(dt) for r in rows)
    nv = fmt == "nvfp4"
    vals, scales = (n, n_kv, d // 2), (n, n_kv, d // (16 if nv else 32))
    sdt = np.uint8 if nv else np.float16
    bufs = {
        "k_vals": fd.zeros(vals, np.uint8), "v_vals": fd.zeros(vals, np.uint8),
        "k_scales": fd.zeros(scales, sdt), "v_scales": fd.zeros(scales, sdt),
    }  # fmt: skip
    kw = {}
    if nv:  # the scales a cache would fix from its first rows: amax / (6 * 448) per head
        kf = kv4.hadamard(k.astype(np.float32)) if rotate_k else k.astype(np.float32)
        g = [np.abs(a).max(axis=(0, 2)) / np.float32(6 * 448) for a in (kf, v.astype(np.float32))]
        bufs["globals"] = np.concatenate(g).astype(np.float32)
        kw["globals_"] = fd.to_device(bufs["globals"])
    quantize_4bit_async(fd.to_device(k), fd.to_device(v), *(bufs[n_] for n_ in
                        ("k_vals", "v_vals", "k_scales", "v_scales")), first=0, stream=stream,
                        rotate_k=rotate_k, **kw)  # fmt: skip
    stream.synchronize()
    return k, v, bufs


@pytest.mark.parametrize("rows_dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("rotate_k", [False, True])
def test_rows_are_quantized_as_the_host_helpers_do_bit_for_bit(rng, rows_dtype, head_dim,
                                                               rotate_k):  # fmt: skip
    with fd.Stream() as s:
        k, v, bufs = _q4_cache(rng, 37, 3, head_dim, rows_dtype, rotate_k, s)
    kf = k.astype(np.float32)
    k_vals, k_scales = kv4.quantize_q4(kv4.hadamard(kf) if rotate_k else kf)
    v_vals, v_scales = kv4.quantize_q4(v)
    np.testing.assert_array_equal(bufs["k_vals"].to_host(), k_vals)
    np.testing.assert_array_equal(bufs["v_vals"].to_host(), v_vals)
    np.testing.assert_array_equal(bufs["k_scales"].to_host().view(np.uint16),
                                  k_scales.view(np.uint16))  # fmt: skip
    np.testing.assert_array_equal(bufs["v_scales"].to_host().view(np.uint16),
                                  v_scales.view(np.uint16))  # fmt: skip


def _decode(q_d, bufs, n_q, n_heads, n_kv, d, seq, rotate, stream, fmt="q4", kv_scales=None,
            **feats):  # fmt: skip
    out = poisoned(q_d.shape, q_d.dtype)
    lse = fd.empty((n_q * n_heads,), np.float32)
    window = feats.get("sliding_window")
    bits = feature_bits(window is not None, False, False, False, True, False)
    values = FeatureArgs(scale=d**-0.5, window=window or 0, lse=lse)
    launches, _ = launches_for(
        q_d, bufs["k_vals"], bufs["v_vals"], out, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=d, seq_len=seq, plan_seq=seq, aligned=True, bits=bits, fp8=fmt,
        features=values, n_q=n_q, q4_scales=(bufs["k_scales"], bufs["v_scales"]),
        kv_scales=kv_scales,
        rotate=rotate, workspace=lambda floats: fd.empty((floats,), np.float32),
    )  # fmt: skip
    for launch in launches:
        launch.run(stream, q_d.device)
    stream.synchronize()
    return out.to_host().astype(np.float64), lse.to_host().reshape(n_q, n_heads)


# the one-query split plans' narrow kernels (short contexts: these tests' lengths) and the
# wide ones (Overrides.four_bit_narrow_to 0)
NARROW = pytest.mark.parametrize("narrow", [True, False], ids=["narrow", "wide"])


@pytest.fixture
def narrow_plans(request, monkeypatch):
    if not request.getfixturevalue("narrow"):
        wide = dataclasses.replace(planner.OVERRIDES, four_bit_narrow_to=0)
        monkeypatch.setattr(planner, "OVERRIDES", wide)


@NARROW
@pytest.mark.parametrize("qdt", ["bf16", "f16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_a_q4_cache_decodes_as_the_reference_on_its_dequantized_rows(rng, qdt, head_dim, narrow,
                                                                      narrow_plans):  # fmt: skip
    n_kv, seq = 4, 1537
    with fd.Stream() as s:
        _, _, bufs = _q4_cache(rng, seq, n_kv, head_dim, qdt, True, s)
        kq = kv4.dequantize_q4(bufs["k_vals"].to_host(), bufs["k_scales"].to_host())
        kd = kv4.hadamard(kq)  # (its own inverse: K as the scores see it)
        vd = kv4.dequantize_q4(bufs["v_vals"].to_host(), bufs["v_scales"].to_host())
        for n_q, n_heads, feats in ((1, 16, {}), (1, 4, {}), (4, 28, {}), (16, 32, {}),
                                    (5, 16, {"sliding_window": 300})):  # fmt: skip
            n_heads -= n_heads % n_kv
            q = rng.standard_normal((n_q, n_heads, head_dim)).astype(DTYPES[qdt])
            got, lse = _decode(fd.to_device(q), bufs, n_q, n_heads, n_kv, head_dim, seq, True,
                               s, **feats)  # fmt: skip
            ref, ref_lse = fd.reference_gqa_decode(q, kd, vd, return_lse=True, **feats)
            assert np.isfinite(got).all()
            assert rel_err(got, ref) < 2e-2, (n_q, n_heads, feats)
            np.testing.assert_allclose(lse, ref_lse, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("fmt", ["q4", "nvfp4"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("n_kv", [1, 2])
def test_a_4bit_decode_whose_scores_climb_and_jump_keeps_its_softmax(rng, fmt, head_dim, n_kv):
    """Scores that grow along the cache (the running max passes itself every few steps), a
    spike far above them and a later one higher still, tens of nats apart: the one-query
    kernels' running max and rescaling against the reference, LSE too."""
    n_heads, seq, d = 8, 4099, head_dim
    q = rng.standard_normal((1, n_heads, d)).astype(DTYPES["bf16"])
    ramp = np.linspace(0.2, 3.0, seq)[:, None, None]
    k = rng.standard_normal((seq, n_kv, d)) * ramp
    qk = q[0, :: n_heads // n_kv].astype(np.float64)  # (a head of each group)
    for t, mul in ((int(0.6 * seq), 4.0), (seq - 700, 6.0)):
        k[t] = mul * qk / np.linalg.norm(qk, axis=-1, keepdims=True) * np.sqrt(d)
    v = rng.standard_normal((seq, n_kv, d))
    nv = fmt == "nvfp4"
    with fd.Stream() as s:
        _, _, bufs = _q4_cache(rng, seq, n_kv, d, "f32", True, s, fmt, rows=(k, v))
        g = bufs.get("globals")
        if nv:
            kd = kv4.dequantize_nvfp4(bufs["k_vals"].to_host(),
                                      bufs["k_scales"].to_host().view(E4M3), g[:n_kv])  # fmt: skip
            vd = kv4.dequantize_nvfp4(bufs["v_vals"].to_host(),
                                      bufs["v_scales"].to_host().view(E4M3), g[n_kv:])  # fmt: skip
        else:
            kd = kv4.dequantize_q4(bufs["k_vals"].to_host(), bufs["k_scales"].to_host())
            vd = kv4.dequantize_q4(bufs["v_vals"].to_host(), bufs["v_scales"].to_host())
        kd = kv4.hadamard(kd)
        got, lse = _decode(fd.to_device(q), bufs, 1, n_heads, n_kv, d, seq, True, s, fmt=fmt,
                           kv_scales=fd.to_device(g) if nv else None)  # fmt: skip
    ref, ref_lse = fd.reference_gqa_decode(q, kd, vd, return_lse=True)
    assert ref_lse.max() - np.log(seq) > 20  # (the spikes: the softmax is that sharp)
    assert rel_err(got, ref) < 2e-2
    np.testing.assert_allclose(lse, ref_lse, rtol=3e-3, atol=3e-2)


def test_an_unrotated_q4_cache_decodes_too(rng):
    n_kv, d, seq = 2, 128, 700
    with fd.Stream() as s:
        _, _, bufs = _q4_cache(rng, seq, n_kv, d, "bf16", False, s)
        kd = kv4.dequantize_q4(bufs["k_vals"].to_host(), bufs["k_scales"].to_host())
        vd = kv4.dequantize_q4(bufs["v_vals"].to_host(), bufs["v_scales"].to_host())
        q = rng.standard_normal((3, 8, d)).astype(DTYPES["bf16"])
        got, _ = _decode(fd.to_device(q), bufs, 3, 8, n_kv, d, seq, False, s)
    assert rel_err(got, fd.reference_gqa_decode(q, kd, vd)) < 2e-2


@pytest.mark.parametrize("rows_dtype", ["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("rotate_k", [False, True])
def test_nvfp4_rows_are_quantized_as_the_host_helper_does(rng, rows_dtype, head_dim, rotate_k):
    n_kv = 3
    with fd.Stream() as s:
        k, v, bufs = _q4_cache(rng, 37, n_kv, head_dim, rows_dtype, rotate_k, s, "nvfp4")
    kf = k.astype(np.float32)
    g = bufs["globals"]
    k_vals, k_bs, _ = kv4.quantize_nvfp4(kv4.hadamard(kf) if rotate_k else kf, g[:n_kv])
    v_vals, v_bs, _ = kv4.quantize_nvfp4(v, g[n_kv:])
    np.testing.assert_array_equal(bufs["k_vals"].to_host(), k_vals)
    np.testing.assert_array_equal(bufs["v_vals"].to_host(), v_vals)
    np.testing.assert_array_equal(bufs["k_scales"].to_host(), k_bs.view(np.uint8))
    np.testing.assert_array_equal(bufs["v_scales"].to_host(), v_bs.view(np.uint8))


@NARROW
@pytest.mark.parametrize("rotate", [False, True])
def test_an_nvfp4_cache_decodes_as_the_reference_on_its_dequantized_rows(rng, rotate, narrow,
                                                                         narrow_plans):  # fmt: skip
    n_kv, d, seq = 2, 128, 900
    with fd.Stream() as s:
        _, _, bufs = _q4_cache(rng, seq, n_kv, d, "bf16", rotate, s, "nvfp4")
        g = bufs["globals"]
        kd = kv4.dequantize_nvfp4(bufs["k_vals"].to_host(),
                                  bufs["k_scales"].to_host().view(E4M3), g[:n_kv])  # fmt: skip
        kd = kv4.hadamard(kd) if rotate else kd
        vd = kv4.dequantize_nvfp4(bufs["v_vals"].to_host(),
                                  bufs["v_scales"].to_host().view(E4M3), g[n_kv:])  # fmt: skip
        for n_q in (1, 6):
            q = rng.standard_normal((n_q, 8, d)).astype(DTYPES["bf16"])
            got, lse = _decode(fd.to_device(q), bufs, n_q, 8, n_kv, d, seq, rotate, s,
                               fmt="nvfp4", kv_scales=fd.to_device(g))  # fmt: skip
            ref, ref_lse = fd.reference_gqa_decode(q, kd, vd, return_lse=True)
            assert rel_err(got, ref) < 2e-2, n_q
            np.testing.assert_allclose(lse, ref_lse, rtol=3e-2, atol=3e-2)
