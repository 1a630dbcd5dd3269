"""A caller's 4-bit (k_cache, v_cache) pair without a GPU: its checks in both layouts
(token-major and head-major, values and block scales alike), the arguments its decode
record and its append are made with (the head-major bit and stride, the rows a head), and
every bad head-major array named with the shape it needs."""

from __future__ import annotations

import types

import numpy as np
import pytest

from ferrox_driver.cache import pair_append
from ferrox_driver.decode import pair, records
from ferrox_driver.decode.pair import FourBitScales
from ferrox_driver.decode.records import Kept
from ferrox_driver.kernels.abi import F_HND

N_KV, CAP, D, H = 4, 48, 128, 16
PER = {"q4": D // 32, "nvfp4": D // 16}
SCALE_DTYPE = {"q4": np.float16, "nvfp4": np.uint8}


class FakeDevice:
    """A device array as the CUDA array interface describes one (its shape, dtype and
    strides are all the checks read: no driver call at address 0)."""

    def __init__(self, shape, dtype=np.uint8, ptr=0):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": np.dtype(dtype).str, "data": (ptr, False),
            "version": 3, "strides": None,
        }  # fmt: skip


def _lead(layout, n_kv=N_KV, cap=CAP):
    return (n_kv, cap) if layout == "HND" else (cap, n_kv)


def _four(fmt="q4", layout="NHD", n_kv=N_KV, cap=CAP, rotate=True):
    """A 4-bit pair of ``layout`` and its FourBitScales (nvfp4: with its kv_scales)."""
    lead = _lead(layout, n_kv, cap)
    kv = (FakeDevice((*lead, D // 2)), FakeDevice((*lead, D // 2)))
    blocks = [FakeDevice((*lead, PER[fmt]), SCALE_DTYPE[fmt]) for _ in "kv"]
    scales = FakeDevice((2 * n_kv,), np.float32) if fmt == "nvfp4" else None
    return kv, FourBitScales(fmt, blocks[0], blocks[1], rotate), scales


@pytest.mark.parametrize("fmt", ["q4", "nvfp4"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_a_4bit_pair_is_read_in_either_layout(fmt, layout):
    kv, four, scales = _four(fmt, layout)
    capacity, n_kv, hd, refs = pair.check_four_bit_pair(kv, four, scales, layout)
    assert (capacity, n_kv, hd) == (CAP, N_KV, D)
    assert len(refs) == 5 and (refs[4] is None) == (fmt == "q4")
    checked = pair._check_pair(kv, layout, four_bit=four, kv_scales=scales)
    assert (checked.capacity, checked.n_kv_heads, checked.head_dim) == (CAP, N_KV, D)
    assert checked.layout == layout and checked.fp8 == fmt
    # head-major: the bytes of values from one KV head's rows to the next's
    assert checked.head_stride == (CAP * D // 2 if layout == "HND" else 0)


def test_bad_head_major_4bit_pairs_are_refused_naming_the_argument():
    kv, four, _ = _four(layout="HND")
    nhd_kv, nhd_four, _ = _four(layout="NHD")
    want = rf"\({N_KV}, {CAP}, {D // 32}\) \(kv_layout 'HND'"
    cases = [
        # token-major block scales with head-major values
        (kv, FourBitScales("q4", nhd_four.k_scales, four.v_scales, True), "HND",
         f"k_block_scales: .*{want}"),
        (kv, FourBitScales("q4", four.k_scales, nhd_four.v_scales, True), "HND",
         f"v_block_scales: .*{want}"),
        ((kv[0], FakeDevice((N_KV, CAP - 1, D // 2))), four, "HND",
         "v_cache: expected k_cache's shape"),
        ((FakeDevice((1, N_KV, CAP, D // 2)),) * 2, four, "HND",
         r"k_cache: .*\(n_kv_heads, capacity, head_dim // 2\), head-major \(kv_layout 'HND'\)"),
        ((FakeDevice((N_KV, CAP, 48)),) * 2, four, "HND", "k_cache: .*head_dim 64, 128 or 256"),
        # head-major block scales with token-major values
        (nhd_kv, four, "NHD", rf"k_block_scales: .*\({CAP}, {N_KV}, {D // 32}\) "
         r"\(kv_layout 'NHD'"),
        (kv, four, "NCHW", "kv_layout: expected 'NHD'"),
    ]  # fmt: skip
    for pair_, four_, layout, match in cases:
        with pytest.raises(ValueError, match=match):
            pair.check_four_bit_pair(pair_, four_, None, layout)
        with pytest.raises(ValueError, match=match):
            pair._check_pair(pair_, layout, four_bit=four_)


def _fake_device():
    return types.SimpleNamespace(compute_capability=(9, 0), context_handle=1, ordinal=0,
                                 activate=lambda: None)  # fmt: skip


def _checked_record(monkeypatch, layout, fmt="q4"):
    """``_pair_checked`` of a 4-bit pair of ``layout`` with no device: the key and the
    arguments its record would be made with."""
    made = {}

    def record(key, dev, kv, q, out, seq, n_heads, dtype, aligned, bits, fargs, *rest):
        made.update(key=key, kv=kv, bits=bits, fargs=fargs, aligned=aligned)
        return "record"

    monkeypatch.setattr(pair, "device_for", lambda ordinal: _fake_device())
    monkeypatch.setattr(pair, "_pair_record", record)
    kv, four, scales = _four(fmt, layout, n_kv=N_KV, cap=N_KV)  # (both layouts' shape alike)
    q, out = FakeDevice((H, D), np.float16), FakeDevice((H, D), np.float16)
    seq = FakeDevice((1,), np.int32)
    got = pair._pair_checked(q, kv, out, None, None, 0, "auto", seq, layout, {}, None, scales,
                             False, None, four)  # fmt: skip
    assert got[0] == "record"
    return made


def test_a_4bit_pairs_record_key_tells_the_layouts_apart(monkeypatch):
    nhd, hnd = (_checked_record(monkeypatch, layout) for layout in ("NHD", "HND"))
    assert nhd["key"] != hnd["key"]  # (the same shapes: the layout alone differs)
    assert not nhd["bits"] & F_HND and hnd["bits"] & F_HND
    assert nhd["fargs"].head_stride == 0
    assert hnd["fargs"].head_stride == hnd["kv"].head_stride == N_KV * D // 2
    assert hnd["aligned"] and nhd["aligned"]


@pytest.mark.parametrize("fmt", ["q4", "nvfp4"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_a_4bit_pairs_record_gets_its_head_stride_and_block_scales_in_its_layout(
    monkeypatch, fmt, layout
):
    made = {}

    def assemble(q, k, v, out, **how):
        made.update(how, k=k)
        return "record"

    monkeypatch.setattr(pair, "assemble", assemble)
    monkeypatch.setattr(pair, "_records", Kept())
    kv, four, scales = _four(fmt, layout)
    checked = pair._check_pair(kv, layout, four_bit=four, kv_scales=scales)
    ref = pair.array_ref
    q, out = FakeDevice((H, D), np.float16), FakeDevice((H, D), np.float16)
    seq, sc = ref(FakeDevice((1,), np.int32), "seq_len"), None
    if scales is not None:
        sc = ref(scales, "kv_scales")
    bits = F_HND if layout == "HND" else 0
    record = pair._pair_record(
        ("key",), _fake_device(), checked, ref(q, "q"), ref(out, "out"), seq, H,
        np.dtype(np.float16), True, bits, None, None, 0, sc, four_bit=four,
    )  # fmt: skip
    assert record == "record"
    assert made["fp8"] == fmt and made["rotate"] is True
    assert made["q4_head_stride"] == (CAP * D // 2 if layout == "HND" else 0)
    lead = _lead(layout)
    assert tuple(made["k"].shape) == (*lead, D // 2)
    for block in made["q4_scales"]:
        assert tuple(block.shape) == (*lead, PER[fmt])
        assert block.dtype == np.dtype(SCALE_DTYPE[fmt])
    assert (made["kv_scales"] is None) == (fmt == "q4")


@pytest.mark.parametrize("fmt", ["q4", "nvfp4"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("n", [1, 5])
def test_a_4bit_pairs_append_passes_the_rows_a_head(monkeypatch, fmt, layout, n):
    launched = {}

    class Launch:
        def __init__(self, kernel, grid, threads, args, stream=None):
            launched.update(kernel=kernel, args=args)

    monkeypatch.setattr(pair_append, "q4_quantize_kernel", lambda *a: ("q4", *a))
    monkeypatch.setattr(pair_append, "nvfp4_quantize_kernel", lambda *a: ("nvfp4", *a))
    monkeypatch.setattr(pair_append, "PackedLaunch", Launch)
    monkeypatch.setattr(pair_append, "append_sequence", lambda *a: "sequence")
    kv, four, scales = _four(fmt, layout)
    rows = FakeDevice((n, N_KV, D) if n > 1 else (N_KV, D), np.float16)
    state = FakeDevice((2,), np.int32)
    checked, capacity, n_kv, count, dtype = pair_append._check_four_bit(
        kv, rows, rows, state, scales, four, layout)  # fmt: skip
    assert (capacity, n_kv, count, dtype) == (CAP, N_KV, n, np.dtype(np.float16))
    head_rows = CAP if layout == "HND" else 0
    got = pair_append.four_bit_launches(None, checked, capacity, n_kv, count, dtype, four, None,
                                        head_rows)  # fmt: skip
    assert got == "sequence" and launched["kernel"][0] == fmt
    args = launched["args"]
    assert args[-1] == np.int64(head_rows) and args[-1].dtype == np.int64  # (the last argument)
    # before it: q4's 1 / sqrt(head_dim), nvfp4's scales per KV head
    assert isinstance(args[-2], np.float32) == (fmt == "q4")
    assert args[6:8] == (np.int32(N_KV), np.int32(n))


def test_a_head_major_append_is_a_4bit_pairs_alone():
    kv = (FakeDevice((N_KV, CAP, D), np.float16),) * 2
    rows = FakeDevice((N_KV, D), np.float16)
    with pytest.raises(ValueError, match="kv_layout: appends into a 16-bit, 32-bit or fp8 pair"):
        pair_append.append_async_pair(kv, rows, rows, FakeDevice((2,), np.int32), None, None,
                                      kv_layout="HND")  # fmt: skip
    with pytest.raises(ValueError, match="kv_layout: expected 'NHD'"):
        pair_append.append_async_pair(kv, rows, rows, FakeDevice((2,), np.int32), None, None,
                                      kv_layout="NCHW")  # fmt: skip
    hnd, four, _ = _four(layout="HND")
    with pytest.raises(ValueError, match=r"k_rows: expected contiguous \(4, 128\)"):
        pair_append._check_four_bit(hnd, FakeDevice((CAP, D), np.float16),
                                    FakeDevice((CAP, D), np.float16),
                                    FakeDevice((2,), np.int32), None, four, "HND")  # fmt: skip


@pytest.mark.parametrize("n_kv", [1, 2, 8])
def test_a_head_major_4bit_decode_reads_with_the_head_major_bit_but_for_one_kv_head(n_kv):
    stride = CAP * D // 2
    bits, got = records.four_bit_layout(True, n_kv, F_HND, stride)
    # one KV head: head-major bytes are token-major's, read by the token-major kernels
    assert (bits & F_HND, got) == ((0, 0) if n_kv == 1 else (F_HND, stride))
    assert records.four_bit_layout(True, n_kv, 0, 0) == (0, 0)  # token-major stays so
    # other caches keep the bits they came with (a 16-bit head-major pair's F_HND)
    assert records.four_bit_layout(False, n_kv, F_HND, 0) == (F_HND, 0)
