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
from ferrox_driver.kernels.spec import SPLIT_FILE, KernelSpec

from ..helpers.kernel_names import whole_file

M, G, T, C = "mma", "generic", "tc32", "combine"

ARCH = "sm_90"


def _selected(spec: KernelSpec):
    source = f"#define FX_SELECTED 1\n{kernel_source(SPLIT_FILE)}\n"
    source += spec.entry + "\n"
    started = time.perf_counter()
    program = compile_source(source, arch=ARCH, name=SPLIT_FILE)
    return spec, program, time.perf_counter() - started


@pytest.fixture(scope="module")
def whole():
    return compile_source(kernel_source(SPLIT_FILE), arch=ARCH)


def test_every_kernel_compiled_alone_has_the_machine_code_it_has_among_all(whole):
    names = sorted(whole.resources)
    specs = {spec.name: spec for spec in whole_file()}
    assert sorted(specs) == names  # the file's kernels, as specs name them
    entries = {}  # one compile per entry line (an mma entry makes a kernel and its _cluster)
    for spec in specs.values():
        entries.setdefault(spec.entry, spec)
    with ProcessPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        done = list(pool.map(_selected, entries.values()))
    alone: dict[str, object] = {}
    every = whole.sections()
    for spec, program, _ in done:
        assert set(program.resources) == {n for n in names if specs[n].entry == spec.entry}
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
        (KernelSpec(M, "bf16", 128), KernelSpec(C, "bf16")),
        (KernelSpec(G, "bf16", heads_per_block=4, vec=True), KernelSpec(C, "bf16")),
        (KernelSpec(T, "f32", 128), KernelSpec(C, "f32")),
    ):
        seconds = sum(_selected(spec)[2] for spec in kernels)
        names = " + ".join(spec.name for spec in kernels)
        with capsys.disabled():
            print(f"\n{names} for {ARCH}: {seconds:.2f} s on {os.cpu_count()} CPUs")
        assert seconds > 0


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
def test_padded_head_dims_compile_without_stack_or_spills(arch):
    # one per kernel head_dim they pad to, both 16-bit types across the three
    for spec in (
        KernelSpec(M, "bf16", 64, 40),
        KernelSpec(M, "f16", 128, 96, cluster=True),
        KernelSpec(M, "bf16", 128, 72),
        KernelSpec(M, "f16", 128, 80, cluster=True),  # a ring depth of its own (FX_STAGES_D128_R80)
        KernelSpec(M, "f16", 256, 160, cluster=True),  # its own columns (FX_TRIM_D256_R160)
        KernelSpec(M, "bf16", 256, 248, cluster=True),
        KernelSpec(M, "bf16", 128, tiles=2, cluster=True),  # groups of 9-16, two tiles of 8
        KernelSpec(M, "f16", 256, tiles=2),
        KernelSpec(M, "bf16", 64, 40, tiles=2),
        KernelSpec(M, "bf16", 128, 80, paired=True),  # two KV heads' rows as one (paired)
        KernelSpec(M, "f16", 64, 64, tiles=2, paired=True),
        KernelSpec(M, "bf16", 256, 256, paired=True),
    ):
        source = f"#define FX_SELECTED 1\n{kernel_source(SPLIT_FILE)}\n"
        program = compile_source(source + spec.entry + "\n", arch=arch)
        for kernel in (spec.name, spec.but(cluster=False).name):
            res = program.resources[kernel]
            assert (res.stack_bytes, res.spill_stores, res.spill_loads) == (0, 0, 0), (kernel, res)


def test_a_padded_kernel_is_named_for_its_call():
    assert attention.mma_head_dim(96) == 128 and attention.mma_head_dim(40) == 64
    assert attention.mma_head_dim(200) == 256 and attention.mma_head_dim(128) == 128
    assert attention.mma_head_dim(100) is None and attention.mma_head_dim(7) is None
    padded = KernelSpec(M, "bf16", 128, 96)
    assert padded.name == "gqa_split_mma_bf16_d128_r96"
    assert (
        padded.entry
        == "FX_MMA_PAD_ENTRY(gqa_split_mma_bf16_d128_r96, fx_bf16, 128, 96)"
        == padded.but(cluster=True).entry  # with its twin
    )
    tiled = KernelSpec(M, "f16", 128, 96, tiles=2, cluster=True)
    assert tiled.name == "gqa_split_mma_f16_d128_r96_t2_cluster"
    assert tiled.entry == "FX_MMA_TILED_ENTRY(gqa_split_mma_f16_d128_r96_t2, fx_half, 128, 96)"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
def test_feature_kernels_compile_without_stack_or_spills(arch):
    # every family with every feature (x63), and with head-major K/V too (x127), and the
    # combine kernel with those it applies
    for spec in (
        KernelSpec(M, "bf16", 128, features=127),
        KernelSpec(M, "f16", 256, features=127, cluster=True),
        KernelSpec(T, "f32", 256, features=127),
        KernelSpec(G, "bf16", heads_per_block=4, features=127),
        KernelSpec(M, "bf16", 128, features=63),
        KernelSpec(M, "f16", 256, features=63),
        KernelSpec(M, "bf16", 128, 80, tiles=2, features=63),
        KernelSpec(T, "f32", 256, features=63),
        KernelSpec(G, "f32", heads_per_block=8, vec=True, features=63),
        KernelSpec(G, "bf16", heads_per_block=4, features=63),
        KernelSpec(C, "f32", features=25),
        KernelSpec(M, "bf16", 128, wide=True, features=63, cluster=True),
        KernelSpec(M, "f16", 256, features=63, cluster=True),
    ):
        source = f"#define FX_SELECTED 1\n{kernel_source(SPLIT_FILE)}\n"
        program = compile_source(source + spec.entry + "\n", arch=arch)
        res = program.resources[spec.name]
        assert (res.stack_bytes, res.spill_stores, res.spill_loads) == (0, 0, 0), (spec, res)
