"""The split-KV decode, planned: which kernel (a ``KernelSpec``), how many chunks, how they
merge. A pure function of the shape and of what the planner knows of a device
(``DeviceTraits``, built by hand in tests, read from the driver by ``decode.launches``); it
imports nothing from the driver.

Two kernel families: the split-KV kernels (default; tensor cores for fp16/bf16 and, with
split TF32 products, for fp32 with groups of 2-8; CUDA cores otherwise) and the parity
kernel (ferrox-cuda's algorithm, corrected), kept as the reference path.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..archs import ARCHS, FP8_FROM, TENSOR_CORES_FROM
from ..kernels.spec import (
    FOUR_BIT_FORMATS,
    FP8_FORMATS,
    MMA_HEAD_DIMS,
    NARROW_ROWS_HEAD_DIM,
    NVFP4_FORMAT,
    QUANTIZED_FORMATS,
    ROWS_HEAD_DIMS,
    ROWS_MAX_WARPS,
    SPLIT_FILE,
    TC32_HEAD_DIMS,
    WIDE_HEAD_DIM,
    WIDE_ROWS_HEAD_DIM,
    WIDE_ROWS_MAX_HEADS,
    KernelSpec,
    kernel_dtype,
    kv_formats,
    mixed_format,
)
from ..kernels.traits import (
    COMBINE_FEATURES,
    F_HND,
    F_LSE,
    F_SINKS,
    SPLIT_TRAITS,
    padded_stages,
)
from .latent_plan import LATENT_WG_MIN_CHUNK

__all__ = [
    "ALGORITHMS",
    "OVERRIDES",
    "TUNING",
    "DeviceTraits",
    "Overrides",
    "RowsPlan",
    "SplitPlan",
    "Tuning",
    "fitting",
    "plan",
    "rows_plan",
]

ALGORITHMS = ("auto", "split", "parity")


@functools.cache
def kernel_define(name: str) -> int:
    """The value of the split kernels' compile-time constant ``name`` (kernels.traits: the
    kernels are compiled with the same table, so the host's grids and shared memory sizes
    cannot drift from them)."""
    value = SPLIT_TRAITS.get(name)
    if value is None:
        raise RuntimeError(f"{SPLIT_FILE} defines no integer {name} (kernel_traits.SPLIT_TRAITS)")
    return value


TILE = kernel_define("FX_TILE")  # tokens; tensor-core chunk sizes are multiples of it
MAX_SPLITS = kernel_define("FX_MAX_SPLITS")
THREADS = kernel_define("FX_THREADS")
COMBINE_THREADS = kernel_define("FX_COMBINE_THREADS")
MAX_CLUSTER = kernel_define("FX_MAX_CLUSTER")  # blocks of one on-chip merge
# The most floats a KV head's chunks exchange through distributed shared memory (chunks x
# group x head_dim) for them to merge on chip; larger exchanges go through the combine
# kernel, launched early: past it the combine kernel was ahead, below it the cluster
# (H200, 512 and 1024 tokens; docs/design.md has the runs).
CLUSTER_MAX_EXCHANGE = 8192


def mma_head_dim(head_dim: int, overrides: Overrides | None = None) -> int | None:
    """The fp16/bf16 tensor-core kernel's head_dim for a cache of ``head_dim``: its own, or
    for any other multiple of 8 the next of MMA_HEAD_DIMS up (the columns past it zeros,
    never read from memory: gqa_split_mma_<dt>_d<D>_r<head_dim>); None for the rest, and
    with ``OVERRIDES.padded_mma`` off for all but MMA_HEAD_DIMS."""
    if head_dim in MMA_HEAD_DIMS:
        return head_dim
    ov = OVERRIDES if overrides is None else overrides
    if head_dim % 8 or head_dim > MMA_HEAD_DIMS[-1] or not ov.padded_mma:
        return None
    return next(d for d in MMA_HEAD_DIMS if d >= head_dim)


@dataclass(frozen=True, eq=False)
class Overrides:
    """Choices of the planner that experiments turn off, one field each (all on by
    default). Read once from the environment at import (``from_env``); tests and
    benchmarks replace ``plan.OVERRIDES`` instead.

    Attributes:
        heads_per_block: query heads per block of the CUDA-core kernels (1, 2, 4 or 8;
            ``FERROX_SPLIT_HEADS_PER_BLOCK``).
        tc32: fp32 decodes of groups 2-8 on tensor cores (``FERROX_TC32=0``: CUDA cores).
        cluster: chunks merged on chip where they fit (``FERROX_CLUSTER=0``: the combine
            kernel always; the wide plans too).
        wide: the wide plans (``FERROX_WIDE=0``).
        early_combine: the combine kernel launched early, programmatic dependent launch
            (``FERROX_EARLY_COMBINE=0``); a verify's split kernel too, behind its tail.
        verify_block_tiles: the most tiles of 8 rows a verify's split block takes per pass
            over K and V at head_dim 128: 1, 2 or 4 (``FERROX_VERIFY_BLOCK_TILES``).
        verify_shared: where a KV head's rows take two or more split blocks (a verify of
            more than 32 rows per KV head; 16 below VERIFY_WIDE_FROM tokens), the blocks
            share a multiprocessor: their launch reserves no shared memory past the ring,
            so twice the warps hide the latency of the mma work (``FERROX_VERIFY_SHARED=0``:
            one block each).
        padded_mma: fp16/bf16 head_dims other than 64/128/256 (multiples of 8) on the
            tensor-core kernels, padded (``FERROX_PADDED_MMA=0``: CUDA cores).
        paired: two adjacent KV heads' rows read as one row of 2 x head_dim: None (the
            default) where the architecture's Tuning says (``paired_from``), True wherever
            the kernels can (experiments and tests, ``FERROX_PAIRED=1``), False never
            (``FERROX_PAIRED=0``).
        verify_rows: a verify on the rows kernel where it takes the call (``rows_plan``;
            the default: measured faster than the tail, split and combine kernels at every
            point of benchmarks/verify_rows_compare.py, docs/performance.md);
            ``FERROX_VERIFY_ROWS=0``: the tail, split and combine kernels take every verify
            (a 4-bit cache's are the rows kernels whatever this says).
        rows_min_chunk: the fewest tokens per chunk of a rows plan (0: the Tuning's;
            ``FERROX_ROWS_MIN_CHUNK``).
        rows4_warps: the fewest warps a block of a 4-bit cache's rows kernel takes
            (``FERROX_ROWS4_WARPS``; 0 or 1: as many as its rows need): warps past the
            rows only load and widen the steps, which is most of a 4-bit decode's work.
            2 measured 1.1-1.4x faster than 1 at every point of benchmarks/kv4_speed.py
            (q4, H100); 4 faster still at 4096 tokens and head_dim 256, slower at 32768+
            on 32/8/128 and 28/4/128.
        four_bit_split: a 4-bit cache's one-query decodes on the swapped split kernels
            (``four_bit_plan``, widened in registers) where they take the call
            (``FERROX_FOUR_BIT_SPLIT=0``: the rows kernel, as before them).
        four_bit_narrow_to: the longest plan length (tokens) a 4-bit cache's split plan
            takes the narrow kernels at (FX_WARPS4N_D<D>; past it FX_WARPS4_D<D>), 0 never
            (``FERROX_FOUR_BIT_NARROW_TO``).
        wide_tensor_cores: fp16/bf16 q over 16-bit or fp8 caches of head_dim 384 or 512
            on the latent tensor-core kernels with V rows of their own (records.py
            ``wide_launches``; ``FERROX_WIDE_TC=0``: the CUDA-core ``_d512`` kernels).
        latent_wgmma: MLA decodes of more than 32 query rows a latent head on an sm_90 GPU
            on the warpgroup-MMA latent kernel (split_latent_wg.cuh, blocks of 64 rows)
            where its chunks are ``latent_wg_min_chunk`` tokens or more
            (``FERROX_LATENT_WG=0``: the mma.sync latent kernel, blocks of 32, always).
        latent_wg_min_chunk: the shortest chunk (tokens) the wgmma latent kernel takes;
            shorter ones, the mma.sync kernel (default: latent_plan.LATENT_WG_MIN_CHUNK,
            where it measured faster; ``FERROX_LATENT_WG_MIN_CHUNK``).
    """

    heads_per_block: int = 4
    tc32: bool = True
    cluster: bool = True
    wide: bool = True
    early_combine: bool = True
    verify_block_tiles: int = 4
    verify_shared: bool = True
    padded_mma: bool = True
    paired: bool | None = None
    verify_rows: bool = True
    rows_min_chunk: int = 0
    rows4_warps: int = 2
    four_bit_split: bool = True
    four_bit_narrow_to: int = 8192
    wide_tensor_cores: bool = True
    latent_wgmma: bool = True
    latent_wg_min_chunk: int = LATENT_WG_MIN_CHUNK

    @classmethod
    def from_env(cls, env: Any = None) -> Overrides:
        """The overrides the ``FERROX_*`` variables of ``env`` (default: os.environ) ask for."""
        env = os.environ if env is None else env

        def on(name: str) -> bool:
            return env.get(name, "1") != "0"

        return cls(
            heads_per_block=int(env.get("FERROX_SPLIT_HEADS_PER_BLOCK", "4")),
            tc32=on("FERROX_TC32"),
            cluster=on("FERROX_CLUSTER"),
            wide=on("FERROX_WIDE"),
            early_combine=on("FERROX_EARLY_COMBINE"),
            verify_block_tiles=int(env.get("FERROX_VERIFY_BLOCK_TILES", "4")),
            verify_shared=on("FERROX_VERIFY_SHARED"),
            padded_mma=on("FERROX_PADDED_MMA"),
            paired={"0": False, "1": True}.get(env.get("FERROX_PAIRED", "")),
            verify_rows=on("FERROX_VERIFY_ROWS"),
            rows_min_chunk=int(env.get("FERROX_ROWS_MIN_CHUNK", "0")),
            rows4_warps=int(env.get("FERROX_ROWS4_WARPS", "2")),
            four_bit_split=on("FERROX_FOUR_BIT_SPLIT"),
            four_bit_narrow_to=int(env.get("FERROX_FOUR_BIT_NARROW_TO", "8192")),
            wide_tensor_cores=on("FERROX_WIDE_TC"),
            latent_wgmma=on("FERROX_LATENT_WG"),
            latent_wg_min_chunk=int(
                env.get("FERROX_LATENT_WG_MIN_CHUNK", str(LATENT_WG_MIN_CHUNK))
            ),
        )


OVERRIDES = Overrides.from_env()


def check_algorithm(algorithm: Any) -> str:
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")
    return str(algorithm)


@dataclass(frozen=True)
class SplitPlan:
    """How a split-KV decode is launched: which kernel (``spec``), how many chunks."""

    spec: KernelSpec
    head_tiles: int  # blocks per KV head along the group (tensor cores: tiles of 8 heads)
    lanes_per_token: int
    splits: int
    threads: int = THREADS  # per block
    tile: int = TILE  # chunk sizes are multiples of this many tokens
    stages: int = 0  # tensor-core kernels: steps in each warp's ring ...
    step_tokens: int = 16  # ... of this many tokens
    reserve_stages: int = 0  # the launch's shared memory holds this many (if more)
    cluster: int = 0  # blocks per thread block cluster (a KV head's chunks merge on chip,
    # no combine kernel; spec.cluster is the twin that does); 0: the combine kernel merges them

    @property
    def kernel(self) -> str:
        """The split kernel's name."""
        return self.spec.name

    @property
    def tensor_cores(self) -> bool:
        return self.spec.tensor_cores

    @property
    def paired(self) -> bool:
        """Two KV heads' rows read as one (the launch's n_kv_heads halved)."""
        return self.spec.paired

    @property
    def features(self) -> int:
        """The features compiled in (F_* bits)."""
        return self.spec.features

    @property
    def fp8(self) -> str:
        """An fp8 cache's format (FP8_FORMATS; the kernel reads bytes), or ""."""
        return self.spec.fp8

    @property
    def kernel_head_dim(self) -> int:
        """The head_dim the kernel is built for, when not the call's (padded, paired); 0."""
        s = self.spec
        return s.head_dim if s.family == "mma" and (s.row_dim != s.head_dim or s.paired) else 0

    def with_spec(self, **changes: Any) -> SplitPlan:
        """This plan with its kernel's fields changed (``KernelSpec.but``)."""
        return dataclasses.replace(self, spec=self.spec.but(**changes))

    def combine_spec(self, dtype: Any) -> KernelSpec | None:
        """The kernel merging this plan's chunks for a ``dtype`` output (None: a cluster
        plan, merged on chip), with the features it applies."""
        return None if self.cluster else KernelSpec.combine(kernel_dtype(dtype), self.features)

    def combine_kernel(self, dtype: Any) -> str | None:
        """The name of ``combine_spec(dtype)``."""
        spec = self.combine_spec(dtype)
        return None if spec is None else spec.name

    def workspace_floats(self, n_heads: int, head_dim: int) -> int:
        """Floats of scratch the launch needs: partial outputs, maxima and sums (none for a
        cluster plan, whose partials stay on chip)."""
        return 0 if self.cluster else n_heads * self.splits * (head_dim + 2)

    def grid(self, n_kv_heads: int) -> tuple[int, int, int]:
        """The split kernel's grid for a cache of ``n_kv_heads`` KV heads: the tensor-core
        kernels' (chunks, KV heads x head tiles; a paired plan's KV heads are the pairs,
        a cluster plan's clusters run along x), the CUDA-core ones' (head tiles, chunks,
        KV heads: a chunk's head tiles adjacent in launch order)."""
        if not self.tensor_cores:
            return (self.head_tiles, self.splits, n_kv_heads)
        launch_kv = n_kv_heads // 2 if self.paired else n_kv_heads
        return (self.splits, launch_kv * self.head_tiles, 1)

    def shared_bytes(self, head_dim: int, itemsize: int) -> int:
        """Dynamic shared memory of the split kernel: the tensor-core kernels' per-warp ring
        of K/V steps (warps * stages * step tokens * (K, V) * head_dim elements; as much
        as ``reserve_stages`` steps would take where that is more), and for a cluster plan
        the receive area its blocks push their partials into (the kernel finds it past
        its ring)."""
        if not self.tensor_cores:
            return 0
        head_dim = self.kernel_head_dim or head_dim
        steps = max(self.stages, self.reserve_stages)  # see MMA_RESERVE_STAGES
        if self.fp8 in FOUR_BIT_FORMATS:  # (a step: nibbles and a scale byte per 16)
            step = self.step_tokens * 2 * (head_dim // 2 + head_dim // 16)
        else:
            step = self.step_tokens * 2 * head_dim * itemsize
        ring = (self.threads // 32) * steps * step
        return ring + (cluster_recv_bytes(head_dim) if self.cluster else 0)


def cluster_recv_bytes(head_dim: int) -> int:
    """Bytes of a cluster block's receive area past its ring (FX_RECV_FLOATS in the kernel
    file, whose launches trap with less): maxima and sums of every block's heads, and the
    block's share of the output units from every block."""
    return 4 * (MAX_CLUSTER * 16 + (2 * head_dim + MAX_CLUSTER) * 4)


# The tensor-core kernels' static shared memory (Q staged, the warps' merge) by head_dim, at
# most: ptxas's numbers for sm_80 to sm_120 over every variant (features, fp8, clusters,
# pairs, padding), rounded up (largest seen: fp16/bf16 1952, 2592, 4640 bytes; fp32 5120,
# 9216, 17024). ``fitting`` adds them to a launch's dynamic shared memory to check it
# against the device's limit per block; tests/driver/test_arch_support.py checks every plan's sum.
MMA_STATIC_SHARED = {64: 2048, 128: 3072, 256: 5120}
TC32_STATIC_SHARED = {64: 5632, 128: 9728, 256: 17920}


def fitting(
    traits: DeviceTraits, head_dim: int, itemsize: int, plan: SplitPlan
) -> SplitPlan | None:
    """The tensor-core ``plan`` (q's ``itemsize``: 4 for the fp32 kernels) as a block of the
    device can take it: its launch's shared memory (dynamic, with a cluster's receive area,
    and its kernel's static) within ``traits.shared_per_block``, the reserve beyond the ring
    given up step by step where needed (on GPUs of 99-163 KiB per block one block of the
    ring alone fills a multiprocessor, which is what the reserve is for); None where the
    ring itself does not fit (the planner then takes the CUDA-core kernels)."""
    d = plan.kernel_head_dim or head_dim
    static = (TC32_STATIC_SHARED if itemsize == 4 else MMA_STATIC_SHARED)[d]
    while plan.shared_bytes(head_dim, itemsize) + static > traits.shared_per_block:
        if plan.reserve_stages <= plan.stages:
            return None
        plan = dataclasses.replace(plan, reserve_stages=plan.reserve_stages - 1)
    return plan


# A 4-bit cache's swapped split kernels (gqa_split_mma_<dt>_<q4|nvfp4>): warps and ring
# steps by head_dim (the traits' FX_WARPS4_D<D>, FX_STAGES4_D<D>), and the narrow kernels'
# for short contexts (FX_WARPS4N_D<D>, FX_STAGES4N_D<D>)
FOUR_BIT_WIDE = {
    d: (kernel_define(f"FX_WARPS4_D{d}"), kernel_define(f"FX_STAGES4_D{d}")) for d in MMA_HEAD_DIMS
}
FOUR_BIT_NARROW = {
    d: (kernel_define(f"FX_WARPS4N_D{d}"), kernel_define(f"FX_STAGES4N_D{d}"))
    for d in MMA_HEAD_DIMS
}

# The tensor-core kernels' shape by head_dim: warps per block and each warp's ring of
# steps (one fewer are in flight), for fp16/bf16 (FxWarps/FxStages, 16-token steps) and
# fp32 (FxTc32Shape, 8- or 16-token steps)
MMA_WARPS = {d: kernel_define(f"FX_WARPS_D{d}") for d in MMA_HEAD_DIMS}
MMA_STAGES = {d: kernel_define(f"FX_STAGES_D{d}") for d in MMA_HEAD_DIMS}
# ... and the steps' worth of shared memory a launch reserves where the ring is shallower
# (fp16/bf16 head_dim 128 and fp32 head_dim 64 and 128: one step in flight measured
# fastest, and the reserve keeps one block per multiprocessor, as the wave and
# clusters_fit assume)
MMA_RESERVE_STAGES = {d: kernel_define(f"FX_RESERVE_STAGES_D{d}") for d in MMA_HEAD_DIMS}
TC32_WARPS = {d: kernel_define(f"FX_TC32_WARPS_D{d}") for d in TC32_HEAD_DIMS}
TC32_STAGES = {d: kernel_define(f"FX_TC32_STAGES_D{d}") for d in TC32_HEAD_DIMS}
TC32_TOKENS = {d: kernel_define(f"FX_TC32_TOKENS_D{d}") for d in TC32_HEAD_DIMS}
TC32_RESERVE_STAGES = {d: kernel_define(f"FX_TC32_RESERVE_STAGES_D{d}") for d in TC32_HEAD_DIMS}
# The "wide" plans (fp16/bf16, head_dim 128): WIDE_CHUNKS chunks per KV head in clusters of
# as many blocks of WIDE_WARPS warps (gqa_split_mma_*_d128_wide_cluster), merged on chip,
# instead of 16 chunks and the combine kernel. With 8 KV heads the 64 blocks are a cluster
# per GPC of an H200; with 12 two clusters share some GPCs, and 4 or 32 KV heads make
# clusters of 16 or 2: all slower (docs/design.md), so the plan is for WIDE_KV_HEADS only.
WIDE_WARPS = kernel_define("FX_WIDE_WARPS")


@dataclass(frozen=True)
class Tuning:
    """The planner's measured thresholds for one architecture (TUNING); docs/design.md has
    the runs each came from.

    Attributes:
        cluster_max_exchange: see CLUSTER_MAX_EXCHANGE (H200, 512-8192 tokens).
        wide_kv_heads: the KV heads the wide plans are for (see WIDE_WARPS: 8 on the H200,
            one cluster per GPC).
        wide_chunks: chunks per KV head, and blocks per cluster, of a wide plan.
        wide_from: (largest group, shortest sequence) pairs: a wide plan for groups up to
            that size from that length (H200: groups of 2-5 from 1024/2048 tokens, 8 from
            16384; 6 and 7 not measured, so 8's).
        tc32_groups: the fp32 groups that take the split-TF32 tensor-core kernels (see
            ``tc32_for``; H200).
        rows_min_chunk: the fewest tokens per chunk of a verify's rows plan (``rows_plan``):
            a plan of more, shorter chunks writes more partials for the combine.
        paired_from: (head_dim, shortest sequence) pairs: fp16/bf16 head_dims that read two
            KV heads' rows as one (Overrides.paired) from that length, where the pair's
            group fits one tile of 8 query heads: where pairs were faster on the H200
            (graph-replayed, benchmarks/paired_compare.py). Not 64, 80 and 112 (level or
            slower), and never groups of 8 (two tiles, each reading the whole pair's row).
    """

    cluster_max_exchange: int = CLUSTER_MAX_EXCHANGE
    wide_kv_heads: int = 8
    wide_chunks: int = 8
    wide_from: tuple[tuple[int, int], ...] = ((4, 1024), (5, 2048), (8, 16384))
    tc32_groups: tuple[int, int] = (2, 8)
    rows_min_chunk: int = 128
    paired_from: tuple[tuple[int, int], ...] = (
        (8, 16384), (16, 16384), (24, 16384), (32, 16384), (40, 16384), (48, 16384),
        (56, 16384), (72, 16384), (88, 16384), (96, 32768), (104, 16384), (120, 16384),
    )  # fmt: skip


# Measured on the H200 (sm_90); other architectures take its values until measured.
TUNING: dict[str, Tuning] = {"sm_90": Tuning()}
DEFAULT_TUNING = TUNING["sm_90"]
WIDE_CHUNKS = DEFAULT_TUNING.wide_chunks
WIDE_KV_HEADS = DEFAULT_TUNING.wide_kv_heads


def wide_from(group: int, tuning: Tuning = DEFAULT_TUNING) -> int:
    """The shortest sequence a wide plan takes for groups of ``group`` (see Tuning)."""
    return next((seq for most, seq in tuning.wide_from if group <= most), 2**62)


@dataclass(frozen=True, eq=False)
class DeviceTraits:
    """What the planner knows of a device: numbers from the driver, the occupancy of the
    kernels it may choose (asked of the driver the first time, then remembered), and the
    architecture's measured thresholds. ``decode.launches.device_traits(device)`` reads a
    real one, ``decode.launches.arch_traits(arch)`` models a GPU of a supported
    architecture; tests build their own, with occupancy functions of their choosing.

    Attributes:
        key: identifies the device (a context handle) in the planner's memo.
        arch: e.g. ``"sm_90"``.
        compute_capability: (major, minor).
        multiprocessor_count: SMs.
        blocks_per_sm: ``(kernel spec, threads, dynamic shared bytes) -> blocks`` resident
            on a multiprocessor (cuOccupancyMaxActiveBlocksPerMultiprocessor), at least 1.
        active_clusters: ``(kernel spec, cluster, threads, dynamic shared bytes) ->
            clusters`` of ``cluster`` blocks resident at once on the device
            (cuOccupancyMaxActiveClusters; 0 where such a cluster cannot run).
        tuning: the thresholds (TUNING by arch, DEFAULT_TUNING elsewhere).
        shared_per_block: the most shared memory (static + dynamic) a block may opt in to,
            bytes (CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN; default: an
            H200's). Tensor-core plans whose ring does not fit take CUDA cores (``fitting``).
    """

    key: Any
    arch: str
    compute_capability: tuple[int, int]
    multiprocessor_count: int
    blocks_per_sm: Callable[[KernelSpec, int, int], int]
    active_clusters: Callable[[KernelSpec, int, int, int], int]
    tuning: Tuning = DEFAULT_TUNING
    shared_per_block: int = ARCHS["sm_90"].shared_per_block


def plan(
    traits: DeviceTraits,
    dtype: Any,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    plan_seq: int,
    aligned: bool = True,
    overrides: Overrides | None = None,
    features: int = 0,
    fp8: str = "",
    verify: bool = False,
) -> SplitPlan:
    """The split plan for decodes of up to ``plan_seq`` tokens of this shape on a device of
    ``traits`` (``decode.launches.plan_split`` remembers it per device): a function of its
    arguments alone, ``overrides`` (default: OVERRIDES) included.

    The grid is at most one full wave of resident blocks; each block's chunk is a multiple
    of the plan's tile, computed on the device from the actual length (which may be
    shorter, as in a captured graph sized for the cache's capacity). CUDA-core tiles are the
    tokens a block takes per iteration (8-64). Tensor-core tiles are 64 tokens (32 for the
    fp32 head_dim 256 kernel), and a KV head's chunks merge on chip where they fit resident
    clusters (clusters_fit); fp16/bf16 head_dim 128 plans for WIDE_KV_HEADS KV heads take
    WIDE_CHUNKS chunks per KV head of 8-warp blocks in clusters from ``wide_from(group)``
    tokens (wide_plan).

    With ``features`` (F_* bits), the same kernel with them compiled in (the fp32
    tensor-core ones without clusters); a window's plan covers the window (``plan_seq`` at
    most the window, the caller's part). With ``fp8`` (an fp8 cache's format, ``dtype``
    q's), the fp16/bf16 plan's kernel for a cache of bytes (never paired).

    With ``verify`` (the split kernel of a many-query decode, split_verify.cuh: ``n_heads``
    counts the rows, n_q x the query heads), a plan whose chunks the combine kernel merges
    (no clusters, wide or paired plans) and whose fp16/bf16 tensor-core kernel takes any
    group, in tiles of 8 rows.

    Raises:
        ValueError: ``fp8`` where the plan has no such kernel (q not fp16/bf16, a head_dim
            not a multiple of 8, groups past 16).
    """
    if verify:
        overrides = dataclasses.replace(
            OVERRIDES if overrides is None else overrides, cluster=False, wide=False,
            paired=False,
        )  # fmt: skip
    if fp8:
        return _fp8_plan(traits, dtype, n_heads, n_kv_heads, head_dim, plan_seq, aligned,
                         overrides, features, fp8, verify)  # fmt: skip
    if not features:
        return _plan(traits, dtype, n_heads, n_kv_heads, head_dim, plan_seq, aligned, overrides,
                     verify)  # fmt: skip
    ov = OVERRIDES if overrides is None else overrides
    ov = dataclasses.replace(ov, paired=False)  # (the paired kernels take no features)
    found = _plan(traits, dtype, n_heads, n_kv_heads, head_dim, plan_seq, aligned, ov, verify)
    if found.cluster and found.spec.family != "mma":
        # the fp32 tensor-core kernels take features without clusters (not built)
        ov = dataclasses.replace(ov, cluster=False, wide=False)
        found = _plan(traits, dtype, n_heads, n_kv_heads, head_dim, plan_seq, aligned, ov,
                      verify)  # fmt: skip
    return found.with_spec(features=features)


def _fp8_plan(
    traits: DeviceTraits, dtype: Any, n_heads: int, n_kv_heads: int, head_dim: int,
    plan_seq: int, aligned: bool, overrides: Overrides | None, features: int, fp8: str,
    verify: bool = False,
) -> SplitPlan:  # fmt: skip
    """``plan`` for an fp8 cache (see there)."""
    if fp8 not in FP8_FORMATS:
        raise ValueError(f"fp8: expected one of {sorted(FP8_FORMATS)}, got {fp8!r}")
    if traits.compute_capability < FP8_FROM:
        major, minor = traits.compute_capability
        raise ValueError(
            f"fp8: fp8 caches need compute capability 8.9 or newer, this GPU ({traits.arch}) "
            f"has {major}.{minor}"
        )
    # No wide plans: their 64 blocks read an fp8 cache slower than the plans of a full
    # wave, as the widening costs each block more work per byte (H200, docs/design.md).
    # No pairs (the kernels take none).
    ov = dataclasses.replace(
        OVERRIDES if overrides is None else overrides, paired=False, wide=False
    )
    found = plan(traits, dtype, n_heads, n_kv_heads, head_dim, plan_seq, aligned, ov,
                 verify=verify)  # fmt: skip
    if found.spec.family == "generic" and found.spec.head_dim and found.spec.dtype != "f32":
        # head_dims past the tensor-core kernels': CUDA cores, the rows widened as read
        return found.with_spec(fp8=fp8, features=features)
    if found.spec.family != "mma" or head_dim % 8:
        raise ValueError(
            f"fp8: no kernel for q {np.dtype(dtype)}, head_dim {head_dim} and groups of "
            f"{n_heads // n_kv_heads} on {traits.arch} (fp8 caches take fp16/bf16 q, head_dims "
            f"that are multiples of 8, groups up to 16, and a tensor-core ring that fits the "
            f"GPU's {traits.shared_per_block // 1024} KiB of shared memory per block: on GPUs "
            f"of 99 KiB, head_dims up to 128)"
        )
    # (an fp8 ring takes its kernel's own depth, not a padded head_dim's: FxStages)
    own = MMA_STAGES[found.spec.head_dim]
    return dataclasses.replace(found, spec=found.spec.but(fp8=fp8, features=features), stages=own)


def four_bit_plan(
    traits: DeviceTraits, dtype: Any, n_heads: int, n_kv_heads: int, head_dim: int,
    plan_seq: int, aligned: bool, features: int, fmt: str, rotate: bool = False,
    overrides: Overrides | None = None,
) -> SplitPlan | None:  # fmt: skip
    """The split plan of a 4-bit cache's one-query decode on the swapped split kernels
    (``fmt`` "q4" or "nvfp4", K rotated where ``rotate``), or None where they do not take
    it (the rows kernel does: ``rows_plan``): fp32 q, head_dims other than 64/128/256,
    groups past 16, arrays not 16-byte aligned, GPUs before compute
    capability 8.0 (8.9 for nvfp4's e4m3 scales), a ring past a block's shared memory, or
    ``overrides.four_bit_split`` off. Chunks fill one wave of resident blocks, merged on
    chip where the clusters fit, as ``plan``'s fp16/bf16 tensor-core plans are."""
    ov = OVERRIDES if overrides is None else overrides
    name = kernel_dtype(dtype)
    group = n_heads // n_kv_heads
    if not ov.four_bit_split or name == "f32" or not aligned:
        return None
    if head_dim not in MMA_HEAD_DIMS or group > 16 or fmt not in FOUR_BIT_FORMATS:
        return None
    least = FP8_FROM if fmt == NVFP4_FORMAT else TENSOR_CORES_FROM
    if traits.compute_capability < least:
        return None
    tiles = -(-group // 8)
    narrow = plan_seq <= ov.four_bit_narrow_to
    warps, stages = (FOUR_BIT_NARROW if narrow else FOUR_BIT_WIDE)[head_dim]
    spec = KernelSpec("mma", name, head_dim, tiles=tiles, fp8=fmt, rotate=rotate,
                      features=features, narrow=narrow)  # fmt: skip
    chosen = fitting(traits, head_dim, 2, SplitPlan(
        spec, tiles, 32, 1, 32 * warps, TILE, stages, 16,
    ))  # fmt: skip
    if chosen is None:
        return None
    return _splits_and_clusters(traits, chosen, n_kv_heads, group, head_dim, plan_seq, 2, ov)


VERIFY_WIDE_FROM = 16384  # a verify's split blocks take up to 32 rows from here (else 16)


def _plan(
    traits: DeviceTraits,
    dtype: Any,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    plan_seq: int,
    aligned: bool = True,
    overrides: Overrides | None = None,
    any_group: bool = False,
) -> SplitPlan:
    ov = OVERRIDES if overrides is None else overrides
    tuning = traits.tuning
    group = n_heads // n_kv_heads
    name = kernel_dtype(dtype)
    tensor_cores = traits.compute_capability >= TENSOR_CORES_FROM
    mma_dim = mma_head_dim(head_dim, ov) if name != "f32" and tensor_cores else None
    pair_dim = mma_head_dim(2 * head_dim, ov) if name != "f32" and tensor_cores else None
    paired_from = dict(tuning.paired_from).get(head_dim)
    pays = paired_from is not None and plan_seq >= paired_from and 2 * group <= 8
    if (
        (ov.paired or (ov.paired is None and pays)) and pair_dim is not None
        and head_dim % 8 == 0 and n_kv_heads % 2 == 0 and 2 * group <= 16 and aligned
    ):  # fmt: skip
        paired = _paired_plan(traits, name, n_heads, n_kv_heads, head_dim, plan_seq, pair_dim)
        if paired is not None:
            return paired
    chosen: SplitPlan | None = None
    if mma_dim is not None and (group <= 16 or any_group) and aligned:  # past 8: tiles of 8
        tiles = -(-group // 8)
        # a verify's rows past 8 at head_dim 128 (the swapped body): 16 or 32 rows per block,
        # K and V read once for every tile (Overrides.verify_block_tiles); 32 only from
        # VERIFY_WIDE_FROM tokens (H200: 5-10% faster there, 2-11% slower at 4096)
        most_tiles = ov.verify_block_tiles if any_group and mma_dim == 128 else 1
        if plan_seq < VERIFY_WIDE_FROM:
            most_tiles = min(most_tiles, 2)
        per_block = 1 if tiles == 1 or most_tiles < 2 else 2 if tiles == 2 or most_tiles < 4 else 4
        chosen = fitting(traits, head_dim, 2, SplitPlan(
            KernelSpec("mma", name, mma_dim, head_dim, tiles=min(tiles, 2),
                       block_tiles=per_block),
            -(-tiles // per_block), 32, 1, 32 * MMA_WARPS[mma_dim], TILE,
            padded_stages(mma_dim, head_dim) or MMA_STAGES[mma_dim], 16,
            reserve_stages=(
                0 if per_block > 1 and tiles > per_block and ov.verify_shared
                else MMA_RESERVE_STAGES[mma_dim]
            ),
        ))  # fmt: skip
    elif (
        name == "f32" and tensor_cores and head_dim in TC32_HEAD_DIMS and aligned
        and tc32_for(group, ov, tuning)
    ):  # fmt: skip
        chosen = fitting(traits, head_dim, 4, SplitPlan(
            KernelSpec("tc32", "f32", head_dim), 1, 32, 1, 32 * TC32_WARPS[head_dim], TILE,
            TC32_STAGES[head_dim], TC32_TOKENS[head_dim],
            reserve_stages=TC32_RESERVE_STAGES[head_dim],
        ))  # fmt: skip
    if chosen is None:  # CUDA cores: no tensor-core kernel, or its ring does not fit here
        # (head_dims past 256: the _d512 kernels, two chunks of 8 a lane, a warp a token and
        # at most WIDE_ROWS_MAX_HEADS heads a block, for their registers)
        wide_rows = head_dim > NARROW_ROWS_HEAD_DIM
        cap = min(ov.heads_per_block, WIDE_ROWS_MAX_HEADS) if wide_rows else ov.heads_per_block
        gt = next(g for g in (1, 2, 4, 8) if g >= min(group, cap, 8))
        lpt = 1
        while lpt * 8 < head_dim and lpt < 32:
            lpt *= 2
        vec = head_dim % 8 == 0 and aligned
        spec = KernelSpec("generic", name, WIDE_ROWS_HEAD_DIM if wide_rows else 0,
                          heads_per_block=gt, vec=vec)  # fmt: skip
        chosen = SplitPlan(spec, -(-group // gt), lpt, 1, THREADS, cuda_core_tile(lpt))
    spec, tiles, tile, threads = chosen.spec, chosen.head_tiles, chosen.tile, chosen.threads
    itemsize = np.dtype(dtype).itemsize
    shared = chosen.shared_bytes(head_dim, itemsize)
    # Splits: as many chunks per KV head as fill one wave of resident blocks, and no more.
    # A block past what the GPU holds at once runs in a second wave, doubling the time of
    # the tail; fewer blocks leave multiprocessors idle while the cache streams. E.g.
    # 32/8/128 bf16 on an H200: one block of the head_dim 128 kernel per multiprocessor,
    # 132 resident, 8 KV heads x 1 tile: 16 chunks per KV head (128 blocks); at 512 tokens
    # 8 chunks of 64 (a chunk is at least one tile).
    wave = traits.blocks_per_sm(spec, threads, shared) * traits.multiprocessor_count
    most = max(1, min(wave // (n_kv_heads * tiles), MAX_SPLITS))
    seq = max(plan_seq, 1)
    if not spec.tensor_cores:
        return dataclasses.replace(chosen, splits=min(most, -(-seq // tile)))
    if name == "f32" and head_dim == 256:
        # 32-token tiles, no clusters: this kernel's steps (8 tokens of split-TF32 products
        # over 256 columns) are long dependent chains, so short sequences want more blocks
        # with fewer steps each (16-token tiles and clusters were slower: docs/design.md).
        tile = 32
        return dataclasses.replace(chosen, splits=min(most, -(-seq // tile)), tile=tile)
    # 64-token tiles, merged on chip where the chunks fit resident clusters and exchange at
    # most CLUSTER_MAX_EXCHANGE floats: smaller tiles (more chunks, in clusters or not)
    # measured level or slower for these kernels.
    wide = wide_plan(traits, chosen, name, n_kv_heads, group, head_dim, seq, ov)
    if wide is not None:
        return wide
    return _splits_and_clusters(traits, chosen, n_kv_heads, group, head_dim, seq, itemsize, ov)


def _splits_and_clusters(
    traits: DeviceTraits, chosen: SplitPlan, n_kv_heads: int, group: int, head_dim: int,
    seq: int, itemsize: int, ov: Overrides,
) -> SplitPlan:  # fmt: skip
    """The fp16/bf16 tensor-core plan ``chosen`` with its chunks: as many per KV head as
    fill one wave of resident blocks (and no more than ``seq`` tokens need), merged on chip
    where the clusters fit and exchange at most the Tuning's ``cluster_max_exchange``
    floats, else by the combine kernel."""
    spec, tiles, tile, threads = chosen.spec, chosen.head_tiles, chosen.tile, chosen.threads
    shared = chosen.shared_bytes(head_dim, itemsize)
    wave = traits.blocks_per_sm(spec, threads, shared) * traits.multiprocessor_count
    most = max(1, min(wave // (n_kv_heads * tiles), MAX_SPLITS))
    splits = min(most, -(-max(seq, 1) // tile))
    # (the cluster entry's receive area comes past the launch's reserve: where both do not
    # fit a block, the reserve gives way, down to the ring)
    clustered = fitting(traits, head_dim, itemsize, dataclasses.replace(
        chosen, spec=spec.but(cluster=True), splits=splits, tile=tile, cluster=splits
    ))  # fmt: skip
    exchange = splits * min(group, 8) * head_dim  # floats one cluster (a head tile) merges
    if (
        clustered is not None and exchange <= traits.tuning.cluster_max_exchange
        and clusters_fit(
            traits, clustered.spec, splits, n_kv_heads * tiles, threads,
            clustered.shared_bytes(head_dim, itemsize), ov,
        )
    ):  # fmt: skip
        return clustered
    return dataclasses.replace(chosen, splits=splits, tile=tile)


def _paired_plan(
    traits: DeviceTraits, name: str, n_heads: int, n_kv_heads: int, head_dim: int,
    plan_seq: int, kernel_dim: int,
) -> SplitPlan | None:  # fmt: skip
    """The plan of two KV heads' rows read as one row of 2 x head_dim (Overrides.paired):
    the kernel of ``kernel_dim`` for n_kv_heads / 2 KV heads of groups twice the size,
    merged by the combine kernel; None where its ring does not fit a block of the device."""
    pairs, group = n_kv_heads // 2, 2 * (n_heads // n_kv_heads)
    tiles = -(-group // 8)
    spec = KernelSpec("mma", name, kernel_dim, 2 * head_dim, tiles=tiles, paired=True)
    chosen = fitting(traits, head_dim, 2, SplitPlan(
        spec, tiles, 32, 1, 32 * MMA_WARPS[kernel_dim], TILE, MMA_STAGES[kernel_dim], 16,
        reserve_stages=MMA_RESERVE_STAGES[kernel_dim],
    ))  # fmt: skip
    if chosen is None:
        return None
    shared = chosen.shared_bytes(head_dim, 2)
    # (the occupancy of the unpaired kernel of kernel_dim: the same ring, the same block)
    wave = traits.blocks_per_sm(KernelSpec("mma", name, kernel_dim), chosen.threads, shared)
    most = max(1, min(wave * traits.multiprocessor_count // (pairs * tiles), MAX_SPLITS))
    return dataclasses.replace(chosen, splits=min(most, -(-max(plan_seq, 1) // TILE)))


def wide_plan(
    traits: DeviceTraits,
    plan: SplitPlan,
    name: str,
    n_kv_heads: int,
    group: int,
    head_dim: int,
    seq: int,
    overrides: Overrides | None = None,
) -> SplitPlan | None:
    """The wide plan replacing the fp16/bf16 tensor-core ``plan`` (see WIDE_WARPS), or None
    where it does not apply: another head_dim, other than WIDE_KV_HEADS KV heads, a sequence
    shorter than ``wide_from(group)``, clusters that would not all be resident, or
    ``overrides.wide`` off (a comparison knob; ``cluster`` off turns it off too), or a
    block's shared memory larger than the device allows (``fitting``)."""
    ov = OVERRIDES if overrides is None else overrides
    tuning = traits.tuning
    if not ov.wide or name == "f32" or head_dim != WIDE_HEAD_DIM:
        return None
    if n_kv_heads != tuning.wide_kv_heads or seq < wide_from(group, tuning):
        return None
    wide = dataclasses.replace(
        plan,
        spec=KernelSpec("mma", name, head_dim, wide=True, cluster=True),
        threads=32 * WIDE_WARPS,
        reserve_stages=0,  # WIDE_WARPS x stages steps already fill a multiprocessor's share
        splits=tuning.wide_chunks,
        tile=TILE,
        cluster=tuning.wide_chunks,
    )
    shared = wide.shared_bytes(head_dim, 2)
    if fitting(traits, head_dim, 2, wide) is None or not clusters_fit(
        traits, wide.spec, tuning.wide_chunks, n_kv_heads, wide.threads, shared, ov
    ):
        return None
    return wide


def clusters_fit(
    traits: DeviceTraits,
    kernel: KernelSpec,
    cluster: int,
    n_clusters: int,
    threads: int,
    shared: int,
    overrides: Overrides | None = None,
) -> bool:
    """Whether ``n_clusters`` clusters of ``cluster`` blocks of the tensor-core kernel
    ``kernel`` run at once (one wave: a cluster waiting for another to finish would
    double the time), so each KV head's chunks can merge on chip instead of in a combine
    kernel. Needs compute capability 9.0 (clusters of at most ``MAX_CLUSTER`` blocks);
    ``overrides.cluster`` off turns it off (a comparison knob)."""
    if not (OVERRIDES if overrides is None else overrides).cluster:
        return False
    if traits.compute_capability < (9, 0) or cluster > MAX_CLUSTER:
        return False
    return traits.active_clusters(kernel, cluster, threads, shared) >= n_clusters


def tc32_for(
    group: int, overrides: Overrides | None = None, tuning: Tuning = DEFAULT_TUNING
) -> bool:
    """Whether an fp32 decode takes the split-TF32 tensor-core kernel (whose time does not
    depend on the group: it always computes 8 rows) rather than a CUDA-core one (whose
    time grows with the group): the groups of ``tuning.tc32_groups``, where the tensor
    cores measured faster (H200, docs/design.md). Groups of 1 (MHA) stay on CUDA cores,
    which stream at the ceiling. ``OVERRIDES.tc32`` off keeps every group on CUDA cores
    (a comparison knob)."""
    if not (OVERRIDES if overrides is None else overrides).tc32:
        return False
    low, high = tuning.tc32_groups
    return low <= group <= high


def cuda_core_tile(lanes_per_token: int) -> int:
    """Chunk granularity of the CUDA-core kernels: the tokens a block takes per iteration
    (two per lane group), 8 to TILE. Each iteration is a trip to memory the next waits
    for, so a short sequence gets many short chunks rather than a few long ones."""
    return max(8, min(TILE, 2 * (THREADS // 32) * (32 // lanes_per_token)))


# A verify's rows kernel (split_rows.cuh): tokens per step of its block's ring, steps by
# head_dim
ROWS_TOKENS = kernel_define("FX_ROWS_TOKENS")
ROWS_STAGES = {d: kernel_define(f"FX_ROWS_STAGES_D{d}") for d in ROWS_HEAD_DIMS}


@dataclass(frozen=True)
class RowsPlan:
    """A verify of ``n_q`` queries on the rows kernel (split_rows.cuh): blocks of
    ``spec.row_warps`` warps of 16 rows (a KV head's n_q x group rows in ``row_blocks``
    blocks), ``splits`` chunks of whole ``tile`` tokens, merged by its combine kernel."""

    spec: KernelSpec
    row_blocks: int
    splits: int
    tile: int = ROWS_TOKENS
    combine_features: int = 0  # the sinks, the LSE and the window (COMBINE_FEATURES)

    @property
    def threads(self) -> int:
        return self.spec.row_warps * 32

    @property
    def features(self) -> int:
        return self.spec.features

    def combine_spec(self) -> KernelSpec:
        """The kernel merging the chunks, with the features that reach it."""
        return KernelSpec("vrcombine", self.spec.dtype, features=self.combine_features)

    def workspace_floats(self, rows: int, head_dim: int) -> int:
        """Floats of scratch: each row's partial output, maximum and sum per chunk."""
        return rows * self.splits * (head_dim + 2)

    def grid(self, n_kv_heads: int) -> tuple[int, int, int]:
        return (self.splits, n_kv_heads * self.row_blocks, 1)

    def shared_bytes(self, itemsize: int) -> int:
        """Dynamic shared memory: the ring's steps of K and V (an fp8 cache's bytes, a q4
        cache's nibbles and scales; then one step widened to fp16), then q's rows
        (``itemsize``: q's)."""
        d, fmt = self.spec.head_dim, self.spec.fp8
        step = 2 * ROWS_TOKENS * d
        four_bit = step // 2 + step // 16  # nibbles and a scale byte per 16 (q4: 2 per 32)
        step_bytes = step * itemsize if not fmt else four_bit if fmt in FOUR_BIT_FORMATS else step
        if self.spec.v_fp8:  # K's half of a step in K's format, V's in V's
            step_bytes = sum(four_bit // 2 if f in FOUR_BIT_FORMATS else step // 2
                             for f in (fmt, self.spec.v_fp8))  # fmt: skip
        ring = ROWS_STAGES[d] * step_bytes
        return ring + (step * 2 if fmt else 0) + 16 * self.spec.row_warps * d * itemsize


def rows_plan(
    traits: DeviceTraits, dtype: Any, n_q: int, n_heads: int, n_kv_heads: int, head_dim: int,
    plan_seq: int, aligned: bool, features: int, fp8: str = "",
    overrides: Overrides | None = None, rotate: bool = False,
) -> RowsPlan | None:  # fmt: skip
    """The rows kernel's plan for a verify of ``n_q`` queries of up to ``plan_seq`` tokens
    (the queries' included), or None where it does not take the call (the tail, split and
    combine kernels do): fp32, head_dims other than ROWS_HEAD_DIMS, arrays not 16-byte
    aligned, GPUs without cp.async (an fp8 cache, ``fp8``: without fp8 conversions), a
    ring past the block's shared memory. ``fp8`` "q4" or "nvfp4": a 4-bit cache (its only
    kernels, taken whatever ``Overrides.verify_rows`` says), K rotated where ``rotate``;
    K and V in formats of their own (``mixed_format``, e.g. "e4m3+q4": the same, each
    side's format asking what it asks of the device).

    A KV head's n_q x group rows take blocks of up to ROWS_MAX_WARPS warps of 16 rows;
    the chunks fill one wave of resident blocks, each of at least the Tuning's
    ``rows_min_chunk`` tokens (every chunk's partials cost the combine a read of
    rows x head_dim floats).
    """
    ov = OVERRIDES if overrides is None else overrides
    name = np.dtype(dtype).name
    k_fmt, v_fmt = kv_formats(fp8)
    if k_fmt != v_fmt:  # K and V in formats of their own: this kernel reads them alone
        return _mixed_rows_plan(traits, dtype, n_q, n_heads, n_kv_heads, head_dim, plan_seq,
                                aligned, features, k_fmt, v_fmt, ov, rotate)  # fmt: skip
    four_bit = fp8 in FOUR_BIT_FORMATS  # (no other kernels: the override is not asked)
    if not (ov.verify_rows or four_bit) or name not in ("float16", "bfloat16") or not aligned:
        return None
    if head_dim not in ROWS_HEAD_DIMS or traits.compute_capability < TENSOR_CORES_FROM:
        return None
    if fp8 in FOUR_BIT_FORMATS:
        if fp8 == NVFP4_FORMAT and traits.compute_capability < FP8_FROM:  # (e4m3 scales)
            return None
    elif fp8 and (fp8 not in FP8_FORMATS or traits.compute_capability < FP8_FROM):
        return None
    return _rows_spread(traits, dtype, n_q, n_heads, n_kv_heads, head_dim, plan_seq, features,
                        fp8, "", ov, rotate)  # fmt: skip


def _mixed_rows_plan(
    traits: DeviceTraits, dtype: Any, n_q: int, n_heads: int, n_kv_heads: int, head_dim: int,
    plan_seq: int, aligned: bool, features: int, k_fmt: str, v_fmt: str, ov: Overrides,
    rotate: bool,
) -> RowsPlan | None:  # fmt: skip
    """``rows_plan`` of a cache of K in ``k_fmt`` and V in ``v_fmt`` (QUANTIZED_FORMATS)."""
    formats = (k_fmt, v_fmt)
    if not set(formats) <= set(QUANTIZED_FORMATS):
        raise ValueError(f"fp8: K's and V's formats two of {QUANTIZED_FORMATS}, got "
                         f"{mixed_format(k_fmt, v_fmt)!r}")  # fmt: skip
    if np.dtype(dtype).name not in ("float16", "bfloat16") or not aligned:
        return None
    if head_dim not in ROWS_HEAD_DIMS or traits.compute_capability < TENSOR_CORES_FROM:
        return None
    # (a KVCache is token-major; one side at least is fp8 or nvfp4: fp8 conversions)
    if features & F_HND or traits.compute_capability < FP8_FROM:
        return None
    return _rows_spread(traits, dtype, n_q, n_heads, n_kv_heads, head_dim, plan_seq, features,
                        k_fmt, v_fmt, ov, rotate)  # fmt: skip


def _rows_spread(
    traits: DeviceTraits, dtype: Any, n_q: int, n_heads: int, n_kv_heads: int, head_dim: int,
    plan_seq: int, features: int, fp8: str, v_fp8: str, ov: Overrides, rotate: bool,
) -> RowsPlan | None:  # fmt: skip
    """A rows plan's blocks and chunks, the call taken (None: its ring past the block's
    shared memory)."""
    four_bit = bool({fp8, v_fp8} & set(FOUR_BIT_FORMATS))  # (its warps widen the steps)
    rows_kv = n_q * (n_heads // n_kv_heads)
    warps = min(ROWS_MAX_WARPS, max(-(-rows_kv // 16), ov.rows4_warps if four_bit else 1))
    row_blocks = -(-rows_kv // (16 * warps))
    spec = KernelSpec("vrows", kernel_dtype(dtype), head_dim=head_dim, row_warps=warps, fp8=fp8,
                      features=features & ~(F_SINKS | F_LSE), rotate=rotate,
                      v_fp8=v_fp8)  # fmt: skip
    found = RowsPlan(spec, row_blocks, 1, combine_features=features & COMBINE_FEATURES)
    shared = found.shared_bytes(np.dtype(dtype).itemsize)
    if shared > traits.shared_per_block:
        return None
    wave = traits.multiprocessor_count * traits.blocks_per_sm(spec, found.threads, shared)
    min_chunk = ov.rows_min_chunk or traits.tuning.rows_min_chunk
    splits = min(wave // (n_kv_heads * row_blocks), -(-plan_seq // min_chunk), MAX_SPLITS)
    return dataclasses.replace(found, splits=max(1, splits))
