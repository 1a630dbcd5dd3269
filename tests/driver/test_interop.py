"""DLPack, foreign arrays and streams, checked without a GPU: numpy is an independent DLPack
producer and consumer, and fake device tensors show what is refused before device work."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.decode import plan as attention
from ferrox_driver.driver import dlpack
from ferrox_driver.driver.stream import stream_key


class HostTensor:
    """A producer of DLPack capsules over a numpy array, with ferrox's exporter."""

    def __init__(self, arr: np.ndarray, device: tuple[int, int] = (dlpack.CPU, 0)) -> None:
        self.arr, self.device = arr, device
        self.asked: list[object] = []

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.asked.append(max_version)
        versioned = max_version is not None and max_version[0] >= 1
        return dlpack.export(
            self.arr.ctypes.data, self.arr.shape, self.arr.dtype, *self.device, self.arr,
            versioned=versioned,
        )  # fmt: skip

    def __dlpack_device__(self):
        return self.device


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
def test_numpy_reads_our_capsules_without_a_copy(rng, versioned) -> None:
    src = rng.standard_normal((3, 5)).astype(np.float32)
    producer = HostTensor(src)
    if not versioned:  # a consumer that asks for no version gets the legacy capsule
        producer.__dlpack__ = lambda **kw: dlpack.export(  # type: ignore[method-assign]
            src.ctypes.data, src.shape, src.dtype, dlpack.CPU, 0, src, versioned=False
        )
    got = np.from_dlpack(producer)
    assert got.ctypes.data == src.ctypes.data  # the same memory
    np.testing.assert_array_equal(got, src)


def test_we_read_numpys_capsules_with_their_strides_and_release_them(rng) -> None:
    a = rng.standard_normal((4, 6)).astype(np.float16)
    imported = dlpack.import_capsule(a.__dlpack__())
    assert (imported.ptr, imported.shape, imported.dtype) == (a.ctypes.data, (4, 6), a.dtype)
    assert imported.device_type == dlpack.CPU and imported.contiguous
    assert not dlpack.import_capsule(a.T.__dlpack__()).contiguous
    with pytest.raises(TypeError, match="unconsumed DLPack capsule"):
        capsule = a.__dlpack__()
        dlpack.import_capsule(capsule)
        dlpack.import_capsule(capsule)  # consumed once already


def test_an_exported_capsule_keeps_its_owner_until_released() -> None:
    before = len(dlpack._exported)
    arr = np.arange(4, dtype=np.float32)
    capsule = HostTensor(arr).__dlpack__()
    assert len(dlpack._exported) == before + 1
    del capsule
    gc.collect()
    assert len(dlpack._exported) == before  # an unconsumed capsule released its tensor


def test_bf16_and_fp8_have_dlpack_type_codes() -> None:
    for dt in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.float16, np.float32):
        capsule = dlpack.export(8, (2,), np.dtype(dt), dlpack.CUDA, 0, None, versioned=True)
        assert dlpack.import_capsule(capsule).dtype == np.dtype(dt)
    with pytest.raises(BufferError, match="dtype"):
        dlpack.export(8, (2,), np.dtype(np.complex64), dlpack.CUDA, 0, None, versioned=True)


class FakeCudaTensor:
    """A DLPack producer claiming CUDA memory on ``ordinal`` (never dereferenced: these
    calls must fail validation before any device work)."""

    def __init__(self, shape, dtype=np.float16, ordinal=0, ptr=1 << 20) -> None:
        self.shape, self.dtype, self.ordinal, self.ptr = shape, np.dtype(dtype), ordinal, ptr

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        return dlpack.export(
            self.ptr, self.shape, self.dtype, dlpack.CUDA, self.ordinal, None, versioned=True
        )

    def __dlpack_device__(self):
        return dlpack.CUDA, self.ordinal


KW = {"n_heads": 8, "n_kv_heads": 2, "head_dim": 16}


@pytest.mark.parametrize("odd_one", ["k_cache", "v_cache", "out"])
def test_arrays_on_two_devices_are_refused_naming_the_argument(odd_one) -> None:
    args = {
        "q": FakeCudaTensor((8, 16)),
        "k_cache": FakeCudaTensor((10, 2, 16)),
        "v_cache": FakeCudaTensor((10, 2, 16)),
        "out": FakeCudaTensor((8, 16)),
    }
    args[odd_one] = FakeCudaTensor(args[odd_one].shape, ordinal=1)
    with pytest.raises(ValueError, match=rf"^{odd_one}: on device 1, but q is on device 0"):
        fd.gqa_decode(args["q"], args["k_cache"], args["v_cache"], out=args["out"], **KW)


def test_a_host_dlpack_tensor_is_refused_as_not_on_a_device() -> None:
    host = HostTensor(np.zeros((8, 16), np.float16))
    k = FakeCudaTensor((10, 2, 16))
    with pytest.raises(TypeError, match="q: expected a numpy array or a CUDA device array"):
        fd.gqa_decode(host, k, k, **KW)


def test_bad_device_arrays_are_refused_before_device_work() -> None:
    q, k = FakeCudaTensor((8, 16)), FakeCudaTensor((10, 2, 16))
    with pytest.raises(TypeError, match="k_cache: expected q's dtype float16"):
        fd.gqa_decode(q, FakeCudaTensor((10, 2, 16), np.float32), k, **KW)
    with pytest.raises(ValueError, match="v_cache: expected k_cache's shape"):
        fd.gqa_decode(q, k, FakeCudaTensor((11, 2, 16)), **KW)
    with pytest.raises(ValueError, match="out: expected 128 elements of float16"):
        fd.gqa_decode(q, k, k, out=FakeCudaTensor((8, 8)), **KW)
    with pytest.raises(ValueError, match="device: 5 given, but q is on device 0"):
        fd.gqa_decode(q, k, k, device=5, **KW)
    with pytest.raises(TypeError, match=r"device: expected a ferrox_driver\.Device, an int"):
        fd.gqa_decode(q, k, k, device=0.0, **KW)
    with pytest.raises(TypeError, match="stream: expected"):
        fd.gqa_decode(q, k, k, stream="cuda", **KW)


def test_numpy_calls_check_out_device_and_stream_before_copying(rng) -> None:
    # without a GPU, a copy would raise NoDeviceError: these must be the argument's error
    q = rng.standard_normal((8, 16)).astype(np.float32)
    k = rng.standard_normal((10, 2, 16)).astype(np.float32)
    with pytest.raises(TypeError, match="out: only accepted with device inputs"):
        fd.gqa_decode(q, k, k, out=np.empty_like(q), **KW)
    with pytest.raises(ValueError, match="device: expected a CUDA device"):
        fd.gqa_decode(q, k, k, device="cpu", **KW)
    with pytest.raises(TypeError, match=r"device: expected a ferrox_driver\.Device"):
        fd.gqa_decode(q, k, k, device=[0], **KW)
    with pytest.raises(TypeError, match="stream: expected"):
        fd.gqa_decode(q, k, k, stream=2.5, **KW)
    empty = np.zeros((0, 2, 16), np.float32)
    with pytest.raises(ValueError, match="device: expected an ordinal >= 0"):
        fd.gqa_decode(q, empty, empty, device=-1, **KW)  # even with nothing to decode


class ProtocolStream:
    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self):
        return 0, self.handle


def test_streams_are_taken_by_protocol_attribute_or_handle() -> None:
    assert stream_key(None) == 0
    assert stream_key(12345) == 12345
    assert stream_key(ProtocolStream(777)) == 777

    class TorchLike:
        cuda_stream = 4242

    assert stream_key(TorchLike()) == 4242
    with pytest.raises(TypeError, match="stream: expected"):
        stream_key(object())
    with pytest.raises(TypeError, match="stream: expected"):
        stream_key(True)


def test_the_environment_knobs_are_read_into_overrides_once() -> None:
    env = {"FERROX_WIDE": "0", "FERROX_SPLIT_HEADS_PER_BLOCK": "2"}
    o = attention.Overrides.from_env(env)
    assert (o.wide, o.heads_per_block, o.cluster, o.tc32, o.early_combine) == (
        False, 2, True, True, True,
    )  # fmt: skip
    assert attention.Overrides.from_env({}).wide
    # the wgmma latent kernel: on, from chunks of 512 tokens
    assert attention.Overrides.from_env({}).latent_wgmma
    assert not attention.Overrides.from_env({"FERROX_LATENT_WG": "0"}).latent_wgmma
    assert attention.Overrides.from_env({}).latent_wg_min_chunk == 512
    assert (
        attention.Overrides.from_env({"FERROX_LATENT_WG_MIN_CHUNK": "0"}).latent_wg_min_chunk == 0
    )


def test_importing_ferrox_imports_no_framework():
    """PyTorch and transformers are optional: only ferrox_driver.integrations imports
    them, when asked."""
    import subprocess
    import sys

    names = "('torch', 'transformers', 'cupy')"
    code = f"import sys, ferrox_driver; print(sorted(m for m in {names} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
