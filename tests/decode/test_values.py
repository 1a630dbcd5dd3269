"""``gqa_decode(..., head_dim_v=...)`` on the CPU (issue 50): values of their own width on
the latent kernels with V rows of their own. The arguments refused by name before any device
work, the strides a view is read through, the plans and kernels chosen for DeepSeek's
expanded heads and wide GQA heads, their launches' arguments, a length on the device (its
checks, its plan for K's tokens, the launches reading it), and those kernels compiling
without spills on Hopper."""

from __future__ import annotations

import types

import ml_dtypes
import numpy as np
import pytest

import ferrox_driver as fd
import ferrox_driver.decode.values as values
from ferrox_driver.decode.latent import latent_launches
from ferrox_driver.decode.latent_plan import LATENT_MIN_CHUNK, latent_plan
from ferrox_driver.decode.launches import split_program
from ferrox_driver.decode.values import plan_length, takes_own_width, value_strides, values_decode
from ferrox_driver.driver.memory import DeviceArray
from ferrox_driver.kernels import abi
from ferrox_driver.kernels.traits import F_CAP, F_LSE, F_SCALE, F_SINKS, F_WINDOW

BF16 = ml_dtypes.bfloat16
H100 = dict(multiprocessor_count=132, shared_per_block=232448, compute_capability=(9, 0))
FEATURES = F_WINDOW | F_CAP | F_SCALE


def _args(n_q=0, n_heads=16, n_kv=16, d=192, dv=128, seq=20, dtype=BF16, layout="NHD"):
    rng = np.random.default_rng()
    q = rng.standard_normal((n_q, n_heads, d) if n_q else (n_heads, d)).astype(dtype)
    shapes = [(seq, n_kv, w) if layout == "NHD" else (n_kv, seq, w) for w in (d, dv)]
    k, v = (rng.standard_normal(s).astype(dtype) for s in shapes)
    return q, k, v


@pytest.mark.parametrize(
    ("change", "kw", "error", "match"),
    [
        (dict(dtype=np.float32), {}, TypeError, "q: head_dim_v .* needs float16 or bfloat16"),
        ({}, dict(head_dim_v=100), ValueError, "head_dim_v: a multiple of 128 up to 512"),
        ({}, dict(head_dim_v=640), ValueError, "head_dim_v: a multiple of 128"),
        ({}, dict(head_dim_v=128.0), TypeError, "head_dim_v: expected an int"),
        (dict(d=160), {}, ValueError, "head_dim: with head_dim_v, a multiple of 64"),
        (dict(d=640), {}, ValueError, "head_dim: with head_dim_v, a multiple of 64 up to 576"),
        (dict(n_q=17, seq=40), {}, ValueError, "q: up to 16 query tokens"),
        (dict(n_q=3, seq=2), {}, ValueError, "q: 3 query tokens for a cache of 2"),
        (dict(n_heads=12, n_kv=8), {}, ValueError, "n_heads: 12 query heads"),
        ({}, dict(n_kv_heads=4), ValueError, "n_kv_heads: 4 given"),
        ({}, dict(n_heads=8), ValueError, "n_heads: 8 given"),
        ({}, dict(head_dim=128), ValueError, "head_dim: 128 given"),
        ({}, dict(tree_mask=np.ones((1, 1), bool)), ValueError, "tree_mask: not with head_dim_v"),
        ({}, dict(alibi_slopes=np.ones(16, np.float32)), ValueError, "alibi_slopes: not with"),
        ({}, dict(algorithm="parity"), ValueError, "algorithm: head_dim_v runs on the split"),
        ({}, dict(algorithm="fast"), ValueError, "algorithm: expected one of"),
        ({}, dict(kv_layout="NDH"), ValueError, "kv_layout"),
        ({}, dict(out=np.zeros((16, 128), BF16)), TypeError, "out: only accepted with device"),
        ({}, dict(sliding_window=0), ValueError, "sliding_window"),
        ({}, dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
        ({}, dict(sinks=np.zeros(3, np.float32)), ValueError, "sinks"),
        ({}, dict(scale=float("nan")), ValueError, "scale"),
        ({}, dict(return_lse=1), TypeError, "return_lse"),
    ],
)
def test_bad_arguments_are_refused_by_name(change, kw, error, match):
    q, k, v = _args(**change)
    kw = {"head_dim_v": 128, **kw}
    with pytest.raises(error, match=match):
        fd.gqa_decode(q, k, v, **kw)


@pytest.mark.parametrize(
    ("which", "make", "match"),
    [
        ("k", lambda k, v: k.astype(np.float16), "k_cache: expected q's dtype"),
        ("v", lambda k, v: v.astype(np.float16), "v_cache: expected q's dtype"),
        ("v", lambda k, v: v[:, :, :64], r"v_cache: expected a NHD array \(seq_len, n_kv"),
        ("k", lambda k, v: k[:, :, :128], r"k_cache: expected a NHD array .*q's head_dim"),
        ("v", lambda k, v: v[:5], "v_cache: expected k_cache's 20 tokens of 16 KV heads"),
        ("v", lambda k, v: v[:, :8], "v_cache: expected k_cache's 20 tokens of 16 KV heads"),
        ("k", lambda k, v: k.reshape(-1), "k_cache: expected a NHD array"),
        ("q", lambda k, v: np.zeros(16 * 192, BF16), r"q: expected \(n_heads, head_dim\)"),
    ],
)
def test_bad_caches_are_refused_by_name(which, make, match):
    q, k, v = _args()
    if which == "q":
        q = make(k, v)
    elif which == "k":
        k = make(k, v)
    else:
        v = make(k, v)
    with pytest.raises((TypeError, ValueError), match=match):
        fd.gqa_decode(q, k, v, head_dim_v=128)


def test_a_head_major_cache_is_checked_in_its_own_layout():
    q, k, v = _args(n_heads=32, n_kv=8, d=256, layout="HND")
    with pytest.raises(ValueError, match=r"v_cache: expected a HND array \(n_kv_heads"):
        fd.gqa_decode(q, k, v[:, :, :64], head_dim_v=128, kv_layout="HND")
    with pytest.raises(ValueError, match="n_heads: 32 query heads are not groups of k_cache's 20"):
        fd.gqa_decode(q, k, v, head_dim_v=128)  # (8, 20, 256) read as 8 tokens of 20 heads


class _DeviceLike:
    """A device array as the CUDA array interface describes one (a null pointer: no device
    is asked which holds it)."""

    def __init__(self, shape, typestr="<f2", strides=None):
        self.__cuda_array_interface__ = dict(shape=shape, typestr=typestr, data=(0, False),
                                             strides=strides, version=3)  # fmt: skip


def test_numpy_and_device_arrays_do_not_mix():
    q, k, _ = _args(dtype=np.float16)
    with pytest.raises(TypeError, match="q, k_cache, v_cache: pass all three"):
        fd.gqa_decode(q, k, _DeviceLike((20, 16, 128)), head_dim_v=128)
    with pytest.raises(TypeError, match="v_cache: expected a numpy array or a device array"):
        fd.gqa_decode(q, k, [0.0], head_dim_v=128)


def test_a_host_call_of_no_tokens_gives_zeros_without_a_device():
    q, k, v = _args(seq=0)
    out = fd.gqa_decode(q, k, v, head_dim_v=128)
    assert out.shape == (16, 128) and out.dtype == q.dtype and not out.astype(float).any()
    sinks = np.linspace(-1, 1, 16).astype(np.float32)
    out, lse = fd.gqa_decode(q, k, v, head_dim_v=128, return_lse=True, sinks=sinks)
    assert out.shape == (16, 128)
    np.testing.assert_allclose(lse, sinks, rtol=1e-6)
    _, lse = fd.gqa_decode(q, k, v, head_dim_v=128, return_lse=True)
    assert np.isneginf(lse).all()


def test_values_of_k_widths_take_the_usual_path():
    q, _, _ = _args(d=128)
    assert not takes_own_width(q, None, 128)
    assert not takes_own_width(q.reshape(-1), 128, 128)  # (flat q, head_dim given)
    assert takes_own_width(q, None, 256)
    assert takes_own_width(q, None, 128.0)  # (refused by name there)
    q32 = np.zeros((8, 128), np.float32)  # a float32 q of equal widths is the usual call's
    assert not takes_own_width(q32, None, 128)


def test_a_views_rows_are_read_through_its_strides():
    # K and V as a torch.split of one (seq, n_kv, 192 + 128) buffer, NHD and HND
    kv = np.zeros((7, 4, 320), BF16)
    k, v = kv[..., :192], kv[..., 192:]
    kw = dict(itemsize=2, contiguous=False)
    assert value_strides(k, k.shape, "NHD", 192, ptr=0, name="k_cache", **kw) == (1280, 320)
    assert value_strides(v, v.shape, "NHD", 128, ptr=384, name="v_cache", **kw) == (1280, 320)
    hnd = np.zeros((4, 7, 320), BF16)[..., 192:]
    assert value_strides(hnd, hnd.shape, "HND", 128, ptr=384, name="v", **kw) == (320, 2240)
    grown = np.zeros((1, 4, 50, 128), BF16)[:, :, :7]  # cache[:, :, :n] of a larger one
    assert value_strides(grown, grown.shape, "HND", 128, ptr=0, name="v", **kw) == (128, 6400)
    whole = np.zeros((7, 4, 128), BF16)
    assert value_strides(whole, whole.shape, "NHD", 128, 2, 0, True, "v") == (512, 128)
    one = np.zeros((7, 1, 320), BF16)[..., :128]  # one head, one token: their strides unused
    assert value_strides(one, one.shape, "NHD", 128, ptr=0, name="v", **kw) == (320, 128)


def test_a_device_view_of_unaligned_rows_is_refused_before_any_device_work():
    q, k = _DeviceLike((16, 192)), _DeviceLike((20, 16, 192))
    v = _DeviceLike((20, 16, 128), strides=(16 * 260 * 2, 260 * 2, 2))  # rows 520 bytes apart
    with pytest.raises(ValueError, match="v_cache: every row must start on a 16-byte"):
        fd.gqa_decode(q, k, v, head_dim_v=128)
    q32 = _DeviceLike((16, 192), "<f4")
    with pytest.raises(TypeError, match=r"q: head_dim_v .* needs float16 or bfloat16"):
        fd.gqa_decode(q32, k, _DeviceLike((20, 16, 128)), head_dim_v=128)


@pytest.mark.parametrize(
    ("view", "ptr", "match"),
    [
        (lambda a: a[..., 8:136], 16, r"v_cache: every row must start on a 16-byte boundary"),
        (lambda a: a[..., 1:129], 2, "v_cache: every row must start on a 16-byte"),
        (lambda a: a[:, :, ::2][..., :128], 0, "v_cache: each token's row of 128 must be"),
    ],
)
def test_a_view_off_16_byte_rows_is_refused(view, ptr, match):
    base = np.zeros((7, 4, 260), BF16)  # rows 520 bytes apart: no 16-byte multiple
    v = view(base)
    with pytest.raises(ValueError, match=match):
        value_strides(v, v.shape, "NHD", 128, 2, ptr, False, "v_cache")


def _plan(n_q, n_heads, n_kv, d, dv, seq=32768, features=0, dtype="bf16"):
    return latent_plan(dtype, "", n_q, n_heads, n_kv, d, dv, seq, features, own_v=True,
                       **H100)  # fmt: skip


def test_deepseeks_expanded_heads_plan_a_block_of_rows_per_head():
    """16 heads of K 192 (128 + 64 rope) and V 128, one KV head each (MHA)."""
    plan = _plan(1, 16, 16, 192, 128)
    assert plan.spec.name == "gqa_split_latent_bf16_dk192_dv128_sv_h16_x0"
    assert plan.spec.own_v and plan.spec.step_tokens == 64
    assert plan.row_blocks == 1 and plan.splits == 8 and plan.grid(16) == (8, 16, 1)
    assert plan.shared_bytes <= H100["shared_per_block"]
    assert plan.workspace_floats(16) == 16 * 8 * 130
    three = _plan(3, 16, 16, 192, 128, features=FEATURES | F_SINKS | F_LSE)
    assert three.spec.features == FEATURES and three.row_blocks == 1
    combine = f"gqa_verify_rows_combine_bf16_x{F_WINDOW | F_SINKS | F_LSE}"
    assert three.combine_spec().name == combine


@pytest.mark.parametrize(
    ("n_q", "n_heads", "n_kv", "d", "dv", "heads", "row_blocks", "tokens"),
    [
        (1, 32, 8, 256, 128, 16, 1, 64),
        (3, 32, 8, 256, 128, 16, 1, 64),
        (1, 28, 4, 128, 256, 16, 1, 64),
        (3, 28, 4, 128, 256, 32, 1, 64),
        (1, 64, 8, 512, 256, 16, 1, 64),
        (4, 64, 8, 512, 256, 32, 1, 32),  # (a 64-token ring of 768-wide rows, 32 rows: too big)
        (1, 8, 2, 576, 512, 16, 1, 32),
        (16, 64, 2, 128, 512, 32, 16, 64),
    ],
)
def test_wide_gqa_heads_plan_blocks_of_a_kv_heads_rows(n_q, n_heads, n_kv, d, dv, heads,
                                                       row_blocks, tokens):  # fmt: skip
    plan = _plan(n_q, n_heads, n_kv, d, dv)
    assert plan.spec.head_dim == d and plan.spec.head_dim_v == dv and plan.spec.own_v
    assert (plan.spec.heads_per_block, plan.row_blocks) == (heads, row_blocks)
    assert plan.spec.step_tokens == tokens
    assert plan.shared_bytes <= H100["shared_per_block"]
    assert plan.row_blocks * plan.spec.heads_per_block >= n_q * n_heads // n_kv
    assert plan.splits >= 1 and plan.grid(n_kv)[1] == n_kv * row_blocks
    assert plan.splits * n_kv * row_blocks <= max(H100["multiprocessor_count"], n_kv * row_blocks)


def test_the_launches_pass_v_its_strides_and_the_kv_heads():
    plan = _plan(1, 32, 8, 256, 128)

    def arr(ptr, shape, dtype=BF16):
        return DeviceArray._wrap(ptr, shape, np.dtype(dtype), None, None)

    q, k, v = arr(0x1000, (32, 256)), arr(0x100000, (9, 8, 256)), arr(0x200000, (9, 8, 128))
    out, ws = arr(0x300000, (32, 128)), arr(0x400000, (plan.workspace_floats(32),), np.float32)
    feats = abi.FeatureArgs(0.1, 1.0, 0, None, None, None)
    kernel, combine = latent_launches(plan, q, k, out, ws, n_q=1, n_heads=32, seq_len=9,
                                      seq_len_dev=None, features=feats, v=v, n_kv_heads=8,
                                      strides=(2048, 1024, 256, 128))  # fmt: skip
    assert kernel.spec == plan.spec and kernel.grid == plan.grid(8)
    assert kernel.args[1] is k and kernel.args[2] is v and int(kernel.args[6]) == 8
    assert [int(a) for a in kernel.args[12:16]] == [2048, 1024, 256, 128]
    assert combine.grid == (32, 4, 1) and int(combine.args[3]) == 128
    mla = latent_launches(plan, q, k, out, ws, n_q=1, n_heads=32, seq_len=9,
                          seq_len_dev=None, features=feats)[0]  # fmt: skip
    assert mla.args[2] is k and [int(a) for a in mla.args[12:16]] == [256, 256, 0, 0]


def test_the_kernels_these_plans_name_compile_without_spills():
    shapes = [(1, 16, 16, 192, 128), (3, 32, 8, 256, 128), (3, 28, 4, 128, 256),
              (4, 64, 8, 512, 256), (1, 8, 2, 576, 512)]  # fmt: skip
    specs = {
        _plan(*shape, features=f, dtype=dt).spec
        for shape in shapes
        for f in (0, FEATURES)
        for dt in ("bf16", "f16")
        if dt == "bf16" or f == 0
    }
    program = split_program(sorted(specs, key=lambda s: s.name), "sm_90")
    for spec in specs:
        res = program.resources[spec.name]
        assert res.spill_stores == 0 and res.spill_loads == 0 and res.stack_bytes == 0, spec.name
        assert res.registers <= 255, spec.name


@pytest.mark.parametrize(
    ("change", "kw", "error", "match"),
    [
        ({}, dict(seq_len=21), ValueError, r"seq_len: expected 0..20 \(k_cache's tokens\)"),
        ({}, dict(seq_len=-1), ValueError, "seq_len: expected 0..20"),
        ({}, dict(seq_len=True), TypeError, "seq_len: expected None, an int, or a one-element"),
        ({}, dict(seq_len=3.0), TypeError, "seq_len: expected None, an int"),
        ({}, dict(seq_len=np.array([3], np.int32)), TypeError, "seq_len: expected None"),
        ({}, dict(seq_len=_DeviceLike((1,), "<i8")), TypeError, "int32 device array"),
        ({}, dict(seq_len=_DeviceLike((2,), "<i4")), TypeError, "one-element int32"),
        ({}, dict(seq_len=_DeviceLike((1,), "<i4")), ValueError,
         "seq_len: a device length takes device arrays q, k_cache, v_cache"),
        (dict(n_q=3), dict(seq_len=2), ValueError, "q: 3 query tokens for a cache of 2"),
        ({}, dict(lse=np.zeros(16, np.float32)), TypeError, "lse: only with device inputs"),
    ],
)  # fmt: skip
def test_a_bad_length_or_lse_is_refused_by_name(change, kw, error, match):
    q, k, v = _args(**change)
    with pytest.raises(error, match=match):
        values_decode(q, k, v, 128, **kw)


def test_a_host_length_of_no_tokens_gives_zeros_without_a_device():
    q, k, v = _args(n_q=0, seq=20)
    out, lse = values_decode(q, k, v, 128, seq_len=0, return_lse=True)
    assert out.shape == (16, 128) and not out.astype(float).any() and np.isneginf(lse).all()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(lse=_DeviceLike((16, 128), "<f4")), r"lse: expected a C-contiguous .* \(16,\)"),
        (dict(lse=_DeviceLike((16,), "<f2")), "lse: expected .* of float32"),
        (dict(seq_len=_DeviceLike((1,), "<u4")), "seq_len: expected None, an int"),
    ],
)  # fmt: skip
def test_a_device_calls_length_and_lse_are_checked_before_any_device_work(kw, match):
    q, k, v = _DeviceLike((16, 192)), _DeviceLike((20, 16, 192)), _DeviceLike((20, 16, 128))
    with pytest.raises((TypeError, ValueError), match=match):
        values_decode(q, k, v, 128, **kw)


def test_a_length_is_planned_for_what_it_can_read_rounded_up():
    assert plan_length(1000, None, 1) == 1024  # (a device length's bound: K's tokens)
    assert plan_length(1024, None, 3) == 1024
    assert plan_length(100_000, 400, 3) == 512  # (a window's: its tokens and the queries')
    assert plan_length(0, None, 1) == plan_length(1, None, 1) == LATENT_MIN_CHUNK


def test_a_device_length_reaches_both_launches_planned_for_ks_tokens(monkeypatch):
    """A decode over K and V of 1000 tokens with the length on the device (the driver
    stood in for: no device): planned for K's 1000 tokens (1024), the launches given the
    length's array to read (and K's tokens as the host bound), the caller's out and lse."""
    dev = types.SimpleNamespace(
        context_handle=1,
        multiprocessor_count=132,
        max_shared_per_block_optin=232448,
        compute_capability=(9, 0),
    )
    seen = {}

    def launches(plan, q, k, out, workspace, **kw):
        seen.update(kw, plan=plan, out=out)
        return []

    def wrap(ref, obj, name):
        return DeviceArray._wrap(ref[0], tuple(ref[1]), np.dtype(ref[2]), None, obj)

    monkeypatch.setattr(values, "device_for", lambda ordinal: dev)
    monkeypatch.setattr(values, "view_of", wrap)
    monkeypatch.setattr(values, "latent_launches", launches)
    monkeypatch.setattr(
        values, "stream_buffer", lambda d, sid, role, n: wrap((0, (n,), np.float32), None, role)
    )
    q = _DeviceLike((16, 192))
    k, v = _DeviceLike((1000, 16, 192)), _DeviceLike((1000, 16, 128))
    out, lse, length = _DeviceLike((16, 128)), _DeviceLike((16,), "<f4"), _DeviceLike((1,), "<i4")
    got = values_decode(q, k, v, 128, out=out, lse=lse, seq_len=length)
    assert got == (out, lse)
    want = latent_plan("f16", "", 1, 16, 16, 192, 128, 1024, F_LSE, own_v=True, **H100)
    assert seen["plan"] == want and want.splits == 4  # (a 256-token plan has one split)
    assert seen["seq_len"] == 1000 and seen["seq_len_dev"].dtype == np.int32
    assert seen["seq_len_dev"].shape == (1,) and seen["features"].lse.shape == (16,)
    assert seen["n_kv_heads"] == 16 and seen["strides"] == (16 * 192, 16 * 128, 192, 128)
