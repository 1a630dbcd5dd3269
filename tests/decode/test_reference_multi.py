"""The float64 reference for n_q query tokens (speculative verify): q (n_q, n_heads,
head_dim), the cache's last n_q tokens, causal or under a tree mask, with every feature
relative to each query's own position; against a brute-force loop written here from the
definitions, and the identities a verify must satisfy. CPU only."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ferrox_driver as fd
from ferrox_driver.decode import pair as decode_pair
from ferrox_driver.decode.queries import (
    check_tree_mask,
    query_heads,
    read_query_dims,
    single_query_only,
)

FEATURES = ("sliding_window", "logits_soft_cap", "sinks", "alibi_slopes", "scale")


def brute(q, k, v, n_kv, mask=None, window=None, cap=None, sinks=None, slopes=None, scale=None):
    """Query by query, head by head, token by token, in Python floats, as the definitions
    read: query t at p = seq - n_q + t sees earlier tokens j < seq - n_q always and new
    token u where mask[t][u] (default u <= t), only p - window < j with a window."""
    n_q, n_heads, head_dim = q.shape
    seq = k.shape[0]
    group = n_heads // n_kv
    base = seq - n_q
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    out = np.zeros((n_q, n_heads, head_dim))
    lse = np.zeros((n_q, n_heads))
    for t in range(n_q):
        p = base + t
        for h in range(n_heads):
            g = h // group
            logits, values = [], []
            for j in range(seq):
                u = j - base
                if u >= 0 and not (mask[t][u] if mask is not None else u <= t):
                    continue
                if window is not None and j <= p - window:
                    continue
                s = scale * float(np.dot(q[t, h], k[j, g]))
                if cap is not None:
                    s = cap * math.tanh(s / cap)
                if slopes is not None:
                    s += float(slopes[h]) * (j - p)
                logits.append(s)
                values.append(v[j, g])
            sink = -math.inf if sinks is None else float(sinks[h])
            top = max([*logits, sink])
            weights = [math.exp(s - top) for s in logits]
            total = sum(weights) + math.exp(sink - top)
            for w, val in zip(weights, values, strict=True):
                out[t, h] += w / total * val
            lse[t, h] = top + math.log(total)
    return out, lse


def inputs(rng, n_q, seq, n_heads=4, n_kv=2, head_dim=4, q_scale=1.0):
    q = (rng.standard_normal((n_q, n_heads, head_dim)) * q_scale).astype(np.float32)
    k = rng.standard_normal((seq, n_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((seq, n_kv, head_dim)).astype(np.float32)
    return q, k, v


def feature_values(rng, names, n_heads, n_q):
    values = dict(
        sliding_window=int(rng.integers(1, n_q + 4)),
        logits_soft_cap=float(rng.uniform(0.5, 5.0)),
        sinks=rng.standard_normal(n_heads),
        alibi_slopes=rng.uniform(0.01, 1.0, n_heads),
        scale=float(rng.uniform(0.1, 1.0)),
    )
    return {name: values[name] for name in names}


def as_brute(feats):
    return dict(window=feats.get("sliding_window"), cap=feats.get("logits_soft_cap"),
                sinks=feats.get("sinks"), slopes=feats.get("alibi_slopes"),
                scale=feats.get("scale"))  # fmt: skip


def head_major(a):
    return np.ascontiguousarray(a.transpose(1, 0, 2))


def random_tree(rng, n_q):
    """A random draft tree over the n_q new tokens in topological order (each node's
    parent an earlier node, or the committed cache): mask[t, u] iff u is t or an
    ancestor of t."""
    parent = [int(rng.integers(-1, u)) for u in range(n_q)]
    mask = np.zeros((n_q, n_q), dtype=bool)
    for t in range(n_q):
        u = t
        while u >= 0:
            mask[t, u] = True
            u = parent[u]
    return mask


def check(got, want, tol=1e-10):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("n_q", [*range(1, 17), 33, 64, 100])
def test_causal_queries_compute_the_definitions(rng, n_q):
    for seq in (n_q, n_q + 2 * int(rng.integers(0, 20)) + 1):  # no earlier cache; odd extra
        q, k, v = inputs(rng, n_q, seq, head_dim=3)
        out, lse = fd.reference_gqa_decode(q, k, v, return_lse=True)
        want_out, want_lse = brute(q, k, v, 2)
        assert out.dtype == lse.dtype == np.float64
        assert out.shape == (n_q, 4, 3) and lse.shape == (n_q, 4)
        check(out, want_out)
        check(lse, want_lse)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(
    "names",
    [(), *((f,) for f in FEATURES), FEATURES, ("sliding_window", "alibi_slopes", "sinks"),
     ("logits_soft_cap", "scale", "alibi_slopes")],
    ids=lambda n: "+".join(n) or "plain",
)  # fmt: skip
def test_every_feature_is_relative_to_each_querys_position(rng, layout, names):
    n_q = int(rng.integers(2, 12))
    seq = n_q + int(rng.integers(0, 9))
    q, k, v = inputs(rng, n_q, seq, n_heads=6, n_kv=2, head_dim=5)
    feats = feature_values(rng, names, 6, n_q)
    kk, vv = (head_major(k), head_major(v)) if layout == "HND" else (k, v)
    out, lse = fd.reference_gqa_decode(q, kk, vv, return_lse=True, kv_layout=layout, **feats)
    want_out, want_lse = brute(q, k, v, 2, **as_brute(feats))
    check(out, want_out)
    check(lse, want_lse)


@pytest.mark.parametrize("n_q", [1, 2, 3, 7, 8, 9, 16, 33, 64])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_random_trees_compute_the_definitions_with_every_feature(rng, n_q, layout):
    seq = n_q + int(rng.integers(0, 6))
    q, k, v = inputs(rng, n_q, seq, head_dim=3)
    mask = random_tree(rng, n_q)
    feats = feature_values(rng, FEATURES if n_q % 2 else ("alibi_slopes",), 4, n_q)
    kk, vv = (head_major(k), head_major(v)) if layout == "HND" else (k, v)
    out, lse = fd.reference_gqa_decode(q, kk, vv, tree_mask=mask, return_lse=True,
                                       kv_layout=layout, **feats)  # fmt: skip
    want_out, want_lse = brute(q, k, v, 2, mask=mask, **as_brute(feats))
    check(out, want_out)
    check(lse, want_lse)


def test_a_mask_entry_above_the_diagonal_is_honoured(rng):
    n_q, seq = 4, 9
    q, k, v = inputs(rng, n_q, seq)
    mask = np.eye(n_q, dtype=bool)
    mask[0, 3] = mask[1, 2] = True  # query 0 sees the last new token, query 1 the next one
    out, lse = fd.reference_gqa_decode(q, k, v, tree_mask=mask, return_lse=True,
                                       alibi_slopes=np.full(4, 0.5))  # fmt: skip
    want_out, want_lse = brute(q, k, v, 2, mask=mask, slopes=np.full(4, 0.5))
    check(out, want_out)
    check(lse, want_lse)


@pytest.mark.parametrize("n_q", [1, 2, 5, 8, 17])
def test_a_chain_is_the_causal_mask(rng, n_q):
    seq = n_q + int(rng.integers(0, 5))
    q, k, v = inputs(rng, n_q, seq)
    chain = np.tri(n_q, dtype=bool)  # node u's parent is u - 1
    feats = feature_values(rng, FEATURES, 4, n_q)
    causal = fd.reference_gqa_decode(q, k, v, return_lse=True, **feats)
    masked = fd.reference_gqa_decode(q, k, v, tree_mask=chain, return_lse=True, **feats)
    want_out, want_lse = brute(q, k, v, 2, **as_brute(feats))
    for got in (causal, masked):
        check(got[0], want_out)
        check(got[1], want_lse)
    check(masked[0], causal[0], 1e-13)


@pytest.mark.parametrize("n_q", [1, 4, 11])
def test_an_all_diagonal_mask_is_each_query_alone_on_the_committed_cache(rng, n_q):
    seq = n_q + 6
    q, k, v = inputs(rng, n_q, seq)
    out = fd.reference_gqa_decode(q, k, v, tree_mask=np.eye(n_q, dtype=bool))
    check(out, brute(q, k, v, 2, mask=np.eye(n_q, dtype=bool))[0])
    base = seq - n_q
    for t in range(n_q):  # query t over the committed tokens and its own
        kt = np.concatenate([k[:base], k[base + t : base + t + 1]])
        vt = np.concatenate([v[:base], v[base + t : base + t + 1]])
        check(out[t], brute(q[t : t + 1], kt, vt, 2)[0][0])


@pytest.mark.parametrize("n_q", [1, 3, 8, 9, 16, 33])
def test_a_packed_mask_is_the_bool_mask(rng, n_q):
    seq = n_q + 3
    q, k, v = inputs(rng, n_q, seq)
    mask = random_tree(rng, n_q)
    packed = np.zeros((n_q, (n_q + 7) // 8), np.uint8)  # bit u % 8 of byte u // 8
    for t, u in zip(*np.nonzero(mask), strict=True):
        packed[t, u // 8] |= 1 << (u % 8)
    assert (packed == np.packbits(mask, axis=1, bitorder="little")).all()
    want = fd.reference_gqa_decode(q, k, v, tree_mask=mask)
    got = fd.reference_gqa_decode(q, k, v, tree_mask=packed)
    assert got.tobytes() == want.tobytes()
    assert (check_tree_mask(packed, n_q) == mask).all()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("n_q", [1, 2, 5, 16])
def test_a_causal_verify_is_one_token_decodes_on_the_caches_prefixes(rng, layout, n_q):
    seq = n_q + int(rng.integers(0, 30))
    q, k, v = inputs(rng, n_q, seq, n_heads=8, n_kv=2, head_dim=6)
    feats = feature_values(rng, FEATURES, 8, n_q)
    kk, vv = (head_major(k), head_major(v)) if layout == "HND" else (k, v)
    out, lse = fd.reference_gqa_decode(q, kk, vv, return_lse=True, kv_layout=layout, **feats)
    for t in range(n_q):
        n = seq - n_q + t + 1  # the cache as query t's one-token decode saw it
        kt, vt = (head_major(k[:n]), head_major(v[:n])) if layout == "HND" else (k[:n], v[:n])
        one, one_lse = fd.reference_gqa_decode(q[t], kt, vt, return_lse=True, kv_layout=layout,
                                               **feats)  # fmt: skip
        check(out[t], one, 1e-12)
        check(lse[t], one_lse, 1e-12)


def test_one_query_of_three_dimensions_is_todays_one_token_exactly(rng):
    q, k, v = inputs(rng, 1, 13, n_heads=8, n_kv=4, head_dim=7)
    for layout in ("NHD", "HND"):
        feats = feature_values(rng, FEATURES, 8, 1)
        kk, vv = (head_major(k), head_major(v)) if layout == "HND" else (k, v)
        many = fd.reference_gqa_decode(q, kk, vv, return_lse=True, kv_layout=layout, **feats)
        one = fd.reference_gqa_decode(q[0], kk, vv, return_lse=True, kv_layout=layout, **feats)
        assert many[0].shape == (1, 8, 7) and many[1].shape == (1, 8)
        assert many[0][0].tobytes() == one[0].tobytes()
        assert many[1][0].tobytes() == one[1].tobytes()


def test_huge_scores_stay_finite(rng):
    q, k, v = inputs(rng, 9, 20, q_scale=1e4)
    mask = random_tree(rng, 9)
    for tree in (None, mask):
        out, lse = fd.reference_gqa_decode(q, k, v, tree_mask=tree, return_lse=True)
        assert np.isfinite(out).all() and np.isfinite(lse).all()
        want_out, want_lse = brute(q, k, v, 2, mask=tree)
        check(out, want_out, 1e-9)
        check(lse, want_lse, 1e-9)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n_q=st.integers(1, 12),
    earlier=st.integers(0, 10),
    window=st.one_of(st.none(), st.integers(1, 25)),
)
def test_a_query_does_not_read_the_tokens_hidden_from_it(seed, n_q, earlier, window):
    """Property: changing the K and V of the tokens query t does not see (masked new
    tokens, tokens past the window) leaves its output and LSE exactly as they were."""
    rng = np.random.default_rng(seed)
    seq = n_q + earlier
    q, k, v = inputs(rng, n_q, seq)
    mask = random_tree(rng, n_q)
    slopes = rng.uniform(0.1, 1.0, 4)
    kw = dict(tree_mask=mask, sliding_window=window, alibi_slopes=slopes, return_lse=True)
    out, lse = fd.reference_gqa_decode(q, k, v, **kw)
    for t in range(n_q):
        p = earlier + t
        seen = [(j < earlier or mask[t, j - earlier]) and (window is None or j > p - window)
                for j in range(seq)]  # fmt: skip
        hidden = ~np.array(seen)
        k2, v2 = k.copy(), v.copy()
        k2[hidden] = rng.standard_normal(k2[hidden].shape) * 10
        v2[hidden] = rng.standard_normal(v2[hidden].shape) * 10
        out2, lse2 = fd.reference_gqa_decode(q, k2, v2, **kw)
        assert out2[t].tobytes() == out[t].tobytes() and lse2[t].tobytes() == lse[t].tobytes()


# --- bad input: each refused naming the argument, before anything is computed ----------


def _qkv(n_q=3, seq=5):
    return inputs(np.random.default_rng(), n_q, seq)


@pytest.mark.parametrize(
    "make,kw,error,message",
    [
        (lambda: _qkv(6, 5), {}, ValueError, r"q: 6 query tokens for a cache of 5 tokens"),
        (lambda: _qkv(1, 0), {}, ValueError, r"q: 1 query tokens for a cache of 0 tokens"),
        (lambda: (np.zeros((0, 4, 4), np.float32), *_qkv()[1:]), {}, ValueError,
         r"q: expected \(n_q, n_heads, head_dim\) with each at least 1, got \(0, 4, 4\)"),
        (lambda: (np.zeros((3, 4, 5), np.float32), *_qkv()[1:]), {}, ValueError,
         r"q: expected shape \(n_q, n_heads, head_dim\) with head_dim = 4 \(read from k's"),
        (lambda: _qkv(), dict(head_dim=8), ValueError,
         r"q: expected shape \(n_q, n_heads, head_dim\) with head_dim = 8 \(given\)"),
        (lambda: _qkv(), dict(n_heads=8), ValueError,
         r"n_heads: 8 given, but q of shape \(3, 4, 4\) holds 4 heads"),
        (lambda: (np.zeros((3, 3, 4), np.float32), *_qkv()[1:]), {}, ValueError,
         "n_heads: must be a multiple of n_kv_heads"),
        (lambda: (np.zeros((3, 4, 4), np.int32), *_qkv()[1:]), {}, TypeError,
         "q: expected a floating-point array"),
        (lambda: (np.zeros((4, 3, 4), np.float32).transpose(1, 0, 2), *_qkv()[1:]), {},
         ValueError, "q: must be C-contiguous"),
        (lambda: (_qkv()[0], _qkv()[1].tolist(), _qkv()[2]), {}, TypeError,
         "k: expected a numpy array, got list"),
        (lambda: (*_qkv()[:2], _qkv(3, 6)[2]), {}, ValueError, "v: expected k's shape"),
        (lambda: _qkv(), dict(sliding_window=0), ValueError, "sliding_window: expected 1.."),
        (lambda: _qkv(), dict(sinks=np.zeros(3)), ValueError, "sinks: expected one value"),
        (lambda: _qkv(), dict(kv_layout="BSHD"), ValueError, "kv_layout: expected 'NHD'"),
        (lambda: _qkv(), dict(tree_mask=np.eye(4, dtype=bool)), ValueError,
         r"tree_mask: expected shape \(3, 3\) \(bool\) for 3 query tokens, got \(4, 4\)"),
        (lambda: _qkv(), dict(tree_mask=np.eye(3, dtype=bool)[:, :1]), ValueError,
         r"tree_mask: expected shape \(3, 3\) \(bool\)"),
        (lambda: _qkv(), dict(tree_mask=np.ones((3, 3), np.uint8)), ValueError,
         r"tree_mask: expected shape \(3, 1\) \(bit-packed uint8\) for 3 query tokens"),
        (lambda: _qkv(), dict(tree_mask=np.eye(3, dtype=np.int64)), TypeError,
         r"tree_mask: expected bool \(n_q, n_q\) or bit-packed uint8"),
        (lambda: _qkv(), dict(tree_mask=np.eye(3).tolist()), TypeError,
         "tree_mask: expected a numpy array, got list"),
        (lambda: _qkv(), dict(tree_mask=np.tri(3, k=-1, dtype=bool)), ValueError,
         r"tree_mask: the diagonal must be set .* missing at t = \[0, 1, 2\]"),
        (lambda: _qkv(), dict(tree_mask=np.array([[1], [3], [4 | 8]], np.uint8)), ValueError,
         r"tree_mask: bits past the 3 query tokens are set"),
        (lambda: _qkv(), dict(tree_mask=np.packbits(np.eye(3, dtype=bool), axis=1)),
         ValueError, r"tree_mask: bits past the 3 query tokens"),  # big-endian packing
        (lambda: (_qkv()[0][0], *_qkv()[1:]), dict(tree_mask=np.ones((1, 1), bool)),
         ValueError, r"tree_mask: only with a q of several query tokens, shape \(n_q, n_heads"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_naming_it(make, kw, error, message):
    q, k, v = make()
    with pytest.raises(error, match=message):
        fd.reference_gqa_decode(q, k, v, **kw)


def test_the_shared_checks_read_every_accepted_q_shape():
    for shape in ((8, 16), (128,), (1, 8, 1, 16)):
        got = query_heads(shape, 16)
        assert (got.n_q, got.n_heads, got.head_dim, got.token_shape) == (1, 8, 16, shape)
    got = query_heads((5, 8, 16), 16, 8)
    assert (got.n_q, got.n_heads, got.token_shape) == (5, 8, (8, 16))
    with pytest.raises(ValueError, match=r"q_dev: expected shape \(n_q, n_heads, head_dim\)"):
        query_heads((5, 8, 16), 32, None, "q_dev")
    queries, dims = read_query_dims((7, 12, 16), (20, 3, 16), None, None, None)
    assert (queries.n_q, dims) == (7, (12, 3, 16))
    queries, dims = read_query_dims((7, 12, 16), (12 * 20 * 16,), None, 3, None, layout="HND")
    assert (queries.n_q, dims) == (7, (12, 3, 16))  # a flat K: head_dim from q
    with pytest.raises(ValueError, match=r"head_dim: 8 given, but k_cache of shape"):
        read_query_dims((7, 12, 8), (20, 3, 16), None, None, 8)


@pytest.mark.parametrize("shape", [(2, 8, 16), (4, 1, 16), (1, 8, 2, 16)])
def test_several_query_tokens_are_read_as_such(shape):
    """A 3-D q is (n_q, n_heads, head_dim); SDPA's (1, n_heads, n_q, head_dim) with n_q > 1
    is refused (a read of whole heads from q's size would take n_q * n_heads heads)."""
    with pytest.raises(ValueError, match=r"q: shape .* holds \d+ query tokens; pass .*\(n_q, "):
        single_query_only(shape)
    torch = pytest.importorskip("torch")

    class FakeCuda:  # what ferrox reads of a PyTorch CUDA tensor; nothing dereferences it
        __module__ = "torch"

        def __init__(self, shape):
            self.shape, self.dtype = torch.Size(shape), torch.float16

        def data_ptr(self):
            return 1 << 20

        def get_device(self):
            return 0

        def is_contiguous(self):
            return True

    fxt = pytest.importorskip("ferrox_driver.integrations.torch")
    q = torch.zeros(shape, dtype=torch.float16)
    k = torch.zeros((5, 2, 16), dtype=torch.float16)
    if len(shape) == 4:  # gqa_decode_async reads n_heads from q_dev's size: not more heads
        with pytest.raises(ValueError, match=r"q_dev: shape .* holds \d+ query tokens"):
            decode_pair.q_heads_of(None, FakeCuda(shape), 16)
        with pytest.raises(ValueError, match=r"q: shape .* holds \d+ query tokens"):
            fxt._dims(q, k, "NHD")
        return
    assert decode_pair.q_heads_of(None, FakeCuda(shape), 16) == shape[1]
    assert decode_pair.query_count(FakeCuda(shape), 16) == shape[0]
    assert fxt._dims(q, k, "NHD") == (shape[1], 2, 16)
    assert fxt._lse_shape(q, shape[1], True) == (shape[0], shape[1])
    with pytest.raises(ValueError, match=r"q_dev: expected shape \(n_q, n_heads, head_dim\)"):
        decode_pair.query_count(FakeCuda(shape), 32)
    with pytest.raises(ValueError, match=r"n_heads: 3 given, but q_dev of shape"):
        decode_pair.query_count(FakeCuda(shape), 16, 3)
