"""NVRTC compilation, with no GPU needed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import ferrox_driver as fd
from ferrox_driver.driver import module_cache
from ferrox_driver.driver.compiler import expand_includes, parse_resources, source_dir
from ferrox_driver.kernels.catalogue import kernel_source
from ferrox_driver.kernels.traits import GENERATED_PARTS

ARCHS = ["sm_80", "sm_90", "sm_100"]
KERNEL_FILES = ["gqa_decode.cu", "gqa_decode_split.cu", "kv_cache.cu", "util.cu", "merge_states.cu"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", KERNEL_FILES)
def test_every_kernel_file_compiles_for_arch_without_gpu(filename: str, arch: str) -> None:
    program = module_cache.get_program(kernel_source(filename), arch=arch, name=filename)
    assert program.arch == arch
    assert program.cubin[:4] == b"\x7fELF"
    assert program.resources, program.log


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "filename,expected",
    [
        ("gqa_decode.cu", {"gqa_decode_f32", "gqa_decode_f16", "gqa_decode_bf16"}),
        (
            "gqa_decode_split.cu",
            {"gqa_split_f32_g8_vec", "gqa_split_mma_bf16_d128", "gqa_split_combine_f16"},
        ),
        ("kv_cache.cu", {"kv_append_row"}),
        ("merge_states.cu", {"merge_states_f32", "merge_states_f16", "merge_states_bf16"}),
    ],
)
def test_decode_kernels_use_no_stack_and_never_spill(arch, filename, expected) -> None:
    program = module_cache.get_program(kernel_source(filename), arch=arch, name=filename)
    assert expected <= set(program.resources)
    for name, r in program.resources.items():
        assert (r.stack_bytes, r.spill_stores, r.spill_loads) == (0, 0, 0), (name, r)
        assert 0 < r.registers <= 255


def test_resource_report_reads_registers_stack_spills_and_shared_memory() -> None:
    src = """
    extern "C" __global__ void uses_smem(float* x) {
        __shared__ float tile[256];
        tile[threadIdx.x] = x[threadIdx.x];
        __syncthreads();
        x[threadIdx.x] = tile[255 - threadIdx.x];
    }
    extern "C" __global__ void uses_stack(float* x, int i) {
        float a[64] = {};
        for (int j = 0; j < 64; ++j) a[(j * i) & 63] += x[j];
        x[0] = a[i & 63] + a[(i + 1) & 63];
    }
    """
    res = fd.compile_source(src, arch="sm_90").resources
    assert res["uses_smem"].shared_bytes == 1024
    assert res["uses_smem"].stack_bytes == 0
    assert res["uses_stack"].stack_bytes >= 256


def test_parse_resources_reads_a_ptxas_report() -> None:
    log = """ptxas info    : Compiling entry function 'k' for 'sm_90'
ptxas info    : Function properties for k
ptxas         .     32 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 2048 bytes smem, 380 bytes cmem[0]
"""
    assert parse_resources(log) == {
        "k": fd.KernelResources(
            registers=40, stack_bytes=32, spill_stores=8, spill_loads=4, shared_bytes=2048
        )
    }


def test_prelude_defines_infinity_so_the_seed_kernel_idiom_compiles() -> None:
    src = 'extern "C" __global__ void k(float* x) { x[0] = -INFINITY; x[1] = NAN; }'
    assert fd.compile_source(src, arch="sm_90").cubin


def test_compile_error_carries_the_nvrtc_log_and_options() -> None:
    src = 'extern "C" __global__ void broken(float* x) { x[0] = undefined_name; }'
    with pytest.raises(fd.CompileError) as info:
        fd.compile_source(src, arch="sm_90", options=("-DFOO=1",), name="broken.cu")
    err = info.value
    assert "undefined_name" in err.log
    assert "broken.cu" in err.log
    assert "-DFOO=1" in err.options
    assert err.source_name == "broken.cu"
    assert "undefined_name" in str(err)


def test_split_kernel_file_is_compiled_with_its_parts_in_place() -> None:
    src = kernel_source("gqa_decode_split.cu")
    assert not re.search(r"^#include", src, re.M)
    for part in sorted(source_dir().glob("split_*.cuh")):
        assert f'#line 1 "{part.name}"' in src
        assert part.read_text().strip() in src


def test_compile_error_in_an_included_part_names_the_part_and_its_line(tmp_path: Path) -> None:
    (tmp_path / "main.cu").write_text('// main\n#include "part.cuh"\nMAIN_ERROR;\n')
    (tmp_path / "part.cuh").write_text("// part\n\nPART_ERROR;\n")
    src = expand_includes("main.cu", tmp_path)
    with pytest.raises(fd.CompileError) as info:
        fd.compile_source(src, arch="sm_90", name="main.cu")
    log = info.value.log
    assert re.search(r"part\.cuh\(3\): error", log), log
    assert re.search(r"main\.cu\(3\): error", log), log


def test_each_part_is_included_once(tmp_path: Path) -> None:
    (tmp_path / "main.cu").write_text('#include "a.cuh"\n#include "b.cuh"\n')
    (tmp_path / "a.cuh").write_text('#include "b.cuh"\nint a;\n')
    (tmp_path / "b.cuh").write_text("int b;\n")
    src = expand_includes("main.cu", tmp_path)
    assert src.count("int b;") == 1
    assert src.index("int b;") < src.index("int a;")


def test_the_generated_parts_come_from_the_parts_given(tmp_path: Path) -> None:
    # the host writes split_traits.h (kernels.traits); the driver's expander knows no kernel
    # parts of its own: the catalogue gives them, and a revision's own writer may be given
    (tmp_path / "main.cu").write_text('#include "split_traits.h"\nint main_part;\n')
    with pytest.raises(FileNotFoundError, match="split_traits"):
        expand_includes("main.cu", tmp_path)
    assert "#define FX_THREADS " in expand_includes("main.cu", tmp_path, GENERATED_PARTS)
    src = expand_includes("main.cu", tmp_path, {"split_traits.h": lambda: "#define OLD 1\n"})
    assert "#define OLD 1" in src and "FX_THREADS" not in src and "int main_part;" in src


def test_include_of_a_missing_part_names_both_files(tmp_path: Path) -> None:
    (tmp_path / "main.cu").write_text('#include "gone.cuh"\n')
    with pytest.raises(FileNotFoundError, match=r"main\.cu includes 'gone\.cuh'"):
        expand_includes("main.cu", tmp_path)


def test_options_reach_the_compiler() -> None:
    src = 'extern "C" __global__ void k(float* x) { x[0] = VALUE; }'
    with pytest.raises(fd.CompileError):
        fd.compile_source(src, arch="sm_90")
    assert fd.compile_source(src, arch="sm_90", options=("-DVALUE=1.0f",)).cubin


@pytest.mark.parametrize("arch", ["sm90", "90", "compute_90", "", "gfx90a"])
def test_bad_arch_is_a_value_error_naming_arch(arch: str) -> None:
    with pytest.raises(ValueError, match="arch"):
        fd.compile_source("", arch=arch)


def test_options_must_be_a_sequence_of_strings() -> None:
    with pytest.raises(TypeError, match="options"):
        fd.compile_source("", arch="sm_90", options="-DX=1")  # type: ignore[arg-type]
