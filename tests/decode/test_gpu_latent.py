"""MLA decode on the GPU (issue 50): ``fd.mla_decode`` against the float64 reference on
fresh random inputs, outputs poisoned: 16, 64 and 128 heads, one to five queries, bf16,
fp16 and fp8 latent caches, lengths 0, 1 and odd ones, every feature it takes, huge scores,
the LSE, and a graph captured once replayed over a growing device length."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd

from ..helpers.gpu_helpers import DTYPES, TOL, poisoned, rel_err

pytestmark = pytest.mark.gpu

DK, DV = 576, 512
E4M3 = ml_dtypes.float8_e4m3fn
LSE_TOL = 2e-2
FP8_TOL = 2e-2  # (the scores of fp16 q against exact fp8 values; P rounded to fp16)


def _inputs(rng, n_q, n_heads, capacity, dtype, fp8=False, q_scale=1.0):
    dt = DTYPES[dtype]
    shape = (n_q, n_heads, DK) if n_q else (n_heads, DK)
    q = (rng.standard_normal(shape) * q_scale).astype(dt)
    if fp8:  # values of ~N(0, 1) as e4m3 of scale 1/16
        return q, (rng.standard_normal((capacity, DK)) * 16).astype(E4M3)
    return q, rng.standard_normal((capacity, DK)).astype(dt)


def _check(rng, n_q, n_heads, seq, dtype="bf16", fp8=False, capacity=None, q_scale=1.0,
           **kw):  # fmt: skip
    """One device call (n_q 0: a one-token q of shape (n_heads, DK)) against the reference."""
    capacity = capacity or max(seq, 1)
    q, ckv = _inputs(rng, n_q, n_heads, capacity, dtype, fp8, q_scale)
    scale = {"kv_scale": 1.0 / 16} if fp8 else {}
    ref, ref_lse = fd.reference_mla_decode(q, ckv[:seq], return_lse=True, **scale, **kw)
    out_shape = (*q.shape[:-1], DV)
    out, lse = poisoned(out_shape, q.dtype), poisoned(q.shape[:-1], np.float32)
    got, got_lse = fd.mla_decode(fd.to_device(q), fd.to_device(ckv), seq, out=out, lse=lse,
                                 **scale, **kw)  # fmt: skip
    assert got is out and got_lse is lse
    got, got_lse = got.to_host().astype(np.float64), got_lse.to_host()
    assert got.shape == out_shape and np.isfinite(got).all()
    err = rel_err(got, ref)
    assert err < (FP8_TOL if fp8 else TOL[dtype]), err
    np.testing.assert_allclose(got_lse, ref_lse, rtol=LSE_TOL, atol=LSE_TOL)


@pytest.mark.parametrize("n_heads", [16, 64, 128])
@pytest.mark.parametrize("n_q", [0, 1, 2, 5])
def test_mla_matches_the_reference(rng, n_heads, n_q):
    for seq in (max(n_q, 1), 17, 777, 4099):
        _check(rng, n_q, n_heads, seq)


@pytest.mark.parametrize("n_heads", [16, 128])
@pytest.mark.parametrize("n_q", [0, 2])
def test_an_fp8_latent_cache_matches_the_reference(rng, n_heads, n_q):
    for seq in (max(n_q, 1), 777, 4099):
        _check(rng, n_q, n_heads, seq, fp8=True)
    _check(rng, n_q, n_heads, 301, dtype="f16", fp8=True)


@pytest.mark.parametrize("n_q", [0, 5])
def test_fp16_matches_the_reference(rng, n_q):
    for seq in (5, 1000):
        _check(rng, n_q, 64, seq, dtype="f16")


@pytest.mark.parametrize("n_heads", [1, 20, 48])
def test_head_counts_off_the_blocks_rows_leave_no_row_unwritten(rng, n_heads):
    _check(rng, 3, n_heads, 333)
    _check(rng, 0, n_heads, 99)


@pytest.mark.parametrize("n_q", [0, 1, 5])
@pytest.mark.parametrize(
    "kw",
    [
        dict(scale=0.02),
        dict(sliding_window=40),
        dict(sliding_window=1),
        dict(logits_soft_cap=5.0, scale=0.2),
        dict(sinks="random"),
        dict(sliding_window=100, logits_soft_cap=3.0, sinks="random", scale=0.05),
    ],
    ids=["scale", "window", "window1", "cap", "sinks", "all"],
)
def test_every_feature_matches_the_reference(rng, n_q, kw):
    kw = dict(kw)
    if kw.get("sinks") == "random":
        kw["sinks"] = rng.standard_normal(64).astype(np.float32)
    for seq in (max(n_q, 1), 700):
        _check(rng, n_q, 64, seq, capacity=800, **kw)
    _check(rng, n_q, 64, 700, fp8=True, **kw)


def test_device_sinks_are_read_on_the_device(rng):
    sinks = rng.standard_normal(16).astype(np.float32)
    q, ckv = _inputs(rng, 0, 16, 300, "bf16")
    ref = fd.reference_mla_decode(q, ckv, sinks=sinks)
    got = fd.mla_decode(fd.to_device(q), fd.to_device(ckv), sinks=fd.to_device(sinks))
    assert rel_err(got.to_host(), ref) < TOL["bf16"]


def test_huge_scores_stay_finite_and_right(rng):
    _check(rng, 0, 64, 1500, q_scale=30.0)
    _check(rng, 2, 16, 1500, q_scale=30.0, fp8=True)


def test_no_tokens_give_zeros_and_an_empty_lse(rng):
    q, ckv = _inputs(rng, 0, 32, 64, "bf16")
    out, lse = fd.mla_decode(fd.to_device(q), fd.to_device(ckv), 0, return_lse=True)
    assert not out.to_host().astype(np.float64).any() and np.isneginf(lse.to_host()).all()
    sinks = rng.standard_normal(32).astype(np.float32)
    _, lse = fd.mla_decode(fd.to_device(q), fd.to_device(ckv), 0, return_lse=True, sinks=sinks)
    np.testing.assert_allclose(lse.to_host(), sinks, rtol=1e-6)


def test_numpy_inputs_give_numpy_outputs(rng):
    q, ckv = _inputs(rng, 2, 16, 90, "bf16")
    got, lse = fd.mla_decode(q, ckv, return_lse=True)
    ref, ref_lse = fd.reference_mla_decode(q, ckv, return_lse=True)
    assert isinstance(got, np.ndarray) and got.dtype == q.dtype and lse.shape == (2, 16)
    assert rel_err(got, ref) < TOL["bf16"]
    np.testing.assert_allclose(lse, ref_lse, rtol=LSE_TOL, atol=LSE_TOL)


@pytest.mark.parametrize("fp8", [False, True])
def test_a_graph_captured_once_serves_a_growing_device_length(rng, fp8):
    """Captured with out, lse and a device length at 1 token (after an eager call made the
    workspace), replayed at lengths up to the capacity: each replay matches the reference
    at its length, the queries the last two tokens, with sinks and a window."""
    capacity, n_heads, n_q = 1200, 64, 2
    q, ckv = _inputs(rng, n_q, n_heads, capacity, "bf16", fp8)
    sinks = rng.standard_normal(n_heads).astype(np.float32)
    scale = {"kv_scale": fd.to_device(np.array([1.0 / 16], np.float32))} if fp8 else {}
    kw = dict(sliding_window=500, sinks=fd.to_device(sinks))
    with fd.Stream() as stream:
        q_d, c_d = fd.to_device(q), fd.to_device(ckv)
        seq_d = fd.to_device(np.array([n_q], np.int32))
        out, lse = fd.empty((n_q, n_heads, DV), q.dtype), fd.empty((n_q, n_heads), np.float32)
        fd.mla_decode(q_d, c_d, seq_d, out=out, lse=lse, stream=stream, **scale, **kw)
        stream.synchronize()
        with stream.capture() as graph:
            fd.mla_decode(q_d, c_d, seq_d, out=out, lse=lse, stream=stream, **scale, **kw)
        replay = graph.instantiate()
        for n in (2, 3, 64, 65, 129, 777, 1199, 1200):
            seq_d.copy_from_host(np.array([n], np.int32), stream)
            out.fill_bytes(0xFF, stream)
            replay.launch(stream)
            stream.synchronize()
            ref, ref_lse = fd.reference_mla_decode(
                q, ckv[:n], return_lse=True, kv_scale=1.0 / 16 if fp8 else 1.0,
                sliding_window=500, sinks=sinks,
            )  # fmt: skip
            got = out.to_host().astype(np.float64)
            assert rel_err(got, ref) < (FP8_TOL if fp8 else TOL["bf16"]), n
            np.testing.assert_allclose(lse.to_host(), ref_lse, rtol=LSE_TOL, atol=LSE_TOL)


def _route(monkeypatch, **overrides):
    """The latent kernels' route for this test (planner.OVERRIDES' latent_* fields)."""
    import dataclasses

    from ferrox_driver.decode import plan as planner

    monkeypatch.setattr(planner, "OVERRIDES", dataclasses.replace(planner.OVERRIDES, **overrides))


@pytest.mark.parametrize("n_heads,n_q", [(128, 1), (64, 2), (40, 1), (16, 3)])
@pytest.mark.parametrize("fp8", [False, True])
def test_the_wgmma_kernel_matches_the_reference(rng, monkeypatch, fp8, n_heads, n_q):
    """The wgmma kernel at every length (its shortest chunk 0): blocks of 64 rows
    (split_latent_wg.cuh) on compute capability 9.0 (padding rows at 40 and 48), with every
    feature it takes."""
    _route(monkeypatch, latent_wgmma=True, latent_wg_min_chunk=0)
    sinks = rng.standard_normal(n_heads).astype(np.float32)
    for seq in (n_q, 64, 65, 777, 4099):
        _check(rng, n_q, n_heads, seq, fp8=fp8)
    _check(rng, n_q, n_heads, 1500, fp8=fp8, sliding_window=700, logits_soft_cap=4.0,
           scale=0.1, sinks=sinks)  # fmt: skip
    _check(rng, n_q, n_heads, 1500, fp8=fp8, q_scale=30.0)


@pytest.mark.parametrize("fp8", [False, True])
def test_the_wgmma_kernel_takes_values_as_wide_as_the_latent(rng, monkeypatch, fp8):
    """A latent of 512 columns, all of them the values (no rope block after them): the
    wgmma kernel at 40-128 rows with DK == DV, bf16 and e4m3."""
    _route(monkeypatch, latent_wgmma=True, latent_wg_min_chunk=0)
    for n_heads, n_q, seq in ((128, 1, 777), (64, 2, 4099), (40, 1, 65)):
        q = rng.standard_normal((n_q, n_heads, DV)).astype(ml_dtypes.bfloat16)
        ckv = rng.standard_normal((seq, DV))
        ckv = (ckv * 16).astype(E4M3) if fp8 else ckv.astype(ml_dtypes.bfloat16)
        scale = {"kv_scale": 1.0 / 16} if fp8 else {}
        ref = fd.reference_mla_decode(q, ckv, head_dim_v=DV, **scale)
        out = poisoned((n_q, n_heads, DV), q.dtype)
        fd.mla_decode(fd.to_device(q), fd.to_device(ckv), seq, head_dim_v=DV, out=out, **scale)
        err = rel_err(out.to_host().astype(np.float64), ref)
        assert err < (FP8_TOL if fp8 else TOL["bf16"]), (n_heads, n_q, seq, err)


def test_past_32_rows_a_hopper_gpu_can_take_the_wgmma_kernel(rng, monkeypatch):
    """The plan a long call takes on this GPU: blocks of 64 rows on compute capability 9.0,
    the mma.sync kernel's 32 elsewhere."""
    from ferrox_driver.decode.latent import _plan
    from ferrox_driver.driver.device import default_device

    _route(monkeypatch, latent_wgmma=True)
    dev = default_device()
    plan = _plan(dev, "bf16", "", 1, 128, DK, DV, 131072, 0)
    assert plan.spec.heads_per_block == (64 if dev.compute_capability == (9, 0) else 32)
    _check(rng, 1, 128, 4099, sliding_window=3000, logits_soft_cap=4.0, scale=0.1)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n_heads,n_q", [(128, 1), (64, 2), (40, 1)])
def test_the_mma_sync_kernel_still_serves_many_rows_when_wgmma_is_off(
    rng, monkeypatch, fp8, n_heads, n_q
):
    """FERROX_LATENT_WG=0's route (and every non-Hopper GPU's) at 40-128 rows, against the
    reference as the wgmma kernel is above."""
    _route(monkeypatch, latent_wgmma=False)
    for seq in (n_q, 1031):
        _check(rng, n_q, n_heads, seq, fp8=fp8, sinks=rng.standard_normal(n_heads).astype(
            np.float32))  # fmt: skip
