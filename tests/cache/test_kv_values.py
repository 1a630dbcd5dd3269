"""KVCache(head_dim_v=...): V rows of their own width. Construction, appends and decodes are
checked before any device work, and what needs the length on the device is refused by
name (no GPU: a cache built over a fake device, whose first use raises DeviceTouched)."""

from __future__ import annotations

import math
import weakref
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.cache import appends, kv_cache, own_values, staging, state
from ferrox_driver.driver.device import Device

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
N_KV, D, DV, CAP = 2, 192, 128, 16


# ---- construction (refused before the device is asked for) ---------------------------------
@pytest.mark.parametrize(
    "args,kwargs,exc,pattern",
    [
        ((N_KV, D, CAP), {"dtype": np.float32, "head_dim_v": DV}, ValueError,
         "dtype: a cache with head_dim_v holds float16 or bfloat16"),
        ((N_KV, D, CAP), {"dtype": "float8_e4m3fn", "head_dim_v": DV}, ValueError,
         "dtype: a cache with head_dim_v"),
        ((N_KV, 128, CAP), {"dtype": "int4", "head_dim_v": 256}, ValueError,
         "dtype: a cache with head_dim_v"),
        ((N_KV, D, CAP), {"dtype": F16, "v_dtype": F16, "head_dim_v": DV}, ValueError,
         "v_dtype: not with head_dim_v"),
        ((N_KV, D, CAP), {"dtype": F16, "rotate": True, "head_dim_v": DV}, ValueError,
         "rotate: not with head_dim_v"),
        ((N_KV, D, CAP), {"dtype": F16, "head_dim_v": 100}, ValueError,
         "head_dim_v: a multiple of 128 up to 512"),
        ((N_KV, D, CAP), {"dtype": F16, "head_dim_v": 640}, ValueError, "head_dim_v: a multiple"),
        ((N_KV, 96, CAP), {"dtype": F16, "head_dim_v": DV}, ValueError,
         "head_dim: with head_dim_v, a multiple of 64"),
        ((N_KV, D, CAP), {"dtype": F16, "head_dim_v": 128.0}, TypeError, "head_dim_v: expected"),
        ((N_KV, D, CAP), {"dtype": F16, "head_dim_v": True}, TypeError, "head_dim_v: expected"),
    ],
)  # fmt: skip
def test_bad_construction_names_the_argument(args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fd.KVCache(*args, **kwargs)


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

    _handle_int = 0

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


class FakeArray:
    """A device array as the CUDA array interface describes one (no driver call)."""

    def __init__(self, shape: Any, dtype: Any = F16) -> None:
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": np.dtype(dtype).str, "data": (0, False),
            "version": 3, "strides": None,
        }  # fmt: skip


def _fake_cache(**kw: Any) -> fd.KVCache:
    fakes = {
        "resolve": lambda device=None: FakeDevice(),
        "Stream": FakeStream,
        "stream_handle": lambda *a: 0,
        "empty": FakeBuffer,
        "pinned_empty": lambda shape, dtype=np.float32: np.zeros(shape, dtype),
        "Event": lambda *a, **k: FakeBuffer((1,), np.uint8),
    }
    kw = {"dtype": F16, "head_dim_v": DV, **kw}
    ARMED[0] = False
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name, fake in fakes.items():
                for module in (kv_cache, state, staging, appends, own_values):
                    if hasattr(module, name):
                        mp.setattr(module, name, fake)
            cache = fd.KVCache(N_KV, kw.pop("head_dim", D), CAP, **kw)
    finally:
        ARMED[0] = True
    return cache


@pytest.fixture(params=["f16", "bf16"])
def cache(request: pytest.FixtureRequest) -> fd.KVCache:
    return _fake_cache(dtype=F16 if request.param == "f16" else BF16)


def _k(cache: fd.KVCache, n: int | None = None, dtype: Any = None) -> np.ndarray:
    shape = (N_KV, D) if n is None else (n, N_KV, D)
    return np.zeros(shape, cache.dtype if dtype is None else dtype)


def _v(cache: fd.KVCache, n: int | None = None, width: int = DV) -> np.ndarray:
    return np.zeros((N_KV, width) if n is None else (n, N_KV, width), cache.dtype)


def test_it_holds_values_of_their_own_width(cache):
    assert cache.head_dim == D and cache.head_dim_v == DV
    assert cache.v_buffer.shape == (CAP, N_KV, DV)
    assert cache.k_buffer.shape == (CAP, N_KV, D)
    assert cache.v.shape == (0, N_KV, DV)
    assert "head_dim_v=128" in repr(cache)


def test_equal_widths_take_the_usual_cache():
    cache = _fake_cache(head_dim_v=D)
    assert cache.own_v is None and cache.head_dim_v == D
    assert cache.v_buffer.shape == (CAP, N_KV, D)
    assert "head_dim_v" not in repr(cache)


def test_good_calls_get_through_to_the_device(cache):
    calls = [
        lambda: cache.append(_k(cache), _v(cache)),
        lambda: cache.append(_k(cache).reshape(-1), _v(cache).reshape(-1)),
        lambda: cache.append(_k(cache)[None, :, None], _v(cache)[None, :, None]),
        lambda: cache.extend(_k(cache, 3), _v(cache, 3)),
        lambda: cache.extend(_k(cache, 3).reshape(3, -1), _v(cache, 3).reshape(-1)),
    ]
    for call in calls:
        with pytest.raises(DeviceTouched):
            call()
    assert cache.seq_len == 0


def test_device_rows_get_through_to_the_device():
    cache = _fake_cache()  # (float16: bfloat16 does not cross the CUDA array interface)
    for call in (lambda: cache.append(FakeArray((N_KV, D)), FakeArray((N_KV, DV))),
                 lambda: cache.extend(FakeArray((4, N_KV, D)), FakeArray((4, N_KV, DV))),
                 lambda: cache.decode(FakeArray((8, D)))):  # fmt: skip
        with pytest.raises(DeviceTouched):
            call()
    assert cache.seq_len == 0


def test_bad_device_rows_are_refused_by_name_and_leave_the_length():
    cache = _fake_cache()
    bad = [
        (lambda: cache.append(FakeArray((N_KV, D)), FakeArray((N_KV, D))), ValueError,
         "v_tok: expected one token's V"),
        (lambda: cache.extend(FakeArray((4, N_KV, D)), FakeArray((3, N_KV, DV))), ValueError,
         "v_rows: expected 4 tokens like k_rows, got 3"),
        (lambda: cache.extend(FakeArray((4, N_KV, D)), FakeArray((4, N_KV, DV), np.float32)),
         TypeError, "v_rows: expected dtype"),
        (lambda: cache.append(FakeArray((N_KV, D)), _v(cache)), TypeError,
         "k_tok, v_tok: pass both as numpy arrays or both as device arrays"),
        (lambda: cache.decode(FakeArray((8, D), np.float32)), TypeError, "q: expected dtype"),
    ]  # fmt: skip
    for call, exc, pattern in bad:
        with pytest.raises(exc, match=pattern):
            call()
    assert cache.seq_len == 0


def test_bad_appends_are_refused_by_name_and_leave_the_length(cache):
    other = F16 if cache.dtype == BF16 else BF16
    bad = [
        (lambda: cache.append(_k(cache), _v(cache, width=D)), ValueError,
         r"v_tok: expected one token's V of shape \(256,\), \(2, 128\)"),
        (lambda: cache.append(_k(cache), _k(cache)), ValueError, "v_tok: expected one token's V"),
        (lambda: cache.append(_v(cache), _v(cache)), ValueError, "k_tok: expected one token"),
        (lambda: cache.append(_k(cache, dtype=other), _v(cache)), TypeError, "k_tok: expected"),
        (lambda: cache.append(_k(cache), _v(cache).astype(other)), TypeError, "v_tok: expected"),
        (lambda: cache.append(_k(cache), list(_v(cache))), TypeError, "v_tok: expected a numpy"),
        (lambda: cache.extend(_k(cache, 3), _v(cache, 2)), ValueError,
         "v_rows: expected 3 tokens like k_rows, got 2"),
        (lambda: cache.extend(_k(cache, 3), _v(cache, 3, width=D)), ValueError,
         r"v_rows: expected V tokens of shape \(n, 2, 128\)"),
        (lambda: cache.extend(_k(cache, CAP + 1), _v(cache, CAP + 1)), fd.KVCapacityError, "16"),
    ]  # fmt: skip
    for call, exc, pattern in bad:
        with pytest.raises(exc, match=pattern):
            call()
    assert cache.seq_len == 0


def test_an_empty_cache_decodes_to_zeros_of_the_value_width(cache):
    q = np.ones((8, D), cache.dtype)
    out = cache.decode(q)
    assert out.shape == (8, DV) and out.dtype == cache.dtype and not out.any()
    flat = cache.decode(q.reshape(-1))
    assert flat.shape == (8 * DV,)
    sinks = np.linspace(-1, 1, 8).astype(np.float32)
    out, lse = cache.decode(q, sinks=sinks, return_lse=True)
    assert out.shape == (8, DV) and not out.any()
    np.testing.assert_allclose(lse, sinks)


def test_a_decode_with_tokens_gets_through_to_the_device(cache):
    cache._seq_len = 3  # (as three appends would leave it)
    q = np.zeros((8, D), cache.dtype)
    many = np.zeros((2, 8, D), cache.dtype)
    feats = dict(sliding_window=2, logits_soft_cap=5.0, scale=0.1, return_lse=True)
    for call in (lambda: cache.decode(q), lambda: cache.decode(q[None, :, None]),
                 lambda: cache.decode(many, **feats)):  # fmt: skip
        with pytest.raises(DeviceTouched):
            call()


@pytest.mark.parametrize(
    "q_shape,kw,exc,pattern",
    [
        ((8, D), {"tree_mask": np.ones((1, 1), bool)}, ValueError, "tree_mask: not with"),
        ((8, D), {"alibi_slopes": np.ones(8, np.float32)}, ValueError, "alibi_slopes: not with"),
        ((8, D), {"algorithm": "parity"}, ValueError, "algorithm: head_dim_v runs on the split"),
        ((8, DV), {}, ValueError, r"q: expected \(n_heads\*192,\)"),
        ((8, D), {"n_heads": 4}, ValueError, "n_heads: 4 given, but q's shape"),
        ((3, D), {}, ValueError, "n_heads: 3 query heads are not groups"),
        ((8, D), {"sliding_window": 0}, ValueError, "sliding_window"),
        ((8, D), {"sinks": np.ones(3, np.float32)}, ValueError, "sinks"),
    ],
)  # fmt: skip
def test_bad_decodes_are_refused_by_name(q_shape, kw, exc, pattern):
    cache = _fake_cache()
    cache._seq_len = 3
    with pytest.raises(exc, match=pattern):
        cache.decode(np.zeros(q_shape, F16), **kw)


def test_a_q_of_another_dtype_is_refused(cache):
    other = F16 if cache.dtype == BF16 else np.float32
    with pytest.raises(TypeError, match="q: expected dtype"):
        cache.decode(np.zeros((8, D), other))


def test_what_needs_the_length_on_the_device_is_refused_by_name(cache):
    pattern = "is not supported on a KVCache with head_dim_v"
    with pytest.raises(fd.FerroxError, match=f"prepare {pattern}"):
        cache.prepare(8)
    with pytest.raises(fd.FerroxError, match=f"DecodeGraph {pattern}"):
        fd.DecodeGraph(cache, n_heads=8)
    with pytest.raises(fd.FerroxError, match=f"kv_append_async {pattern}"):
        fd.kv_append_async(cache, FakeArray((N_KV, D)), FakeArray((N_KV, DV)), stream=None)
    with pytest.raises(fd.FerroxError, match=f"gqa_decode_async {pattern}"):
        fd.gqa_decode_async(FakeArray((8, D)), cache, FakeArray((8, DV)), n_heads=8, stream=None)


def test_truncate_checks_its_length(cache):
    cache.truncate(0)
    with pytest.raises(ValueError, match="n"):
        cache.truncate(1)
    assert cache.seq_len == 0


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        ({"dtype": np.float32, "head_dim_v": DV}, ValueError, "dtype: a cache with head_dim_v"),
        ({"dtype": F16, "head_dim_v": 100}, ValueError, "head_dim_v: a multiple of 128"),
        ({"dtype": F16, "head_dim_v": 2.0}, TypeError, "head_dim_v: expected"),
        ({"dtype": F16, "rotate": True, "head_dim_v": DV}, ValueError, "rotate: not with"),
    ],
)
def test_a_layered_cache_checks_head_dim_v_before_the_device(monkeypatch, kwargs, exc, pattern):
    """LayerKVCache(head_dim_v=) refuses by name before it asks for a device or a stream."""
    from ferrox_driver.cache import layers

    def touched(*a: Any, **k: Any) -> None:
        raise AssertionError("the device was asked for")

    monkeypatch.setattr(layers, "resolve", touched)
    with pytest.raises(exc, match=pattern):
        fd.LayerKVCache(2, N_KV, D, CAP, **kwargs)
