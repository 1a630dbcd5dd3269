"""The driver layer: errors, a missing driver, typed kernel arguments (no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.driver import _bindings as _driver
from ferrox_driver.driver import device
from ferrox_driver.driver.launch import pack_args


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


def _no_libcuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_libcuda(*args: object) -> None:
        raise _driver._LibNotFound('"cuda" is an NVIDIA driver library ... not found')

    monkeypatch.setattr(_driver.cu, "cuInit", no_libcuda)
    monkeypatch.setattr(_driver, "_initialised", False)
    monkeypatch.setattr(_driver, "_init_error", None)
    monkeypatch.setattr(device, "_devices", {})


def test_missing_driver_is_no_device_error_and_cuda_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_libcuda(monkeypatch)
    assert fd.cuda_available() is False
    with pytest.raises(fd.NoDeviceError, match="no NVIDIA driver found"):
        fd.Device(0)
    with pytest.raises(fd.NoDeviceError, match="arch"):
        fd.compile_source('extern "C" __global__ void k() {}')  # no arch, no GPU


def test_a_missing_driver_is_one_sentence_without_the_loaders_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import traceback

    _no_libcuda(monkeypatch)
    for _ in range(2):  # the first failure, then the remembered one
        with pytest.raises(fd.NoDeviceError) as info:
            fd.Device(0)
        err = info.value
        assert str(err) == _driver.NO_DRIVER_MESSAGE
        assert err.__cause__ is None and err.__suppress_context__
        text = "".join(traceback.format_exception(err))
        assert text.count("Traceback") == 1 and "NVIDIA driver library" not in text


def test_the_remembered_failure_does_not_grow_a_traceback_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import traceback

    _no_libcuda(monkeypatch)
    lengths = []
    for _ in range(4):
        with pytest.raises(fd.NoDeviceError) as info:
            fd.Device(0)
        lengths.append(len(traceback.extract_tb(info.value.__traceback__)))
    assert len(set(lengths[1:])) == 1


def test_a_missing_nvrtc_is_one_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_nvrtc(*args: object) -> None:
        raise _driver._LibNotFound("nvrtc ... not found")

    monkeypatch.setattr(_driver._nvrtc, "nvrtcVersion", no_nvrtc)
    for call in (_driver.rtc, _driver.rtc_raw):
        with pytest.raises(fd.NoDeviceError, match="NVRTC library could not be loaded") as info:
            call("nvrtcVersion")
        assert info.value.__cause__ is None and info.value.__suppress_context__


@pytest.mark.skipif(_driver.driver_version() is not None, reason="a CUDA driver is installed")
def test_without_libcuda_a_script_prints_the_sentence_not_a_chained_traceback() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", "import ferrox_driver as fd; fd.Device(0)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "direct cause" not in done.stderr and "During handling" not in done.stderr
    assert done.stderr.count("Traceback") == 1 and len(done.stderr.splitlines()) < 16
    assert done.stderr.rstrip().endswith(f"NoDeviceError: {_driver.NO_DRIVER_MESSAGE}")


@pytest.mark.parametrize("bad", [1, 2.5, True], ids=["int", "float", "bool"])
def test_bare_python_number_kernel_argument_is_a_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match=r"args\[1\].*numpy"):
        pack_args([np.int32(1), bad])


@pytest.mark.parametrize("fast", [False, True], ids=["pack_args", "launch_slots"])
def test_numpy_scalars_and_null_pointers_pack_with_their_c_types(fast: bool) -> None:
    import ctypes

    from ferrox_driver.driver.launch import _pack_for_launch

    args = [
        np.int32(-3),
        np.float32(1.5),
        np.uint64(2**40),
        None,
        np.float64(-2.25),
        np.int8(-7),
        np.int64(-(2**40)),
        np.uint16(65535),
        np.bool_(True),
    ]
    if fast:
        _pack_for_launch([np.int32(99)] * len(args))  # the slots hold a previous launch's
        address = _pack_for_launch(args)
    else:
        address, _keep = pack_args(args)
    ptrs = (ctypes.c_void_p * len(args)).from_address(address)
    read = [
        ctypes.c_int32.from_address(ptrs[0]).value,
        ctypes.c_float.from_address(ptrs[1]).value,
        ctypes.c_uint64.from_address(ptrs[2]).value,
        ctypes.c_void_p.from_address(ptrs[3]).value,
        ctypes.c_double.from_address(ptrs[4]).value,
        ctypes.c_int8.from_address(ptrs[5]).value,
        ctypes.c_int64.from_address(ptrs[6]).value,
        ctypes.c_uint16.from_address(ptrs[7]).value,
        ctypes.c_bool.from_address(ptrs[8]).value,
    ]
    assert read == [-3, 1.5, 2**40, None, -2.25, -7, -(2**40), 65535, True]


def test_a_bad_argument_leaves_the_launch_slots_as_they_were() -> None:
    import ctypes

    from ferrox_driver.driver.launch import _pack_for_launch

    address = _pack_for_launch([np.int32(5), np.int32(6)])
    with pytest.raises(TypeError, match=r"args\[1\]"):
        _pack_for_launch([np.int32(7), 8])
    ptrs = (ctypes.c_void_p * 2).from_address(address)
    assert [ctypes.c_int32.from_address(p).value for p in ptrs] == [5, 6]


@pytest.mark.parametrize(
    ("value", "dims"),
    [(7, (7, 1, 1)), ((3, 2, 1), (3, 2, 1)), ([4, 5], (4, 5, 1)), (np.int64(2), (2, 1, 1))],
)
def test_grid_and_block_dims_normalise(value: object, dims: tuple[int, int, int]) -> None:
    from ferrox_driver.driver.launch import _dim3

    assert _dim3(value, "grid") == dims  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, True, (1, 0, 1), (1, 2, 3, 4), (1.0, 1, 1), ()])
def test_bad_grid_dims_name_the_argument(bad: object) -> None:
    from ferrox_driver.driver.launch import _dim3

    with pytest.raises(ValueError, match="grid: expected 1 to 3 positive ints"):
        _dim3(bad, "grid")  # type: ignore[arg-type]


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


def test_objects_kept_during_a_capture_go_to_its_graph_and_only_then() -> None:
    first, second = object(), object()
    assert _driver.capture_keep(first) is False  # no capture on this thread
    with _driver.capturing() as kept:
        assert _driver.capture_keep(second) is True
        with _driver.capturing() as inner:  # nested: the outermost graph holds them all
            assert _driver.capture_keep(first) is True
        assert inner is kept
        assert kept == [second, first]
    assert _driver.capture_keep(first) is False


def test_releases_held_by_one_thread_capture_do_not_hold_another_threads() -> None:
    import threading

    seen: list[int] = []
    with _driver.capturing():
        worker = threading.Thread(target=lambda: seen.append(getattr(_driver._capture, "depth", 0)))
        worker.start()
        worker.join()
    assert seen == [0]
