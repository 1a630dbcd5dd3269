"""Many query tokens at once (issue 48): ``gqa_decode`` and ``KVCache.decode`` with q of
``(n_q, n_heads, head_dim)``, causal or under a tree mask, every feature, both layouts, fp8
caches, against the float64 reference on fresh random inputs, outputs poisoned."""

from __future__ import annotations

import numpy as np
import pytest

import ferrox_driver as fd

from ..helpers.gpu_helpers import DTYPES, TOL, feature_kwargs, poisoned, rel_err

pytestmark = pytest.mark.gpu

LSE_TOL = {"f32": 1e-4, "f16": 2e-2, "bf16": 2e-2}


def _features(rng, n_heads, which):
    return feature_kwargs(rng, n_heads, which, window=40, scale=0.05)


def _inputs(rng, n_q, n_heads, n_kv, head_dim, seq, dtype, layout="NHD"):
    dt = DTYPES[dtype]
    q = rng.standard_normal((n_q, n_heads, head_dim)).astype(dt)
    shape = (seq, n_kv, head_dim) if layout == "NHD" else (n_kv, seq, head_dim)
    return q, rng.standard_normal(shape).astype(dt), rng.standard_normal(shape).astype(dt)


def _check(rng, n_q, n_heads, n_kv, head_dim, seq, dtype="bf16", kw=None, layout="NHD",
           tree_mask=None, device_mask=False):  # fmt: skip
    kw = kw or {}
    q, k, v = _inputs(rng, n_q, n_heads, n_kv, head_dim, seq, dtype, layout)
    ref, ref_lse = fd.reference_gqa_decode(q, k, v, return_lse=True, kv_layout=layout,
                                           tree_mask=tree_mask, **kw)  # fmt: skip
    qd, kd, vd = fd.to_device(q), fd.to_device(k), fd.to_device(v)
    out = poisoned(q.shape, q.dtype)
    mask = fd.to_device(tree_mask) if device_mask and tree_mask is not None else tree_mask
    got, lse = fd.gqa_decode(qd, kd, vd, out=out, return_lse=True, kv_layout=layout,
                             tree_mask=mask, **kw)  # fmt: skip
    got, lse = got.to_host().astype(np.float64), lse.to_host()
    assert got.shape == (n_q, n_heads, head_dim) and lse.shape == (n_q, n_heads)
    assert np.isfinite(got).all()
    assert rel_err(got, ref) < TOL[dtype], rel_err(got, ref)
    np.testing.assert_allclose(lse, ref_lse, rtol=LSE_TOL[dtype], atol=LSE_TOL[dtype])


@pytest.mark.parametrize("n_q", [*range(1, 17), 33, 64, 100])
def test_a_causal_verify_matches_the_reference(rng, n_q):
    for seq in sorted({n_q, n_q + 1, 301, 1000 + n_q}):
        _check(rng, n_q, 32, 8, 128, seq)


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256, 37])
@pytest.mark.parametrize("n_heads,n_kv", [(8, 8), (28, 4), (16, 1)])
def test_every_kernel_family_and_head_dim(rng, dtype, head_dim, n_heads, n_kv):
    for n_q in (2, 5):
        _check(rng, n_q, n_heads, n_kv, head_dim, 517, dtype)


COMBOS = ["window", "cap", "sinks", "alibi", "scale", "window+cap+sinks+alibi+scale"]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("combo", COMBOS)
def test_every_feature_relative_to_each_querys_position(rng, combo, layout):
    kw = _features(rng, 16, combo)
    for n_q, seq in ((4, 4), (4, 39), (4, 41), (8, 300), (50, 60), (3, 1234)):
        _check(rng, n_q, 16, 4, 128, seq, kw=kw, layout=layout)


def _random_tree(rng, n_q):
    """A draft tree: each token's parent an earlier one; a token sees its ancestors."""
    mask = np.eye(n_q, dtype=bool)
    for t in range(1, n_q):
        parent = int(rng.integers(0, t))
        mask[t] |= mask[parent]
    return mask


@pytest.mark.parametrize("device_mask", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_tree_masks_random_chains_and_the_diagonal(rng, packed, device_mask):
    for n_q in (2, 7, 16, 33):
        for mask in (_random_tree(rng, n_q), np.tril(np.ones((n_q, n_q), bool)),
                     np.eye(n_q, dtype=bool)):  # fmt: skip
            m = np.packbits(mask, axis=1, bitorder="little") if packed else mask
            _check(rng, n_q, 16, 4, 128, 200 + n_q, tree_mask=m, device_mask=device_mask)
    # entries above the diagonal are honoured too, with features
    n_q = 6
    mask = _random_tree(rng, n_q) | (rng.random((n_q, n_q)) < 0.3)
    kw = _features(rng, 16, "window+cap+sinks+alibi+scale")
    _check(rng, n_q, 16, 4, 128, 90, kw=kw, tree_mask=mask, layout="HND")


def test_a_causal_verify_is_n_q_one_token_decodes(rng):
    n_q, seq = 8, 777
    q, k, v = _inputs(rng, n_q, 32, 8, 128, seq, "bf16")
    qd, kd, vd = fd.to_device(q), fd.to_device(k), fd.to_device(v)
    many = fd.gqa_decode(qd, kd, vd).to_host().astype(np.float64)
    for t in range(n_q):
        n = seq - n_q + t + 1
        one = fd.gqa_decode(q[t], k[:n], v[:n]).astype(np.float64)
        assert rel_err(many[t], one) < 1e-2


def test_a_kv_cache_verifies_bf16_and_fp8(rng, verify_path):
    n_q, H, KV, D = 5, 32, 8, 128
    bf16 = DTYPES["bf16"]
    k = rng.standard_normal((400, KV, D)).astype(bf16)
    v = rng.standard_normal((400, KV, D)).astype(bf16)
    q = rng.standard_normal((n_q, H, D)).astype(bf16)
    with fd.KVCache(KV, D, 512, dtype=bf16) as kv:
        kv.extend(k, v)
        got = kv.decode(q)
        assert rel_err(got, fd.reference_gqa_decode(q, k, v)) < TOL["bf16"]
        mask = _random_tree(rng, n_q)
        got = kv.decode(fd.to_device(q), tree_mask=mask).to_host()
        assert rel_err(got, fd.reference_gqa_decode(q, k, v, tree_mask=mask)) < TOL["bf16"]
    with fd.KVCache(KV, D, 512, dtype="float8_e4m3fn") as kv:
        kv.extend(k, v)
        kq, vq = kv.dequantized()
        got, lse = kv.decode(q, sliding_window=100, return_lse=True)
        ref, ref_lse = fd.reference_gqa_decode(q, kq, vq, sliding_window=100, return_lse=True)
        assert rel_err(got, ref) < 2e-2
        np.testing.assert_allclose(lse, ref_lse, rtol=3e-2, atol=3e-2)


def test_bad_verify_arguments_are_refused_naming_them(rng):
    q, k, v = _inputs(rng, 4, 8, 2, 64, 3, "bf16")
    with pytest.raises(ValueError, match="q: 4 query tokens for a cache of 3"):
        fd.gqa_decode(fd.to_device(q), fd.to_device(k), fd.to_device(v))
    q, k, v = _inputs(rng, 4, 8, 2, 64, 30, "bf16")
    with pytest.raises(ValueError, match="tree_mask: the diagonal must be set"):
        fd.gqa_decode(q, k, v, tree_mask=np.zeros((4, 4), bool))
    with pytest.raises(ValueError, match="tree_mask: expected shape"):
        fd.gqa_decode(q, k, v, tree_mask=np.eye(3, dtype=bool))


@pytest.fixture
def rows_path(monkeypatch):
    """The rows kernel (split_rows.cuh) where it takes the call (Overrides.verify_rows)."""
    import dataclasses

    from ferrox_driver.decode import plan as attention

    monkeypatch.setattr(
        attention, "OVERRIDES", dataclasses.replace(attention.OVERRIDES, verify_rows=True)
    )


def _rows_planned(n_q, n_heads, n_kv, head_dim, seq, dtype, fp8=""):
    from ferrox_driver.decode.launches import plan_rows
    from ferrox_driver.driver.device import default_device

    found = plan_rows(default_device(), DTYPES[dtype], n_q, n_heads, n_kv, head_dim, seq, True, 0,
                      fp8)  # fmt: skip
    assert found is not None, "the rows kernel takes this call"


@pytest.mark.parametrize("n_q", [2, 3, 5, 8, 16, 33, 64, 100])
def test_the_rows_kernel_matches_the_reference(rng, rows_path, n_q):
    _rows_planned(n_q, 32, 8, 128, 1000, "bf16")
    for seq in sorted({n_q, n_q + 1, 301, 1000 + n_q}):
        _check(rng, n_q, 32, 8, 128, seq)
    kw = _features(rng, 16, "window+cap+sinks+alibi+scale")
    _check(rng, n_q, 16, 4, 128, 90 + n_q, kw=kw, layout="HND", tree_mask=_random_tree(rng, n_q))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("combo", COMBOS)
def test_the_rows_kernel_every_feature(rng, rows_path, combo, layout):
    kw = _features(rng, 16, combo)
    for n_q, seq in ((4, 4), (4, 39), (4, 41), (8, 300), (50, 60), (3, 1234)):
        _check(rng, n_q, 16, 4, 128, seq, kw=kw, layout=layout)


@pytest.mark.parametrize("device_mask", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_the_rows_kernel_under_tree_masks(rng, rows_path, packed, device_mask):
    for n_q in (2, 7, 16, 33):
        for mask in (_random_tree(rng, n_q), np.tril(np.ones((n_q, n_q), bool)),
                     np.eye(n_q, dtype=bool)):  # fmt: skip
            m = np.packbits(mask, axis=1, bitorder="little") if packed else mask
            _check(rng, n_q, 16, 4, 128, 200 + n_q, tree_mask=m, device_mask=device_mask)
    n_q = 6  # entries above the diagonal honoured, with features
    mask = _random_tree(rng, n_q) | (rng.random((n_q, n_q)) < 0.3)
    kw = _features(rng, 16, "window+cap+sinks+alibi+scale")
    _check(rng, n_q, 16, 4, 128, 90, kw=kw, tree_mask=mask, layout="HND")


def test_the_rows_kernel_is_n_q_one_token_decodes(rng, rows_path):
    n_q, seq = 8, 777
    q, k, v = _inputs(rng, n_q, 32, 8, 128, seq, "bf16")
    many = fd.gqa_decode(fd.to_device(q), fd.to_device(k), fd.to_device(v))
    many = many.to_host().astype(np.float64)
    for t in range(n_q):
        n = seq - n_q + t + 1
        one = fd.gqa_decode(q[t], k[:n], v[:n]).astype(np.float64)
        assert rel_err(many[t], one) < 1e-2


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_rows_kernel_every_warp_count_and_row_block(rng, rows_path, dtype, head_dim):
    """Rows per KV head of 1-8 warps of 16 (the last warp part padding, or whole), and past
    128 rows several blocks; chunks of several steps and a last partial step."""
    for n_q, n_heads, n_kv, seq in ((2, 8, 8, 70), (4, 16, 4, 1000), (3, 28, 4, 4099),
                                    (16, 28, 4, 777), (9, 56, 4, 300), (33, 32, 8, 2000),
                                    (7, 7, 1, 5000)):  # fmt: skip
        _rows_planned(n_q, n_heads, n_kv, head_dim, seq, dtype)
        _check(rng, n_q, n_heads, n_kv, head_dim, seq, dtype)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_the_rows_kernel_windows_reaching_into_many_chunks(rng, rows_path, layout):
    """Windows longer and shorter than a chunk, each row's own first token, with a tree."""
    for window in (1, 31, 500, 3000):
        kw = {"sliding_window": window, "sinks": rng.standard_normal(32).astype(np.float32)}
        _check(rng, 8, 32, 8, 128, 6000, kw=kw, layout=layout)
        _check(rng, 5, 32, 8, 128, 2500, kw=kw, layout=layout, tree_mask=_random_tree(rng, 5))


def test_the_rows_kernel_with_huge_scores(rng, rows_path):
    """Scores of 1e4 in one row, tiny in another: no overflow, no NaN."""
    n_q, H, KV, D, seq = 4, 16, 4, 128, 3000
    q, k, v = _inputs(rng, n_q, H, KV, D, seq, "bf16")
    q = (q.astype(np.float32) * 30).astype(q.dtype)
    k[123] = (k[123].astype(np.float32) * 40).astype(k.dtype)
    ref = fd.reference_gqa_decode(q, k, v)
    got = fd.gqa_decode(q, k, v)
    assert np.isfinite(got).all()
    assert rel_err(got.astype(np.float64), ref) < TOL["bf16"]


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_the_rows_kernel_reads_an_fp8_cache(rng, rows_path, fmt):
    """An fp8 KVCache's verify against the reference on its dequantized cache, features and
    a tree mask included; q scaled into fp16's range where its values pass it."""
    n_q, H, KV, D = 6, 32, 8, 128
    bf16 = DTYPES["bf16"]
    k = rng.standard_normal((3000, KV, D)).astype(bf16)
    v = rng.standard_normal((3000, KV, D)).astype(bf16)
    q = rng.standard_normal((n_q, H, D)).astype(bf16)
    q[2, 5] = (q[2, 5].astype(np.float32) * 2.0**17).astype(bf16)  # past fp16's range
    with fd.KVCache(KV, D, 4096, dtype=fmt) as kv:
        kv.extend(k, v)
        kq, vq = kv.dequantized()
        _rows_planned(n_q, H, KV, D, 3000, "bf16", {"float8_e4m3fn": "e4m3"}.get(fmt, "e5m2"))
        kw = _features(rng, H, "window+cap+sinks+alibi")
        mask = _random_tree(rng, n_q)
        for extra in ({}, kw, {"tree_mask": mask}):
            got, lse = kv.decode(q, return_lse=True, **extra)
            ref, ref_lse = fd.reference_gqa_decode(q, kq, vq, return_lse=True, **extra)
            assert np.isfinite(got).all()
            assert rel_err(got, ref) < 2e-2, extra.keys()
            np.testing.assert_allclose(lse, ref_lse, rtol=3e-2, atol=3e-2)
