"""4-bit KVCaches (dtype "int4" and "nvfp4"): what every append path stores is what the
public numpy helpers compute, bit for bit (K rotated first where the cache rotates); decodes
(one query and several, features, graphs) match the float64 reference on the dequantized
cache; fresh random inputs, outputs poisoned."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd

from ..helpers.gpu_helpers import rel_err

pytestmark = pytest.mark.gpu

TOL = 2e-2
# The LSE's absolute error: a rotated q is rounded to fp16 after its rotation (about 5e-4
# of each element), which moves scores of magnitude ~30 by up to ~0.02.
LSE_ATOL = 3e-2
BF16 = np.dtype(ml_dtypes.bfloat16)


def _rows(rng, n, n_kv, d, dt=np.float32):
    k = rng.standard_normal((n, n_kv, d)) * 2
    # an outlier channel, as real models' K have: mostly a magnitude the tokens share (a
    # per-token one alone makes the softmax so sharp that every 4-bit format errs ~0.5)
    k[:, :, 5] = 30 * (1 + 0.1 * k[:, :, 5])
    v = rng.standard_normal((n, n_kv, d))
    return k.astype(dt), v.astype(dt)


def _expected(kv, k, v, k_scale=None, v_scale=None):
    """(values, block scales) of K and V as the public helpers compute them."""
    kf = k.astype(np.float32)
    if kv.fp8 == "nvfp4":  # the cache's scales per KV head, as it quantizes with them
        k_scale = kv.k_scale if k_scale is None else k_scale
        v_scale = kv.v_scale if v_scale is None else v_scale
    if kv.rotate:
        kf = fd.hadamard(kf)
    if kv.fp8 == "q4":
        return fd.quantize_int4(kf), fd.quantize_int4(v.astype(np.float32))
    kq = fd.quantize_nvfp4(kf, k_scale)
    vq = fd.quantize_nvfp4(v.astype(np.float32), v_scale)
    return kq[:2], vq[:2]


def _same_bytes(got, want):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


def _check_stored(kv, k, v, **scales):
    (kw, ksw), (vw, vsw) = _expected(kv, k, v, **scales)
    kq, vq = kv.to_host()
    ks, vs = kv.block_scales()
    _same_bytes(kq, kw)
    _same_bytes(vq, vw)
    _same_bytes(ks, ksw)
    _same_bytes(vs, vsw)


CASES = [("int4", None), ("int4", False), ("nvfp4", None), ("nvfp4", True)]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype,rotate", CASES)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("path", ["append", "extend", "device", "async", "async_rows"])
def test_every_append_path_stores_what_the_helpers_compute(
    rng, dtype, rotate, head_dim, path, layout
):
    n_kv, n = 3, 21
    scales = {"k_scale": np.float32(0.02), "v_scale": np.float32(0.005)} if dtype == "nvfp4" else {}
    rows_dt = {"append": BF16, "extend": np.float32, "device": np.float16}.get(path, BF16)
    k, v = _rows(rng, n, n_kv, head_dim, rows_dt)
    with fd.KVCache(n_kv, head_dim, 64, dtype=dtype, rotate=rotate, kv_layout=layout,
                    **scales) as kv:  # fmt: skip
        assert kv.rotate == (dtype == "int4" if rotate is None else rotate)
        if path == "append":
            for t in range(n):
                kv.append(k[t], v[t])
        elif path == "extend":
            kv.extend(k[:7], v[:7])
            kv.extend(k[7:], v[7:])
        elif path == "device":
            kv.extend(fd.to_device(k), fd.to_device(v))
        elif path == "async":
            for t in range(n):
                fd.kv_append_async(kv, fd.to_device(k[t]), fd.to_device(v[t]), stream=kv.stream)
        else:
            fd.kv_append_async(kv, fd.to_device(k[:8]), fd.to_device(v[:8]), stream=kv.stream)
            fd.kv_append_async(kv, fd.to_device(k[8:]), fd.to_device(v[8:]), stream=kv.stream)
        kv.synchronize()
        assert kv.seq_len == n
        _check_stored(kv, k, v, **scales)


@pytest.mark.parametrize("layout", [None, "NHD", "HND"])
@pytest.mark.parametrize("dtype,rotate", CASES)
def test_a_4bit_cache_stores_its_rows_in_its_layout(rng, dtype, rotate, layout):
    # head-major, [n_kv][capacity][...]: what the helpers compute for (token t, head h) is
    # the buffer's row t of head h, values and block scales alike (read raw, whole);
    # token-major, [capacity][n_kv][...]; None: head-major, the default
    n_kv, hd, cap, n = 3, 128, 40, 13
    scales = {"k_scale": np.float32(0.02), "v_scale": np.float32(0.005)} if dtype == "nvfp4" else {}
    k, v = _rows(rng, n, n_kv, hd)
    hnd = layout in ("HND", None)
    with fd.KVCache(n_kv, hd, cap, dtype=dtype, rotate=rotate, kv_layout=layout, **scales) as kv:
        kv.extend(k, v)
        kv.synchronize()
        rows = (n_kv, cap) if hnd else (cap, n_kv)
        assert kv.k_buffer.shape == kv.v_buffer.shape == (*rows, hd // 2)
        for name in ("k", "v"):  # (rows of head_dim elements: not what it holds)
            with pytest.raises(ValueError, match=f"^{name}: a 4-bit cache"):
                getattr(kv, name)
        (kw, ksw), (vw, vsw) = _expected(kv, k, v, **scales)
        raw = [
            a.to_host(kv.stream)
            for a in (kv.k_buffer, kv.v_buffer, kv.four_bit.k_scales, kv.four_bit.v_scales)
        ]
        for got, want in zip(raw, (kw, vw, ksw, vsw), strict=True):
            assert got.shape[:2] == rows
            _same_bytes(got[:, :n].transpose(1, 0, 2) if hnd else got[:n], want)


def _decode_checked(kv, q, n_heads, **features):
    """kv.decode(q) with its device output poisoned first, against the float64 reference
    on the dequantized cache."""
    kv.decode(q, n_heads=n_heads, **features)
    for dec in (*kv._decoders.values(), *kv.feature_decoders.values()):
        dec.out_dev.fill_bytes(0xFF, kv.stream)
    got = kv.decode(q, n_heads=n_heads, **features)
    k, v = kv.dequantized()
    dims = {"n_heads": n_heads, "n_kv_heads": kv.n_kv_heads, "head_dim": kv.head_dim}
    return got, fd.reference_gqa_decode(q, k, v, **dims, **features)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype,rotate", CASES)
@pytest.mark.parametrize("head_dim,n_heads,n_kv", [(64, 16, 2), (128, 32, 8), (128, 28, 4),
                                                   (256, 8, 1), (128, 8, 8)])  # fmt: skip
@pytest.mark.parametrize("qdt", [BF16, np.dtype(np.float16)])
def test_decode_matches_the_reference_on_the_dequantized_cache(
    rng, dtype, rotate, head_dim, n_heads, n_kv, qdt, layout
):
    with fd.KVCache(n_kv, head_dim, 5000, dtype=dtype, rotate=rotate, kv_layout=layout) as kv:
        q = rng.standard_normal((n_heads, head_dim)).astype(qdt)
        assert not kv.decode(q, n_heads=n_heads).astype(np.float32).any()  # seq_len 0
        done = 0
        for seq in (1, 2, 77, 1001, 4999):
            k, v = _rows(rng, seq - done, n_kv, head_dim)
            kv.extend(k, v)
            done = seq
            got, ref = _decode_checked(kv, q, n_heads)
            assert got.dtype == qdt and got.shape == q.shape
            err = rel_err(got.astype(np.float64), ref)
            assert err < TOL, (seq, err)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["int4", "nvfp4"])
def test_decode_with_every_feature(rng, dtype, layout):
    n_heads, n_kv, hd = 32, 8, 128
    sinks = rng.standard_normal(n_heads).astype(np.float32)
    slopes = (rng.uniform(0.0, 0.1, n_heads)).astype(np.float32)
    with fd.KVCache(n_kv, hd, 3000, dtype=dtype, kv_layout=layout) as kv:
        k, v = _rows(rng, 2999, n_kv, hd)
        kv.extend(k, v)
        q = rng.standard_normal((n_heads, hd)).astype(BF16)
        for feats in (
            {"sliding_window": 100},
            {"logits_soft_cap": 5.0, "scale": 0.3},
            {"sinks": sinks, "return_lse": True},
            {"alibi_slopes": slopes},
            {"sliding_window": 1, "sinks": sinks, "logits_soft_cap": 30.0, "return_lse": True},
        ):
            got, ref = _decode_checked(kv, q, n_heads, **feats)
            if feats.get("return_lse"):
                np.testing.assert_allclose(got[1], ref[1], rtol=2e-3, atol=LSE_ATOL)
                got, ref = got[0], ref[0]
            assert rel_err(got.astype(np.float64), ref) < TOL, feats


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["int4", "nvfp4"])
@pytest.mark.parametrize("n_q", [1, 2, 3, 5, 8])
def test_verify_of_several_queries(rng, dtype, n_q, layout):
    n_heads, n_kv, hd = 28, 4, 128
    with fd.KVCache(n_kv, hd, 2048, dtype=dtype, kv_layout=layout) as kv:
        k, v = _rows(rng, 1337, n_kv, hd)
        kv.extend(k, v)
        q = rng.standard_normal((n_q, n_heads, hd)).astype(BF16)
        got = kv.decode(q, n_heads=n_heads, sliding_window=700)
        kd, vd = kv.dequantized()
        ref = fd.reference_gqa_decode(q, kd, vd, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd,
                                      sliding_window=700)  # fmt: skip
        assert got.shape == q.shape
        assert rel_err(got.astype(np.float64), ref) < TOL


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["int4", "nvfp4"])
def test_a_graph_of_appends_and_decodes_serves_every_token(rng, dtype, layout):
    """kv_append_async and gqa_decode_async captured once at seq_len 1, replayed to 300."""
    n_heads, n_kv, hd, steps = 32, 8, 128, 300
    k, v = _rows(rng, steps, n_kv, hd, BF16)
    q = rng.standard_normal((n_heads, hd)).astype(BF16)
    dims = {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": hd}
    with fd.KVCache(n_kv, hd, steps, dtype=dtype, kv_layout=layout) as kv, fd.Stream() as stream:
        k_row, v_row = fd.empty((n_kv, hd), BF16), fd.empty((n_kv, hd), BF16)
        q_d, out = fd.to_device(q), fd.empty((n_heads, hd), BF16)
        kv.prepare(n_heads, q_dtype=BF16)
        with stream.capture() as graph:
            fd.kv_append_async(kv, k_row, v_row, stream=stream)
            fd.gqa_decode_async(q_d, kv, out, n_heads=n_heads, stream=stream)
        step = graph.instantiate()
        for t in range(steps):
            k_row.copy_from_host(k[t], stream)
            v_row.copy_from_host(v[t], stream)
            out.fill_bytes(0xFF, stream)
            step.launch(stream)
            if t + 1 not in (1, 2, 33, 299, 300):
                continue
            stream.synchronize()
            assert kv.seq_len == t + 1
            _check_stored(kv, k[: t + 1], v[: t + 1])
            kd, vd = kv.dequantized()
            ref = fd.reference_gqa_decode(q, kd, vd, **dims)
            assert rel_err(out.to_host().astype(np.float64), ref) < TOL, t
        step.close()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["int4", "nvfp4"])
def test_decode_graph_steps_a_four_bit_cache(rng, dtype, layout):
    n_heads, n_kv, hd, steps = 16, 4, 64, 200
    sinks = rng.standard_normal(n_heads).astype(np.float32)
    dims = {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": hd}
    with fd.KVCache(n_kv, hd, steps, dtype=dtype, kv_layout=layout) as kv:
        kv.extend(*_rows(rng, 10, n_kv, hd))
        with fd.DecodeGraph(kv, n_heads=n_heads, q_dtype=BF16, sliding_window=64, sinks=sinks,
                            return_lse=True) as graph:  # fmt: skip
            for t in range(10, steps):
                q = rng.standard_normal((n_heads, hd)).astype(BF16)
                k_tok, v_tok = (x[0] for x in _rows(rng, 1, n_kv, hd, BF16))
                out = graph(q, k_tok, v_tok)
                if t % 61:
                    continue
                assert kv.seq_len == t + 1
                kd, vd = kv.dequantized()
                ref, ref_lse = fd.reference_gqa_decode(
                    q, kd, vd, **dims, sliding_window=64, sinks=sinks, return_lse=True
                )
                assert rel_err(out.astype(np.float64), ref) < TOL, t
                np.testing.assert_allclose(graph.lse, ref_lse, rtol=2e-3, atol=LSE_ATOL)


def test_a_full_cache_refuses_the_row_and_keeps_every_token(rng):
    with fd.KVCache(2, 64, 5, dtype="int4") as kv:
        k, v = _rows(rng, 5, 2, 64)
        kv.extend(k, v)
        with pytest.raises(fd.KVCapacityError):
            kv.append(k[0], v[0])
        with pytest.raises(fd.KVCapacityError):
            kv.extend(k[:1], v[:1])
        kv.synchronize()
        assert kv.seq_len == 5
        _check_stored(kv, k, v)


def test_a_four_bit_cache_costs_its_format_error_and_rotation_lowers_int4s(rng):
    """The decode against the reference on the unquantized rows (K with an outlier
    channel): within 10% of the error of the reference on the rows the numpy helpers
    quantize (nothing lost on the device beyond the format), and int4 rotated (the default)
    below int4 plain."""
    n_heads, n_kv, hd = 32, 8, 128
    k, v = _rows(rng, 4096, n_kv, hd)
    q = rng.standard_normal((n_heads, hd)).astype(BF16)
    dims = {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": hd}
    ref = fd.reference_gqa_decode(q, k, v, **dims)
    errs = {}
    for dtype, rotate in (("int4", True), ("int4", False), ("nvfp4", False)):
        with fd.KVCache(n_kv, hd, 4096, dtype=dtype, rotate=rotate) as kv:
            kv.extend(k, v)
            err = rel_err(kv.decode(q, n_heads=n_heads).astype(np.float64), ref)
            if dtype == "int4":
                kq = fd.dequantize_int4(*fd.quantize_int4(fd.hadamard(k) if rotate else k))
                vq = fd.dequantize_int4(*fd.quantize_int4(v))
            else:
                kq = fd.dequantize_nvfp4(*fd.quantize_nvfp4(k, 1.0))
                vq = fd.dequantize_nvfp4(*fd.quantize_nvfp4(v, 1.0))
            host = rel_err(
                fd.reference_gqa_decode(q, fd.hadamard(kq) if rotate else kq, vq, **dims), ref
            )
            assert 1e-3 < err < 1.1 * host + 1e-2, (dtype, rotate, err, host)
            errs[dtype, rotate] = err
    assert errs["int4", True] < errs["int4", False], errs
