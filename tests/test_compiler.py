"""NVRTC compilation, with no GPU needed."""

from __future__ import annotations

import pytest

import ferrox_driver as fd
from ferrox_driver import module_cache
from ferrox_driver.compiler import kernel_source, parse_resources

ARCHS = ["sm_80", "sm_90", "sm_100"]
KERNEL_FILES = ["gqa_decode.cu", "gqa_decode_split.cu", "kv_cache.cu", "util.cu"]


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
