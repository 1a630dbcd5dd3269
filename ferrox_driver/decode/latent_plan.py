"""Multi-head latent attention (MLA) decode, planned: which latent kernel (split_latent.cuh),
how many chunks. A pure function of the shape and of three numbers of the device (its
multiprocessors, the shared memory one block may have, its compute capability), so the
CPU tests plan for any GPU; nothing here imports the driver.

A block serves 16 or 32 query rows (a KV head's n_q x group, query-major) from each step of
the latent it copies into shared memory; the chunks fill one wave of blocks (one block per
multiprocessor: the ring takes most of its shared memory), each of at least
LATENT_MIN_CHUNK tokens, since every chunk costs the combine a read of rows x head_dim_v
floats. Worked example: 128 heads, one query, 131072 tokens on 132 multiprocessors: 4 row
blocks of 32, 33 chunks of 4032 tokens (63 steps of 64; the last shorter).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..archs import FP8_FROM, TENSOR_CORES_FROM
from ..kernels.spec import (
    LATENT_FEATURES,
    LATENT_WG_HEAD_DIM_V,
    LATENT_WG_HEADS,
    KernelSpec,
)
from ..kernels.traits import COMBINE_FEATURES, SPLIT_TRAITS, chunk_tokens

__all__ = [
    "LATENT_MIN_CHUNK",
    "LATENT_WARPS",
    "LATENT_WG_MIN_CHUNK",
    "LatentPlan",
    "latent_plan",
    "latent_shared_bytes",
    "latent_stages",
]

LATENT_WARPS = SPLIT_TRAITS["FX_LATENT_WARPS"]
LATENT_MIN_CHUNK = 256  # tokens: not yet measured (4 steps of 64)
# the wgmma kernel's shortest chunk (tokens): below it the mma.sync kernel measured faster
# (H100, benchmarks/mla_speed.py: 64 heads at 32768 tokens, chunks of 256: 41 vs 37 us;
# 128 heads at 32768, chunks of 512: 53 vs 66 us)
LATENT_WG_MIN_CHUNK = 512
_MAX_SPLITS = SPLIT_TRAITS["FX_MAX_SPLITS"]


def latent_stages(step_tokens: int, fp8: str) -> int:
    """The ring's stages (FX_LATENT_STAGES*) for steps of ``step_tokens`` of a cache of
    format ``fp8`` ("" for q's dtype)."""
    suffix = ("8" if fp8 else "") + f"_T{step_tokens}"
    return SPLIT_TRAITS[f"FX_LATENT_STAGES{suffix}"]


def latent_shared_bytes(spec: KernelSpec) -> int:
    """The latent kernel ``spec``'s dynamic shared memory (split_latent.cuh's
    FxLatentSmem, part by part): the ring, (fp8) the widened step, the partial scores, P,
    the maxima, q's largest magnitudes; the wgmma kernel's (split_latent_wg.cuh's
    FxLatentWgSmem): 1024 bytes to align its tiles, q's tile, (fp8) the widened step, two
    stages, P, the maxima and q's largest magnitudes."""
    tok, rt, fp8 = spec.step_tokens, spec.heads_per_block // 16, spec.fp8
    if spec.heads_per_block == LATENT_WG_HEADS:
        tile = tok * spec.head_dim * 2
        stage = tok * spec.head_dim * (1 if fp8 else 2)
        return 1024 + tile + (tile if fp8 else 0) + 2 * stage + 64 * tok * 2 + 3 * 64 * 4
    row = spec.head_dim + (spec.head_dim_v if spec.own_v else 0)
    ring = latent_stages(tok, fp8) * tok * row * (1 if fp8 else 2)
    wide = tok * row * 2 if fp8 else 0
    part = 4 * rt * (tok // 8) * 32 * 16
    p = 16 * rt * (tok + 8) * 2
    red = (tok // 8) * 16 * rt * 4
    return ring + wide + part + p + red + 16 * rt * 4


@dataclass(frozen=True)
class LatentPlan:
    """An MLA decode on the latent kernel: blocks of ``spec.heads_per_block`` rows (a KV
    head's n_q x group rows in ``row_blocks`` blocks), ``splits`` chunks of whole steps,
    merged by the verify rows' combine (the window, sinks and LSE)."""

    spec: KernelSpec
    row_blocks: int
    splits: int
    combine_features: int = 0

    @property
    def threads(self) -> int:
        return 32 * LATENT_WARPS

    @property
    def tile(self) -> int:
        """The chunks' granularity: one step."""
        return self.spec.step_tokens

    @property
    def shared_bytes(self) -> int:
        return latent_shared_bytes(self.spec)

    def grid(self, n_kv_heads: int) -> tuple[int, int, int]:
        return (self.splits, n_kv_heads * self.row_blocks, 1)

    def workspace_floats(self, rows: int) -> int:
        """Floats of scratch: each output row's partial output, maximum and sum per chunk."""
        return rows * self.splits * (self.spec.head_dim_v + 2)

    def combine_spec(self) -> KernelSpec:
        return KernelSpec("vrcombine", self.spec.dtype, features=self.combine_features)


def latent_plan(
    dtype: str, fp8: str, n_q: int, n_heads: int, n_kv_heads: int, head_dim: int,
    head_dim_v: int, plan_seq: int, features: int, *, multiprocessor_count: int,
    shared_per_block: int, compute_capability: tuple[int, int], own_v: bool = False,
    wgmma: bool = True, wg_min_chunk: int = LATENT_WG_MIN_CHUNK,
) -> LatentPlan:  # fmt: skip
    """The latent kernel's plan for ``n_q`` queries of ``n_heads`` heads over up to
    ``plan_seq`` tokens (``dtype``: the kernels' f16 or bf16; ``fp8``: the cache's format
    or ""; ``features``: F_* bits, those past LATENT_FEATURES and COMBINE_FEATURES
    refused by the spec; ``own_v``: V rows of their own, a value cache apart from K's,
    rather than K's first ``head_dim_v`` columns). Steps of 64 tokens where the block's
    shared memory holds their ring, else 32. More than 32 rows a KV head, values K's first
    512 columns, on compute capability 9.0 (``wgmma``): the warpgroup-MMA kernel, blocks
    of 64 rows (split_latent_wg.cuh), where its shared memory fits and its chunks are
    ``wg_min_chunk`` tokens or more (shorter: the mma.sync kernel measured faster).

    Raises:
        ValueError: a device without the kernel's instructions (compute capability 8.0 for
            cp.async and the bf16 mma, 8.9 for fp8 conversions), or whose shared memory per
            block cannot hold even the 32-token ring; naming ``device``.
    """
    if compute_capability < TENSOR_CORES_FROM:
        raise ValueError(f"device: the latent kernels need compute capability "
                         f"{TENSOR_CORES_FROM} or newer, got {compute_capability}")  # fmt: skip
    if fp8 and compute_capability < FP8_FROM:
        raise ValueError(f"device: an fp8 latent cache needs compute capability {FP8_FROM} "
                         f"or newer, got {compute_capability}")  # fmt: skip
    rows_kv = n_q * (n_heads // n_kv_heads)
    if (wgmma and rows_kv > 32 and compute_capability == (9, 0) and not own_v
            and head_dim_v == LATENT_WG_HEAD_DIM_V):  # fmt: skip
        wg = KernelSpec("latent", dtype, head_dim, fp8=fp8, head_dim_v=head_dim_v,
                        heads_per_block=LATENT_WG_HEADS, step_tokens=64,
                        features=features & LATENT_FEATURES)  # fmt: skip
        if latent_shared_bytes(wg) <= shared_per_block:
            plan = _spread(wg, -(-rows_kv // LATENT_WG_HEADS), n_kv_heads, plan_seq,
                           multiprocessor_count, features)  # fmt: skip
            if chunk_tokens(max(plan_seq, 1), plan.splits, plan.tile) >= wg_min_chunk:
                return plan
    heads = 16 if rows_kv <= 16 else 32
    row_blocks = -(-rows_kv // heads)
    spec = None
    for tokens in (64, 32):
        spec = KernelSpec("latent", dtype, head_dim, fp8=fp8, head_dim_v=head_dim_v,
                          heads_per_block=heads, step_tokens=tokens, own_v=own_v,
                          features=features & LATENT_FEATURES)  # fmt: skip
        if latent_shared_bytes(spec) <= shared_per_block:
            break
    else:
        assert spec is not None
        raise ValueError(
            f"device: its {shared_per_block} bytes of shared memory per block do not hold "
            f"the latent kernel's ring ({latent_shared_bytes(spec)} bytes at 32 tokens a step)"
        )
    return _spread(spec, row_blocks, n_kv_heads, plan_seq, multiprocessor_count, features)


def _spread(
    spec: KernelSpec, row_blocks: int, n_kv_heads: int, plan_seq: int,
    multiprocessor_count: int, features: int,
) -> LatentPlan:  # fmt: skip
    """The plan of ``spec``: chunks enough to fill one wave, each at least LATENT_MIN_CHUNK."""
    most = max(1, multiprocessor_count // (n_kv_heads * row_blocks))
    splits = max(1, min(most, -(-max(plan_seq, 1) // LATENT_MIN_CHUNK), _MAX_SPLITS))
    return LatentPlan(spec, row_blocks, splits, features & COMBINE_FEATURES)
