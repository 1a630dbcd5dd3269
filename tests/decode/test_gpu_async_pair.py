"""gqa_decode_async over a caller's (k_cache, v_cache) pair on the GPU: a static cache read
in place, token-major or head-major, the length an int32 on the device; against the float64
reference of its first seq_len tokens (NaN past them: never read), outputs poisoned before
each kernel; with features; captured once and replayed as the length changes; the first
call of a signature refused inside a capture, clearly."""

from __future__ import annotations

import numpy as np
import pytest

import ferrox_driver as fd

from ..helpers.gpu_helpers import DTYPES, TOL, random_decode_inputs, rel_err

pytestmark = pytest.mark.gpu

CAP = 5000


def _static_cache(k, v, layout, cap=CAP):
    """k, v (n, n_kv, hd) in a (cap, ...) buffer of the layout, NaN past n, on the device."""
    n, n_kv, hd = k.shape
    arrays = []
    for rows in (k, v):
        if layout == "HND":
            full = np.full((1, n_kv, cap, hd), np.nan, rows.dtype)
            full[0, :, :n] = rows.transpose(1, 0, 2)
        else:
            full = np.full((cap, n_kv, hd), np.nan, rows.dtype)
            full[:n] = rows
        arrays.append(fd.to_device(full))
    return tuple(arrays)


def _length(n):
    return fd.to_device(np.array([n], np.int32))


CASES = (
    [(dt, layout, 128, 32, 8) for dt in DTYPES for layout in ("NHD", "HND")]
    + [("bf16", "HND", hd, 32, 8) for hd in (64, 80, 96, 256)]
    + [("f16", "HND", 128, nh, nkv) for nh, nkv in ((8, 8), (8, 1), (28, 4))]
)


@pytest.mark.parametrize("dtype,layout,head_dim,n_heads,n_kv", CASES)
def test_a_pair_decodes_its_first_seq_len_tokens_in_place(
    rng, dtype, layout, head_dim, n_heads, n_kv
):
    dt = DTYPES[dtype]
    q, k, v = random_decode_inputs(rng, n_heads, n_kv, head_dim, CAP, dt)
    with fd.Stream() as stream:
        q_d, out = fd.to_device(q), fd.empty(q.shape, dt)
        seq = _length(0)
        for n in (0, 1, 301, 4097, CAP):  # one length array, its value changed on the device
            pair = _static_cache(k[:n], v[:n], layout)  # NaN past n; new buffers each time
            seq.copy_from_host(np.array([n], np.int32), stream)
            out.fill_bytes(0xFF, stream)
            fd.gqa_decode_async(q_d, pair, out, n_heads=n_heads, stream=stream, seq_len=seq,
                                kv_layout=layout)  # fmt: skip
            got = out.to_host(stream)
            if n == 0:
                assert not got.astype(np.float64).any()
                continue
            ref = fd.reference_gqa_decode(q, k[:n], v[:n], n_heads=n_heads, n_kv_heads=n_kv,
                                          head_dim=head_dim)  # fmt: skip
            assert rel_err(got, ref) < TOL[dtype], (n, rel_err(got, ref))


def test_a_pair_decode_with_features_matches_the_reference(rng):
    n_heads, n_kv, hd, n = 32, 8, 128, 3001
    dt = DTYPES["bf16"]
    q, k, v = random_decode_inputs(rng, n_heads, n_kv, hd, n, dt)
    sinks = rng.standard_normal(n_heads).astype(np.float32)
    feats = {"sliding_window": 700, "logits_soft_cap": 30.0, "scale": 0.1}
    ref, ref_lse = fd.reference_gqa_decode(q, k, v, n_heads=n_heads, n_kv_heads=n_kv,
                                           head_dim=hd, sinks=sinks, return_lse=True,
                                           **feats)  # fmt: skip
    pair = _static_cache(k, v, "HND")
    with fd.Stream() as stream:
        q_d, out = fd.to_device(q), fd.empty(q.shape, dt)
        lse = fd.empty((n_heads,), np.float32)
        out.fill_bytes(0xFF, stream)
        lse.fill_bytes(0xFF, stream)
        fd.gqa_decode_async(q_d, pair, out, n_heads=n_heads, stream=stream, seq_len=_length(n),
                            kv_layout="HND", sinks=fd.to_device(sinks), out_lse=lse,
                            **feats)  # fmt: skip
        assert rel_err(out.to_host(stream), ref) < TOL["bf16"]
        np.testing.assert_allclose(lse.to_host(stream), ref_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_a_pair_decode_captured_once_follows_the_length_on_the_device(rng, layout):
    n_heads, n_kv, hd = 32, 8, 128
    dt = DTYPES["bf16"]
    q, k, v = random_decode_inputs(rng, n_heads, n_kv, hd, CAP, dt)
    pair = _static_cache(k, v, layout)
    seq = _length(1)
    with fd.Stream() as stream:
        q_d, out = fd.to_device(q), fd.empty(q.shape, dt)
        kw = dict(n_heads=n_heads, stream=stream, seq_len=seq, kv_layout=layout)
        fd.gqa_decode_async(q_d, pair, out, **kw)  # its launches, before the capture
        stream.synchronize()
        with stream.capture() as graph:
            fd.gqa_decode_async(q_d, pair, out, **kw)
        exe = graph.instantiate()
        graph.close()
        for n in (1, 64, 65, 999, 4097, CAP, 17):
            seq.copy_from_host(np.array([n], np.int32), stream)
            out.fill_bytes(0xFF, stream)
            exe.launch(stream)
            ref = fd.reference_gqa_decode(q, k[:n], v[:n], n_heads=n_heads, n_kv_heads=n_kv,
                                          head_dim=hd)  # fmt: skip
            assert rel_err(out.to_host(stream), ref) < TOL["bf16"], n
        exe.close()


def test_the_first_pair_decode_of_a_signature_inside_a_capture_is_refused(rng):
    n_heads, n_kv, hd = 16, 4, 64
    dt = DTYPES["f16"]
    q, k, v = random_decode_inputs(rng, n_heads, n_kv, hd, 100, dt)
    pair = _static_cache(k, v, "HND", cap=777)  # a capacity no other test used
    seq = _length(100)
    with fd.Stream() as stream:
        q_d, out = fd.to_device(q), fd.empty(q.shape, dt)
        kw = dict(n_heads=n_heads, stream=stream, seq_len=seq, kv_layout="HND")
        refused = pytest.raises(fd.FerroxError, match="run it once before capturing")
        with refused, stream.capture():
            fd.gqa_decode_async(q_d, pair, out, **kw)
        # the stream still works, and the same call outside a capture is right
        out.fill_bytes(0xFF, stream)
        fd.gqa_decode_async(q_d, pair, out, **kw)
        ref = fd.reference_gqa_decode(q, k, v, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd)
        assert rel_err(out.to_host(stream), ref) < TOL["f16"]


def test_a_torch_static_cache_is_decoded_in_place_inside_a_torch_graph(rng):
    torch = pytest.importorskip("torch")
    n_heads, n_kv, hd, cap = 32, 8, 128, 2048
    g = torch.Generator("cuda").manual_seed(3)
    kc = torch.randn(1, n_kv, cap, hd, generator=g, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(1, n_kv, cap, hd, generator=g, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(n_heads, hd, generator=g, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    length = torch.ones(1, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())

    def step():
        fd.gqa_decode_async(q, (kc, vc), out, n_heads=n_heads, seq_len=length,
                            stream=torch.cuda.current_stream().cuda_stream,
                            kv_layout="HND")  # fmt: skip

    with torch.cuda.stream(side):
        step()  # warm-up on the capture stream
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        step()
    for n in (1, 100, 2048):
        length.fill_(n)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        mask = torch.zeros(1, 1, 1, cap, dtype=torch.bool, device="cuda")
        mask[..., :n] = True
        want = torch.nn.functional.scaled_dot_product_attention(
            q.view(1, n_heads, 1, hd).double(),
            kc.double(),
            vc.double(),
            attn_mask=mask,
            enable_gqa=True,
        ).view(n_heads, hd)  # fmt: skip (the float64 reference)
        err = ((out.double() - want).norm() / want.norm()).item()
        assert err < TOL["bf16"], (n, err)


def test_repeated_calls_of_one_shape_read_each_calls_own_head_strides(rng):
    # eager calls are remembered by their shapes and strides: the same shape with the heads
    # another number of rows apart is another call, never the last one's launches
    torch = pytest.importorskip("torch")
    n_heads, n_kv, hd, cap, n = 8, 2, 64, 300, 257
    q, k, v = random_decode_inputs(rng, n_heads, n_kv, hd, n, np.float16)
    ref = fd.reference_gqa_decode(q, k, v, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd)
    cuda = torch.device("cuda")
    length = torch.full((1,), n, dtype=torch.int32, device=cuda)
    q_t = torch.from_numpy(q).to(cuda)
    stream = torch.cuda.current_stream()
    for extra in (0, 100, 0, 37, 100):  # rows past the capacity in each head's buffer
        pair = []
        for rows in (k, v):
            buf = torch.full((1, n_kv, cap + extra, hd), float("nan"), dtype=torch.float16,
                             device=cuda)  # fmt: skip
            buf[0, :, :n] = torch.from_numpy(rows.transpose(1, 0, 2).copy()).to(cuda)
            pair.append(buf[:, :, :cap])
        out = torch.full((n_heads, hd), float("nan"), dtype=torch.float16, device=cuda)
        fd.gqa_decode_async(q_t, tuple(pair), out, n_heads=n_heads, stream=stream,
                            seq_len=length, kv_layout="HND")  # fmt: skip
        got = out.cpu().numpy()
        assert rel_err(got, ref) < TOL["f16"], (extra, rel_err(got, ref))
