"""One sequence sharded across ranks (ferrox_driver.parallel.sharded): the shards as separate caches
on one device (LocalGroup) decode to what the unsharded decode gives, eager and in a
replayed graph; one NCCL rank where nccl4py is installed."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.errors import KVCapacityError
from ferrox_driver.parallel.sharded import LocalGroup, ShardedDecoder, ShardedKVCache, shard_count

pytestmark = pytest.mark.gpu

BF16 = ml_dtypes.bfloat16
# vs the unsharded ferrox decode, and vs the float64 reference
TOL = {np.float32: (1e-6, 1e-5), np.float16: (1e-2, 1e-2), BF16: (1e-2, 1e-2)}


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), want.astype(np.float64)
    assert np.isfinite(got).all()
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _shards(world, block, n_kv, hd, capacity, dtype, n_heads, **features):
    groups = LocalGroup.ranks(world)
    caches = [ShardedKVCache(n_kv, hd, capacity, group=g, block=block, dtype=dtype)
              for g in groups]  # fmt: skip
    decoders = [ShardedDecoder(c, n_heads=n_heads, **features) for c in caches]
    outs = [fd.empty((n_heads, hd), dtype) for _ in groups]
    return caches, decoders, outs


def _check(outs, q, k, v, n_heads, dtype, stream, **features):
    n_kv, hd = k.shape[1], k.shape[2]
    host = {n: (f.to_host() if n == "sinks" else f) for n, f in features.items()}
    want = fd.gqa_decode(q, k, v, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd, **host)
    ref = fd.reference_gqa_decode(q, k, v, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd,
                                  **host)  # fmt: skip
    tol_ferrox, tol_ref = TOL[dtype]
    for rank, out in enumerate(outs):
        got = out.to_host(stream)
        assert _rel(got, want) < tol_ferrox, (rank, k.shape[0])
        assert _rel(got, ref) < tol_ref, (rank, k.shape[0])


@pytest.mark.parametrize(
    "world,block,dtype,hd",
    [(1, 1, np.float32, 64), (2, 1, np.float32, 128), (3, 4, np.float32, 64),
     (4, 1, BF16, 128), (4, 16, np.float16, 80), (2, 7, BF16, 256)],
)  # fmt: skip
def test_sharded_decode_equals_the_unsharded_one_over_500_appended_tokens(
    rng, world, block, dtype, hd
):
    n_heads, n_kv, total = 8, 2, 600
    k = rng.standard_normal((total, n_kv, hd)).astype(dtype)
    v = rng.standard_normal((total, n_kv, hd)).astype(dtype)
    stream = fd.Stream()
    caches, decoders, outs = _shards(world, block, n_kv, hd, total + 3, dtype, n_heads)
    for c in caches:
        c.extend(k[:100], v[:100])  # host rows: each rank keeps its own
    kd, vd = fd.empty((n_kv * hd,), dtype), fd.empty((n_kv * hd,), dtype)
    qd = fd.empty((n_heads, hd), dtype)
    checks = {100, 101, 117, 350, 599}
    for t in range(100, total):
        kd.copy_from_host(k[t].ravel(), stream)
        vd.copy_from_host(v[t].ravel(), stream)
        for c in caches:
            c.append_async(kd, vd, stream=stream)
        if t in checks:
            q = rng.standard_normal((n_heads, hd)).astype(dtype)
            qd.copy_from_host(q, stream)
            for out in outs:
                out.fill_bytes(0xFF, stream)  # NaN: an unwritten output shows
            ShardedDecoder.decode_all(decoders, qd, outs, stream=stream)
            _check(outs, q, k[: t + 1], v[: t + 1], n_heads, dtype, stream)
    stream.synchronize()
    assert [c.seq_len for c in caches] == [total] * world
    assert [c.local_len for c in caches] == [shard_count(total, r, world, block)
                                             for r in range(world)]  # fmt: skip


def test_a_whole_token_graph_replays_with_soft_cap_scale_and_sinks(rng):
    world, block, n_heads, n_kv, hd, dtype = 3, 2, 16, 4, 128, BF16
    total = 460
    k = rng.standard_normal((total, n_kv, hd)).astype(dtype)
    v = rng.standard_normal((total, n_kv, hd)).astype(dtype)
    sinks = fd.to_device(rng.standard_normal(n_heads).astype(np.float32))
    features = dict(logits_soft_cap=20.0, scale=0.07, sinks=sinks)
    caches, decoders, outs = _shards(world, block, n_kv, hd, total, dtype, n_heads, **features)
    for c in caches:
        c.extend(k[:50], v[:50])
    stream = fd.Stream()
    kd, vd = fd.empty((n_kv * hd,), dtype), fd.empty((n_kv * hd,), dtype)
    qd = fd.empty((n_heads, hd), dtype)

    def token() -> None:
        for c in caches:
            c.append_async(kd, vd, stream=stream)
        ShardedDecoder.decode_all(decoders, qd, outs, stream=stream)

    def feed(t: int) -> np.ndarray:
        q = rng.standard_normal((n_heads, hd)).astype(dtype)
        kd.copy_from_host(k[t].ravel(), stream)
        vd.copy_from_host(v[t].ravel(), stream)
        qd.copy_from_host(q, stream)
        for out in outs:
            out.fill_bytes(0xFF, stream)
        return q

    q = feed(50)
    token()  # eager: the launches are made
    _check(outs, q, k[:51], v[:51], n_heads, dtype, stream, **features)
    with stream.capture() as graph:
        token()
    exe = graph.instantiate()
    for t in range(51, total):
        q = feed(t)
        exe.launch(stream)
        if t in (51, 52, 200, total - 1):
            _check(outs, q, k[: t + 1], v[: t + 1], n_heads, dtype, stream, **features)
    stream.synchronize()
    assert [c.seq_len for c in caches] == [total] * world


def test_no_tokens_one_token_and_a_full_sequence(rng):
    world, n_heads, n_kv, hd, dtype = 4, 4, 1, 64, np.float32
    k = rng.standard_normal((6, n_kv, hd)).astype(dtype)
    v = rng.standard_normal((6, n_kv, hd)).astype(dtype)
    stream = fd.Stream()
    caches, decoders, outs = _shards(world, 1, n_kv, hd, 6, dtype, n_heads)
    q = rng.standard_normal((n_heads, hd)).astype(dtype)
    qd = fd.to_device(q)
    for out in outs:
        out.fill_bytes(0xFF, stream)
    ShardedDecoder.decode_all(decoders, qd, outs, stream=stream)  # every shard empty
    for out in outs:
        np.testing.assert_array_equal(out.to_host(stream), np.zeros((n_heads, hd), dtype))
    for c in caches:
        c.append(k[0], v[0])  # three of four shards still empty
    ShardedDecoder.decode_all(decoders, qd, outs, stream=stream)
    _check(outs, q, k[:1], v[:1], n_heads, dtype, stream)
    for c in caches:
        c.extend(k[1:6], v[1:6])
    with pytest.raises(KVCapacityError):
        caches[0].append(k[0], v[0])  # refused, nothing written
    kd, vd = fd.to_device(k[0]), fd.to_device(v[0])
    for c in caches:
        c.append_async(kd, vd, stream=stream)  # past the capacity on the device
    stream.synchronize()
    for c in caches:
        with pytest.raises(KVCapacityError):
            c.synchronize()
        assert c.seq_len == 6
    ShardedDecoder.decode_all(decoders, qd, outs, stream=stream)
    _check(outs, q, k, v, n_heads, dtype, stream)  # every token kept


def test_bad_arguments_name_themselves_before_any_device_work(rng):
    caches, _, _ = _shards(2, 1, 2, 64, 10, np.float16, 4)
    c = caches[0]
    c.extend(np.zeros((3, 2, 64), np.float16), np.zeros((3, 2, 64), np.float16))
    with pytest.raises(TypeError, match="k_rows"):
        c.extend(np.zeros((1, 2, 64), np.float32), np.zeros((1, 2, 64), np.float16))
    with pytest.raises(ValueError, match="v_rows"):
        c.extend(np.zeros((1, 2, 64), np.float16), np.zeros((1, 2, 32), np.float16))
    with pytest.raises(ValueError, match="k_dev"):
        c.append_async(fd.empty((64,), np.float16), fd.empty((128,), np.float16), stream=None)
    with pytest.raises(TypeError, match="v_dev"):
        c.append_async(fd.empty((128,), np.float16), np.zeros(128, np.float16), stream=None)
    assert (c.seq_len, c.local_len) == (3, 2)  # as it was
    for name, value in (("sliding_window", 4), ("alibi_slopes", fd.zeros((4,), np.float32))):
        with pytest.raises(ValueError, match=name):
            ShardedDecoder(c, n_heads=4, **{name: value})
    with pytest.raises(ValueError, match="n_heads"):
        ShardedDecoder(c, n_heads=3)


def test_one_nccl_rank_decodes_as_the_unsharded_decode(rng):
    pytest.importorskip("nccl.bindings.nccl", reason="the [distributed] extra (nccl4py)")
    from ferrox_driver.parallel.distributed import NcclGroup, new_unique_id

    n_heads, n_kv, hd, dtype = 8, 2, 128, BF16
    k = rng.standard_normal((300, n_kv, hd)).astype(dtype)
    v = rng.standard_normal((300, n_kv, hd)).astype(dtype)
    with NcclGroup(0, 1, new_unique_id(), device=0) as group:
        cache = ShardedKVCache(n_kv, hd, 300, group=group, dtype=dtype)
        dec = ShardedDecoder(cache, n_heads=n_heads)
        cache.extend(k, v)
        q = rng.standard_normal((n_heads, hd)).astype(dtype)
        out = fd.empty((n_heads, hd), dtype)
        out.fill_bytes(0xFF)
        stream = fd.Stream()
        dec.decode_async(fd.to_device(q), out, stream=stream)
        _check([out], q, k, v, n_heads, dtype, stream)
        got = group.all_gather_host(np.arange(3, dtype=np.int32))
        np.testing.assert_array_equal(got, [[0, 1, 2]])
        cache.close()


def test_closing_frees_and_closed_caches_refuse_work(rng):
    caches, decoders, _ = _shards(2, 1, 1, 64, 8, np.float32, 2)
    k = rng.standard_normal((3, 1, 64)).astype(np.float32)
    for c in caches:
        c.extend(k, k)
    for d in decoders:
        with d:
            pass
    for c in caches:
        with c:
            pass
        assert c.closed
        with pytest.raises(fd.ClosedError):
            c.extend(k, k)
