"""CPU checks of the split-kernel launch plan and the benchmark's bookkeeping."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import asdict

import ml_dtypes
import numpy as np
import pytest

from ferrox_driver.apps.bench import decode as bench_decode
from ferrox_driver.apps.bench import harness as bench_harness
from ferrox_driver.apps.bench import report as bench_report
from ferrox_driver.decode import launches
from ferrox_driver.decode import plan as attention
from ferrox_driver.driver import compiler
from ferrox_driver.driver.compiler import compile_source
from ferrox_driver.errors import CudaError
from ferrox_driver.kernels import traits as kernel_traits
from ferrox_driver.kernels.catalogue import kernel_source
from ferrox_driver.kernels.spec import MMA_HEAD_DIMS, SPLIT_FILE, KernelSpec

L2_BYTES = 60 * 2**20  # H200
MAX_BLOCK_SHARED = 227 * 1024  # sm_90 opt-in limit per block


def test_host_launch_constants_are_the_kernels_defines():
    src = kernel_source("gqa_decode_split.cu")
    expected = {"FX_TILE": attention.TILE, "FX_THREADS": attention.THREADS}
    expected["FX_COMBINE_THREADS"] = attention.COMBINE_THREADS
    expected["FX_MAX_SPLITS"] = attention.MAX_SPLITS
    expected["FX_MAX_CLUSTER"] = attention.MAX_CLUSTER
    for head_dim, stages in attention.MMA_STAGES.items():
        expected[f"FX_STAGES_D{head_dim}"] = stages
        expected[f"FX_WARPS_D{head_dim}"] = attention.MMA_WARPS[head_dim]
    for head_dim, stages in attention.TC32_STAGES.items():
        expected[f"FX_TC32_STAGES_D{head_dim}"] = stages
        expected[f"FX_TC32_WARPS_D{head_dim}"] = attention.TC32_WARPS[head_dim]
        expected[f"FX_TC32_TOKENS_D{head_dim}"] = attention.TC32_TOKENS[head_dim]
    for name, value in expected.items():
        found = re.findall(rf"^#define {name} (\d+)", src, re.M)
        assert found == [str(value)], f"{name}: {found} in the kernel, {value} on the host"
    # defined once, from the host's table: no part of the kernel file has its own
    parts = sorted(compiler.source_dir().glob("split_*.cuh"))
    assert parts
    for part in parts:
        for name in kernel_traits.SPLIT_TRAITS:
            assert not re.search(rf"^#define {name}\b", part.read_text(), re.M), (part, name)
    assert sorted(attention.MMA_STAGES) == sorted(attention.MMA_WARPS) == [64, 128, 256]
    assert sorted(attention.TC32_STAGES) == sorted(attention.TC32_WARPS) == [64, 128, 256]
    assert all(t in (8, 16) for t in attention.TC32_TOKENS.values())
    # a launch reserves at least its ring's steps
    for head_dim, stages in attention.MMA_STAGES.items():
        assert 2 <= stages <= attention.MMA_RESERVE_STAGES[head_dim], head_dim
    for head_dim, stages in attention.TC32_STAGES.items():
        assert 2 <= stages <= attention.TC32_RESERVE_STAGES[head_dim], head_dim


def test_a_missing_define_is_a_clear_error():
    with pytest.raises(RuntimeError, match="defines no integer FX_NOT_THERE"):
        attention.kernel_define("FX_NOT_THERE")


def test_tensor_core_kernels_fit_one_block_per_multiprocessor():
    program = compile_source(kernel_source("gqa_decode_split.cu"), arch="sm_90")
    a = attention
    kernels = [
        (KernelSpec("mma", "f16", d), d, 2, a.MMA_WARPS[d], a.MMA_RESERVE_STAGES[d], 16)
        for d in MMA_HEAD_DIMS
    ] + [
        (KernelSpec("tc32", "f32", d), d, 4, a.TC32_WARPS[d], reserve, a.TC32_TOKENS[d])
        for d, reserve in a.TC32_RESERVE_STAGES.items()
    ]
    # the wide cluster entries: 8 warps, their ring's own steps (no reserve beyond it)
    kernels += [
        (KernelSpec("mma", t, 128, wide=True, cluster=True), 128, 2, a.WIDE_WARPS,
         a.MMA_STAGES[128], 16)
        for t in ("f16", "bf16")
    ]  # fmt: skip
    for spec, head_dim, itemsize, warps, reserve, tokens in kernels:
        # the launch's shared memory: the reserve (at least the ring's steps)
        plan = a.SplitPlan(spec, 1, 32, 1, 32 * warps, stages=reserve, step_tokens=tokens)
        # and the cluster entry, whose receive area comes on top of the ring
        clustered = dataclasses.replace(plan, spec=spec.but(cluster=True), splits=16, cluster=16)
        recv = a.cluster_recv_bytes(head_dim)
        assert (
            clustered.shared_bytes(head_dim, itemsize)
            == plan.shared_bytes(head_dim, itemsize) + recv
        )
        wide = spec.wide  # only a cluster entry
        for p in (clustered,) if wide else (plan, clustered):
            dynamic = p.shared_bytes(head_dim, itemsize)
            static = program.resources[p.kernel].shared_bytes
            assert dynamic > 0
            assert dynamic + static <= MAX_BLOCK_SHARED, (p.kernel, dynamic, static)
            # more than half a multiprocessor's 228 KiB (1 KiB per block reserved): one block
            assert 2 * (dynamic + static + 1024) > 228 * 1024, (p.kernel, dynamic, static)


def test_the_cluster_receive_area_holds_every_blocks_share_of_the_output():
    """FX_RECV_FLOATS: 16 blocks x 8 heads x (max, sum), then [blocks][slots] float4 with
    slots = ceil(units / blocks), units = group * head_dim / 4."""
    for head_dim in attention.MMA_HEAD_DIMS:
        for group in range(1, 9):
            for blocks in range(1, attention.MAX_CLUSTER + 1):
                units = group * head_dim // 4
                slots = -(-units // blocks)
                floats = attention.MAX_CLUSTER * 16 + blocks * slots * 4
                assert 4 * floats <= attention.cluster_recv_bytes(head_dim), (head_dim, group)


def test_the_hosts_receive_area_is_the_kernels():
    """cluster_recv_bytes repeats FX_RECV_FLOATS (a macro of head_dim, which kernel_define
    cannot read); a kernel given less traps, so the two must not drift apart."""
    match = re.search(r"^#define FX_RECV_FLOATS\(D\) (.+)$", kernel_source(SPLIT_FILE), re.M)
    assert match, "FX_RECV_FLOATS(D) is not defined on one line"
    for head_dim in attention.MMA_HEAD_DIMS:
        expr = match[1].replace("FX_MAX_CLUSTER", str(attention.MAX_CLUSTER))
        expr = expr.replace("(D)", f"({head_dim})")
        assert re.fullmatch(r"[0-9+*() ]+", expr), expr  # plain arithmetic, safe to evaluate
        assert 4 * eval(expr) == attention.cluster_recv_bytes(head_dim), head_dim


def test_fp32_takes_tensor_cores_for_groups_of_two_to_eight(monkeypatch):
    assert [g for g in range(1, 17) if attention.tc32_for(g)] == [2, 3, 4, 5, 6, 7, 8]
    monkeypatch.setattr(attention, "OVERRIDES", attention.Overrides(tc32=False))
    assert not any(attention.tc32_for(g) for g in range(1, 17))


def _traits(cc=(9, 0), blocks=None, clusters=None, sms=132):
    """A device's traits for the planner, built by hand (no GPU): by default a fake H200
    (132 multiprocessors of 228 KiB of shared memory, 1 KiB of it reserved per block;
    clusters of up to 8 blocks: 15 resident, of 9-16: 7)."""

    def fake_blocks(kernel, threads, shared):
        return max(1, min(2048 // threads, 228 * 1024 // (shared + 1024)))

    def fake_clusters(kernel, cluster, threads, shared):
        return 15 if cluster <= 8 else 7

    return attention.DeviceTraits(
        "fake", f"sm_{cc[0]}{cc[1]}", cc, sms, blocks or fake_blocks, clusters or fake_clusters
    )


def test_clusters_need_compute_capability_9_at_most_16_blocks_all_resident():
    resident = {"k4": 40, "k16": 7, "k_refused": 0}  # clusters the (fake) device holds at once

    def clusters(kernel, cluster, threads, shared):
        return resident[kernel]

    def fits(name, cluster, n_clusters, cc=(9, 0), overrides=None):
        traits = _traits(cc, clusters=clusters)
        return attention.clusters_fit(traits, name, cluster, n_clusters, 128, 0, overrides)

    assert fits("k4", 4, 32) and fits("k4", 4, 40) and not fits("k4", 4, 41)
    assert fits("k16", 16, 7) and not fits("k16", 16, 8)  # an eighth would wait: no
    assert not fits("k_refused", 16, 1)
    assert not fits("k4", 4, 1, cc=(8, 0))
    assert not fits("k4", attention.MAX_CLUSTER + 1, 1)
    assert not fits("k4", 4, 1, overrides=attention.Overrides(cluster=False))


def test_plans_tile_and_merge_as_measured():
    """The plan rule on a fake H200 (see _traits), no GPU. Every tensor-core launch takes
    more than half a multiprocessor's shared memory (the head_dim 128 one by its reserve),
    so one block fits each."""
    traits = _traits()

    def plan(dtype, heads, seq, overrides=None, on=traits):
        p = attention.plan(on, dtype, *heads, seq, True, overrides)
        return p.kernel, p.tile, p.splits, p.cluster

    bf16 = ml_dtypes.bfloat16
    # 8 chunks of a KV head fit a resident cluster (8 of 15): merged on chip
    assert plan(bf16, (32, 8, 128), 512) == ("gqa_split_mma_bf16_d128_cluster", 64, 8, 8)
    # 16 chunks per KV head: 8 clusters of 16 would not all be resident (7), so from 1024
    # tokens (groups up to 4) 8 chunks of 8-warp blocks in clusters: the wide plans
    wide = "gqa_split_mma_bf16_d128_wide_cluster"
    assert plan(bf16, (32, 8, 128), 1024) == (wide, 64, 8, 8)
    assert plan(bf16, (32, 8, 128), 4096) == (wide, 64, 8, 8)
    assert plan(bf16, (32, 8, 128), 131072) == (wide, 64, 8, 8)
    assert plan(np.float16, (32, 8, 128), 4096)[0] == "gqa_split_mma_f16_d128_wide_cluster"
    # groups of 8 from 16384 tokens; before, 16 chunks and the combine kernel
    assert plan(bf16, (64, 8, 128), 8192) == ("gqa_split_mma_bf16_d128", 64, 16, 0)
    assert plan(bf16, (64, 8, 128), 16384) == (wide, 64, 8, 8)
    # groups of 5 from 2048 tokens
    assert plan(bf16, (40, 8, 128), 1024) == ("gqa_split_mma_bf16_d128", 64, 16, 0)
    assert plan(bf16, (40, 8, 128), 2048) == (wide, 64, 8, 8)
    # 8 KV heads only: not 4 (32 blocks), 12 (measured slower: two clusters share GPCs) or
    # 32 (MHA; 32 clusters of 8 would not all be resident anyway)
    assert plan(bf16, (16, 4, 128), 32768) == ("gqa_split_mma_bf16_d128", 64, 33, 0)
    assert plan(bf16, (48, 12, 128), 32768) == ("gqa_split_mma_bf16_d128", 64, 11, 0)
    assert plan(bf16, (32, 32, 128), 32768) == ("gqa_split_mma_bf16_d128", 64, 4, 0)
    p = attention.plan(traits, bf16, 32, 8, 128, 4096)
    assert (p.threads, p.stages) == (32 * attention.WIDE_WARPS, attention.MMA_STAGES[128])
    ring = attention.WIDE_WARPS * attention.MMA_STAGES[128] * 16 * 2 * 128 * 2
    assert p.shared_bytes(128, 2) == ring + attention.cluster_recv_bytes(128)
    # 4 KV heads: 4 clusters of 16 are resident
    assert plan(bf16, (16, 4, 128), 1024) == ("gqa_split_mma_bf16_d128_cluster", 64, 16, 16)
    # ... unless their exchange (chunks x group x head_dim floats) passes 8192
    assert plan(bf16, (28, 4, 128), 512) == ("gqa_split_mma_bf16_d128_cluster", 64, 8, 8)
    assert plan(bf16, (28, 4, 128), 1024) == ("gqa_split_mma_bf16_d128", 64, 16, 0)  # 14336
    assert plan(bf16, (64, 8, 128), 512) == ("gqa_split_mma_bf16_d128_cluster", 64, 8, 8)
    assert plan(bf16, (8, 1, 256), 256) == ("gqa_split_mma_bf16_d256_cluster", 64, 4, 4)
    assert plan(bf16, (8, 1, 256), 512) == ("gqa_split_mma_bf16_d256", 64, 8, 0)  # 16384
    assert plan(bf16, (2, 1, 256), 1024) == ("gqa_split_mma_bf16_d256_cluster", 64, 16, 16)
    assert plan(bf16, (28, 4, 128), 4096) == ("gqa_split_mma_bf16_d128", 64, 33, 0)
    # fp32 head_dim 256: 32-token tiles, as many chunks as a wave holds, never clusters
    assert plan(np.float32, (8, 1, 256), 512) == ("gqa_split_tc32_f32_d256", 32, 16, 0)
    assert plan(np.float32, (8, 1, 256), 4096) == ("gqa_split_tc32_f32_d256", 32, 128, 0)
    assert plan(np.float32, (8, 1, 256), 131072) == ("gqa_split_tc32_f32_d256", 32, 132, 0)
    # fp32 head_dim 64 and 128: a 2-step ring, launched with 3 steps' shared memory (as
    # measured); one block per multiprocessor either way
    assert plan(np.float32, (32, 8, 128), 4096) == ("gqa_split_tc32_f32_d128", 64, 16, 0)
    assert plan(np.float32, (16, 2, 64), 32768) == ("gqa_split_tc32_f32_d64", 64, 66, 0)
    for heads in ((32, 8, 128), (16, 2, 64)):
        p = attention.plan(traits, np.float32, *heads, 4096)
        hd = heads[2]
        assert (p.stages, p.reserve_stages) == (2, 3)
        assert p.shared_bytes(hd, 4) == p.threads // 32 * 3 * p.step_tokens * 2 * hd * 4
    # wide=False (FERROX_WIDE=0): the combine kernel's plans again (a comparison knob)
    no_wide = attention.Overrides(wide=False)
    assert plan(bf16, (32, 8, 128), 4096, no_wide) == ("gqa_split_mma_bf16_d128", 64, 16, 0)
    # no clusters before compute capability 9.0
    ampere = _traits(cc=(8, 0), sms=108)
    assert plan(bf16, (32, 8, 128), 512, on=ampere) == ("gqa_split_mma_bf16_d128", 64, 8, 0)
    assert plan(bf16, (32, 8, 128), 4096, on=ampere) == ("gqa_split_mma_bf16_d128", 64, 13, 0)
    # padded head dims: the next tensor-core kernel up, merged on chip where the clusters
    # fit (as their kernel's), by the combine kernel where not, never in the wide plans
    assert plan(bf16, (32, 8, 96), 4096) == ("gqa_split_mma_bf16_d128_r96", 64, 16, 0)
    assert plan(bf16, (32, 8, 96), 512) == ("gqa_split_mma_bf16_d128_r96_cluster", 64, 8, 8)
    assert plan(bf16, (32, 8, 40), 512) == ("gqa_split_mma_bf16_d64_r40_cluster", 64, 8, 8)
    assert plan(bf16, (4, 2, 160), 1024) == ("gqa_split_mma_bf16_d256_r160_cluster", 64, 16, 16)
    assert plan(bf16, (8, 2, 160), 1024) == ("gqa_split_mma_bf16_d256_r160", 64, 16, 0)  # 10240
    assert plan(bf16, (32, 8, 112), 32768) == ("gqa_split_mma_bf16_d128_r112", 64, 16, 0)
    p = attention.plan(traits, bf16, 32, 8, 96, 512)
    assert p.shared_bytes(96, 2) == attention.plan(traits, bf16, 32, 8, 128, 512).shared_bytes(
        128, 2
    )
    # groups of 9-16: the tensor cores in two tiles of 8 query heads (twice the blocks per
    # KV head, so half the chunks); past 16, CUDA cores
    assert plan(bf16, (16, 1, 128), 32768) == ("gqa_split_mma_bf16_d128_t2", 64, 66, 0)
    assert plan(bf16, (16, 1, 128), 512) == ("gqa_split_mma_bf16_d128_t2_cluster", 64, 8, 8)
    assert plan(bf16, (24, 2, 96), 32768) == ("gqa_split_mma_bf16_d128_r96_t2", 64, 33, 0)
    assert attention.plan(traits, bf16, 12, 1, 64, 4096).head_tiles == 2
    assert plan(bf16, (17, 1, 128), 4096)[0] == "gqa_split_bf16_g4_vec"
    no_pad = attention.Overrides(padded_mma=False)
    assert plan(bf16, (32, 8, 96), 4096, no_pad)[0] == "gqa_split_bf16_g4_vec"
    assert plan(bf16, (32, 8, 100), 4096)[0] == "gqa_split_bf16_g4_any"  # not a multiple of 8


def test_the_thresholds_come_from_the_architecture_table():
    h200 = _traits()
    other = attention.DeviceTraits(
        "other", "sm_90", (9, 0), 132, h200.blocks_per_sm, h200.active_clusters,
        attention.Tuning(wide_kv_heads=4, cluster_max_exchange=0),
    )  # fmt: skip
    bf16 = ml_dtypes.bfloat16
    assert attention.plan(h200, bf16, 32, 8, 128, 4096).kernel.endswith("_wide_cluster")
    assert attention.plan(other, bf16, 32, 8, 128, 4096).cluster == 0  # no wide plan for 8
    assert attention.plan(other, bf16, 16, 4, 128, 4096).kernel.endswith("_wide_cluster")
    assert attention.plan(other, bf16, 32, 8, 128, 512).cluster == 0  # no exchange allowed
    assert attention.TUNING["sm_90"] == attention.Tuning()
    assert [g for g in range(1, 17) if attention.wide_from(g) <= 2048] == [1, 2, 3, 4, 5]


def test_the_head_dim_128_launch_reserves_more_shared_memory_than_its_ring():
    """Its ring has 2 steps (one in flight while one is computed: measured fastest)
    but the launch reserves the shared memory of 4, so one block
    still fills a multiprocessor of 228 KiB, as the plans' one wave assumes."""
    a = attention
    assert a.MMA_STAGES[128] < a.MMA_RESERVE_STAGES[128]
    plan = a.SplitPlan(
        KernelSpec("mma", "bf16", 128), 1, 32, 16, 32 * a.MMA_WARPS[128],
        stages=a.MMA_STAGES[128], reserve_stages=a.MMA_RESERVE_STAGES[128],
    )  # fmt: skip
    ring = a.MMA_WARPS[128] * a.MMA_STAGES[128] * 16 * 2 * 128 * 2
    assert plan.shared_bytes(128, 2) == ring * a.MMA_RESERVE_STAGES[128] // a.MMA_STAGES[128]
    assert 2 * (plan.shared_bytes(128, 2) + 1024) > 228 * 1024
    # the cluster entry's receive area comes past the reserve (the kernel finds it past its
    # ring, inside what is reserved)
    clustered = dataclasses.replace(plan, spec=plan.spec.but(cluster=True), cluster=8)
    assert clustered.shared_bytes(128, 2) == plan.shared_bytes(128, 2) + a.cluster_recv_bytes(128)
    # a deeper ring than the reserve takes what the ring needs
    deep = dataclasses.replace(plan, stages=a.MMA_RESERVE_STAGES[128] + 2)
    assert deep.shared_bytes(128, 2) == ring * deep.stages // a.MMA_STAGES[128]


def test_cuda_core_plans_need_no_dynamic_shared_memory():
    plan = attention.SplitPlan(KernelSpec("generic", "f32", heads_per_block=4, vec=True), 2, 16, 8)
    assert plan.shared_bytes(128, 4) == 0


def test_only_plans_with_a_combine_kernel_need_scratch():
    plan = attention.SplitPlan(KernelSpec("mma", "bf16", 128), 1, 32, 16, stages=4)
    assert plan.workspace_floats(32, 128) == 32 * 16 * (128 + 2)  # partials, maxima, sums
    clustered = dataclasses.replace(plan, spec=plan.spec.but(cluster=True), splits=8, cluster=8)
    assert clustered.workspace_floats(32, 128) == 0  # the partials stay on chip


def test_only_plans_with_a_combine_kernel_name_one():
    plan = attention.SplitPlan(KernelSpec("mma", "bf16", 128), 1, 32, 16, stages=4)
    assert plan.combine_kernel(ml_dtypes.bfloat16) == "gqa_split_combine_bf16"
    assert plan.combine_kernel(np.float32) == "gqa_split_combine_f32"
    clustered = dataclasses.replace(plan, spec=plan.spec.but(cluster=True), splits=8, cluster=8)
    assert clustered.combine_kernel(ml_dtypes.bfloat16) is None


@pytest.mark.parametrize("shape", bench_decode.SHAPES)
def test_benchmark_rotation_keeps_every_point_out_of_l2(shape):
    _, n_kv, head_dim = shape
    for seq in bench_decode.SEQ_LENS:
        for itemsize in (2, 4):
            kv_bytes = 2 * seq * n_kv * head_dim * itemsize
            n_sets, chain = bench_harness.rotation(kv_bytes)
            assert 1 <= n_sets <= chain
            assert chain >= bench_harness.CHAIN_MIN
            # between two reads of one set, the other sets' bytes flush the L2
            assert n_sets == 1 or (n_sets - 1) * kv_bytes > 2 * L2_BYTES, (seq, n_sets)
            assert n_sets > 1 or kv_bytes > 2 * L2_BYTES


def test_markdown_table_shows_both_timings_and_the_speed_up():
    point = {
        "shape": "32/8/128",
        "dtype": "bf16",
        "seq_len": 4096,
        "kv_bytes": 10_000_000,
        "graph_us": 10.0,
        "single_us": 17.5,
        "eager_us": 60.0,
        "torch_us": 25.0,
        "torch_single_us": 31.0,
    }
    no_torch = dict(point, torch_us=None, torch_single_us=None, seq_len=512)
    text = bench_report.markdown_table(
        {"device": "GPU", "read_ceiling_tbs": 4.0, "points": [point, no_torch]}
    )
    rows = [r for r in text.splitlines() if r.startswith("| 32/8/128")]
    assert len(rows) == 2
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    # 10 MB in 10 us = 1.00 TB/s = 25% of 4 TB/s; PyTorch 10 MB in 25 us = 10%
    assert cells[3:] == ["10.0", "1.00", "25.0", "17.5", "60.0", "25.0", "10.0", "31.0", "2.50x"]
    assert rows[1].rstrip().endswith("| - | - | - | - |")


def test_results_are_written_as_json_and_markdown_and_the_console_table_prints(tmp_path, capsys):
    point = bench_decode.DecodePoint("16/2/64", "f16", 512, 2_000_000, 5.0, 9.0, 50.0, 6.0, 8.0)
    result = {"device": "GPU", "read_ceiling_tbs": 4.0, "points": [asdict(point)]}
    bench_report.write_results(result, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "bench_decode.json").read_text()) == result
    assert "| 16/2/64 | f16 | 512 | 5.0 |" in (tmp_path / "out" / "bench_decode.md").read_text()
    bench_report.print_table([point], 4.0)
    line = next(r for r in capsys.readouterr().out.splitlines() if r.startswith("16/2/64"))
    # 2 MB in 5 us = 0.40 TB/s = 10% of 4 TB/s; PyTorch 6 us: 1.20x
    assert line.split() == [
        "16/2/64",
        "f16",
        "512",
        "5.0",
        "0.40",
        "10.0",
        "9.0",
        "50.0",
        "6.0",
        "8.3",
        "8.0",
        "1.20x",
    ]


def test_compile_source_reads_the_log_into_a_buffer_of_its_own(monkeypatch):
    """NVRTC writes into the buffer it is given: an immutable (possibly shared) bytes
    object must never be it. A one-byte log is the case that bit: b" " * 1 is b" " itself."""
    real_rtc = compiler.rtc
    seen = []

    def fake_rtc(call, *args):
        if call == "nvrtcGetProgramLogSize":
            real_rtc(call, *args)
            return 1
        if call == "nvrtcGetProgramLog":
            seen.append(args[1])
            args[1][0:1] = b"\0"  # what NVRTC does with an empty log
            return None
        return real_rtc(call, *args)

    monkeypatch.setattr(compiler, "rtc", fake_rtc)
    program = compile_source('extern "C" __global__ void k() {}', arch="sm_90")
    assert isinstance(seen[0], bytearray)
    assert bytes([32]) == b" "  # Python's shared one-byte object is untouched
    assert program.log == ""
    assert program.resources == {}
    assert program.cubin[:4] == b"\x7fELF"


def test_traits_read_from_a_device_ask_the_driver_once_per_kernel(monkeypatch):
    asked = []

    class FakeKernel:
        def __init__(self, name):
            self.name = name

        def max_active_blocks(self, threads, shared):
            asked.append(("blocks", self.name))
            return 0  # read as 1: a launch runs at least one block

        def max_active_clusters(self, cluster, threads, shared):
            asked.append(("clusters", self.name, cluster))
            if cluster > 8:
                raise CudaError(912, "CUDA_ERROR_INVALID_CLUSTER_SIZE", "cuOccupancy...", "-")
            return 15

    class FakeDevice:
        context_handle, arch, compute_capability, multiprocessor_count = -7, "sm_90", (9, 0), 132
        max_shared_per_block_optin = 227 * 1024 - 5

    monkeypatch.setattr(launches, "split_kernel", lambda spec, device: FakeKernel(spec.name))
    traits = launches.device_traits(FakeDevice())
    assert traits.tuning is attention.TUNING["sm_90"] and traits.multiprocessor_count == 132
    assert traits.shared_per_block == 227 * 1024 - 5  # the device's own limit
    k = KernelSpec("mma", "bf16", 128)
    assert traits.blocks_per_sm(k, 128, 0) == traits.blocks_per_sm(k, 128, 0) == 1
    assert traits.active_clusters(k, 16, 128, 0) == 0  # refused: none resident
    assert traits.active_clusters(k, 8, 128, 0) == traits.active_clusters(k, 8, 128, 0) == 15
    n = k.name
    assert asked == [("blocks", n), ("clusters", n, 16), ("clusters", n, 8)]
    assert launches.device_traits(FakeDevice()) is traits  # once per context


def test_features_take_the_plans_of_the_decode_without_them():
    traits, bf16 = _traits(), np.dtype(ml_dtypes.bfloat16)
    bits = kernel_traits.F_WINDOW | kernel_traits.F_SINKS | kernel_traits.F_CAP
    # the wide plan and the clusters, with the features compiled in (the cluster's merge
    # applies the sinks and the LSE)
    p = attention.plan(traits, bf16, 32, 8, 128, 32768, features=bits)
    wide = f"gqa_split_mma_bf16_d128_wide_x{bits}_cluster"
    assert (p.kernel, p.cluster, p.features) == (wide, 8, bits)
    assert p.spec.entry == f"FX_MMA_WIDE_FEAT_ENTRY({wide}, fx_bf16, {bits})"
    clustered = attention.plan(traits, bf16, 64, 8, 128, 512, features=kernel_traits.F_LSE)
    assert clustered.kernel == "gqa_split_mma_bf16_d128_x16_cluster" and clustered.cluster == 8
    # where the chunks do not fit clusters: the combine kernel applies window, sinks, LSE
    p = attention.plan(traits, bf16, 28, 4, 128, 4096, features=bits)
    assert (p.kernel, p.cluster) == (f"gqa_split_mma_bf16_d128_x{bits}", 0)
    assert p.combine_kernel(bf16) == "gqa_split_combine_bf16_x9"  # window + sinks
    cap_only = attention.plan(traits, bf16, 28, 4, 128, 4096, features=kernel_traits.F_CAP)
    assert cap_only.combine_kernel(bf16) == "gqa_split_combine_bf16"
    # fp32 with features: no clusters (its cluster kernels take none)
    f32 = attention.plan(traits, np.float32, 64, 8, 128, 512, features=kernel_traits.F_LSE)
    assert (f32.kernel, f32.cluster) == ("gqa_split_tc32_f32_d128_x16", 0)
    tiled = attention.plan(traits, bf16, 16, 1, 96, 4096, features=kernel_traits.F_LSE)
    assert tiled.kernel == "gqa_split_mma_bf16_d128_r96_t2_x16"
    assert tiled.spec.entry == (
        "FX_MMA_FEAT_ENTRY(gqa_split_mma_bf16_d128_r96_t2_x16, fx_bf16, 128, 96, true, 16)"
    )
    assert p.combine_spec(bf16).entry == (
        "FX_COMBINE_FEAT_ENTRY(gqa_split_combine_bf16_x9, fx_bf16, 9)"
    )
    # every kernel family takes them: fp32 on tensor cores, other head_dims on CUDA cores
    lse = kernel_traits.F_LSE
    assert attention.plan(traits, np.float32, 32, 8, 128, 4096, features=lse).kernel == (
        "gqa_split_tc32_f32_d128_x16"
    )
    odd = attention.plan(traits, bf16, 32, 8, 100, 4096, features=lse)
    assert odd.kernel == "gqa_split_bf16_g4_any_x16"
    assert odd.spec.entry == (
        "FX_GENERIC_FEAT_ENTRY(gqa_split_bf16_g4_any_x16, fx_bf16, 4, false, 16)"
    )
    assert attention.plan(traits, bf16, 32, 8, 128, 32768).features == 0  # none: as before


def test_head_dims_pair_their_kv_heads_where_measured_to_pay():
    """Two adjacent KV heads' rows read as one row of 2 x head_dim (Tuning.paired_from, as
    measured on the H200), merged by the combine kernel; never with features, never where
    the pair's group needs two tiles."""
    traits, bf16 = _traits(), np.dtype(ml_dtypes.bfloat16)

    def kernel(heads, seq, dtype=bf16, overrides=None, features=0):
        return attention.plan(traits, dtype, *heads, seq, True, overrides, features).kernel

    p = attention.plan(traits, bf16, 32, 8, 40, 131072)
    assert (p.kernel, p.paired, p.cluster) == ("gqa_split_mma_bf16_d128_r80_p2", True, 0)
    assert kernel((32, 8, 32), 16384) == "gqa_split_mma_bf16_d64_r64_p2"
    assert kernel((32, 8, 48), 32768) == "gqa_split_mma_bf16_d128_r96_p2"
    assert kernel((32, 8, 16), 32768, np.dtype(np.float16)) == "gqa_split_mma_f16_d64_r32_p2"
    assert kernel((32, 8, 56), 131072) == "gqa_split_mma_bf16_d128_r112_p2"
    assert kernel((32, 8, 72), 16384) == "gqa_split_mma_bf16_d256_r144_p2"
    assert kernel((8, 8, 72), 131072) == "gqa_split_mma_bf16_d256_r144_p2"  # MHA
    assert kernel((32, 8, 104), 16384) == "gqa_split_mma_bf16_d256_r208_p2"
    assert kernel((32, 8, 120), 131072) == "gqa_split_mma_bf16_d256_r240_p2"
    assert kernel((32, 8, 96), 32768) == "gqa_split_mma_bf16_d256_r192_p2"
    assert kernel((32, 8, 96), 16384) == "gqa_split_mma_bf16_d128_r96"  # 96 from 32768
    # shorter, not measured to pay (64, 80, 112), two tiles (groups of 8 paired), wider,
    # odd KV heads, fp32, features, FERROX_PAIRED=0: not
    assert kernel((32, 8, 40), 8192) == "gqa_split_mma_bf16_d64_r40"
    assert kernel((32, 8, 72), 8192) == "gqa_split_mma_bf16_d128_r72"
    assert kernel((32, 8, 64), 131072) == "gqa_split_mma_bf16_d64"
    assert kernel((32, 8, 80), 131072) == "gqa_split_mma_bf16_d128_r80"
    assert kernel((32, 8, 112), 131072) == "gqa_split_mma_bf16_d128_r112"
    assert kernel((64, 8, 48), 32768) == "gqa_split_mma_bf16_d64_r48"
    assert kernel((64, 8, 72), 131072) == "gqa_split_mma_bf16_d128_r72"
    assert kernel((16, 2, 72), 131072) == "gqa_split_mma_bf16_d128_r72"
    assert "_p2" not in kernel((12, 3, 40), 131072)
    assert "_p2" not in kernel((72, 8, 40), 131072)
    assert "_p2" not in kernel((32, 8, 40), 131072, np.dtype(np.float32))
    assert (
        kernel((32, 8, 40), 131072, features=kernel_traits.F_LSE)
        == "gqa_split_mma_bf16_d64_r40_x16"
    )
    never = attention.Overrides(paired=False)
    assert kernel((32, 8, 40), 131072, overrides=never) == "gqa_split_mma_bf16_d64_r40"
    # paired=True (FERROX_PAIRED=1): wherever the kernels can
    always = attention.Overrides(paired=True)
    assert kernel((32, 8, 40), 512, overrides=always) == "gqa_split_mma_bf16_d128_r80_p2"
    assert kernel((32, 8, 128), 512, overrides=always) == "gqa_split_mma_bf16_d256_r256_p2"
    assert kernel((64, 8, 48), 512, overrides=always) == "gqa_split_mma_bf16_d128_r96_p2_t2"
    assert p.spec.entry == (
        "FX_MMA_PAIR_ENTRY(gqa_split_mma_bf16_d128_r80_p2, fx_bf16, 128, 80, false)"
    )


def test_padded_head_dims_that_stop_at_their_own_columns_are_generated_as_measured():
    """FX_TRIM_D<D>_R<DR> (kernel_traits) becomes FxPaddedTrim<D, DR>, read by the
    heads-as-rows body only (the kernels of D with FX_MMA_SWAPPED_D<D> = 0)."""
    trims = {
        (int(m[1]), int(m[2])): value
        for name, value in kernel_traits.SPLIT_TRAITS.items()
        if (m := re.fullmatch(r"FX_TRIM_D(\d+)_R(\d+)", name))
    }
    assert trims == {(256, 160): 1, (256, 192): 1}  # measured: docs/design.md
    header = kernel_traits.traits_header()
    assert "template <int D, int DR> struct FxPaddedTrim { static constexpr int value = 0; };" in (
        header
    )
    for d, dr in trims:
        assert kernel_traits.SPLIT_TRAITS[f"FX_MMA_SWAPPED_D{d}"] == 0
        assert dr < d and dr % 8 == 0
        assert (
            f"template <> struct FxPaddedTrim<{d}, {dr}> "
            f"{{ static constexpr int value = FX_TRIM_D{d}_R{dr}; }};"
        ) in header
    assert "FxPaddedTrim<D, DR>::value" in (compiler.source_dir() / "split_mma.cuh").read_text()


def test_a_padded_head_dim_with_a_ring_depth_of_its_own_plans_with_it():
    """FX_STAGES_D<D>_R<DR> (kernel_traits): the plan's steps, within the launch's shared
    memory (the kernel traps with less), and the kernel compiled with it (FxPaddedStages);
    the pairs and fp8 caches of the same rows keep the kernel's own depth."""
    traits, bf16 = _traits(), np.dtype(ml_dtypes.bfloat16)
    own = {
        (int(m[1]), int(m[2])): value
        for name, value in kernel_traits.SPLIT_TRAITS.items()
        if (m := re.fullmatch(r"FX_STAGES_D(\d+)_R(\d+)", name))
    }
    assert own == {(128, 80): 3}  # measured: docs/design.md
    for (d, dr), steps in own.items():
        assert steps <= attention.MMA_RESERVE_STAGES[d]
        assert f"struct FxPaddedStages<{d}, {dr}> {{ static constexpr int value = " in (
            kernel_traits.traits_header()
        )
    p = attention.plan(traits, bf16, 32, 8, 80, 131072)
    assert (p.kernel, p.stages) == ("gqa_split_mma_bf16_d128_r80", 3)
    ring = 4 * 3 * 16 * 2 * 128 * 2  # warps x steps x tokens x (K, V) x columns x bytes
    assert p.shared_bytes(80, 2) >= ring
    assert attention.plan(traits, bf16, 32, 8, 72, 4096).stages == 2
    always = attention.Overrides(paired=True)
    assert attention.plan(traits, bf16, 32, 8, 40, 131072, True, always).stages == 2  # r80_p2
    assert attention.plan(traits, bf16, 32, 8, 80, 131072, fp8="e4m3").stages == 2


def test_no_plan_pairs_kv_heads_whose_pair_needs_two_tiles():
    """A pair's group is twice the KV head's; past 8 it needs two tiles, each reading the
    whole pair's row (26-50% slower on the H200): the planner never pairs those, at any
    measured head_dim, length or group, while pairing every group of up to 4 there."""
    traits = _traits()
    for dtype in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)):
        for head_dim, shortest in attention.DEFAULT_TUNING.paired_from:
            for group in range(1, 17):
                for seq in (shortest, 131072):
                    p = attention.plan(traits, dtype, 8 * group, 8, head_dim, seq)
                    assert p.paired == (group <= 4), (head_dim, group, seq, p.kernel)
                    assert "_p2_t2" not in p.kernel


def test_a_verifys_split_blocks_take_16_rows_and_32_from_16384_tokens():
    """A verify's split kernel (n_q x n_heads rows) on the fake H200: one block per 16 rows
    of a KV head (two tiles of 8) below VERIFY_WIDE_FROM planned tokens, per 32 from there,
    at head_dim 128 (bf16, fp16, fp8); 8 elsewhere; FERROX_VERIFY_BLOCK_TILES caps it."""
    traits = _traits()
    bf16 = ml_dtypes.bfloat16

    def verify(rows, seq, head_dim=128, dtype=bf16, fp8="", overrides=None):
        p = attention.plan(traits, dtype, rows, 8, head_dim, seq, True, overrides, 0, fp8,
                           verify=True)  # fmt: skip
        return p.spec.block_tiles, p.head_tiles, p.cluster

    wide = attention.VERIFY_WIDE_FROM
    assert verify(8 * 4, 4096) == (1, 1, 0)  # 4 rows per KV head: one tile, as ever
    assert verify(8 * 8, 4096) == (1, 1, 0)  # 8 rows (n_q 2 of a group of 4): one tile
    assert verify(8 * 16, 4096) == (2, 1, 0)  # 16 rows per KV head: one block
    assert verify(8 * 32, 4096) == (2, 2, 0)  # 32 rows, below 16384 tokens: two blocks
    assert verify(8 * 32, wide) == (4, 1, 0)  # from 16384: one block of 32
    assert verify(8 * 64, 131072) == (4, 2, 0)
    assert verify(8 * 24, wide) == (4, 1, 0)  # three tiles: one block, its last tile empty
    assert verify(8 * 32, wide, dtype=np.float16) == (4, 1, 0)
    assert verify(8 * 32, wide, fp8="e4m3") == (4, 1, 0)
    assert verify(8 * 32, wide, head_dim=64) == (1, 4, 0)  # (the unswapped body: tiles of 8)
    assert verify(8 * 32, wide, head_dim=256) == (1, 4, 0)
    capped = attention.Overrides(verify_block_tiles=2)
    assert verify(8 * 32, wide, overrides=capped) == (2, 2, 0)
    assert verify(8 * 32, wide, overrides=attention.Overrides(verify_block_tiles=1)) == (1, 4, 0)
    # a one-token plan never takes them
    assert attention.plan(traits, bf16, 8 * 16, 8, 128, wide).spec.block_tiles == 1


def test_a_verifys_blocks_share_a_multiprocessor_where_a_kv_heads_rows_take_several():
    """Where a KV head's verify rows take two or more split blocks, the launch reserves no
    shared memory past the ring (two blocks per multiprocessor on the fake H200, twice the
    chunks); one block of a KV head's rows, and every one-token plan, keep the reserve."""
    traits = _traits()
    bf16 = ml_dtypes.bfloat16

    def verify(rows, seq, overrides=None):
        p = attention.plan(traits, bf16, rows, 8, 128, seq, True, overrides, 0, "",
                           verify=True)  # fmt: skip
        return p.head_tiles, p.reserve_stages, p.splits, p.shared_bytes(128, 2)

    ring = 4 * 2 * 16 * 2 * 128 * 2  # warps x stages x tokens x (K, V) x head_dim x bytes
    tiles, reserve, splits, shared = verify(8 * 64, 131072)
    assert (tiles, reserve, shared) == (2, 0, ring)
    alone = verify(8 * 64, 131072, attention.Overrides(verify_shared=False))
    assert alone[:2] == (2, attention.MMA_RESERVE_STAGES[128])
    assert splits >= 2 * alone[2]  # a wave of twice the blocks
    assert verify(8 * 32, 4096)[:2] == (2, 0)  # 16-row blocks below VERIFY_WIDE_FROM
    assert verify(8 * 32, 131072)[:2] == (1, attention.MMA_RESERVE_STAGES[128])  # one block
    assert verify(8 * 16, 4096)[:2] == (1, attention.MMA_RESERVE_STAGES[128])
    one_token = attention.plan(traits, bf16, 8 * 16, 8, 128, 131072)
    assert one_token.reserve_stages == attention.MMA_RESERVE_STAGES[128]


def test_blocks_of_several_tiles_are_the_swapped_head_dim_128_kernels_only():
    spec = KernelSpec("mma", "bf16", 128, 128, tiles=2, block_tiles=4)
    assert spec.name == "gqa_split_mma_bf16_d128_t2b4"
    assert spec.entry == "FX_MMA_KERNELS(gqa_split_mma_bf16_d128_t2b4, fx_bf16, 128, 128, 4)"
    fp8 = KernelSpec("mma", "bf16", 128, 128, tiles=2, block_tiles=2, fp8="e4m3")
    assert fp8.name == "gqa_split_mma_bf16_e4m3_d128_t2b2_x0"
    assert ", 2, 0)" in fp8.entry
    for bad in (dict(head_dim=64, row_dim=64, tiles=2, block_tiles=2),
                dict(head_dim=128, row_dim=128, tiles=1, block_tiles=2),
                dict(head_dim=128, row_dim=128, tiles=2, block_tiles=3)):  # fmt: skip
        with pytest.raises(ValueError, match=r"block_tiles|two tiles per block"):
            KernelSpec("mma", "bf16", **bad)
    with pytest.raises(ValueError, match="block_tiles"):
        KernelSpec("generic", "bf16", heads_per_block=4, block_tiles=2)


def test_a_verifys_rows_plan_takes_16_rows_a_warp_up_to_8_warps_a_block():
    """A verify on the rows kernel (split_rows.cuh) on the fake H200: a KV head's n_q x group
    rows in warps of 16, blocks of up to 8 warps; one wave of blocks, chunks of at least
    the tuning's 128 tokens; None where the kernel does not take the call."""
    bf16 = np.dtype(ml_dtypes.bfloat16)

    on = attention.Overrides(verify_rows=True)

    def rows(n_q, n_heads=32, n_kv=8, seq=131072, head_dim=128, dtype=bf16, aligned=True,
             features=0, fp8="", overrides=on, cc=(9, 0)):  # fmt: skip
        found = attention.rows_plan(_traits(cc), dtype, n_q, n_heads, n_kv, head_dim, seq,
                                    aligned, features, fp8, overrides)  # fmt: skip
        return None if found is None else (found.spec.row_warps, found.row_blocks, found.splits)

    shared = (4 * 2 * 32 * 128 + 16 * 128) * 2  # 4 steps of 32 tokens of K and V; q's rows
    per_sm = 228 * 1024 // (shared + 1024)
    assert rows(2) == (1, 1, 132 * per_sm // 8)  # 8 rows per KV head: one warp
    assert rows(4) == (1, 1, 132 * per_sm // 8)  # 16 rows
    assert rows(8) == (2, 1, 132 * 3 // 8)  # 32 rows: two warps (q's rows take more)
    assert rows(16, n_heads=28, n_kv=4)[:2] == (7, 1)  # 112 rows: seven warps
    assert rows(33)[:2] == (8, 2)  # 132 rows: two blocks of 8 warps
    assert rows(8, seq=4096)[2] == 4096 // 128  # chunks of at least 128 tokens
    assert rows(8, seq=20)[2] == 1
    fewer = attention.Overrides(verify_rows=True, rows_min_chunk=1024)
    assert rows(8, seq=4096, overrides=fewer)[2] == 4
    assert rows(8, head_dim=64)[:2] == rows(8, head_dim=256)[:2] == (2, 1)
    spec = attention.rows_plan(_traits(), bf16, 4, 32, 8, 128, 4096, True, 1 | 8 | 16 | 64,
                               overrides=on)  # fmt: skip
    assert spec is not None and spec.spec.features == 1 | 64  # sinks and LSE: its combine's
    assert spec.combine_spec().features == 1 | 8 | 16
    assert spec.spec.name == "gqa_verify_rows_bf16_d128_w1_x65"
    assert spec.combine_spec().name == "gqa_verify_rows_combine_bf16_x25"
    # an fp8 cache: a ring of bytes and one step widened, so more blocks fit
    fp8 = attention.rows_plan(_traits(), bf16, 8, 32, 8, 128, 131072, True, 0, "e4m3", on)
    assert fp8 is not None and fp8.spec.name == "gqa_verify_rows_bf16_e4m3_d128_w2_x0"
    assert fp8.shared_bytes(2) == 4 * 2 * 32 * 128 + 2 * 32 * 128 * 2 + 32 * 128 * 2
    for refused in (
        {"dtype": np.dtype(np.float32)}, {"head_dim": 80}, {"aligned": False}, {"cc": (7, 5)},
        {"fp8": "e4m3", "cc": (8, 0)}, {"overrides": attention.Overrides(verify_rows=False)},
    ):  # fmt: skip
        assert rows(4, **refused) is None, refused


def test_the_rows_kernels_compile_for_hopper_without_spills():
    """The rows kernel of one and eight row warps at head_dim 64 and 128, 16-bit and fp8
    caches, compiles to a cubin for sm_90 without spilling (256 may spill a little with
    every feature)."""
    specs = [KernelSpec("vrows", "bf16", head_dim=d, row_warps=w, features=f, fp8=f8)
             for d in (64, 128) for w in (1, 8) for f in (0, 1 | 2 | 4 | 32 | 64)
             for f8 in ("", "e4m3")]  # fmt: skip
    specs.append(KernelSpec("vrcombine", "f16", features=1 | 8 | 16))
    program = launches.split_program(specs, "sm_90")
    for spec in specs:
        assert program.resources[spec.name].spill_stores == 0, spec.name
