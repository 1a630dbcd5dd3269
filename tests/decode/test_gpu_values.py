"""``gqa_decode(..., head_dim_v=...)`` on the GPU (issue 50): values of their own width on the
latent kernels (V rows of their own), against ``reference_gqa_decode(..., head_dim_v=...)``
on fresh random inputs, outputs poisoned: DeepSeek's expanded heads (16 heads, K 192, V
128) and wide GQA heads, one or three queries, lengths 0, 1, 17 and 777, NHD and HND,
bf16 and fp16, every feature the kernels take, the LSE, torch views read in place; a length
on the device (``values_decode(..., seq_len=)``: lengths 0, 1, odd and whole, the rows past
it NaN so reading one would show) and one graph captured once, replayed at every length."""

from __future__ import annotations

import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.decode.values import values_decode

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


CAPACITY = 1000


def _past(a, n, layout):
    """``a`` (K or V of CAPACITY tokens) with its rows from token ``n`` on NaN."""
    a = a.copy()
    if layout == "NHD":
        a[n:] = np.nan
    else:
        a[:, n:] = np.nan
    return a


def _first(a, n, layout):
    """``a``'s first ``n`` tokens (contiguous, as the reference takes them)."""
    return np.ascontiguousarray(a[:n] if layout == "NHD" else a[:, :n])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("n_q", [0, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_a_device_length_reads_only_the_tokens_before_it(rng, shape, n_q, layout):
    """K and V of CAPACITY tokens whose rows past the length are NaN, the length an int32
    on the device: the reference of the first n tokens, out and LSE (poisoned) written."""
    n_heads, n_kv, d, dv = shape
    q, k, v = _inputs(rng, n_q, n_heads, n_kv, d, dv, CAPACITY, layout=layout)
    # (n_q queries are the cache's last n_q tokens: at least n_q of them)
    for n in (0, 1, 17, 777, CAPACITY) if not n_q else (n_q, 17, 777, CAPACITY):
        out = poisoned((*q.shape[:-1], dv), q.dtype)
        lse = poisoned(q.shape[:-1], np.float32)
        seq = fd.to_device(np.array([n], np.int32))
        k_d, v_d = (fd.to_device(_past(a, n, layout)) for a in (k, v))
        got = values_decode(fd.to_device(q), k_d, v_d, dv, kv_layout=layout, out=out, lse=lse,
                            seq_len=seq)  # fmt: skip
        assert got[0] is out and got[1] is lse
        host, host_lse = out.to_host().astype(np.float64), lse.to_host()
        if n == 0:
            assert not host.any() and np.isneginf(host_lse).all()
            continue
        ref, ref_lse = fd.reference_gqa_decode(q, _first(k, n, layout), _first(v, n, layout),
                                               head_dim_v=dv, kv_layout=layout,
                                               return_lse=True)  # fmt: skip
        assert np.isfinite(host).all() and rel_err(host, ref) < TOL["bf16"], (n, shape)
        np.testing.assert_allclose(host_lse, ref_lse, rtol=LSE_TOL, atol=LSE_TOL)


def test_a_host_length_reads_only_the_tokens_before_it(rng):
    q, k, v = _inputs(rng, 3, 16, 16, 192, 128, CAPACITY)
    n = 333
    got = values_decode(q, _past(k, n, "NHD"), _past(v, n, "NHD"), 128, seq_len=n)
    ref = fd.reference_gqa_decode(q, k[:n], v[:n], head_dim_v=128)
    assert rel_err(got, ref) < TOL["bf16"]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_a_graph_captured_once_serves_every_length(rng, layout):
    """Captured with out, lse, device sinks and a device length (after an eager call made
    the workspace), replayed at lengths up to the capacity, the rows past each length NaN:
    each replay matches the reference at its length, two queries (the last two tokens),
    with a window."""
    n_heads, n_kv, d, dv, n_q = 32, 8, 256, 128, 2
    q, k, v = _inputs(rng, n_q, n_heads, n_kv, d, dv, CAPACITY, layout=layout)
    sinks = rng.standard_normal(n_heads).astype(np.float32)
    kw = dict(kv_layout=layout, sliding_window=300, sinks=fd.to_device(sinks))
    with fd.Stream() as stream:
        q_d, k_d, v_d = (fd.to_device(a) for a in (q, k, v))
        seq = fd.to_device(np.array([n_q], np.int32))
        out, lse = fd.empty((n_q, n_heads, dv), q.dtype), fd.empty((n_q, n_heads), np.float32)
        values_decode(q_d, k_d, v_d, dv, out=out, lse=lse, seq_len=seq, stream=stream, **kw)
        stream.synchronize()
        with stream.capture() as graph:
            values_decode(q_d, k_d, v_d, dv, out=out, lse=lse, seq_len=seq, stream=stream, **kw)
        replay = graph.instantiate()
        graph.close()
        for n in (2, 3, 64, 65, 301, 777, 999, CAPACITY, 17):
            k_d.copy_from_host(_past(k, n, layout), stream)
            v_d.copy_from_host(_past(v, n, layout), stream)
            seq.copy_from_host(np.array([n], np.int32), stream)
            out.fill_bytes(0xFF, stream)
            lse.fill_bytes(0xFF, stream)
            replay.launch(stream)
            stream.synchronize()
            ref, ref_lse = fd.reference_gqa_decode(
                q, _first(k, n, layout), _first(v, n, layout), head_dim_v=dv,
                kv_layout=layout, return_lse=True, sliding_window=300, sinks=sinks,
            )  # fmt: skip
            got = out.to_host(stream).astype(np.float64)
            assert rel_err(got, ref) < TOL["bf16"], n
            np.testing.assert_allclose(lse.to_host(stream), ref_lse, rtol=LSE_TOL, atol=LSE_TOL)
        replay.close()


def test_a_first_call_inside_a_capture_is_refused_by_name(rng):
    """The workspace is made on a first call outside a capture: a first call inside a fresh
    stream's capture says so, and the same call outside the capture is right."""
    q, k, v = _inputs(rng, 0, 16, 16, 192, 128, 100)
    with fd.Stream() as stream:
        q_d, k_d, v_d = (fd.to_device(a) for a in (q, k, v))
        seq = fd.to_device(np.array([100], np.int32))
        out = fd.empty((16, 128), q.dtype)
        refused = pytest.raises(fd.FerroxError, match="make one eager call first")
        with refused, stream.capture():
            values_decode(q_d, k_d, v_d, 128, out=out, seq_len=seq, stream=stream)
        out.fill_bytes(0xFF, stream)
        values_decode(q_d, k_d, v_d, 128, out=out, seq_len=seq, stream=stream)
        ref = fd.reference_gqa_decode(q, k, v, head_dim_v=128)
        assert rel_err(out.to_host(stream), ref) < TOL["bf16"]


def test_a_torch_cache_and_length_are_read_inside_a_torch_graph(rng):
    """A torch static cache (K and V a torch.split of one head-major buffer) and an int32
    length tensor, captured in torch.cuda.graph on a fresh stream (the first call there
    inside the capture, in relaxed mode as torch's ops make theirs) and replayed at every
    length, the buffer's rows past it NaN."""
    torch = pytest.importorskip("torch")

    n_heads, d, dv, cap = 16, 192, 128, 1024
    clean = torch.randn((1, n_heads, cap, d + dv), dtype=torch.bfloat16, device="cuda")
    kv = clean.clone()
    k, v = kv[..., :d], kv[..., d:]
    q = torch.randn((n_heads, d), dtype=torch.bfloat16, device="cuda")
    out = torch.empty((n_heads, dv), dtype=torch.bfloat16, device="cuda")
    seq = torch.ones(1, dtype=torch.int32, device="cuda")
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=side, capture_error_mode="relaxed"):
        values_decode(q, k, v, dv, out=out, seq_len=seq, kv_layout="HND")
    host = [t.float().cpu().numpy() for t in (q, clean[..., :d], clean[..., d:])]
    for n in (1, 2, 17, 500, cap):
        kv.copy_(clean)
        kv[:, :, n:] = float("nan")
        seq.fill_(n)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = fd.reference_gqa_decode(host[0], *(np.ascontiguousarray(a[:, :, :n])
                                                 for a in host[1:]),
                                      head_dim_v=dv, kv_layout="HND")  # fmt: skip
        assert rel_err(out.float().cpu().numpy(), ref) < TOL["bf16"], n
