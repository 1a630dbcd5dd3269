"""4-bit (q4) caches' device kernels, on the CPU: they compile for Hopper without spills,
the swapped split kernels' plans take the one-query decodes they can read, and the rows
kernels' plans every other 4-bit decode they can read, refusing the rest."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from ferrox_driver.decode import plan as attention
from ferrox_driver.decode.launches import split_program
from ferrox_driver.driver.compiler import compile_source
from ferrox_driver.kernels.catalogue import kernel_source
from ferrox_driver.kernels.spec import KernelSpec
from ferrox_driver.kernels.traits import F_HND, F_LSE, F_WINDOW

from .test_split_plan import _traits


def test_the_quantizing_kernels_compile_without_spills():
    names = []
    for rows, c_type in (("f32", "float"), ("bf16", "fx_bf16")):
        for d in (64, 128, 256):
            name = f"kv_quantize_q4_{rows}_d{d}_g32_rk"
            names.append((name, f"FX_QUANTIZE_Q4_ENTRY({name}, {c_type}, {d}, 32, true)"))
            name = f"kv_quantize_nvfp4_{rows}_d{d}_rk"
            names.append((name, f"FX_QUANTIZE_NVFP4_ENTRY({name}, {c_type}, {d}, true)"))
    source = "#define FX_SELECTED 1\n" + kernel_source("kv_quantize4.cu") + "\n"
    program = compile_source(source + "\n".join(e for _, e in names) + "\n", arch="sm_90")
    for name, _ in names:
        assert program.resources[name].spill_stores == 0, name


def test_the_q4_rows_kernels_compile_without_spills():
    specs = [KernelSpec("vrows", "bf16", head_dim=d, row_warps=w, fp8=fmt, rotate=True,
                        features=f) for d in (64, 128) for w in (1, 8)
             for f in (0, F_WINDOW | 2 | 4 | 32) for fmt in ("q4", "nvfp4")]  # fmt: skip
    program = split_program(specs, "sm_90")
    for spec in specs:
        assert program.resources[spec.name].spill_stores == 0, spec.name


def test_a_q4_decode_takes_the_rows_kernel_whatever_the_override_says():
    bf16 = np.dtype(ml_dtypes.bfloat16)
    off = attention.Overrides(verify_rows=False)

    def rows(n_q=1, dtype=bf16, head_dim=128, features=0, rotate=True):
        return attention.rows_plan(_traits(), dtype, n_q, 32, 8, head_dim, 32768, True,
                                   features, "q4", off, rotate)  # fmt: skip

    one = rows()  # blocks of at least Overrides.rows4_warps (2) warps: they widen the steps
    assert one is not None and one.spec.name == "gqa_verify_rows_bf16_q4r_d128_w2_x0"
    assert rows(8, features=F_LSE).spec.row_warps == 2
    assert rows(16, features=F_LSE).spec.row_warps == 4  # (64 rows: four warps)
    # a step of 32 tokens of nibbles and scales (K and V), its widened twin, q's rows
    assert one.shared_bytes(2) == 4 * (2 * 32 * (64 + 8)) + 2 * 32 * 128 * 2 + 2 * 16 * 128 * 2
    assert rows(rotate=False).spec.name == "gqa_verify_rows_bf16_q4_d128_w2_x0"
    single = dataclasses.replace(off, rows4_warps=1)
    assert attention.rows_plan(_traits(), bf16, 1, 32, 8, 128, 32768, True, 0, "q4", single,
                               True).spec.row_warps == 1  # fmt: skip
    for refused in ({"dtype": np.dtype(np.float32)}, {"head_dim": 80}):
        assert rows(**refused) is None, refused
    # a head-major 4-bit cache (a KVCache's): its own kernel, the head-major bit in its name
    assert rows(features=F_HND).spec.name == "gqa_verify_rows_bf16_q4r_d128_w2_x64"
    nv = attention.rows_plan(_traits(), bf16, 1, 32, 8, 128, 32768, True, 0, "nvfp4", off)
    assert nv is not None and nv.spec.name == "gqa_verify_rows_bf16_nvfp4_d128_w2_x0"
    assert nv.shared_bytes(2) == one.shared_bytes(2)  # (a scale byte per 16: q4's 2 per 32)
    assert attention.rows_plan(_traits((8, 0)), bf16, 1, 32, 8, 128, 32768, True, 0, "nvfp4",
                               off) is None  # e4m3 scales: compute capability 8.9  # fmt: skip


MMA = {"family": "mma", "row_warps": 0, "head_dim": 128}


@pytest.mark.parametrize(
    "changes",
    [{"rotate": True, "fp8": ""}, {"rotate": True, "fp8": "e4m3", **MMA},
     {"rotate": True, "fp8": "", **MMA}],
)  # fmt: skip
def test_only_a_4bit_caches_kernels_rotate(changes):
    base = KernelSpec("vrows", "bf16", head_dim=128, row_warps=1, fp8="q4")
    with pytest.raises(ValueError, match="rotate"):
        base.but(**changes)


def test_the_4bit_split_kernels_names_entries_and_refusals():
    spec = KernelSpec("mma", "bf16", 128, fp8="q4", rotate=True)
    assert spec.name == "gqa_split_mma_bf16_q4r_d128_x0"
    assert (
        spec.entry
        == "FX_MMA4_KERNELS(gqa_split_mma_bf16_q4r_d128_x0, fx_bf16, 3, 128, false, 0, 1, "
        "FX_WARPS4_D128, FX_STAGES4_D128)"
    )
    short = spec.but(narrow=True)
    assert short.name == "gqa_split_mma_bf16_q4r_d128_n_x0"
    assert short.entry.endswith(", 1, FX_WARPS4N_D128, FX_STAGES4N_D128)")
    with pytest.raises(ValueError, match="narrow"):
        KernelSpec("mma", "bf16", 128, fp8="e4m3", narrow=True)
    nv = KernelSpec("mma", "f16", 64, fp8="nvfp4", tiles=2, features=F_WINDOW, cluster=True)
    assert nv.name == "gqa_split_mma_f16_nvfp4_d64_t2_x1_cluster"
    assert (
        nv.entry
        == "FX_MMA4_KERNELS(gqa_split_mma_f16_nvfp4_d64_t2_x1, fx_half, 4, 64, true, 1, 0, "
        "FX_WARPS4_D64, FX_STAGES4_D64)"
    )
    # a head-major cache (a 4-bit KVCache's rows): the head-major bit in the name
    assert spec.but(features=F_HND).name == "gqa_split_mma_bf16_q4r_d128_x64"
    for bad in ({"row_dim": 96}, {"block_tiles": 2, "tiles": 2}):
        with pytest.raises(ValueError):
            spec.but(**bad)


def test_the_4bit_split_kernels_compile_without_spills():
    specs = [KernelSpec("mma", "bf16", d, fp8=fmt, rotate=True, tiles=t, features=f)
             for d in (64, 128, 256) for fmt in ("q4", "nvfp4") for t in (1, 2)
             for f in (0, F_HND, F_WINDOW | 2 | 4 | 32 | F_HND)
             if not (d == 256 and t == 2)]  # fmt: skip
    specs += [s.but(narrow=True) for s in specs]
    program = split_program(specs + [s.but(cluster=True) for s in specs], "sm_90")
    for spec in specs:
        for name in (spec.name, spec.name + "_cluster"):
            assert program.resources[name].spill_stores == 0, name


def test_a_4bit_one_query_decode_takes_the_split_kernels_where_they_can():
    bf16 = np.dtype(ml_dtypes.bfloat16)

    def four(n_heads=32, n_kv=8, head_dim=128, fmt="q4", features=0, traits=None, ov=None,
             aligned=True, seq=131072):  # fmt: skip
        return attention.four_bit_plan(traits or _traits(), bf16, n_heads, n_kv, head_dim,
                                       seq, aligned, features, fmt, True, ov)  # fmt: skip

    for seq, narrow in ((131072, False), (4096, True)):
        found = four(seq=seq)
        assert found is not None and found.spec.fp8 == "q4" and found.spec.rotate
        assert found.spec.narrow == narrow and found.spec.name.endswith("_n_x0") == narrow
        warps, stages = (attention.FOUR_BIT_NARROW if narrow else attention.FOUR_BIT_WIDE)[128]
        assert (warps, stages) == ((4, 8) if narrow else (12, 4))
        assert found.threads == 32 * warps
        # each warp's ring: steps of 16 tokens of K and V nibbles and their scales
        ring = warps * stages * 16 * 2 * (64 + 8)
        assert found.shared_bytes(128, 2) == ring + (
            attention.cluster_recv_bytes(128) if found.cluster else 0
        )
        # one wave of resident blocks (the fake H200 holds 228 KiB of rings)
        per_sm = 228 * 1024 // (found.shared_bytes(128, 2) + 1024)
        assert found.splits * 8 <= 132 * per_sm and per_sm == (3 if narrow else 2)
    # the narrow kernels up to Overrides.four_bit_narrow_to tokens of plan, inclusive
    edge = attention.Overrides().four_bit_narrow_to
    assert four(seq=edge).spec.narrow and not four(seq=edge + 1).spec.narrow
    assert not four(seq=512, ov=attention.Overrides(four_bit_narrow_to=0)).spec.narrow
    assert four(n_heads=128, n_kv=8).spec.tiles == 2  # groups of 16: two tiles of 8
    assert four(fmt="nvfp4").spec.name.startswith("gqa_split_mma_bf16_nvfp4r_d128")
    assert four(features=F_HND).spec.name == "gqa_split_mma_bf16_q4r_d128_x64"  # (head-major)
    for refused in (
        four(n_heads=136, n_kv=8),  # groups past 16
        four(head_dim=96),
        four(aligned=False),
        four(fmt="nvfp4", traits=_traits((8, 0))),  # e4m3 scales: 8.9 and up
        four(ov=attention.Overrides(four_bit_split=False)),
        attention.four_bit_plan(_traits(), np.dtype(np.float32), 32, 8, 128, 4096, True, 0,
                                "q4", False),
    ):  # fmt: skip
        assert refused is None


@pytest.mark.parametrize("arch", ["sm_89", "sm_90"])  # (nvfp4's e4m3 conversions: 8.9)
def test_the_by_value_4bit_append_kernels_compile_without_stack_or_spills(arch):
    # KVCache.append's one-launch path: the rows in the arguments (a generic pointer into
    # the parameter space, __grid_constant__), q4 and nvfp4, every head_dim, K rotated or not
    source = kernel_source("kv_quantize4.cu")
    entries = {}
    for d, n_kv, rows, fmt, rotate in ((64, 8, "float", "q4", True), (128, 8, "fx_bf16", "q4",
                                        True), (256, 4, "fx_half", "nvfp4", False),
                                       (128, 1, "fx_bf16", "nvfp4", True)):  # fmt: skip
        name = f"append4_{fmt}_d{d}_{n_kv}"
        group = 32 if fmt == "q4" else 0
        entries[name] = (f"FX_APPEND4_ENTRY({name}, {rows}, {d}, {group}, "
                         f"{'true' if rotate else 'false'}, {n_kv * d})")  # fmt: skip
    program = compile_source(f"{source}\n" + "\n".join(entries.values()), arch=arch,
                             name="append4.cu")  # fmt: skip
    for name in entries:
        res = program.resources[name]
        assert res.stack_bytes == 0 and res.spill_stores == 0, (arch, name, res)
