"""Every supported architecture's plans fit it: the benchmark shapes planned with each
architecture's hand-made traits (ferrox_driver.archs), the kernels the plans pick compiled
for that architecture (NVRTC, no GPU), and each launch checked against its limits: shared
memory within a block's opt-in limit, registers within a thread's and a multiprocessor's,
no spills, no stack. Turing (sm_75) takes the CUDA-core kernels only."""

from __future__ import annotations

import dataclasses
import os
import pickle
import resource
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver import archs
from ferrox_driver.decode import launches
from ferrox_driver.decode import plan as attention
from ferrox_driver.driver import device as device_module
from ferrox_driver.driver.compiler import KernelResources, compile_source, nvrtc_archs
from ferrox_driver.driver.module_cache import get_program
from ferrox_driver.errors import CompileError
from ferrox_driver.kernels.catalogue import kernel_source
from ferrox_driver.kernels.spec import SPLIT_FILE, KernelSpec
from ferrox_driver.kernels.traits import F_LSE

from ..helpers.gpu_helpers import DTYPES, TOL, poisoned, random_decode_inputs, rel_err

BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
SHAPES = [(32, 8, 128), (28, 4, 128), (32, 4, 128), (16, 2, 64), (8, 1, 256), (64, 8, 128)]
SEQS = [512 * 2**i for i in range(9)]  # 512 .. 131072
# head_dims 1..256: odd ones, multiples of 8 padded to each tensor-core kernel (and their
# pairs), the kernels' own, the trimmed ones (160, 192); compiled for sm_75 (every dtype) and
# for the tightest tensor-core architecture, sm_86 (bf16); planned for all (the arithmetic
# test below covers every head_dim)
HEAD_DIMS = (1, 7, 8, 24, 40, 56, 64, 72, 80, 96, 100, 112, 128, 136, 160, 192, 200, 248, 256)
HEAD_DIM_ARCHS = {"sm_75": (BF16, F16, F32), "sm_86": (BF16,)}
# fp8 caches: each format with one q dtype, on a GPU of 99 KiB and one of 227 KiB each
FP8 = {"sm_89": (BF16, "e4m3"), "sm_90": (F16, "e5m2"), "sm_100": (BF16, "e4m3"),
       "sm_120": (F16, "e5m2")}  # fmt: skip
KiB = 1024


def _estimate(kernel: str) -> KernelResources:
    """Resources to plan with before anything is compiled (the set of kernels a plan picks
    does not hang on them: the compiled ones replan below)."""
    return KernelResources(registers=128, shared_bytes=4096)


def plans(traits: attention.DeviceTraits) -> Iterator[tuple[str, np.dtype, int, object]]:
    """(what, q dtype, head_dim, the plan or the ValueError refusing it) over the benchmark
    shapes at every length in every dtype, the head_dim sample (HEAD_DIM_ARCHS) and an
    fp8 cache (FP8) on the architectures that have them."""
    for dtype in (BF16, F16, F32):
        for shape in SHAPES:
            for seq in SEQS:
                what = f"{dtype} {'/'.join(map(str, shape))} at {seq}"
                yield what, dtype, shape[2], attention.plan(traits, dtype, *shape, seq)
    for dtype in HEAD_DIM_ARCHS.get(traits.arch, ()):
        for head_dim in HEAD_DIMS:
            for seq in (4096, 131072):
                what = f"{dtype} 32/8/{head_dim} at {seq}"
                yield what, dtype, head_dim, attention.plan(traits, dtype, 32, 8, head_dim, seq)
        if traits.arch == "sm_75":  # every feature, and head-major K and V (the CUDA cores')
            for bits in (63, 127):
                what = f"{dtype} 32/8/128 at 4096 with features {bits}"
                found = attention.plan(traits, dtype, 32, 8, 128, 4096, features=bits)
                yield what, dtype, 128, found
    if traits.arch in FP8:
        dtype, fmt = FP8[traits.arch]
        for shape in SHAPES:
            for seq in (512, 8192, 131072):
                what = f"{fmt} cache, {dtype} q, {'/'.join(map(str, shape))} at {seq}"
                try:
                    found: object = attention.plan(traits, dtype, *shape, seq, fp8=fmt)
                except ValueError as exc:
                    found = exc
                yield what, dtype, shape[2], found


def _kernels(plan: attention.SplitPlan, dtype: np.dtype) -> list[KernelSpec]:
    combine = plan.combine_spec(dtype)
    return [plan.spec, *([combine] if combine else [])]


def _static_bound(p: attention.SplitPlan, dtype: np.dtype, head_dim: int) -> int:
    table = attention.TC32_STATIC_SHARED if dtype == F32 else attention.MMA_STATIC_SHARED
    return table[p.kernel_head_dim or head_dim]


# the other kernel files a decode, a cache, a merge of states or the benchmark may load (not
# kv_quantize.cu: fp8 caches, sm_89 and newer, planned above)
OTHER_FILES = ("gqa_decode.cu", "kv_cache.cu", "merge_states.cu", "util.cu")


def _compile(
    arch: str, kernels: list[KernelSpec] | list[str]
) -> tuple[str, dict[str, KernelResources], float]:
    started = time.perf_counter()
    first = kernels[0]
    if isinstance(first, str):  # one of OTHER_FILES
        resources = get_program(kernel_source(first), arch=arch, name=first).resources
    else:
        resources = launches.split_program(kernels, arch).resources  # type: ignore[arg-type]
    return arch, resources, time.perf_counter() - started


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, KernelResources]]:
    """Every kernel the plans pick, per architecture, compiled once for it (in batches of
    entries over the CPUs: about a minute on two)."""
    jobs: list[tuple[str, list[KernelSpec] | list[str]]] = []
    for arch in archs.ARCHS:
        entries: dict[str, KernelSpec] = {}
        for _what, dtype, _d, p in plans(launches.arch_traits(arch, _estimate)):
            if isinstance(p, attention.SplitPlan):
                for spec in _kernels(p, dtype):
                    entries.setdefault(spec.entry, spec)
        specs = sorted(entries.values(), key=lambda spec: spec.name)
        jobs += [(arch, specs[i : i + 6]) for i in range(0, len(specs), 6)]
        jobs += [(arch, [filename]) for filename in OTHER_FILES]
    started, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
    found: dict[str, dict[str, KernelResources]] = {arch: {} for arch in archs.ARCHS}
    with ProcessPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        for arch, resources, _ in pool.map(_compile, *zip(*jobs, strict=True)):
            found[arch].update(resources)
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - cpu
    print(f"\ncompiled {sum(map(len, found.values()))} kernels for {len(found)} architectures "
          f"in {time.perf_counter() - started:.0f} s ({cpu:.0f} CPU s) on {os.cpu_count()} "
          f"CPUs")  # fmt: skip
    return found


@pytest.mark.parametrize("arch", list(archs.ARCHS))
def test_every_plan_fits_its_architecture(compiled, arch):
    limits = archs.ARCHS[arch]
    resources = compiled[arch]
    traits = launches.arch_traits(arch, resources.__getitem__)
    checked = 0
    for what, dtype, head_dim, p in plans(traits):
        if isinstance(p, ValueError):
            # refused only where its ring cannot fit: head_dim 256 on 99 KiB per block
            assert head_dim == 256 and limits.shared_per_block < 128 * KiB, (what, p)
            assert "shared memory per block" in str(p), p
            continue
        assert isinstance(p, attention.SplitPlan)
        at = f"{arch}: {what}: {p.kernel}"
        assert p.tensor_cores == p.kernel.startswith(("gqa_split_mma_", "gqa_split_tc32_")), at
        assert p.spec.cluster == bool(p.cluster), at
        assert limits.tensor_cores or not p.tensor_cores, at
        assert p.cluster <= limits.max_cluster and (p.cluster == 0) == (
            not p.kernel.endswith("_cluster")
        ), at
        for spec in _kernels(p, dtype):
            name = spec.name
            r = resources[name]
            split = spec == p.spec
            threads = p.threads if split else attention.COMBINE_THREADS
            dynamic = p.shared_bytes(head_dim, dtype.itemsize) if split else 0
            assert (r.stack_bytes, r.spill_stores, r.spill_loads) == (0, 0, 0), (at, name, r)
            assert 0 < r.registers <= 255, (at, name, r)
            assert r.registers * threads <= limits.registers_per_sm, (at, name, r)
            assert dynamic + r.shared_bytes <= limits.shared_per_block, (at, name, dynamic, r)
            assert archs.occupancy(limits, threads, dynamic, r.registers, r.shared_bytes) >= 1
            if split and p.tensor_cores:  # the planner's static bound holds
                table = (
                    attention.TC32_STATIC_SHARED if dtype == F32 else attention.MMA_STATIC_SHARED
                )
                assert r.shared_bytes <= table[p.kernel_head_dim or head_dim], (at, r)
            checked += 1
    assert checked > 300
    others = {n: r for n, r in resources.items() if not n.startswith("gqa_split_")}
    assert {"gqa_decode_bf16", "kv_append_row", "merge_states_f32"} <= set(others), others
    for name, r in others.items():  # (small blocks, at most 1024 threads)
        assert (r.stack_bytes, r.spill_stores, r.spill_loads) == (0, 0, 0), (arch, name, r)
        # (the parity kernel's _d512 twins hold 16 elements a lane of q and the accumulator)
        most = 128 if name.endswith("_d512") else 64
        assert 0 < r.registers <= most and r.shared_bytes <= 48 * KiB, (arch, name, r)


def test_turing_runs_the_cuda_core_kernels_and_the_tensor_core_ones_do_not_compile_there(
    compiled,
):
    # the planner picks none of the tensor-core kernels for sm_75 (cp.async and the bf16
    # and TF32 mma need sm_80): they would not compile
    names = {n for n in compiled["sm_75"] if n.startswith("gqa_split_")}
    cuda_cores = ("gqa_split_f32_g", "gqa_split_f16_g", "gqa_split_bf16_g", "gqa_split_combine_")
    assert names and all(n.startswith(cuda_cores) for n in names), names
    source = f"#define FX_SELECTED 1\n{kernel_source(SPLIT_FILE)}\n"
    source += KernelSpec("mma", "f16", 128).entry + "\n"
    with pytest.raises(CompileError, match=r"cp\.async.* requires .target sm_80"):
        compile_source(source, arch="sm_75")


def _fake_traits(arch: str) -> attention.DeviceTraits:
    return launches.arch_traits(arch, _estimate)


@pytest.mark.parametrize("arch", list(archs.ARCHS))
def test_the_plans_shared_memory_fits_at_every_head_dim_group_and_feature(arch):
    """The planner's own arithmetic, every head_dim 1..256 (no compile): a launch's dynamic
    shared memory and its kernel's static bound within the block's limit."""
    limits, traits = archs.ARCHS[arch], _fake_traits(arch)
    for dtype in (BF16, F16, F32):
        for head_dim in range(1, 257):
            for heads in ((8, 8), (32, 8), (16, 1), (17, 1)):
                for seq, features in ((512, 0), (131072, 0), (4096, F_LSE)):
                    p = attention.plan(traits, dtype, *heads, head_dim, seq, features=features)
                    if not p.tensor_cores:
                        continue
                    table = (
                        attention.TC32_STATIC_SHARED
                        if dtype == F32
                        else attention.MMA_STATIC_SHARED
                    )
                    static = table[p.kernel_head_dim or head_dim]
                    used = p.shared_bytes(head_dim, dtype.itemsize) + static
                    assert used <= limits.shared_per_block, (arch, dtype, head_dim, heads, p)
                    assert p.stages <= max(p.stages, p.reserve_stages)


def _plan(arch: str, dtype: np.dtype, shape: tuple[int, int, int], seq: int, **kw):
    return attention.plan(_fake_traits(arch), dtype, *shape, seq, **kw)


def test_gpus_of_99_kib_per_block_take_cuda_cores_where_a_ring_does_not_fit():
    for arch in ("sm_86", "sm_89", "sm_120"):
        # head_dim 256: 4 warps x 3 steps x 16 tokens x (K, V) x 256 x 2 bytes = 192 KiB
        assert _plan(arch, BF16, (8, 1, 256), 4096).kernel == "gqa_split_bf16_g4_vec"
        assert _plan(arch, BF16, (32, 8, 200), 4096).kernel == "gqa_split_bf16_g4_vec"
        # fp32 on tensor cores: 8 warps x 2 steps x 16 x 2 x 64 x 4 bytes = 128 KiB
        assert _plan(arch, F32, (16, 2, 64), 4096).kernel == "gqa_split_f32_g4_vec"
        # head_dim 128: the 64 KiB ring fits; of the 4 steps (128 KiB) the H200 reserves, 3
        # (96 KiB and 3 KiB of static shared memory at most: 99 KiB)
        p = _plan(arch, BF16, (32, 8, 128), 4096)
        assert p.kernel.startswith("gqa_split_mma_bf16_d128") and not p.kernel.endswith("wide")
        assert (p.stages, p.reserve_stages, p.shared_bytes(128, 2)) == (2, 3, 96 * KiB)
        # head_dim 64: a 96 KiB ring (8 warps x 3 steps), with 1920 bytes of Q and merge
        assert _plan(arch, F16, (16, 2, 64), 4096).shared_bytes(64, 2) == 96 * KiB
    # an fp8 cache of head_dim 256 there: refused, saying why
    with pytest.raises(ValueError, match="shared memory per block: on GPUs of 99 KiB"):
        _plan("sm_89", BF16, (8, 1, 256), 4096, fp8="e4m3")


def test_a100_keeps_tensor_cores_within_163_kib():
    # the 192 KiB head_dim-256 ring does not fit; the fp32 kernels' 128 KiB rings do, their
    # 3 reserved steps (192 KiB) do not
    assert _plan("sm_80", BF16, (8, 1, 256), 4096).kernel == "gqa_split_bf16_g4_vec"
    p = _plan("sm_80", F32, (32, 8, 128), 4096)
    assert p.kernel == "gqa_split_tc32_f32_d128" and (p.stages, p.reserve_stages) == (2, 2)
    p = _plan("sm_80", BF16, (32, 8, 128), 4096)  # the H200's reserve of 4 steps: 128 KiB
    assert (p.kernel, p.reserve_stages, p.cluster) == ("gqa_split_mma_bf16_d128", 4, 0)
    assert p.splits == 13  # one wave: 108 SMs of one block over 8 KV heads


def test_clusters_only_where_the_architecture_has_them_and_the_receive_area_fits():
    assert _plan("sm_90", BF16, (32, 8, 128), 4096).kernel.endswith("_wide_cluster")
    assert _plan("sm_100", BF16, (32, 8, 128), 4096).kernel.endswith("_wide_cluster")
    # the wide ring (8 warps x 2 steps, 128 KiB) does not fit 99 KiB
    sm120 = _plan("sm_120", BF16, (32, 8, 128), 4096)
    assert not sm120.kernel.endswith("wide_cluster"), sm120
    assert _plan("sm_120", BF16, (32, 8, 128), 512).cluster == 8  # 64 KiB ring + receive area
    for arch in ("sm_75", "sm_80", "sm_86", "sm_89"):
        assert _plan(arch, BF16, (32, 8, 128), 512).cluster == 0, arch


def test_fp8_caches_need_compute_capability_8_9():
    for arch in ("sm_75", "sm_80", "sm_86"):
        with pytest.raises(ValueError, match=r"fp8 caches need compute capability 8\.9"):
            _plan(arch, BF16, (32, 8, 128), 4096, fp8="e4m3")
    assert _plan("sm_89", BF16, (32, 8, 128), 4096, fp8="e4m3").fp8 == "e4m3"


@pytest.mark.parametrize(
    "arch,threads,dynamic,registers,static,blocks",
    [
        ("sm_86", 128, 0, 130, 20480, 3),  # registers: 17 x 256 per warp, 3 of 4 blocks
        ("sm_90", 128, 0, 64, 0, 8),  # registers: 8 blocks of 8192
        ("sm_90", 128, 131072, 130, 2560, 1),  # shared memory: one block
        ("sm_80", 256, 98304, 110, 1920, 1),  # one 97.9 KiB block of 164 KiB
        ("sm_75", 128, 0, 32, 5120, 8),  # threads: 1024 a multiprocessor
        ("sm_86", 128, 101376 - 1919, 110, 1920, 0),  # one byte past the opt-in limit
        ("sm_90", 32, 0, 16, 0, 32),  # blocks: at most 32
    ],
)
def test_occupancy_counts_as_the_cuda_occupancy_calculator(
    arch, threads, dynamic, registers, static, blocks
):
    limits = archs.ARCHS[arch]
    assert archs.occupancy(limits, threads, dynamic, registers, static) == blocks


def test_the_table_holds_the_documented_gpus():
    table = {a.arch: a for a in archs.ARCHS.values()}
    assert archs.MIN_COMPUTE_CAPABILITY == (7, 5)
    expected = {  # multiprocessors, opt-in KiB per block, L2 MiB of the GPU named
        "sm_75": (40, 64, 4), "sm_80": (108, 163, 40), "sm_86": (82, 99, 6),
        "sm_89": (128, 99, 72), "sm_90": (132, 227, 60), "sm_100": (148, 227, 126),
        "sm_120": (170, 99, 96),
    }  # fmt: skip
    got = {
        arch: (a.multiprocessor_count, a.shared_per_block // KiB, a.l2_bytes // 2**20)
        for arch, a in table.items()
    }
    assert got == expected
    assert [a for a, t in table.items() if t.max_cluster] == ["sm_90", "sm_100", "sm_120"]
    with pytest.raises(ValueError, match="arch: expected one of sm_75, sm_80"):
        archs.arch_limits("sm_70")


class _Retained(Exception):
    """The fake driver was asked to retain the primary context."""


def _fake_driver(monkeypatch, cc: tuple[int, int], calls: list[str]) -> None:
    a = device_module.cu.CUdevice_attribute
    values = {
        a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: cc[0],
        a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: cc[1],
    }

    def drv(call, *args):
        calls.append(call)
        if call == "cuDeviceGet":
            return 0
        if call == "cuDeviceGetName":
            return b"Tesla V100-SXM2-16GB\0\0\0"
        if call == "cuDeviceGetAttribute":
            return values[args[0]]
        raise _Retained(call)

    monkeypatch.setattr(device_module, "drv", drv)
    monkeypatch.setattr(device_module, "device_count", lambda: 1)


def test_a_gpu_older_than_turing_is_refused_in_one_sentence_before_its_context(monkeypatch):
    calls: list[str] = []
    _fake_driver(monkeypatch, (7, 0), calls)
    with pytest.raises(fd.UnsupportedDeviceError) as exc:
        fd.Device(0)
    assert str(exc.value) == (
        "device 0 (Tesla V100-SXM2-16GB) has compute capability 7.0, and ferrox_driver needs "
        "7.5 or newer (Turing or later: T4, RTX 20xx, A100, RTX 30xx-50xx, L4/L40S, "
        "H100/H200, B200)"
    )
    assert isinstance(exc.value, fd.NoDeviceError)  # a CPU fallback catches it
    assert "cuDevicePrimaryCtxRetain" not in calls
    again = pickle.loads(pickle.dumps(exc.value))
    assert (again.ordinal, again.compute_capability, again.minimum) == (0, (7, 0), (7, 5))
    assert str(again) == str(exc.value)


def test_turing_and_newer_open(monkeypatch):
    for cc in ((7, 5), (8, 6), (12, 1)):
        calls: list[str] = []
        _fake_driver(monkeypatch, cc, calls)
        with pytest.raises(_Retained):  # past the check: the context is next
            fd.Device(0)
        assert calls[-1] == "cuDevicePrimaryCtxRetain", calls


@pytest.mark.parametrize("arch", ["sm_30", "sm_999", "below this NVRTC's oldest"])
def test_an_architecture_nvrtc_does_not_compile_for_is_one_line_naming_those_it_does(arch):
    # (NVRTC 13 dropped sm_50..sm_72, which 12.x still compiles: CI runs both)
    if arch.startswith("below"):
        arch = f"sm_{min(nvrtc_archs()) - 1}"
    with pytest.raises(ValueError) as exc:
        compile_source('extern "C" __global__ void k() {}', arch=arch)
    text = str(exc.value)
    assert text.startswith("arch: NVRTC ") and text.endswith(f"got {arch!r}"), text
    assert "sm_75" in text and "sm_90" in text and "\n" not in text


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_86", "sm_120"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim,seq_len",
    [(8, 1, 256, 5003), (32, 8, 128, 4096), (16, 2, 64, 777), (32, 8, 80, 20001),
     (28, 4, 128, 512), (16, 1, 200, 3000)],
)  # fmt: skip
def test_another_architectures_plans_compute_the_decode_on_this_gpu(
    rng, device, arch, dtype, n_heads, n_kv_heads, head_dim, seq_len
):
    # The plans of a GPU with that architecture's shared memory per block and compute
    # capability (CUDA cores where a ring does not fit or below sm_80, reserves cut down,
    # no clusters before sm_90), with this GPU's occupancy, launched here (compiled for this
    # GPU, from the same source): each is the right decode.
    limits = archs.ARCHS[arch]
    real = launches.device_traits(device)
    cc = min(limits.compute_capability, device.compute_capability)
    if limits.max_cluster and device.compute_capability >= (9, 0):
        cc = device.compute_capability
    traits = dataclasses.replace(
        real, arch=arch, compute_capability=cc, shared_per_block=limits.shared_per_block
    )
    dt = np.dtype(DTYPES[dtype])
    plan = attention.plan(traits, dt, n_heads, n_kv_heads, head_dim, seq_len)
    if not limits.tensor_cores:
        assert not plan.tensor_cores, plan
    q, k, v = random_decode_inputs(rng, n_heads, n_kv_heads, head_dim, seq_len, dt)
    qd, kd, vd = fd.to_device(q), fd.to_device(k), fd.to_device(v)
    kw = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim}
    floats = plan.workspace_floats(n_heads, head_dim)
    ws = poisoned((floats,), np.float32) if floats else None
    out = poisoned(q.shape, q.dtype)
    for launch in launches.split_launches(
        plan, qd, kd, vd, out, ws, seq_len=seq_len, seq_len_dev=None, **kw
    ):
        launch.run(None, device)
    got = out.to_host()
    ref = fd.reference_gqa_decode(q, k, v, **kw)
    assert rel_err(got, ref) < TOL[dtype], (arch, plan)
