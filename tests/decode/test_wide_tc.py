"""head_dim 384 and 512 on tensor cores, on the CPU (issue 50): `launches_for`, the assembly
every decode entry point uses, hands fp16/bf16 q over 16-bit or fp8 caches of those widths
to the latent kernels with V rows of their own (``records.wide_launches``), with the strides
of either layout, V's fp8 scales apart from K's and the roles a launch record rewrites; what
those kernels cannot compute is left to the CUDA-core kernels (None)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from ferrox_driver.decode import plan as planner
from ferrox_driver.decode.records import launches_for, wide_launches
from ferrox_driver.driver.memory import DeviceArray
from ferrox_driver.kernels import abi
from ferrox_driver.kernels.traits import F_ALIBI, F_HND, F_LSE, F_SINKS, F_WINDOW

BF16 = np.dtype(ml_dtypes.bfloat16)
H100 = SimpleNamespace(context_handle=1, multiprocessor_count=132,
                       max_shared_per_block_optin=232448, compute_capability=(9, 0))  # fmt: skip


def _arr(ptr, shape, dtype=BF16, device=H100):
    return DeviceArray._wrap(ptr, shape, np.dtype(dtype), device, None)


def _call(d=512, n_heads=16, n_kv=4, n_q=1, seq=40, cache=BF16, qdt=BF16, device=H100,
          layout="NHD", **kw):  # fmt: skip
    q_shape = (n_q, n_heads, d) if n_q > 1 else (n_heads, d)
    kv_shape = (seq, n_kv, d) if layout == "NHD" else (n_kv, seq, d)
    q, out = _arr(0x1000, q_shape, qdt, device), _arr(0x9000, q_shape, qdt, device)
    k, v = _arr(0x100000, kv_shape, cache, device), _arr(0x900000, kv_shape, cache, device)
    asked = []

    def workspace(floats):
        asked.append(floats)
        return _arr(0x2000000, (floats,), np.float32, device)

    args = dict(n_heads=n_heads, n_kv_heads=n_kv, head_dim=d, seq_len=seq, plan_seq=64,
                aligned=True, algorithm="auto", seq_len_dev=None, workspace=workspace,
                qdt=qdt, bits=0, fp8="", features=None, kv_scales=None, n_q=n_q,
                mask=None)  # fmt: skip
    args.update(kw)
    if layout == "HND":
        args["bits"] |= F_HND
        args["features"] = abi.FeatureArgs(d**-0.5, head_stride=seq * d)
    return wide_launches(q, k, v, out, **args), (q, k, v, out), asked


@pytest.mark.parametrize("d", [384, 512])
@pytest.mark.parametrize("n_q", [1, 3])
def test_a_wide_token_major_decode_takes_the_latent_kernels_with_its_strides(d, n_q):
    found, (q, k, v, out), asked = _call(d=d, n_q=n_q)
    assert found is not None
    (kernel, combine), ws = found
    spec = kernel.spec
    assert (spec.family, spec.head_dim, spec.head_dim_v, spec.own_v) == ("latent", d, d, True)
    assert kernel.args[0] is q and kernel.args[1] is k and kernel.args[2] is v
    assert [int(a) for a in kernel.args[12:16]] == [4 * d, 4 * d, d, d]
    assert int(kernel.args[6]) == 4 and int(kernel.args[7]) == n_q
    assert combine.args[0] is out and int(combine.args[3]) == d
    per_chunk = n_q * 16 * (d + 2)  # each row's partial output, maximum and sum per chunk
    assert len(asked) == 1 and asked[0] % per_chunk == 0 and asked[0] >= per_chunk
    assert ws.size == asked[0] and kernel.args[3] is ws
    assert dict((r, i) for i, r in kernel.roles if r != "heads") == {
        "q": 0, "k": 1, "v": 2, "seq": 8}  # fmt: skip
    assert dict((r, i) for i, r in combine.roles) == {"out": 0, "seq": 4, "sinks": 11, "lse": 12}


def test_a_head_major_decode_reads_rows_by_the_calls_head_stride():
    found, _, _ = _call(layout="HND", seq=40)
    assert found is not None
    kernel = found[0][0]
    assert [int(a) for a in kernel.args[12:16]] == [512, 512, 40 * 512, 40 * 512]
    assert (14, "heads") in kernel.roles and (15, "heads") in kernel.roles
    assert not kernel.spec.features & F_HND


def test_a_device_length_is_read_by_both_launches_and_is_no_role():
    length = _arr(0x50, (1,), np.int32)
    found, _, _ = _call(seq_len_dev=length)
    assert found is not None
    kernel, combine = found[0]
    assert kernel.args[9] is length and combine.args[5] is length
    assert all(role != "seq" for _, role in (*kernel.roles, *combine.roles))


def test_an_fp8_cache_passes_k_and_v_their_own_scales():
    scales = _arr(0x7000, (8,), np.float32)
    found, _, _ = _call(cache=np.uint8, fp8="e4m3", kv_scales=scales)
    assert found is not None
    kernel = found[0][0]
    assert kernel.spec.fp8 == "e4m3"
    assert kernel.args[19] is scales and kernel.args[20].ptr == scales.ptr + 4 * 4


def test_the_features_the_kernels_take_reach_them():
    feats = abi.FeatureArgs(0.125, 30.0, 7, None, _arr(0x60, (16,), np.float32),
                            _arr(0x70, (16,), np.float32))  # fmt: skip
    found, _, _ = _call(bits=F_WINDOW | F_SINKS | F_LSE, features=feats)
    assert found is not None
    kernel, combine = found[0]
    assert kernel.spec.features & F_WINDOW and combine.spec.features & (F_SINKS | F_LSE)
    assert float(kernel.args[16]) == 0.125 and int(kernel.args[18]) == 7
    assert combine.args[11] is feats.sinks and combine.args[12] is feats.lse


@pytest.mark.parametrize(
    "change",
    [
        dict(d=256), dict(d=320), dict(d=448), dict(bits=F_ALIBI), dict(algorithm="parity"),
        dict(aligned=False), dict(qdt=np.float32, cache=np.float32), dict(n_q=17, seq=40),
        dict(fp8="q4"), dict(fp8="e4m3+q4"),
        dict(device=SimpleNamespace(**{**vars(H100), "compute_capability": (7, 5)})),
        dict(cache=np.uint8, fp8="e4m3",
             device=SimpleNamespace(**{**vars(H100), "compute_capability": (8, 0)})),
    ],
)  # fmt: skip
def test_what_the_latent_kernels_cannot_compute_stays_on_cuda_cores(change):
    found, _, asked = _call(**change)
    assert found is None and asked == []


def test_a_tree_mask_stays_on_cuda_cores():
    found, _, asked = _call(n_q=3, mask=_arr(0x80, (4,), np.uint32))
    assert found is None and asked == []


def test_the_override_turns_it_off(monkeypatch):
    off = dataclasses.replace(planner.OVERRIDES, wide_tensor_cores=False)
    monkeypatch.setattr(planner, "OVERRIDES", off)
    found, _, asked = _call()
    assert found is None and asked == []
    assert planner.Overrides.from_env({"FERROX_WIDE_TC": "0"}).wide_tensor_cores is False
    assert planner.Overrides.from_env({}).wide_tensor_cores is True


def test_launches_for_takes_them_at_head_dim_512():
    q, out = _arr(0x1000, (8, 512)), _arr(0x9000, (8, 512))
    k, v = _arr(0x100000, (33, 2, 512)), _arr(0x900000, (33, 2, 512))
    launches, ws = launches_for(
        q, k, v, out, n_heads=8, n_kv_heads=2, head_dim=512, seq_len=33, plan_seq=64,
        aligned=True, workspace=lambda floats: _arr(0x2000000, (floats,), np.float32),
    )  # fmt: skip
    assert [launch.spec.family for launch in launches] == ["latent", "vrcombine"]
    assert ws is not None and launches[0].args[3] is ws
