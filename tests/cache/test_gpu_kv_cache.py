"""The resident KV cache on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

import ferrox_driver as fd

from ..helpers.gpu_helpers import DTYPES, TOL, rel_err

pytestmark = pytest.mark.gpu


def rows(rng, n, n_kv, hd, dtype):
    return rng.standard_normal((n, n_kv, hd)).astype(dtype)


def test_ten_thousand_appends_without_synchronize_keep_every_row_in_order(rng):
    n, n_kv, hd = 10_000, 2, 16
    k = rows(rng, n, n_kv, hd, np.float32)
    v = rows(rng, n, n_kv, hd, np.float32)
    with fd.KVCache(n_kv, hd, n) as kv:
        for i in range(n):
            kv.append(k[i], v[i])
        got_k, got_v = kv.to_host()
    assert np.array_equal(got_k, k) and np.array_equal(got_v, v)


def test_append_reuses_staging_rows_only_after_their_copy_finished(rng):
    # Overwrite the caller's arrays right after each append: the cache must hold what
    # was passed at the time (staged), not what the arrays hold later.
    with fd.KVCache(1, 8, 300, staging_slots=2) as kv:
        tok = np.empty((1, 8), np.float32)
        expect = []
        for i in range(300):
            tok[...] = i
            kv.append(tok, tok)
            expect.append(np.full((1, 8), i, np.float32))
        got_k, _ = kv.to_host()
    assert np.array_equal(got_k, np.stack(expect))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_extend_append_decode_equals_reference_over_all_rows(rng, dtype):
    dt = DTYPES[dtype]
    n_heads, n_kv, hd = 32, 8, 128
    pre_k, pre_v = rows(rng, 700, n_kv, hd, dt), rows(rng, 700, n_kv, hd, dt)
    tok_k, tok_v = rows(rng, 1, n_kv, hd, dt), rows(rng, 1, n_kv, hd, dt)
    q = rng.standard_normal((n_heads, hd)).astype(dt)
    with fd.KVCache(n_kv, hd, 1024, dtype=dt) as kv:
        kv.extend(pre_k, pre_v)
        kv.append(tok_k[0], tok_v[0])
        assert kv.seq_len == 701
        got = kv.decode(q, n_heads=n_heads)
    all_k, all_v = np.concatenate([pre_k, tok_k]), np.concatenate([pre_v, tok_v])
    ref = fd.reference_gqa_decode(q, all_k, all_v, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert rel_err(got, ref) < TOL[dtype]


def test_failed_appends_and_extends_leave_the_cache_intact(rng):
    k, v = rows(rng, 8, 2, 16, np.float32), rows(rng, 8, 2, 16, np.float32)
    with fd.KVCache(2, 16, 8) as kv:
        kv.extend(k[:6], v[:6])
        bad = [
            (lambda: kv.append(k[0].astype(np.float16), v[0]), TypeError),
            (lambda: kv.append(k[0].reshape(-1)[:31], v[0]), ValueError),
            (lambda: kv.append(k[0], [0.0] * 32), TypeError),
            (lambda: kv.extend(k[:3], v[:3]), fd.KVCapacityError),
            (lambda: kv.extend(k[:2], v[:1]), ValueError),
        ]
        for call, exc in bad:
            with pytest.raises(exc):
                call()
            assert kv.seq_len == 6
        kv.extend(k[6:8], v[6:8])
        with pytest.raises(fd.KVCapacityError, match="seq_len=8, capacity=8"):
            kv.append(k[0], v[0])
        got_k, got_v = kv.to_host()
    assert np.array_equal(got_k, k) and np.array_equal(got_v, v)


def test_clear_then_reuse_decodes_only_the_new_sequence(rng):
    with fd.KVCache(2, 32, 64) as kv:
        kv.extend(rows(rng, 50, 2, 32, np.float32), rows(rng, 50, 2, 32, np.float32))
        kv.clear()
        assert kv.seq_len == 0
        k, v = rows(rng, 5, 2, 32, np.float32), rows(rng, 5, 2, 32, np.float32)
        for i in range(5):
            kv.append(k[i], v[i])
        q = rng.standard_normal((4, 32)).astype(np.float32)
        got = kv.decode(q, n_heads=4)
        assert np.array_equal(kv.k.to_host(), k)
    ref = fd.reference_gqa_decode(q, k, v, n_heads=4, n_kv_heads=2, head_dim=32)
    assert rel_err(got, ref) < 1e-5


def test_layer_cache_holds_independent_layers(rng):
    with fd.LayerKVCache(3, 2, 16, 10) as layers:
        assert len(layers) == 3
        for i, layer in enumerate(layers):
            layer.extend(
                np.full((i + 1, 2, 16), i, np.float32), np.zeros((i + 1, 2, 16), np.float32)
            )
        assert [layers[i].seq_len for i in range(3)] == [1, 2, 3]
        assert (layers[2].to_host()[0] == 2).all()
        layers.clear()
        assert [layer.seq_len for layer in layers] == [0, 0, 0]


def test_resident_decode_follows_the_host_cache_through_drift(rng):
    from ferrox_driver.cache import resident

    n_heads, n_kv, hd, cap = 8, 2, 64, 256
    fd.ensure_layer_kv(2, n_kv, hd, cap)
    first = resident.resident_layers()
    fd.ensure_layer_kv(2, n_kv, hd, cap)
    assert resident.resident_layers() is first  # same shape: not rebuilt
    fd.clear_layer_kv()
    host_k = rows(rng, cap, n_kv, hd, np.float32)
    host_v = rows(rng, cap, n_kv, hd, np.float32)
    seq = 0
    try:
        for step in range(200):
            seq += 1
            if step == 50:
                seq += 3  # tokens the resident cache never saw
            if step == 120:  # the host cache was cleared and refilled with new tokens
                host_k[:] = rows(rng, cap, n_kv, hd, np.float32)
                host_v[:] = rows(rng, cap, n_kv, hd, np.float32)
                seq = 2
            q = rng.standard_normal(n_heads * hd).astype(np.float32)
            for layer in range(2):
                got = fd.gqa_decode_resident(layer, q, host_k, host_v, n_heads, n_kv, hd, seq)
                ref = fd.reference_gqa_decode(
                    q, host_k[:seq], host_v[:seq], n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd
                )
                assert rel_err(got, ref) < 1e-5, (step, layer)
            assert resident.resident_layers()[0].seq_len == seq
    finally:
        resident.release_layer_kv()


def test_ensure_layer_kv_rebuilds_on_shape_change():
    from ferrox_driver.cache import resident

    try:
        fd.ensure_layer_kv(2, 2, 16, 8)
        a = resident.resident_layers()
        fd.ensure_layer_kv(2, 2, 16, 9)
        b = resident.resident_layers()
        assert b is not a and b.capacity == 9 and a.layers == []  # old one freed
    finally:
        resident.release_layer_kv()


@pytest.mark.alone
def test_create_close_cycles_do_not_grow_device_memory(device):
    def cycle():
        with fd.KVCache(8, 128, 1024, dtype=np.float16) as kv:
            kv.append(np.ones((8, 128), np.float16), np.ones((8, 128), np.float16))

    cycle()
    device.synchronize()
    free_before, _ = device.mem_info()
    for _ in range(1000):
        cycle()
    device.synchronize()
    free_after, _ = device.mem_info()
    assert free_before - free_after < 8 * 2**20


def test_a_failed_decode_leaves_the_cache_intact(rng):
    k, v = rows(rng, 10, 2, 16, np.float32), rows(rng, 10, 2, 16, np.float32)
    with fd.KVCache(2, 16, 16) as kv:
        kv.extend(k, v)
        for bad, exc in [
            (dict(q=np.zeros(3 * 16, np.float32), n_heads=3), ValueError),  # 3 % 2 != 0
            (dict(q=np.zeros(4 * 16, np.float16), n_heads=4), TypeError),
            (dict(q=np.zeros(5 * 16, np.float32), n_heads=4), ValueError),
        ]:
            with pytest.raises(exc):
                kv.decode(bad["q"], n_heads=bad["n_heads"])
        assert kv.seq_len == 10
        got_k, got_v = kv.to_host()
    assert np.array_equal(got_k, k) and np.array_equal(got_v, v)


@pytest.mark.parametrize(
    "n_heads,capacity,on_chip",
    [(32, 500, True), (32, 4096, True), (64, 4096, False)],
    ids=["cluster-merge", "wide-cluster-merge", "combine-kernel"],
)
def test_a_misaligned_query_after_an_aligned_one_decodes_right(rng, n_heads, capacity, on_chip):
    """A q that is not 16-byte aligned takes a CUDA-core kernel, whose plan can need more
    scratch than the tensor-core one the cache made first (or some where that needed none):
    the cache's scratch grows, and the aligned decodes still work after it."""
    dt = DTYPES["bf16"]
    n_kv, hd, seq = 8, 128, 300
    k, v = rows(rng, seq, n_kv, hd, dt), rows(rng, seq, n_kv, hd, dt)
    q = rng.standard_normal((n_heads, hd)).astype(dt)
    ref = fd.reference_gqa_decode(q, k, v, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd)
    with fd.KVCache(n_kv, hd, capacity, dtype=dt) as kv:
        kv.extend(k, v)
        q_aligned = fd.to_device(q)
        buf = fd.empty((n_heads * hd + 1,), dt)
        buf.copy_from_host(np.concatenate([np.zeros(1, dt), q.reshape(-1)]))
        q_misaligned = buf.view((n_heads * hd,), offset=np.dtype(dt).itemsize)
        assert q_misaligned.ptr % 16
        for i, q_dev in enumerate((q_aligned, q_misaligned, q_aligned)):
            out = fd.empty((n_heads * hd,), dt)
            out.fill_bytes(0xFF, kv.stream)
            fd.gqa_decode_async(q_dev, kv, out, n_heads=n_heads, stream=kv.stream)
            got = out.to_host(kv.stream).reshape(ref.shape)
            assert rel_err(got, ref) < TOL["bf16"], i
            if i == 0:  # merged on chip (8 chunks per KV head in clusters), it made no scratch
                assert (kv._workspaces == {}) == on_chip
