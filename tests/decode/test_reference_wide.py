"""The float64 reference for issue 50's shapes: head_dim past 256 (to 1024), values of a
width of their own (``head_dim_v``), and multi-head latent attention (``v`` None: V is K's
first ``head_dim_v`` columns), one query token and several, against a per-head loop written
from the definitions."""

from __future__ import annotations

import numpy as np
import pytest

import ferrox_driver as fd


def _loop(q, k, v, scale, positions):
    """q (n_q, H, D); k (seq, KV, D); v (seq, KV, Dv); query t sees tokens j <= positions[t]."""
    n_q, n_heads, _ = q.shape
    group = n_heads // k.shape[1]
    out = np.zeros((n_q, n_heads, v.shape[2]))
    lse = np.zeros((n_q, n_heads))
    for t in range(n_q):
        for h in range(n_heads):
            g = h // group
            s = np.array([scale * float(np.dot(q[t, h], k[j, g])) for j in range(positions[t] + 1)])
            w = np.exp(s - s.max())
            out[t, h] = (w[:, None] * v[: positions[t] + 1, g]).sum(0) / w.sum()
            lse[t, h] = s.max() + np.log(w.sum())
    return out, lse


@pytest.mark.parametrize("head_dim,head_dim_v", [(512, 512), (320, 320), (192, 128), (96, 256),
                                                 (576, 512)])  # fmt: skip
def test_values_of_their_own_width_one_query_and_several(rng, head_dim, head_dim_v):
    seq, n_heads, n_kv = 37, 8, 2
    k = rng.standard_normal((seq, n_kv, head_dim))
    v = rng.standard_normal((seq, n_kv, head_dim_v))
    q = rng.standard_normal((4, n_heads, head_dim))
    scale = head_dim**-0.5
    ref, ref_lse = _loop(q, k, v, scale, [seq - 4 + t for t in range(4)])
    kw = {"head_dim_v": head_dim_v} if head_dim_v != head_dim else {}
    got, lse = fd.reference_gqa_decode(q, k, v, return_lse=True, **kw)
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-10)
    one = fd.reference_gqa_decode(q[3], k, v, **kw)  # one token: the last query's
    assert one.shape == (n_heads, head_dim_v)
    np.testing.assert_allclose(one, ref[3], rtol=1e-10, atol=1e-12)
    flat = fd.reference_gqa_decode(q[3].reshape(-1), k.reshape(-1), v.reshape(-1),
                                   n_kv_heads=n_kv, head_dim=head_dim, **kw)  # fmt: skip
    assert flat.shape == (n_heads * head_dim_v,)
    np.testing.assert_allclose(flat.reshape(n_heads, head_dim_v), ref[3], rtol=1e-10, atol=1e-12)


def test_mla_reads_the_values_from_the_latent_rows(rng):
    """DeepSeek's absorbed decode: 16 query heads of 576 over one latent KV head of 576
    whose first 512 columns are the values, head-major too."""
    seq, n_heads = 50, 16
    latent = rng.standard_normal((seq, 1, 576))
    q = rng.standard_normal((2, n_heads, 576))
    scale = 0.07
    ref, _ = _loop(q, latent, latent[..., :512], scale, [seq - 2, seq - 1])
    got = fd.reference_gqa_decode(q, latent, None, n_heads=n_heads, n_kv_heads=1, head_dim=576,
                                  head_dim_v=512, scale=scale)  # fmt: skip
    assert got.shape == (2, n_heads, 512)
    np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-12)
    hnd = fd.reference_gqa_decode(q, latent.transpose(1, 0, 2), None, head_dim_v=512,
                                  scale=scale, kv_layout="HND")  # fmt: skip
    np.testing.assert_allclose(hnd, ref, rtol=1e-10, atol=1e-12)
    # the features apply as ever (a window of 10: the last query sees its last 10 tokens)
    win = fd.reference_gqa_decode(q[1], latent, None, head_dim_v=512, scale=scale,
                                  sliding_window=10)  # fmt: skip
    tail, _ = _loop(q[1:], latent[-10:], latent[-10:, :, :512], scale, [9])
    np.testing.assert_allclose(win, tail[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "v,kw,exc,pattern",
    [
        (None, {}, TypeError, "v, head_dim_v: v None needs head_dim_v"),
        (None, {"head_dim_v": 577}, ValueError, "head_dim_v: expected 1..576"),
        (np.zeros((9, 1, 512)), {"head_dim_v": 512}, ValueError, "v: expected \\(10, 1, 512\\)"),
        (np.zeros((10, 1, 512), np.int32), {"head_dim_v": 512}, TypeError, "v: expected a f"),
        ([[0.0]], {"head_dim_v": 1}, TypeError, "v: expected a numpy array"),
        (np.zeros((10, 1, 512)), {"head_dim_v": 0}, ValueError, "head_dim_v: expected 1.."),
    ],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_argument(rng, v, kw, exc, pattern):
    k, q = rng.standard_normal((10, 1, 576)), rng.standard_normal((4, 576))
    with pytest.raises(exc, match=pattern):
        fd.reference_gqa_decode(q, k, v, **kw)


def test_head_dims_past_the_reference_s_widest_are_refused(rng):
    k = rng.standard_normal((3, 1, 1025))
    with pytest.raises(ValueError, match=r"head_dim: expected 1\.\.1024"):
        fd.reference_gqa_decode(rng.standard_normal((2, 1025)), k, k)
