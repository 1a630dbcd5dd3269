"""fd.LatentCache on the GPU (issue 50): rows appended one at a time and in blocks (numpy
and device rows), decoded against fd.reference_mla_decode on fresh random inputs with the
outputs poisoned (NaN bytes) before each kernel: bf16 and fp8 (e4m3 quantized on the
device, its bytes checked against fd.quantize_fp8), 16 and 128 heads, one query and two,
lengths 0, 1 and odd; a graph of append_async + decode_async replayed against the eager
calls; bad input refused leaving the cache as it was; truncation, overflow, lifetime."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd

from ..helpers.gpu_helpers import TOL, poisoned, rel_err

pytestmark = pytest.mark.gpu

DK, DV = 576, 512
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_SCALE = 1.0 / 16  # (rows of ~N(0, 1) stored as x / scale: well inside e4m3's 448)
FP8_TOL = 2e-2  # (as tests/decode/test_gpu_latent.py: fp8 values, P rounded to 16 bits)
LSE_TOL = 2e-2
FP8 = [False, True]
FP8_IDS = ["bf16", "e4m3"]


def _cache(capacity, fp8, **kw):
    if fp8:
        return fd.LatentCache(capacity, dtype=E4M3, kv_scale=FP8_SCALE, **kw)
    return fd.LatentCache(capacity, dtype=BF16, **kw)


def _rows(rng, n):
    return rng.standard_normal((n, DK)).astype(BF16)


def _stored(rows, fp8):
    """What the cache holds for ``rows``: themselves, or their e4m3 bytes at FP8_SCALE."""
    return fd.quantize_fp8(rows, E4M3, FP8_SCALE) if fp8 else rows


def _queries(rng, n_q, n_heads):
    """One token's q (n_heads, DK) for n_q 1, else (n_q, n_heads, DK)."""
    shape = (n_heads, DK) if n_q == 1 else (n_q, n_heads, DK)
    return rng.standard_normal(shape).astype(BF16)


def _reference(q, stored, fp8, **kw):
    return fd.reference_mla_decode(q, stored, kv_scale=FP8_SCALE if fp8 else 1.0,
                                   return_lse=True, **kw)  # fmt: skip


def _decode(cache, q, **kw):
    """cache.decode of a device q into poisoned out and lse (the caller's objects back)."""
    out = poisoned((*q.shape[:-1], DV), q.dtype)
    lse = poisoned(q.shape[:-1], np.float32)
    got, got_lse = cache.decode(fd.to_device(q), out=out, lse=lse, **kw)
    assert got is out and got_lse is lse
    return got.to_host().astype(np.float64), got_lse.to_host()


def _check(got, got_lse, ref, ref_lse, fp8):
    assert np.isfinite(got).all()
    assert rel_err(got, ref) < (FP8_TOL if fp8 else TOL["bf16"])
    np.testing.assert_allclose(got_lse, ref_lse, rtol=LSE_TOL, atol=LSE_TOL)


def _same_bytes(a, b):
    return np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("n_heads", [16, 128])
@pytest.mark.parametrize("n_q", [1, 2])
def test_rows_appended_one_at_a_time_decode_as_the_reference(rng, fp8, n_heads, n_q):
    rows = _rows(rng, 301)
    stored = _stored(rows, fp8)
    lengths = {n_q, n_q + 1, 37, 64, 65, 301}
    with _cache(301, fp8) as cache:
        for t in range(301):
            cache.append(rows[t])
            if t + 1 in lengths:
                q = _queries(rng, n_q, n_heads)
                got, got_lse = _decode(cache, q)
                _check(got, got_lse, *_reference(q, stored[: t + 1], fp8), fp8)
        assert cache.seq_len == 301
        assert _same_bytes(cache.to_host(), stored)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_an_empty_cache_decodes_to_zeros_and_an_lse_of_minus_infinity(rng, fp8):
    with _cache(50, fp8) as cache:
        got, got_lse = _decode(cache, _queries(rng, 1, 16))
        assert not got.any() and np.isneginf(got_lse).all()
        sinks = rng.standard_normal(16).astype(np.float32)
        _, got_lse = _decode(cache, _queries(rng, 1, 16), sinks=sinks)
        np.testing.assert_allclose(got_lse, sinks, rtol=1e-6)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_rows_appended_in_blocks_host_and_device_are_stored_and_decoded(rng, fp8):
    sizes = [1, 17, 1, 200, 0, 301, 480]  # (every other block on the device)
    rows = _rows(rng, sum(sizes))
    stored = _stored(rows, fp8)
    with _cache(1000, fp8) as cache:
        at = 0
        for i, n in enumerate(sizes):
            block = rows[at : at + n]
            if fp8 and i % 4 == 2:  # an fp8 cache takes float32 rows too
                block = block.astype(np.float32)
            if n == 1 and i == 0:
                block = block[0]  # one row (DK,)
            cache.append(fd.to_device(block) if i % 2 else block)
            at += n
            assert cache.seq_len == at
        assert _same_bytes(cache.to_host(), stored)
        q = _queries(rng, 2, 16)
        got, got_lse = _decode(cache, q)
        _check(got, got_lse, *_reference(q, stored, fp8), fp8)
        np.testing.assert_array_equal(
            cache.dequantized(),
            stored.astype(np.float32) * (np.float32(FP8_SCALE) if fp8 else np.float32(1)),
        )


def test_numpy_queries_give_numpy_results(rng):
    rows = _rows(rng, 99)
    with _cache(128, False) as cache:
        cache.append(rows)
        q = _queries(rng, 2, 32)
        got, got_lse = cache.decode(q, return_lse=True)
        assert isinstance(got, np.ndarray) and got.dtype == BF16 and got.shape == (2, 32, DV)
        _check(got.astype(np.float64), got_lse, *_reference(q, rows, False), False)
        one = _queries(rng, 1, 32)
        plain = cache.decode(one)
        assert isinstance(plain, np.ndarray) and plain.shape == (32, DV)
        assert rel_err(plain, _reference(one, rows, False)[0]) < TOL["bf16"]


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize(
    "kw",
    [dict(scale=0.03), dict(sliding_window=40), dict(logits_soft_cap=5.0, scale=0.2),
     dict(sinks="random"), dict(sliding_window=100, logits_soft_cap=3.0, sinks="random")],
    ids=["scale", "window", "cap", "sinks", "all"],
)  # fmt: skip
def test_the_features_reach_the_decode(rng, fp8, kw):
    kw = dict(kw)
    if kw.get("sinks") == "random":
        kw["sinks"] = rng.standard_normal(64).astype(np.float32)
    rows = _rows(rng, 333)
    with _cache(400, fp8) as cache:
        cache.append(rows)
        for n_q in (1, 3):
            q = _queries(rng, n_q, 64)
            got, got_lse = _decode(cache, q, **kw)
            _check(got, got_lse, *_reference(q, _stored(rows, fp8), fp8, **kw), fp8)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("n_q", [1, 2])
def test_a_graph_of_append_and_decode_replays_as_the_eager_calls(rng, fp8, n_q):
    """Captured once (append_async of n_q rows, decode_async of n_q queries, the length on
    the device), replayed step after step: each replay matches the eager append + decode
    of a twin cache and the reference, and the cache's length follows the replays."""
    n_heads, prefill, steps = 64, 77, 9
    rows = _rows(rng, prefill + steps * n_q)
    stored = _stored(rows, fp8)
    row_shape = (DK,) if n_q == 1 else (n_q, DK)
    q_shape = (n_heads, DK) if n_q == 1 else (n_q, n_heads, DK)
    with _cache(200, fp8) as graphed, _cache(200, fp8) as eager:
        graphed.append(rows[:prefill])
        eager.append(rows[:prefill])
        s = graphed.stream
        row_d, q_d = fd.empty(row_shape, BF16), fd.empty(q_shape, BF16)
        out_d = fd.empty((*q_shape[:-1], DV), BF16)
        lse_d = fd.empty(q_shape[:-1], np.float32)
        with s.capture() as graph:
            graphed.append_async(row_d, stream=s)
            graphed.decode_async(q_d, out_d, lse=lse_d, scale=0.05, stream=s)
        step = graph.instantiate()
        for i in range(steps):
            n = prefill + (i + 1) * n_q
            new = rows[n - n_q : n].reshape(row_shape)
            q = _queries(rng, n_q, n_heads)
            row_d.copy_from_host(new, s)
            q_d.copy_from_host(q, s)
            out_d.fill_bytes(0xFF, s)
            lse_d.fill_bytes(0xFF, s)
            step.launch(s)
            s.synchronize()
            got, got_lse = out_d.to_host(s).astype(np.float64), lse_d.to_host(s)
            eager.append(new)
            want, want_lse = _decode(eager, q, scale=0.05)
            ref, ref_lse = _reference(q, stored[:n], fp8, scale=0.05)
            _check(got, got_lse, ref, ref_lse, fp8)
            _check(want, want_lse, ref, ref_lse, fp8)
            assert rel_err(got, want) < 1e-3, i  # (the same kernels over the same rows)
            assert graphed.seq_len == eager.seq_len == n
        assert _same_bytes(graphed.to_host(), eager.to_host())
        assert _same_bytes(graphed.to_host(), stored)
        step.close()
        graph.close()


def test_a_replay_that_finds_the_cache_full_writes_nothing_and_is_reported(rng):
    rows = _rows(rng, 12)
    with _cache(11, False) as cache:
        cache.append(rows[:9])
        s = cache.stream
        row_d = fd.empty((DK,), BF16)
        with s.capture() as graph:
            cache.append_async(row_d, stream=s)
        step = graph.instantiate()
        for t in (9, 10):
            row_d.copy_from_host(rows[t], s)
            step.launch(s)
        cache.synchronize()
        assert cache.seq_len == 11
        row_d.copy_from_host(rows[11], s)
        step.launch(s)
        with pytest.raises(fd.KVCapacityError):
            cache.synchronize()
        assert cache.seq_len == 11
        assert _same_bytes(cache.to_host(), rows[:11])
        step.close()
        graph.close()


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_bad_input_is_refused_and_leaves_the_cache_as_it_was(rng, fp8):
    rows = _rows(rng, 10)
    with _cache(12, fp8) as cache:
        cache.append(rows)
        before = cache.to_host()
        wrong = np.float64 if fp8 else np.float16
        bad = [
            (lambda: cache.append(rows[0, :-64]), ValueError),
            (lambda: cache.append(fd.to_device(rows[:2, :-64])), ValueError),
            (lambda: cache.append(rows[0].astype(wrong)), TypeError),
            (lambda: cache.append(fd.to_device(rows[:2].astype(np.float64))), TypeError),
            (lambda: cache.append(rows[:2][:, None]), ValueError),
            (lambda: cache.append(_rows(rng, 3)), fd.KVCapacityError),
            (lambda: cache.append(fd.to_device(_rows(rng, 3))), fd.KVCapacityError),
            (lambda: cache.decode(_queries(rng, 11, 16)), ValueError),
            (lambda: cache.truncate(11), ValueError),
        ]
        for call, error in bad:
            with pytest.raises(error):
                call()
            assert cache.seq_len == 10
            assert _same_bytes(cache.to_host(), before)
        more = _rows(rng, 2)
        cache.append(more)
        with pytest.raises(fd.KVCapacityError, match="seq_len=12, capacity=12"):
            cache.append(more[0])
        assert _same_bytes(cache.to_host(), _stored(np.concatenate([rows, more]), fp8))


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_truncate_forgets_the_tail_and_the_next_rows_overwrite_it(rng, fp8):
    rows, redo = _rows(rng, 50), _rows(rng, 5)
    with _cache(64, fp8) as cache:
        cache.append(rows)
        cache.truncate(20)
        assert cache.seq_len == 20
        for r in redo:
            cache.append(r)
        kept = np.concatenate([rows[:20], redo])
        assert _same_bytes(cache.to_host(), _stored(kept, fp8))
        q = _queries(rng, 2, 16)
        got, got_lse = _decode(cache, q)
        _check(got, got_lse, *_reference(q, _stored(kept, fp8), fp8), fp8)
        n_dev = fd.to_device(np.array([9], np.int32))
        cache.truncate_async(n_dev, stream=cache.stream)
        assert cache.seq_len == 9
        cache.clear()
        assert cache.seq_len == 0 and cache.to_host().shape == (0, DK)


def test_a_closed_cache_refuses_every_use_naming_itself(rng):
    cache = _cache(8, False)
    cache.append(_rows(rng, 2))
    with cache:
        pass
    assert cache.closed
    for call in (lambda: cache.append(_rows(rng, 1)[0]), lambda: cache.seq_len,
                 lambda: cache.decode(_queries(rng, 1, 16)), lambda: cache.to_host()):  # fmt: skip
        with pytest.raises(fd.ClosedError, match="this LatentCache was closed"):
            call()
    cache.close()  # (again: nothing)


@pytest.mark.alone
def test_a_dropped_cache_gives_its_memory_back(rng, device):
    gc.collect()
    device.synchronize()
    free_before, _ = device.mem_info()
    cache = _cache(2**18, False)  # 288 MiB of rows
    cache.append(_rows(rng, 3))
    assert cache.seq_len == 3
    free_held, _ = device.mem_info()
    assert free_before - free_held >= 2**18 * DK * 2
    del cache
    gc.collect()
    device.synchronize()
    free_after, _ = device.mem_info()
    assert free_before - free_after < 2**25  # (the 288 MiB are back, pools aside)


def test_device_rows_of_torch_append_on_torchs_stream(rng):
    torch = pytest.importorskip("torch")
    rows = _rows(rng, 40)
    with _cache(64, False) as cache:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            t = torch.from_numpy(rows.view(np.int16)).cuda().view(torch.bfloat16)
            cache.append(t[:30])  # (ordered after the copy on the side stream)
            cache.append(t[30])
        cache.append_async(t[31:40], stream=side)
        torch.cuda.synchronize()
        cache.synchronize()
        assert cache.seq_len == 40
        assert _same_bytes(cache.to_host(), rows)
