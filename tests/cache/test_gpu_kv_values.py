"""KVCache(head_dim_v=...) on the GPU: V rows of their own width appended one row at a time
and in blocks (numpy and device rows), decoded (numpy and device q, one or three queries,
lengths 0, 1 and odd) against ``reference_gqa_decode(..., head_dim_v=)`` on the appended
data. Fresh random inputs; the cache's buffers and the decode outputs poisoned with NaN
first, so a row read past the length, at a wrong offset or never written shows."""

from __future__ import annotations

import numpy as np
import pytest

import ferrox_driver as fd

from ..helpers.gpu_helpers import DTYPES, TOL, poisoned, rel_err

pytestmark = pytest.mark.gpu

LSE_TOL = 2e-2
N_KV = 2
# (head_dim, head_dim_v): DeepSeek's expanded heads, wider keys, wider values; 512/512 is
# an equal-width cache (the usual path, checked to stay it)
WIDTHS = [(192, 128), (256, 128), (128, 256), (512, 512)]


def _cache(d, dv, dt, capacity=64):
    kv = fd.KVCache(N_KV, d, capacity, dtype=dt, head_dim_v=dv)
    kv.k_buffer.fill_bytes(0xFF, kv.stream)  # NaN: read past the length, it shows
    kv.v_buffer.fill_bytes(0xFF, kv.stream)
    return kv


def _fill(kv, rng, seq, dt, one_row, device_rows=False):
    """``seq`` fresh tokens appended (one row at a time or as one block); (k, v) on the host."""
    k = rng.standard_normal((seq, N_KV, kv.head_dim)).astype(dt)
    v = rng.standard_normal((seq, N_KV, kv.head_dim_v)).astype(dt)
    put = fd.to_device if device_rows else (lambda a: a)
    if one_row:
        for i in range(seq):
            kv.append(put(k[i]), put(v[i]))
    elif seq:
        kv.extend(put(k), put(v))
    kv.stream.synchronize()
    return k, v


def _reference(q, k, v, dv, **kw):
    return fd.reference_gqa_decode(q, k, v, head_dim_v=dv, return_lse=True, **kw)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("n_q", [1, 3])
@pytest.mark.parametrize("one_row", [True, False], ids=["rows", "block"])
@pytest.mark.parametrize("widths", WIDTHS, ids=lambda w: f"{w[0]}-{w[1]}")
def test_decode_matches_the_reference_on_the_appended_rows(rng, widths, one_row, n_q, group,
                                                           dtype):  # fmt: skip
    d, dv = widths
    dt = DTYPES[dtype]
    n_heads = N_KV * group
    for seq in (0, 1, 37):
        if seq < n_q and seq:
            continue
        with _cache(d, dv, dt) as kv:
            assert kv.head_dim_v == dv and (kv.own_v is None) == (d == dv)
            k, v = _fill(kv, rng, seq, dt, one_row)
            assert kv.seq_len == seq
            got_k, got_v = kv.to_host()
            assert np.array_equal(got_k.view(np.uint16), k.view(np.uint16))
            assert np.array_equal(got_v.view(np.uint16), v.view(np.uint16))
            if n_q > seq:  # (an empty cache: one query only)
                continue
            shape = (n_q, n_heads, d) if n_q > 1 else (n_heads, d)
            q = rng.standard_normal(shape).astype(dt)
            out, lse = kv.decode(q, return_lse=True)
            ref, ref_lse = _reference(q, k, v, dv)
            assert out.shape == (*shape[:-1], dv) and out.dtype == dt
            assert rel_err(out, ref) < TOL[dtype], (widths, seq, n_q, group)
            np.testing.assert_allclose(lse, ref_lse, rtol=LSE_TOL, atol=LSE_TOL)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("widths", [(192, 128), (256, 128)], ids=lambda w: f"{w[0]}-{w[1]}")
def test_device_rows_and_a_device_q(rng, widths, dtype):
    d, dv = widths
    dt = DTYPES[dtype]
    with _cache(d, dv, dt) as kv:
        k1, v1 = _fill(kv, rng, 5, dt, one_row=True, device_rows=True)
        k2, v2 = _fill(kv, rng, 12, dt, one_row=False, device_rows=True)
        k, v = np.concatenate([k1, k2]), np.concatenate([v1, v2])
        for shape in ((8, d), (3, 8, d)):
            q = rng.standard_normal(shape).astype(dt)
            poisoned((4 << 20,), np.uint8).close()  # (the pool's next block: NaN bytes)
            out, lse = kv.decode(fd.to_device(q), return_lse=True)
            assert isinstance(out, fd.DeviceArray) and out.shape == (*shape[:-1], dv)
            ref, ref_lse = _reference(q, k, v, dv)
            assert rel_err(out.to_host(), ref) < TOL[dtype]
            np.testing.assert_allclose(lse.to_host(), ref_lse, rtol=LSE_TOL, atol=LSE_TOL)


def test_the_caches_views_decode_into_a_poisoned_out(rng):
    dt = DTYPES["bf16"]
    with _cache(192, 128, dt) as kv:
        k, v = _fill(kv, rng, 23, dt, one_row=False)
        q = rng.standard_normal((8, 192)).astype(dt)
        out = poisoned((8, 128), dt)
        got = fd.gqa_decode(fd.to_device(q), kv.k, kv.v, head_dim_v=128, out=out)
        assert got is out and kv.v.shape == (23, N_KV, 128)
        ref, _ = _reference(q, k, v, 128)
        assert rel_err(out.to_host(), ref) < TOL["bf16"]


def test_features_flat_and_sdpa_queries(rng):
    dt = DTYPES["bf16"]
    n_heads = 8
    sinks = rng.standard_normal(n_heads).astype(np.float32)
    feats = dict(sliding_window=9, logits_soft_cap=20.0, scale=0.07, sinks=sinks)
    with _cache(256, 128, dt) as kv:
        k, v = _fill(kv, rng, 31, dt, one_row=True)
        q = rng.standard_normal((n_heads, 256)).astype(dt)
        ref, ref_lse = _reference(q, k, v, 128, **feats)
        out, lse = kv.decode(q, return_lse=True, **feats)
        assert rel_err(out, ref) < TOL["bf16"]
        np.testing.assert_allclose(lse, ref_lse, rtol=LSE_TOL, atol=LSE_TOL)
        flat = kv.decode(q.reshape(-1))
        sdpa = kv.decode(q[None, :, None])
        assert flat.shape == (n_heads * 128,) and sdpa.shape == (1, n_heads, 1, 128)
        ref0, _ = _reference(q, k, v, 128)
        assert rel_err(flat.reshape(n_heads, 128), ref0) < TOL["bf16"]
        assert rel_err(sdpa.reshape(n_heads, 128), ref0) < TOL["bf16"]


def test_truncate_and_appends_past_it(rng):
    dt = DTYPES["f16"]
    with _cache(192, 128, dt) as kv:
        k, v = _fill(kv, rng, 20, dt, one_row=False)
        kv.truncate(11)
        k2, v2 = _fill(kv, rng, 4, dt, one_row=True)
        k, v = np.concatenate([k[:11], k2]), np.concatenate([v[:11], v2])
        got_k, got_v = kv.to_host()
        assert got_v.shape == (15, N_KV, 128)
        assert np.array_equal(got_k, k) and np.array_equal(got_v, v)
        q = rng.standard_normal((4, 192)).astype(dt)
        ref, _ = _reference(q, k, v, 128, n_heads=4)
        assert rel_err(kv.decode(q), ref) < TOL["f16"]


def test_bad_input_and_overflow_leave_the_cache_as_it_was(rng):
    dt = DTYPES["bf16"]
    with _cache(192, 128, dt, capacity=8) as kv:
        k, v = _fill(kv, rng, 6, dt, one_row=False)
        with pytest.raises(ValueError, match="v_tok"):
            kv.append(k[0], k[0])
        with pytest.raises(ValueError, match="v_rows"):
            kv.extend(fd.to_device(k[:2]), fd.to_device(k[:2]))
        with pytest.raises(fd.KVCapacityError):
            kv.extend(k[:3], v[:3])
        with pytest.raises(fd.FerroxError, match="DecodeGraph"):
            fd.DecodeGraph(kv, n_heads=8)
        assert kv.seq_len == 6
        got_k, got_v = kv.to_host()
        assert np.array_equal(got_k, k) and np.array_equal(got_v, v)


def test_closed_cache_refuses(rng):
    dt = DTYPES["bf16"]
    kv = _cache(192, 128, dt)
    kv.close()
    with pytest.raises(fd.ClosedError):
        kv.append(np.zeros((N_KV, 192), dt), np.zeros((N_KV, 128), dt))
    with pytest.raises(fd.ClosedError):
        kv.decode(np.zeros((8, 192), dt))


def test_a_layered_cache_holds_values_of_their_own_width_in_every_layer(rng):
    """LayerKVCache(head_dim_v=): each layer a KVCache of that width, appended and decoded
    on its own against the reference on its rows."""
    dt = DTYPES["bf16"]
    with fd.LayerKVCache(3, N_KV, 192, 40, dtype=dt, head_dim_v=128) as layers:
        assert layers.head_dim_v == 128 and len(layers) == 3
        rows = []
        for i, layer in enumerate(layers):
            assert layer.head_dim_v == 128 and layer.v_buffer.shape == (40, N_KV, 128)
            layer.k_buffer.fill_bytes(0xFF, layer.stream)  # NaN past the length
            layer.v_buffer.fill_bytes(0xFF, layer.stream)
            rows.append(_fill(layer, rng, 17 + 6 * i, dt, one_row=i == 1))
        for layer, (k, v) in zip(layers, rows, strict=True):
            q = rng.standard_normal((2 * N_KV, 192)).astype(dt)
            ref, _ = _reference(q, k, v, 128)
            got = layer.decode(q)
            assert got.shape == (2 * N_KV, 128) and np.isfinite(got.astype(np.float64)).all()
            assert rel_err(got, ref) < TOL["bf16"]
