"""fd.LatentCache without a GPU: its arguments are refused by name before any device work,
and a cache built over a fake device (what it allocates faked; any device use raises
DeviceTouched) refuses bad rows, queries and counts before touching it, leaving its length
as it was, while good calls get through to the device."""

from __future__ import annotations

import math
import weakref
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.cache import appends, latent_cache, staging, state
from ferrox_driver.cache.latent_cache import check_latent_queries, check_latent_rows
from ferrox_driver.driver.device import Device

BF16, F16 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
W = 576


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        ((0,), {}, ValueError, "capacity: expected 1"),
        ((16.0,), {}, TypeError, "capacity: expected an int"),
        ((16,), {"kv_lora_rank": 500}, ValueError, "kv_lora_rank: a multiple of 128"),
        ((16,), {"kv_lora_rank": 0}, ValueError, "kv_lora_rank"),
        ((16,), {"rope_dim": 32}, ValueError, r"rope_dim: kv_lora_rank \+ rope_dim .* 512 \+ 32"),
        ((16,), {"kv_lora_rank": 512, "rope_dim": 128}, ValueError, "up to 576"),
        ((16,), {"rope_dim": -1}, ValueError, "rope_dim"),
        ((16,), {"dtype": np.float32}, TypeError, "dtype: expected bfloat16, float16, float8"),
        ((16,), {"dtype": np.float64}, TypeError, "dtype"),
        ((16,), {"dtype": "int4"}, ValueError, "dtype: LatentCache does not hold 4-bit"),
        ((16,), {"kv_scale": 2.0}, ValueError, "kv_scale: only an fp8 cache"),
        ((16,), {"dtype": E4M3, "kv_scale": 0.0}, ValueError, "kv_scale: expected positive"),
        ((16,), {"dtype": E4M3, "kv_scale": float("nan")}, ValueError, "kv_scale"),
        ((16,), {"dtype": E4M3, "kv_scale": "1"}, TypeError, "kv_scale"),
        ((16,), {"dtype": E4M3, "kv_scale": [1.0, 2.0]}, ValueError, "kv_scale"),
        ((16,), {"stream": 5}, TypeError, "stream: expected a ferrox_driver.Stream"),
        ((16,), {"staging_slots": 0}, ValueError, "staging_slots"),
    ],
)
def test_bad_construction_is_refused_by_name_before_any_device_work(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        fd.LatentCache(*args, **kwargs)


@pytest.mark.parametrize(
    ("shape", "dtype", "fp8", "tokens"),
    [((W,), BF16, "", 1), ((1, W), BF16, "", 1), ((7, W), BF16, "", 7), ((0, W), BF16, "", 0),
     ((W,), np.dtype(np.float32), "e4m3", 1), ((3, W), F16, "e4m3", 3)],
)  # fmt: skip
def test_rows_are_one_row_or_n(shape, dtype, fp8, tokens):
    cache_dtype = E4M3 if fp8 else BF16
    assert check_latent_rows(shape, dtype, W, cache_dtype, fp8) == tokens


@pytest.mark.parametrize(
    ("shape", "dtype", "fp8", "error", "match"),
    [
        ((W + 64,), BF16, "", ValueError, r"rows: expected one latent row \(576,\) or rows"),
        ((2, 1, W), BF16, "", ValueError, "rows: expected one latent row"),
        ((W * 2,), BF16, "", ValueError, "rows"),
        ((W,), F16, "", TypeError, r"rows: expected bfloat16 \(the cache's dtype\), got float16"),
        ((W,), np.dtype(np.float64), "e4m3", TypeError, "rows: expected float32, float16 or"),
        ((W,), E4M3, "e4m3", TypeError, "rows: expected float32"),
    ],
)
def test_bad_rows_are_refused_naming_them(shape, dtype, fp8, error, match):
    with pytest.raises(error, match=match):
        check_latent_rows(shape, dtype, W, E4M3 if fp8 else BF16, fp8)


@pytest.mark.parametrize(
    ("shape", "dtype", "fp8", "error", "match"),
    [
        ((16, 512), BF16, "", ValueError, r"q: expected \(n_heads, 576\)"),
        ((16,), BF16, "", ValueError, "q: expected"),
        ((1, 2, 16, W), BF16, "", ValueError, "q: expected"),
        ((0, W), BF16, "", ValueError, "q: expected"),
        ((129, W), BF16, "", ValueError, "q: up to 128 query heads"),
        ((17, 16, W), BF16, "", ValueError, "q: up to 16 query tokens"),
        ((16, W), F16, "", TypeError, "q: expected bfloat16"),
        ((16, W), np.dtype(np.float32), "e4m3", TypeError, "q: expected float16 or bfloat16"),
    ],
)
def test_bad_queries_are_refused_naming_q(shape, dtype, fp8, error, match):
    with pytest.raises(error, match=match):
        check_latent_queries(shape, dtype, W, E4M3 if fp8 else BF16, fp8)


def test_queries_give_their_count_and_heads():
    assert check_latent_queries((128, W), BF16, W, BF16, "") == (1, 128)
    assert check_latent_queries((2, 16, W), F16, W, E4M3, "e4m3") == (2, 16)


# ---- a cache over a fake device ------------------------------------------------------------
class DeviceTouched(BaseException):
    """A use of the fake device: the call got past its checks."""


ARMED = [True]  # False while the cache is built


class FakeBuffer:
    """What the cache allocates: a pointer, no memory."""

    def __init__(self, shape: Any, dtype: Any = np.float32, *_args: Any, **_kw: Any) -> None:
        self.shape = tuple(shape) if isinstance(shape, tuple) else (shape,)
        self.dtype, self.ptr, self._base = np.dtype(dtype), 0x7F00_0000_0000, None
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self._closed = False

    def _work(self, *_args: Any, **_kw: Any) -> None:
        if ARMED[0]:
            raise DeviceTouched("buffer")

    fill_bytes = copy_from_host = synchronize = to_host = _work

    def view(self, shape: Any, dtype: Any = None, **_kw: Any) -> FakeBuffer:
        return FakeBuffer(shape, self.dtype if dtype is None else dtype)

    def close(self) -> None:
        pass


class FakeStream(FakeBuffer):
    """The cache's own stream (a class: the constructor asks isinstance of it)."""

    def __init__(self, *_args: Any, **_kw: Any) -> None:
        super().__init__((1,), np.uint8)


class FakeDevice(Device):
    """A Device no driver stands behind (compute capability 9.0)."""

    def __init__(self) -> None:
        self.ordinal, self.name, self.compute_capability = 0, "none", (9, 0)
        self._finalizer = weakref.finalize(self, int)

    def activate(self) -> None:
        if ARMED[0]:
            raise DeviceTouched("activate")


def _fake_cache(**kw: Any) -> fd.LatentCache:
    fakes = {
        "resolve": lambda device=None: FakeDevice(),
        "Stream": FakeStream,
        "stream_handle": lambda *a: 0,
        "empty": FakeBuffer,
        "pinned_empty": lambda shape, dtype=np.float32: np.zeros(shape, dtype),
        "Event": lambda *a, **k: FakeBuffer((1,), np.uint8),
        "quantize_kernel": lambda *a, **k: None,
        "append_kernel": lambda *a, **k: None,
        "PackedLaunch": lambda *a, **k: FakeBuffer((1,), np.uint8),
    }
    ARMED[0] = False
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name, fake in fakes.items():
                for module in (latent_cache, state, staging, appends):
                    if hasattr(module, name):
                        mp.setattr(module, name, fake)
            cache = fd.LatentCache(64, **kw)
    finally:
        ARMED[0] = True
    return cache


@pytest.fixture(params=["bf16", "e4m3"])
def cache(request: pytest.FixtureRequest) -> fd.LatentCache:
    return _fake_cache(dtype=BF16 if request.param == "bf16" else E4M3)


def _row(n: int | None = None, dtype: Any = BF16) -> np.ndarray:
    return np.zeros((W,) if n is None else (n, W), dtype)


def test_good_calls_get_through_to_the_device(cache):
    q = np.zeros((16, W), BF16)
    feats = dict(return_lse=True, sinks=np.zeros(16), sliding_window=8, logits_soft_cap=2.0,
                 scale=0.1)  # fmt: skip
    for call in (lambda: cache.append(_row()), lambda: cache.append(_row(5)),
                 lambda: cache.decode(q), lambda: cache.decode(q, **feats)):  # fmt: skip
        with pytest.raises(DeviceTouched):
            call()
    assert cache.seq_len == 0


def test_bad_appends_are_refused_by_name_and_leave_the_length(cache):
    other = F16 if not cache.fp8 else np.dtype(np.float64)
    bad = [
        (lambda: cache.append(_row()[:-64]), ValueError, "rows: expected one latent row"),
        (lambda: cache.append(_row(2)[:, None]), ValueError, "rows: expected one latent row"),
        (lambda: cache.append(_row(dtype=other)), TypeError, "rows: expected"),
        (lambda: cache.append([0.0] * W), TypeError, "rows"),
        (lambda: cache.append(_row(65)), fd.KVCapacityError, "capacity=64, cannot add 65"),
        (lambda: cache.append_async(_row(), stream=None), TypeError, "rows: expected a device"),
    ]
    for call, error, match in bad:
        with pytest.raises(error, match=match):
            call()
        assert cache.seq_len == 0


def test_a_full_cache_refuses_one_row_and_keeps_its_length(cache):
    cache._store._seq_len = 64  # (as if full)
    with pytest.raises(fd.KVCapacityError, match="seq_len=64, capacity=64"):
        cache.append(_row())
    with pytest.raises(fd.KVCapacityError):
        cache.append(_row(1))
    assert cache.seq_len == 64


@pytest.mark.parametrize(
    ("q", "kw", "error", "match"),
    [
        ((16, 512), {}, ValueError, r"q: expected \(n_heads, 576\)"),
        ((2, 16, W), {}, ValueError, "q: 2 query tokens for a cache of 0 tokens"),
        ((16, W), {"out": np.zeros((16, 512), BF16)}, TypeError, "out: only with a device q"),
        ((16, W), {"lse": np.zeros(16, np.float32)}, TypeError, "lse: only with a device q"),
        ((16, W), {"sliding_window": 0}, ValueError, "sliding_window"),
        ((16, W), {"logits_soft_cap": -1.0}, ValueError, "logits_soft_cap"),
        ((16, W), {"sinks": np.zeros(3)}, ValueError, "sinks"),
        ((16, W), {"scale": float("inf")}, ValueError, "scale"),
        ((16, W), {"return_lse": 1}, TypeError, "return_lse"),
    ],
)
def test_bad_decodes_are_refused_by_name_before_any_device_work(cache, q, kw, error, match):
    with pytest.raises(error, match=match):
        cache.decode(np.zeros(q, BF16), **kw)


def test_a_q_of_another_dtype_is_refused_naming_q():
    with pytest.raises(TypeError, match=r"q: expected bfloat16 \(the cache's dtype\), got float16"):
        _fake_cache().decode(np.zeros((16, W), F16))
    with pytest.raises(TypeError, match="q: expected float16 or bfloat16 for an fp8"):
        _fake_cache(dtype=E4M3).decode(np.zeros((16, W), np.float32))


def test_truncate_past_the_length_is_refused_and_changes_nothing(cache):
    cache._store._seq_len = 10
    for bad, error in ((11, ValueError), (-1, ValueError), (2.0, TypeError)):
        with pytest.raises(error, match="n"):
            cache.truncate(bad)
    assert cache.seq_len == 10
    with pytest.raises(DeviceTouched):  # (a good one gets to the device)
        cache.truncate(3)


def test_a_cache_names_its_shape_and_scale():
    cache = _fake_cache(dtype=E4M3, kv_scale=0.25, kv_lora_rank=256, rope_dim=64)
    assert (cache.width, cache.fp8, cache.kv_scale, cache.dtype) == (320, "e4m3", 0.25, E4M3)
    assert repr(cache).startswith("LatentCache(capacity=64, kv_lora_rank=256, rope_dim=64")
    plain = _fake_cache()
    assert (plain.width, plain.fp8, plain.kv_scale, plain.dtype) == (576, "", None, BF16)


def test_the_store_is_one_buffer_read_as_k_and_v():
    store = _fake_cache()._store
    assert store._v is store._k and store._v_ptr == store._k_ptr
    assert (store.n_kv_heads, store.head_dim, store.row_bytes) == (1, W, 2 * W)
    assert store._eager_seq  # (decodes read the length on the device: kept current)
