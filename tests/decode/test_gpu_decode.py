"""gqa_decode on the GPU against the float64 reference, outputs poisoned before each launch."""

from __future__ import annotations

import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.decode import plan as attention
from ferrox_driver.experimental import plan_split, split_launches
from ferrox_driver.kernels.catalogue import kernel_source
from ferrox_driver.kernels.spec import SPLIT_FILE

from ..helpers.gpu_helpers import (
    DTYPES,
    TOL,
    poisoned,
    random_decode_inputs,
    rel_err,
    score_error_bound,
    torch_or_cupy,
)

pytestmark = pytest.mark.gpu

SEQ_LENS = [0, 1, 2, 31, 33, 1000, 4097]
HEAD_DIMS = [1, 8, 64, 96, 100, 128, 256]
HEADS = [(32, 8), (64, 8), (28, 4), (32, 32), (8, 1), (7, 7)]
ALGORITHMS = ["split", "parity"]

CASES = (
    [(32, 8, 128, s) for s in SEQ_LENS]
    + [(8, 1, d, 1000) for d in HEAD_DIMS]
    + [(16, 4, d, 33) for d in HEAD_DIMS]
    + [(h, kv, 100, 31) for h, kv in HEADS]
    + [(h, kv, 128, 4097) for h, kv in HEADS]
)


def decode_on_device(q, k, v, n_heads, n_kv_heads, head_dim, algorithm):
    out = poisoned(q.shape, q.dtype)
    got = fd.gqa_decode(
        fd.to_device(q),
        fd.to_device(k),
        fd.to_device(v),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        out=out,
        algorithm=algorithm,
    )
    assert got.ptr == out.ptr
    return got.to_host()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim,seq_len", CASES)
def test_decode_matches_reference(rng, algorithm, dtype, n_heads, n_kv_heads, head_dim, seq_len):
    q, k, v = random_decode_inputs(rng, n_heads, n_kv_heads, head_dim, seq_len, DTYPES[dtype])
    ref = fd.reference_gqa_decode(
        q, k, v, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim
    )
    got = decode_on_device(q, k, v, n_heads, n_kv_heads, head_dim, algorithm)
    assert got.dtype == q.dtype and got.shape == q.shape
    if seq_len == 0:
        assert not got.astype(np.float64).any()
    else:
        assert rel_err(got, ref) < TOL[dtype]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("q_scale", [1e3, 1e-6], ids=["huge-scores", "tiny-scores"])
def test_extreme_scores_stay_finite_and_correct(rng, algorithm, dtype, q_scale):
    q, k, v = random_decode_inputs(rng, 32, 8, 128, 777, DTYPES[dtype], q_scale=q_scale)
    got = decode_on_device(q, k, v, 32, 8, 128, algorithm)
    assert_close_at_any_scale(got, q, k, v, 32, 8, 128, TOL[dtype])


def assert_close_at_any_scale(got, q, k, v, n_heads, n_kv_heads, head_dim, tol):
    """Finite, and within ``tol`` (relative) of the float64 reference plus what fp32 score
    errors account for (score_error_bound: nothing where one token dominates a head; huge
    scores that nearly tie are ill-conditioned for every fp32 decode: with random scores of
    ~1e3 the parity kernel measured 1.5e-5 and the CUDA-core one 3.7e-5 against a 1e-5
    tolerance)."""
    ref = fd.reference_gqa_decode(
        q, k, v, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim
    )
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all()
    bound = score_error_bound(q, k, v, n_heads, n_kv_heads, head_dim)
    err = np.linalg.norm(got - ref)
    assert err <= tol * np.linalg.norm(ref) + np.linalg.norm(bound), (
        rel_err(got, ref),
        np.linalg.norm(bound) / np.linalg.norm(ref),
    )


def test_numpy_inputs_give_numpy_output_equal_to_the_device_path(rng):
    q, k, v = random_decode_inputs(rng, 28, 4, 128, 513, np.float32)
    host = fd.gqa_decode(
        q.reshape(-1), k.reshape(-1), v.reshape(-1), n_heads=28, n_kv_heads=4, head_dim=128
    )
    assert isinstance(host, np.ndarray) and host.shape == (28 * 128,)
    dev = decode_on_device(q, k, v, 28, 4, 128, "auto")
    np.testing.assert_array_equal(host.reshape(28, 128), dev)


def test_nan_input_propagates_as_in_the_reference(rng):
    q, k, v = random_decode_inputs(rng, 8, 2, 64, 40, np.float32)
    k[3, 0, 5] = np.nan  # poisons query heads 0..3 (KV head 0) only
    got = fd.gqa_decode(q, k, v, n_heads=8, n_kv_heads=2, head_dim=64)
    ref = fd.reference_gqa_decode(q, k, v, n_heads=8, n_kv_heads=2, head_dim=64)
    assert np.isnan(got[:4]).all() and np.isnan(ref[:4]).all()
    assert rel_err(got[4:], ref[4:]) < 1e-5


def test_foreign_device_inputs_give_the_numpy_result_without_a_host_round_trip(rng):
    kind, lib = torch_or_cupy()
    q, k, v = random_decode_inputs(rng, 32, 8, 128, 300, np.float32)
    expect = fd.gqa_decode(q, k, v, n_heads=32, n_kv_heads=8, head_dim=128)
    if kind == "torch":
        tq, tk, tv = (lib.as_tensor(a, device="cuda") for a in (q, k, v))
    else:
        tq, tk, tv = (lib.asarray(a) for a in (q, k, v))
    got = fd.gqa_decode(tq, tk, tv, n_heads=32, n_kv_heads=8, head_dim=128)
    assert isinstance(got, fd.DeviceArray)
    np.testing.assert_array_equal(got.to_host(), expect)


def test_out_of_wrong_size_is_rejected_before_launch(rng):
    q, k, v = random_decode_inputs(rng, 8, 2, 64, 4, np.float32)
    with pytest.raises(ValueError, match="out"):
        fd.gqa_decode(
            fd.to_device(q),
            fd.to_device(k),
            fd.to_device(v),
            n_heads=8,
            n_kv_heads=2,
            head_dim=64,
            out=fd.empty(7, np.float32),
        )


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", [(32, 8, 128), (28, 4, 64), (8, 1, 256)])
def test_split_kernels_agree_with_the_parity_kernel(rng, dtype, n_heads, n_kv_heads, head_dim):
    q, k, v = random_decode_inputs(rng, n_heads, n_kv_heads, head_dim, 5000, DTYPES[dtype])
    split = decode_on_device(q, k, v, n_heads, n_kv_heads, head_dim, "split")
    parity = decode_on_device(q, k, v, n_heads, n_kv_heads, head_dim, "parity")
    assert rel_err(split, parity.astype(np.float64)) < TOL[dtype]


@pytest.mark.parametrize("seq_len", [63, 64, 65, 127, 129, 4095, 20001])
def test_split_handles_lengths_that_are_not_multiples_of_the_chunk(rng, seq_len):
    q, k, v = random_decode_inputs(rng, 16, 2, 64, seq_len, DTYPES["bf16"])
    ref = fd.reference_gqa_decode(q, k, v, n_heads=16, n_kv_heads=2, head_dim=64)
    assert rel_err(decode_on_device(q, k, v, 16, 2, 64, "split"), ref) < 1e-2
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    assert rel_err(decode_on_device(q32, k32, v32, 16, 2, 64, "split"), ref) < 1e-5


# fp32 caches with head_dim 64/128/256 and groups of 2 to 8 take the split-TF32 tensor-core
# kernels; FERROX_TC32=0 keeps them on the CUDA-core kernels. Both must hold fp32 accuracy.
@pytest.mark.parametrize("tc32", ["1", "0"])
@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim,seq_len",
    [
        (64, 8, 128, 5000),
        (32, 8, 128, 5000),
        (16, 4, 256, 33),
        (28, 4, 128, 65),
        (16, 2, 64, 3001),
        (8, 1, 256, 2049),
        (40, 8, 64, 1),
        (5, 1, 256, 130),
        (16, 8, 128, 4097),  # groups of 2 and 3
        (24, 8, 64, 333),
    ],
)
@pytest.mark.parametrize("q_scale", [1.0, 8.0])
def test_fp32_tensor_core_and_cuda_core_kernels_match_reference(
    rng, monkeypatch, tc32, n_heads, n_kv_heads, head_dim, seq_len, q_scale
):
    monkeypatch.setattr(attention, "OVERRIDES", attention.Overrides(tc32=tc32 != "0"))
    q, k, v = random_decode_inputs(
        rng, n_heads, n_kv_heads, head_dim, seq_len, np.float32, q_scale=q_scale
    )
    ref = fd.reference_gqa_decode(
        q, k, v, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim
    )
    got = decode_on_device(q, k, v, n_heads, n_kv_heads, head_dim, "split")
    assert rel_err(got, ref) < 1e-5


# As test_extreme_scores_stay_finite_and_correct, on the fp32 tensor-core kernels (group 8,
# head_dim 128 and 256) and, for comparison, the CUDA-core ones.
@pytest.mark.parametrize("tc32", ["1", "0"])
@pytest.mark.parametrize("head_dim,seq_len", [(128, 777), (256, 2049)])
@pytest.mark.parametrize("q_scale", [1e3, 1e-6], ids=["huge-scores", "tiny-scores"])
def test_extreme_scores_on_the_fp32_tensor_core_path(
    rng, monkeypatch, tc32, head_dim, seq_len, q_scale
):
    monkeypatch.setattr(attention, "OVERRIDES", attention.Overrides(tc32=tc32 != "0"))
    n_heads, n_kv = 64 * 128 // head_dim, 8 * 128 // head_dim
    q, k, v = random_decode_inputs(rng, n_heads, n_kv, head_dim, seq_len, np.float32, q_scale)
    got = decode_on_device(q, k, v, n_heads, n_kv, head_dim, "split")
    assert_close_at_any_scale(got, q, k, v, n_heads, n_kv, head_dim, TOL["f32"])


def test_misaligned_foreign_arrays_take_the_generic_path(rng):
    kind, lib = torch_or_cupy()
    q, k, v = random_decode_inputs(rng, 32, 8, 128, 300, np.float16)
    ref = fd.reference_gqa_decode(q, k, v, n_heads=32, n_kv_heads=8, head_dim=128)

    def offset_by_one(a):  # a view starting 2 bytes into a buffer: not 16-byte aligned
        flat = np.concatenate([np.zeros(1, a.dtype), a.reshape(-1)])
        t = lib.as_tensor(flat, device="cuda") if kind == "torch" else lib.asarray(flat)
        return t[1:]

    got = fd.gqa_decode(
        offset_by_one(q), offset_by_one(k), offset_by_one(v), n_heads=32, n_kv_heads=8, head_dim=128
    )
    assert rel_err(got.to_host().reshape(ref.shape), ref) < 1e-2


@pytest.mark.parametrize("heads_per_block", ["1", "2", "4", "8"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "n_heads,seq_len", [(64, 3001), (32, 500), (32, 3001)],
    ids=["combine-kernel", "cluster-merge", "wide-cluster-merge"],
)  # fmt: skip
def test_split_decode_is_bitwise_reproducible(
    rng, monkeypatch, heads_per_block, dtype, n_heads, seq_len
):
    # A result that moves between identical runs means a race: run each kernel family 20x
    # (on compute capability 9.0, fp16/bf16: 500 tokens, 8 chunks per KV head merged on
    # chip; 3001 tokens of groups of 4, the same in 8-warp blocks; of groups of 8, 16 chunks
    # and the combine kernel).
    monkeypatch.setattr(
        attention, "OVERRIDES", attention.Overrides(heads_per_block=int(heads_per_block))
    )
    q, k, v = random_decode_inputs(rng, n_heads, 8, 128, seq_len, DTYPES[dtype])
    qd, kd, vd = fd.to_device(q), fd.to_device(k), fd.to_device(v)
    first = None
    for _ in range(20):
        out = poisoned(q.shape, q.dtype)
        fd.gqa_decode(qd, kd, vd, n_heads=n_heads, n_kv_heads=8, head_dim=128, out=out)
        got = out.to_host().view(np.uint8)
        if first is None:
            first = got
        assert np.array_equal(got, first)


def combine_started_at_entry(specs):
    """Kernels ``specs`` (KernelSpec values) built with the split kernels letting the combine
    kernel start at their entry (FX_PDL_TRIGGER=2), long before they write their partials."""
    entries = sorted({spec.entry for spec in specs})
    src = f"#define FX_SELECTED 1\n{kernel_source(SPLIT_FILE)}\n" + "\n".join(entries)
    module = fd.Module(fd.compile_source(src, options=["-DFX_PDL_TRIGGER=2"], name="entry.cu"))
    return {spec.name: module.get_function(spec.name) for spec in specs}


@pytest.mark.parametrize("trigger", ["after-loops", "at-entry"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim,seq_len",
    [(64, 8, 128, 3001), (32, 32, 128, 5000), (8, 1, 256, 20001), (16, 2, 40, 20001),
     (16, 2, 36, 777)],
)  # fmt: skip
def test_combine_launched_early_gives_the_same_bits_as_an_ordinary_launch(
    rng, monkeypatch, device, trigger, dtype, n_heads, n_kv_heads, head_dim, seq_len,
):  # fmt: skip
    # The combine kernel starts while the split kernel runs and waits for it on the GPU
    # (programmatic dependent launch): had it read the workspace (NaN before each decode)
    # before the split kernel wrote it, its output would differ from an ordinary launch's.
    # Started at the split kernels' entry, it would (a missing wait fails this test).
    from ferrox_driver.decode import plan as attention

    dt = DTYPES[dtype]
    plan = plan_split(device, dt, n_heads, n_kv_heads, head_dim, seq_len)
    assert plan.cluster == 0, plan  # a plan with a combine kernel
    variants = {}
    if trigger == "at-entry":
        variants = combine_started_at_entry((plan.spec, plan.combine_spec(dt)))
    q, k, v = random_decode_inputs(rng, n_heads, n_kv_heads, head_dim, seq_len, dt)
    qd, kd, vd = fd.to_device(q), fd.to_device(k), fd.to_device(v)
    kw = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim}
    ws = fd.empty(plan.workspace_floats(n_heads, head_dim), np.float32)
    got = {}
    for early in (False, True):
        monkeypatch.setattr(attention, "OVERRIDES", attention.Overrides(early_combine=early))
        ws.fill_bytes(0xFF)
        out = poisoned(q.shape, q.dtype)
        launches = split_launches(
            plan, qd, kd, vd, out, ws, seq_len=seq_len, seq_len_dev=None, **kw
        )
        assert [launch.early for launch in launches] == [False, early]
        for launch in launches:
            launch.run(None, device, variants.get(launch.kernel))
        got[early] = out.to_host()
    assert np.array_equal(got[True].view(np.uint8), got[False].view(np.uint8))
    ref = fd.reference_gqa_decode(q, k, v, **kw)
    assert rel_err(got[True], ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim,seq_len",
    [(8, 1, 256, 20001), (8, 1, 40, 20001), (6, 1, 24, 100003), (16, 2, 64, 65537)],
)
def test_combine_of_more_than_64_chunks_matches_reference(
    rng, device, dtype, n_heads, n_kv_heads, head_dim, seq_len
):
    # The combine kernel loads 16 chunks per lane in flight up to 64 chunks and 33 past
    # them (in one or more rounds): lengths whose plans have more than 64 chunks.
    dt = DTYPES[dtype]
    plan = plan_split(device, dt, n_heads, n_kv_heads, head_dim, seq_len)
    per_split = -(-seq_len // plan.splits)
    chunk = -(-per_split // plan.tile) * plan.tile  # fx_chunk
    active = -(-seq_len // chunk)
    assert plan.cluster == 0 and active > 64, (plan, active)
    q, k, v = random_decode_inputs(rng, n_heads, n_kv_heads, head_dim, seq_len, dt)
    kw = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim}
    out = poisoned(q.shape, q.dtype)
    fd.gqa_decode(fd.to_device(q), fd.to_device(k), fd.to_device(v), out=out, **kw)
    assert rel_err(out.to_host(), fd.reference_gqa_decode(q, k, v, **kw)) < TOL[dtype]


def assert_cache_decode_matches_reference(q, k, v, n_heads, capacity, dtype):
    """Decode q over k and v appended to a KVCache of ``capacity`` (planned for it), the
    length read on the device as in a captured graph: within TOL of the float64 reference,
    and zeros for an empty cache."""
    _, n_kv_heads, head_dim = k.shape
    ref = fd.reference_gqa_decode(
        q, k, v, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim
    )
    with fd.KVCache(n_kv_heads, head_dim, capacity, dtype=q.dtype) as kv:
        if len(k):
            kv.extend(k, v)
        out = poisoned(q.shape, q.dtype)
        kv.launch_decode(
            fd.to_device(q), out, n_heads=n_heads, stream=kv.stream, length_on_device=True
        )
        kv.synchronize()
        got = out.to_host()
    assert rel_err(got, ref) < TOL[dtype]
    if len(k) == 0:
        assert not np.any(got)


# Tensor-core plans whose chunks per KV head fit one thread block cluster (compute
# capability 9.0, at most 16 blocks, every cluster resident at once) merge them on chip
# where they exchange at most 8192 floats (chunks x group x head_dim; ``blocks`` 0: more,
# so the combine kernel); FERROX_CLUSTER=0 keeps the combine kernel. Both must match the
# reference. A cache of 512 tokens plans 8 chunks per KV head (clusters of 8; the H200
# holds 15 such clusters at once), one of 1024 tokens 16 (non-portable clusters of 16, 7
# at once: up to 7 KV heads), so short lengths leave some of a cluster's blocks without
# tokens.
@pytest.mark.parametrize("cluster", ["1", "0"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim,capacity,blocks",
    [
        (32, 8, 128, 512, 8),
        (64, 8, 64, 512, 8),
        (8, 8, 256, 512, 8),
        (16, 2, 64, 1024, 16),
        (28, 4, 128, 512, 8),
        (28, 4, 128, 1024, 0),
        (64, 8, 40, 512, 8),  # padded head_dims (to 64, 128, 256) in clusters too
        (8, 2, 96, 1024, 16),
        (8, 8, 160, 512, 8),
        (8, 1, 256, 1024, 0),
        (16, 4, 128, 1024, 16),
        (2, 1, 256, 1024, 16),
    ],
)
@pytest.mark.parametrize("seq_len", [0, 1, 65, 511, "full"])
def test_cluster_merge_and_combine_kernel_match_reference(
    rng,
    monkeypatch,
    device,
    cluster,
    dtype,
    n_heads,
    n_kv_heads,
    head_dim,
    capacity,
    blocks,
    seq_len,
):
    monkeypatch.setattr(attention, "OVERRIDES", attention.Overrides(cluster=cluster != "0"))
    dt = DTYPES[dtype]
    seq_len = capacity if seq_len == "full" else seq_len
    plan = plan_split(device, dt, n_heads, n_kv_heads, head_dim, capacity)
    if cluster == "0" or not plan.tensor_cores:
        assert plan.cluster == 0
    elif dtype == "f32" and head_dim == 256:  # 32-token tiles, never clusters
        assert plan.cluster == 0 and plan.tile == 32, plan
    elif device.compute_capability >= (9, 0):
        assert plan.splits == capacity // 64 and plan.cluster == blocks, plan
    q, k, v = random_decode_inputs(rng, n_heads, n_kv_heads, head_dim, seq_len, dt)
    assert_cache_decode_matches_reference(q, k, v, n_heads, capacity, dtype)


# fp16/bf16 head_dim 128 with 8 KV heads: from 1024 tokens (groups up to 4) or 16384 (groups
# of 8), 8 chunks per KV head in clusters of 8-warp blocks (the wide plans; FERROX_WIDE=0:
# the combine kernel's). A cache planned for its capacity and read at shorter lengths (the
# length on the device, as in a captured graph) leaves blocks of a cluster without tokens.
@pytest.mark.parametrize("wide", ["1", "0"])
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize(
    "n_heads,capacity", [(32, 1024), (32, 4096), (16, 32768), (64, 16384)]
)  # fmt: skip
@pytest.mark.parametrize("seq_len", [0, 1, 65, 1000, "full-1", "full"])
def test_wide_cluster_plans_match_reference(
    rng, monkeypatch, device, wide, dtype, n_heads, capacity, seq_len
):
    from ferrox_driver.decode import plan as attention

    monkeypatch.setattr(attention, "OVERRIDES", attention.Overrides(wide=wide != "0"))
    dt = DTYPES[dtype]
    seq_len = {"full": capacity, "full-1": capacity - 1}.get(seq_len, seq_len)
    plan = plan_split(device, dt, n_heads, 8, 128, capacity)
    if wide == "0" or device.compute_capability < (9, 0):
        assert plan.cluster == 0, plan
    else:
        assert plan.kernel.endswith("_d128_wide_cluster"), plan
        assert plan.splits == plan.cluster == attention.WIDE_CHUNKS, plan
        assert plan.threads == 32 * attention.WIDE_WARPS, plan
    q, k, v = random_decode_inputs(rng, n_heads, 8, 128, seq_len, dt)
    assert_cache_decode_matches_reference(q, k, v, n_heads, capacity, dtype)


def _decode_and_check(rng, dtype, n_heads, n_kv_heads, head_dim, seq_len):
    q, k, v = random_decode_inputs(rng, n_heads, n_kv_heads, head_dim, seq_len, DTYPES[dtype])
    ref = fd.reference_gqa_decode(
        q, k, v, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim
    )
    got = decode_on_device(q, k, v, n_heads, n_kv_heads, head_dim, "auto")
    if seq_len == 0:
        return 0.0 if not got.astype(np.float64).any() else float("inf")
    return rel_err(got, ref)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_head_dim_from_1_to_256_matches_reference(rng, dtype):
    # multiples of 8 run on the tensor-core kernels padded to 64/128/256 (fp16/bf16), the
    # rest on CUDA cores; lengths cycle through one token, a chunk and one, and odd ones
    lengths = [1, 65, 77, 1000, 4097]
    worst = {}
    for head_dim in range(1, 257):
        seq = lengths[head_dim % len(lengths)]
        worst[head_dim] = _decode_and_check(rng, dtype, 8, 2, head_dim, seq)
    bad = {d: e for d, e in worst.items() if not e < TOL[dtype]}
    assert bad == {}


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("head_dim", [40, 80, 96, 160, 192])
@pytest.mark.parametrize("seq_len", [0, 1, 33, 4097])
def test_padded_head_dims_every_group_from_1_to_16(rng, dtype, head_dim, seq_len):
    for group in range(1, 17):
        err = _decode_and_check(rng, dtype, 2 * group, 2, head_dim, seq_len)
        assert err < TOL[dtype], (group, err)


# Groups past 8 take the tensor cores in tiles of 8 query heads (a block per tile and KV
# head, both reading the KV head's rows): 9-16 heads per KV head, merged on chip (512
# tokens: clusters of 8) or by the combine kernel, every tile's heads where they belong.
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 96])
@pytest.mark.parametrize("seq_len", [0, 1, 65, 512, 4097])
def test_groups_past_8_take_the_tensor_cores_in_tiles_of_8_heads(
    rng, device, dtype, head_dim, seq_len
):
    for n_heads, n_kv in ((9, 1), (12, 1), (16, 1), (26, 2), (32, 2)):
        plan = plan_split(device, np.dtype(DTYPES[dtype]), n_heads, n_kv, head_dim, seq_len)
        assert plan.tensor_cores and plan.head_tiles == 2 and "_t2" in plan.kernel, plan
        err = _decode_and_check(rng, dtype, n_heads, n_kv, head_dim, seq_len)
        assert err < TOL[dtype], (n_heads, n_kv, err)


@pytest.mark.parametrize("head_dim", [48, 96, 112])
def test_padded_head_dims_take_the_tensor_cores_and_stay_finite_on_huge_scores(rng, head_dim):
    plan = plan_split(fd.Device(0), np.dtype(DTYPES["bf16"]), 32, 8, head_dim, 4096, True)
    assert plan.tensor_cores and plan.kernel.endswith(f"_r{head_dim}")
    q, k, v = random_decode_inputs(rng, 32, 8, head_dim, 777, DTYPES["bf16"], q_scale=1e3)
    got = decode_on_device(q, k, v, 32, 8, head_dim, "auto")
    assert_close_at_any_scale(got, q, k, v, 32, 8, head_dim, TOL["bf16"])


# Overrides.paired=True (FERROX_PAIRED=1: wherever the kernels can, not only where
# Tuning.paired_from says): two adjacent KV heads' rows read as one row of 2 x head_dim,
# Q block-diagonal, each query head's half of the output kept
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("head_dim", [8, 32, 40, 48, 56, 64, 72, 88, 96, 104, 120, 128])
@pytest.mark.parametrize("n_heads,n_kv_heads", [(32, 8), (64, 8), (16, 2), (8, 2), (2, 2)])
def test_paired_kv_heads_match_the_reference(rng, monkeypatch, dtype, head_dim, n_heads,
                                             n_kv_heads):  # fmt: skip
    monkeypatch.setattr(attention, "OVERRIDES", attention.Overrides(paired=True))
    plan = plan_split(fd.Device(0), np.dtype(DTYPES[dtype]), n_heads, n_kv_heads, head_dim,
                      4097, True)  # fmt: skip
    assert plan.paired and "_p2" in plan.kernel, plan
    for seq_len in (0, 1, 65, 4097):
        err = _decode_and_check(rng, dtype, n_heads, n_kv_heads, head_dim, seq_len)
        assert err < TOL[dtype], (seq_len, err)
