"""gqa_decode rejects bad input before any device work (runs with no GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import ferrox_driver as fd

H, KV, D, S = 8, 2, 16, 5


def args(**over):
    a = dict(
        q=np.zeros(H * D, np.float32),
        k_cache=np.zeros(S * KV * D, np.float32),
        v_cache=np.zeros(S * KV * D, np.float32),
        n_heads=H,
        n_kv_heads=KV,
        head_dim=D,
    )
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over,exc,pattern",
    [
        (dict(n_heads=6, n_kv_heads=4), ValueError, "n_heads: must be a multiple of n_kv_heads"),
        (dict(head_dim=0), ValueError, r"head_dim: expected 1\.\.512, got 0"),
        (dict(head_dim=513), ValueError, r"head_dim: expected 1\.\.512, got 513"),
        (dict(n_heads=0), ValueError, "n_heads"),
        (dict(n_kv_heads=-1), ValueError, "n_kv_heads"),
        (dict(n_heads=8.0), TypeError, "n_heads: expected an int"),
        (dict(head_dim=True), TypeError, "head_dim: expected an int"),
        (dict(q=np.zeros(H * D + 1, np.float32)), ValueError, r"q: expected shape \(128,\)"),
        (dict(q=np.zeros((D, H), np.float32)), ValueError, "q: expected shape"),
        (
            dict(k_cache=np.zeros(S * KV * D + 3, np.float32)),
            ValueError,
            "k_cache: length 163 is not a multiple of n_kv_heads\\*head_dim",
        ),
        (
            dict(k_cache=np.zeros((S, KV + 1, D), np.float32)),
            ValueError,
            r"n_kv_heads: 2 given, but k_cache of shape \(5, 3, 16\) holds 3 KV heads",
        ),
        (
            dict(v_cache=np.zeros((S + 1) * KV * D, np.float32)),
            ValueError,
            "v_cache: expected k_cache's shape",
        ),
        (dict(q=np.zeros((H * D * 2,), np.float32)[::2]), ValueError, "q: must be C-contiguous"),
        (
            dict(k_cache=np.zeros((S, KV, 2 * D), np.float32)[:, :, :D]),
            ValueError,
            "k_cache: must be C-contiguous",
        ),
        (dict(q=np.zeros(H * D, np.float64)), TypeError, "q: expected float32, float16"),
        (dict(q=np.zeros(H * D, np.int32)), TypeError, "q: expected float32"),
        (
            dict(k_cache=np.zeros(S * KV * D, np.float16)),
            TypeError,
            "k_cache: expected q's dtype float32, got float16",
        ),
        (dict(v_cache=np.zeros(S * KV * D, object)), TypeError, "v_cache: expected float32"),
        (dict(q=[0.0] * (H * D)), TypeError, "q: expected a numpy array or a device array"),
    ],
)
def test_bad_argument_is_rejected_naming_it(over, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fd.gqa_decode(**args(**over))


def test_unknown_algorithm_is_rejected():
    with pytest.raises(ValueError, match="algorithm"):
        fd.gqa_decode(**args(), algorithm="fastest")


def test_seq_len_zero_returns_zeros_of_q_shape_and_dtype_without_a_gpu():
    q = np.ones((H, D), np.float16)
    empty = np.zeros((0, KV, D), np.float16)
    out = fd.gqa_decode(q, empty, empty, n_heads=H, n_kv_heads=KV, head_dim=D)
    assert out.shape == (H, D) and out.dtype == np.float16
    assert not out.any()


def test_reference_validates_like_the_kernel_path():
    with pytest.raises(ValueError, match="n_heads: must be a multiple"):
        a = args(n_heads=6, n_kv_heads=4)
        fd.reference_gqa_decode(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), **a)


@pytest.mark.parametrize(
    "kw,error,match",
    [
        ({"sliding_window": 0}, ValueError, "sliding_window"),
        ({"logits_soft_cap": -1.0}, ValueError, "logits_soft_cap"),
        ({"sinks": np.zeros(3, np.float32)}, ValueError, "sinks"),
        ({"alibi_slopes": np.zeros(8, np.complex64)}, TypeError, "alibi_slopes"),
        ({"scale": float("inf")}, ValueError, "scale"),
        ({"return_lse": 1}, TypeError, "return_lse"),
    ],
)
def test_gqa_decode_refuses_bad_features_naming_them_before_any_device_work(kw, error, match):
    q = np.zeros((8, 16), np.float16)
    k = np.zeros((5, 2, 16), np.float16)
    with pytest.raises(error, match=match):
        fd.gqa_decode(q, k, k, n_heads=8, n_kv_heads=2, head_dim=16, **kw)


HND = np.zeros((KV, S, D), np.float32)


@pytest.mark.parametrize(
    "over,exc,pattern",
    [
        (dict(kv_layout="hnd"), ValueError, "kv_layout: expected 'NHD'"),
        (dict(kv_layout=None), ValueError, "kv_layout: expected 'NHD'"),
        (dict(k_cache=np.zeros((S, KV, D), np.float32), v_cache=np.zeros((S, KV, D), np.float32)),
         ValueError, r"n_kv_heads: 2 given, but k_cache of shape \(5, 2, 16\) holds 5 KV heads "
         r"\(read as \(\[1,\] n_kv_heads, seq_len, head_dim\), kv_layout='HND'\)"),
        (dict(k_cache=np.zeros((2, KV, S, D), np.float32)), ValueError, "k_cache: expected a head"),
        (dict(v_cache=np.zeros((KV, S + 1, D), np.float32)), ValueError,
         "v_cache: expected k_cache's"),
        (dict(v_cache=np.zeros((KV, S, D), np.float16)), TypeError, "v_cache: expected q's dtype"),
        (dict(algorithm="parity"), ValueError, "algorithm: the features and head-major caches"),
    ],
)  # fmt: skip
def test_head_major_caches_are_checked_before_any_device_work(over, exc, pattern):
    kw = args(k_cache=HND, v_cache=HND, kv_layout="HND")
    kw.update(over)
    with pytest.raises(exc, match=pattern):
        fd.gqa_decode(**kw)


def test_head_major_numpy_arrays_of_any_strides_pass_the_checks_as_their_copies():
    from ferrox_driver.decode.checks import check_head_major_args

    big = np.zeros((1, KV, 3 * S, D), np.float32)
    spec, stride = check_head_major_args(np.zeros((H, D), np.float32), big[:, :, :S],
                                         big[:, :, :S], H, KV, D)  # fmt: skip
    assert (spec.seq_len, stride) == (S, S * D)  # (copied in: contiguous)
    spec, stride = check_head_major_args(np.zeros(H * D, np.float32), HND, HND, H, KV, D)
    assert (spec.seq_len, stride) == (S, S * D)
    with pytest.raises(ValueError, match="n_kv_heads: 2 given, but k_cache of shape"):
        check_head_major_args(np.zeros(H * D, np.float32), big[0, :1], big[0, :1], H, KV, D)
    nhd = np.zeros((S, KV, D), np.float32)  # numpy: any strides (copied in, contiguous)
    spec, stride = check_head_major_args(np.zeros(H * D, np.float32), nhd.transpose(1, 0, 2),
                                         nhd.transpose(1, 0, 2), H, KV, D)  # fmt: skip
    assert (spec.seq_len, stride) == (S, S * D)
