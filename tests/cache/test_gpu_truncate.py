"""Rollback (issue 48): ``KVCache.truncate(n)`` on the host, ``fd.kv_truncate_async`` from a
count on the device (captured too), ``ShardedKVCache.truncate``. The tokens below n stay
as they were (bytes compared), the next append writes token n, and a decode afterwards
matches the float64 reference of what the cache should hold."""

from __future__ import annotations

import numpy as np
import pytest

import ferrox_driver as fd

from ..helpers.gpu_helpers import DTYPES, TOL, rel_err

pytestmark = pytest.mark.gpu

H, KV, D = 8, 2, 64
BF16 = DTYPES["bf16"]


def rows(rng, n):
    return tuple(rng.standard_normal((n, KV, D)).astype(BF16) for _ in "kv")


def check_decode(kv, k, v, rng):
    q = rng.standard_normal((H, D)).astype(BF16)
    got = kv.decode(q, n_heads=H)
    assert rel_err(got, fd.reference_gqa_decode(q, k, v, n_heads=H)) < TOL["bf16"]


def same_bytes(kv, k, v):
    got_k, got_v = kv.to_host()
    assert got_k.view(np.uint16).tobytes() == k.view(np.uint16).tobytes()
    assert got_v.view(np.uint16).tobytes() == v.view(np.uint16).tobytes()


def test_truncate_keeps_the_first_n_tokens_and_the_next_append_writes_token_n(rng):
    with fd.KVCache(KV, D, 64, dtype=BF16) as kv:
        k, v = rows(rng, 10)
        kv.extend(k, v)
        kv.truncate(6)
        assert kv.seq_len == 6
        same_bytes(kv, k[:6], v[:6])
        check_decode(kv, k[:6], v[:6], rng)
        k2, v2 = rows(rng, 3)
        kv.extend(k2, v2)
        k_all, v_all = np.concatenate([k[:6], k2]), np.concatenate([v[:6], v2])
        same_bytes(kv, k_all, v_all)
        check_decode(kv, k_all, v_all, rng)
        kv.truncate(9)  # (its own length: nothing changes)
        kv.truncate(0)
        assert kv.seq_len == 0


@pytest.mark.parametrize(("n", "error"), [(11, ValueError), (-1, ValueError), (2.0, TypeError)])
def test_a_bad_truncate_names_n_and_changes_nothing(rng, n, error):
    with fd.KVCache(KV, D, 64, dtype=BF16) as kv:
        k, v = rows(rng, 10)
        kv.extend(k, v)
        with pytest.raises(error, match=r"^n: "):
            kv.truncate(n)
        assert kv.seq_len == 10
        same_bytes(kv, k, v)


def test_a_device_count_rolls_back_keeps_all_past_the_length_and_refuses_negatives(rng):
    with fd.KVCache(KV, D, 64, dtype=BF16) as kv:
        k, v = rows(rng, 10)
        kv.extend(k, v)
        n_dev = fd.to_device(np.array([4], np.int32))
        fd.kv_truncate_async(kv, n_dev, stream=kv.stream)
        assert kv.seq_len == 4
        same_bytes(kv, k[:4], v[:4])
        n_dev.copy_from_host(np.array([100], np.int32))
        fd.kv_truncate_async(kv, n_dev, stream=kv.stream)
        assert kv.seq_len == 4  # (as k[:100] would: every token kept)
        n_dev.copy_from_host(np.array([-3], np.int32))
        fd.kv_truncate_async(kv, n_dev, stream=kv.stream)
        with pytest.raises(fd.FerroxError, match="negative length"):
            kv.synchronize()
        assert kv.seq_len == 4  # (reported once; nothing changed)
        check_decode(kv, k[:4], v[:4], rng)


def test_bad_device_counts_are_refused_before_any_device_work(rng):
    with fd.KVCache(KV, D, 64, dtype=BF16) as kv:
        kv.extend(*rows(rng, 5))
        with pytest.raises(TypeError, match=r"^n_dev: expected dtype int32"):
            fd.kv_truncate_async(kv, fd.to_device(np.array([1], np.int64)), stream=kv.stream)
        with pytest.raises(ValueError, match=r"^n_dev: expected 1 contiguous"):
            fd.kv_truncate_async(kv, fd.to_device(np.array([1, 2], np.int32)), stream=kv.stream)
        with pytest.raises(TypeError, match=r"^n_dev: expected a device array"):
            fd.kv_truncate_async(kv, np.array([1], np.int32), stream=kv.stream)
        assert kv.seq_len == 5


def test_a_captured_append_and_rollback_loop_matches_a_host_driven_cache(rng):
    """Each replay appends 3 draft tokens then rolls back to a count written on the device
    (0-3 of the drafts kept): 200 replays against the same steps on the host."""
    steps, drafts = 200, 3
    with fd.KVCache(KV, D, steps * drafts + 8, dtype=BF16) as kv:
        k0, v0 = rows(rng, 2)
        kv.extend(k0, v0)
        ks, vs = [k0], [v0]
        s = fd.Stream()
        k_d = [fd.empty((KV * D,), BF16) for _ in range(drafts)]
        v_d = [fd.empty((KV * D,), BF16) for _ in range(drafts)]
        n_dev = fd.to_device(np.array([0], np.int32))
        kv.prepare(H)
        with s.capture() as graph:
            for i in range(drafts):
                fd.kv_append_async(kv, k_d[i], v_d[i], stream=s)
            fd.kv_truncate_async(kv, n_dev, stream=s)
        exe = graph.instantiate()
        graph.close()
        length = 2
        for _ in range(steps):
            k, v = rows(rng, drafts)
            for i in range(drafts):
                k_d[i].copy_from_host(k[i].reshape(-1))
                v_d[i].copy_from_host(v[i].reshape(-1))
            keep = int(rng.integers(0, drafts + 1))
            n_dev.copy_from_host(np.array([length + keep], np.int32))
            kv.synchronize()
            exe.launch(s)
            s.synchronize()
            ks.append(k[:keep])
            vs.append(v[:keep])
            length += keep
        assert kv.seq_len == length
        k_all, v_all = np.concatenate(ks), np.concatenate(vs)
        same_bytes(kv, k_all, v_all)
        check_decode(kv, k_all, v_all, rng)
        exe.close()
        s.close()


def test_a_sharded_cache_truncates_on_the_host_and_refuses_a_device_count(rng):
    from ferrox_driver.parallel.sharded import LocalGroup, ShardedKVCache

    ranks = LocalGroup.ranks(2)
    caches = [ShardedKVCache(KV, D, 64, group=g, dtype=BF16) for g in ranks]
    k, v = rows(rng, 9)
    for c in caches:
        c.extend(k, v)
        c.truncate(5)
        assert (c.seq_len, c.local_len) == (5, 3 if c.rank == 0 else 2)  # (round robin)
        with pytest.raises(ValueError, match=r"^n: "):
            c.truncate(6)
        with pytest.raises(TypeError, match=r"^kv: a ShardedKVCache"):
            fd.kv_truncate_async(c, fd.to_device(np.array([1], np.int32)), stream=0)
    for c in caches:
        c.close()
