"""Head dims 257..512 on the CPU (issue 50, first part): the checks take them and refuse
513 on, the planner routes them to the CUDA-core _d512 kernels (the tensor-core kernels stay
at 256 and below), fp8 caches included, and every new instantiation compiles for sm_80 and
sm_90 without spilling."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.decode import plan as attention
from ferrox_driver.decode.checks import check_dims
from ferrox_driver.decode.launches import split_program
from ferrox_driver.driver.compiler import compile_source
from ferrox_driver.kernels.catalogue import kernel_source
from ferrox_driver.kernels.spec import KernelSpec
from ferrox_driver.kernels.traits import F_ALIBI, F_CAP, F_HND, F_LIMIT, F_SCALE, F_WINDOW

from .test_split_plan import _traits

F32, F16, BF16 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
WIDE = (257, 264, 289, 320, 384, 448, 511, 512)
TAIL_ALL = F_WINDOW | F_CAP | F_ALIBI | F_SCALE | F_HND  # every feature a verify's tail takes


@pytest.mark.parametrize("head_dim", WIDE)
def test_the_checks_take_head_dims_up_to_512(head_dim):
    assert check_dims(8, 2, head_dim) == (8, 2, head_dim)


@pytest.mark.parametrize("head_dim", [513, 576, 1024])
def test_the_checks_refuse_head_dims_past_512_naming_them(head_dim):
    with pytest.raises(ValueError, match=rf"head_dim: expected 1\.\.512, got {head_dim}"):
        check_dims(8, 2, head_dim)
    with pytest.raises(ValueError, match=rf"head_dim: expected 1\.\.512, got {head_dim}"):
        fd.KVCache(2, head_dim, 16)
    with pytest.raises(ValueError, match=rf"head_dim: expected 1\.\.512, got {head_dim}"):
        fd.gqa_decode(np.zeros((2, head_dim), np.float32), np.zeros((3, 1, head_dim), np.float32),
                      np.zeros((3, 1, head_dim), np.float32))  # fmt: skip


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
@pytest.mark.parametrize("head_dim", [320, 512])
def test_four_bit_caches_still_refuse_head_dims_past_256(fmt, head_dim):
    with pytest.raises(ValueError, match=f"head_dim: {fmt} caches take head_dim 64, 128 or 256"):
        fd.KVCache(2, head_dim, 16, dtype=fmt)


def _plan(dtype, shape, seq=4096, fp8="", features=0, verify=False, cc=(9, 0), aligned=True):
    h, kv, d = shape
    return attention.plan(_traits(cc), dtype, h, kv, d, seq, aligned, features=features,
                          fp8=fp8, verify=verify)  # fmt: skip


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("head_dim", WIDE)
@pytest.mark.parametrize("n_heads,n_kv_heads", [(8, 8), (8, 1), (16, 4), (32, 2), (3, 1)])
def test_wide_heads_plan_on_the_cuda_core_d512_kernels(dtype, head_dim, n_heads, n_kv_heads):
    p = _plan(dtype, (n_heads, n_kv_heads, head_dim))
    group = n_heads // n_kv_heads
    spec = p.spec
    assert spec.family == "generic" and spec.head_dim == 512 and not p.tensor_cores
    assert spec.heads_per_block == min(4, next(g for g in (1, 2, 4) if g >= min(group, 4)))
    assert p.head_tiles == -(-group // spec.heads_per_block)
    assert p.lanes_per_token == 32 and spec.vec == (head_dim % 8 == 0)
    assert spec.name.endswith("_d512") and "_d512" in spec.entry
    assert p.workspace_floats(n_heads, head_dim) == n_heads * p.splits * (head_dim + 2)


def test_head_dims_up_to_256_keep_their_kernels():
    assert _plan(BF16, (8, 1, 256)).spec.name.startswith("gqa_split_mma_bf16_d256")
    assert _plan(F32, (8, 8, 256)).spec.name == "gqa_split_f32_g1_vec"
    assert _plan(F32, (8, 8, 200)).lanes_per_token == 32
    assert _plan(F16, (8, 8, 37)).spec.name == "gqa_split_f16_g1_any"
    assert _plan(F32, (32, 1, 100)).spec.name == "gqa_split_f32_g4_any"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("head_dim", [264, 320, 512])
def test_fp8_caches_of_wide_heads_plan_on_the_cuda_core_fp8_kernels(fmt, dtype, head_dim):
    p = _plan(dtype, (16, 2, head_dim), fp8=fmt, features=F_CAP)
    assert p.spec.family == "generic" and p.fp8 == fmt and p.features == F_CAP
    assert p.spec.head_dim == 512 and p.spec.heads_per_block == 4
    dt = "f16" if dtype == F16 else "bf16"
    assert p.kernel == f"gqa_split_{dt}_{fmt}_g4_vec_d512_x{F_CAP}"
    assert p.spec.entry.startswith("FX_GENERIC8_D512_ENTRY(")


def test_fp8_caches_of_wide_heads_refuse_fp32_q_and_old_gpus():
    with pytest.raises(ValueError, match="fp8: no kernel for q float32, head_dim 320"):
        _plan(F32, (16, 2, 320), fp8="e4m3")
    with pytest.raises(ValueError, match=r"fp8: fp8 caches need compute capability 8\.9"):
        _plan(BF16, (16, 2, 320), fp8="e4m3", cc=(8, 0))


@pytest.mark.parametrize("fp8", ["", "e4m3"])
def test_a_verify_of_wide_heads_takes_the_tail_split_and_combine_kernels(fp8):
    # (the rows kernel takes head_dims 64/128/256 only)
    assert attention.rows_plan(_traits(), BF16, 2, 16, 2, 320, 4096, True, 0, fp8) is None
    p = _plan(BF16, (2 * 16, 2, 320), fp8=fp8, verify=True)
    assert p.spec.family == "generic" and p.spec.head_dim == 512 and p.fp8 == fp8
    tail = KernelSpec("verify", "bf16", 512, fp8=fp8, features=TAIL_ALL)
    assert tail.name == f"gqa_verify_tail_bf16{'_' + fp8 if fp8 else ''}_d512_x{TAIL_ALL}"
    assert tail.entry.startswith("FX_VERIFY_TAIL_D512_ENTRY(")


def test_the_wide_specs_refuse_what_has_no_kernel():
    for bad in (
        {"family": "generic", "dtype": "f32", "head_dim": 512, "heads_per_block": 8},
        {"family": "generic", "dtype": "f32", "head_dim": 384, "heads_per_block": 1},
        {"family": "generic", "dtype": "f32", "head_dim": 512, "heads_per_block": 1,
         "fp8": "e4m3"},
        {"family": "generic", "dtype": "bf16", "heads_per_block": 1, "fp8": "e4m3"},
        {"family": "vcombine", "dtype": "bf16", "head_dim": 512},
        {"family": "combine", "dtype": "bf16", "head_dim": 512},
    ):  # fmt: skip
        with pytest.raises(ValueError, match="has no kernel"):
            KernelSpec(**bad)
    assert KernelSpec.parity("f16", 300).name == "gqa_decode_f16_d512"
    assert KernelSpec.parity("f16", 256).name == "gqa_decode_f16"


def wide_specs(arch: str) -> list[KernelSpec]:
    """Every new split-file kernel for ``arch``: the generic _d512 kernels (each dtype, heads
    per block and load width, without features, with all of them and with the head-major
    ones), their fp8 twins (from sm_89: the conversions) and the verify tails."""
    fp8 = int(arch.removeprefix("sm_")) >= 89
    specs = []
    for dt in ("f32", "f16", "bf16"):
        for g in (1, 2, 4):
            for vec in (False, True):
                for f in (0, F_LIMIT - 1, F_HND | F_CAP | F_ALIBI):
                    specs.append(KernelSpec("generic", dt, 512, heads_per_block=g, vec=vec,
                                            features=f))  # fmt: skip
                    for fmt in ("e4m3", "e5m2") if fp8 and dt != "f32" else ():
                        specs.append(KernelSpec("generic", dt, 512, heads_per_block=g, vec=vec,
                                                fp8=fmt, features=f))  # fmt: skip
        for f in (0, TAIL_ALL):
            specs.append(KernelSpec("verify", dt, 512, features=f))
            for fmt in ("e4m3", "e5m2") if fp8 and dt != "f32" else ():
                specs.append(KernelSpec("verify", dt, 512, fp8=fmt, features=f))
    return specs


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_wide_split_kernels_compile_without_spills(arch):
    specs = wide_specs(arch)
    program = split_program(specs, arch)
    spilled = {s.name: program.resources[s.name].spill_stores for s in specs
               if program.resources[s.name].spill_stores}  # fmt: skip
    assert not spilled, spilled
    for spec in specs:  # (a block's static shared memory within the 48 KiB every GPU allows)
        assert program.resources[spec.name].shared_bytes <= 48 * 1024, spec.name


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_wide_parity_kernels_compile_without_spills(arch):
    program = compile_source(kernel_source("gqa_decode.cu"), arch=arch, name="gqa_decode.cu")
    for dt in ("f32", "f16", "bf16"):
        name = KernelSpec.parity(dt, 512).name
        assert program.resources[name].spill_stores == 0, name
