"""The split kernels' compile-time constants, in one table: the host plans its launches with
them (decode/plan.py: grids, threads, shared memory) and the kernels are compiled with them
(``catalogue.kernel_source`` puts them in place of the split file's
``#include "split_traits.h"``), so the two cannot drift apart and nothing is read back
from the source.

Each value was measured; the notes say how (docs/design.md has the runs). Change a value
here, and both the kernels and the plans follow.
"""

from __future__ import annotations

import re
from collections.abc import Callable

__all__ = [
    "COMBINE_FEATURES",
    "FEATURES",
    "F_ALIBI",
    "F_CAP",
    "F_HND",
    "F_LIMIT",
    "F_LSE",
    "F_SCALE",
    "F_SINKS",
    "F_WINDOW",
    "GENERATED_PARTS",
    "SPLIT_TRAITS",
    "SPLIT_TRAITS_INCLUDE",
    "chunk_tokens",
    "padded_stages",
    "traits_header",
]

SPLIT_TRAITS_INCLUDE = "split_traits.h"

SPLIT_TRAITS: dict[str, int] = {
    # the CUDA-core split kernels' threads per block
    "FX_THREADS": 128,
    # the largest chunk granularity (tokens): a block's tokens per iteration; tensor-core
    # chunks are multiples of it
    "FX_TILE": 64,
    "FX_MAX_SPLITS": 1024,
    # the largest (non-portable) thread block cluster of compute capability 9.0
    "FX_MAX_CLUSTER": 16,
    # the combine kernel: four warps (eight cost 0.3 us more at 16 chunks)
    "FX_COMBINE_THREADS": 128,
    # fp16/bf16 tensor-core kernels per head_dim: warps per block and steps (16 tokens of K
    # and V) in each warp's ring, so a block has FX_WARPS_D<D> * 32 threads and
    # FX_WARPS_D<D> * steps * 16 * 2 * head_dim * 2 bytes of ring. Head_dim 64 issues twice
    # the instructions per byte of 128, and eight warps hide their latency better than a
    # deeper ring; it keeps two steps in flight (4.8% faster at 32768 tokens on 16/2/64
    # than three, 0.2-0.3% slower at 131072). Head_dim 128 keeps one in flight while it
    # computes another: 2-4% faster at 4096 tokens than 3, 0.1-0.5% at 32768-131072, 2% on
    # MHA. Head_dim 256: 4 warps x 3 x 16 KB, as much as a block may have.
    "FX_WARPS_D64": 8,
    "FX_STAGES_D64": 3,
    "FX_WARPS_D128": 4,
    "FX_STAGES_D128": 2,
    "FX_WARPS_D256": 4,
    "FX_STAGES_D256": 3,
    # the launch reserves shared memory for this many steps where the ring has fewer, so
    # that one block still fills a multiprocessor (the plans' one wave of one block per
    # multiprocessor, and the clusters that fit, assume it)
    "FX_RESERVE_STAGES_D64": 4,
    "FX_RESERVE_STAGES_D128": 4,
    "FX_RESERVE_STAGES_D256": 3,
    # 4-bit caches on the swapped body (gqa_split_mma_<dt>_<q4|nvfp4>_d<D>): warps per
    # block and steps of 16 tokens in each warp's ring of nibbles and scales (2 x 16 x
    # (D / 2 + D / 16) bytes a step). Every lane widens its own fragments in registers, about
    # three times the instructions per byte of an fp8 cache, so a block takes eight or twelve
    # warps (two or three per scheduler) where the 16-bit kernels take four. Measured on an
    # H100, 32/8/128 at 131072 tokens, q4/nvfp4 us: 8 warps x 6 steps 80.9/93.7, 12 x 4
    # 73.7/85.9, 16 x 3 73.5/86.3, 8 x 3 79.8/87.3, 8 x 10 73.1/94.6, 4 x 10 79.0/97.7;
    # 8/1/256: 8 x 4 28.1/35.2, 4 x 8 29.5, 16 x 2 31.5 (spills). Twelve warps do not tile
    # head_dim 256's rows. (FX_BLOCKS4_D<D>: the blocks per multiprocessor its registers
    # are held to; two measured slower)
    "FX_WARPS4_D64": 8,
    "FX_STAGES4_D64": 8,
    "FX_BLOCKS4_D64": 1,
    "FX_WARPS4_D128": 12,
    "FX_STAGES4_D128": 4,
    "FX_BLOCKS4_D128": 1,
    "FX_WARPS4_D256": 8,
    "FX_STAGES4_D256": 4,
    "FX_BLOCKS4_D256": 1,
    # ... and the narrow kernels the plans take for short contexts (Overrides.four_bit_narrow_to,
    # 8192 tokens): a chunk of a few hundred tokens is one step or none for most of twelve
    # warps, and the block's merge of its warps' partial softmaxes grows with them. Measured
    # on an H100, graph-replayed, q4 us narrow against wide: 32/8/128 at 512/1024/2048 tokens
    # 5.8/6.9/7.2 vs 6.6/8.3/8.9, 4096 10.0 vs 10.7, 8192 12.6 vs 13.5, 16384 18.9 vs 17.3,
    # 32768 27.9 vs 23.0; 28/4/128 4096 7.8 vs 9.5, 8192 10.3 vs 11.2, 16384 13.4 vs 14.1,
    # 32768 19.8 vs 17.7; 8/1/256 4096 8.2 vs 9.3, 8192 9.7 vs 12.4, 16384 16.1 vs 13.5
    "FX_WARPS4N_D64": 4,
    "FX_STAGES4N_D64": 8,
    "FX_WARPS4N_D128": 4,
    "FX_STAGES4N_D128": 8,
    "FX_WARPS4N_D256": 4,
    "FX_STAGES4N_D256": 6,
    # the fp32 split-TF32 kernels per head_dim: warps, ring steps and tokens per step (8 or
    # 16: 8-token steps fit more warps or a wider head_dim into shared memory). Head_dim 64
    # and 128 keep one step in flight per warp while they compute another: 8-12% faster at
    # 4096 tokens than two, 1-7% at 32768 but for 64/8/128 (0.5% slower there, 1.2% at
    # 131072); head_dim 256 keeps two, as one was 1.1% slower at 512-4096.
    "FX_TC32_WARPS_D64": 8,
    "FX_TC32_STAGES_D64": 2,
    "FX_TC32_TOKENS_D64": 16,
    "FX_TC32_WARPS_D128": 8,
    "FX_TC32_STAGES_D128": 2,
    "FX_TC32_TOKENS_D128": 8,
    "FX_TC32_WARPS_D256": 4,
    "FX_TC32_STAGES_D256": 3,
    "FX_TC32_TOKENS_D256": 8,
    "FX_TC32_RESERVE_STAGES_D64": 3,
    "FX_TC32_RESERVE_STAGES_D128": 3,
    "FX_TC32_RESERVE_STAGES_D256": 3,
    # a head_dim padded to a tensor-core kernel's, with a ring depth of its own
    # (FX_STAGES_D<D>_R<DR>: the kernel of D reading rows of DR; single KV heads, not the
    # pairs or fp8 caches): bf16 32/8/80 on the 128 kernel with 3 steps against 2, in one
    # run (benchmarks/kernel_compare.py new FX_STAGES_D128=3 --padded): 26.5 vs 28.9 us at
    # 32768 tokens, 89.0 vs 97.8 at 131072, level at 4096 (4 steps: 94.1 at 131072; 112
    # with 3 steps 6-12% slower, so not)
    "FX_STAGES_D128_R80": 3,
    # a padded head_dim whose loops stop at its own columns (FX_TRIM_D<D>_R<DR> = 1: Q K^T
    # over the 32-column blocks with any of DR, P V over the 64-column ones; single KV
    # heads on the heads-as-rows body, the 256 kernel's): bf16 32/8/160 against the full
    # 256 columns, two runs in one process (kernel_compare --padded): 11.3 -> 10.6 us at
    # 4096 tokens, 51.4 -> 50.0 at 32768, 3.5% faster at 131072 (188 -> 182); 192 1.0-2.2%
    # faster. Not 144: 7% faster at 4096, but 4-9% slower at 32768-131072 (so not every
    # padded head_dim: same bits, different times), nor the pairs of 72 (r144: 1-6% slower)
    "FX_TRIM_D256_R160": 1,
    "FX_TRIM_D256_R192": 1,
    # the wide cluster kernels (head_dim 128): twice the others' warps (with 4 warps the
    # same plans were 3-32% slower)
    "FX_WIDE_WARPS": 8,
    # fp16/bf16 tensor-core kernels per head_dim: 1 = the mma's operands swapped (tokens
    # as its rows: half the mmas). Measured against the unswapped body on the same plans:
    # head_dim 128 was 0.1-2.3% faster (2% at 512 tokens, 0.3-0.5% at 32768-131072), 64
    # and 256 0.2-2.1% slower at 512-32768 (halving the mmas did not speed up the small
    # shapes: they were not bound by the tensor cores)
    "FX_MMA_SWAPPED_D64": 0,
    "FX_MMA_SWAPPED_D128": 1,
    "FX_MMA_SWAPPED_D256": 0,
    # a verify's rows kernel (split_rows.cuh): tokens per step of the block's shared K/V
    # ring, and the ring's steps per head_dim (16, 32 and 64 KB a step of K and V)
    "FX_ROWS_TOKENS": 32,
    "FX_ROWS_STAGES_D64": 4,
    "FX_ROWS_STAGES_D128": 4,
    "FX_ROWS_STAGES_D256": 3,
    # the latent (MLA) kernels (split_latent.cuh): warps per block, and the ring's stages per
    # step size (64 tokens where a block's shared memory holds them, else 32) and format
    # (16-bit, fp8 with its widened stage). Not yet measured: two 64-token stages of
    # 16-bit rows of 576 (144 KB) keep one step in flight while one is computed; fp8's
    # three fill the 227 KB of a Hopper block with the widened stage and the scores
    "FX_LATENT_WARPS": 8,
    "FX_LATENT_STAGES_T64": 2,
    "FX_LATENT_STAGES8_T64": 3,
    "FX_LATENT_STAGES_T32": 2,
    "FX_LATENT_STAGES8_T32": 2,
}


# The bits of the kernels' F, each a compile-time switch (a decode without one compiles to the
# kernel it has without features), as FX_F_<NAME> in the header: (name, bit, what it does).
# HND is a layout, not a feature, one bit all the same, so the kernels without it keep their
# code.
FEATURES: tuple[tuple[str, int, str], ...] = (
    ("WINDOW", 1, "attend to the last `window` tokens"),
    ("CAP", 2, "scores become cap * tanh(score / cap)"),
    ("ALIBI", 4, "score_j += slope_h * (j - (seq - 1))"),
    ("SINKS", 8, "exp(sink_h) in the softmax's denominator"),
    ("LSE", 16, "the log-sum-exp per head (natural log) to `lse`"),
    ("SCALE", 32, "the score scale `scale` instead of 1/sqrt(head_dim)"),
    ("HND", 64, "K and V head-major, [kv_head][token][head_dim], `head_stride` apart"),
)
_BITS = {name: bit for name, bit, _ in FEATURES}
F_WINDOW, F_CAP, F_ALIBI, F_SINKS = _BITS["WINDOW"], _BITS["CAP"], _BITS["ALIBI"], _BITS["SINKS"]
F_LSE, F_SCALE, F_HND = _BITS["LSE"], _BITS["SCALE"], _BITS["HND"]
F_LIMIT = 2 * max(_BITS.values())  # every F is below this
# those the combine kernel applies (the rest end in the split kernel)
COMBINE_FEATURES = F_WINDOW | F_SINKS | F_LSE


# the padded head dims' own traits: FX_<TRAIT>_D<D>_R<DR> -> Fx<Trait><D, DR>
_PADDED = re.compile(r"FX_(STAGES|TRIM)_D(\d+)_R(\d+)")


def chunk_tokens(seq: int, splits: int, tile: int) -> int:
    """Tokens per chunk of a split decode over ``seq`` tokens: split_common.cuh's
    ``fx_chunk`` on the host (at most ``splits`` chunks, each a multiple of ``tile``)."""
    per_split = -(-seq // splits)
    return -(-per_split // tile) * tile


def padded_stages(kernel_dim: int, head_dim: int) -> int | None:
    """The ring depth of the fp16/bf16 tensor-core kernel of ``kernel_dim`` reading rows of
    ``head_dim`` where one of its own was measured (FX_STAGES_D<D>_R<DR>), else None."""
    return SPLIT_TRAITS.get(f"FX_STAGES_D{kernel_dim}_R{head_dim}")


def traits_header() -> str:
    """The ``#define`` lines of SPLIT_TRAITS and the feature bits (FX_F_*), as the split
    file includes them, and the
    padded head dims' own traits as FxPaddedStages<D, DR> (ring depth) and FxPaddedTrim<D,
    DR> (loops stop at DR's columns); 0 where a head_dim has none (the kernel's own)."""
    lines = ["// generated from ferrox_driver/kernels/traits.py (SPLIT_TRAITS, FEATURES)"]
    lines += [f"#define {name} {value}" for name, value in SPLIT_TRAITS.items()]
    lines += [f"#define FX_F_{name} {bit}  // {what}" for name, bit, what in FEATURES]
    for trait in ("Stages", "Trim"):
        lines.append(
            f"template <int D, int DR> struct FxPadded{trait} "
            "{ static constexpr int value = 0; };"
        )
    for name in SPLIT_TRAITS:
        if m := _PADDED.fullmatch(name):
            lines.append(
                f"template <> struct FxPadded{m[1].title()}<{m[2]}, {m[3]}> "
                f"{{ static constexpr int value = {name}; }};"
            )
    return "\n".join(lines) + "\n"


# the parts of kernel files that the host writes (compiler.expand_includes)
GENERATED_PARTS: dict[str, Callable[[], str]] = {SPLIT_TRAITS_INCLUDE: traits_header}
