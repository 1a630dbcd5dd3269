"""Misuse gets the argument's error, before any device work (no GPU needed to see it)."""

from __future__ import annotations

import pickle
import time

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.decode.checks import check_dtype
from ferrox_driver.driver import compiler, module_cache
from ferrox_driver.errors import ClosedError, CompileError, CudaError, KVCapacityError


@pytest.mark.parametrize("name", ["bf16", "bfloat16", "BF16"])
def test_dtype_names_are_understood(name):
    assert check_dtype(name, "dtype") == np.dtype(ml_dtypes.bfloat16)
    assert check_dtype("f16", "dtype") == np.dtype(np.float16)
    assert check_dtype("float32", "dtype") == np.dtype(np.float32)


@pytest.mark.parametrize(
    "dtype,message",
    [
        (None, "dtype: expected float32, float16 or bfloat16, got None"),
        ("bf17", "dtype: expected float32, float16 or bfloat16 .* got 'bf17'"),
        (np.float64, "dtype: expected float32, float16 or bfloat16, got float64"),
        (np.int8, "dtype: expected float32, float16 or bfloat16, got int8"),
    ],
)
def test_a_bad_cache_dtype_is_a_type_error_naming_it(dtype, message):
    for make in (
        lambda: fd.KVCache(8, 128, 16, dtype=dtype),
        lambda: fd.LayerKVCache(2, 8, 128, 16, dtype=dtype),
    ):
        with pytest.raises(TypeError, match=message):
            make()


def test_a_bad_array_dtype_names_the_argument():
    with pytest.raises(TypeError, match="dtype: expected float32, float16 or bfloat16"):
        fd.empty((4,), "no-such-type")


def test_a_program_prints_in_one_short_line():
    program = fd.compile_source('extern "C" __global__ void tiny(float* x) {}', arch="sm_90")
    text = repr(program)
    assert len(text) < 200 and "tiny" in text and "sm_90" in text and "bytes" in text


def test_a_slow_first_compile_says_what_it_is_doing(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FERROX_CACHE_DIR", str(tmp_path))
    module_cache.clear_memory_cache()
    real = compiler.compile_source

    def slow(*args, **kwargs):
        time.sleep(1.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(module_cache, "compile_source", slow)
    module_cache.get_program('extern "C" __global__ void slow_one() {}', arch="sm_90")
    err = capsys.readouterr().err
    assert "compiling kernel.cu for sm_90 (first use; cached afterwards)" in err
    assert "done in" in err
    module_cache.clear_memory_cache()
    module_cache.get_program('extern "C" __global__ void slow_one() {}', arch="sm_90")
    assert capsys.readouterr().err == ""  # a disk hit says nothing


def test_a_quick_compile_says_nothing(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FERROX_CACHE_DIR", str(tmp_path))
    module_cache.get_program('extern "C" __global__ void quick_one() {}', arch="sm_90")
    assert capsys.readouterr().err == ""


def test_closed_error_is_a_value_error_and_a_ferrox_error_naming_the_object():
    assert issubclass(fd.ClosedError, ValueError) and issubclass(fd.ClosedError, fd.FerroxError)
    assert str(fd.ClosedError("KVCache")) == "this KVCache was closed"
    err = fd.ClosedError("DecodeGraph", "uses a KVCache that was closed")
    assert str(err) == "this DecodeGraph uses a KVCache that was closed"
    assert err.what == "DecodeGraph"


def test_a_layer_decode_graph_takes_a_layer_kv_cache_only():
    with pytest.raises(TypeError, match=r"layers: expected a ferrox_driver\.LayerKVCache"):
        fd.LayerDecodeGraph(object(), n_heads=8)


@pytest.mark.parametrize(
    "error",
    [
        CudaError(1, "CUDA_ERROR_INVALID_VALUE", "cuMemAlloc", "invalid argument", "a hint"),
        CompileError("gqa_decode_split.cu", "line 3: error", ["-arch=sm_90"]),
        KVCapacityError(10, 10, 2),
        ClosedError("Stream"),
        ClosedError("KVCache", "was closed with its stream"),
    ],
)
def test_errors_survive_pickling_with_their_fields(error):
    # raised in a worker process (a compile in a process pool), they cross back whole
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert vars(back) == vars(error)
