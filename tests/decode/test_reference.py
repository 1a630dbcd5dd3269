"""The float64 reference against a direct, loop-by-loop computation."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd


def direct(q, k, v, n_heads, n_kv_heads, head_dim):
    seq = k.size // (n_kv_heads * head_dim)
    q = q.reshape(n_heads, head_dim).astype(np.float64)
    k = k.reshape(seq, n_kv_heads, head_dim).astype(np.float64)
    v = v.reshape(seq, n_kv_heads, head_dim).astype(np.float64)
    out = np.zeros((n_heads, head_dim))
    for h in range(n_heads):
        g = h // (n_heads // n_kv_heads)
        scores = [
            sum(q[h, d] * k[t, g, d] for d in range(head_dim)) / math.sqrt(head_dim)
            for t in range(seq)
        ]
        if not scores:
            continue
        top = max(scores)
        w = [math.exp(s - top) for s in scores]
        total = sum(w)
        for t in range(seq):
            out[h] += w[t] / total * v[t, g]
    return out


@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim,seq",
    [(4, 2, 8, 5), (3, 3, 5, 1), (6, 1, 3, 7), (2, 2, 4, 0)],
)
def test_reference_equals_direct_float64_computation(rng, n_heads, n_kv_heads, head_dim, seq):
    q = rng.standard_normal(n_heads * head_dim).astype(np.float32)
    k = rng.standard_normal(seq * n_kv_heads * head_dim).astype(np.float32)
    v = rng.standard_normal(seq * n_kv_heads * head_dim).astype(np.float32)
    got = fd.reference_gqa_decode(
        q, k, v, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim
    )
    want = direct(q, k, v, n_heads, n_kv_heads, head_dim).reshape(-1)
    assert got.dtype == np.float64
    assert got.shape == q.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_reference_keeps_shaped_q_and_handles_huge_scores(rng):
    q = (rng.standard_normal((4, 16)) * 1e3).astype(np.float32)
    k = rng.standard_normal((9, 2, 16)).astype(np.float32)
    v = rng.standard_normal((9, 2, 16)).astype(np.float32)
    got = fd.reference_gqa_decode(q, k, v, n_heads=4, n_kv_heads=2, head_dim=16)
    assert got.shape == (4, 16)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, direct(q, k, v, 4, 2, 16), rtol=1e-9, atol=1e-9)


def test_reference_accepts_bfloat16_inputs(rng):
    q = rng.standard_normal(32).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal(3 * 32).astype(ml_dtypes.bfloat16)
    got = fd.reference_gqa_decode(q, k, k, n_heads=2, n_kv_heads=2, head_dim=16)
    np.testing.assert_allclose(got, direct(q, k, k, 2, 2, 16).reshape(-1), rtol=1e-9)


@pytest.mark.parametrize("where", ["k", "v", "q"])
def test_reference_propagates_nan_to_the_outputs_that_read_it(rng, where):
    q = rng.standard_normal((8, 16))
    k, v = rng.standard_normal((2, 5, 2, 16))
    {"q": q[1], "k": k[3, 0], "v": v[3, 0]}[where][5] = np.nan  # KV head 0 / query head 1
    poisoned = np.zeros((8, 16), bool)
    if where == "q":
        poisoned[1] = True  # its scores
    elif where == "k":
        poisoned[:4] = True  # the scores of KV head 0's query heads
    else:
        poisoned[:4, 5] = True  # one column of their outputs
    for extra in ({}, {"logits_soft_cap": 30.0, "sinks": np.zeros(8)}):
        out = fd.reference_gqa_decode(q, k, v, n_heads=8, n_kv_heads=2, head_dim=16, **extra)
        assert (np.isnan(out) == poisoned).all(), extra
