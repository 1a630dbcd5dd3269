"""A growing cache on the GPU: ``gqa_decode`` over the first n tokens of a larger cache, n
one longer each call (and at random lengths), token-major (``k[:n]``) and head-major
(``k[:, :n]``, and contiguous (n_kv, n, D) arrays whose head stride is n * D), with and
without features. A call planned for its length's bucket must decode exactly its own n
tokens: each checkpoint against the float64 reference, with a fresh q (so a stale output or
LSE cannot pass), outputs poisoned, and the tokens past n NaN (so reading one fails). The
records and device memory must not grow with the number of lengths."""

from __future__ import annotations

import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.decode import eager, records
from ferrox_driver.decode import plan as attention

from ..helpers.gpu_helpers import DTYPES, TOL, poisoned, rel_err

pytestmark = pytest.mark.gpu

H, KV, D = 32, 8, 128
DIMS = {"n_heads": H, "n_kv_heads": KV, "head_dim": D}
BF16 = DTYPES["bf16"]
LSE_TOL = 1e-3


class Cache:
    """K or V of ``cap`` tokens on the device, NaN until written, token-major
    ``(cap, KV, D)`` or head-major ``(KV, cap, D)``; ``first(n)`` is the view of the first
    n tokens that gqa_decode reads in place."""

    def __init__(self, cap: int, layout: str):
        self.cap, self.layout = cap, layout
        self.buf = fd.empty((cap * KV * D,), BF16)
        self.buf.fill_bytes(0xFF)

    def write(self, t: int, rows: np.ndarray) -> None:
        """Tokens t, t + 1, ... from ``rows`` (n, KV, D)."""
        n, size = len(rows), np.dtype(BF16).itemsize
        if self.layout == "NHD":
            self.buf.view((n, KV, D), offset=t * KV * D * size).copy_from_host(rows)
            return
        for h in range(KV):
            at = (h * self.cap + t) * D * size
            self.buf.view((n, D), offset=at).copy_from_host(np.ascontiguousarray(rows[:, h]))

    def first(self, n: int):
        if self.layout == "NHD":
            return self.buf.view((n, KV, D))
        # (bf16 has no CUDA-array-interface type: the strided view is PyTorch's, by DLPack)
        torch = pytest.importorskip("torch")
        if not hasattr(self, "_torch"):
            self._torch = torch.from_dlpack(self.buf)
        return self._torch.as_strided((KV, n, D), (self.cap * D, D, 1))


def features(rng, which: str) -> dict:
    """Device per-head arrays (the cached path reads their pointers at each call)."""
    if which == "none":
        return {}
    if which == "window+cap+sinks+lse":
        sinks = fd.to_device(rng.standard_normal(H).astype(np.float32))
        return {"sliding_window": 1500, "logits_soft_cap": 30.0, "sinks": sinks,
                "return_lse": True}  # fmt: skip
    assert which == "alibi+scale+lse"
    slopes = fd.to_device((2.0 ** -np.arange(1, H + 1) * 4).astype(np.float32))
    return {"alibi_slopes": slopes, "scale": 0.05, "return_lse": True}


def reference(q, k, v, kw: dict):
    host = {a: (b.to_host() if isinstance(b, fd.DeviceArray) else b) for a, b in kw.items()}
    got = fd.reference_gqa_decode(q, k, v, **DIMS, **host)
    return got if kw.get("return_lse") else (got, None)


def check(got, out, ref, ref_lse, what) -> None:
    """``got`` (gqa_decode's result written into ``out``) against the reference."""
    lse = None
    if isinstance(got, tuple):
        got, lse = got
    assert got.ptr == out.ptr, what
    host = out.to_host().astype(np.float64)
    assert rel_err(host, ref) < TOL["bf16"], (what, rel_err(host, ref))
    if ref_lse is not None:
        np.testing.assert_allclose(lse.to_host(), ref_lse, rtol=LSE_TOL, atol=LSE_TOL,
                                   err_msg=str(what))  # fmt: skip


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("which", ["none", "window+cap+sinks+lse", "alibi+scale+lse"])
def test_a_cache_grown_by_a_token_each_call_decodes_its_own_length(rng, layout, which):
    """300 calls from 3900 tokens (three buckets: 3840-3967, 3968-4095, 4096-4351), a token
    written before each; checkpoints at the buckets' edges, the first and last lengths and
    random ones in between."""
    n0, steps, cap = 3900, 300, 4400
    k = rng.standard_normal((cap, KV, D)).astype(BF16)
    v = rng.standard_normal((cap, KV, D)).astype(BF16)
    kc, vc = Cache(cap, layout), Cache(cap, layout)
    kc.write(0, k[: n0 - 1])
    vc.write(0, v[: n0 - 1])
    kw = features(rng, which)
    qd = fd.empty((H, D), BF16)
    lengths = range(n0, n0 + steps)
    checkpoints = {n0, n0 + 1, 3967, 3968, 3969, 4095, 4096, 4097, n0 + steps - 1}
    checkpoints |= set(rng.choice(lengths, 12, replace=False).tolist())
    for n in lengths:
        kc.write(n - 1, k[n - 1 : n])
        vc.write(n - 1, v[n - 1 : n])
        q = rng.standard_normal((H, D)).astype(BF16)
        qd.copy_from_host(q)
        if n not in checkpoints:
            fd.gqa_decode(qd, kc.first(n), vc.first(n), **DIMS, kv_layout=layout, **kw)
            continue
        out = poisoned((H, D), BF16)
        got = fd.gqa_decode(qd, kc.first(n), vc.first(n), **DIMS, out=out, kv_layout=layout,
                            **kw)  # fmt: skip
        check(got, out, *reference(q, k[:n], v[:n], kw), n)


def test_contiguous_head_major_arrays_of_one_bucket_each_give_their_head_stride(rng):
    """(KV, n, D) arrays: KV heads n * D elements apart, a new stride at every n, yet one
    record for the bucket (4096-4351)."""
    k = rng.standard_normal((4351, KV, D)).astype(BF16)
    v = rng.standard_normal((4351, KV, D)).astype(BF16)
    kw = features(rng, "window+cap+sinks+lse")
    made = None
    for n in (4096, 4097, 4100, 4200, 4351):
        kd = fd.to_device(np.ascontiguousarray(k[:n].transpose(1, 0, 2)))
        vd = fd.to_device(np.ascontiguousarray(v[:n].transpose(1, 0, 2)))
        q = rng.standard_normal((H, D)).astype(BF16)
        out = poisoned((H, D), BF16)
        got = fd.gqa_decode(fd.to_device(q), kd, vd, **DIMS, out=out, kv_layout="HND", **kw)
        check(got, out, *reference(q, k[:n], v[:n], kw), n)
        keys = set(records.store)
        made = keys if made is None else made
        assert keys == made, n  # no record past the bucket's first length


def test_new_per_head_arrays_of_a_repeated_call_are_read(rng):
    """Sinks are a pointer the call writes: two arrays of the same shape, alternated."""
    n = 3000
    k = rng.standard_normal((n, KV, D)).astype(BF16)
    v = rng.standard_normal((n, KV, D)).astype(BF16)
    kd, vd = fd.to_device(k), fd.to_device(v)
    sinks = [rng.standard_normal(H).astype(np.float32) * 4 for _ in range(2)]
    sinks_d = [fd.to_device(s) for s in sinks]
    for i in (0, 1, 0, 1):
        q = rng.standard_normal((H, D)).astype(BF16)
        out = poisoned((H, D), BF16)
        kw = {"sinks": sinks_d[i], "return_lse": True}
        got = fd.gqa_decode(fd.to_device(q), kd, vd, **DIMS, out=out, **kw)
        check(got, out, *reference(q, k, v, {"sinks": sinks[i], "return_lse": True}), i)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("which", ["none", "window+cap+sinks+lse"])
def test_random_lengths_each_decode_their_own_tokens(rng, layout, which):
    """Lengths up to 8192 in random order (a record reused for a shorter length after a
    longer one of its bucket); the token just past n is NaN during each call."""
    cap = 8193
    k = rng.standard_normal((cap, KV, D)).astype(BF16)
    v = rng.standard_normal((cap, KV, D)).astype(BF16)
    kc, vc = Cache(cap, layout), Cache(cap, layout)
    kc.write(0, k)
    vc.write(0, v)
    nan_row = np.full((1, KV, D), np.nan, BF16)
    kw = features(rng, which)
    lengths = rng.integers(1, 8193, 40).tolist()
    lengths += [lengths[0] | 127, lengths[0] & ~127 | 1, 8192, 1]  # (a bucket's ends)
    for n in lengths:
        kc.write(n, nan_row)
        vc.write(n, nan_row)
        q = rng.standard_normal((H, D)).astype(BF16)
        out = poisoned((H, D), BF16)
        got = fd.gqa_decode(fd.to_device(q), kc.first(n), vc.first(n), **DIMS, out=out,
                            kv_layout=layout, **kw)  # fmt: skip
        check(got, out, *reference(q, k[:n], v[:n], kw), n)
        kc.write(n, k[n : n + 1])
        vc.write(n, v[n : n + 1])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("which", ["none", "window+cap+sinks+lse"])
def test_lengths_0_and_1_in_one_bucket(rng, layout, which):
    """0, 1 and 7 share the bucket 0-7: zeros (LSE -inf, or the sink's logit), then the
    token itself."""
    cap = 16
    k = rng.standard_normal((cap, KV, D)).astype(BF16)
    v = rng.standard_normal((cap, KV, D)).astype(BF16)
    kc, vc = Cache(cap, layout), Cache(cap, layout)
    kc.write(0, k)
    vc.write(0, v)
    kw = features(rng, which)
    for n in (1, 0, 1, 7, 0, 5):
        q = rng.standard_normal((H, D)).astype(BF16)
        out = poisoned((H, D), BF16)
        got = fd.gqa_decode(fd.to_device(q), kc.first(n), vc.first(n), **DIMS, out=out,
                            kv_layout=layout, **kw)  # fmt: skip
        ref, ref_lse = reference(q, k[:n], v[:n], kw)
        if n == 0:
            host = out.to_host().astype(np.float64)
            assert not host.any() and not np.isnan(host).any(), n
            if ref_lse is not None:
                np.testing.assert_allclose(got[1].to_host(), ref_lse, rtol=LSE_TOL)
            continue
        check(got, out, ref, ref_lse, n)


@pytest.mark.parametrize("cluster", [True, False])  # (off: every plan writes scratch)
@pytest.mark.parametrize(
    "layout,which", [("NHD", "none"), ("HND", "none"), ("HND", "window+cap+sinks+lse")]
)
def test_records_and_device_memory_do_not_grow_with_the_number_of_lengths(
    rng, monkeypatch, cluster, layout, which
):
    """Two passes over every length of 1..4095 in random order: the first makes one record
    and one call per bucket (96 buckets), the second none, and device memory stays put."""
    monkeypatch.setattr(attention, "OVERRIDES", attention.Overrides(cluster=cluster))
    monkeypatch.setattr(records, "store", records.Kept(records.MAX_RECORDS))
    monkeypatch.setattr(eager, "_calls", records.Kept(eager.MAX_CALLS))
    monkeypatch.setattr(eager, "_families", records.Kept(eager.MAX_CALLS))
    cap = 4096
    k = rng.standard_normal((cap, KV, D)).astype(BF16)
    kc, vc = Cache(cap, layout), Cache(cap, layout)
    kc.write(0, k)
    vc.write(0, k)
    qd = fd.to_device(rng.standard_normal((H, D)).astype(BF16))
    order = rng.permutation(np.arange(1, cap)).tolist()  # (results dropped: pool blocks)
    kw = features(rng, which)
    kw.pop("return_lse", None)  # (its blocks come from a pool: in flight, they would count)
    buckets = len({records.length_bound(n) for n in range(1, cap)})
    assert buckets == 96  # 1-255: 32 of 8 tokens; 256-4095: 4 octaves of 16
    device = fd.Device(0)
    free = []
    out = fd.empty((H, D), BF16)  # (pool blocks in flight would count as growth)
    for p in range(2):
        for n in order if p == 0 else order[::-1]:
            fd.gqa_decode(qd, kc.first(n), vc.first(n), **DIMS, kv_layout=layout, out=out, **kw)
        device.synchronize()
        free.append(device.mem_info()[0])
        if p == 0:
            made, calls = set(records.store), set(eager._calls)
            assert 0 < len(made) <= buckets and len(calls) <= 2 * buckets  # (2: alignment)
    assert set(records.store) == made and set(eager._calls) == calls
    assert free[1] == free[0]


def test_torch_views_of_a_growing_cache_are_read_in_place(rng):
    """The issue's case: torch bf16 ``k[:n]`` of a (cap, KV, D) tensor and ``k[:, :n]`` of a
    (KV, cap, D) one, n growing, results as tensors on torch's stream."""
    torch = pytest.importorskip("torch")
    assert torch.cuda.is_available(), "these tests need a CUDA build of PyTorch"
    cap, n0 = 2200, 2000
    k = rng.standard_normal((cap, KV, D)).astype(np.float32)
    v = rng.standard_normal((cap, KV, D)).astype(np.float32)
    kt = torch.from_numpy(k).to("cuda", torch.bfloat16)
    vt = torch.from_numpy(v).to("cuda", torch.bfloat16)
    k_hnd, v_hnd = kt.transpose(0, 1).contiguous(), vt.transpose(0, 1).contiguous()
    kb, vb = kt.float().cpu().numpy().astype(BF16), vt.float().cpu().numpy().astype(BF16)
    for n in range(n0, cap):
        q = torch.randn((H, D), device="cuda").to(torch.bfloat16)
        nhd = fd.gqa_decode(q, kt[:n], vt[:n])
        hnd, lse = fd.gqa_decode(q, k_hnd[:, :n], v_hnd[:, :n], kv_layout="HND",
                                 return_lse=True)  # fmt: skip
        if n % 37 and n != cap - 1:
            continue
        qh = q.float().cpu().numpy().astype(BF16)
        ref, ref_lse = fd.reference_gqa_decode(qh, kb[:n], vb[:n], **DIMS, return_lse=True)
        for got in (nhd, hnd):
            host = torch.from_dlpack(got).double().cpu().numpy()
            assert rel_err(host, ref) < TOL["bf16"], n
        np.testing.assert_allclose(torch.from_dlpack(lse).cpu().numpy(), ref_lse,
                                   rtol=LSE_TOL, atol=LSE_TOL)  # fmt: skip


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_the_buckets_of_one_plan_share_one_record(rng, monkeypatch, layout):
    """Lengths 4096..6143 span 8 buckets whose plans the planner may make equal (the chunks
    are cut on the device): one record and one validated call per distinct plan, not per
    bucket, and each length still decodes its own tokens."""
    from ferrox_driver.decode.launches import plan_split
    from ferrox_driver.kernels import abi

    monkeypatch.setattr(records, "store", records.Kept(records.MAX_RECORDS))
    monkeypatch.setattr(eager, "_calls", records.Kept(eager.MAX_CALLS))
    monkeypatch.setattr(eager, "_families", records.Kept(eager.MAX_CALLS))
    cap = 6144
    k, v = (rng.standard_normal((cap, KV, D)).astype(BF16) for _ in "kv")
    kc, vc = Cache(cap, layout), Cache(cap, layout)
    kc.write(0, k)
    vc.write(0, v)
    lengths = range(4096, cap)
    bits = abi.F_HND if layout == "HND" else 0
    dev = fd.Device(0)
    plans = {plan_split(dev, BF16, H, KV, D, records.length_bound(n), True, bits) for n in lengths}
    buckets = {records.length_bound(n) for n in lengths}
    assert len(buckets) == 8
    out = fd.empty((H, D), BF16)
    q0 = fd.to_device(np.zeros((H, D), BF16))
    for n in lengths:
        fd.gqa_decode(q0, kc.first(n), vc.first(n), **DIMS, kv_layout=layout, out=out)
    assert len(records.store) == len(plans) < len(buckets)
    # ... and one validated call: a bucket of a plan seen before takes that bucket's call
    assert len(eager._calls) == len(buckets)
    assert len({id(call) for call in eager._calls.values()}) == len(plans)
    for n in (4096, 5000, 6143):
        q = rng.standard_normal((H, D)).astype(BF16)
        out.fill_bytes(0xFF)
        fd.gqa_decode(fd.to_device(q), kc.first(n), vc.first(n), **DIMS, kv_layout=layout,
                      out=out)  # fmt: skip
        want = fd.reference_gqa_decode(q, k[:n], v[:n], **DIMS)
        assert rel_err(out.to_host(), want) < TOL["bf16"], n
