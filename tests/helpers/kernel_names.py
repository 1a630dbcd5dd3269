"""Kernel specs the tests share: the split file's whole-file kernels as KernelSpec values, and
the kernel-name grammar as it was before KernelSpec (``old_entry``: attention.split_entry at
tag pre-restructure, verbatim), kept as the oracle that KernelSpec's names and entry lines
must match. The library parses no name; only this oracle does."""

from __future__ import annotations

from ferrox_driver.kernels.spec import SPLIT_FILE, KernelSpec

# the oracle's own constants, as they were (not the library's)
MMA_HEAD_DIMS = (64, 128, 256)
WIDE_HEAD_DIM = 128
F_LIMIT = 128
COMBINE_FEATURES = 1 | 8 | 16  # window, sinks, LSE
DTYPES = ("f32", "f16", "bf16")


def whole_file() -> list[KernelSpec]:
    """The kernels the split file instantiates when compiled whole (no FX_SELECTED)."""
    specs = [
        KernelSpec("generic", dt, heads_per_block=g, vec=vec)
        for dt in DTYPES for vec in (True, False) for g in (1, 2, 4, 8)
    ]  # fmt: skip
    specs += [KernelSpec("combine", dt) for dt in DTYPES]
    for cluster in (False, True):
        specs += [KernelSpec("mma", dt, d, cluster=cluster) for dt in ("f16", "bf16")
                  for d in MMA_HEAD_DIMS]  # fmt: skip
        specs += [KernelSpec("tc32", "f32", d, cluster=cluster) for d in (64, 128, 256)]
    specs += [KernelSpec("mma", dt, 128, wide=True, cluster=True) for dt in ("f16", "bf16")]
    return specs


def old_entry(name: str) -> str:
    """attention.split_entry at tag pre-restructure."""
    return split_entry(name)


# ---- verbatim from ferrox_driver/attention.py at pre-restructure (the grammar, parsed) ----
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
