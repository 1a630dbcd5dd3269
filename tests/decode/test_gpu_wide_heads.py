"""Head dims 257..512 on the GPU (issue 50, first part: the CUDA-core _d512 kernels) against
the float64 reference, fresh random inputs, outputs poisoned (NaN) before each kernel: every
dtype, MHA, MQA and GQA (groups past 8 too), seq_len 0, 1, odd and thousands, fp8 caches,
the features, both layouts, many queries, the parity kernel, graphs and the torch op."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.decode import launches

from ..helpers.gpu_helpers import DTYPES, TOL, feature_kwargs, poisoned, rel_err

pytestmark = pytest.mark.gpu

HEAD_DIMS = [264, 289, 320, 384, 448, 512]  # 289: odd (scalar loads)
SHAPES = [(8, 8), (8, 1), (16, 4), (32, 2)]  # MHA, MQA, GQA of 4, of 16 (4 head tiles)
SEQS = (0, 1, 37, 4099)
LSE_TOL = {"f32": 1e-4, "f16": 2e-2, "bf16": 2e-2}
FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
Q_DTYPES = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}


def _features(rng, n_heads, which):
    return feature_kwargs(rng, n_heads, which, window=96, scale=0.03)


def _inputs(rng, lead, n_kv, head_dim, seq, dt, layout="NHD"):
    q = rng.standard_normal((*lead, head_dim)).astype(dt)
    shape = (seq, n_kv, head_dim) if layout == "NHD" else (n_kv, seq, head_dim)
    return q, rng.standard_normal(shape).astype(dt), rng.standard_normal(shape).astype(dt)


def _check(rng, dtype, n_heads, n_kv, head_dim, seq, kw=None, layout="NHD", n_q=0):
    """gqa_decode on device arrays into a poisoned output, with its LSE, against the
    reference; n_q > 0: q of (n_q, n_heads, head_dim), a verify."""
    kw = kw or {}
    lead = (n_q, n_heads) if n_q else (n_heads,)
    q, k, v = _inputs(rng, lead, n_kv, head_dim, seq, DTYPES[dtype], layout)
    ref, ref_lse = fd.reference_gqa_decode(q, k, v, return_lse=True, kv_layout=layout, **kw)
    out = poisoned(q.shape, q.dtype)
    got, lse = fd.gqa_decode(fd.to_device(q), fd.to_device(k), fd.to_device(v), out=out,
                             return_lse=True, kv_layout=layout, **kw)  # fmt: skip
    got, lse = got.to_host().astype(np.float64), lse.to_host()
    assert got.shape == q.shape and lse.shape == lead
    assert np.isfinite(got).all()
    if seq == 0 and "sinks" not in kw:
        assert not got.any() and (lse == -np.inf).all()
        return
    assert rel_err(got, ref) < TOL[dtype], (seq, rel_err(got, ref))
    np.testing.assert_allclose(lse, ref_lse, rtol=LSE_TOL[dtype], atol=LSE_TOL[dtype])


def test_wide_heads_plan_on_the_cuda_core_d512_kernels(device):
    """(so that the tests below exercise the kernels they are about)"""
    for dt in (np.float32, np.float16, ml_dtypes.bfloat16):
        p = launches.plan_split(device, np.dtype(dt), 32, 2, 320, 4096)
        assert p.spec.family == "generic" and p.kernel.endswith("_d512"), p.kernel
    fp8 = launches.plan_split(device, np.dtype(np.float16), 16, 4, 512, 4096, fp8="e4m3")
    assert fp8.kernel == "gqa_split_f16_e4m3_g4_vec_d512_x0"


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("n_heads,n_kv", SHAPES)
def test_decode_matches_the_reference(rng, dtype, head_dim, n_heads, n_kv):
    for seq in SEQS:
        _check(rng, dtype, n_heads, n_kv, head_dim, seq)


def test_a_long_sequence_of_many_chunks(rng):
    for dtype in ("f32", "bf16"):
        _check(rng, dtype, 16, 2, 512, 30011)


def test_numpy_in_numpy_out(rng):
    q, k, v = _inputs(rng, (8,), 2, 320, 999, np.float32)
    got = fd.gqa_decode(q, k, v)
    assert isinstance(got, np.ndarray) and got.shape == q.shape
    assert rel_err(got, fd.reference_gqa_decode(q, k, v)) < TOL["f32"]


COMBOS = ["window", "cap", "sinks", "alibi", "scale", "window+cap+sinks+alibi+scale"]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("combo", COMBOS)
def test_every_feature_both_layouts(rng, combo, layout):
    kw = _features(rng, 16, combo)
    for dtype, head_dim in (("bf16", 512), ("f32", 289), ("f16", 320)):
        for seq in (0, 1, 95, 96, 97, 2049) if layout == "NHD" else (1, 97, 2049):
            _check(rng, dtype, 16, 4, head_dim, seq, kw, layout)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("n_q", [2, 5])
def test_many_queries_causal_and_under_a_tree_mask(rng, dtype, n_q):
    kw = _features(rng, 16, "window+cap+sinks+alibi+scale")
    for head_dim, seq in ((512, n_q), (320, 301), (289, 1000 + n_q)):
        _check(rng, dtype, 16, 4, head_dim, seq, n_q=n_q)
        _check(rng, dtype, 16, 4, head_dim, seq, kw, layout="HND", n_q=n_q)
    # a tree: each new token sees its parent chain (and the diagonal)
    mask = np.eye(n_q, dtype=bool)
    for t in range(1, n_q):
        mask[t] |= mask[int(rng.integers(0, t))]
    q, k, v = _inputs(rng, (n_q, 8), 2, 384, 200, DTYPES[dtype])
    ref = fd.reference_gqa_decode(q, k, v, tree_mask=mask)
    got = fd.gqa_decode(fd.to_device(q), fd.to_device(k), fd.to_device(v), tree_mask=mask,
                        out=poisoned(q.shape, q.dtype)).to_host()  # fmt: skip
    assert rel_err(got, ref) < TOL[dtype]


def _fp8_checked(kv, q, n_heads, **features):
    """kv.decode(q) with the decoders' device outputs poisoned before the kernels run,
    against the reference of the dequantized cache (with the LSE where asked)."""
    kv.decode(q, n_heads=n_heads, **features)  # makes the decoder
    for dec in [*kv._decoders.values(), *kv.feature_decoders.values()]:
        dec.out_dev.fill_bytes(0xFF, kv.stream)
    got = kv.decode(q, n_heads=n_heads, **features)
    k, v = kv.dequantized()
    ref = fd.reference_gqa_decode(q, k, v, n_heads=n_heads, n_kv_heads=kv.n_kv_heads,
                                  head_dim=kv.head_dim, **features)  # fmt: skip
    return got, ref


@pytest.mark.parametrize("fmt,qdt", [("e4m3", "bf16"), ("e5m2", "f16"), ("e4m3", "f16")])
@pytest.mark.parametrize("head_dim", [264, 320, 512])
@pytest.mark.parametrize("n_heads", [4, 16, 32])
def test_fp8_caches_match_the_reference_of_the_dequantized_cache(rng, fmt, qdt, head_dim,
                                                                 n_heads):  # fmt: skip
    n_kv = 4  # groups of 1, 4 and 8
    k_scale = (rng.uniform(0.5, 2.0, n_kv) / 16).astype(np.float32)
    with fd.KVCache(n_kv, head_dim, 4097, dtype=FP8[fmt], k_scale=k_scale,
                    v_scale=0.02) as kv:  # fmt: skip
        q = rng.standard_normal((n_heads, head_dim)).astype(Q_DTYPES[qdt])
        assert not kv.decode(q, n_heads=n_heads).any()  # seq_len 0: zeros
        done = 0
        for seq in (1, 77, 4097):
            k = rng.standard_normal((seq - done, n_kv, head_dim)) * 16
            v = rng.standard_normal((seq - done, n_kv, head_dim)) * 0.05
            kv.extend(k.astype(np.float32), v.astype(np.float32))
            done = seq
            got, ref = _fp8_checked(kv, q, n_heads)
            assert got.dtype == q.dtype and got.shape == q.shape
            assert rel_err(got.astype(np.float64), ref) < 2e-2, seq
        kw = _features(rng, n_heads, "window+cap+sinks+alibi+scale")
        (got, lse), (ref, ref_lse) = _fp8_checked(kv, q, n_heads, return_lse=True, **kw)
        assert rel_err(got.astype(np.float64), ref) < 2e-2
        np.testing.assert_allclose(lse, ref_lse, rtol=3e-2, atol=3e-2)
        # a verify: the cache's last 3 tokens are the queries'
        qs = rng.standard_normal((3, n_heads, head_dim)).astype(Q_DTYPES[qdt])
        got, lse = kv.decode(qs, sliding_window=100, return_lse=True)
        kq, vq = kv.dequantized()
        ref, ref_lse = fd.reference_gqa_decode(qs, kq, vq, sliding_window=100, return_lse=True)
        assert rel_err(got.astype(np.float64), ref) < 2e-2
        np.testing.assert_allclose(lse, ref_lse, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_kv_cache_decodes_and_the_parity_kernel(rng, dtype):
    dt = DTYPES[dtype]
    for head_dim in (289, 512):
        with fd.KVCache(2, head_dim, 600, dtype=dt) as kv:
            q = rng.standard_normal((8, head_dim)).astype(dt)
            assert not kv.decode(q, n_heads=8).any()
            assert not kv.decode(q, n_heads=8, algorithm="parity").any()
            k = rng.standard_normal((555, 2, head_dim)).astype(dt)
            v = rng.standard_normal((555, 2, head_dim)).astype(dt)
            kv.extend(k, v)
            ref = fd.reference_gqa_decode(q, k, v)
            assert rel_err(kv.decode(q, n_heads=8), ref) < TOL[dtype]
            assert rel_err(kv.decode(q, n_heads=8, algorithm="parity"), ref) < TOL[dtype]
        q, k, v = _inputs(rng, (8,), 2, head_dim, 333, dt)
        out = poisoned(q.shape, q.dtype)
        got = fd.gqa_decode(fd.to_device(q), fd.to_device(k), fd.to_device(v), out=out,
                            algorithm="parity").to_host()  # fmt: skip
        assert rel_err(got, fd.reference_gqa_decode(q, k, v)) < TOL[dtype]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_a_decode_graph_steps_a_wide_cache(rng, dtype):
    dt = DTYPES[dtype]
    n_heads, n_kv, hd, steps = 16, 2, 512, 160
    sinks = rng.standard_normal(n_heads).astype(np.float32)
    qs = rng.standard_normal((steps, n_heads, hd)).astype(dt)
    ks = rng.standard_normal((steps, n_kv, hd)).astype(dt)
    vs = rng.standard_normal((steps, n_kv, hd)).astype(dt)
    with (fd.KVCache(n_kv, hd, steps, dtype=dt) as kv,
          fd.DecodeGraph(kv, n_heads=n_heads, sliding_window=64, sinks=sinks,
                         return_lse=True) as graph):  # fmt: skip
        for t in range(steps):
            got = graph(qs[t], ks[t], vs[t])
            if t % 23 and t != steps - 1:
                continue
            ref, ref_lse = fd.reference_gqa_decode(qs[t], ks[: t + 1], vs[: t + 1],
                                                   sliding_window=64, sinks=sinks,
                                                   return_lse=True)  # fmt: skip
            assert rel_err(got, ref) < TOL[dtype], t
            np.testing.assert_allclose(graph.lse, ref_lse, rtol=LSE_TOL[dtype],
                                       atol=LSE_TOL[dtype])  # fmt: skip


def test_an_async_decode_captured_once_serves_every_length(rng):
    dt = ml_dtypes.bfloat16
    n_heads, n_kv, hd, steps = 8, 1, 320, 40
    qs = rng.standard_normal((n_heads, hd)).astype(dt)
    ks = rng.standard_normal((steps, n_kv, hd)).astype(dt)
    vs = rng.standard_normal((steps, n_kv, hd)).astype(dt)
    with fd.KVCache(n_kv, hd, steps, dtype=dt) as kv, fd.Stream() as stream:
        q_d, k_d, v_d = fd.to_device(qs), fd.empty((n_kv, hd), dt), fd.empty((n_kv, hd), dt)
        out = fd.empty((n_heads, hd), dt)
        fd.kv_append_async(kv, k_d, v_d, stream=stream)  # (kernels loaded outside the capture)
        fd.gqa_decode_async(q_d, kv, out, n_heads=n_heads, stream=stream)
        stream.synchronize()
        kv.clear()
        kv.synchronize()
        with stream.capture() as graph:
            fd.kv_append_async(kv, k_d, v_d, stream=stream)
            fd.gqa_decode_async(q_d, kv, out, n_heads=n_heads, stream=stream)
        exe = graph.instantiate()
        for t in range(steps):
            k_d.copy_from_host(ks[t], stream=stream)
            v_d.copy_from_host(vs[t], stream=stream)
            out.fill_bytes(0xFF, stream)
            exe.launch(stream)
            got = out.to_host(stream=stream)
            ref = fd.reference_gqa_decode(qs, ks[: t + 1], vs[: t + 1])
            assert rel_err(got, ref) < TOL["bf16"], t


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_the_torch_op(rng, layout):
    torch = pytest.importorskip("torch")
    import ferrox_driver.integrations.torch as fxt

    H, KV, D, cap = 16, 4, 384, 1200
    for n in (0, 1, 777):
        shape = (cap, KV, D) if layout == "NHD" else (1, KV, cap, D)
        k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        q = torch.randn(H, D, device="cuda", dtype=torch.bfloat16)
        seq = torch.tensor([n], dtype=torch.int32, device="cuda")
        out, lse = fxt.gqa_decode(q, k, v, seq, kv_layout=layout, return_lse=True,
                                  logits_soft_cap=10.0)  # fmt: skip
        torch.cuda.synchronize()
        if n == 0:
            assert torch.all(out == 0)
            continue
        kn, vn = (x.float().cpu().numpy() for x in (k, v))
        if layout == "HND":
            kn, vn = (np.ascontiguousarray(x[0].transpose(1, 0, 2)) for x in (kn, vn))
        want, want_lse = fd.reference_gqa_decode(q.float().cpu().numpy(), kn[:n], vn[:n],
                                                 logits_soft_cap=10.0, return_lse=True)  # fmt: skip
        assert rel_err(out.float().cpu().numpy(), want) < TOL["bf16"]
        np.testing.assert_allclose(lse.cpu().numpy(), want_lse, rtol=2e-2, atol=2e-2)
