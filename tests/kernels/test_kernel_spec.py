"""KernelSpec: a kernel's name and entry line are rendered from typed fields, byte for byte
what the old name grammar gave (the module caches and the disk cache key on the names), and
nothing parses a name back. No GPU needed."""

from __future__ import annotations

import itertools
import re

import pytest

from ferrox_driver.driver import compiler
from ferrox_driver.kernels import traits
from ferrox_driver.kernels.spec import FP8_FORMATS, KernelSpec
from ferrox_driver.kernels.traits import F_LIMIT

from ..helpers.kernel_names import old_entry, whole_file

M, G, T, C = "mma", "generic", "tc32", "combine"

# (spec, its name, its entry line) as the library produced them before KernelSpec: the
# on-demand kernels of benchmarks/code_compare.py and a few of each family
LITERAL = [
    (KernelSpec(M, "bf16", 64, 40), "gqa_split_mma_bf16_d64_r40",
     "FX_MMA_PAD_ENTRY(gqa_split_mma_bf16_d64_r40, fx_bf16, 64, 40)"),
    (KernelSpec(M, "f16", 128, 72, cluster=True), "gqa_split_mma_f16_d128_r72_cluster",
     "FX_MMA_PAD_ENTRY(gqa_split_mma_f16_d128_r72, fx_half, 128, 72)"),
    (KernelSpec(M, "bf16", 128, tiles=2, cluster=True), "gqa_split_mma_bf16_d128_t2_cluster",
     "FX_MMA_TILED_ENTRY(gqa_split_mma_bf16_d128_t2, fx_bf16, 128, 128)"),
    (KernelSpec(M, "bf16", 64, 40, tiles=2), "gqa_split_mma_bf16_d64_r40_t2",
     "FX_MMA_TILED_ENTRY(gqa_split_mma_bf16_d64_r40_t2, fx_bf16, 64, 40)"),
    (KernelSpec(M, "bf16", 128, 80, paired=True), "gqa_split_mma_bf16_d128_r80_p2",
     "FX_MMA_PAIR_ENTRY(gqa_split_mma_bf16_d128_r80_p2, fx_bf16, 128, 80, false)"),
    (KernelSpec(M, "bf16", 128, 96, paired=True, tiles=2), "gqa_split_mma_bf16_d128_r96_p2_t2",
     "FX_MMA_PAIR_ENTRY(gqa_split_mma_bf16_d128_r96_p2_t2, fx_bf16, 128, 96, true)"),
    (KernelSpec(M, "bf16", 256, 256, paired=True), "gqa_split_mma_bf16_d256_r256_p2",
     "FX_MMA_PAIR_ENTRY(gqa_split_mma_bf16_d256_r256_p2, fx_bf16, 256, 256, false)"),
    (KernelSpec(M, "f16", 256, features=127, cluster=True),
     "gqa_split_mma_f16_d256_x127_cluster",
     "FX_MMA_FEAT_ENTRY(gqa_split_mma_f16_d256_x127, fx_half, 256, 256, false, 127)"),
    (KernelSpec(M, "bf16", 128, 96, tiles=2, features=16), "gqa_split_mma_bf16_d128_r96_t2_x16",
     "FX_MMA_FEAT_ENTRY(gqa_split_mma_bf16_d128_r96_t2_x16, fx_bf16, 128, 96, true, 16)"),
    (KernelSpec(M, "bf16", 128, wide=True, features=63, cluster=True),
     "gqa_split_mma_bf16_d128_wide_x63_cluster",
     "FX_MMA_WIDE_FEAT_ENTRY(gqa_split_mma_bf16_d128_wide_x63_cluster, fx_bf16, 63)"),
    (KernelSpec(M, "f16", 128, wide=True, cluster=True), "gqa_split_mma_f16_d128_wide_cluster",
     "FX_MMA_WIDE_ENTRY(gqa_split_mma_f16_d128_wide_cluster, fx_half)"),
    (KernelSpec(T, "f32", 128), "gqa_split_tc32_f32_d128",
     "FX_TC32_ENTRY(gqa_split_tc32_f32_d128, 128)"),
    (KernelSpec(T, "f32", 64, cluster=True), "gqa_split_tc32_f32_d64_cluster",
     "FX_TC32_ENTRY(gqa_split_tc32_f32_d64, 64)"),
    (KernelSpec(T, "f32", 256, features=63), "gqa_split_tc32_f32_d256_x63",
     "FX_TC32_FEAT_ENTRY(gqa_split_tc32_f32_d256_x63, 256, 63)"),
    (KernelSpec(G, "bf16", heads_per_block=4, features=16), "gqa_split_bf16_g4_any_x16",
     "FX_GENERIC_FEAT_ENTRY(gqa_split_bf16_g4_any_x16, fx_bf16, 4, false, 16)"),
    (KernelSpec(G, "f32", heads_per_block=8, vec=True), "gqa_split_f32_g8_vec",
     "FX_GENERIC_ENTRY(gqa_split_f32_g8_vec, float, 8, true)"),
    (KernelSpec(C, "f16", features=25), "gqa_split_combine_f16_x25",
     "FX_COMBINE_FEAT_ENTRY(gqa_split_combine_f16_x25, fx_half, 25)"),
    (KernelSpec(C, "bf16"), "gqa_split_combine_bf16",
     "FX_COMBINE_ENTRY(gqa_split_combine_bf16, fx_bf16)"),
    (KernelSpec(M, "bf16", 128, fp8="e4m3", cluster=True),
     "gqa_split_mma_bf16_e4m3_d128_x0_cluster",
     "FX_MMA8_KERNELS(gqa_split_mma_bf16_e4m3_d128_x0, fx_bf16, 1, 128, 128, false, 0)"),
    (KernelSpec(M, "f16", 256, 192, tiles=2, fp8="e5m2", features=3),
     "gqa_split_mma_f16_e5m2_d256_r192_t2_x3",
     "FX_MMA8_KERNELS(gqa_split_mma_f16_e5m2_d256_r192_t2_x3, fx_half, 2, 256, 192, true, 3)"),
    (KernelSpec(M, "bf16", 128, wide=True, fp8="e4m3", cluster=True),
     "gqa_split_mma_bf16_e4m3_d128_wide_x0_cluster",
     "FX_MMA8_WIDE_KERNEL(gqa_split_mma_bf16_e4m3_d128_wide_x0_cluster, fx_bf16, 1, 0)"),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "name", "entry"), LITERAL, ids=[n for _, n, _ in LITERAL])
def test_a_spec_renders_the_name_and_entry_of_old(spec, name, entry):
    assert spec.name == name
    assert spec.entry == entry
    assert old_entry(name) == entry  # (the oracle agrees with the literals)


def test_the_parity_kernel_is_named_and_compiled_with_its_file():
    spec = KernelSpec.parity("f16")
    assert (spec.name, spec.file, spec.select) == ("gqa_decode_f16", "gqa_decode.cu", None)
    with pytest.raises(ValueError, match="compiled whole"):
        _ = spec.entry


def test_the_split_files_kernels_are_its_47_specs():
    specs = whole_file()
    names = [s.name for s in specs]
    assert len(names) == len(set(names)) == 47
    for spec in specs:
        assert spec.entry == old_entry(spec.name), spec


def _every_spec_candidate():
    """Every combination of fields over a representative range, valid or not."""
    for family, dt, d, dr, tiles, paired, wide, fp8, feats, cluster in itertools.product(
        (M,), ("f32", "f16", "bf16"), (64, 96, 128, 256), (0, 40, 64, 72, 80, 100, 128, 144, 256),
        (1, 2, 3), (False, True), (False, True), ("", "e4m3", "e5m2"), (0, 3, 16, 25, 127, 128),
        (False, True),
    ):  # fmt: skip
        yield dict(family=family, dtype=dt, head_dim=d, row_dim=dr, tiles=tiles, paired=paired,
                   wide=wide, fp8=fp8, features=feats, cluster=cluster)  # fmt: skip
    for dt, d, feats, cluster in itertools.product(
        ("f32", "f16"), (0, 64, 96, 128, 256), (0, 1, 63, 127, 128, -1), (False, True)
    ):
        yield dict(family=T, dtype=dt, head_dim=d, features=feats, cluster=cluster)
    for dt, g, vec, feats, cluster in itertools.product(
        ("f32", "f16", "bf16", "f64"), (0, 1, 2, 4, 8), (False, True), (0, 16, 127), (False, True)
    ):
        yield dict(family=G, dtype=dt, heads_per_block=g, vec=vec, features=feats, cluster=cluster)
    for dt, feats, cluster in itertools.product(("f32", "bf16"), range(0, 130, 1), (False, True)):
        yield dict(family=C, dtype=dt, features=feats, cluster=cluster)


def test_every_valid_spec_has_the_old_grammars_entry_and_a_name_of_its_own():
    seen: dict[str, KernelSpec] = {}
    valid = refused = 0
    for fields in _every_spec_candidate():
        try:
            spec = KernelSpec(**fields)
        except ValueError as exc:
            assert "has no kernel" in str(exc)
            refused += 1
            continue
        valid += 1
        assert spec.entry == old_entry(spec.name), spec  # the old grammar takes its name
        other = seen.setdefault(spec.name, spec)
        assert other == spec, (other, spec)  # one name, one spec
    assert valid > 1000 and refused > 1000, (valid, refused)


@pytest.mark.parametrize(
    "fields",
    [
        dict(family="mma", dtype="f32", head_dim=128),  # fp32 takes tc32
        dict(family="mma", dtype="bf16", head_dim=96),  # not a kernel's head_dim
        dict(family="mma", dtype="bf16", head_dim=128, row_dim=100),  # not a multiple of 8
        dict(family="mma", dtype="bf16", head_dim=128, row_dim=136),  # wider than D
        dict(family="mma", dtype="bf16", head_dim=128, row_dim=72, paired=True),  # not of 16
        dict(family="mma", dtype="bf16", head_dim=128, tiles=3),
        dict(family="mma", dtype="bf16", head_dim=128, wide=True),  # only a cluster kernel
        dict(family="mma", dtype="bf16", head_dim=64, wide=True, cluster=True),
        dict(family="mma", dtype="bf16", head_dim=128, row_dim=96, paired=True, features=1),
        dict(family="mma", dtype="bf16", head_dim=128, fp8="e3m4"),
        dict(family="mma", dtype="bf16", head_dim=128, features=F_LIMIT),
        dict(family="tc32", dtype="f32", head_dim=128, features=1, cluster=True),
        dict(family="generic", dtype="f16", heads_per_block=4, cluster=True),
        dict(family="generic", dtype="f16", heads_per_block=0),
        dict(family="combine", dtype="f16", features=2),  # the cap ends in the split kernel
        dict(family="combine", dtype="f16", cluster=True),
        dict(family="fp8", dtype="f16"),
        dict(family="generic", dtype="f64", heads_per_block=4),
    ],
)
def test_fields_no_kernel_has_are_refused(fields):
    with pytest.raises(ValueError, match="has no kernel"):
        KernelSpec(**fields)


def test_twins_share_an_entry_and_round_trip():
    for spec in (KernelSpec(M, "bf16", 128), KernelSpec(M, "f16", 64, 40, tiles=2, features=9),
                 KernelSpec(T, "f32", 256), KernelSpec(M, "bf16", 256, fp8="e5m2")):  # fmt: skip
        twin = spec.but(cluster=True)
        assert twin.name == spec.name + "_cluster" and twin.entry == spec.entry
        assert twin.but(cluster=False) == spec and hash(twin.but(cluster=False)) == hash(spec)
    # row_dim 0 is the kernel's own head_dim: one value for one kernel
    assert KernelSpec(M, "bf16", 128) == KernelSpec(M, "bf16", 128, 128)
    assert KernelSpec.combine("f16", 63) == KernelSpec(C, "f16", features=25)
    assert set(FP8_FORMATS) == {"e4m3", "e5m2"}


def test_the_feature_bits_are_one_table_written_into_the_header():
    header = traits.traits_header()
    for name, bit, _ in traits.FEATURES:
        assert re.findall(rf"^#define FX_F_{name} (\d+)\b", header, re.M) == [str(bit)]
        assert getattr(traits, f"F_{name}") == bit
    bits = [bit for _, bit, _ in traits.FEATURES]
    assert bits == [1 << i for i in range(len(bits))] and 2 * bits[-1] == traits.F_LIMIT
    # no kernel file has a copy of its own
    for part in sorted(compiler.source_dir().glob("*.cu*")):
        assert not re.search(r"^\s*#define FX_F_", part.read_text(), re.M), part
