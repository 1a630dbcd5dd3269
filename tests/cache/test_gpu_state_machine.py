"""The public objects in random orders (hypothesis' state machine): caches created,
appended to, extended, decoded (eagerly, from several threads, by a DecodeGraph and by a
graph captured with kv_append_async + gqa_decode_async), cleared and closed, with their
streams closed under them. Every result is checked against the float64 reference of what
the model says the cache holds; every failure must be the documented exception
(ClosedError, KVCapacityError), and nothing else may be raised."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

import ferrox_driver as fd

from ..helpers.gpu_helpers import DTYPES, TOL, rel_err

pytestmark = pytest.mark.gpu

EXAMPLES = int(os.environ.get("FERROX_MACHINE_EXAMPLES", "1000"))
SHAPES = [(1, 1, 64), (2, 4, 64), (2, 1, 128), (1, 8, 128)]  # (n_kv_heads, group, head_dim)
runs = {"sequences": 0, "steps": 0, "checked": 0, "expected_errors": 0}


class Entry:
    """A cache and what the model knows of it."""

    def __init__(self, dtype, n_kv, group, hd, capacity, own_stream):
        self.dtype, self.n_kv, self.hd, self.capacity = DTYPES[dtype], n_kv, hd, capacity
        self.n_heads = n_kv * group
        self.tol = TOL[dtype]
        self.stream = fd.Stream() if own_stream else None
        self.kv = fd.KVCache(n_kv, hd, capacity, dtype=self.dtype, stream=self.stream)
        self.k: list[np.ndarray] = []
        self.v: list[np.ndarray] = []
        self.closed = False
        self.stream_closed = False
        self.graph: fd.DecodeGraph | None = None
        self.captured = None  # (exec, stream, q_d, k_d, v_d, out_d)

    @property
    def unusable(self):
        return self.closed or self.stream_closed

    def rows(self, rng, n):
        shape = (n, self.n_kv, self.hd)
        return (
            rng.standard_normal(shape).astype(self.dtype),
            rng.standard_normal(shape).astype(self.dtype),
        )

    def query(self, rng):
        return rng.standard_normal((self.n_heads, self.hd)).astype(self.dtype)

    def reference(self, q):
        if not self.k:
            return np.zeros(q.shape)
        return fd.reference_gqa_decode(
            q, np.stack(self.k), np.stack(self.v),
            n_heads=self.n_heads, n_kv_heads=self.n_kv, head_dim=self.hd,
        )  # fmt: skip

    def check(self, got, q):
        ref = self.reference(q)
        err = rel_err(got, ref) if self.k else float(np.abs(np.asarray(got, np.float64)).max())
        assert err < self.tol, f"rel err {err:.2e} at seq_len {len(self.k)}"
        runs["checked"] += 1


class Expect:
    """Run an operation the model predicts to raise ``error`` (None: to succeed)."""

    def __init__(self, error):
        self.error = error

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if self.error is None:
            return False  # any exception is a failure
        if kind is None:
            raise AssertionError(f"expected {self.error.__name__}, nothing was raised")
        if not issubclass(kind, self.error):
            return False
        runs["expected_errors"] += 1
        return True


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.entries: list[Entry] = []
        runs["sequences"] += 1

    def _entry(self, i):
        runs["steps"] += 1
        return self.entries[i % len(self.entries)]

    def _expect(self, e, *, full=False):
        """What the model predicts: ClosedError for a closed cache (or one whose stream
        was closed), KVCapacityError where the tokens would not fit, else success."""
        if e.unusable:
            return Expect(fd.ClosedError)
        return Expect(fd.KVCapacityError if full else None)

    @precondition(lambda self: len(self.entries) < 3)
    @rule(
        dtype=st.sampled_from(["f32", "f16", "bf16"]),
        shape=st.sampled_from(SHAPES),
        capacity=st.integers(1, 40),
        own_stream=st.booleans(),
    )
    def create(self, dtype, shape, capacity, own_stream):
        n_kv, group, hd = shape
        self.entries.append(Entry(dtype, n_kv, group, hd, capacity, own_stream))

    @precondition(lambda self: self.entries)
    @rule(i=st.integers(0, 2), seed=st.integers(0, 2**32 - 1))
    def append(self, i, seed):
        e = self._entry(i)
        k, v = e.rows(np.random.default_rng(seed), 1)
        with self._expect(e, full=len(e.k) >= e.capacity):
            e.kv.append(k[0], v[0])
            e.k.append(k[0])
            e.v.append(v[0])

    @precondition(lambda self: self.entries)
    @rule(i=st.integers(0, 2), n=st.integers(0, 12), seed=st.integers(0, 2**32 - 1))
    def extend(self, i, n, seed):
        e = self._entry(i)
        k, v = e.rows(np.random.default_rng(seed), n)
        with self._expect(e, full=len(e.k) + n > e.capacity):
            e.kv.extend(k, v)
            e.k.extend(k)
            e.v.extend(v)

    @precondition(lambda self: self.entries)
    @rule(i=st.integers(0, 2), seed=st.integers(0, 2**32 - 1))
    def decode(self, i, seed):
        e = self._entry(i)
        q = e.query(np.random.default_rng(seed))
        with self._expect(e):
            e.check(e.kv.decode(q, n_heads=e.n_heads), q)

    @precondition(lambda self: self.entries)
    @rule(i=st.integers(0, 2), seed=st.integers(0, 2**32 - 1))
    def decode_from_threads(self, i, seed):
        e = self._entry(i)
        rng = np.random.default_rng(seed)
        queries = [e.query(rng) for _ in range(4)]
        results: list[object] = [None] * 4

        def work(j):
            try:
                results[j] = e.kv.decode(queries[j], n_heads=e.n_heads)
            except Exception as exc:  # checked below, on the test's thread
                results[j] = exc

        threads = [threading.Thread(target=work, args=(j,)) for j in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for q, got in zip(queries, results, strict=True):
            with self._expect(e):
                if isinstance(got, Exception):
                    raise got
                e.check(got, q)

    @precondition(lambda self: self.entries)
    @rule(i=st.integers(0, 2), seed=st.integers(0, 2**32 - 1))
    def graph_step(self, i, seed):
        e = self._entry(i)
        rng = np.random.default_rng(seed)
        k, v = e.rows(rng, 1)
        q = e.query(rng)
        with self._expect(e, full=len(e.k) >= e.capacity):
            if e.graph is None:
                e.graph = fd.DecodeGraph(e.kv, n_heads=e.n_heads)
            got = e.graph(q, k[0], v[0])
            e.k.append(k[0])
            e.v.append(v[0])
            e.check(got, q)

    @precondition(lambda self: self.entries)
    @rule(i=st.integers(0, 2), seed=st.integers(0, 2**32 - 1))
    def captured_step(self, i, seed):
        """A token through a graph the user captured from the async ops."""
        e = self._entry(i)
        rng = np.random.default_rng(seed)
        k, v = e.rows(rng, 1)
        q = e.query(rng)
        full = len(e.k) >= e.capacity
        with self._expect(e):
            if e.captured is None:
                size, row = e.n_heads * e.hd, e.n_kv * e.hd
                s = fd.Stream()
                ops = [fd.empty((n,), e.dtype) for n in (size, row, row, size)]
                e.kv.prepare(e.n_heads)
                with s.capture() as graph:
                    fd.kv_append_async(e.kv, ops[1], ops[2], stream=s)
                    fd.gqa_decode_async(ops[0], e.kv, ops[3], n_heads=e.n_heads, stream=s)
                e.captured = (graph.instantiate(), s, *ops)
                graph.close()
            exec_, s, q_d, k_d, v_d, out_d = e.captured
            for arr, host in ((q_d, q), (k_d, k[0]), (v_d, v[0])):
                arr.copy_from_host(host.reshape(-1))
            e.kv.synchronize()  # the cache's own work first: the graph runs on s
            exec_.launch(s)
            s.synchronize()
            if full:  # the device refused the append and flags it; the decode saw the rest
                with pytest.raises(fd.KVCapacityError):
                    e.kv.synchronize()
            else:
                e.k.append(k[0])
                e.v.append(v[0])
            e.check(out_d.to_host().reshape(q.shape), q)

    @precondition(lambda self: self.entries)
    @rule(i=st.integers(0, 2))
    def clear(self, i):
        e = self._entry(i)
        with self._expect(e):
            e.kv.clear()
            e.k, e.v = [], []

    @precondition(lambda self: self.entries)
    @rule(i=st.integers(0, 2))
    def close(self, i):
        e = self._entry(i)
        e.kv.close()  # always allowed, and again
        e.closed = True

    @precondition(lambda self: self.entries)
    @rule(i=st.integers(0, 2))
    def close_stream(self, i):
        e = self._entry(i)
        if e.stream is not None:
            e.stream.close()
            e.stream_closed = True

    @precondition(lambda self: self.entries)
    @rule(i=st.integers(0, 2))
    def seq_len(self, i):
        e = self._entry(i)
        with self._expect(e):
            assert e.kv.seq_len == len(e.k)

    def teardown(self):
        for e in self.entries:
            if e.graph is not None:
                e.graph.close()
            if e.captured is not None:
                e.captured[0].close()
                e.captured[1].close()
            e.kv.close()
            if e.stream is not None:
                e.stream.close()


def test_random_sequences_of_public_operations_never_crash_or_give_a_wrong_answer():
    before = dict(runs)
    run_state_machine_as_test(
        CacheMachine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=30,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    done = {key: runs[key] - before[key] for key in runs}
    print(f"\nstate machine: {done}")
    assert done["sequences"] >= EXAMPLES and done["checked"] > EXAMPLES
