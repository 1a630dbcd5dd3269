"""Caches of K and V in formats of their own (fp8 K with 4-bit V...), on the CPU: their
kernels compile for Hopper without spills, their decodes plan on the rows kernel alone
(one query or several), and the kernel specs name both formats."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ferrox_driver.cache.four_bit import mixed_quantize_kernel
from ferrox_driver.decode import plan as attention
from ferrox_driver.decode.launches import split_program
from ferrox_driver.driver.compiler import compile_source
from ferrox_driver.kernels.catalogue import kernel_source
from ferrox_driver.kernels.spec import QUANTIZED_Q8, KernelSpec
from ferrox_driver.kernels.traits import F_HND, F_LSE, F_WINDOW

from .test_split_plan import _traits

PAIRS = [("e4m3", "q4"), ("e4m3", "nvfp4"), ("q4", "e4m3"), ("nvfp4", "e5m2"), ("q4", "nvfp4")]
BF16 = np.dtype(ml_dtypes.bfloat16)


def test_the_mixed_quantizing_kernels_compile_without_spills():
    entries = []
    for rows, c_type in (("f32", "float"), ("bf16", "fx_bf16")):
        for d in (64, 128, 256):
            for k, v in PAIRS:
                for rot in (True, False) if k in ("q4", "nvfp4") else (False,):
                    name = f"kv_quantize_{k}{'r' if rot else ''}_v{v}_{rows}_d{d}"
                    entries.append((name, f"FX_QUANTIZE_MIXED_ENTRY({name}, {c_type}, {d}, "
                                          f"{QUANTIZED_Q8[k]}, {QUANTIZED_Q8[v]}, "
                                          f"{'true' if rot else 'false'})"))  # fmt: skip
    source = "#define FX_SELECTED 1\n" + kernel_source("kv_quantize4.cu") + "\n"
    program = compile_source(source + "\n".join(e for _, e in entries) + "\n", arch="sm_90")
    for name, _ in entries:
        assert program.resources[name].spill_stores == 0, name


def test_a_rotated_fp8_k_has_no_quantizing_kernel():
    source = "#define FX_SELECTED 1\n" + kernel_source("kv_quantize4.cu") + "\n"
    bad = "FX_QUANTIZE_MIXED_ENTRY(bad, float, 128, 1, 3, true)\n"
    with pytest.raises(Exception, match="a 4-bit K is rotated"):
        compile_source(source + bad, arch="sm_90")
    assert callable(mixed_quantize_kernel)  # (the cache's getter of these kernels)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_mixed_rows_kernels_compile_without_spills(head_dim):
    specs = [KernelSpec("vrows", dt, head_dim=head_dim, row_warps=w, fp8=k, v_fp8=v,
                        rotate=k == "q4", features=f)
             for dt in ("bf16", "f16") for k, v in [*PAIRS, ("e4m3", "e5m2")]
             for w in (2, 8) for f in (0, F_WINDOW | 2 | 4 | 32)]  # fmt: skip
    program = split_program(specs, "sm_90")
    for spec in specs:
        assert program.resources[spec.name].spill_stores == 0, spec.name


def test_a_mixed_kernel_spec_names_both_formats():
    spec = KernelSpec("vrows", "bf16", head_dim=128, row_warps=2, fp8="e4m3", v_fp8="q4")
    assert spec.name == "gqa_verify_rows_bf16_e4m3_vq4_d128_w2_x0"
    assert spec.entry == (
        "FX_VERIFY_ROWS_MIXED_ENTRY(gqa_verify_rows_bf16_e4m3_vq4_d128_w2_x0, fx_bf16, 1, 3, "
        "128, 2, 0, 0)"
    )
    rot = spec.but(fp8="q4", v_fp8="nvfp4", rotate=True, features=F_WINDOW)
    assert rot.name == "gqa_verify_rows_bf16_q4r_vnvfp4_d128_w2_x1"
    assert rot.entry.endswith("fx_bf16, 3, 4, 128, 2, 1, 1)")


@pytest.mark.parametrize(
    "changes",
    [
        {"v_fp8": "e4m3"},  # V's format K's: not a mixed kernel
        {"fp8": "", "v_fp8": "q4"},  # a 16-bit side
        {"v_fp8": "int8"},
        {"rotate": True},  # an fp8 K is not rotated
        {"features": F_HND},  # a 4-bit side: token-major
        {"family": "mma", "row_warps": 0},  # the rows kernel's alone
    ],
)
def test_a_mixed_kernel_spec_refuses_what_no_kernel_is(changes):
    base = KernelSpec("vrows", "bf16", head_dim=128, row_warps=2, fp8="e4m3", v_fp8="q4")
    with pytest.raises(ValueError, match="kernel"):
        base.but(**changes)


def _rows(n_q=1, fmt="e4m3+q4", traits=None, **kw):
    args = dict(dtype=BF16, head_dim=128, features=0, rotate=False, aligned=True)
    args.update(kw)
    return attention.rows_plan(traits or _traits(), args["dtype"], n_q, 32, 8,
                               args["head_dim"], 32768, args["aligned"], args["features"], fmt,
                               attention.Overrides(verify_rows=False), args["rotate"])  # fmt: skip


def test_a_mixed_decode_plans_on_the_rows_kernel_whatever_the_override_says():
    one = _rows()
    assert one is not None and one.spec.name == "gqa_verify_rows_bf16_e4m3_vq4_d128_w2_x0"
    assert one.spec.fp8 == "e4m3" and one.spec.v_fp8 == "q4"
    assert _rows(8, features=F_LSE).spec.row_warps == 2
    assert _rows(16).spec.row_warps == 4
    rotated = _rows(fmt="q4+e4m3", rotate=True)
    assert rotated.spec.name == "gqa_verify_rows_bf16_q4r_ve4m3_d128_w2_x0"
    # a step of 32 tokens: K's fp8 bytes, V's nibbles and scales; its widened twin; q's rows
    step = 32 * 128 + 32 * (64 + 8)
    widened, q_rows = 2 * 32 * 128 * 2, 2 * 16 * 128 * 2
    assert one.shared_bytes(2) == attention.ROWS_STAGES[128] * step + widened + q_rows
    assert rotated.shared_bytes(2) == one.shared_bytes(2)
    both = _rows(fmt="q4+nvfp4")  # (two 4-bit sides: the one-format 4-bit step)
    assert both.shared_bytes(2) == _rows(fmt="q4").shared_bytes(2)
    fp8s = _rows(fmt="e4m3+e5m2")  # two fp8 sides: a byte an element, one warp's rows
    assert fp8s.spec.row_warps == 1
    assert fp8s.shared_bytes(2) == attention.ROWS_STAGES[128] * 2 * 32 * 128 + widened + q_rows // 2


@pytest.mark.parametrize(
    "refused",
    [
        {"dtype": np.dtype(np.float32)},
        {"head_dim": 96},
        {"features": F_HND},
        {"aligned": False},
        {"traits": _traits((8, 0))},  # fp8 and nvfp4 sides: fp8 conversions, 8.9 and up
    ],
)
def test_a_mixed_decode_the_rows_kernel_cannot_take_has_no_plan(refused):
    assert _rows(**refused) is None


def test_a_mixed_format_of_an_unknown_side_is_an_error():
    with pytest.raises(ValueError, match="fp8: K's and V's formats"):
        _rows(fmt="e4m3+int8")
