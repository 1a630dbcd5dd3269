"""fp8 KV caches on the GPU: rows quantized on the device bit for bit as fd.quantize_fp8
(ml_dtypes casts), and decodes against the float64 reference of the dequantized cache,
the kernel's output poisoned before each decode."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd

from ..helpers.gpu_helpers import rel_err

pytestmark = pytest.mark.gpu

FORMATS = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
Q_DTYPES = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}
TOL = 1e-2  # the bound against the reference of the dequantized cache


def _same_bytes(got, want):
    """fp8 arrays equal bit for bit, NaN where the other has NaN (any NaN pattern)."""
    g, w = got.astype(np.float32), want.astype(np.float32)
    assert (np.isnan(g) == np.isnan(w)).all()
    keep = ~np.isnan(w)
    assert (got.view(np.uint8)[keep] == want.view(np.uint8)[keep]).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("row_dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_quantized_rows_are_the_host_rounding_bit_for_bit(rng, fmt, row_dtype):
    n_kv, hd, n = 4, 64, 40
    k_scale, v_scale = np.array([0.5, 1.0, 3.0, 0.01], np.float32), 0.25
    k = (rng.standard_normal((n, n_kv, hd)) * 200).astype(row_dtype)
    v = (rng.standard_normal((n, n_kv, hd)) * 4).astype(row_dtype)
    k[0, 0, :4] = [np.nan, np.inf, -np.inf, 1e30 if row_dtype != np.float16 else 6e4]
    v[1, 2, :3] = [np.nan, -1e-7, 1e-30 if row_dtype != np.float16 else 1e-7]
    with fd.KVCache(n_kv, hd, 64, dtype=FORMATS[fmt], k_scale=k_scale, v_scale=v_scale) as kv:
        kv.extend(k[: n - 3], v[: n - 3])
        for i in range(n - 3, n):  # and one token at a time
            kv.append(k[i], v[i])
        got_k, got_v = kv.to_host()
        assert got_k.dtype == np.dtype(FORMATS[fmt]) and got_k.shape == (n, n_kv, hd)
        want_k = fd.quantize_fp8(k, FORMATS[fmt], k_scale)
        want_v = fd.quantize_fp8(v, FORMATS[fmt], v_scale)
        _same_bytes(got_k, want_k)
        _same_bytes(got_v, want_v)
        dk, dv = kv.dequantized()
        np.testing.assert_array_equal(dk, want_k.astype(np.float32) * k_scale[:, None])
        np.testing.assert_array_equal(dv, want_v.astype(np.float32) * np.float32(v_scale))


def test_appends_of_every_row_dtype_mixed_share_the_staging_ring(rng):
    """Rows of each dtype, K's and V's different, one token at a time past the staging
    ring's length: each token's bytes are the host rounding of its own rows."""
    n_kv, hd, n = 2, 40, 300
    dtypes = [np.float32, np.float16, ml_dtypes.bfloat16]
    k = rng.standard_normal((n, n_kv, hd)).astype(np.float32) * 50
    v = rng.standard_normal((n, n_kv, hd)).astype(np.float32) * 3
    k_rows = [k[i].astype(dtypes[i % 3]) for i in range(n)]
    v_rows = [v[i].astype(dtypes[(i // 3) % 3]) for i in range(n)]
    with fd.KVCache(n_kv, hd, n, dtype=FORMATS["e4m3"], k_scale=0.5, v_scale=0.125) as kv:
        for kr, vr in zip(k_rows, v_rows, strict=True):
            kv.append(kr, vr)
        got_k, got_v = kv.to_host()
    want_k = np.stack([fd.quantize_fp8(r, FORMATS["e4m3"], 0.5) for r in k_rows])
    want_v = np.stack([fd.quantize_fp8(r, FORMATS["e4m3"], 0.125) for r in v_rows])
    _same_bytes(got_k, want_k)
    _same_bytes(got_v, want_v)


def test_rows_too_large_to_pass_by_value_are_staged_and_both_paths_interleave(rng):
    """16 KV heads of 256: bfloat16 rows (16 KB for K and V) go in the append launch's
    arguments, float32 rows (32 KB) through the staging ring; alternated, each token holds
    its own rows' rounding and a decode reads every token (the device length is kept)."""
    n_kv, hd, n = 16, 256, 70
    k = rng.standard_normal((n, n_kv, hd)).astype(np.float32) * 30
    v = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    rows = [(k[i], v[i]) if i % 2 else (k[i].astype(ml_dtypes.bfloat16),
            v[i].astype(ml_dtypes.bfloat16)) for i in range(n)]  # fmt: skip
    with fd.KVCache(n_kv, hd, n, dtype=FORMATS["e4m3"], k_scale=0.25, v_scale=0.5) as kv:
        for kr, vr in rows:
            kv.append(kr, vr)
        got_k, got_v = kv.to_host()
        _same_bytes(got_k, np.stack([fd.quantize_fp8(r, FORMATS["e4m3"], 0.25) for r, _ in rows]))
        _same_bytes(got_v, np.stack([fd.quantize_fp8(r, FORMATS["e4m3"], 0.5) for _, r in rows]))
        q = rng.standard_normal((n_kv, hd)).astype(ml_dtypes.bfloat16)
        got, ref = _decode_checked(kv, q, n_kv)
        np.testing.assert_allclose(got.astype(np.float64), ref, rtol=1e-2, atol=1e-2)


def _decode_checked(kv, q, n_heads, **features):
    """kv.decode(q) with the decoder's device output poisoned (NaN) before the kernels run,
    against the float64 reference of the dequantized cache."""
    kv.decode(q, n_heads=n_heads, **features)  # makes the decoder
    decoders = [*kv._decoders.values(), *kv.feature_decoders.values()]
    for dec in decoders:
        dec.out_dev.fill_bytes(0xFF, kv.stream)
    got = kv.decode(q, n_heads=n_heads, **features)
    k, v = kv.dequantized()
    dims = {"n_heads": n_heads, "n_kv_heads": kv.n_kv_heads, "head_dim": kv.head_dim}
    ref = fd.reference_gqa_decode(q, k, v, **dims, **features)
    return got, ref


GRID = (
    [("e4m3", "bf16", hd, nh) for hd in (64, 80, 96, 128, 256) for nh in (8, 32, 64)]
    + [(fmt, qdt, hd, 32) for fmt, qdt in (("e4m3", "f16"), ("e5m2", "bf16")) for hd in (80, 128)]
    + [("e4m3", "bf16", hd, 32) for hd in (8, 24, 40, 72, 200)]
)  # rows of 8-byte chunks


@pytest.mark.parametrize("fmt,qdt,head_dim,n_heads", GRID)
def test_fp8_decode_matches_the_reference_of_the_dequantized_cache(
    rng, fmt, qdt, head_dim, n_heads
):
    n_kv = 8  # groups of 1, 4 and 8
    k_scale = (rng.uniform(0.5, 2.0, n_kv) / 16).astype(np.float32)
    with fd.KVCache(n_kv, head_dim, 4097, dtype=FORMATS[fmt], k_scale=k_scale,
                    v_scale=0.02) as kv:  # fmt: skip
        q = rng.standard_normal((n_heads, head_dim)).astype(Q_DTYPES[qdt])
        assert not kv.decode(q, n_heads=n_heads).any()  # seq_len 0: zeros
        done = 0
        for seq in (1, 77, 4097):
            k = rng.standard_normal((seq - done, n_kv, head_dim)) * 16
            v = rng.standard_normal((seq - done, n_kv, head_dim)) * 0.05
            kv.extend(k.astype(np.float32), v.astype(np.float32))
            done = seq
            got, ref = _decode_checked(kv, q, n_heads)
            assert got.dtype == q.dtype and got.shape == q.shape
            err = rel_err(got.astype(np.float64), ref)
            assert err < TOL, (seq, err)


def test_fp8_decode_of_131072_tokens(rng):
    n_heads, n_kv, hd, seq = 32, 8, 128, 131072
    with fd.KVCache(n_kv, hd, seq, dtype=FORMATS["e4m3"], k_scale=0.01, v_scale=0.01) as kv:
        k = (rng.standard_normal((seq, n_kv, hd)) * 2).astype(np.float32)
        v = rng.standard_normal((seq, n_kv, hd)).astype(np.float32)
        kv.extend(k, v)
        q = rng.standard_normal((n_heads, hd)).astype(ml_dtypes.bfloat16)
        got, ref = _decode_checked(kv, q, n_heads)
        assert rel_err(got.astype(np.float64), ref) < TOL


def test_fp8_decode_with_features(rng):
    n_heads, n_kv, hd = 32, 8, 128
    kw = {"sliding_window": 96, "logits_soft_cap": 5.0, "return_lse": True,
          "sinks": rng.standard_normal(n_heads).astype(np.float32),
          "alibi_slopes": (2.0 ** -np.arange(1, n_heads + 1) * 4).astype(np.float32)}  # fmt: skip
    with fd.KVCache(n_kv, hd, 512, dtype=FORMATS["e4m3"], k_scale=0.05, v_scale=0.1) as kv:
        q = rng.standard_normal((n_heads, hd)).astype(ml_dtypes.bfloat16)
        for seq in (95, 97, 300):
            rows = rng.standard_normal((seq - kv.seq_len, n_kv, hd)).astype(np.float32)
            kv.extend(rows, rows * 0.5)
            (got, lse), (ref, ref_lse) = _decode_checked(kv, q, n_heads, **kw)
            assert rel_err(got.astype(np.float64), ref) < TOL
            np.testing.assert_allclose(lse, ref_lse, rtol=1e-3, atol=1e-3)


def test_bf16_q_past_the_range_of_fp16_is_scaled_not_lost(rng):
    """The kernels' mmas are fp16: each head's q is scaled by a power of two first."""
    n_heads, n_kv, hd = 16, 4, 64
    with fd.KVCache(n_kv, hd, 256, dtype=FORMATS["e4m3"], k_scale=1e-3) as kv:
        kv.extend(rng.standard_normal((200, n_kv, hd)).astype(np.float32),
                  rng.standard_normal((200, n_kv, hd)).astype(np.float32))  # fmt: skip
        q = rng.standard_normal((n_heads, hd)) * 4e5  # past fp16's 65504
        q[1] *= 1e-9  # and a head near zero
        q = q.astype(ml_dtypes.bfloat16)
        got, ref = _decode_checked(kv, q, n_heads)
        assert np.isfinite(got.astype(np.float32)).all()
        assert rel_err(got.astype(np.float64), ref) < TOL


def test_new_scales_apply_to_the_tokens_already_stored(rng):
    n_heads, n_kv, hd = 8, 2, 64
    with fd.KVCache(n_kv, hd, 64, dtype=FORMATS["e5m2"]) as kv:
        kv.extend(rng.standard_normal((50, n_kv, hd)).astype(np.float16),
                  rng.standard_normal((50, n_kv, hd)).astype(np.float16))  # fmt: skip
        q = rng.standard_normal((n_heads, hd)).astype(np.float16)
        before = kv.decode(q, n_heads=n_heads)
        kv.set_scales(k_scale=[0.25, 4.0], v_scale=3.0)
        np.testing.assert_array_equal(kv.k_scale, [0.25, 4.0])
        got, ref = _decode_checked(kv, q, n_heads)
        assert rel_err(got.astype(np.float64), ref) < TOL
        assert np.abs(got.astype(np.float32) - before.astype(np.float32)).max() > 0.1


def test_fp8_caches_refuse_what_is_not_built_yet(rng):
    with fd.KVCache(2, 64, 16, dtype=FORMATS["e4m3"]) as kv:
        kv.append(np.ones(128, np.float32), np.ones(128, np.float32))
        q = np.ones((8, 64), np.float32)
        with pytest.raises(TypeError, match="float16 or bfloat16"):
            kv.decode(q, n_heads=8)
        with pytest.raises(ValueError, match="algorithm"):
            kv.decode(q.astype(np.float16), n_heads=8, algorithm="parity")
        qd = fd.to_device(q)  # float32 q
        with pytest.raises(TypeError, match="q_dev: expected"):
            fd.gqa_decode_async(qd, kv, qd, n_heads=8, stream=kv.stream)
        q16, out_bf16 = fd.to_device(q.astype(np.float16)), fd.empty((8, 64), ml_dtypes.bfloat16)
        with pytest.raises(TypeError, match="out_dev: expected dtype float16"):
            fd.gqa_decode_async(q16, kv, out_bf16, n_heads=8, stream=kv.stream)
        with pytest.raises(TypeError, match="q_dtype"):
            fd.DecodeGraph(kv, n_heads=8, q_dtype=np.float32)
        with pytest.raises(TypeError, match="q_dtype"):
            kv.prepare(8, q_dtype=np.float32)
        with pytest.raises(TypeError, match="float32, float16 or bfloat16 rows"):
            kv.append(np.ones(128, np.int32), np.ones(128, np.int32))
        rows_i8 = fd.to_device(np.ones(128, np.int8))
        with pytest.raises(TypeError, match="k_dev"):
            fd.kv_append_async(kv, rows_i8, rows_i8, stream=kv.stream)
        assert kv.seq_len == 1  # nothing appended by the refusals


@pytest.mark.parametrize("qdt", ["bf16", "f16"])
def test_a_graph_of_fp8_appends_and_decodes_captured_once_serves_every_token(rng, qdt):
    """kv_append_async of 16-bit device rows (quantized on the device) and
    gqa_decode_async captured at seq_len 1, replayed to 600 tokens; with a window, sinks
    and the LSE in a second graph."""
    dt = Q_DTYPES[qdt]
    n_heads, n_kv, hd, steps, window = 32, 8, 128, 600, 200
    k = (rng.standard_normal((steps, n_kv, hd)) * 3).astype(dt)
    v = rng.standard_normal((steps, n_kv, hd)).astype(dt)
    q = rng.standard_normal((n_heads, hd)).astype(dt)
    sinks = rng.standard_normal(n_heads).astype(np.float32)
    dims = {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": hd}
    with (fd.KVCache(n_kv, hd, steps, dtype=FORMATS["e4m3"], k_scale=0.02, v_scale=0.01) as kv,
          fd.Stream() as stream):  # fmt: skip
        k_row, v_row = fd.empty((n_kv, hd), dt), fd.empty((n_kv, hd), dt)
        q_d, sinks_d = fd.to_device(q), fd.to_device(sinks)
        kv.prepare(n_heads, q_dtype=dt)
        kv.prepare(n_heads, q_dtype=dt, sliding_window=window, sinks=sinks_d, return_lse=True)
        out, out_w = fd.empty((n_heads, hd), dt), fd.empty((n_heads, hd), dt)
        lse = fd.empty((n_heads,), np.float32)
        with stream.capture() as graph:
            fd.kv_append_async(kv, k_row, v_row, stream=stream)
            fd.gqa_decode_async(q_d, kv, out, n_heads=n_heads, stream=stream)
        step = graph.instantiate()
        with stream.capture() as graph_w:
            fd.gqa_decode_async(q_d, kv, out_w, n_heads=n_heads, stream=stream,
                                sliding_window=window, sinks=sinks_d, out_lse=lse)  # fmt: skip
        windowed = graph_w.instantiate()
        for t in range(steps):
            k_row.copy_from_host(k[t], stream)
            v_row.copy_from_host(v[t], stream)
            out.fill_bytes(0xFF, stream)
            step.launch(stream)
            if t + 1 not in (1, 2, 199, 200, 201, 599, 600):
                continue
            out_w.fill_bytes(0xFF, stream)
            windowed.launch(stream)
            stream.synchronize()
            assert kv.seq_len == t + 1
            kq, vq = kv.to_host()
            _same_bytes(kq, fd.quantize_fp8(k[: t + 1], FORMATS["e4m3"], 0.02))
            _same_bytes(vq, fd.quantize_fp8(v[: t + 1], FORMATS["e4m3"], 0.01))
            kd, vd = kv.dequantized()
            ref = fd.reference_gqa_decode(q, kd, vd, **dims)
            assert rel_err(out.to_host().astype(np.float64), ref) < TOL, t
            ref_w, ref_lse = fd.reference_gqa_decode(
                q, kd, vd, **dims, sliding_window=window, sinks=sinks, return_lse=True
            )
            assert rel_err(out_w.to_host().astype(np.float64), ref_w) < TOL, t
            np.testing.assert_allclose(lse.to_host(), ref_lse, rtol=1e-3, atol=1e-3)
        step.close()
        windowed.close()


def test_decode_graph_steps_an_fp8_cache(rng):
    """DecodeGraph of an fp8 cache: bf16 q and rows in, each step's rows quantized on the
    device, the result in bf16; features too."""
    dt = ml_dtypes.bfloat16
    n_heads, n_kv, hd, steps = 16, 4, 64, 300
    sinks = rng.standard_normal(n_heads).astype(np.float32)
    dims = {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": hd}
    with fd.KVCache(n_kv, hd, steps, dtype=FORMATS["e5m2"], k_scale=0.05, v_scale=0.1) as kv:
        kv.extend(rng.standard_normal((10, n_kv, hd)).astype(np.float32),
                  rng.standard_normal((10, n_kv, hd)).astype(np.float32))  # fmt: skip
        with fd.DecodeGraph(kv, n_heads=n_heads, q_dtype=dt, sliding_window=64, sinks=sinks,
                            return_lse=True) as graph:  # fmt: skip
            assert graph.dtype == np.dtype(dt)
            for t in range(10, steps):
                q = rng.standard_normal((n_heads, hd)).astype(dt)
                k_tok = rng.standard_normal((n_kv, hd)).astype(dt)
                v_tok = rng.standard_normal((n_kv, hd)).astype(dt)
                out = graph(q, k_tok, v_tok)
                if t % 97:
                    continue
                assert out.dtype == np.dtype(dt) and kv.seq_len == t + 1
                kd, vd = kv.dequantized()
                np.testing.assert_array_equal(
                    kd[t],
                    fd.quantize_fp8(k_tok, FORMATS["e5m2"], 0.05).astype(np.float32)
                    * np.float32(0.05),
                )
                ref, ref_lse = fd.reference_gqa_decode(
                    q, kd, vd, **dims, sliding_window=64, sinks=sinks, return_lse=True
                )
                assert rel_err(out.astype(np.float64), ref) < TOL, t
                np.testing.assert_allclose(graph.lse, ref_lse, rtol=1e-3, atol=1e-3)
