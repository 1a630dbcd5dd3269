"""Sharing across threads never gives a wrong answer: one cache decoded by many threads
while others append to caches of their own; appends to one cache from many threads."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import ferrox_driver as fd

from ..helpers.gpu_helpers import DTYPES, TOL, rel_err

pytestmark = pytest.mark.gpu

DECODES = int(os.environ.get("FERROX_THREAD_DECODES", "200"))


def _run(workers):
    """Run the workers on threads at once; a thread's exception fails the test."""
    errors: list[str] = []
    start = threading.Barrier(len(workers))

    def wrap(i, work):
        try:
            start.wait()
            work()
        except Exception as exc:
            errors.append(f"thread {i}: {exc!r}")

    threads = [threading.Thread(target=wrap, args=(i, w)) for i, w in enumerate(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_eight_threads_decoding_one_cache_while_others_append_each_get_their_own_result(rng, dtype):
    dt, tol = DTYPES[dtype], TOL[dtype]
    n_heads, n_kv, hd, seq = 32, 8, 128, 777
    kw = {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": hd}
    shared = fd.KVCache(n_kv, hd, 1024, dtype=dt)
    k = rng.standard_normal((seq, n_kv, hd)).astype(dt)
    v = rng.standard_normal((seq, n_kv, hd)).astype(dt)
    shared.extend(k, v)
    queries = [rng.standard_normal((n_heads, hd)).astype(dt) for _ in range(8)]
    refs = [fd.reference_gqa_decode(q, k, v, **kw) for q in queries]
    own = [fd.KVCache(n_kv, hd, 256, dtype=dt) for _ in range(3)]
    own_rows = [
        (
            rng.standard_normal((200, n_kv, hd)).astype(dt),
            rng.standard_normal((200, n_kv, hd)).astype(dt),
        )
        for _ in own
    ]
    wrong: list[str] = []

    def decoder(i):
        def work():
            for step in range(DECODES):
                got = shared.decode(queries[i], n_heads=n_heads)
                err = rel_err(got, refs[i])
                if not err < tol:
                    wrong.append(f"decoder {i} step {step}: rel err {err:.2e}")

        return work

    def appender(j):
        def work():
            kv, (ks, vs) = own[j], own_rows[j]
            q = queries[j]
            for t in range(len(ks)):
                kv.append(ks[t], vs[t])
                if t % 20 == 19:  # decode its own cache as it grows
                    ref = fd.reference_gqa_decode(q, ks[: t + 1], vs[: t + 1], **kw)
                    err = rel_err(kv.decode(q, n_heads=n_heads), ref)
                    if not err < tol:
                        wrong.append(f"appender {j} at {t + 1}: rel err {err:.2e}")

        return work

    errors = _run([decoder(i) for i in range(8)] + [appender(j) for j in range(3)])
    assert errors == [] and wrong == []
    assert shared.seq_len == seq
    for kv, (ks, vs) in zip(own, own_rows, strict=True):
        got_k, got_v = kv.to_host()
        assert np.array_equal(got_k, ks) and np.array_equal(got_v, vs)
        kv.close()
    shared.close()


def test_appends_from_many_threads_to_one_cache_are_serialized_whole(rng):
    n_kv, hd, per_thread, n_threads = 2, 64, 100, 6
    kv = fd.KVCache(n_kv, hd, per_thread * n_threads)

    def appender(i):
        def work():
            for t in range(per_thread):
                token = float(i * per_thread + t)  # K and V rows carry the token's id
                row = np.full((n_kv, hd), token, np.float32)
                kv.append(row, -row)

        return work

    assert _run([appender(i) for i in range(n_threads)]) == []
    assert kv.seq_len == per_thread * n_threads
    k, v = kv.to_host()
    ids = k[:, 0, 0]
    assert np.array_equal(k, np.broadcast_to(ids[:, None, None], k.shape))  # no torn rows
    assert np.array_equal(v, -k)  # each K row went with its own V row
    assert sorted(ids.tolist()) == list(range(per_thread * n_threads))  # none lost
    for i in range(n_threads):  # each thread's tokens in the order it appended them
        mine = ids[(ids >= i * per_thread) & (ids < (i + 1) * per_thread)]
        assert np.all(np.diff(mine) > 0)
    with pytest.raises(fd.KVCapacityError):
        kv.append(np.zeros((n_kv, hd), np.float32), np.zeros((n_kv, hd), np.float32))
    kv.close()


def test_closing_a_cache_while_threads_use_it_gives_results_or_closed_errors(rng):
    n_heads, n_kv, hd = 8, 2, 64
    kv = fd.KVCache(n_kv, hd, 4096)
    k = rng.standard_normal((100, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((100, n_kv, hd)).astype(np.float32)
    kv.extend(k, v)
    q = rng.standard_normal((n_heads, hd)).astype(np.float32)
    ref = fd.reference_gqa_decode(q, k, v, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd)
    outcomes: list[str] = []

    def user():
        try:
            for _ in range(500):
                err = rel_err(kv.decode(q, n_heads=n_heads), ref)
                outcomes.append("ok" if err < 1e-5 else f"wrong {err:.2e}")
        except fd.ClosedError:
            outcomes.append("closed")

    def closer():
        for _ in range(20):
            kv.decode(q, n_heads=n_heads)
        kv.close()

    assert _run([user, user, user, closer]) == []
    assert outcomes.count("closed") == 3
    assert set(outcomes) <= {"ok", "closed"}
