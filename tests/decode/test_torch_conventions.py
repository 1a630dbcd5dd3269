"""A PyTorch user's conventions, without a GPU: ``device=`` as an int, a torch.device or
"cuda:N"; ``stream=None`` with PyTorch tensors meaning PyTorch's current stream; the
attention shape read from the arrays' shapes (n_heads, n_kv_heads, head_dim optional);
PyTorch SDPA's shapes; the float64 reference's own argument names. Checks run before
any device work, so fakes stand in for CUDA tensors (never dereferenced): where a call
gets past its checks, the first device step is replaced by one that records what it was
given and stops."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.decode import eager as decode
from ferrox_driver.decode import merge, records
from ferrox_driver.decode import pair as decode_pair
from ferrox_driver.decode.checks import check_decode_args, q_heads, read_dims
from ferrox_driver.driver import dlpack, stream
from ferrox_driver.driver.device import ordinal_of
from ferrox_driver.driver.interop import is_torch

torch = pytest.importorskip("torch")

H, KV, D, S = 8, 2, 16, 5


class Reached(Exception):
    """The call passed its checks and reached the device step a test replaced."""


class FakeTorchCuda:
    """What ferrox reads of a PyTorch CUDA tensor (its type's module is "torch"), at an
    address nothing dereferences."""

    __module__ = "torch"

    def __init__(self, shape, dtype=None, ordinal=0, ptr=1 << 20) -> None:
        self.shape = torch.Size(shape)
        self.dtype = torch.float16 if dtype is None else dtype
        self._ordinal, self._ptr = ordinal, ptr

    def data_ptr(self) -> int:
        return self._ptr

    def get_device(self) -> int:
        return self._ordinal

    def is_contiguous(self) -> bool:
        return True


class FakeDLPackCuda:
    """A CUDA tensor seen through DLPack only (not PyTorch)."""

    def __init__(self, shape, dtype=np.float16, ordinal=0) -> None:
        self.shape, self.dtype, self.ordinal = shape, np.dtype(dtype), ordinal

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        return dlpack.export(1 << 20, self.shape, self.dtype, dlpack.CUDA, self.ordinal, None,
                             versioned=True)  # fmt: skip

    def __dlpack_device__(self):
        return dlpack.CUDA, self.ordinal


def reference(q, k, v, n_heads, n_kv_heads, head_dim):
    """Plain float64 softmax attention, written here (not the library's reference)."""
    q = np.asarray(q, np.float64).reshape(n_heads, head_dim)
    k = np.asarray(k, np.float64).reshape(-1, n_kv_heads, head_dim)
    v = np.asarray(v, np.float64).reshape(-1, n_kv_heads, head_dim)
    group = n_heads // n_kv_heads
    out = np.empty((n_heads, head_dim))
    for h in range(n_heads):
        s = k[:, h // group] @ q[h] / np.sqrt(head_dim)
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v[:, h // group]
    return out


@pytest.fixture
def torch_streams(monkeypatch):
    """PyTorch's current stream on device d reads as 0x7000 + d."""
    monkeypatch.setattr(stream, "_torch_current", lambda ordinal: 0x7000 + ordinal)
    monkeypatch.setattr(decode, "_calls", records.Kept(decode.MAX_CALLS))
    monkeypatch.setattr(decode, "_families", records.Kept(decode.MAX_CALLS))


# -- device= -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device,ordinal",
    [(0, 0), (3, 3), ("cuda", 0), ("cuda:2", 2), ("torch:cuda:1", 1), ("torch:cuda", 0)],
)
def test_a_device_is_an_int_a_torch_device_or_a_cuda_string(device, ordinal):
    if isinstance(device, str) and device.startswith("torch:"):
        device = torch.device(device[len("torch:") :])
    assert ordinal_of(device) == ordinal


def test_a_torch_device_without_an_index_is_torchs_current_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert ordinal_of(torch.device("cuda")) == 3
    assert ordinal_of("cuda") == 3
    assert ordinal_of(torch.device("cuda", 1)) == 1  # an index is the index


@pytest.mark.parametrize(
    "device,exc,message",
    [
        (-1, ValueError, "device: expected an ordinal >= 0, got -1"),
        ("cpu", ValueError, r"device: expected a CUDA device \('cuda' or 'cuda:N'\), got 'cpu'"),
        ("cuda:x", ValueError, "device: expected a CUDA device"),
        ("cuda:", ValueError, "device: expected a CUDA device"),
        ("torch:cpu", ValueError, r"got device\(type='cpu'\)"),
        (True, TypeError, "device: expected a ferrox_driver.Device, an int ordinal, a torch"),
        (1.0, TypeError, "got float"),
    ],
)
def test_a_device_that_is_no_cuda_device_is_refused_naming_device(device, exc, message):
    if isinstance(device, str) and device.startswith("torch:"):
        device = torch.device(device[len("torch:") :])
    with pytest.raises(exc, match=message):
        ordinal_of(device)
    # every constructor with device= refuses it before any device work
    for make in (
        lambda: fd.KVCache(2, 16, 8, device=device),
        lambda: fd.LayerKVCache(2, 2, 16, 8, device=device),
        lambda: fd.Stream(device),
        lambda: fd.Event(device=device),
        lambda: fd.empty((4,), np.float32, device=device),
    ):
        with pytest.raises(exc, match=message):
            make()


@pytest.mark.parametrize("device", [0, "cuda", "cuda:0", "torch:cuda:0", "torch:cuda"])
def test_gqa_decode_on_device_arrays_takes_their_device_in_any_form(
    device, monkeypatch, torch_streams
):
    if isinstance(device, str) and device.startswith("torch:"):
        device = torch.device(device[len("torch:") :])

    def stop(ordinal):
        raise Reached(ordinal)

    monkeypatch.setattr(decode, "device_for", stop)
    q, k = FakeTorchCuda((H, D)), FakeTorchCuda((S, KV, D))
    with pytest.raises(Reached):
        fd.gqa_decode(q, k, k, device=device)


@pytest.mark.parametrize("device", [1, "cuda:1", "torch:cuda:1"])
def test_gqa_decode_refuses_a_device_other_than_its_arrays(device, torch_streams):
    if isinstance(device, str) and device.startswith("torch:"):
        device = torch.device(device[len("torch:") :])
    q, k = FakeTorchCuda((H, D)), FakeTorchCuda((S, KV, D))
    with pytest.raises(ValueError, match=r"device: .*1.* given, but q is on device 0"):
        fd.gqa_decode(q, k, k, device=device)
    with pytest.raises(ValueError, match=r"device: .*1.* given, but q is on device 0"):
        fd.gqa_decode(q, k, k, device=device, scale=0.5)  # (the features' path too)


def test_numpy_gqa_decode_resolves_a_torch_device(monkeypatch, rng):
    seen = []

    def stop(device):
        seen.append(ordinal_of(device))
        raise Reached

    monkeypatch.setattr(decode, "resolve", stop)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((H, D), (S, KV, D), (S, KV, D)))
    with pytest.raises(Reached):
        fd.gqa_decode(q, k, v, device=torch.device("cuda:0"))
    with pytest.raises(Reached):
        fd.gqa_decode(q, k, v, device="cuda:0", scale=0.25)
    assert seen == [0, 0]


# -- stream=None with PyTorch tensors ------------------------------------------------------


def test_torch_tensors_are_recognised_without_importing_anything():
    assert is_torch(torch.zeros(2))
    assert is_torch(torch.nn.Parameter(torch.zeros(2)))
    assert is_torch(FakeTorchCuda((2,)))
    assert not is_torch(np.zeros(2))
    assert not is_torch(FakeDLPackCuda((2,)))


def test_call_stream_is_torchs_current_one_only_for_torch_tensors_and_no_stream(torch_streams):
    t = FakeTorchCuda((4,), ordinal=2)
    assert stream.call_stream(None, t) == 0x7002
    assert stream.call_stream(None, t, 0) == 0x7000
    given = object()
    assert stream.call_stream(given, t) is given
    assert stream.call_stream(None, FakeDLPackCuda((4,))) is None
    assert stream.call_stream(None, torch.zeros(2)) is None  # a CPU tensor: left to the checks


def test_torchs_current_stream_is_read_through_its_public_api_where_no_raw_reader(monkeypatch):
    asked = []

    class CurrentStream:
        cuda_stream = 0xBEEF

    def current_stream(ordinal):
        asked.append(ordinal)
        return CurrentStream()

    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream", raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(stream, "_torch_current", None)
    assert stream.torch_stream(3) == 0xBEEF and asked == [3]


def _decode_stream(monkeypatch, *arrays, **kw):
    """The stream handle gqa_decode's device path keys and packs its call for."""
    seen = []

    def prepare(key, refs, out, n_heads, n_kv_heads, head_dim, s, sid, algorithm, device):
        seen.append(sid)
        raise Reached

    monkeypatch.setattr(decode, "_prepare_call", prepare)
    with pytest.raises(Reached):
        fd.gqa_decode(*arrays, **kw)
    return seen[0]


def test_gqa_decode_on_torch_tensors_runs_on_torchs_current_stream(torch_streams, monkeypatch):
    q, k = FakeTorchCuda((H, D), ordinal=1), FakeTorchCuda((S, KV, D), ordinal=1)
    assert _decode_stream(monkeypatch, q, k, k) == 0x7001
    assert _decode_stream(monkeypatch, q, k, k, stream=55) == 55  # a stream given wins
    q, k = FakeDLPackCuda((H, D)), FakeDLPackCuda((S, KV, D))
    assert _decode_stream(monkeypatch, q, k, k) == 0  # not torch: the legacy default stream


def test_gqa_decode_with_features_on_torch_tensors_runs_on_torchs_current_stream(
    torch_streams, monkeypatch
):
    keys = []
    real = decode.stream_key

    def key(s):
        keys.append(s)
        return real(s)

    def stop(ordinal):
        raise Reached

    monkeypatch.setattr(decode, "stream_key", key)
    monkeypatch.setattr(decode, "device_for", stop)
    q, k = FakeTorchCuda((H, D)), FakeTorchCuda((KV, S, D))
    with pytest.raises(Reached):
        fd.gqa_decode(q, k, k, kv_layout="HND")
    assert keys and set(keys) == {0x7000}  # (a first call asks the fast and the full path)


def test_gqa_decode_async_on_a_pair_of_torch_tensors_runs_on_torchs_current_stream(
    torch_streams, monkeypatch
):
    seen = []

    def checked(q_dev, pair, out_dev, n_heads, s, sid, *rest):
        seen.append((sid, n_heads))
        raise Reached

    monkeypatch.setattr(decode_pair, "_pair_checked", checked)
    monkeypatch.setattr(decode_pair, "_pair_calls", records.Kept(decode_pair.MAX_PAIR_CALLS))
    q, out = FakeTorchCuda((1, H, 1, D)), FakeTorchCuda((1, H, 1, D))
    kc, seq = FakeTorchCuda((1, KV, 64, D)), FakeTorchCuda((1,), torch.int32)
    with pytest.raises(Reached):
        fd.gqa_decode_async(q, (kc, kc), out, stream=None, seq_len=seq, kv_layout="HND")
    with pytest.raises(Reached):
        fd.gqa_decode_async(q, (kc, kc), out, stream=9, seq_len=seq, kv_layout="HND")
    assert seen == [(0x7000, None), (9, None)]


def test_merge_states_on_torch_tensors_runs_on_torchs_current_stream(torch_streams, monkeypatch):
    launched = []

    class Kernel:
        def launch(self, grid, block, args, *, stream=None):
            launched.append(stream)

    monkeypatch.setattr(merge, "device_for", lambda ordinal: None)
    monkeypatch.setattr(merge, "get_kernel", lambda *a: Kernel())
    outs, lses = FakeTorchCuda((3, H, D)), FakeTorchCuda((3, H), torch.float32)
    out, out_lse = FakeTorchCuda((H, D)), FakeTorchCuda((H,), torch.float32)
    fd.merge_states(outs, lses, out=out, out_lse=out_lse)
    fd.merge_states(outs, lses, out=out, out_lse=out_lse, stream=4)
    assert launched == [0x7000, 4]


# -- n_heads, n_kv_heads, head_dim read from the shapes -----------------------------------


@pytest.mark.parametrize(
    "q_shape,k_shape,layout",
    [
        ((H, D), (S, KV, D), "NHD"),
        ((H * D,), (S, KV, D), "NHD"),
        ((1, H, 1, D), (S, KV, D), "NHD"),
        ((H, D), (KV, S, D), "HND"),
        ((1, H, 1, D), (1, KV, S, D), "HND"),
    ],
)
def test_the_attention_shape_is_read_from_the_arrays(q_shape, k_shape, layout):
    assert read_dims(q_shape, k_shape, None, None, None, layout=layout) == (H, KV, D)
    assert read_dims(q_shape, k_shape, H, KV, D, layout=layout) == (H, KV, D)  # given: agree


def test_a_flat_cache_needs_what_its_shape_does_not_say():
    assert read_dims((H, D), (S * KV * D,), None, KV, None) == (H, KV, D)  # head_dim from q
    assert read_dims((H * D,), (S * KV * D,), None, KV, D) == (H, KV, D)
    with pytest.raises(TypeError, match=r"n_kv_heads: required: a flat k_cache \(shape \(160,\)"):
        read_dims((H, D), (S * KV * D,), None, None, None)
    with pytest.raises(TypeError, match="head_dim: required: neither k_cache of shape"):
        read_dims((H * D,), (S * KV * D,), None, KV, None)


@pytest.mark.parametrize(
    "q_shape,k_shape,given,message",
    [
        ((H, D), (S, KV, D), dict(n_heads=4),
         r"n_heads: 4 given, but q of shape \(8, 16\) holds 8 heads of head_dim 16"),
        ((1, H, 1, D), (S, KV, D), dict(n_heads=16), "n_heads: 16 given, but q of shape"),
        ((H, D), (S, KV, D), dict(n_kv_heads=4),
         r"n_kv_heads: 4 given, but k_cache of shape \(5, 2, 16\) holds 2 KV heads"),
        ((H, D), (S, KV, D), dict(head_dim=32),
         r"head_dim: 32 given, but k_cache of shape \(5, 2, 16\) holds 16 elements per head"),
        ((H, 2 * D), (S, KV, D), {}, r"q: expected shape \(n_heads\*16,\)"),
        ((H, D), (S, 3, D), {}, "n_heads: must be a multiple of n_kv_heads"),
        ((H, D), (S, KV, 600), {}, r"head_dim: expected 1..512, got 600 \(read from k_cache"),
        ((H, D), (1, KV, S, D), {},
         "k_cache: expected .* a 4-D cache .* is PyTorch SDPA's head-major layout: pass "
         "kv_layout='HND'"),
    ],
)  # fmt: skip
def test_a_given_dim_the_shapes_contradict_is_refused_naming_it(q_shape, k_shape, given, message):
    with pytest.raises(ValueError, match=message):
        read_dims(q_shape, k_shape, given.get("n_heads"), given.get("n_kv_heads"),
                  given.get("head_dim"))  # fmt: skip


def test_q_heads_reads_any_of_qs_shapes_and_checks_a_given_count():
    assert [q_heads(s, D) for s in ((H, D), (H * D,), (1, H, 1, D))] == [H, H, H]
    with pytest.raises(ValueError, match=r"n_heads: 4 given, but q of shape \(1, 8, 1, 16\)"):
        q_heads((1, H, 1, D), D, 4)
    with pytest.raises(ValueError, match=r"q: expected shape \(n_heads\*16,\)"):
        q_heads((2, H, 1, D), D)  # a batch of two is not one query
    with pytest.raises(ValueError, match=r"q_dev: expected shape \(n_heads\*16,\)"):
        q_heads((H * D + 1,), D, None, "q_dev")


def test_gqa_decode_async_reads_n_heads_from_q_devs_size():
    q = FakeTorchCuda((1, H, 1, D))
    assert decode_pair.q_heads_of(None, q, D) == H
    assert decode_pair.q_heads_of(6, q, D) == 6  # given: checked with the operands later
    with pytest.raises(ValueError, match=r"q_dev: shape .* holds no whole number of heads"):
        decode_pair.q_heads_of(None, FakeTorchCuda((H * D + 1,)), D)
    with pytest.raises(TypeError, match="q_dev: expected a device array"):
        decode_pair.q_heads_of(None, np.zeros((H, D), np.float16), D)


def test_gqa_decode_reads_the_dims_and_returns_qs_shape_sdpas_included():
    empty = np.zeros((0, KV, D), np.float16)
    for shape in ((H, D), (1, H, 1, D), (H * D,)):
        out = fd.gqa_decode(np.ones(shape, np.float16), empty, empty)  # seq_len 0: no GPU
        assert out.shape == shape and out.dtype == np.float16 and not out.any()
    spec = check_decode_args(np.ones((1, H, 1, D), np.float32), np.ones((S, KV, D), np.float32),
                             np.ones((S, KV, D), np.float32), None, None, None)  # fmt: skip
    assert (spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.seq_len) == (H, KV, D, S)
    assert spec.q_shape == (1, H, 1, D)


def test_the_reference_reads_the_dims_from_the_shapes(rng):
    q = rng.standard_normal((H, D))
    k, v = rng.standard_normal((2, S, KV, D))
    want = reference(q, k, v, H, KV, D)
    np.testing.assert_allclose(fd.reference_gqa_decode(q, k, v), want, rtol=1e-12, atol=1e-12)
    got = fd.reference_gqa_decode(q.reshape(1, H, 1, D), k, v)  # SDPA's q: out like q
    assert got.shape == (1, H, 1, D)
    np.testing.assert_allclose(got.reshape(H, D), want, rtol=1e-12, atol=1e-12)
    got = fd.reference_gqa_decode(q.reshape(-1), k.reshape(-1), v.reshape(-1), n_kv_heads=KV,
                                  head_dim=D)  # fmt: skip
    np.testing.assert_allclose(got.reshape(H, D), want, rtol=1e-12, atol=1e-12)


def test_the_reference_takes_sdpas_head_major_cache(rng):
    q = rng.standard_normal((1, H, 1, D))
    k, v = rng.standard_normal((2, S, KV, D))
    want = reference(q, k, v, H, KV, D)
    k_hnd, v_hnd = (np.ascontiguousarray(a.transpose(1, 0, 2)[None]) for a in (k, v))
    got = fd.reference_gqa_decode(q, k_hnd, v_hnd, kv_layout="HND")
    np.testing.assert_allclose(got.reshape(H, D), want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="pass kv_layout='HND'"):
        fd.reference_gqa_decode(q, k_hnd, v_hnd)


# -- the reference's messages --------------------------------------------------------------


@pytest.mark.parametrize(
    "over,exc,message",
    [
        (dict(k=np.zeros((S, KV + 1, D))), ValueError, "n_kv_heads: 2 given, but k of shape"),
        (dict(v=np.zeros((S + 1, KV, D))), ValueError, "v: expected k's shape"),
        (dict(k=np.zeros((S, KV, D), np.int32)), TypeError,
         r"k: expected a floating-point array \(float64, float32, float16, bfloat16, float8\), "
         "got int32"),
        (dict(v=[0.0] * (S * KV * D)), TypeError, "v: expected a numpy array"),
    ],
)  # fmt: skip
def test_the_reference_names_its_own_arguments(over, exc, message):
    kw = dict(q=np.zeros((H, D)), k=np.zeros((S, KV, D)), v=np.zeros((S, KV, D)), n_heads=H,
              n_kv_heads=KV, head_dim=D)  # fmt: skip
    kw.update(over)
    with pytest.raises(exc, match=message) as info:
        fd.reference_gqa_decode(**kw)
    assert "k_cache" not in str(info.value) and "v_cache" not in str(info.value)


@pytest.mark.parametrize(
    "dtype", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.bfloat16]
)
def test_the_reference_reads_float8_and_bfloat16_by_value(dtype, rng):
    q = rng.standard_normal((H, D)).astype(dtype)
    k, v = (rng.standard_normal((S, KV, D)).astype(dtype) for _ in range(2))
    want = reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), H, KV, D)
    np.testing.assert_allclose(fd.reference_gqa_decode(q, k, v), want, rtol=1e-12, atol=1e-12)


# -- KVCache: device rows and q (checks only; the GPU tests run them) ---------------------


def unbuilt_cache(dtype=np.float16, fp8="", ordinal=0):
    """A KVCache's attributes that its argument checks read, with no device behind them:
    a call that passes the checks fails on the missing lock, never on the device."""
    kv = fd.KVCache.__new__(fd.KVCache)
    kv.n_kv_heads, kv.head_dim, kv.row_elems = KV, D, KV * D
    kv.dtype, kv.fp8 = np.dtype(dtype), fp8
    kv._row_shapes = ((KV * D,), (KV, D), (1, KV, 1, D))

    class Device:
        pass

    kv.device = Device()
    kv.device.ordinal = ordinal
    return kv


@pytest.mark.parametrize(
    "k,v,exc,message",
    [
        (FakeTorchCuda((KV, D)), np.zeros((KV, D), np.float16), TypeError,
         "k_tok, v_tok: pass both as numpy arrays or both as device arrays"),
        (FakeTorchCuda((KV, D), torch.float32), FakeTorchCuda((KV, D)), TypeError,
         r"k_tok: expected dtype float16 \(the cache's\), got float32"),
        (FakeTorchCuda((KV, D), ordinal=1), FakeTorchCuda((KV, D), ordinal=1), ValueError,
         "k_tok: on device 1, but the cache is on device 0"),
        (FakeTorchCuda((KV, D)), FakeTorchCuda((KV, 2 * D)), ValueError,
         r"v_tok: expected one token of shape \(32,\), \(2, 16\) or \(1, 2, 1, 16\), got "
         r"\(2, 32\)"),
        ([0.0] * (KV * D), FakeTorchCuda((KV, D)), TypeError,
         "k_tok: expected a numpy array or a device array, got list"),
    ],
)  # fmt: skip
def test_kv_cache_append_of_device_rows_is_checked_naming_the_argument(
    k, v, exc, message, torch_streams
):
    with pytest.raises(exc, match=message):
        unbuilt_cache().append(k, v)


def test_kv_cache_extend_of_device_rows_is_checked_naming_the_argument(torch_streams):
    kv = unbuilt_cache()
    with pytest.raises(ValueError, match="v_rows: expected 5 tokens like k_rows, got 4"):
        kv.extend(FakeTorchCuda((5, KV, D)), FakeTorchCuda((4, KV, D)))
    with pytest.raises(ValueError, match=r"k_rows: expected tokens of shape \(n, 2, 16\)"):
        kv.extend(FakeTorchCuda((5, KV, D + 1)), FakeTorchCuda((5, KV, D + 1)))
    with pytest.raises(ValueError, match=r"SDPA cache .* is head-major; pass rows\[0\]"):
        kv.extend(FakeTorchCuda((1, KV, 5, D)), FakeTorchCuda((1, KV, 5, D)))
    fp8 = unbuilt_cache(ml_dtypes.float8_e4m3fn, "e4m3")
    with pytest.raises(TypeError, match="k_rows: expected float32, float16 or bfloat16 rows"):
        fp8.extend(FakeTorchCuda((5, KV, D), torch.int8), FakeTorchCuda((5, KV, D)))
    with pytest.raises(TypeError, match="v_rows: expected k_rows's dtype float16, got float32"):
        fp8.extend(FakeTorchCuda((5, KV, D)), FakeTorchCuda((5, KV, D), torch.float32))


def test_kv_cache_decode_of_a_device_q_is_checked_naming_the_argument(torch_streams):
    kv = unbuilt_cache()
    with pytest.raises(ValueError, match="q: on device 1, but the cache is on device 0"):
        kv.decode(FakeTorchCuda((H, D), ordinal=1))
    with pytest.raises(TypeError, match=r"q: expected dtype float16 \(the cache's\)"):
        kv.decode(FakeTorchCuda((H, D), torch.bfloat16))
    with pytest.raises(ValueError, match=r"n_heads: 4 given, but q of shape \(1, 8, 1, 16\)"):
        kv.decode(FakeTorchCuda((1, H, 1, D)), n_heads=4)
    with pytest.raises(ValueError, match=r"q: expected shape \(n_heads\*16,\)"):
        kv.decode(FakeTorchCuda((H, D + 1)))
    with pytest.raises(ValueError, match="n_heads: must be a multiple of n_kv_heads"):
        kv.decode(FakeTorchCuda((3, D)))
    with pytest.raises(TypeError, match="q: expected a numpy array or a device array"):
        kv.decode([0.0] * (H * D))


def test_a_kv_cache_names_every_dtype():
    assert unbuilt_cache(np.float32).dtype_name == "f32"
    assert unbuilt_cache(ml_dtypes.bfloat16).dtype_name == "bf16"
    assert unbuilt_cache(ml_dtypes.float8_e4m3fn, "e4m3").dtype_name == "e4m3"
    assert unbuilt_cache(ml_dtypes.float8_e5m2, "e5m2").dtype_name == "e5m2"
