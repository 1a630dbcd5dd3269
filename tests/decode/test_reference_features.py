"""The float64 reference's features (sliding window, soft-cap, sinks, ALiBi, scale, LSE) and
merge_states, against a per-head loop written from the definitions (docs/design.md,
"features") and against the identities they must satisfy. CPU only."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import ferrox_driver as fd


def _inputs(rng, n_heads, n_kv, head_dim, seq, q_scale=1.0):
    q = (rng.standard_normal((n_heads, head_dim)) * q_scale).astype(np.float32)
    k = rng.standard_normal((seq, n_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((seq, n_kv, head_dim)).astype(np.float32)
    return q, k, v


def _by_definition(q, k, v, n_heads, n_kv, window=None, cap=None, sinks=None, slopes=None,
                   scale=None):  # fmt: skip
    """One head and one token at a time, in Python floats, as the definitions read."""
    seq, _, head_dim = k.shape
    group = n_heads // n_kv
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    out = np.zeros((n_heads, head_dim))
    lse = np.zeros(n_heads)
    i = seq - 1
    for h in range(n_heads):
        g = h // group
        logits, values = [], []
        for j in range(seq):
            if window is not None and j < seq - window:
                continue
            s = scale * sum(float(q[h, d]) * float(k[j, g, d]) for d in range(head_dim))
            if cap is not None:
                s = cap * math.tanh(s / cap)
            if slopes is not None:
                s += float(slopes[h]) * (j - i)
            logits.append(s)
            values.append(v[j, g].astype(np.float64))
        sink = -math.inf if sinks is None else float(sinks[h])
        top = max([*logits, sink])
        if top == -math.inf:
            lse[h] = -math.inf
            continue
        weights = [math.exp(s - top) for s in logits]
        total = sum(weights) + math.exp(sink - top)
        for w, val in zip(weights, values, strict=True):
            out[h] += w / total * val
        lse[h] = top + math.log(total)
    return out, lse


@pytest.mark.parametrize(
    "n_heads,n_kv,head_dim,seq",
    [(8, 2, 16, 37), (4, 4, 8, 1), (6, 1, 5, 0), (8, 8, 24, 9), (12, 4, 7, 64)],
)
@pytest.mark.parametrize(
    "features",
    [
        {},
        {"sliding_window": 5},
        {"sliding_window": 1},
        {"sliding_window": 1000},
        {"logits_soft_cap": 2.5},
        {"sinks": "random"},
        {"alibi_slopes": "random"},
        {"scale": 0.3},
        {"sliding_window": 7, "logits_soft_cap": 30.0, "sinks": "random", "scale": 0.2},
        {"sliding_window": 4, "alibi_slopes": "random", "sinks": "random"},
    ],
    ids=["plain", "window5", "window1", "window-past-seq", "softcap", "sinks", "alibi", "scale",
         "window-cap-sinks-scale", "window-alibi-sinks"],
)  # fmt: skip
def test_the_reference_computes_the_definitions(rng, n_heads, n_kv, head_dim, seq, features):
    q, k, v = _inputs(rng, n_heads, n_kv, head_dim, seq)
    kw = dict(features)
    for name in ("sinks", "alibi_slopes"):
        if kw.get(name) == "random":
            kw[name] = rng.standard_normal(n_heads).astype(np.float32)
    got, lse = fd.reference_gqa_decode(
        q, k, v, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, return_lse=True, **kw
    )
    want, want_lse = _by_definition(
        q, k, v, n_heads, n_kv, kw.get("sliding_window"), kw.get("logits_soft_cap"),
        kw.get("sinks"), kw.get("alibi_slopes"), kw.get("scale"),
    )  # fmt: skip
    assert got.shape == q.shape and got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-13)
    plain = fd.reference_gqa_decode(q, k, v, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
                                    **kw)  # fmt: skip
    np.testing.assert_array_equal(plain, got)  # the same output without return_lse


def test_identities_of_the_features(rng):
    q, k, v = _inputs(rng, 8, 2, 16, 50)
    dims = {"n_heads": 8, "n_kv_heads": 2, "head_dim": 16}
    plain, plain_lse = fd.reference_gqa_decode(q, k, v, **dims, return_lse=True)
    # a window of the last W tokens is the plain decode of those tokens
    for w in (1, 2, 17, 49, 50, 51):
        got = fd.reference_gqa_decode(q, k, v, **dims, sliding_window=w)
        np.testing.assert_allclose(got, fd.reference_gqa_decode(q, k[-w:], v[-w:], **dims))
    # window 1: the last token's value
    last = fd.reference_gqa_decode(q, k, v, **dims, sliding_window=1)
    np.testing.assert_allclose(last, np.repeat(v[-1].astype(np.float64), 4, axis=0))
    # no sink (-inf) and zero slopes are the plain decode
    none = np.full(8, -np.inf, np.float32)
    np.testing.assert_array_equal(fd.reference_gqa_decode(q, k, v, **dims, sinks=none), plain)
    zero = np.zeros(8, np.float32)
    np.testing.assert_allclose(fd.reference_gqa_decode(q, k, v, **dims, alibi_slopes=zero), plain)
    # a sink scales the output by denominator / (denominator + e^sink)
    sinks = rng.standard_normal(8)
    got, lse = fd.reference_gqa_decode(q, k, v, **dims, sinks=sinks, return_lse=True)
    np.testing.assert_allclose(lse, np.logaddexp(plain_lse, sinks), rtol=1e-13, atol=1e-13)
    # (outputs near zero: an absolute bound too, as float64 rounding of O(0.1) values)
    np.testing.assert_allclose(got, plain * np.exp(plain_lse - lse)[:, None], rtol=1e-12,
                               atol=1e-14)  # fmt: skip
    # LSE of the plain decode: log sum exp of the scaled scores
    scores = np.einsum("hd,shd->hs", q.astype(np.float64),
                       np.repeat(k.astype(np.float64), 4, axis=1)) / 4.0  # fmt: skip
    np.testing.assert_allclose(plain_lse, np.logaddexp.reduce(scores, axis=1), rtol=1e-13,
                               atol=1e-13)  # fmt: skip
    # a cap far above the scores changes nothing measurable; the default scale is 1/sqrt(D)
    np.testing.assert_allclose(
        fd.reference_gqa_decode(q, k, v, **dims, logits_soft_cap=1e6),
        plain,
        rtol=1e-9,
        atol=1e-9 * np.abs(plain).max(),  # (outputs near zero are sums that cancel)
    )
    np.testing.assert_array_equal(fd.reference_gqa_decode(q, k, v, **dims, scale=0.25), plain)


def test_soft_cap_keeps_huge_scores_finite_and_sinks_count_at_seq_len_0(rng):
    q, k, v = _inputs(rng, 4, 1, 8, 33, q_scale=1e30)
    dims = {"n_heads": 4, "n_kv_heads": 1, "head_dim": 8}
    out, lse = fd.reference_gqa_decode(q, k, v, **dims, logits_soft_cap=50.0, return_lse=True)
    assert np.isfinite(out).all() and np.isfinite(lse).all() and (lse <= 50 + np.log(33)).all()
    q0, k0, v0 = _inputs(rng, 4, 1, 8, 0)
    sinks = np.array([0.5, -1.0, -np.inf, 3.0])
    out, lse = fd.reference_gqa_decode(q0, k0, v0, **dims, sinks=sinks, return_lse=True)
    np.testing.assert_array_equal(out, np.zeros((4, 8)))
    np.testing.assert_array_equal(lse, sinks)  # the sink alone; -inf where there is none


@pytest.mark.parametrize("parts", [1, 2, 3, 5, 8])
def test_merging_the_parts_of_a_split_sequence_equals_the_whole(rng, parts):
    n_heads, n_kv, head_dim, seq = 8, 2, 16, 300
    q, k, v = _inputs(rng, n_heads, n_kv, head_dim, seq)
    dims = {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": head_dim}
    sinks = rng.standard_normal(n_heads)
    whole, whole_lse = fd.reference_gqa_decode(q, k, v, **dims, return_lse=True)
    cuts = np.sort(rng.choice(np.arange(1, seq), parts - 1, replace=False))
    bounds = [0, *cuts.tolist(), seq]
    outs, lses = [], []
    for a, b in itertools.pairwise(bounds):
        o, lse = fd.reference_gqa_decode(q, k[a:b], v[a:b], **dims, return_lse=True)
        outs.append(o)
        lses.append(lse)
    outs.append(np.zeros((n_heads, head_dim)))  # an empty part: lse -inf, contributes nothing
    lses.append(np.full(n_heads, -np.inf))
    out, lse = fd.merge_states(np.stack(outs), np.stack(lses))
    np.testing.assert_allclose(out, whole, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, whole_lse, rtol=1e-13, atol=1e-13)
    # float32 parts merge to float32 within float32's rounding
    out32, lse32 = fd.merge_states(np.stack(outs).astype(np.float32),
                                   np.stack(lses).astype(np.float32))  # fmt: skip
    assert out32.dtype == np.float32 and lse32.dtype == np.float32
    np.testing.assert_allclose(out32, whole, rtol=1e-5, atol=1e-6)
    # with sinks: the sink is one more part with a zero output and lse = the sink
    with_sinks, lse_s = fd.reference_gqa_decode(q, k, v, **dims, sinks=sinks, return_lse=True)
    out_s, merged_s = fd.merge_states(np.stack([*outs, np.zeros((n_heads, head_dim))]),
                                      np.stack([*lses, sinks]))  # fmt: skip
    np.testing.assert_allclose(out_s, with_sinks, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(merged_s, lse_s, rtol=1e-13, atol=1e-13)


def test_merge_states_of_empty_heads_and_flat_outputs():
    outs = np.ones((2, 3, 4))
    lses = np.array([[-np.inf, 0.0, -np.inf], [-np.inf, np.log(3.0), 1.0]])
    outs[1] *= 2
    out, lse = fd.merge_states(outs, lses)
    np.testing.assert_array_equal(out[0], np.zeros(4))  # every part empty: zeros, -inf
    assert lse[0] == -np.inf
    np.testing.assert_allclose(out[1], np.full(4, (1 * 1 + 2 * 3) / 4))
    np.testing.assert_allclose(lse[1:], [np.log(4.0), 1.0])
    flat, _ = fd.merge_states(outs.reshape(2, 12), lses)
    np.testing.assert_array_equal(flat, out.reshape(12))


@pytest.mark.parametrize(
    "kw,error,match",
    [
        ({"sliding_window": 0}, ValueError, "sliding_window"),
        ({"sliding_window": -3}, ValueError, "sliding_window"),
        ({"sliding_window": 2.5}, TypeError, "sliding_window"),
        ({"sliding_window": True}, TypeError, "sliding_window"),
        ({"logits_soft_cap": 0.0}, ValueError, "logits_soft_cap"),
        ({"logits_soft_cap": float("inf")}, ValueError, "logits_soft_cap"),
        ({"logits_soft_cap": "50"}, TypeError, "logits_soft_cap"),
        ({"sinks": np.zeros(3)}, ValueError, "sinks"),
        ({"sinks": np.array([0, 0, 0, np.nan])}, ValueError, "sinks"),
        ({"sinks": np.array([0, 0, 0, np.inf])}, ValueError, "sinks"),
        ({"alibi_slopes": np.zeros((2, 2))}, ValueError, "alibi_slopes"),
        ({"alibi_slopes": np.array([0, np.inf, 0, 0])}, ValueError, "alibi_slopes"),
        ({"alibi_slopes": np.array(["a"] * 4)}, TypeError, "alibi_slopes"),
        ({"scale": float("nan")}, ValueError, "scale"),
        ({"scale": None, "return_lse": "yes"}, TypeError, "return_lse"),
    ],
)
def test_bad_features_are_refused_naming_them(rng, kw, error, match):
    q, k, v = _inputs(rng, 4, 2, 8, 5)
    with pytest.raises(error, match=match):
        fd.reference_gqa_decode(q, k, v, n_heads=4, n_kv_heads=2, head_dim=8, **kw)


@pytest.mark.parametrize(
    "outs,lses,match",
    [
        (np.zeros((2, 3, 4)), np.zeros((3, 3)), "outs"),
        (np.zeros((2, 3, 4)), np.zeros(3), "lses"),
        (np.zeros((2, 7)), np.zeros((2, 3)), "outs"),
        (np.zeros((2, 3, 4)), np.array([[0, 0, np.nan]] * 2), "lses"),
        (np.zeros((2, 3, 4), np.int32), np.zeros((2, 3)), "outs"),
    ],
)
def test_bad_merge_inputs_are_refused_naming_them(outs, lses, match):
    with pytest.raises((ValueError, TypeError), match=match):
        fd.merge_states(outs, lses)
