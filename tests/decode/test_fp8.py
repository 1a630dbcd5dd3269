"""fp8 caches on the CPU: the host rounding (fd.quantize_fp8), the checks made before any
device work, the plans and kernel names, and the fp8 kernels' compile (no stack, no
spills) for sm_90 and sm_100."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.decode import plan as attention
from ferrox_driver.decode.fp8 import fp8_max
from ferrox_driver.driver.compiler import compile_source
from ferrox_driver.kernels.catalogue import kernel_source
from ferrox_driver.kernels.spec import KernelSpec

from .test_split_plan import _traits

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def test_quantize_rounds_to_nearest_even_and_saturates():
    x = np.array([1.0, 1.0625, 1.1875, 447.9, 460.0, 1e6, -1e6, np.inf, -np.inf, np.nan])
    got = fd.quantize_fp8(x, E4M3).astype(np.float64)
    # 1.0625 is halfway between 1 and 1.125: to the even one; 1.1875 between 1.125 and 1.25
    assert got[:3].tolist() == [1.0, 1.0, 1.25]
    assert got[3:9].tolist() == [448.0, 448.0, 448.0, -448.0, 448.0, -448.0]
    assert np.isnan(got[9])
    assert fp8_max(E4M3) == 448.0 and fp8_max(E5M2) == 57344.0
    assert fd.quantize_fp8(np.array([1e9]), E5M2).astype(float)[0] == 57344.0


def test_quantize_divides_by_each_kv_heads_scale_in_float32():
    x = np.arange(12, dtype=np.float32).reshape(1, 3, 4) * 0.37
    scale = np.array([0.5, 2.0, 0.1], np.float32)
    got = fd.quantize_fp8(x, E4M3, scale)
    want = (x / scale[:, None]).astype(E4M3)  # in range: a plain cast
    assert (got.view(np.uint8) == want.view(np.uint8)).all()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"head_dim": 100}, ValueError, "head_dim: fp8 caches take head_dims that are multiples"),
        ({"k_scale": 0.0}, ValueError, "k_scale: expected positive finite"),
        ({"v_scale": [1.0, np.nan]}, ValueError, "v_scale: expected positive finite"),
        ({"k_scale": [1.0, 2.0, 3.0]}, ValueError, "k_scale: expected a scalar or 2 values"),
        ({"v_scale": "1"}, TypeError, "v_scale: expected a float"),
        ({"k_scale": 1e39}, ValueError, "k_scale"),
        ({"dtype": np.float16, "k_scale": 2.0}, ValueError, "only fp8 and nvfp4 caches"),
        ({"dtype": np.int8}, TypeError, "dtype"),
    ],
)
def test_bad_fp8_cache_arguments_are_refused_before_any_device_work(kwargs, error, match):
    args = {"n_kv_heads": 2, "head_dim": 64, "capacity": 16, "dtype": E4M3, **kwargs}
    with pytest.raises(error, match=match):
        fd.KVCache(**args)


def test_fp8_plans_are_the_bf16_plans_on_byte_kernels():
    traits, bf16 = _traits(), np.dtype(ml_dtypes.bfloat16)

    def kernel(heads, seq, fmt="e4m3", features=0, dtype=bf16):
        return attention.plan(traits, dtype, *heads, seq, True, None, features, fmt).kernel

    assert kernel((32, 8, 128), 512) == "gqa_split_mma_bf16_e4m3_d128_x0_cluster"
    # no wide plans (measured slower with fp8): the combine kernel's full wave
    assert kernel((32, 8, 128), 131072) == "gqa_split_mma_bf16_e4m3_d128_x0"
    assert attention.plan(traits, bf16, 32, 8, 128, 131072, True, None, 0, "e4m3").splits == 16
    assert kernel((32, 32, 128), 131072, "e5m2") == "gqa_split_mma_bf16_e5m2_d128_x0"
    assert kernel((32, 8, 96), 32768, features=16) == "gqa_split_mma_bf16_e4m3_d128_r96_x16"
    assert kernel((16, 1, 128), 32768) == "gqa_split_mma_bf16_e4m3_d128_t2_x0"
    # never paired (head_dim 32 at 131072 would be), fp16 q too
    assert kernel((32, 8, 32), 131072, dtype=np.dtype(np.float16)) == (
        "gqa_split_mma_f16_e4m3_d64_r32_x0"
    )
    p = attention.plan(traits, bf16, 32, 8, 128, 512, True, None, 0, "e4m3")
    plain = attention.plan(traits, bf16, 32, 8, 128, 512)
    assert (p.splits, p.cluster, p.fp8) == (plain.splits, plain.cluster, "e4m3")
    assert p.shared_bytes(128, 2) == plain.shared_bytes(128, 2)  # twice the steps of bytes
    for heads, dtype in (((32, 8, 100), bf16), ((32, 8, 128), np.dtype(np.float32)),
                         ((36, 2, 128), bf16)):  # fmt: skip
        with pytest.raises(ValueError, match="fp8: no kernel"):
            kernel(heads, 4096, dtype=dtype)
    odd = KernelSpec("mma", "f16", 256, 192, tiles=2, fp8="e5m2", features=3)
    assert odd.name == "gqa_split_mma_f16_e5m2_d256_r192_t2_x3"
    assert odd.entry == (
        "FX_MMA8_KERNELS(gqa_split_mma_f16_e5m2_d256_r192_t2_x3, fx_half, 2, 256, 192, true, 3)"
    )
    assert kernel((32, 8, 72), 4096) == "gqa_split_mma_bf16_e4m3_d128_r72_x0"  # 8-byte chunks
    for bad in (dict(row_dim=68), dict(dtype="f32"), dict(wide=True), dict(features=128),
                dict(fp8="e3m4"), dict(paired=True, row_dim=64)):  # fmt: skip
        with pytest.raises(ValueError, match="has no kernel"):
            KernelSpec(**{"family": "mma", "dtype": "bf16", "head_dim": 128, "fp8": "e4m3", **bad})


FP8_KERNELS = [
    KernelSpec("mma", "bf16", 128, fp8="e4m3"),  # gqa_split_mma_bf16_e4m3_d128_x0
    KernelSpec("mma", "f16", 64, fp8="e5m2"),
    KernelSpec("mma", "bf16", 256, fp8="e4m3"),
    KernelSpec("mma", "bf16", 128, 80, tiles=2, fp8="e4m3", features=31),
    KernelSpec("mma", "bf16", 256, 192, fp8="e5m2", features=26),
    KernelSpec("mma", "bf16", 128, wide=True, fp8="e4m3", cluster=True),
    KernelSpec("mma", "f16", 64, 48, fp8="e4m3", features=63),
    KernelSpec("mma", "bf16", 128, 72, fp8="e4m3"),  # rows of 8-byte chunks
    KernelSpec("mma", "f16", 64, 40, tiles=2, fp8="e5m2", features=31),
    KernelSpec("mma", "bf16", 64, 8, fp8="e4m3"),
    KernelSpec("mma", "bf16", 256, 200, fp8="e4m3"),
]


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_fp8_kernels_compile_without_stack_or_spills(arch):
    src = kernel_source("gqa_decode_split.cu")
    for spec in FP8_KERNELS:
        name, sel = spec.name, spec.entry
        program = compile_source(f"#define FX_SELECTED 1\n{src}\n{sel}\n", arch=arch,
                                 name=f"{name}.cu")  # fmt: skip
        found = program.resources
        assert name in found or name.removesuffix("_cluster") in found, (name, sorted(found))
        for kernel, res in found.items():
            assert res.stack_bytes == 0 and res.spill_stores == 0, (arch, kernel, res)
    quant = compile_source(kernel_source("kv_quantize.cu"), arch=arch, name="kv_quantize.cu")
    assert {"kv_quantize_e4m3", "kv_quantize_e5m2_bf16"} <= set(quant.resources)
