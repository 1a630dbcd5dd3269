"""A decode kernel's identity as a typed value: ``KernelSpec``. Its ``name`` (the symbol the
module exports, and what the module caches key on) and its ``entry`` (the line of the split
file's own macros that instantiates it for a module of its own) are rendered from its fields;
nothing in the package parses a name back (flash-attention's ``generate_kernels.py`` does the
same: a kernel is a dataclass, its name an output).

The names, as they have been since the kernels were first cached on disk:

    gqa_split_<dt>_g<G>_<vec|any>[_x<F>]                          CUDA cores ("generic")
    gqa_split_<dt>[_<fp8>]_g<G>_<vec|any>_d512[_x<F>]             ... head_dims 257..512
    gqa_split_tc32_f32_d<D>[_x<F>][_cluster]                      fp32 on tensor cores
    gqa_split_mma_<dt>[_<fp8>]_d<D>[_r<DR>][_wide][_p2][_t2[b<2|4>]][_x<F>][_cluster]
                                                                  fp16/bf16 on tensor cores
    gqa_split_mma_<dt>_<q4|nvfp4>[r]_d<D>[_t2][_n]_x<F>[_cluster]  ... over a 4-bit cache
                                                                  (_n: the narrow blocks)
    gqa_split_combine_<dt>[_x<F>]                                 merges the chunks
    gqa_verify_tail_<dt>[_<fp8>][_d512]_x<F>, gqa_verify_combine_<dt>_x<F>  a verify's tail,
                                                                  combine
    gqa_verify_rows_<dt>[_<fp8>]_d<D>_w<RW>_x<F>                  a verify's rows kernel
    gqa_verify_rows_<dt>_<fp8>[r]_v<fp8>_d<D>_w<RW>_x<F>           ... K and V in formats of
                                                                  their own (K's, then V's)
    gqa_verify_rows_combine_<dt>_x<F>                             ... and its combine
    gqa_split_latent_<dt>[_<fp8>]_dk<DK>_dv<DV>[_sv]_h<HT>[_t32]_x<F>  multi-head latent
                                                                  attention (split_latent.cuh;
                                                                  _sv: V rows of their own)
    gqa_decode_<dt>[_d512]                                        the parity kernel

(an fp8 or 4-bit cache's kernels always carry ``_x<F>``, F = 0 included; ``r``: K
rotated). No driver import: the planner and its tests build specs on a machine without a
GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from .traits import COMBINE_FEATURES, F_CAP, F_HND, F_LIMIT, F_LSE, F_SCALE, F_SINKS, F_WINDOW

__all__ = [
    "ENTRY_TYPES",
    "FP8_FORMATS",
    "KERNEL_DTYPE_NAMES",
    "KernelSpec",
    "LATENT_FEATURES",
    "LATENT_HEADS_PER_BLOCK",
    "LATENT_MAX_HEAD_DIM",
    "LATENT_STEP_TOKENS",
    "LATENT_WG_HEADS",
    "LATENT_WG_HEAD_DIM_V",
    "MMA_HEAD_DIMS",
    "NARROW_ROWS_HEAD_DIM",
    "PARITY_FILE",
    "FOUR_BIT_FORMATS",
    "NVFP4_FORMAT",
    "Q4_FORMAT",
    "QUANTIZED_FORMATS",
    "QUANTIZED_Q8",
    "ROWS_HEAD_DIMS",
    "ROWS_MAX_WARPS",
    "SPLIT_FILE",
    "TC32_HEAD_DIMS",
    "WIDE_HEAD_DIM",
    "WIDE_ROWS_HEAD_DIM",
    "WIDE_ROWS_MAX_HEADS",
    "kernel_dtype",
    "kv_formats",
    "mixed_format",
]

SPLIT_FILE = "gqa_decode_split.cu"
PARITY_FILE = "gqa_decode.cu"

# numpy dtype names -> the kernels' suffix (decode/checks.py's SUPPORTED_DTYPES is this table)
KERNEL_DTYPE_NAMES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
# the kernels' suffix -> the C type their macros take
ENTRY_TYPES = {"f32": "float", "f16": "fx_half", "bf16": "fx_bf16"}
# fp8 caches (KVCache dtype float8_e4m3fn / float8_e5m2): the kernels' Q8 (FX_E4M3, FX_E5M2)
FP8_FORMATS = {"e4m3": 1, "e5m2": 2}
Q4_FORMAT = "q4"  # 4-bit caches (cache/four_bit.py): the kernels' Q8 FX_Q4, FX_NVFP4
FOUR_BIT_Q8 = {"q4": 3, "nvfp4": 4}
NVFP4_FORMAT = "nvfp4"
FOUR_BIT_FORMATS = (Q4_FORMAT, NVFP4_FORMAT)
QUANTIZED_Q8 = {**FP8_FORMATS, **FOUR_BIT_Q8}  # the kernels' Q8 of every quantized format
QUANTIZED_FORMATS = (*FP8_FORMATS, *FOUR_BIT_FORMATS)
MMA_HEAD_DIMS = (64, 128, 256)  # the fp16/bf16 tensor-core kernels' own head_dims
TC32_HEAD_DIMS = (64, 128, 256)  # the fp32 tensor-core (split TF32) kernels'
WIDE_HEAD_DIM = 128  # the wide cluster kernels'
# the CUDA-core kernels' (generic, a verify's tail, parity) twins of 16 elements a lane
# (_d512): head_dims 257..512; the others take 1..NARROW_ROWS_HEAD_DIM
WIDE_ROWS_HEAD_DIM = 512
NARROW_ROWS_HEAD_DIM = 256
WIDE_ROWS_MAX_HEADS = 4  # a _d512 split kernel's query heads per block (registers, shared)

FAMILIES = (
    "generic", "tc32", "mma", "combine", "parity", "verify", "vcombine", "vrows", "vrcombine",
    "latent",
)  # fmt: skip
ROWS_HEAD_DIMS = (64, 128, 256)  # a verify's rows kernel's (split_rows.cuh)
ROWS_MAX_WARPS = 8  # ... warps of 16 rows per block, at most
# the latent (MLA) kernels' (split_latent.cuh): query rows per block (16 x its row tiles),
# tokens per step, the widest K row (q's fragments of a quarter of it stay in registers),
# and the features the kernel itself applies (the window, sinks and LSE reach its combine)
LATENT_HEADS_PER_BLOCK = (16, 32, 64)
LATENT_STEP_TOKENS = (32, 64)
LATENT_MAX_HEAD_DIM = 576
# the latent kernel on Hopper's warpgroup MMA (split_latent_wg.cuh, sm_90a alone): blocks of
# 64 rows, values K's first 512 columns
LATENT_WG_HEADS = 64
LATENT_WG_HEAD_DIM_V = 512
LATENT_FEATURES = F_WINDOW | F_CAP | F_SCALE


def mixed_format(k_fmt: str, v_fmt: str) -> str:
    """The cache format of K in ``k_fmt`` and V in ``v_fmt`` (QUANTIZED_FORMATS): the one
    name where they agree, else ``"<k>+<v>"`` (a cache's ``fp8``, what the decode entry
    points pass down to the planner)."""
    return k_fmt if k_fmt == v_fmt else f"{k_fmt}+{v_fmt}"


def kv_formats(fmt: str) -> tuple[str, str]:
    """K's and V's formats of a cache format (`mixed_format`'s inverse; ``""``: q's dtype)."""
    k_fmt, _, v_fmt = fmt.partition("+")
    return k_fmt, v_fmt or k_fmt


def kernel_dtype(dtype: Any) -> str:
    """The kernels' suffix for a (validated) numpy dtype: ``f32``, ``f16`` or ``bf16``.

    Raises:
        KeyError: a dtype the kernels do not take.
    """
    return KERNEL_DTYPE_NAMES[np.dtype(dtype).name]


@dataclass(frozen=True)
class KernelSpec:
    """One decode kernel, by what makes it: the family, q's dtype and the compile-time
    choices its name encodes.

    Attributes:
        family: ``generic`` (CUDA cores), ``tc32`` (fp32 on tensor cores), ``mma``
            (fp16/bf16 on tensor cores), ``combine`` (merges a split plan's chunks) or
            ``parity`` (ferrox-cuda's algorithm, corrected; a file of its own).
        dtype: q's and the output's kernel dtype, ``f32``, ``f16`` or ``bf16``.
        head_dim: tc32/mma: the head_dim D the kernel is built for (its ring and tiles);
            generic, verify (the tail) and parity: 0 (head_dims 1..256) or
            WIDE_ROWS_HEAD_DIM (the twin of 16 elements a lane, head_dims 257..512).
        row_dim: mma: the cache rows' elements DR the kernel reads, where they are fewer
            than D (a padded head_dim: columns past DR are zeros never read) or a pair's
            2 x head_dim; 0 (the default) means D.
        heads_per_block: generic: query heads per block (G).
        vec: generic: 16-byte vector loads (head_dim a multiple of 8, rows aligned).
        tiles: mma: tiles of 8 query heads per KV head (2: groups of 9-16, or any group of
            a verify's rows, in tiles of 8).
        block_tiles: mma, tiled: tiles one block takes with one pass over K and V (2 or 4:
            a verify's rows 16 or 32 at a time; the swapped body, head_dim 128).
        paired: mma: two adjacent KV heads' rows read as one row of ``row_dim``.
        wide: mma: the wide cluster kernel (head_dim 128, twice the warps).
        fp8: mma, and generic of WIDE_ROWS_HEAD_DIM: an fp8 cache's format
            (FP8_FORMATS), or "" for a cache of q's dtype.
        features: the F_* bits compiled in (kernels.traits).
        row_warps: vrows: warps per block, 16 rows each.
        rotate: vrows or mma of a 4-bit cache (fp8 "q4" or "nvfp4"): K was rotated on
            append, q is rotated by the kernel.
        v_fp8: vrows: V's format where it is not K's (``fp8``; both of QUANTIZED_FORMATS),
            or "" (V as K).
        narrow: mma of a 4-bit cache: the short contexts' kernel, FX_WARPS4N_D<D> warps of
            FX_STAGES4N_D<D> steps (not FX_WARPS4_D<D> of FX_STAGES4_D<D>).
        head_dim_v: latent: the value rows' width DV (head_dim is K's, DK).
        step_tokens: latent: tokens per step of its ring (LATENT_STEP_TOKENS).
        own_v: latent: V rows of their own (a separate value cache), not the first
            head_dim_v columns of K's rows (MLA's latent).
        cluster: the twin whose blocks merge a KV head's chunks on chip.

    Raises:
        ValueError: no kernel of the split file is made of these fields.
    """

    family: str
    dtype: str
    head_dim: int = 0
    row_dim: int = 0
    heads_per_block: int = 0
    vec: bool = False
    tiles: int = 1
    block_tiles: int = 1
    paired: bool = False
    wide: bool = False
    fp8: str = ""
    features: int = 0
    cluster: bool = False
    row_warps: int = 0
    rotate: bool = False
    v_fp8: str = ""
    narrow: bool = False
    head_dim_v: int = 0
    step_tokens: int = 0
    own_v: bool = False

    def __post_init__(self) -> None:
        if self.family == "mma" and self.row_dim == 0:
            object.__setattr__(self, "row_dim", self.head_dim)  # one value for one kernel
        problem = self._problem()
        if problem:
            raise ValueError(f"kernel: {SPLIT_FILE} has no kernel of {self!r} ({problem})")

    def _problem(self) -> str:
        """Why no kernel has these fields ("" when one does): the split file's macros."""
        if self.family not in FAMILIES:
            return f"family not one of {FAMILIES}"
        if self.dtype not in ENTRY_TYPES:
            return f"dtype not one of {tuple(ENTRY_TYPES)}"
        if not 0 <= self.features < F_LIMIT:
            return f"features not in [0, {F_LIMIT})"
        mma = self.family == "mma"
        rows = self.family == "vrows"
        latent = self.family == "latent"
        if not latent and (self.head_dim_v or self.step_tokens or self.own_v):
            return "head_dim_v, step_tokens and own_v are the latent kernels'"
        if latent:
            return self._latent_problem()
        if self.rotate and not (rows or (mma and self.fp8 in FOUR_BIT_FORMATS)):
            return "rotate is a 4-bit cache's rows or mma kernel's"
        if self.v_fp8 and not rows:
            return "v_fp8 (V's own format) is the rows kernel's"
        if self.narrow and not (mma and self.fp8 in FOUR_BIT_FORMATS):
            return "narrow is a 4-bit cache's mma kernel's"
        if self.v_fp8 and (self.v_fp8 == self.fp8 or not {self.fp8, self.v_fp8} <= set(
                QUANTIZED_FORMATS)):  # fmt: skip
            return f"v_fp8 and fp8 two of {QUANTIZED_FORMATS} (K's and V's), not the same"
        if rows != (self.row_warps > 0):
            return "row_warps (1 to 8) is the rows kernel's, and it needs them"
        if self.family in ("vrows", "vrcombine"):
            others = (self.row_dim, self.heads_per_block, self.vec, self.paired, self.wide,
                      self.cluster, self.tiles != 1, self.block_tiles != 1)  # fmt: skip
            if any(others) or (not rows and (self.head_dim or self.fp8)):
                return "a verify's rows kernels take dtype, head_dim, fp8 (the rows') and features"
            if self.dtype == "f32":
                return "fp16/bf16"
            if self.fp8 not in ("", *FP8_FORMATS, *FOUR_BIT_FORMATS):
                return f"fp8 not one of {(*FP8_FORMATS, *FOUR_BIT_FORMATS)}"
            if self.rotate and self.fp8 not in FOUR_BIT_FORMATS:
                return "rotate is a 4-bit cache's"
            if self.v_fp8 and self.features & F_HND:
                return "K and V in formats of their own are token-major"
            if rows and (self.head_dim not in ROWS_HEAD_DIMS or self.row_warps > ROWS_MAX_WARPS):
                return f"head_dim one of {ROWS_HEAD_DIMS}, 1 to {ROWS_MAX_WARPS} row warps"
            if rows and self.features & (F_SINKS | F_LSE):
                return "sinks and the LSE are its combine's"
            return ""
        if self.family in ("verify", "vcombine"):
            if self.head_dim not in (0, WIDE_ROWS_HEAD_DIM) or (
                self.head_dim and self.family != "verify"
            ):
                return f"a verify's tail takes head_dim 0 or {WIDE_ROWS_HEAD_DIM}"
            if self.row_dim or self.tiles != 1 or self.block_tiles != 1 or self.paired or self.wide:
                return "a verify's kernels take dtype, fp8 (the tail) and features only"
            if self.heads_per_block or self.vec or self.cluster:
                return "a verify's kernels take dtype, fp8 (the tail) and features only"
            if self.fp8 and (self.family != "verify" or self.fp8 not in FP8_FORMATS):
                return f"fp8 (one of {tuple(FP8_FORMATS)}) is the tail kernel's"
            if self.fp8 and self.dtype == "f32":
                return "an fp8 cache takes fp16/bf16 q"
            return ""
        if not mma and self.block_tiles != 1:
            return "block_tiles is the fp16/bf16 tensor-core kernels'"
        if not mma and (self.row_dim or self.tiles != 1 or self.paired or self.wide):
            return "row_dim, tiles, paired and wide are the fp16/bf16 tensor-core kernels'"
        wide_rows = self.head_dim == WIDE_ROWS_HEAD_DIM and self.family in ("generic", "parity")
        if not mma and self.fp8 and not (wide_rows and self.family == "generic"):
            return f"fp8: the fp16/bf16 tensor-core kernels' and generic d{WIDE_ROWS_HEAD_DIM}'s"
        if self.family != "generic" and (self.heads_per_block or self.vec):
            return "heads_per_block and vec are the CUDA-core kernels'"
        if self.family in ("generic", "combine", "parity"):
            if (self.head_dim and not wide_rows) or self.cluster:
                return f"no head_dim (but {WIDE_ROWS_HEAD_DIM}: generic, parity) or cluster twin"
            if self.family == "generic" and self.heads_per_block < 1:
                return "heads_per_block at least 1"
            if wide_rows and self.family == "generic":
                if self.heads_per_block > WIDE_ROWS_MAX_HEADS:
                    return f"heads_per_block up to {WIDE_ROWS_MAX_HEADS} at head_dim 512"
                if self.fp8 and (self.fp8 not in FP8_FORMATS or self.dtype == "f32"):
                    return f"fp8 one of {tuple(FP8_FORMATS)}, q fp16/bf16"
            if self.family == "combine" and self.features & ~COMBINE_FEATURES:
                return "the combine kernel takes window, sinks and the LSE only"
            if self.family == "parity" and self.features:
                return "the parity kernel takes no features"
            return ""
        if self.family == "tc32":
            if self.dtype != "f32" or self.head_dim not in TC32_HEAD_DIMS:
                return f"fp32, head_dim one of {TC32_HEAD_DIMS}"
            if self.features and self.cluster:
                return "its cluster twins take no features"
            return ""
        d, dr = self.head_dim, self.row_dim
        if self.dtype == "f32" or d not in MMA_HEAD_DIMS:
            return f"fp16/bf16, head_dim one of {MMA_HEAD_DIMS}"
        if self.fp8 in FOUR_BIT_FORMATS:
            if dr != d or self.paired or self.wide or self.block_tiles != 1:
                return "a 4-bit cache's kernels: their own head_dim, not paired or wide"
        elif self.fp8 and self.fp8 not in FP8_FORMATS:
            return f"fp8 not one of {(*FP8_FORMATS, *FOUR_BIT_FORMATS)}"
        if self.tiles not in (1, 2):
            return "tiles 1 or 2"
        if self.block_tiles not in (1, 2, 4):
            return "block_tiles 1, 2 or 4"
        if self.block_tiles > 1 and (self.tiles != 2 or d != 128 or self.wide or self.paired):
            return "two tiles per block: tiled, head_dim 128 (the swapped body), not wide or paired"
        if self.wide:
            if d != WIDE_HEAD_DIM or dr != d or self.tiles != 1 or self.paired:
                return f"the wide kernel: head_dim {WIDE_HEAD_DIM}, one tile, not paired"
            return "" if self.cluster else "the wide kernel is a cluster kernel"
        if self.paired:
            if self.fp8 or self.features or self.cluster:
                return "the paired kernels take no fp8, features or clusters"
            return "" if 0 < dr <= d and dr % 16 == 0 else "a pair's row_dim a multiple of 16"
        return "" if 0 < dr <= d and dr % 8 == 0 else "row_dim a multiple of 8 up to head_dim"

    def _latent_problem(self) -> str:
        """Why no latent kernel has these fields ("" when one does)."""
        others = (self.row_dim, self.vec, self.paired, self.wide, self.cluster, self.row_warps,
                  self.rotate, self.v_fp8, self.narrow, self.tiles != 1,
                  self.block_tiles != 1)  # fmt: skip
        if any(others):
            return ("a latent kernel takes dtype, fp8, head_dim, head_dim_v, own_v, "
                    "heads_per_block, step_tokens and features")  # fmt: skip
        if self.dtype == "f32":
            return "fp16/bf16"
        if self.fp8 and self.fp8 not in FP8_FORMATS:
            return f"fp8 one of {tuple(FP8_FORMATS)}"
        dk, dv = self.head_dim, self.head_dim_v
        if not (0 < dk <= LATENT_MAX_HEAD_DIM and dk % 64 == 0):
            return f"head_dim a multiple of 64 up to {LATENT_MAX_HEAD_DIM}"
        if not (0 < dv <= (512 if self.own_v else dk) and dv % 128 == 0):
            return "head_dim_v a multiple of 128 up to head_dim (own_v: up to 512)"
        if self.heads_per_block not in LATENT_HEADS_PER_BLOCK:
            return f"heads_per_block one of {LATENT_HEADS_PER_BLOCK}"
        if self.heads_per_block == LATENT_WG_HEADS and (
            self.own_v or dv != LATENT_WG_HEAD_DIM_V or self.step_tokens != 64
        ):
            return (f"heads_per_block {LATENT_WG_HEADS} (the wgmma kernel): values of "
                    f"{LATENT_WG_HEAD_DIM_V} within K's rows, steps of 64 tokens")  # fmt: skip
        if self.step_tokens not in LATENT_STEP_TOKENS:
            return f"step_tokens one of {LATENT_STEP_TOKENS}"
        if self.features & ~LATENT_FEATURES:
            return "features: the window, the soft-cap and the scale (its combine: sinks, LSE)"
        return ""

    @property
    def tensor_cores(self) -> bool:
        return self.family in ("tc32", "mma", "latent")

    @property
    def file(self) -> str:
        """The kernel file it lives in."""
        return PARITY_FILE if self.family == "parity" else SPLIT_FILE

    @cached_property
    def name(self) -> str:
        """The kernel's symbol (see the module's grammar)."""
        dt, d, dr = self.dtype, self.head_dim, self.row_dim
        family = self.family
        wide_rows = f"_d{d}" if d else ""  # (generic, verify, parity: WIDE_ROWS_HEAD_DIM)
        if family == "parity":
            return f"gqa_decode_{dt}{wide_rows}"
        if family == "verify":
            return (
                f"gqa_verify_tail_{dt}"
                + (f"_{self.fp8}" if self.fp8 else "")
                + wide_rows
                + (f"_x{self.features}")
            )
        if family == "vcombine":
            return f"gqa_verify_combine_{dt}_x{self.features}"
        if family == "vrows":
            fp8 = f"_{self.fp8}{'r' if self.rotate else ''}" if self.fp8 else ""
            fp8 += f"_v{self.v_fp8}" if self.v_fp8 else ""
            return f"gqa_verify_rows_{dt}{fp8}_d{d}_w{self.row_warps}_x{self.features}"
        if family == "vrcombine":
            return f"gqa_verify_rows_combine_{dt}_x{self.features}"
        if family == "latent":
            return (
                f"gqa_split_latent_{dt}"
                + (f"_{self.fp8}" if self.fp8 else "")
                + f"_dk{d}_dv{self.head_dim_v}"
                + ("_sv" if self.own_v else "")
                + f"_h{self.heads_per_block}"
                + (f"_t{self.step_tokens}" if self.step_tokens != 64 else "")
                + f"_x{self.features}"
            )
        if family == "generic":
            fp8 = f"_{self.fp8}" if self.fp8 else ""
            stem = f"gqa_split_{dt}{fp8}_g{self.heads_per_block}_{'vec' if self.vec else 'any'}"
            stem += wide_rows
        elif family == "combine":
            stem = f"gqa_split_combine_{dt}"
        elif family == "tc32":
            stem = f"gqa_split_tc32_f32_d{d}"
        else:
            rot = "r" if self.rotate else ""
            stem = f"gqa_split_mma_{dt}" + (f"_{self.fp8}{rot}" if self.fp8 else "") + f"_d{d}"
            stem += f"_r{dr}" if dr != d or self.paired else ""
            stem += "_wide" if self.wide else ""
            stem += "_p2" if self.paired else ""
            stem += "_t2" if self.tiles == 2 else ""
            stem += f"b{self.block_tiles}" if self.block_tiles > 1 else ""
            stem += "_n" if self.narrow else ""
        stem += f"_x{self.features}" if self.features or self.fp8 else ""
        return stem + ("_cluster" if self.cluster else "")

    @cached_property
    def entry(self) -> str:
        """The line of the split file's macros that instantiates this kernel in a module of
        its own (FX_SELECTED), with its ``_cluster`` twin where the macro makes both (the
        twins' entries are the same line).

        Raises:
            ValueError: the parity kernel (its file is compiled whole).
        """
        name, t, d, dr, f = (
            self.name,
            ENTRY_TYPES[self.dtype],
            self.head_dim,
            self.row_dim,
            self.features,
        )
        base = name.removesuffix("_cluster")  # the macro names the twin itself
        tiled = (
            str(self.block_tiles)
            if self.block_tiles > 1
            else "true"
            if self.tiles == 2
            else "false"
        )
        family = self.family
        if family == "parity":
            raise ValueError(f"kernel: {name} is in {PARITY_FILE}, compiled whole (no entry)")
        if family == "verify":
            kt = "unsigned char" if self.fp8 else t
            q8 = FP8_FORMATS[self.fp8] if self.fp8 else 0
            macro = "FX_VERIFY_TAIL_D512_ENTRY" if d else "FX_VERIFY_TAIL_ENTRY"
            return f"{macro}({name}, {t}, {kt}, {q8}, {f})"
        if family == "vcombine":
            return f"FX_VERIFY_COMBINE_ENTRY({name}, {t}, {f})"
        if family == "vrows" and self.v_fp8:
            kq, vq = (QUANTIZED_Q8[fmt] for fmt in (self.fp8, self.v_fp8))
            return (f"FX_VERIFY_ROWS_MIXED_ENTRY({name}, {t}, {kq}, {vq}, {d}, {self.row_warps}, "
                    f"{f}, {int(self.rotate)})")  # fmt: skip
        if family == "vrows" and self.fp8 in FOUR_BIT_FORMATS:
            macro = (
                "FX_VERIFY_ROWS4_ENTRY" if self.fp8 == Q4_FORMAT else "FX_VERIFY_ROWS_NVFP4_ENTRY"
            )
            return f"{macro}({name}, {t}, {d}, {self.row_warps}, {f}, {int(self.rotate)})"
        if family == "vrows" and self.fp8:
            q8 = FP8_FORMATS[self.fp8]
            return f"FX_VERIFY_ROWS8_ENTRY({name}, {t}, {q8}, {d}, {self.row_warps}, {f})"
        if family == "vrows":
            return f"FX_VERIFY_ROWS_ENTRY({name}, {t}, {d}, {self.row_warps}, {f})"
        if family == "vrcombine":
            return f"FX_VERIFY_ROWS_COMBINE_ENTRY({name}, {t}, {f})"
        if family == "latent" and self.heads_per_block == LATENT_WG_HEADS:
            q8 = FP8_FORMATS[self.fp8] if self.fp8 else 0
            return f"FX_LATENT_WG_ENTRY({name}, {t}, {q8}, {d}, {self.head_dim_v}, {f})"
        if family == "latent":
            q8 = FP8_FORMATS[self.fp8] if self.fp8 else 0
            vk = "false" if self.own_v else "true"
            rt = self.heads_per_block // 16
            return (f"FX_LATENT_ENTRY({name}, {t}, {q8}, {d}, {self.head_dim_v}, {vk}, {rt}, "
                    f"{self.step_tokens}, {f})")  # fmt: skip
        if family == "generic":
            vec = "true" if self.vec else "false"
            g = self.heads_per_block
            if d and self.fp8:
                q8 = FP8_FORMATS[self.fp8]
                return f"FX_GENERIC8_D512_ENTRY({name}, {t}, {q8}, {g}, {vec}, {f})"
            if d:
                return (f"FX_GENERIC_D512_FEAT_ENTRY({name}, {t}, {g}, {vec}, {f})" if f
                        else f"FX_GENERIC_D512_ENTRY({name}, {t}, {g}, {vec})")  # fmt: skip
            if f:
                return f"FX_GENERIC_FEAT_ENTRY({name}, {t}, {g}, {vec}, {f})"
            return f"FX_GENERIC_ENTRY({name}, {t}, {g}, {vec})"
        if family == "combine":
            return (
                f"FX_COMBINE_FEAT_ENTRY({name}, {t}, {f})"
                if f
                else f"FX_COMBINE_ENTRY({name}, {t})"
            )
        if family == "tc32":
            return f"FX_TC32_FEAT_ENTRY({name}, {d}, {f})" if f else f"FX_TC32_ENTRY({base}, {d})"
        if self.fp8 in FOUR_BIT_FORMATS:
            q8 = FOUR_BIT_Q8[self.fp8]
            n = "N" if self.narrow else ""
            return (f"FX_MMA4_KERNELS({base}, {t}, {q8}, {d}, {tiled}, {f}, {int(self.rotate)}, "
                    f"FX_WARPS4{n}_D{d}, FX_STAGES4{n}_D{d})")  # fmt: skip
        if self.fp8:
            q8 = FP8_FORMATS[self.fp8]
            if self.wide:
                return f"FX_MMA8_WIDE_KERNEL({name}, {t}, {q8}, {f})"
            return f"FX_MMA8_KERNELS({base}, {t}, {q8}, {d}, {dr}, {tiled}, {f})"
        if self.wide:
            return (
                f"FX_MMA_WIDE_FEAT_ENTRY({name}, {t}, {f})"
                if f
                else f"FX_MMA_WIDE_ENTRY({name}, {t})"
            )
        if self.paired:
            return f"FX_MMA_PAIR_ENTRY({name}, {t}, {d}, {dr}, {tiled})"
        if f:
            return f"FX_MMA_FEAT_ENTRY({base}, {t}, {d}, {dr}, {tiled}, {f})"
        if self.block_tiles > 1:
            return f"FX_MMA_KERNELS({base}, {t}, {d}, {dr}, {self.block_tiles})"
        if self.tiles == 2:
            return f"FX_MMA_TILED_ENTRY({base}, {t}, {d}, {dr})"
        if dr != d:
            return f"FX_MMA_PAD_ENTRY({base}, {t}, {d}, {dr})"
        return f"FX_MMA_ENTRY({base}, {t}, {d})"

    @property
    def arch_suffix(self) -> str:
        """What its module's target adds to the device's (``"a"``: the wgmma latent
        kernel, sm_90a's own instructions)."""
        wg = self.family == "latent" and self.heads_per_block == LATENT_WG_HEADS
        return "a" if wg else ""

    @property
    def select(self) -> str | None:
        """What ``catalogue.get_kernel`` compiles for it: its entry, or None (the whole file)."""
        return None if self.family == "parity" else self.entry

    def but(self, **changes: Any) -> KernelSpec:
        """This spec with ``changes`` (``dataclasses.replace``; checked the same way)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def combine(cls, dtype: str, features: int = 0) -> KernelSpec:
        """The kernel merging a split plan's chunks into a ``dtype`` output, applying the
        ``features`` that reach it (COMBINE_FEATURES of them)."""
        return cls("combine", dtype, features=features & COMBINE_FEATURES)

    @classmethod
    def parity(cls, dtype: str, head_dim: int = 0) -> KernelSpec:
        """The parity kernel for ``dtype`` and rows of ``head_dim`` elements (its _d512
        twin past NARROW_ROWS_HEAD_DIM)."""
        return cls("parity", dtype, WIDE_ROWS_HEAD_DIM if head_dim > NARROW_ROWS_HEAD_DIM else 0)
