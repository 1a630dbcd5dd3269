"""The driver layer: errors, a missing driver, typed kernel arguments (no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver import _driver, device
from ferrox_driver.launch import pack_args


def test_check_returns_values_after_a_success_status() -> None:
    ok = _driver.cu.CUresult.CUDA_SUCCESS
    assert _driver.check((ok,), "cuX") is None
    assert _driver.check((ok, 7), "cuX") == 7
    assert _driver.check((ok, 7, 8), "cuX") == (7, 8)


def test_check_raises_cuda_error_with_code_name_call_and_description() -> None:
    status = _driver.cu.CUresult.CUDA_ERROR_INVALID_IMAGE
    with pytest.raises(fd.CudaError) as info:
        _driver.check((status, None), "cuModuleLoadData")
    err = info.value
    assert err.code == int(status)
    assert err.name == "CUDA_ERROR_INVALID_IMAGE"
    assert err.call == "cuModuleLoadData"
    assert "cuModuleLoadData" in str(err) and "CUDA_ERROR_INVALID_IMAGE" in str(err)


def test_missing_driver_is_no_device_error_and_cuda_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_libcuda(*args: object) -> None:
        raise _driver._LibNotFound('"cuda" is an NVIDIA driver library ... not found')

    monkeypatch.setattr(_driver.cu, "cuInit", no_libcuda)
    monkeypatch.setattr(_driver, "_initialised", False)
    monkeypatch.setattr(_driver, "_init_error", None)
    monkeypatch.setattr(device, "_default", None)
    assert fd.cuda_available() is False
    with pytest.raises(fd.NoDeviceError, match="no NVIDIA driver found"):
        fd.Device(0)
    with pytest.raises(fd.NoDeviceError, match="arch"):
        fd.compile_source('extern "C" __global__ void k() {}')  # no arch, no GPU


@pytest.mark.parametrize("bad", [1, 2.5, True], ids=["int", "float", "bool"])
def test_bare_python_number_kernel_argument_is_a_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match=r"args\[1\].*numpy"):
        pack_args([np.int32(1), bad])


def test_numpy_scalars_and_null_pointers_pack_with_their_c_types() -> None:
    import ctypes

    address, keep = pack_args([np.int32(-3), np.float32(1.5), np.uint64(2**40), None])
    values = keep[0]
    assert [type(v) for v in values] == [
        ctypes.c_int32,
        ctypes.c_float,
        ctypes.c_uint64,
        ctypes.c_void_p,
    ]
    ptrs = (ctypes.c_void_p * 4).from_address(address)
    assert ctypes.c_int32.from_address(ptrs[0]).value == -3
    assert ctypes.c_float.from_address(ptrs[1]).value == 1.5


def test_unsupported_kernel_argument_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"args\[0\]"):
        pack_args(["a string"])


def test_releases_inside_a_capture_wait_for_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int]] = []

    class FakeCu:
        def __getattr__(self, name: str) -> object:
            return lambda *args: calls.append((name, *args))

    monkeypatch.setattr(_driver, "cu", FakeCu())
    _driver.release("cuMemFree", 1)
    assert calls == [("cuMemFree", 1)]
    with _driver.capturing():
        _driver.release("cuMemFree", 2)
        with _driver.capturing():  # nested captures: held until the outermost ends
            _driver.release("cuModuleUnload", 3)
        assert calls == [("cuMemFree", 1)]
    assert calls == [("cuMemFree", 1), ("cuMemFree", 2), ("cuModuleUnload", 3)]
    with pytest.raises(RuntimeError, match="boom"), _driver.capturing():
        _driver.release("cuStreamDestroy", 4)
        raise RuntimeError("boom")
    assert calls[-1] == ("cuStreamDestroy", 4)  # a failed capture releases too


def test_releases_held_by_one_thread_capture_do_not_hold_another_threads() -> None:
    import threading

    seen: list[int] = []
    with _driver.capturing():
        worker = threading.Thread(target=lambda: seen.append(getattr(_driver._capture, "depth", 0)))
        worker.start()
        worker.join()
    assert seen == [0]
