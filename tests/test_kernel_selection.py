"""A first use compiles only its own kernels: each split kernel in a module of its own, with
the same machine code as when every kernel is built at once (NVRTC, no GPU needed)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from ferrox_driver.decode import plan as attention
from ferrox_driver.driver.compiler import compile_source
from ferrox_driver.kernels.catalogue import kernel_source

ARCH = "sm_90"


def _selected(name: str):
    source = f"#define FX_SELECTED 1\n{kernel_source(attention.SPLIT_FILE)}\n"
    source += attention.split_entry(name) + "\n"
    started = time.perf_counter()
    program = compile_source(source, arch=ARCH, name=attention.SPLIT_FILE)
    return name, program, time.perf_counter() - started


@pytest.fixture(scope="module")
def whole():
    return compile_source(kernel_source(attention.SPLIT_FILE), arch=ARCH)


def test_every_kernel_compiled_alone_has_the_machine_code_it_has_among_all(whole):
    names = sorted(whole.resources)
    assert len(names) >= 40
    entries = {}  # one compile per entry line (an mma entry makes a kernel and its _cluster)
    for name in names:
        entries.setdefault(attention.split_entry(name), name)
    with ProcessPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        done = list(pool.map(_selected, entries.values()))
    alone: dict[str, object] = {}
    every = whole.sections()
    for name, program, _ in done:
        entry = attention.split_entry(name)
        assert set(program.resources) == {n for n in names if attention.split_entry(n) == entry}
        sections = program.sections()
        for kernel in program.resources:
            for kind in (".text.", ".nv.constant0.", ".nv.shared."):
                assert sections.get(kind + kernel) == every.get(kind + kernel), (kernel, kind)
            assert program.resources[kernel] == whole.resources[kernel]
            alone[kernel] = program
    assert set(alone) == set(names)


def test_a_plan_compiles_in_a_few_seconds_not_every_kernel(capsys):
    # the kernels of a bf16 32/8/128 decode and of a head_dim-96 one (CUDA cores), with
    # their combine: what a first decode of each compiles
    for kernels in (
        ("gqa_split_mma_bf16_d128", "gqa_split_combine_bf16"),
        ("gqa_split_bf16_g4_vec", "gqa_split_combine_bf16"),
        ("gqa_split_tc32_f32_d128", "gqa_split_combine_f32"),
    ):
        seconds = sum(_selected(name)[2] for name in kernels)
        with capsys.disabled():
            print(f"\n{' + '.join(kernels)} for {ARCH}: {seconds:.2f} s on {os.cpu_count()} CPUs")
        assert seconds > 0


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
def test_padded_head_dims_compile_without_stack_or_spills(arch):
    # one per kernel head_dim they pad to, both 16-bit types across the three
    for name in (
        "gqa_split_mma_bf16_d64_r40",
        "gqa_split_mma_f16_d128_r96_cluster",
        "gqa_split_mma_bf16_d128_r72",
        "gqa_split_mma_f16_d128_r80_cluster",  # a ring depth of its own (FX_STAGES_D128_R80)
        "gqa_split_mma_f16_d256_r160_cluster",  # loops at its own columns (FX_TRIM_D256_R160)
        "gqa_split_mma_bf16_d256_r248_cluster",
        "gqa_split_mma_bf16_d128_t2_cluster",  # groups of 9-16, in two tiles of 8 heads
        "gqa_split_mma_f16_d256_t2",
        "gqa_split_mma_bf16_d64_r40_t2",
        "gqa_split_mma_bf16_d128_r80_p2",  # two KV heads' rows as one (paired)
        "gqa_split_mma_f16_d64_r64_p2_t2",
        "gqa_split_mma_bf16_d256_r256_p2",
    ):
        source = f"#define FX_SELECTED 1\n{kernel_source(attention.SPLIT_FILE)}\n"
        program = compile_source(source + attention.split_entry(name) + "\n", arch=arch)
        for kernel in (name, name.removesuffix("_cluster")):
            res = program.resources[kernel]
            assert (res.stack_bytes, res.spill_stores, res.spill_loads) == (0, 0, 0), (kernel, res)


def test_a_padded_kernel_is_named_for_its_call():
    assert attention.mma_head_dim(96) == 128 and attention.mma_head_dim(40) == 64
    assert attention.mma_head_dim(200) == 256 and attention.mma_head_dim(128) == 128
    assert attention.mma_head_dim(100) is None and attention.mma_head_dim(7) is None
    assert (
        attention.split_entry("gqa_split_mma_bf16_d128_r96")
        == "FX_MMA_PAD_ENTRY(gqa_split_mma_bf16_d128_r96, fx_bf16, 128, 96)"
        == attention.split_entry("gqa_split_mma_bf16_d128_r96_cluster")  # with its twin
    )
    assert (
        attention.split_entry("gqa_split_mma_f16_d128_r96_t2_cluster")
        == "FX_MMA_TILED_ENTRY(gqa_split_mma_f16_d128_r96_t2, fx_half, 128, 96)"
    )


@pytest.mark.parametrize(
    "bad",
    ["gqa_split_mma_bf16", "gqa_split_fp8_g4_vec", "nope", "", "gqa_split_mma_bf16_d128_r100",
     "gqa_split_mma_bf16_d128_r128", "gqa_split_mma_bf16_d96_r80", "gqa_split_mma_f32_d128_r96",
     "gqa_split_mma_bf16_d128_r72_wide_cluster", "gqa_split_mma_bf16_d128_wide",
     "gqa_split_mma_bf16_d128_r128_t2", "gqa_split_mma_f32_d128_t2", "gqa_split_mma_bf16_d96_t2",
     "gqa_split_mma_bf16_d128_t3", "gqa_split_mma_bf16_d128_wide_t2"],
)  # fmt: skip
def test_a_name_no_kernel_has_is_refused(bad):
    with pytest.raises(ValueError, match="has no kernel"):
        attention.split_entry(bad)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
def test_feature_kernels_compile_without_stack_or_spills(arch):
    # every family with every feature (x63), and with head-major K/V too (x127), and the
    # combine kernel with those it applies
    for name in (
        "gqa_split_mma_bf16_d128_x127",
        "gqa_split_mma_f16_d256_x127_cluster",
        "gqa_split_tc32_f32_d256_x127",
        "gqa_split_bf16_g4_any_x127",
        "gqa_split_mma_bf16_d128_x63",
        "gqa_split_mma_f16_d256_x63",
        "gqa_split_mma_bf16_d128_r80_t2_x63",
        "gqa_split_tc32_f32_d256_x63",
        "gqa_split_f32_g8_vec_x63",
        "gqa_split_bf16_g4_any_x63",
        "gqa_split_combine_f32_x25",
        "gqa_split_mma_bf16_d128_wide_x63_cluster",
        "gqa_split_mma_f16_d256_x63_cluster",
    ):
        source = f"#define FX_SELECTED 1\n{kernel_source(attention.SPLIT_FILE)}\n"
        program = compile_source(source + attention.split_entry(name) + "\n", arch=arch)
        res = program.resources[name]
        assert (res.stack_bytes, res.spill_stores, res.spill_loads) == (0, 0, 0), (name, res)
