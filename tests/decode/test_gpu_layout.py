"""Head-major K and V (gqa_decode's kv_layout="HND": [kv_head][token][head_dim]) on the GPU,
against the float64 reference of the same cache token-major, outputs poisoned before each
kernel: every kernel family (tensor cores padded or not, CUDA cores, fp32 TF32), MHA, GQA
and MQA, lengths 0, 1, odd and past a chunk, views of a larger cache read in place."""

from __future__ import annotations

import numpy as np
import pytest

import ferrox_driver as fd

from ..helpers.gpu_helpers import DTYPES, TOL, poisoned, random_decode_inputs, rel_err

pytestmark = pytest.mark.gpu


class StridedView:
    """A device view with strides, as the CUDA array interface describes one (what
    ``cache[:, :n]`` of a larger head-major cache is in PyTorch or CuPy)."""

    def __init__(self, base: fd.DeviceArray, shape, strides):
        cai = dict(base.__cuda_array_interface__)
        cai["shape"] = tuple(shape)
        cai["strides"] = tuple(s * base.dtype.itemsize for s in strides)
        self.__cuda_array_interface__ = cai
        self.base = base


def _reference(q, k, v, n_heads, n_kv, head_dim, **kw):
    return fd.reference_gqa_decode(
        q, k, v, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, **kw
    )


def _decode_hnd(q, k_hnd, v_hnd, n_heads, n_kv, head_dim, **kw):
    out = poisoned(q.shape, q.dtype)
    got = fd.gqa_decode(fd.to_device(q), k_hnd, v_hnd, n_heads=n_heads, n_kv_heads=n_kv,
                        head_dim=head_dim, out=out, kv_layout="HND", **kw)  # fmt: skip
    return got


CASES = (
    [(dt, hd, 32, 8) for dt in DTYPES for hd in (1, 40, 64, 72, 128, 256)]
    + [(dt, 128, nh, nkv) for dt in DTYPES for nh, nkv in ((8, 8), (8, 1), (48, 4))]
    + [("bf16", hd, 32, 8) for hd in (8, 80, 96, 200)]
)


@pytest.mark.parametrize("dtype,head_dim,n_heads,n_kv", CASES)
def test_head_major_decode_matches_the_reference(rng, dtype, head_dim, n_heads, n_kv):
    for seq in (0, 1, 301, 4097):
        q, k, v = random_decode_inputs(rng, n_heads, n_kv, head_dim, seq, DTYPES[dtype])
        k_hnd = fd.to_device(np.ascontiguousarray(k.transpose(1, 0, 2)))
        v_hnd = fd.to_device(np.ascontiguousarray(v.transpose(1, 0, 2)))
        got = _decode_hnd(q, k_hnd, v_hnd, n_heads, n_kv, head_dim).to_host()
        ref = _reference(q, k, v, n_heads, n_kv, head_dim)
        if seq == 0:
            assert not got.astype(np.float64).any()
        else:
            assert rel_err(got, ref) < TOL[dtype], (seq, rel_err(got, ref))


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_a_view_of_the_first_tokens_of_a_larger_cache_is_read_in_place(rng, dtype):
    """(1, n_kv, capacity, D) caches, the decode over their first n tokens: heads
    capacity * D elements apart, the tokens past n never read (NaN there)."""
    n_heads, n_kv, hd, cap = 16, 4, 128, 5000
    dt = DTYPES[dtype]
    for n in (1, 999, 4097):
        q, k, v = random_decode_inputs(rng, n_heads, n_kv, hd, n, dt)
        views = []
        for rows in (k, v):
            full = np.full((1, n_kv, cap, hd), np.nan, dt)
            full[0, :, :n] = rows.transpose(1, 0, 2)
            base = fd.to_device(full)
            views.append(StridedView(base, (1, n_kv, n, hd), (n_kv * cap * hd, cap * hd, hd, 1)))
        got = _decode_hnd(q, views[0], views[1], n_heads, n_kv, hd).to_host()
        assert rel_err(got, _reference(q, k, v, n_heads, n_kv, hd)) < TOL[dtype]


@pytest.mark.parametrize(
    "shape,strides,message",
    [
        ((4, 32, 16), (64 * 32, 64, 1), "each token's row must be contiguous"),  # token stride
        ((4, 32, 16), (64 * 32, 32, 2), "each token's row must be contiguous"),  # elements
        ((4, 64, 16), (16, 16, 1), "KV heads 16 elements apart overlap"),
    ],
)
def test_device_views_that_are_not_head_major_rows_are_refused(shape, strides, message):
    base = fd.to_device(np.zeros((4, 64, 32), np.float16))
    q = fd.to_device(np.zeros((8, 16), np.float16))
    view = StridedView(base, shape, strides)
    with pytest.raises(ValueError, match=f"k_cache: .*{message}"):
        fd.gqa_decode(q, view, view, n_heads=8, n_kv_heads=4, head_dim=16, kv_layout="HND")


def test_head_major_with_features_and_numpy_inputs(rng):
    n_heads, n_kv, hd, seq = 32, 8, 128, 3000
    q, k, v = random_decode_inputs(rng, n_heads, n_kv, hd, seq, DTYPES["bf16"])
    kw = dict(sliding_window=700, logits_soft_cap=30.0, return_lse=True,
              sinks=rng.standard_normal(n_heads).astype(np.float32))  # fmt: skip
    ref, ref_lse = _reference(q, k, v, n_heads, n_kv, hd, **kw)
    k_hnd, v_hnd = k.transpose(1, 0, 2), v.transpose(1, 0, 2)  # numpy views: copied in
    got, lse = fd.gqa_decode(q, k_hnd, v_hnd, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd,
                             kv_layout="HND", **kw)  # fmt: skip
    assert rel_err(got, ref) < TOL["bf16"]
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-3, atol=1e-3)


def test_a_torch_static_cache_slice_is_read_in_place(rng):
    torch = pytest.importorskip("torch")
    n_heads, n_kv, hd, cap, n = 32, 8, 128, 8192, 2345
    q, k, v = random_decode_inputs(rng, n_heads, n_kv, hd, n, np.float32)
    kc = torch.full((1, n_kv, cap, hd), float("nan"), dtype=torch.bfloat16, device="cuda")
    vc = torch.full_like(kc, float("nan"))
    kc[0, :, :n] = torch.from_numpy(k.transpose(1, 0, 2).copy()).to(kc)
    vc[0, :, :n] = torch.from_numpy(v.transpose(1, 0, 2).copy()).to(vc)
    qt = torch.from_numpy(q).to(device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(qt, float("nan"))
    fd.gqa_decode(qt, kc[:, :, :n], vc[:, :, :n], n_heads=n_heads, n_kv_heads=n_kv,
                  head_dim=hd, out=out, kv_layout="HND")  # fmt: skip
    torch.cuda.synchronize()
    got = out.float().cpu().numpy()
    kb = np.ascontiguousarray(kc[0, :, :n].float().cpu().numpy().transpose(1, 0, 2))
    vb = np.ascontiguousarray(vc[0, :, :n].float().cpu().numpy().transpose(1, 0, 2))
    qb = qt.float().cpu().numpy()
    assert rel_err(got, _reference(qb, kb, vb, n_heads, n_kv, hd)) < TOL["bf16"]
