"""Speculative verify on the capturable entry points (issue 48): multi-row
``kv_append_async`` into a KVCache (bf16 and fp8), ``gqa_decode_async`` of q ``(n_q,
n_heads, head_dim)`` (KVCache and pair, causal and under a device tree mask), the torch op,
``DecodeGraph``/``LayerDecodeGraph`` per n_q, and a captured draft-verify-rollback loop of
1,000 steps against a host-driven reference, cache bytes compared."""

from __future__ import annotations

import numpy as np
import pytest

import ferrox_driver as fd

from ..helpers.gpu_helpers import DTYPES, TOL, poisoned, rel_err

pytestmark = pytest.mark.gpu

H, KV, D = 8, 2, 64
BF16 = DTYPES["bf16"]


def rows(rng, n, kv=KV, d=D):
    return tuple(rng.standard_normal((n, kv, d)).astype(BF16) for _ in "kv")


def queries(rng, n_q, h=H, d=D):
    return rng.standard_normal((n_q, h, d)).astype(BF16)


def random_tree(rng, n_q):
    """A draft tree: each token's parent an earlier one; a token sees its ancestors."""
    mask = np.eye(n_q, dtype=bool)
    for t in range(1, n_q):
        mask[t] |= mask[int(rng.integers(0, t))]
    return mask


def same_bytes(kv, k, v):
    got_k, got_v = kv.to_host()
    assert got_k.view(np.uint16).tobytes() == k.view(np.uint16).tobytes()
    assert got_v.view(np.uint16).tobytes() == v.view(np.uint16).tobytes()


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_multi_row_device_append_writes_what_a_host_extend_writes(rng, dtype):
    k0, v0 = rows(rng, 5)
    k1, v1 = rows(rng, 7)
    with fd.KVCache(KV, D, 16, dtype=dtype) as a, fd.KVCache(KV, D, 16, dtype=dtype) as b:
        a.extend(k0, v0)
        b.extend(k0, v0)
        a.extend(k1, v1)
        fd.kv_append_async(b, fd.to_device(k1), fd.to_device(v1), stream=b.stream)
        assert b.seq_len == 12
        for x, y in zip(a.dequantized(), b.dequantized(), strict=True):
            assert x.tobytes() == y.tobytes()
        # rows that would not all fit: none written, the overflow reported at synchronize
        fd.kv_append_async(b, fd.to_device(k1), fd.to_device(v1), stream=b.stream)
        with pytest.raises(fd.KVCapacityError):
            b.synchronize()
        assert b.seq_len == 12
        for x, y in zip(a.dequantized(), b.dequantized(), strict=True):
            assert x.tobytes() == y.tobytes()
        with pytest.raises(ValueError, match=r"^k_dev: expected one token"):
            fd.kv_append_async(b, fd.to_device(k1[:, :1]), fd.to_device(v1[:, :1]),
                               stream=b.stream)  # fmt: skip
        with pytest.raises(ValueError, match=r"^v_dev: expected k_dev's shape"):
            fd.kv_append_async(b, fd.to_device(k1), fd.to_device(v1[:3]), stream=b.stream)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_gqa_decode_async_verifies_a_kv_cache_eager_and_captured(rng, verify_path, dtype):
    n_q = 5
    k, v = rows(rng, 300)
    with fd.KVCache(KV, D, 512, dtype=dtype) as kv, fd.Stream() as s:
        kv.extend(k, v)
        kq, vq = kv.dequantized()
        q = queries(rng, n_q)
        q_d, out = fd.to_device(q), poisoned(q.shape, BF16)
        lse = fd.empty((n_q * H,), np.float32)
        mask = random_tree(rng, n_q)
        mask_d = fd.to_device(mask)
        slopes = fd.to_device((2.0 ** -np.arange(1, H + 1)).astype(np.float32))
        kw = dict(sliding_window=77, alibi_slopes=slopes, out_lse=lse)
        fd.gqa_decode_async(q_d, kv, out, stream=s, tree_mask=mask_d, **kw)
        s.synchronize()
        ref, ref_lse = fd.reference_gqa_decode(
            q, kq, vq, tree_mask=mask, sliding_window=77, alibi_slopes=slopes.to_host(),
            return_lse=True,
        )  # fmt: skip
        assert rel_err(out.to_host(), ref) < 2e-2
        np.testing.assert_allclose(lse.to_host().reshape(n_q, H), ref_lse, rtol=3e-2, atol=3e-2)
        # captured: the length and the mask read at each replay
        kv.prepare(H, n_q=n_q, sliding_window=77, alibi_slopes=slopes, return_lse=True)
        with s.capture() as graph:
            fd.gqa_decode_async(q_d, kv, out, stream=s, tree_mask=mask_d, **kw)
        exe = graph.instantiate()
        graph.close()
        for step in range(3):
            k1, v1 = rows(rng, 2)
            kv.extend(k1, v1)
            kq, vq = kv.dequantized()
            mask = random_tree(rng, n_q) if step else np.tril(np.ones((n_q, n_q), bool))
            mask_d.copy_from_host(mask)
            out.fill_bytes(0xFF)
            exe.launch(s)
            s.synchronize()
            ref = fd.reference_gqa_decode(q, kq, vq, tree_mask=mask, sliding_window=77,
                                          alibi_slopes=slopes.to_host())  # fmt: skip
            assert rel_err(out.to_host(), ref) < 2e-2
        exe.close()
        with pytest.raises(ValueError, match=r"^q_dev: 600 query tokens for a cache of 512"):
            fd.gqa_decode_async(fd.empty((600, H, D), BF16), kv, fd.empty((600, H, D), BF16),
                                stream=s)  # fmt: skip
        with pytest.raises(TypeError, match=r"^tree_mask: expected a device array"):
            fd.gqa_decode_async(q_d, kv, out, stream=s, tree_mask=mask)
        with pytest.raises(ValueError, match=r"^tree_mask: expected shape \(5, 5\)"):
            fd.gqa_decode_async(
                q_d, kv, out, stream=s, tree_mask=fd.to_device(np.eye(4, dtype=bool))
            )
        with pytest.raises(ValueError, match=r"^out_lse: expected 40 contiguous float32"):
            fd.gqa_decode_async(q_d, kv, out, stream=s, out_lse=fd.empty((H,), np.float32))


def test_gqa_decode_async_verifies_a_pair_of_either_layout(rng, verify_path):
    n_q, cap, seq = 4, 256, 181
    q = queries(rng, n_q)
    k, v = rows(rng, cap)
    for layout in ("NHD", "HND"):
        heads_first = layout == "HND"
        pair = tuple(fd.to_device(np.ascontiguousarray(a.transpose(1, 0, 2)) if heads_first else a)
                     for a in (k, v))  # fmt: skip
        seq_d = fd.to_device(np.array([seq], np.int32))
        mask = random_tree(rng, n_q)
        out = poisoned(q.shape, BF16)
        with fd.Stream() as s:
            fd.gqa_decode_async(fd.to_device(q), pair, out, stream=s, seq_len=seq_d,
                                kv_layout=layout, tree_mask=fd.to_device(mask),
                                logits_soft_cap=4.0)  # fmt: skip
            s.synchronize()
        ref = fd.reference_gqa_decode(q, k[:seq], v[:seq], tree_mask=mask, logits_soft_cap=4.0)
        assert rel_err(out.to_host(), ref) < TOL["bf16"]


def test_n_queries_reads_flat_buffers_as_the_3d_form(rng, verify_path):
    """gqa_decode_async's ``n_queries``: a flat q and out (or ``(n_q * n_heads,
    head_dim)``) of n_q query tokens decode as the ``(n_q, n_heads, head_dim)`` form does,
    on a KVCache and on a pair, captured too."""
    n_q = 6
    k, v = rows(rng, 200)
    q = queries(rng, n_q)
    ref = fd.reference_gqa_decode(q, k, v)
    with fd.KVCache(KV, D, 256, dtype=BF16) as kv, fd.Stream() as s:
        kv.extend(k, v)
        for shape in ((n_q * H * D,), (n_q * H, D)):
            out = poisoned(shape, BF16)
            fd.gqa_decode_async(fd.to_device(q.reshape(shape)), kv, out, stream=s,
                                n_queries=n_q)  # fmt: skip
            s.synchronize()
            assert rel_err(out.to_host().reshape(q.shape), ref) < TOL["bf16"]
        q_d, out = fd.to_device(q.reshape(-1)), poisoned((n_q * H * D,), BF16)
        kv.prepare(H, n_q=n_q)
        with s.capture() as graph:
            fd.gqa_decode_async(q_d, kv, out, stream=s, n_queries=n_q)
        exe = graph.instantiate()
        graph.close()
        exe.launch(s)
        s.synchronize()
        exe.close()
        assert rel_err(out.to_host().reshape(q.shape), ref) < TOL["bf16"]
    pair = (fd.to_device(k), fd.to_device(v))
    out = poisoned((n_q * H * D,), BF16)
    with fd.Stream() as s:
        fd.gqa_decode_async(fd.to_device(q.reshape(-1)), pair, out, stream=s, n_queries=n_q,
                            seq_len=fd.to_device(np.array([200], np.int32)))  # fmt: skip
        s.synchronize()
    assert rel_err(out.to_host().reshape(q.shape), ref) < TOL["bf16"]


def test_the_torch_op_takes_several_query_tokens(rng, verify_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    import ferrox_driver.integrations.torch as fxt

    n_q, cap, seq = 6, 128, 97
    q = queries(rng, n_q)
    k, v = rows(rng, cap)

    def t(a):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()

    mask = random_tree(rng, n_q)
    kc, vc = t(k), t(v)
    seq_len = torch.tensor([seq], dtype=torch.int32, device="cuda")
    out, lse = fxt.gqa_decode(t(q), kc, vc, seq_len, return_lse=True,
                              tree_mask=torch.from_numpy(mask).cuda())  # fmt: skip
    eager = fxt.gqa_decode(t(q), kc[:seq], vc[:seq])
    ref, ref_lse = fd.reference_gqa_decode(q, k[:seq], v[:seq], tree_mask=mask, return_lse=True)
    ref_causal = fd.reference_gqa_decode(q, k[:seq], v[:seq])

    def host(x):
        return x.float().cpu().numpy()

    assert out.shape == (n_q, H, D) and lse.shape == (n_q, H)
    assert rel_err(host(out), ref) < TOL["bf16"]
    np.testing.assert_allclose(host(lse), ref_lse, rtol=2e-2, atol=2e-2)
    assert rel_err(host(eager), ref_causal) < TOL["bf16"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_decode_graph_per_n_q_causal_and_tree(rng, verify_path, dtype):
    n_q = 4
    k, v = rows(rng, 50)
    with fd.KVCache(KV, D, 256, dtype=dtype) as kv:
        kv.extend(k, v)
        causal = fd.DecodeGraph(kv, n_heads=H, n_q=n_q, return_lse=True)
        tree = fd.DecodeGraph(kv, n_heads=H, n_q=n_q, tree_mask=random_tree(rng, n_q))
        assert causal.q.shape == (n_q, H, D) and causal.k.shape == (n_q, KV, D)
        for step in range(6):
            q = queries(rng, n_q)
            k1, v1 = rows(rng, n_q)
            graph = tree if step % 2 else causal
            mask = random_tree(rng, n_q) if step % 2 else None
            got = graph(q, k1, v1, tree_mask=mask) if mask is not None else graph(q, k1, v1)
            kq, vq = kv.dequantized()
            assert kv.seq_len == 50 + n_q * (step + 1)
            ref, ref_lse = fd.reference_gqa_decode(q, kq, vq, tree_mask=mask, return_lse=True)
            assert got.shape == (n_q, H, D)
            assert rel_err(got, ref) < 2e-2
            if mask is None:
                np.testing.assert_allclose(causal.lse, ref_lse, rtol=3e-2, atol=3e-2)
        with pytest.raises(ValueError, match=r"^tree_mask: this graph was built causal"):
            causal(q, k1, v1, tree_mask=np.eye(n_q, dtype=bool))
        with pytest.raises(ValueError, match=r"^tree_mask: the diagonal must be set"):
            tree(q, k1, v1, tree_mask=np.zeros((n_q, n_q), bool))
        kv.extend(*rows(rng, 253 - kv.seq_len))
        with pytest.raises(fd.KVCapacityError):
            causal(q, k1, v1)
        assert kv.seq_len == 253
        causal.close()
        tree.close()


def test_a_layer_decode_graph_verifies_every_layer(rng, verify_path):
    n_layers, n_q = 3, 3
    with fd.LayerKVCache(n_layers, KV, D, 128, dtype=BF16) as layers:
        hist = [rows(rng, 20) for _ in range(n_layers)]
        for kv, (k, v) in zip(layers, hist, strict=True):
            kv.extend(k, v)
        with fd.LayerDecodeGraph(layers, n_heads=H, n_q=n_q) as step:
            for _ in range(3):
                q = rng.standard_normal((n_layers, n_q, H, D)).astype(BF16)
                k1 = rng.standard_normal((n_layers, n_q, KV, D)).astype(BF16)
                v1 = rng.standard_normal((n_layers, n_q, KV, D)).astype(BF16)
                got = step(q, k1, v1)
                assert got.shape == (n_layers, n_q, H, D)
                for i, kv in enumerate(layers):
                    kq, vq = kv.to_host()
                    ref = fd.reference_gqa_decode(q[i], kq, vq)
                    assert rel_err(got[i], ref) < TOL["bf16"]


def test_a_captured_draft_verify_rollback_loop_of_1000_steps(rng, verify_path):
    """Each replay appends 4 draft tokens in one launch, verifies 4 queries under a tree mask
    written on the device, and rolls back to a count read on the device (0-4 drafts kept):
    1,000 replays against the same steps driven on the host, every output and the cache
    bytes compared."""
    steps, k_drafts = 1000, 4
    with fd.KVCache(KV, D, steps * k_drafts + 16, dtype=BF16) as kv, fd.Stream() as s:
        k0, v0 = rows(rng, 3)
        kv.extend(k0, v0)
        ks, vs = [k0], [v0]
        q_d = fd.empty((k_drafts, H, D), BF16)
        k_d, v_d = fd.empty((k_drafts, KV, D), BF16), fd.empty((k_drafts, KV, D), BF16)
        out = fd.empty((k_drafts, H, D), BF16)
        mask_d = fd.to_device(np.eye(k_drafts, dtype=bool))
        n_dev = fd.to_device(np.array([0], np.int32))
        kv.prepare(H, n_q=k_drafts)
        with s.capture() as graph:
            fd.kv_append_async(kv, k_d, v_d, stream=s)
            fd.gqa_decode_async(q_d, kv, out, stream=s, tree_mask=mask_d)
            fd.kv_truncate_async(kv, n_dev, stream=s)
        exe = graph.instantiate()
        graph.close()
        length, worst = 3, 0.0
        for step in range(steps):
            q = queries(rng, k_drafts)
            k, v = rows(rng, k_drafts)
            mask = random_tree(rng, k_drafts)
            keep = int(rng.integers(0, k_drafts + 1))
            for dev, host in ((q_d, q), (k_d, k), (v_d, v), (mask_d, mask)):
                dev.copy_from_host(host)
            n_dev.copy_from_host(np.array([length + keep], np.int32))
            out.fill_bytes(0xFF)
            exe.launch(s)
            s.synchronize()
            k_all, v_all = np.concatenate([*ks, k]), np.concatenate([*vs, v])
            ref = fd.reference_gqa_decode(q, k_all, v_all, tree_mask=mask)
            worst = max(worst, rel_err(out.to_host(), ref))
            ks.append(k[:keep])
            vs.append(v[:keep])
            length += keep
            if step % 250 == 249:
                assert kv.seq_len == length
                same_bytes(kv, np.concatenate(ks), np.concatenate(vs))
        assert worst < TOL["bf16"], worst
        assert kv.seq_len == length
        same_bytes(kv, np.concatenate(ks), np.concatenate(vs))
        exe.close()


def test_a_long_cache_verifies_with_blocks_of_32_rows(rng):
    """A cache planned for 20,000 tokens takes the split blocks of four tiles (32 rows per
    pass over K and V) for 8 queries of a group of 4 (with a window of 300, blocks of 16);
    checked against the reference, with a tree mask and features, bf16 and fp8."""
    from ferrox_driver.decode.launches import plan_split
    from ferrox_driver.driver.device import default_device

    n_q, heads, kv_heads, hd = 8, 16, 4, 128
    plan = plan_split(default_device(), np.dtype(BF16), n_q * heads, kv_heads, hd, 20000,
                      verify=True)  # fmt: skip
    assert plan.spec.block_tiles == 4
    k, v = rows(rng, 700, kv_heads, hd)
    q = queries(rng, n_q, heads, hd)
    mask = random_tree(rng, n_q)
    for dtype in ("bfloat16", "float8_e4m3fn"):
        with fd.KVCache(kv_heads, hd, 20000, dtype=dtype) as kv:
            kv.extend(k, v)
            kq, vq = kv.dequantized()
            for kw in ({}, {"sliding_window": 300, "logits_soft_cap": 6.0}):
                got = kv.decode(fd.to_device(q), tree_mask=mask, **kw).to_host()
                ref = fd.reference_gqa_decode(q, kq, vq, tree_mask=mask, **kw)
                assert rel_err(got, ref) < 2e-2
