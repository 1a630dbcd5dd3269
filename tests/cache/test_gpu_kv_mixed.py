"""KVCaches of K and V in formats of their own (``v_dtype``: fp8 K with int4 or nvfp4 V, as
llama.cpp's q8_0 K and q4_0 V, and the other pairs): what every append path stores is, side
by side, what the public numpy helpers compute, bit for bit (a 4-bit K rotated first where
the cache rotates); decodes on the rows kernel (one query and several, features, graphs)
match the float64 reference on the dequantized cache; fresh random inputs, outputs
poisoned."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd

from ..helpers.gpu_helpers import rel_err

pytestmark = pytest.mark.gpu

TOL = 2e-2
LSE_ATOL = 3e-2  # (a rotated q is rounded to fp16 after its rotation: test_gpu_kv4_cache.py)
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
FOUR_BIT = ("int4", "nvfp4")

# (K's dtype, V's, rotate)
PAIRS = [
    (E4M3, "int4", None),  # llama.cpp's q8_0 K, q4_0 V
    (E4M3, "nvfp4", None),
    ("int4", E4M3, None),  # a rotated int4 K
    ("nvfp4", E5M2, True),
    ("int4", "nvfp4", False),
]
IDS = ["e4m3-int4", "e4m3-nvfp4", "int4r-e4m3", "nvfp4r-e5m2", "int4-nvfp4"]


def _rows(rng, n, n_kv, d, dt=np.float32):
    k = rng.standard_normal((n, n_kv, d)) * 2
    k[:, :, 5] *= 30  # an outlier channel, as real models' K have
    v = rng.standard_normal((n, n_kv, d))
    return k.astype(dt), v.astype(dt)


def _scales(rng, dtype, v_dtype, n_kv):
    """Per-head scales for the fp8 and nvfp4 sides (an int4 side takes none)."""
    out = {}
    for fmt, name, size in ((dtype, "k_scale", 0.5), (v_dtype, "v_scale", 0.01)):
        if fmt != "int4":
            base = size if fmt == "nvfp4" else size * 2
            out[name] = (base * rng.uniform(0.5, 2.0, n_kv)).astype(np.float32)
    return out


def _side(fmt, x, scale):
    """(values, block scales or None) of one side as the public helpers compute them."""
    if fmt == "int4":
        return fd.quantize_int4(x)
    if fmt == "nvfp4":
        return fd.quantize_nvfp4(x, scale)[:2]
    return fd.quantize_fp8(x, fmt, scale), None


def _same_bytes(got, want):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


def _check_stored(kv, k, v):
    kf = k.astype(np.float32)
    if kv.rotate:
        kf = fd.hadamard(kf)
    k_fmt = "int4" if kv.dtype == np.dtype(ml_dtypes.int4) else (
        "nvfp4" if kv.dtype == np.dtype(ml_dtypes.float4_e2m1fn) else kv.dtype)  # fmt: skip
    v_fmt = "int4" if kv.v_dtype == np.dtype(ml_dtypes.int4) else (
        "nvfp4" if kv.v_dtype == np.dtype(ml_dtypes.float4_e2m1fn) else kv.v_dtype)  # fmt: skip
    ones = np.ones(kv.n_kv_heads, np.float32)
    kw, ksw = _side(k_fmt, kf, ones if kv.k_scale is None else kv.k_scale)
    vw, vsw = _side(v_fmt, v.astype(np.float32), ones if kv.v_scale is None else kv.v_scale)
    kq, vq = kv.to_host()
    ks, vs = kv.block_scales()
    _same_bytes(kq, kw)
    _same_bytes(vq, vw)
    for got, want in ((ks, ksw), (vs, vsw)):
        assert (got is None) == (want is None)
        if want is not None:
            _same_bytes(got, want)


@pytest.mark.parametrize("dtype,v_dtype,rotate", PAIRS, ids=IDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("path", ["append", "extend", "device", "async", "async_rows"])
def test_every_append_path_stores_each_side_as_the_helpers_compute(
    rng, dtype, v_dtype, rotate, head_dim, path
):
    n_kv, n = 3, 21
    scales = _scales(rng, dtype, v_dtype, n_kv)
    rows_dt = {"append": BF16, "extend": np.float32, "device": np.float16}.get(path, BF16)
    k, v = _rows(rng, n, n_kv, head_dim, rows_dt)
    with fd.KVCache(n_kv, head_dim, 64, dtype=dtype, v_dtype=v_dtype, rotate=rotate,
                    **scales) as kv:  # fmt: skip
        assert kv.rotate == (dtype == "int4" if rotate is None else rotate)
        assert kv.v_dtype != kv.dtype
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
        _check_stored(kv, k, v)


def test_the_scales_are_each_sides_own(rng):
    with fd.KVCache(4, 128, 16, dtype=E4M3, v_dtype="int4", k_scale=0.25) as kv:
        np.testing.assert_array_equal(kv.k_scale, np.full(4, 0.25, np.float32))
        assert kv.v_scale is None  # (int4 groups scale themselves)
        with pytest.raises(ValueError, match="v_scale: V is int4 here"):
            kv.set_scales(v_scale=2.0)
        kv.set_scales(k_scale=0.5)  # stored tokens read with it too
        k, v = _rows(rng, 5, 4, 128)
        kv.extend(k, v)
        _check_stored(kv, k, v)
        kd, vd = kv.dequantized()
        want = fd.quantize_fp8(k, E4M3, np.full(4, 0.5, np.float32)).astype(np.float32) * 0.5
        np.testing.assert_array_equal(kd, want)
        np.testing.assert_array_equal(vd, fd.dequantize_int4(*fd.quantize_int4(v)))


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


@pytest.mark.parametrize("dtype,v_dtype,rotate", PAIRS, ids=IDS)
@pytest.mark.parametrize("head_dim,n_heads,n_kv", [(64, 16, 2), (128, 32, 8), (128, 28, 4),
                                                   (256, 8, 1), (128, 8, 8)])  # fmt: skip
@pytest.mark.parametrize("qdt", [BF16, np.dtype(np.float16)])
def test_decode_matches_the_reference_on_the_dequantized_cache(
    rng, dtype, v_dtype, rotate, head_dim, n_heads, n_kv, qdt
):
    scales = _scales(rng, dtype, v_dtype, n_kv)
    with fd.KVCache(n_kv, head_dim, 5000, dtype=dtype, v_dtype=v_dtype, rotate=rotate,
                    **scales) as kv:  # fmt: skip
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


@pytest.mark.parametrize("dtype,v_dtype,rotate", PAIRS, ids=IDS)
def test_decode_with_every_feature(rng, dtype, v_dtype, rotate):
    n_heads, n_kv, hd = 32, 8, 128
    sinks = rng.standard_normal(n_heads).astype(np.float32)
    slopes = (rng.uniform(0.0, 0.1, n_heads)).astype(np.float32)
    with fd.KVCache(n_kv, hd, 3000, dtype=dtype, v_dtype=v_dtype, rotate=rotate) as kv:
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


@pytest.mark.parametrize("dtype,v_dtype,rotate", PAIRS, ids=IDS)
@pytest.mark.parametrize("n_q", [1, 2, 3, 5, 8])
def test_verify_of_several_queries(rng, dtype, v_dtype, rotate, n_q):
    n_heads, n_kv, hd = 28, 4, 128
    with fd.KVCache(n_kv, hd, 2048, dtype=dtype, v_dtype=v_dtype, rotate=rotate) as kv:
        k, v = _rows(rng, 1337, n_kv, hd)
        kv.extend(k, v)
        q = rng.standard_normal((n_q, n_heads, hd)).astype(BF16)
        got = kv.decode(q, n_heads=n_heads, sliding_window=700)
        kd, vd = kv.dequantized()
        ref = fd.reference_gqa_decode(q, kd, vd, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd,
                                      sliding_window=700)  # fmt: skip
        assert got.shape == q.shape
        assert rel_err(got.astype(np.float64), ref) < TOL


def test_a_tree_verify_on_the_device(rng):
    n_heads, n_kv, hd, n_q = 16, 2, 64, 5
    mask = np.tril(rng.random((n_q, n_q)) < 0.6) | np.eye(n_q, dtype=bool)
    with fd.KVCache(n_kv, hd, 512, dtype=E4M3, v_dtype="int4") as kv:
        kv.extend(*_rows(rng, 300, n_kv, hd))
        q = rng.standard_normal((n_q, n_heads, hd)).astype(BF16)
        q_d, out = fd.to_device(q), fd.empty((n_q, n_heads, hd), BF16)
        out.fill_bytes(0xFF, kv.stream)
        fd.gqa_decode_async(q_d, kv, out, n_heads=n_heads, stream=kv.stream,
                            tree_mask=fd.to_device(mask))  # fmt: skip
        kv.stream.synchronize()
        kd, vd = kv.dequantized()
        ref = fd.reference_gqa_decode(q, kd, vd, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd,
                                      tree_mask=mask)  # fmt: skip
        assert rel_err(out.to_host().astype(np.float64), ref) < TOL


@pytest.mark.parametrize("dtype,v_dtype,rotate", PAIRS[:3], ids=IDS[:3])
def test_a_graph_of_appends_and_decodes_serves_every_token(rng, dtype, v_dtype, rotate):
    """kv_append_async and gqa_decode_async captured once at seq_len 1, replayed to 300."""
    n_heads, n_kv, hd, steps = 32, 8, 128, 300
    k, v = _rows(rng, steps, n_kv, hd, BF16)
    q = rng.standard_normal((n_heads, hd)).astype(BF16)
    dims = {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": hd}
    with (fd.KVCache(n_kv, hd, steps, dtype=dtype, v_dtype=v_dtype, rotate=rotate) as kv,
          fd.Stream() as stream):  # fmt: skip
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


@pytest.mark.parametrize("dtype,v_dtype,rotate", PAIRS[:3], ids=IDS[:3])
def test_decode_graph_steps_a_mixed_cache(rng, dtype, v_dtype, rotate):
    n_heads, n_kv, hd, steps = 16, 4, 64, 200
    sinks = rng.standard_normal(n_heads).astype(np.float32)
    dims = {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": hd}
    with fd.KVCache(n_kv, hd, steps, dtype=dtype, v_dtype=v_dtype, rotate=rotate) as kv:
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


def test_a_layer_cache_passes_the_formats_to_every_layer(rng):
    n_heads, n_kv, hd = 16, 4, 128
    with fd.LayerKVCache(3, n_kv, hd, 64, dtype=E4M3, v_dtype="int4", k_scale=0.5) as layers:
        assert layers.dtype == E4M3 and layers.v_dtype == np.dtype(ml_dtypes.int4)
        for kv in layers:
            assert kv.v_dtype == layers.v_dtype and not kv.rotate
            np.testing.assert_array_equal(kv.k_scale, np.full(n_kv, 0.5, np.float32))
            k, v = _rows(rng, 33, n_kv, hd)
            kv.extend(k, v)
            _check_stored(kv, k, v)
            q = rng.standard_normal((n_heads, hd)).astype(BF16)
            got, ref = _decode_checked(kv, q, n_heads)
            assert rel_err(got.astype(np.float64), ref) < TOL


def test_a_full_cache_refuses_the_row_and_keeps_every_token(rng):
    with fd.KVCache(2, 64, 5, dtype=E4M3, v_dtype="nvfp4") as kv:
        k, v = _rows(rng, 5, 2, 64)
        kv.extend(k, v)
        with pytest.raises(fd.KVCapacityError):
            kv.append(k[0], v[0])
        with pytest.raises(fd.KVCapacityError):
            kv.extend(k[:1], v[:1])
        kv.synchronize()
        assert kv.seq_len == 5
        _check_stored(kv, k, v)


def test_the_parity_kernel_refuses_a_mixed_cache_by_name(rng):
    with fd.KVCache(2, 64, 8, dtype=E4M3, v_dtype="int4") as kv:
        kv.extend(*_rows(rng, 3, 2, 64))
        q = rng.standard_normal((8, 64)).astype(BF16)
        with pytest.raises(ValueError, match="algorithm"):
            kv.decode(q, n_heads=8, algorithm="parity")


def test_fp8_k_with_int4_v_errs_between_its_formats(rng):
    """Against the reference on the unquantized rows: within 10% of the error of the
    reference on the rows the numpy helpers quantize (nothing lost on the device beyond
    the formats), and below an int4 cache's (K in fp8). Over eight queries: K's outlier
    channel makes the softmax sharp, so one query's errors swing with which tokens win
    (on the host, one query's ratio of the two errors reached 0.99 in 40 draws; eight
    queries' 0.61 +- 0.06)."""
    n_heads, n_kv, hd = 32, 8, 128
    k, v = _rows(rng, 4096, n_kv, hd)
    qs = [rng.standard_normal((n_heads, hd)).astype(BF16) for _ in range(8)]
    dims = {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": hd}
    ref = np.stack([fd.reference_gqa_decode(q, k, v, **dims) for q in qs])

    def decodes(kv):
        return np.stack([kv.decode(q, n_heads=n_heads).astype(np.float64) for q in qs])

    with fd.KVCache(n_kv, hd, 4096, dtype=E4M3, v_dtype="int4") as kv:
        kv.extend(k, v)
        err = rel_err(decodes(kv), ref)
    kq = fd.quantize_fp8(k, E4M3).astype(np.float32)
    vq = fd.dequantize_int4(*fd.quantize_int4(v))
    host = rel_err(np.stack([fd.reference_gqa_decode(q, kq, vq, **dims) for q in qs]), ref)
    assert 1e-3 < err < 1.1 * host + 1e-2, (err, host)
    with fd.KVCache(n_kv, hd, 4096, dtype="int4") as kv:
        kv.extend(k, v)
        int4 = rel_err(decodes(kv), ref)
    assert err < int4, (err, int4)
