"""gqa_decode's features (sliding window, soft-cap, sinks, ALiBi, scale, LSE) on the GPU,
against the float64 reference (reference_gqa_decode, which test_reference_features.py
checks against the definitions), outputs poisoned before each kernel."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.decode import launches
from ferrox_driver.kernels.traits import F_WINDOW

from ..helpers.gpu_helpers import (
    DTYPES,
    TOL,
    feature_kwargs,
    poisoned,
    random_decode_inputs,
    rel_err,
)

pytestmark = pytest.mark.gpu

LSE_TOL = {"f32": 1e-5, "f16": 1e-3, "bf16": 1e-3}
WINDOW = 96


def _features(rng, n_heads, which):
    return feature_kwargs(rng, n_heads, which, window=WINDOW, scale=0.05)


def _check(rng, dtype, n_heads, n_kv, head_dim, seq, kw, q_scale=1.0):
    q, k, v = random_decode_inputs(rng, n_heads, n_kv, head_dim, seq, DTYPES[dtype], q_scale)
    dims = {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": head_dim}
    ref, ref_lse = fd.reference_gqa_decode(q, k, v, **dims, return_lse=True, **kw)
    qd, kd, vd = fd.to_device(q), fd.to_device(k), fd.to_device(v)
    out = poisoned(q.shape, q.dtype)
    got, lse = fd.gqa_decode(qd, kd, vd, **dims, out=out, return_lse=True, **kw)
    got, lse = got.to_host().astype(np.float64), lse.to_host()
    assert lse.dtype == np.float32 and lse.shape == (n_heads,)
    assert np.isfinite(got).all()
    if seq == 0 and "sinks" not in kw:
        assert not got.any() and (lse == -np.inf).all()
        return
    assert rel_err(got, ref) < TOL[dtype], rel_err(got, ref)
    np.testing.assert_allclose(lse, ref_lse, rtol=LSE_TOL[dtype], atol=LSE_TOL[dtype])


COMBOS = ["window", "cap", "sinks", "alibi", "scale", "lse-only", "window+cap",
          "window+sinks+alibi", "cap+sinks+scale", "window+cap+sinks+alibi+scale"]  # fmt: skip


@pytest.mark.parametrize("combo", COMBOS)
def test_each_feature_and_combination_matches_the_reference(rng, combo):
    kw = _features(rng, 32, combo)
    for seq in (0, 1, WINDOW - 1, WINDOW, WINDOW + 1, 777, 4099):
        _check(rng, "bf16", 32, 4, 128, seq, kw)


# every kernel family with every feature at once (one kernel each): the three dtypes
# (fp32: the TF32 tensor-core kernels for groups of 4 and 8, CUDA cores otherwise), head_dims
# 64/128/256, 80 (padded to 128 on fp16/bf16) and 100 and 37 (CUDA cores), groups of 1, 4, 8
# and 16 (fp16/bf16: two tiles of 8)
@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256, 100, 37])
@pytest.mark.parametrize("n_heads,n_kv", [(8, 8), (16, 4), (32, 4), (16, 1)])
def test_every_kernel_takes_every_feature(rng, dtype, head_dim, n_heads, n_kv):
    kw = _features(rng, n_heads, COMBOS[-1])
    for seq in (0, 1, WINDOW - 1, WINDOW, WINDOW + 1, 777, 4099):
        _check(rng, dtype, n_heads, n_kv, head_dim, seq, kw)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_soft_cap_stays_finite_on_huge_scores(rng, dtype):
    kw = {"logits_soft_cap": 30.0}
    _check(rng, dtype, 32, 8, 128, 3001, kw, q_scale=1e3)


def test_a_window_reads_only_the_window(device):
    # the plan covers min(seq_len, window) tokens: a 4096-token window over 131072 tokens
    # plans like a 4096-token decode
    dt = np.dtype(DTYPES["bf16"])
    bits = F_WINDOW
    windowed = launches.plan_split(device, dt, 32, 8, 128, 4096, True, bits)
    plain = launches.plan_split(device, dt, 32, 8, 128, 4096, True)
    assert windowed.splits == plain.splits and "_x1" in windowed.kernel, windowed


def test_numpy_inputs_return_numpy_and_lse(rng):
    q, k, v = random_decode_inputs(rng, 32, 8, 128, 500, DTYPES["bf16"])
    sinks = rng.standard_normal(32).astype(np.float32)
    dims = {"n_heads": 32, "n_kv_heads": 8, "head_dim": 128}
    got, lse = fd.gqa_decode(q, k, v, **dims, sinks=sinks, sliding_window=100, return_lse=True)
    ref, ref_lse = fd.reference_gqa_decode(
        q, k, v, **dims, sinks=sinks, sliding_window=100, return_lse=True
    )
    assert isinstance(got, np.ndarray) and isinstance(lse, np.ndarray)
    assert rel_err(got.astype(np.float64), ref) < TOL["bf16"]
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_merging_split_decodes_equals_the_whole(rng, parts):
    q, k, v = random_decode_inputs(rng, 32, 8, 128, 5000, DTYPES["bf16"])
    dims = {"n_heads": 32, "n_kv_heads": 8, "head_dim": 128}
    bounds = [0, *sorted(rng.choice(np.arange(1, 5000), parts - 1, replace=False)), 5000]
    outs, lses = [], []
    for a, b in itertools.pairwise(bounds):
        o, lse = fd.gqa_decode(q, k[a:b], v[a:b], **dims, return_lse=True)
        outs.append(o.astype(np.float32))
        lses.append(lse)
    out, lse = fd.merge_states(np.stack(outs), np.stack(lses))
    ref, ref_lse = fd.reference_gqa_decode(q, k, v, **dims, return_lse=True)
    assert rel_err(out.astype(np.float64), ref) < TOL["bf16"]
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_lse_of_plain_decodes_to_the_tolerance(rng, dtype):
    # fp32 to 1e-5 relative, 16-bit to 1e-3, on the six benchmark shapes at odd lengths
    for n_heads, n_kv, head_dim in ((32, 8, 128), (28, 4, 128), (32, 32, 128), (16, 2, 64),
                                    (8, 1, 256)):  # fmt: skip
        _check(rng, dtype, n_heads, n_kv, head_dim, 3001, {})


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_a_graph_captured_at_seq_len_1_keeps_window_sinks_and_lse_to_8192(rng, dtype):
    # the window follows the device's seq_len; sinks are read from their device array at
    # each replay (new values in place, no new capture); the LSE lands in out_lse
    dt = DTYPES[dtype]
    n_heads, n_kv, head_dim, cap, window = 32, 8, 128, 8192, 1000
    k = rng.standard_normal((cap, n_kv, head_dim)).astype(dt)
    v = rng.standard_normal((cap, n_kv, head_dim)).astype(dt)
    q = rng.standard_normal((n_heads, head_dim)).astype(dt)
    sinks = rng.standard_normal(n_heads).astype(np.float32)
    dims = {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": head_dim}
    with fd.KVCache(n_kv, head_dim, cap, dtype=dt) as kv, fd.Stream() as stream:
        kv.extend(k[:1], v[:1])
        kv.synchronize()
        q_d, sinks_d = fd.to_device(q), fd.to_device(sinks)
        out, lse = fd.empty((n_heads, head_dim), dt), fd.empty((n_heads,), np.float32)
        kw = {"sliding_window": window, "sinks": sinks_d, "out_lse": lse}
        kv.prepare(n_heads, sliding_window=window, sinks=sinks_d, return_lse=True)
        with stream.capture() as graph:
            fd.gqa_decode_async(q_d, kv, out, n_heads=n_heads, stream=stream, **kw)
        exe = graph.instantiate()
        for seq in [1, 2, 999, 1000, 1001, 4097, 8191, 8192]:
            kv.extend(k[kv.seq_len : seq], v[kv.seq_len : seq])
            kv.synchronize()
            if seq == 4097:  # new sink values, same array
                sinks = rng.standard_normal(n_heads).astype(np.float32)
                sinks_d.copy_from_host(sinks)
            out.fill_bytes(0xFF)
            lse.fill_bytes(0xFF)
            exe.launch(stream)
            stream.synchronize()
            ref, ref_lse = fd.reference_gqa_decode(
                q, k[:seq], v[:seq], **dims, sliding_window=window, sinks=sinks, return_lse=True
            )
            assert rel_err(out.to_host().astype(np.float64), ref) < TOL[dtype], seq
            np.testing.assert_allclose(lse.to_host(), ref_lse, rtol=LSE_TOL[dtype],
                                       atol=LSE_TOL[dtype])  # fmt: skip
        exe.close()


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_kv_cache_decode_and_decode_graph_take_the_features(rng, dtype):
    dt = DTYPES[dtype]
    n_heads, n_kv, head_dim, cap = 32, 8, 128, 2048
    k = rng.standard_normal((cap, n_kv, head_dim)).astype(dt)
    v = rng.standard_normal((cap, n_kv, head_dim)).astype(dt)
    q = rng.standard_normal((n_heads, head_dim)).astype(dt)
    sinks = rng.standard_normal(n_heads).astype(np.float32)
    slopes = (2.0 ** -np.arange(1, n_heads + 1)).astype(np.float32)
    dims = {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": head_dim}
    with fd.KVCache(n_kv, head_dim, cap, dtype=dt) as kv:
        kv.extend(k[:700], v[:700])
        for kw in ({"sliding_window": 256, "sinks": sinks}, {"logits_soft_cap": 3.0},
                   {"alibi_slopes": slopes, "scale": 0.1}):  # fmt: skip
            got, lse = kv.decode(q, n_heads=n_heads, return_lse=True, **kw)
            ref, ref_lse = fd.reference_gqa_decode(q, k[:700], v[:700], **dims,
                                                   return_lse=True, **kw)  # fmt: skip
            assert rel_err(got.astype(np.float64), ref) < TOL[dtype], kw
            np.testing.assert_allclose(lse, ref_lse, rtol=LSE_TOL[dtype], atol=LSE_TOL[dtype])
        kw = {"sliding_window": 300, "alibi_slopes": slopes}
        with fd.DecodeGraph(kv, n_heads=n_heads, return_lse=True, **kw) as step:
            for t in range(700, 712):
                got = step(q, k[t], v[t])
                ref, ref_lse = fd.reference_gqa_decode(q, k[: t + 1], v[: t + 1], **dims,
                                                       return_lse=True, **kw)  # fmt: skip
                assert rel_err(got.astype(np.float64), ref) < TOL[dtype], t
                np.testing.assert_allclose(step.lse, ref_lse, rtol=LSE_TOL[dtype],
                                           atol=LSE_TOL[dtype])  # fmt: skip


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("parts", [1, 2, 5, 8])
def test_device_merge_of_split_decodes_equals_the_whole_decode(rng, dtype, parts):
    # fp32: the merged parts equal the decode of the whole to 1e-6; the device merge equals
    # the host one; and it replays inside a captured graph
    dt = DTYPES[dtype]
    n_heads, n_kv, head_dim, seq = 32, 8, 128, 6000
    q, k, v = random_decode_inputs(rng, n_heads, n_kv, head_dim, seq, dt)
    dims = {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": head_dim}
    qd, kd, vd = fd.to_device(q), fd.to_device(k), fd.to_device(v)
    whole, whole_lse = fd.gqa_decode(qd, kd, vd, **dims, return_lse=True)
    bounds = [0, *sorted(rng.choice(np.arange(1, seq), parts - 1, replace=False)), seq]
    outs, lses = [], []
    for a, b in itertools.pairwise(bounds):
        o, lse = fd.gqa_decode(q, k[a:b], v[a:b], **dims, return_lse=True)
        outs.append(o)
        lses.append(lse)
    outs_d, lses_d = fd.to_device(np.stack(outs)), fd.to_device(np.stack(lses))
    out = poisoned((n_heads, head_dim), dt)
    got, got_lse = fd.merge_states(outs_d, lses_d, out=out)
    host, host_lse = fd.merge_states(np.stack(outs), np.stack(lses))
    tol = 1e-6 if dtype == "f32" else TOL[dtype]
    assert rel_err(got.to_host().astype(np.float64), whole.to_host().astype(np.float64)) < tol
    np.testing.assert_allclose(got_lse.to_host(), whole_lse.to_host(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.to_host().astype(np.float64), host.astype(np.float64),
                               rtol=1e-2, atol=1e-2)  # fmt: skip
    np.testing.assert_allclose(got_lse.to_host(), host_lse, rtol=1e-6, atol=1e-6)
    with fd.Stream() as stream:
        with stream.capture() as graph:
            fd.merge_states(outs_d, lses_d, out=out, out_lse=got_lse, stream=stream)
        exe = graph.instantiate()
        out.fill_bytes(0xFF)
        exe.launch(stream)
        stream.synchronize()
        assert rel_err(out.to_host().astype(np.float64), host.astype(np.float64)) < TOL[dtype]
        exe.close()


def test_device_merge_of_empty_parts_and_bad_inputs():
    outs = fd.to_device(np.ones((2, 3, 4), np.float32))
    lses = fd.to_device(np.array([[-np.inf, 0.0, -np.inf], [-np.inf, 0.0, 1.0]], np.float32))
    out, lse = fd.merge_states(outs, lses)
    assert not out.to_host()[0].any() and lse.to_host()[0] == -np.inf
    np.testing.assert_allclose(out.to_host()[1:], 1.0)
    with pytest.raises(TypeError, match="lses"):
        fd.merge_states(outs, fd.to_device(np.zeros((2, 3), np.float16)))
    with pytest.raises(ValueError, match="outs"):
        fd.merge_states(fd.to_device(np.ones((3, 3, 4), np.float32)), lses)
    with pytest.raises(TypeError, match="outs, lses"):
        fd.merge_states(outs, np.zeros((2, 3), np.float32))
