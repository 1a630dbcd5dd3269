"""``gqa_decode(..., head_dim_v=...)`` on the GPU (issue 50): values of their own width on the
latent kernels (V rows of their own), against ``reference_gqa_decode(..., head_dim_v=...)``
on fresh random inputs, outputs poisoned: DeepSeek's expanded heads (16 heads, K 192, V
128) and wide GQA heads, one or three queries, lengths 0, 1, 17 and 777, NHD and HND,
bf16 and fp16, every feature the kernels take, the LSE, torch views read in place."""

from __future__ import annotations

import numpy as np
import pytest

import ferrox_driver as fd

from ..helpers.gpu_helpers import DTYPES, TOL, poisoned, rel_err

pytestmark = pytest.mark.gpu

LSE_TOL = 2e-2
# (n_heads, n_kv_heads, head_dim, head_dim_v): DeepSeek V2/V3 expanded (MHA), GQA wider
# keys than values, values wider than keys, head_dim 512 with half-width values
SHAPES = [(16, 16, 192, 128), (32, 8, 256, 128), (28, 4, 128, 256), (8, 2, 512, 256)]


def _inputs(rng, n_q, n_heads, n_kv, d, dv, seq, dtype="bf16", layout="NHD"):
    dt = DTYPES[dtype]
    q = rng.standard_normal((n_q, n_heads, d) if n_q else (n_heads, d)).astype(dt)
    shapes = [(seq, n_kv, w) if layout == "NHD" else (n_kv, seq, w) for w in (d, dv)]
    k, v = (rng.standard_normal(s).astype(dt) for s in shapes)
    return q, k, v


def _check(rng, n_q, shape, seq, dtype="bf16", layout="NHD", **kw):
    """One device call (n_q 0: a one-token q of shape (n_heads, head_dim)) with a poisoned
    ``out``, against the float64 reference, output and LSE."""
    n_heads, n_kv, d, dv = shape
    q, k, v = _inputs(rng, n_q, n_heads, n_kv, d, dv, seq, dtype, layout)
    ref, ref_lse = fd.reference_gqa_decode(q, k, v, head_dim_v=dv, kv_layout=layout,
                                           return_lse=True, **kw)  # fmt: skip
    out_shape = (*q.shape[:-1], dv)
    out = poisoned(out_shape, q.dtype)
    got, lse = fd.gqa_decode(fd.to_device(q), fd.to_device(k), fd.to_device(v), head_dim_v=dv,
                             kv_layout=layout, out=out, return_lse=True, **kw)  # fmt: skip
    assert got is out
    got, lse = got.to_host().astype(np.float64), lse.to_host()
    assert got.shape == out_shape and lse.shape == q.shape[:-1] and np.isfinite(got).all()
    err = rel_err(got, ref)
    assert err < TOL[dtype], (shape, n_q, seq, err)
    np.testing.assert_allclose(lse, ref_lse, rtol=LSE_TOL, atol=LSE_TOL)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("n_q", [0, 1, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_values_of_their_own_width_match_the_reference(rng, shape, n_q, layout):
    for seq in (max(n_q, 1), 17, 777):
        _check(rng, n_q, shape, seq, layout=layout)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_fp16_matches_the_reference(rng, shape):
    _check(rng, 0, shape, 777, dtype="f16")
    _check(rng, 3, shape, 17, dtype="f16", layout="HND")


@pytest.mark.parametrize("n_q", [0, 3])
@pytest.mark.parametrize(
    "kw",
    [
        dict(scale=0.02),
        dict(sliding_window=40),
        dict(sliding_window=1),
        dict(logits_soft_cap=5.0, scale=0.2),
        dict(sinks="random"),
        dict(sliding_window=100, logits_soft_cap=3.0, sinks="random", scale=0.05),
    ],
    ids=["scale", "window", "window1", "cap", "sinks", "all"],
)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1]], ids=["16-16-192-128", "32-8-256-128"])
def test_every_feature_matches_the_reference(rng, shape, n_q, kw):
    kw = dict(kw)
    if kw.get("sinks") == "random":
        kw["sinks"] = rng.standard_normal(shape[0]).astype(np.float32)
    for seq in (max(n_q, 1), 777):
        _check(rng, n_q, shape, seq, **kw)


def test_no_tokens_give_zeros_and_an_empty_lse(rng):
    q, k, v = _inputs(rng, 0, 32, 8, 256, 128, 0)
    out, lse = fd.gqa_decode(fd.to_device(q), fd.to_device(k), fd.to_device(v), head_dim_v=128,
                             out=poisoned((32, 128), q.dtype), return_lse=True)  # fmt: skip
    assert not out.to_host().astype(np.float64).any() and np.isneginf(lse.to_host()).all()
    sinks = rng.standard_normal(32).astype(np.float32)
    _, lse = fd.gqa_decode(fd.to_device(q), fd.to_device(k), fd.to_device(v), head_dim_v=128,
                           return_lse=True, sinks=sinks)  # fmt: skip
    np.testing.assert_allclose(lse.to_host(), sinks, rtol=1e-6)


def test_numpy_inputs_give_numpy_outputs(rng):
    q, k, v = _inputs(rng, 3, 16, 16, 192, 128, 90)
    got, lse = fd.gqa_decode(q, k, v, head_dim_v=128, return_lse=True)
    ref, ref_lse = fd.reference_gqa_decode(q, k, v, head_dim_v=128, return_lse=True)
    assert isinstance(got, np.ndarray) and got.dtype == q.dtype and got.shape == (3, 16, 128)
    assert rel_err(got, ref) < TOL["bf16"]
    np.testing.assert_allclose(lse, ref_lse, rtol=LSE_TOL, atol=LSE_TOL)


def test_equal_widths_given_take_the_usual_path(rng):
    q, k, v = _inputs(rng, 0, 16, 4, 128, 128, 333)
    ref = fd.reference_gqa_decode(q, k, v)
    got = fd.gqa_decode(q, k, v, head_dim_v=128)
    assert got.shape == (16, 128) and rel_err(got, ref) < TOL["bf16"]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_torch_views_of_wider_rows_are_read_in_place(rng, layout):
    """K and V as a torch.split of one buffer of 192 + 128 columns (rows 640 bytes apart),
    the first n tokens of a larger cache, against the reference on their copies."""
    torch = pytest.importorskip("torch")
    n_heads, n_kv, d, dv, cap, n = 16, 16, 192, 128, 900, 777
    shape = (cap, n_kv, d + dv) if layout == "NHD" else (1, n_kv, cap, d + dv)
    kv = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    k, v = torch.split(kv, [d, dv], dim=-1)
    k, v = (k[:n], v[:n]) if layout == "NHD" else (k[:, :, :n], v[:, :, :n])
    q = torch.randn((2, n_heads, d), dtype=torch.bfloat16, device="cuda")
    got, lse = fd.gqa_decode(q, k, v, head_dim_v=dv, kv_layout=layout, return_lse=True)
    assert isinstance(got, fd.DeviceArray) or torch.is_tensor(got)
    got = torch.from_dlpack(got) if not torch.is_tensor(got) else got
    host = [t.float().contiguous().cpu().numpy() for t in (q, k, v)]
    ref, ref_lse = fd.reference_gqa_decode(*host, head_dim_v=dv, kv_layout=layout,
                                           return_lse=True)  # fmt: skip
    assert rel_err(got.float().cpu().numpy(), ref) < TOL["bf16"]
    np.testing.assert_allclose(lse.to_host(), ref_lse, rtol=LSE_TOL, atol=LSE_TOL)


def test_an_unaligned_view_is_refused(rng):
    torch = pytest.importorskip("torch")
    kv = torch.randn((50, 4, 132 + 192), dtype=torch.bfloat16, device="cuda")
    k, v = kv[..., 132:], kv[..., :128]  # (k starts 264 bytes in; rows 648 bytes apart)
    q = torch.randn((16, 192), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="k_cache: every row must start on a 16-byte"):
        fd.gqa_decode(q, k, v, head_dim_v=128)
