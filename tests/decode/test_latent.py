"""MLA decode on the CPU (issue 50): the latent kernels' names, entries and refusals, their
plans, the arguments ``mla_decode`` refuses before any device work, and the kernels
compiling without spills on Hopper and Ada."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.decode.latent_plan import LatentPlan, latent_plan, latent_shared_bytes
from ferrox_driver.decode.launches import split_program
from ferrox_driver.kernels.spec import KernelSpec
from ferrox_driver.kernels.traits import F_CAP, F_LSE, F_SCALE, F_SINKS, F_WINDOW

BF16 = ml_dtypes.bfloat16
H100 = dict(multiprocessor_count=132, shared_per_block=232448, compute_capability=(9, 0))
ADA = dict(multiprocessor_count=128, shared_per_block=101376, compute_capability=(8, 9))


def _latent(**kw):
    fields = dict(head_dim=576, head_dim_v=512, heads_per_block=32, step_tokens=64)
    return KernelSpec("latent", kw.pop("dtype", "bf16"), **{**fields, **kw})


def test_a_latent_kernel_is_named_by_its_fields():
    assert _latent().name == "gqa_split_latent_bf16_dk576_dv512_h32_x0"
    spec = _latent(dtype="f16", fp8="e4m3", heads_per_block=16, step_tokens=32, features=35)
    assert spec.name == "gqa_split_latent_f16_e4m3_dk576_dv512_h16_t32_x35"
    assert spec.entry == (f"FX_LATENT_ENTRY({spec.name}, fx_half, 1, 576, 512, true, 1, 32, 35)")
    own = _latent(head_dim=512, own_v=True)
    assert own.name == "gqa_split_latent_bf16_dk512_dv512_sv_h32_x0"
    assert own.entry.endswith("512, 512, false, 2, 64, 0)")
    assert _latent().tensor_cores


@pytest.mark.parametrize(
    "fields",
    [
        dict(dtype="f32"),
        dict(fp8="q4"),
        dict(head_dim=640),
        dict(head_dim=600),
        dict(head_dim_v=576),
        dict(head_dim_v=448),
        dict(heads_per_block=48),
        dict(heads_per_block=64, step_tokens=32),  # the wgmma kernel: steps of 64,
        dict(heads_per_block=64, head_dim=512, own_v=True),  # values within K's rows
        dict(heads_per_block=64, head_dim_v=256),  # of 512
        dict(step_tokens=16),
        dict(features=F_SINKS),
        dict(features=F_LSE),
        dict(features=4),  # ALiBi
        dict(cluster=True),
        dict(row_warps=2),
    ],
)
def test_a_latent_spec_without_a_kernel_is_refused(fields):
    with pytest.raises(ValueError, match="has no kernel"):
        _latent(**fields)


def test_other_families_take_no_latent_fields():
    with pytest.raises(ValueError, match="latent kernels'"):
        KernelSpec("mma", "bf16", 128, head_dim_v=128)


def _plan(n_q=1, n_heads=128, seq=131072, fp8="", features=0, device=H100, **kw):
    return latent_plan("bf16", fp8, n_q, n_heads, 1, 576, 512, seq, features, **device, **kw)


def test_a_plan_takes_blocks_of_32_rows_and_fills_the_multiprocessors_once():
    plan = _plan(wgmma=False)
    assert isinstance(plan, LatentPlan)
    assert plan.spec.heads_per_block == 32 and plan.row_blocks == 4 and plan.splits == 33
    assert plan.grid(1) == (33, 4, 1) and plan.threads == 256 and plan.tile == 64
    assert plan.workspace_floats(128) == 128 * 33 * 514
    two = _plan(n_q=2, n_heads=64, wgmma=False)  # rows query-major: 128 rows
    assert two.row_blocks == 4 and two.splits == 33
    sixteen = _plan(n_heads=16)
    assert sixteen.spec.heads_per_block == 16 and sixteen.row_blocks == 1
    assert sixteen.splits == 132
    assert _plan(seq=1000, wgmma=False).splits == 4  # chunks of LATENT_MIN_CHUNK or more
    assert _plan(seq=1).splits == 1


def test_past_32_rows_a_hopper_plan_takes_the_wgmma_kernel_in_blocks_of_64():
    plan = _plan()  # 128 heads: two blocks of 64 rows, 66 chunks
    assert plan.spec.heads_per_block == 64 and plan.spec.arch_suffix == "a"
    assert plan.row_blocks == 2 and plan.splits == 66 and plan.grid(1) == (66, 2, 1)
    assert plan.spec.name == "gqa_split_latent_bf16_dk576_dv512_h64_x0"
    assert plan.spec.entry == f"FX_LATENT_WG_ENTRY({plan.spec.name}, fx_bf16, 0, 576, 512, 0)"
    assert plan.threads == 256 and plan.tile == 64
    sixty_four = _plan(n_heads=64)
    assert sixty_four.row_blocks == 1 and sixty_four.splits == 132
    assert _plan(n_q=3, n_heads=16).spec.heads_per_block == 64  # 48 rows (16 padding)
    assert _plan(n_q=2, n_heads=16).spec.heads_per_block == 32  # 32 rows: mma.sync
    assert _plan(fp8="e4m3").spec.name == "gqa_split_latent_bf16_e4m3_dk576_dv512_h64_x0"
    # elsewhere, or turned off: the mma.sync kernel (sm_100 has no wgmma)
    for cc in ((8, 0), (8, 9), (10, 0), (12, 0)):
        other = _plan(device={**H100, "compute_capability": cc})
        assert other.spec.heads_per_block == 32 and other.spec.arch_suffix == ""
    assert _plan(wgmma=False).spec.heads_per_block == 32
    # chunks shorter than LATENT_WG_MIN_CHUNK: the mma.sync kernel (measured faster there)
    assert _plan(n_heads=64, seq=32768).spec.heads_per_block == 32  # 132 chunks of 256
    assert _plan(n_heads=128, seq=32768).spec.heads_per_block == 64  # 66 chunks of 512
    assert _plan(seq=4096).spec.heads_per_block == 32
    assert _plan(n_heads=64, seq=32768, wg_min_chunk=0).spec.heads_per_block == 64
    # Q, (fp8) the widened step, two stages, P, maxima and q's magnitudes, 1024 to align
    for fp8 in ("", "e4m3"):
        wg = _plan(fp8=fp8)
        assert wg.shared_bytes == 1024 + 3 * 64 * 576 * 2 + 64 * 64 * 2 + 768
        assert wg.shared_bytes <= H100["shared_per_block"]
    assert _plan(device={**H100, "shared_per_block": 200000}).spec.heads_per_block == 32


def test_a_plan_passes_the_combines_features_on():
    plan = _plan(features=F_WINDOW | F_CAP | F_SCALE | F_SINKS | F_LSE)
    assert plan.spec.features == F_WINDOW | F_CAP | F_SCALE
    assert plan.combine_spec().name == f"gqa_verify_rows_combine_bf16_x{F_WINDOW | F_SINKS | F_LSE}"


def test_the_ring_fits_the_blocks_shared_memory():
    for fp8 in ("", "e4m3"):
        hopper = _plan(fp8=fp8)
        assert hopper.spec.step_tokens == 64 and hopper.shared_bytes <= H100["shared_per_block"]
        ada = _plan(fp8=fp8, device=ADA)  # 99 KB a block: steps of 32 tokens
        assert ada.spec.step_tokens == 32 and ada.shared_bytes <= ADA["shared_per_block"]
    # two stages of 64 x 576 bf16, the scores' partials, P, the maxima, q's magnitudes
    assert latent_shared_bytes(_latent()) == 2 * 64 * 576 * 2 + 32768 + 4608 + 1024 + 128


def test_a_plan_refuses_devices_without_the_kernels_needs():
    with pytest.raises(ValueError, match=r"device: .*compute capability"):
        _plan(device={**H100, "compute_capability": (7, 5)})
    with pytest.raises(ValueError, match="device: an fp8"):
        _plan(fp8="e4m3", device={**H100, "compute_capability": (8, 6)})
    with pytest.raises(ValueError, match="device: its 49152 bytes"):
        _plan(device={**H100, "shared_per_block": 49152})


def _args(n_q=0, n_heads=16, seq=20, dk=576, dtype=BF16, c_dtype=None):
    rng = np.random.default_rng(0)
    shape = (n_q, n_heads, dk) if n_q else (n_heads, dk)
    q = rng.standard_normal(shape).astype(dtype)
    return q, rng.standard_normal((seq, dk)).astype(c_dtype or dtype)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(dtype=np.float32), TypeError, "q: expected float16 or bfloat16"),
        (dict(dk=600), ValueError, "q: head_dim"),
        (dict(dk=640), ValueError, "q: head_dim"),
        (dict(n_heads=129), ValueError, "q: up to 128 query heads"),
        (dict(n_q=17), ValueError, "q: up to 16 query tokens"),
        (dict(n_q=3, seq=2), ValueError, "q: 3 query tokens for a cache of 2"),
        (dict(c_dtype=np.float16), TypeError, "ckv: expected q's dtype"),
    ],
)
def test_bad_shapes_and_dtypes_are_refused_by_name(change, error, match):
    q, ckv = _args(**change)
    with pytest.raises(error, match=match):
        fd.mla_decode(q, ckv)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        (dict(head_dim_v=500), ValueError, "head_dim_v: a multiple of 128"),
        (dict(head_dim_v=640), ValueError, "head_dim_v"),
        (dict(head_dim_v=512.0), TypeError, "head_dim_v: expected an int"),
        (dict(seq_len=21), ValueError, "seq_len: expected 0..20"),
        (dict(seq_len=-1), ValueError, "seq_len"),
        (dict(seq_len=2.0), TypeError, "seq_len: expected None, an int"),
        (dict(kv_scale=2.0), ValueError, "kv_scale: only for an fp8 cache"),
        (dict(sliding_window=0), ValueError, "sliding_window"),
        (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
        (dict(sinks=np.zeros(3)), ValueError, "sinks"),
        (dict(scale=float("nan")), ValueError, "scale"),
        (dict(return_lse=1), TypeError, "return_lse"),
        (dict(out=np.zeros((16, 512))), TypeError, "out: only with device inputs"),
        (dict(lse=np.zeros(16, np.float32)), TypeError, "lse: only with device inputs"),
    ],
)
def test_bad_arguments_are_refused_by_name(kw, error, match):
    q, ckv = _args()
    with pytest.raises(error, match=match):
        fd.mla_decode(q, ckv, **kw)


def test_an_fp8_cache_takes_a_positive_scale():
    q, _ = _args()
    ckv = np.zeros((20, 576), ml_dtypes.float8_e4m3fn)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="kv_scale: expected a positive"):
            fd.mla_decode(q, ckv, kv_scale=bad)
    with pytest.raises(TypeError, match="kv_scale"):
        fd.mla_decode(q, ckv, kv_scale="2")


def test_a_host_call_of_no_tokens_gives_zeros_without_a_device():
    q, ckv = _args()
    out, lse = fd.mla_decode(q, ckv, 0, return_lse=True)
    assert out.shape == (16, 512) and out.dtype == q.dtype and not out.astype(float).any()
    assert lse.shape == (16,) and np.isneginf(lse).all()
    sinks = np.linspace(-1, 1, 16)
    _, lse = fd.mla_decode(q, ckv, 0, return_lse=True, sinks=sinks)
    np.testing.assert_allclose(lse, sinks, rtol=1e-6)


def test_the_reference_reads_the_values_from_the_latents_first_columns():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((4, 256))
    ckv = rng.standard_normal((9, 256))
    got = fd.reference_mla_decode(q, ckv, head_dim_v=128)
    s = q @ ckv.T / 16.0
    p = np.exp(s - s.max(axis=1, keepdims=True))
    want = (p / p.sum(axis=1, keepdims=True)) @ ckv[:, :128]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    scaled = fd.reference_mla_decode(q, ckv.astype(ml_dtypes.float8_e4m3fn), head_dim_v=128,
                                     kv_scale=0.5)  # fmt: skip
    assert scaled.shape == (4, 128)


@pytest.mark.parametrize("arch", ["sm_90", "sm_89"])
def test_the_latent_kernels_compile_without_spills(arch):
    specs = [
        _latent(dtype=dt, fp8=fp8, heads_per_block=ht, step_tokens=tok, features=f)
        for dt in ("bf16", "f16")
        for fp8 in ("", "e4m3")
        for ht in (16, 32)
        for tok in (32, 64)
        for f in (0, F_WINDOW | F_CAP | F_SCALE)
        if dt == "bf16" or (fp8 == "" and f == 0)
    ]
    specs.append(_latent(head_dim=512, own_v=True, step_tokens=32))  # wide GQA heads' shape
    program = split_program(specs, arch)
    for spec in specs:
        res = program.resources[spec.name]
        assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, spec.name
        assert res.registers <= 255, spec.name


def test_the_wgmma_latent_kernels_compile_for_sm_90a_without_spills():
    specs = [
        _latent(dtype=dt, fp8=fp8, heads_per_block=64, features=f)
        for dt in ("bf16", "f16")
        for fp8 in ("", "e4m3", "e5m2")
        for f in (0, F_WINDOW | F_CAP | F_SCALE)
    ]
    program = split_program(specs, "sm_90a")
    for spec in specs:
        res = program.resources[spec.name]
        assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, spec.name
        assert res.registers <= 255, spec.name
    # sm_90 without the a: the kernel's body is empty (the plan never takes it there)
    empty = split_program(specs[:1], "sm_90").resources[specs[0].name]
    assert empty.registers < 32
