"""The decode's kernels, planned: which split-KV kernel, how many chunks, how they merge,
and the launches that make a decode.

Two kernel families: the split-KV kernels (default; tensor cores for fp16/bf16 and, with
split TF32 products, for fp32 with groups of 2-8; CUDA cores otherwise) and the parity
kernel (ferrox-cuda's algorithm, corrected), kept as the reference path. ``decode`` runs
them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..archs import ARCHS, FP8_FROM, TENSOR_CORES_FROM, ArchLimits, arch_limits, occupancy
from ..driver.compiler import KernelResources, Program
from ..driver.device import Device
from ..driver.launch import Kernel, PackedLaunch
from ..driver.memory import DeviceArray, empty
from ..driver.module_cache import get_program
from ..errors import CudaError, FerroxError
from ..kernels.catalogue import get_kernel, kernel_source
from ..kernels.traits import SPLIT_TRAITS, padded_stages
from .checks import dtype_name

__all__ = [
    "ALGORITHMS",
    "OVERRIDES",
    "TUNING",
    "DeviceTraits",
    "Launch",
    "Overrides",
    "SplitPlan",
    "Tuning",
    "arch_traits",
    "fitting",
    "parity_launches",
    "plan",
    "plan_split",
    "split_launches",
]

ALGORITHMS = ("auto", "split", "parity")
SPLIT_FILE = "gqa_decode_split.cu"


@functools.cache
def kernel_define(name: str) -> int:
    """The value of the split kernels' compile-time constant ``name`` (kernel_traits: the
    kernels are compiled with the same table, so the host's grids and shared memory sizes
    cannot drift from them)."""
    value = SPLIT_TRAITS.get(name)
    if value is None:
        raise RuntimeError(f"{SPLIT_FILE} defines no integer {name} (kernel_traits.SPLIT_TRAITS)")
    return value


_ENTRY_TYPES = {"f32": "float", "f16": "fx_half", "bf16": "fx_bf16"}


def split_entry(name: str) -> str:
    """The line of ``gqa_decode_split.cu``'s own macros that instantiates kernel ``name``
    (with its ``_cluster`` twin, where it has one), for a module of that kernel alone.

    Raises:
        ValueError: no split kernel has that name.
    """
    base = name.removesuffix("_cluster")
    parts = base.split("_")
    try:
        if "p2" in parts and name == base and parts[:3] == ["gqa", "split", "mma"]:
            # gqa_split_mma_<dt>_d<D>_r<2 x head_dim>_p2[_t2]: two KV heads' rows as one
            tiled = parts[-1] == "t2"
            if len(parts) == 7 + tiled and parts[6] == "p2" and parts[3] != "f32":
                d, dr = int(parts[4][1:]), int(parts[5][1:])
                ok = parts[4][0] == "d" and parts[5][0] == "r" and d in MMA_HEAD_DIMS
                if ok and 0 < dr <= d and dr % 16 == 0:
                    flag = "true" if tiled else "false"
                    return f"FX_MMA_PAIR_ENTRY({name}, {_ENTRY_TYPES[parts[3]]}, {d}, {dr}, {flag})"
            raise ValueError(name)
        if len(parts) > 4 and parts[4] in FP8_FORMATS and base.startswith("gqa_split_mma_"):
            return _fp8_entry(name, parts, name != base)
        if parts[-1][:1] == "x" and parts[-1][1:].isdigit():  # <kernel>_x<F>[_cluster]
            return _feature_entry(name, parts[:-1], int(parts[-1][1:]), name != base)
        if base.startswith("gqa_split_combine_"):
            return f"FX_COMBINE_ENTRY({name}, {_ENTRY_TYPES[parts[3]]})"
        if _is_wide(parts) and name != base:  # gqa_split_mma_<dt>_d128_wide_cluster
            return f"FX_MMA_WIDE_ENTRY({name}, {_ENTRY_TYPES[parts[3]]})"
        if base.startswith("gqa_split_mma_") and parts[3] != "f32":  # (fp32: gqa_split_tc32_*)
            return _mma_entry(base, parts)
        if base.startswith("gqa_split_tc32_f32_"):  # gqa_split_tc32_f32_d<D>
            return f"FX_TC32_ENTRY({base}, {int(parts[4][1:])})"
        if len(parts) == 5 and parts[3][0] == "g" and parts[4] in ("vec", "any"):
            vec = "true" if parts[4] == "vec" else "false"  # gqa_split_<dt>_g<G>_<vec|any>
            return f"FX_GENERIC_ENTRY({name}, {_ENTRY_TYPES[parts[2]]}, {int(parts[3][1:])}, {vec})"
    except (KeyError, ValueError, IndexError):
        pass
    raise ValueError(f"kernel: {SPLIT_FILE} has no kernel {name!r}")


# fp8 caches (KVCache dtype float8_e4m3fn / float8_e5m2): the kernels' Q8 (FX_E4M3, FX_E5M2)
FP8_FORMATS = {"e4m3": 1, "e5m2": 2}


def _fp8_entry(name: str, parts: list[str], cluster: bool) -> str:
    """split_entry of an fp8 cache's kernel: gqa_split_mma_<dt>_<e4m3|e5m2>_d<D>[_r<DR>]
    [_t2]_x<F> (with its _cluster twin), or gqa_split_mma_<dt>_<fmt>_d128_wide_x<F>_cluster;
    the cache's head_dim DR a multiple of 8 (the ring's 16-byte chunks, or 8-byte ones where
    DR is not a multiple of 16); ``parts``: the name's
    without ``_cluster``."""
    inner = parts
    bits = inner[-1]
    if parts[3] not in ("f16", "bf16") or bits[:1] != "x" or not bits[1:].isdigit():
        raise ValueError(name)
    if not 0 <= int(bits[1:]) < F_LIMIT:
        raise ValueError(name)
    qt, q8, mask = _ENTRY_TYPES[parts[3]], FP8_FORMATS[parts[4]], int(bits[1:])
    plain = [*parts[:4], *inner[5:-1]]  # the fp16/bf16 kernel's name
    if plain[-1] == "wide":
        if not (cluster and _is_wide(plain)):
            raise ValueError(name)
        return f"FX_MMA8_WIDE_KERNEL({name}, {qt}, {q8}, {mask})"
    d, dr, tiled = _mma_shape("_".join(plain), plain)
    if dr % 8:
        raise ValueError(name)
    base = "_".join(inner)
    flag = "true" if tiled else "false"
    return f"FX_MMA8_KERNELS({base}, {qt}, {q8}, {d}, {dr}, {flag}, {mask})"


def _is_wide(parts: list[str]) -> bool:
    """Whether ``parts`` (a name's, without ``_cluster``) name the wide kernel,
    gqa_split_mma_<dt>_d128_wide."""
    return len(parts) == 6 and parts[4:] == [f"d{WIDE_HEAD_DIM}", "wide"]


def _mma_entry(base: str, parts: list[str]) -> str:
    """split_entry of the fp16/bf16 tensor-core kernel ``base``,
    gqa_split_mma_<dt>_d<D>[_r<head_dim>][_t2]: head_dim D (64, 128, 256), or a smaller
    multiple of 8 padded to D; _t2: groups of 9-16 in two tiles of 8 query heads.

    Raises:
        ValueError, KeyError, IndexError: no such kernel.
    """
    d, dr, tiled = _mma_shape(base, parts)
    dt = _ENTRY_TYPES[parts[3]]
    if tiled:
        return f"FX_MMA_TILED_ENTRY({base}, {dt}, {d}, {dr})"
    if dr != d:
        return f"FX_MMA_PAD_ENTRY({base}, {dt}, {d}, {dr})"
    return f"FX_MMA_ENTRY({base}, {dt}, {d})"


def _mma_shape(base: str, parts: list[str]) -> tuple[int, int, bool]:
    """(D, the cache's head_dim, tiled) of the fp16/bf16 tensor-core kernel ``base``
    (see _mma_entry).

    Raises:
        ValueError, KeyError, IndexError: no such kernel.
    """
    _ENTRY_TYPES[parts[3]]  # (a dtype the kernels have: KeyError otherwise)
    rest = parts[4:]
    tiled = rest[-1:] == ["t2"]
    rest = rest[:-1] if tiled else rest
    d = int(rest[0][1:])
    if rest[0][0] != "d" or d not in MMA_HEAD_DIMS or len(rest) > 2:
        raise ValueError(base)
    dr = d
    if len(rest) == 2:
        dr = int(rest[1][1:])
        if rest[1][0] != "r" or not (0 < dr < d and dr % 8 == 0):
            raise ValueError(base)
    return d, dr, tiled


# The feature bits of the kernels' F (FX_F_* in split_common.cuh), and those the combine
# kernel takes (the rest end in the split kernel). F_HND is a layout, not a feature: K and
# V head-major ([kv_head][token][head_dim], FeatureArgs.head_stride apart), one bit all the
# same, so that the kernels without it keep their code.
F_WINDOW, F_CAP, F_ALIBI, F_SINKS, F_LSE, F_SCALE, F_HND = 1, 2, 4, 8, 16, 32, 64
F_LIMIT = 128  # every F is below this
COMBINE_FEATURES = F_WINDOW | F_SINKS | F_LSE


@dataclass(frozen=True)
class FeatureArgs:
    """The run-time values of a decode's features, as its kernels take them: the split
    kernel's (scale, cap, window, ALiBi slopes, a head-major cache's head stride) and the
    combine kernel's (window, sinks, the LSE output); device arrays of float32 per query
    head, or None."""

    scale: float
    cap: float = 1.0
    window: int = 0
    slopes: DeviceArray | None = None
    sinks: DeviceArray | None = None
    lse: DeviceArray | None = None
    head_stride: int = 0  # F_HND: elements from one KV head's rows to the next's

    def split_args(self) -> tuple[Any, ...]:
        return (np.float32(self.scale), np.float32(self.cap), np.int32(self.window), self.slopes,
                np.int64(self.head_stride))  # fmt: skip

    def combine_args(self) -> tuple[Any, ...]:
        return (np.int32(self.window), self.sinks, self.lse)

    def cluster_args(self) -> tuple[Any, ...]:  # a cluster plan's split kernel: all of them
        return (*self.split_args(), self.sinks, self.lse)


def feature_bits(window: bool, cap: bool, alibi: bool, sinks: bool, lse: bool, scale: bool) -> int:
    """The F_* bits of a decode's features."""
    bits = (F_WINDOW, F_CAP, F_ALIBI, F_SINKS, F_LSE, F_SCALE)
    return sum(b for b, on in zip(bits, (window, cap, alibi, sinks, lse, scale), strict=True) if on)


def feature_bits_of(feats: Any) -> int:
    """The F_* bits of validated features (features.Features)."""
    return feature_bits(
        feats.sliding_window is not None, feats.logits_soft_cap is not None,
        feats.alibi_slopes is not None, feats.sinks is not None, feats.return_lse,
        feats.scale is not None,
    )  # fmt: skip


def feature_args(
    feats: Any, head_dim: int, *, slopes: DeviceArray | None = None,
    sinks: DeviceArray | None = None, lse: DeviceArray | None = None,
) -> tuple[int, FeatureArgs]:  # fmt: skip
    """The F_* bits and the kernels' values of validated features (features.Features) for
    ``head_dim``, with the per-head device arrays the kernels read (None: not used)."""
    values = FeatureArgs(
        scale=feats.score_scale(head_dim), cap=feats.logits_soft_cap or 1.0,
        window=feats.sliding_window or 0, slopes=slopes, sinks=sinks, lse=lse,
    )  # fmt: skip
    return feature_bits_of(feats), values


def _feature_entry(name: str, parts: list[str], mask: int, cluster: bool) -> str:
    """split_entry of ``name``, a split kernel with features ``mask`` (``<kernel>_x<mask>``,
    and the fp16/bf16 tensor-core kernels' ``<kernel>_x<mask>_cluster``; ``parts``: the
    name's without the ``_x<mask>`` and ``_cluster``), or the combine kernel's."""
    inner = "_".join(parts)
    if not 0 < mask < F_LIMIT or "cluster" in parts:
        raise ValueError(name)
    if parts[-1] == "wide":  # gqa_split_mma_<dt>_d128_wide_x<F>_cluster
        if not (cluster and _is_wide(parts)):
            raise ValueError(name)
        _ENTRY_TYPES[parts[3]]  # (a dtype the kernels have: KeyError otherwise)
        return f"FX_MMA_WIDE_FEAT_ENTRY({name}, {_ENTRY_TYPES[parts[3]]}, {mask})"
    base = name.removesuffix("_cluster")
    if inner.startswith("gqa_split_combine_") and len(parts) == 4 and not cluster:
        if mask & ~COMBINE_FEATURES:
            raise ValueError(name)
        return f"FX_COMBINE_FEAT_ENTRY({name}, {_ENTRY_TYPES[parts[3]]}, {mask})"
    tiled = parts[-1] == "t2"
    plain = split_entry(inner)  # the kernel without features, which must exist
    mma = plain.startswith(("FX_MMA_ENTRY(", "FX_MMA_PAD_ENTRY(", "FX_MMA_TILED_ENTRY("))
    if cluster and not mma:  # (the fp32 and CUDA-core kernels with features: no clusters)
        raise ValueError(name)
    if plain.startswith("FX_TC32_ENTRY("):  # gqa_split_tc32_f32_d<D>
        return f"FX_TC32_FEAT_ENTRY({name}, {int(parts[4][1:])}, {mask})"
    if plain.startswith("FX_GENERIC_ENTRY("):  # gqa_split_<dt>_g<G>_<vec|any>
        vec = "true" if parts[4] == "vec" else "false"
        return (f"FX_GENERIC_FEAT_ENTRY({name}, {_ENTRY_TYPES[parts[2]]}, {int(parts[3][1:])}, "
                f"{vec}, {mask})")  # fmt: skip
    if not mma:
        raise ValueError(name)
    d = int(parts[4][1:])
    dr = int(parts[5][1:]) if len(parts) > 5 and parts[5][0] == "r" else d
    flag = "true" if tiled else "false"
    return f"FX_MMA_FEAT_ENTRY({base}, {_ENTRY_TYPES[parts[3]]}, {d}, {dr}, {flag}, {mask})"


def split_kernel(name: str, device: Device) -> Kernel:
    """Split kernel ``name``, compiled (on first use) in a module of its own."""
    return get_kernel(SPLIT_FILE, name, device, select=split_entry(name))


TILE = kernel_define("FX_TILE")  # tokens; tensor-core chunk sizes are multiples of it
MAX_SPLITS = kernel_define("FX_MAX_SPLITS")
THREADS = kernel_define("FX_THREADS")
COMBINE_THREADS = kernel_define("FX_COMBINE_THREADS")
MAX_CLUSTER = kernel_define("FX_MAX_CLUSTER")  # blocks of one on-chip merge
# The most floats a KV head's chunks exchange through distributed shared memory (chunks x
# group x head_dim) for them to merge on chip; larger exchanges go through the combine
# kernel, launched early. Measured at 512 and 1024 tokens, one stream, one process
# , the combine kernel against the cluster:
# 8/1/256 bf16 -0.3 us at 512 (16384 floats), -0.7 at 1024; 16/4/256 -0.5 at 1024 (16384);
# 28/4/128 -0.2 at 1024 (14336), fp32 28/4/128 -0.1; level at 8192 (64/8/128 and 16/4/256
# at 512); the cluster ahead below it (16/2/64 at 1024, 8192: +0.2; 32/8/128 at 512, 4096:
# +0.5; 28/4/128 at 512, 7168: +0.1).
CLUSTER_MAX_EXCHANGE = 8192
MMA_HEAD_DIMS = (64, 128, 256)  # fp16/bf16 tensor-core kernels ...


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


TC32_HEAD_DIMS = (64, 128, 256)  # fp32 tensor-core (split TF32) kernels


@dataclass(frozen=True, eq=False)
class Overrides:
    """Choices of the planner that experiments turn off, one field each (all on by
    default). Read once from the environment at import (``from_env``); tests and
    benchmarks replace ``attention.OVERRIDES`` instead.

    Attributes:
        heads_per_block: query heads per block of the CUDA-core kernels (1, 2, 4 or 8;
            ``FERROX_SPLIT_HEADS_PER_BLOCK``).
        tc32: fp32 decodes of groups 2-8 on tensor cores (``FERROX_TC32=0``: CUDA cores).
        cluster: chunks merged on chip where they fit (``FERROX_CLUSTER=0``: the combine
            kernel always; the wide plans too).
        wide: the wide plans (``FERROX_WIDE=0``).
        early_combine: the combine kernel launched early, programmatic dependent launch
            (``FERROX_EARLY_COMBINE=0``).
        padded_mma: fp16/bf16 head_dims other than 64/128/256 (multiples of 8) on the
            tensor-core kernels, padded (``FERROX_PADDED_MMA=0``: CUDA cores).
        paired: two adjacent KV heads' rows read as one row of 2 x head_dim: None (the
            default) where the architecture's Tuning says (``paired_from``), True wherever
            the kernels can (experiments and tests, ``FERROX_PAIRED=1``), False never
            (``FERROX_PAIRED=0``).
    """

    heads_per_block: int = 4
    tc32: bool = True
    cluster: bool = True
    wide: bool = True
    early_combine: bool = True
    padded_mma: bool = True
    paired: bool | None = None

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
            padded_mma=on("FERROX_PADDED_MMA"),
            paired={"0": False, "1": True}.get(env.get("FERROX_PAIRED", "")),
        )


OVERRIDES = Overrides.from_env()


def check_algorithm(algorithm: Any) -> str:
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")
    return str(algorithm)


@dataclass(frozen=True)
class SplitPlan:
    """How a split-KV decode is launched: which kernel, how many chunks."""

    kernel: str
    tensor_cores: bool
    head_tiles: int  # blocks per KV head along the group (tensor cores: tiles of 8 heads)
    lanes_per_token: int
    splits: int
    threads: int = THREADS  # per block
    tile: int = TILE  # chunk sizes are multiples of this many tokens
    stages: int = 0  # tensor-core kernels: steps in each warp's ring ...
    step_tokens: int = 16  # ... of this many tokens
    reserve_stages: int = 0  # the launch's shared memory holds this many (if more)
    cluster: int = 0  # blocks per thread block cluster (a KV head's chunks merge on chip,
    # no combine kernel); 0: the combine kernel merges them
    kernel_head_dim: int = 0  # the head_dim the kernel is built for, when not the call's
    paired: bool = False  # two KV heads' rows read as one (the launch's n_kv_heads halved)
    features: int = 0  # the features compiled in (F_* bits; the kernel's name ends _x<bits>)
    fp8: str = ""  # an fp8 cache's format (FP8_FORMATS; the kernel reads bytes)

    def combine_kernel(self, dtype: Any) -> str | None:
        """The name of the kernel merging this plan's chunks for a ``dtype`` output (None:
        a cluster plan, merged on chip)."""
        if self.cluster:
            return None
        merged = self.features & COMBINE_FEATURES  # those the combine kernel applies
        return combine_kernel_name(dtype) + (f"_x{merged}" if merged else "")

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
        ring = (self.threads // 32) * steps * self.step_tokens * 2 * head_dim * itemsize
        return ring + (cluster_recv_bytes(head_dim) if self.cluster else 0)


def combine_kernel_name(dtype: Any) -> str:
    """The combine kernel for a ``dtype`` output."""
    return f"gqa_split_combine_{dtype_name(dtype)}"


def cluster_recv_bytes(head_dim: int) -> int:
    """Bytes of a cluster block's receive area past its ring (FX_RECV_FLOATS in the kernel
    file, whose launches trap with less): maxima and sums of every block's heads, and the
    block's share of the output units from every block."""
    return 4 * (MAX_CLUSTER * 16 + (2 * head_dim + MAX_CLUSTER) * 4)


# The tensor-core kernels' static shared memory (Q staged, the warps' merge) by head_dim, at
# most: ptxas's numbers for sm_80 to sm_120 over every variant (features, fp8, clusters,
# pairs, padding), rounded up (largest seen: fp16/bf16 1952, 2592, 4640 bytes; fp32 5120,
# 9216, 17024). ``fitting`` adds them to a launch's dynamic shared memory to check it
# against the device's limit per block; tests/test_arch_support.py checks every plan's sum.
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


# The tensor-core kernels' shape by head_dim: warps per block and each warp's ring of
# steps (one fewer are in flight), for fp16/bf16 (FxWarps/FxStages, 16-token steps) and
# fp32 (FxTc32Shape, 8- or 16-token steps)
MMA_WARPS = {d: kernel_define(f"FX_WARPS_D{d}") for d in MMA_HEAD_DIMS}
MMA_STAGES = {d: kernel_define(f"FX_STAGES_D{d}") for d in MMA_HEAD_DIMS}
# ... and the steps' worth of shared memory a launch reserves where the ring is shallower
# (fp16/bf16 head_dim 128 and fp32 head_dim 64 and 128: one step in flight measured
# fastest, and the reserve keeps one block per multiprocessor, as plan_split and
# clusters_fit assume)
MMA_RESERVE_STAGES = {d: kernel_define(f"FX_RESERVE_STAGES_D{d}") for d in MMA_HEAD_DIMS}
TC32_WARPS = {d: kernel_define(f"FX_TC32_WARPS_D{d}") for d in TC32_HEAD_DIMS}
TC32_STAGES = {d: kernel_define(f"FX_TC32_STAGES_D{d}") for d in TC32_HEAD_DIMS}
TC32_TOKENS = {d: kernel_define(f"FX_TC32_TOKENS_D{d}") for d in TC32_HEAD_DIMS}
TC32_RESERVE_STAGES = {d: kernel_define(f"FX_TC32_RESERVE_STAGES_D{d}") for d in TC32_HEAD_DIMS}
# The "wide" plans (fp16/bf16, head_dim 128): WIDE_CHUNKS chunks per KV head in clusters of
# as many blocks of WIDE_WARPS warps (gqa_split_mma_*_d128_wide_cluster), merged on chip,
# instead of 16 chunks and the combine kernel. Measured on the H200
#: with
# 8 KV heads (64 blocks, a cluster per GPC) groups of 2-5 are 1.3-4.4% faster from 1024
# tokens (groups of 5 measured from 2048) and groups of 8 2.1-2.6% faster at 16384-32768
# and 0.8-1.4% beyond, but 0.4-2.2% slower at 1024-4096. With 12 KV heads (96 blocks: two
# clusters share some GPCs) they were 8.8-11.5% slower from 32768; with 4 (clusters of 16)
# or 32 (MHA, clusters of 2), slower too. So the plan is for WIDE_KV_HEADS only.
WIDE_WARPS = kernel_define("FX_WIDE_WARPS")
WIDE_HEAD_DIM = 128


@dataclass(frozen=True)
class Tuning:
    """The planner's measured thresholds for one architecture (TUNING); each was measured
    as its note says.

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
        paired_from: (head_dim, shortest sequence) pairs: fp16/bf16 head_dims that read two
            KV heads' rows as one (Overrides.paired) from that length, where the pair's
            group fits one tile of 8 query heads. H200, graph-replayed, paired against not
            in one run (two rounds; benchmarks/paired_compare.py for 56 and up): 32/8/D
            bf16 D = 32, 40, 48 at 131072 tokens 20%, 23%, 19% faster, at 32768 15%, 10%,
            2%; at 512 tokens 15-30% slower, and 40/48 at 4096 5-10% slower. D = 56, 72,
            88, 104, 120 (on the 128 and 256 kernels) at 16384 tokens 3-7% faster, at
            131072 28%, 17%, 3%, 17%, 9% (fp16 56 and 72: 22%, 14%), 1-4% slower at 8192;
            96 level at 16384, 2.5% faster at 32768, 9% at 131072; 64, 80 and 112 level or
            slower (+2.5%, -0.5%, +6.5% at 131072): not paired. MHA 8/8/72 15-19% faster
            from 32768. Groups of 8 (64/8/72, 40/8/72, 16/2/72: two tiles, each reading
            the whole pair's row) 26-50% slower: never.
    """

    cluster_max_exchange: int = CLUSTER_MAX_EXCHANGE
    wide_kv_heads: int = 8
    wide_chunks: int = 8
    wide_from: tuple[tuple[int, int], ...] = ((4, 1024), (5, 2048), (8, 16384))
    tc32_groups: tuple[int, int] = (2, 8)
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
    architecture's measured thresholds. ``DeviceTraits.of(device)`` reads a real one;
    tests build their own, with occupancy functions of their choosing.

    Attributes:
        key: identifies the device (a context handle) in the planner's memo.
        arch: e.g. ``"sm_90"``.
        compute_capability: (major, minor).
        multiprocessor_count: SMs.
        blocks_per_sm: ``(kernel, threads, dynamic shared bytes) -> blocks`` resident on a
            multiprocessor (cuOccupancyMaxActiveBlocksPerMultiprocessor), at least 1.
        active_clusters: ``(kernel, cluster, threads, dynamic shared bytes) -> clusters``
            of ``cluster`` blocks resident at once on the device
            (cuOccupancyMaxActiveClusters; 0 where such a cluster cannot run).
        tuning: the thresholds (TUNING by arch, DEFAULT_TUNING elsewhere).
        shared_per_block: the most shared memory (static + dynamic) a block may opt in to,
            bytes (CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN; default: an
            H200's). Tensor-core plans whose ring does not fit take CUDA cores (``fitting``).

    ``arch_traits(arch)`` makes the traits of a GPU of a supported architecture without
    one (archs.ARCHS).
    """

    key: Any
    arch: str
    compute_capability: tuple[int, int]
    multiprocessor_count: int
    blocks_per_sm: Callable[[str, int, int], int]
    active_clusters: Callable[[str, int, int, int], int]
    tuning: Tuning = DEFAULT_TUNING
    shared_per_block: int = ARCHS["sm_90"].shared_per_block

    @classmethod
    def of(cls, device: Device) -> DeviceTraits:
        """The traits of ``device`` (made once per context)."""
        traits = _traits.get(device.context_handle)
        if traits is None:
            traits = _traits[device.context_handle] = _read_traits(device)
        return traits


_traits: dict[int, DeviceTraits] = {}


def _read_traits(device: Device) -> DeviceTraits:
    blocks: dict[str, int] = {}
    clusters: dict[tuple[str, int], int] = {}

    def blocks_per_sm(kernel: str, threads: int, shared: int) -> int:
        n = blocks.get(kernel)
        if n is None:
            found = split_kernel(kernel, device).max_active_blocks(threads, shared)
            n = blocks[kernel] = max(found, 1)
        return n

    def active_clusters(kernel: str, cluster: int, threads: int, shared: int) -> int:
        n = clusters.get((kernel, cluster))
        if n is None:
            try:
                n = split_kernel(kernel, device).max_active_clusters(cluster, threads, shared)
            except CudaError:  # e.g. a cluster larger than this device (or MIG slice) holds
                n = 0
            clusters[kernel, cluster] = n
        return n

    return DeviceTraits(
        device.context_handle, device.arch, device.compute_capability,
        device.multiprocessor_count, blocks_per_sm, active_clusters,
        TUNING.get(device.arch, DEFAULT_TUNING), device.max_shared_per_block_optin,
    )  # fmt: skip


def split_program(names: Sequence[str], arch: str) -> Program:
    """The split kernels ``names`` (with their ``_cluster`` twins) compiled for ``arch`` in
    one module, through the module cache (memory and disk); for one name, the very module
    that ``split_kernel`` loads on a GPU of ``arch``. No GPU needed.

    Raises:
        ValueError: no split kernel has one of the names, or a bad ``arch``.
    """
    select = "\n".join(dict.fromkeys(split_entry(name) for name in names))
    source = f"#define FX_SELECTED 1\n{kernel_source(SPLIT_FILE)}\n{select}\n"
    return get_program(source, arch=arch, name=SPLIT_FILE)


def arch_traits(
    arch: str, resources: Callable[[str], KernelResources] | None = None
) -> DeviceTraits:
    """Hand-made traits of a GPU of ``arch`` (one of archs.ARCHS: its limits, its GPU's
    multiprocessors), for planning without one: a kernel's blocks per multiprocessor from
    the limits and its registers and static shared memory as ptxas reports them
    (``resources``: kernel name -> KernelResources; default: the kernel compiled for
    ``arch`` by ``split_program``), and resident clusters from a model of the GPCs (whole
    clusters within each; a real device's driver knows better).

    Raises:
        ValueError: ``arch`` is not in archs.ARCHS.
    """
    limits = arch_limits(arch)
    seen: dict[str, KernelResources] = {}

    def kernel_resources(kernel: str) -> KernelResources:
        found = seen.get(kernel)
        if found is None:
            found = seen[kernel] = (
                resources(kernel) if resources else split_program([kernel], arch).resources[kernel]
            )
        return found

    def blocks(kernel: str, threads: int, shared: int) -> int:
        r = kernel_resources(kernel)
        return occupancy(limits, threads, shared, r.registers, r.shared_bytes)

    def blocks_per_sm(kernel: str, threads: int, shared: int) -> int:
        return max(1, blocks(kernel, threads, shared))

    def active_clusters(kernel: str, cluster: int, threads: int, shared: int) -> int:
        if not 0 < cluster <= limits.max_cluster:
            return 0
        gpcs = limits.multiprocessor_count // limits.gpc_sms
        return gpcs * (limits.gpc_sms * blocks(kernel, threads, shared) // cluster)

    return _limits_traits(limits, blocks_per_sm, active_clusters)


def _limits_traits(
    limits: ArchLimits,
    blocks_per_sm: Callable[[str, int, int], int],
    active_clusters: Callable[[str, int, int, int], int],
) -> DeviceTraits:
    return DeviceTraits(
        ("arch", limits.arch), limits.arch, limits.compute_capability,
        limits.multiprocessor_count, blocks_per_sm, active_clusters,
        TUNING.get(limits.arch, DEFAULT_TUNING), limits.shared_per_block,
    )  # fmt: skip


_plans: dict[tuple[Any, ...], SplitPlan] = {}
_MAX_PLANS = 4096  # distinct (shape, length) plans kept; eager decodes plan per length


def plan_split(
    device: Device,
    dtype: np.dtype,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    plan_seq: int,
    aligned: bool = True,
    features: int = 0,
    fp8: str = "",
) -> SplitPlan:
    """Choose the split kernel and the number of chunks for up to ``plan_seq`` tokens
    (memoised: every decode asks, once; ``OVERRIDES`` is part of the key).

    The grid is at most one full wave of resident blocks; each block's chunk is a multiple
    of the plan's tile, computed on the device from the actual length (which may be
    shorter, as in a captured graph sized for the cache's capacity). CUDA-core tiles are the
    tokens a block takes per iteration (8-64). Tensor-core tiles are 64 tokens (32 for the
    fp32 head_dim 256 kernel), and a KV head's chunks merge on chip where they fit resident
    clusters (clusters_fit); fp16/bf16 head_dim 128 plans for WIDE_KV_HEADS KV heads take
    WIDE_CHUNKS chunks per KV head of 8-warp blocks in clusters from ``wide_from(group)``
    tokens (wide_plan).
    """
    key = (device.context_handle, np.dtype(dtype), n_heads, n_kv_heads, head_dim, plan_seq,
           aligned, OVERRIDES, features, fp8)  # fmt: skip
    found = _plans.get(key)
    if found is None:
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        found = _plans[key] = plan(
            DeviceTraits.of(device), dtype, n_heads, n_kv_heads, head_dim, plan_seq, aligned,
            OVERRIDES, features, fp8,
        )  # fmt: skip
    split_kernel(found.kernel, device)  # loaded (captures need it; after a first plan, a lookup)
    return found


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
) -> SplitPlan:
    """The split plan for decodes of up to ``plan_seq`` tokens of this shape on a device of
    ``traits`` (see ``plan_split``, which remembers it per device): a function of its
    arguments alone, ``overrides`` (default: OVERRIDES) included. With ``features`` (F_*
    bits), the same kernel with them compiled in (``<kernel>_x<bits>[_cluster]``; the fp32
    tensor-core ones without clusters); a window's plan covers the window (``plan_seq`` at
    most the window, the caller's part). With ``fp8`` (an fp8 cache's format, ``dtype``
    q's), the fp16/bf16 plan's kernel for a cache of bytes,
    ``gqa_split_mma_<dt>_<fp8>_<rest>_x<bits>[_cluster]`` (never paired).

    Raises:
        ValueError: ``fp8`` where the plan has no such kernel (q not fp16/bf16, a head_dim
            not a multiple of 8, groups past 16).
    """
    if fp8:
        return _fp8_plan(traits, dtype, n_heads, n_kv_heads, head_dim, plan_seq, aligned,
                         overrides, features, fp8)  # fmt: skip
    if not features:
        return _plan(traits, dtype, n_heads, n_kv_heads, head_dim, plan_seq, aligned, overrides)
    ov = OVERRIDES if overrides is None else overrides
    ov = dataclasses.replace(ov, paired=False)  # (the paired kernels take no features)
    found = _plan(traits, dtype, n_heads, n_kv_heads, head_dim, plan_seq, aligned, ov)
    if found.cluster and not found.kernel.startswith("gqa_split_mma_"):
        # the fp32 tensor-core kernels take features without clusters (not built)
        ov = dataclasses.replace(ov, cluster=False, wide=False)
        found = _plan(traits, dtype, n_heads, n_kv_heads, head_dim, plan_seq, aligned, ov)
    base = found.kernel.removesuffix("_cluster")
    kernel = f"{base}_x{features}" + ("_cluster" if found.cluster else "")
    return dataclasses.replace(found, kernel=kernel, features=features)


def _fp8_plan(
    traits: DeviceTraits, dtype: Any, n_heads: int, n_kv_heads: int, head_dim: int,
    plan_seq: int, aligned: bool, overrides: Overrides | None, features: int, fp8: str,
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
    # No wide plans: their 64 blocks read an fp8 cache at 2.96 TB/s where the plans of a
    # full wave read 3.91 (H200, 32/8/128 at 131072 tokens, 90.7 vs 68.6 us; same at 64/8),
    # as the widening costs each block more work per byte. No pairs (the kernels take none).
    ov = dataclasses.replace(
        OVERRIDES if overrides is None else overrides, paired=False, wide=False
    )
    found = plan(traits, dtype, n_heads, n_kv_heads, head_dim, plan_seq, aligned, ov)
    prefix = f"gqa_split_mma_{dtype_name(np.dtype(dtype))}_"
    if not found.kernel.startswith(prefix) or head_dim % 8:
        raise ValueError(
            f"fp8: no kernel for q {np.dtype(dtype)}, head_dim {head_dim} and groups of "
            f"{n_heads // n_kv_heads} on {traits.arch} (fp8 caches take fp16/bf16 q, head_dims "
            f"that are multiples of 8, groups up to 16, and a tensor-core ring that fits the "
            f"GPU's {traits.shared_per_block // 1024} KiB of shared memory per block: on GPUs "
            f"of 99 KiB, head_dims up to 128)"
        )
    rest = found.kernel.removesuffix("_cluster")[len(prefix) :]
    kernel = f"{prefix}{fp8}_{rest}_x{features}" + ("_cluster" if found.cluster else "")
    # (an fp8 ring takes its kernel's own depth, not a padded head_dim's: FxStages)
    own = MMA_STAGES[found.kernel_head_dim or head_dim]
    return dataclasses.replace(found, kernel=kernel, features=features, fp8=fp8, stages=own)


def _plan(
    traits: DeviceTraits,
    dtype: Any,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    plan_seq: int,
    aligned: bool = True,
    overrides: Overrides | None = None,
) -> SplitPlan:
    ov = OVERRIDES if overrides is None else overrides
    tuning = traits.tuning
    group = n_heads // n_kv_heads
    name = dtype_name(np.dtype(dtype))
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
    if mma_dim is not None and group <= 16 and aligned:  # 9-16: two tiles of 8 heads
        tiles = -(-group // 8)
        kname = f"gqa_split_mma_{name}_d{mma_dim}"
        if mma_dim != head_dim:
            kname = f"{kname}_r{head_dim}"
        if tiles > 1:
            kname = f"{kname}_t{tiles}"
        chosen = fitting(traits, head_dim, 2, SplitPlan(
            kname, True, tiles, 32, 1, 32 * MMA_WARPS[mma_dim], TILE,
            padded_stages(mma_dim, head_dim) or MMA_STAGES[mma_dim], 16,
            reserve_stages=MMA_RESERVE_STAGES[mma_dim],
            kernel_head_dim=mma_dim if mma_dim != head_dim else 0,
        ))  # fmt: skip
    elif (
        name == "f32" and tensor_cores and head_dim in TC32_HEAD_DIMS and aligned
        and tc32_for(group, ov, tuning)
    ):  # fmt: skip
        chosen = fitting(traits, head_dim, 4, SplitPlan(
            f"gqa_split_tc32_f32_d{head_dim}", True, 1, 32, 1, 32 * TC32_WARPS[head_dim], TILE,
            TC32_STAGES[head_dim], TC32_TOKENS[head_dim],
            reserve_stages=TC32_RESERVE_STAGES[head_dim],
        ))  # fmt: skip
    if chosen is None:  # CUDA cores: no tensor-core kernel, or its ring does not fit here
        cap = ov.heads_per_block
        gt = next(g for g in (1, 2, 4, 8) if g >= min(group, cap, 8))
        lpt = 1
        while lpt * 8 < head_dim:
            lpt *= 2
        vec = "vec" if head_dim % 8 == 0 and aligned else "any"
        chosen = SplitPlan(
            f"gqa_split_{name}_g{gt}_{vec}", False, -(-group // gt), lpt, 1, THREADS,
            cuda_core_tile(lpt),
        )  # fmt: skip
    kname, tc, tiles, tile = chosen.kernel, chosen.tensor_cores, chosen.head_tiles, chosen.tile
    threads = chosen.threads
    itemsize = np.dtype(dtype).itemsize
    shared = chosen.shared_bytes(head_dim, itemsize)
    wave = traits.blocks_per_sm(kname, threads, shared) * traits.multiprocessor_count
    # At most one wave: a block more than the GPU holds at once doubles the time of the tail.
    most = max(1, min(wave // (n_kv_heads * tiles), MAX_SPLITS))
    seq = max(plan_seq, 1)
    if not tc:
        return dataclasses.replace(chosen, splits=min(most, -(-seq // tile)))
    if name == "f32" and head_dim == 256:
        # 32-token tiles, no clusters: this kernel's steps (8 tokens of split-TF32 products
        # over 256 columns) are long dependent chains, so short sequences want more blocks
        # with fewer steps each. Measured with the three-mma products:
        # 8/1/256 10.9 -> 8.8 us at 512 tokens, 13.1 -> 11.8 at 4096; 16-token tiles 9.2 /
        # 11.8; in clusters 0.5-0.8 us slower.
        tile = 32
        return dataclasses.replace(chosen, splits=min(most, -(-seq // tile)), tile=tile)
    # 64-token tiles, merged on chip where the chunks fit resident clusters and exchange at
    # most CLUSTER_MAX_EXCHANGE floats: smaller tiles (more chunks, in clusters or not)
    # measured level or slower for these kernels.
    wide = wide_plan(traits, chosen, name, n_kv_heads, group, head_dim, seq, ov)
    if wide is not None:
        return wide
    splits = min(most, -(-seq // tile))
    # (the cluster entry's receive area comes past the launch's reserve: where both do not
    # fit a block, the reserve gives way, down to the ring)
    clustered = fitting(traits, head_dim, itemsize, dataclasses.replace(
        chosen, kernel=f"{kname}_cluster", splits=splits, tile=tile, cluster=splits
    ))  # fmt: skip
    exchange = splits * min(group, 8) * head_dim  # floats one cluster (a head tile) merges
    if (
        clustered is not None and exchange <= tuning.cluster_max_exchange
        and clusters_fit(
            traits, clustered.kernel, splits, n_kv_heads * tiles, threads,
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
    kname = f"gqa_split_mma_{name}_d{kernel_dim}_r{2 * head_dim}_p2" + ("_t2" if tiles > 1 else "")
    chosen = fitting(traits, head_dim, 2, SplitPlan(
        kname, True, tiles, 32, 1, 32 * MMA_WARPS[kernel_dim], TILE, MMA_STAGES[kernel_dim], 16,
        reserve_stages=MMA_RESERVE_STAGES[kernel_dim], kernel_head_dim=kernel_dim, paired=True,
    ))  # fmt: skip
    if chosen is None:
        return None
    shared = chosen.shared_bytes(head_dim, 2)
    wave = traits.blocks_per_sm(f"gqa_split_mma_{name}_d{kernel_dim}", chosen.threads, shared)
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
        kernel=f"gqa_split_mma_{name}_d{head_dim}_wide_cluster",
        threads=32 * WIDE_WARPS,
        reserve_stages=0,  # WIDE_WARPS x stages steps already fill a multiprocessor's share
        splits=tuning.wide_chunks,
        tile=TILE,
        cluster=tuning.wide_chunks,
    )
    shared = wide.shared_bytes(head_dim, 2)
    if fitting(traits, head_dim, 2, wide) is None or not clusters_fit(
        traits, wide.kernel, tuning.wide_chunks, n_kv_heads, wide.threads, shared, ov
    ):
        return None
    return wide


def clusters_fit(
    traits: DeviceTraits,
    kernel_name: str,
    cluster: int,
    n_clusters: int,
    threads: int,
    shared: int,
    overrides: Overrides | None = None,
) -> bool:
    """Whether ``n_clusters`` clusters of ``cluster`` blocks of the tensor-core kernel
    ``kernel_name`` run at once (one wave: a cluster waiting for another to finish would
    double the time), so each KV head's chunks can merge on chip instead of in a combine
    kernel. Needs compute capability 9.0 (clusters of at most ``MAX_CLUSTER`` blocks);
    ``overrides.cluster`` off turns it off (a comparison knob)."""
    if not (OVERRIDES if overrides is None else overrides).cluster:
        return False
    if traits.compute_capability < (9, 0) or cluster > MAX_CLUSTER:
        return False
    return traits.active_clusters(kernel_name, cluster, threads, shared) >= n_clusters


def tc32_for(
    group: int, overrides: Overrides | None = None, tuning: Tuning = DEFAULT_TUNING
) -> bool:
    """Whether an fp32 decode takes the split-TF32 tensor-core kernel (whose time does not
    depend on the group: it always computes 8 rows) rather than a CUDA-core one (whose
    time grows with the group). Measured on the H200 with the two-mma products: groups of 4
    are 4.5-7.6% faster on tensor cores at 32768-131072 tokens, groups of 3 3.9-22.9% at
    4096-131072, groups of 2 2.7-4.1% at 4096-32768 and level at 131072; groups of 5-8
    were faster at every length already with three mmas. Groups of 1 (MHA) stay on CUDA
    cores, which stream at the ceiling. ``OVERRIDES.tc32`` off keeps every group on CUDA
    cores (a comparison knob)."""
    if not (OVERRIDES if overrides is None else overrides).tc32:
        return False
    low, high = tuning.tc32_groups
    return low <= group <= high


def cuda_core_tile(lanes_per_token: int) -> int:
    """Chunk granularity of the CUDA-core kernels: the tokens a block takes per iteration
    (two per lane group), 8 to TILE. Each iteration is a trip to memory the next waits
    for, so a short sequence gets many short chunks rather than a few long ones."""
    return max(8, min(TILE, 2 * (THREADS // 32) * (32 // lanes_per_token)))


def allocate_scratch(floats: int, device: Device, in_capture: str) -> DeviceArray:
    """``floats`` float32 of decode scratch.

    Raises:
        FerroxError: with the message ``in_capture`` when a stream capture is open
            (allocation is not capturable).
    """
    try:
        return empty((floats,), np.float32, device=device)
    except CudaError as exc:
        if exc.name == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED":
            raise FerroxError(in_capture) from exc
        raise


Roles = tuple[tuple[int, str], ...]  # (argument index, role) pairs


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a decode: the kernel (by name, in ``file``), its grid, block,
    arguments, dynamic shared memory, cluster size, whether it starts early (programmatic
    dependent launch), and which arguments are the call's q, k, v, out and seq_len
    (``roles``: a launch record rewrites those per call)."""

    kernel: str
    grid: tuple[int, int, int]
    block: int
    args: tuple[Any, ...]
    shared_mem: int = 0
    cluster: int = 0
    early: bool = False
    roles: Roles = ()
    file: str = SPLIT_FILE

    def kernel_for(self, device: Device) -> Kernel:
        """The kernel this launch names, loaded on ``device``."""
        if self.file == SPLIT_FILE:
            return split_kernel(self.kernel, device)
        return get_kernel(self.file, self.kernel, device)

    def run(self, stream: Any, device: Device, kernel: Kernel | None = None) -> None:
        """Queue this launch on ``stream`` (``kernel``: a variant with the same parameters
        in place of the named one, for experiments)."""
        self.packed(stream, device, kernel)()

    def packed(self, stream: Any, device: Device, kernel: Kernel | None = None) -> PackedLaunch:
        """This launch packed once for ``stream`` (see ``PackedLaunch``)."""
        return PackedLaunch(
            kernel or self.kernel_for(device),
            self.grid,
            self.block,
            self.args,
            shared_mem=self.shared_mem,
            stream=stream,
            cluster=self.cluster,
            early=self.early,
        )


_QKV = ((0, "q"), (1, "k"), (2, "v"))


def split_launches(
    plan: SplitPlan,
    q: DeviceArray,
    k: DeviceArray,
    v: DeviceArray,
    out: DeviceArray,
    workspace: DeviceArray | None,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    seq_len: int,
    seq_len_dev: DeviceArray | None,
    features: FeatureArgs | None = None,
    kv_scales: DeviceArray | None = None,
) -> list[Launch]:
    """The launches of a split decode in order: the split kernel of ``plan``, then (unless
    it is a cluster plan, whose split kernel writes ``out``) the kernel combining its
    chunks, launched early. A plan with features takes their values from ``features``.

    Raises:
        ValueError: a combine plan without ``workspace``, or with features and no
            ``features``.
    """
    if plan.features and features is None:
        raise ValueError("features: the plan has features compiled in; pass their values")
    if plan.fp8 and kv_scales is None:
        raise ValueError("kv_scales: an fp8 plan reads the cache's scales")
    # the split kernel's last arguments: an fp8 plan's scales, and with features (an fp8
    # plan's kernels take every feature's value, its own or not) their values
    values = (features or FeatureArgs(scale=head_dim**-0.5)) if plan.features or plan.fp8 else None
    fp8_args: tuple[Any, ...] = (kv_scales,) if plan.fp8 else ()
    launch_kv = n_kv_heads // 2 if plan.paired else n_kv_heads  # paired: KV heads of 2 rows
    heads = (np.int32(n_heads), np.int32(launch_kv))
    splits, tile = np.int32(plan.splits), np.int32(plan.tile)
    args: tuple[Any, ...]
    shared = plan.shared_bytes(head_dim, q.dtype.itemsize)
    # seq_len (the launch's bound when the kernels read the length on the device) is a
    # role only when it is the length itself
    seq_role: Roles = ()
    if plan.cluster:
        args = (q, k, v, out, *heads, np.int32(seq_len), seq_len_dev, splits, tile, *fp8_args)
        if values is not None:
            args += values.cluster_args()
        grid = plan.grid(n_kv_heads)
        roles = (*_QKV, (3, "out"), *(((6, "seq"),) if seq_len_dev is None else seq_role))
        return [Launch(plan.kernel, grid, plan.threads, args, shared, plan.cluster, roles=roles)]
    if workspace is None:
        raise ValueError("workspace: the combine kernel's plans need one (workspace_floats)")
    n_partial = n_heads * plan.splits
    ws_o = workspace
    ws_ml = workspace.view((n_partial * 2,), offset=n_partial * head_dim * 4)
    if plan.tensor_cores:
        args = (q, k, v, ws_o, ws_ml, *heads, np.int32(seq_len), seq_len_dev, splits, tile)
        args += fp8_args
        if values is not None:
            args += values.split_args()
        grid = plan.grid(n_kv_heads)  # tiles of 8 query heads
        at = 7
    else:  # head tiles of one chunk adjacent in launch order (see the kernel)
        lanes = np.int32(plan.lanes_per_token)
        args = (q, k, v, ws_o, ws_ml, *heads, np.int32(head_dim), np.int32(seq_len),
                seq_len_dev, splits, lanes, tile)  # fmt: skip
        if values is not None:
            args += values.split_args()
        grid = plan.grid(n_kv_heads)
        at = 8
    combine_args: tuple[Any, ...] = (out, ws_o, ws_ml, np.int32(head_dim), np.int32(seq_len),
                                     seq_len_dev, splits, tile)  # fmt: skip
    combine = plan.combine_kernel(q.dtype)
    assert combine is not None
    if plan.features & COMBINE_FEATURES and values is not None:
        combine_args += values.combine_args()
    on_host = seq_len_dev is None
    return [
        Launch(
            plan.kernel, grid, plan.threads, args, shared,
            roles=(*_QKV, *(((at, "seq"),) if on_host else ())),
        ),
        Launch(
            combine,
            (n_heads, -(-head_dim // 32), 1),
            COMBINE_THREADS,
            combine_args,
            early=OVERRIDES.early_combine,  # it waits for the split kernel itself
            roles=((0, "out"), *(((4, "seq"),) if on_host else ())),
        ),
    ]  # fmt: skip


def parity_launches(
    q: DeviceArray,
    k: DeviceArray,
    v: DeviceArray,
    out: DeviceArray,
    *,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    seq_len: int,
    seq_len_dev: DeviceArray | None,
) -> list[Launch]:
    """The one launch of the parity kernel (ferrox-cuda's algorithm, corrected)."""
    args = (q, k, v, out, np.int32(n_heads), np.int32(n_kv_heads), np.int32(head_dim),
            np.int32(seq_len), seq_len_dev)  # fmt: skip
    roles = (*_QKV, (3, "out"), *(((7, "seq"),) if seq_len_dev is None else ()))
    name = f"gqa_decode_{dtype_name(q.dtype)}"
    return [Launch(name, (n_heads, 1, 1), 32, args, roles=roles, file="gqa_decode.cu")]


def is_aligned(*arrays: DeviceArray) -> bool:
    """True when every array starts on a 16-byte boundary (needed for vector loads)."""
    return all(a.ptr % 16 == 0 for a in arrays)
