"""On the GPU: PyTorch tensors in and out (bf16 included) through the fast path and DLPack,
launch records giving the same bits as the launches they pack, the output pool, and the
KV cache's device length after host appends."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import ferrox_driver as fd
from ferrox_driver.decode import plan as attention
from ferrox_driver.decode import records
from ferrox_driver.experimental import plan_split, split_launches

from ..helpers.gpu_helpers import DTYPES, TOL, poisoned, random_decode_inputs, rel_err

pytestmark = pytest.mark.gpu

KW = {"n_heads": 32, "n_kv_heads": 8, "head_dim": 128}


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


class OnlyDLPack:
    """A tensor seen only through the DLPack protocol (no fast path applies)."""

    def __init__(self, t) -> None:
        self.t = t

    def __dlpack__(self, **kw):
        return self.t.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def _torch_inputs(torch, rng, dtype, seq_len=777):
    q, k, v = random_decode_inputs(rng, 32, 8, 128, seq_len, DTYPES[dtype])
    tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    as_t = [torch.from_numpy(a.astype(np.float32)).to("cuda", tdt) for a in (q, k, v)]
    return (q, k, v), as_t


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("path", ["fast", "dlpack"])
def test_torch_tensors_in_and_a_zero_copy_torch_tensor_out(torch, rng, dtype, path):
    (q, k, v), tensors = _torch_inputs(torch, rng, dtype)
    if path == "dlpack":
        tensors = [OnlyDLPack(t) for t in tensors]
    stream = torch.cuda.current_stream()
    out = fd.gqa_decode(*tensors, **KW, stream=stream)
    assert isinstance(out, fd.DeviceArray) and out.dtype == DTYPES[dtype]
    back = torch.from_dlpack(out)  # zero copy, bf16 too
    assert back.data_ptr() == out.ptr and tuple(back.shape) == q.shape
    got = back.float().cpu().numpy()
    assert rel_err(got, fd.reference_gqa_decode(q, k, v, **KW)) < TOL[dtype]


def test_a_torch_out_is_written_and_a_view_of_it_returned(torch, rng):
    (q, k, v), (qt, kt, vt) = _torch_inputs(torch, rng, "bf16")
    out = torch.full_like(qt, float("nan"))
    got = fd.gqa_decode(qt, kt, vt, **KW, out=out, stream=torch.cuda.current_stream())
    assert got.ptr == out.data_ptr()
    torch.cuda.synchronize()
    ref = fd.reference_gqa_decode(q, k, v, **KW)
    assert rel_err(out.float().cpu().numpy(), ref) < TOL["bf16"]


def test_from_dlpack_views_a_torch_bf16_tensor_and_torch_views_ours(torch, rng):
    t = torch.randn(4, 6, device="cuda", dtype=torch.bfloat16)
    arr = fd.from_dlpack(t)
    assert (arr.ptr, arr.shape, arr.dtype) == (t.data_ptr(), (4, 6), DTYPES["bf16"])
    mine = fd.to_device(rng.standard_normal((3, 5)).astype(DTYPES["bf16"]))
    theirs = torch.from_dlpack(mine)
    assert theirs.data_ptr() == mine.ptr and theirs.dtype == torch.bfloat16
    np.testing.assert_array_equal(theirs.float().cpu().numpy(), mine.to_host().astype(np.float32))


def test_a_strided_torch_tensor_is_refused_naming_it(torch):
    k = torch.randn(16, 8, 128, device="cuda", dtype=torch.float16)
    q = torch.randn(32, 128, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="k_cache: must be C-contiguous"):
        fd.gqa_decode(q, k[::2], k[::2], **KW)
    with pytest.raises(TypeError, match="q: expected a numpy array or a CUDA device array"):
        fd.gqa_decode(q.cpu(), k, k, **KW)


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim,seq_len",
    [(32, 8, 128, 4096), (64, 8, 128, 3001), (16, 2, 64, 512), (8, 1, 256, 20001),
     (12, 3, 80, 1000), (32, 32, 128, 2048)],
)  # fmt: skip
def test_a_record_gives_the_bits_of_the_launches_it_packs(
    rng, dtype, n_heads, n_kv_heads, head_dim, seq_len
):
    dt = DTYPES[dtype]
    kw = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim}
    q, k, v = random_decode_inputs(rng, n_heads, n_kv_heads, head_dim, seq_len, dt)
    qd, kd, vd = fd.to_device(q), fd.to_device(k), fd.to_device(v)
    # (the record of a call is planned for its length's bucket, records.length_bound)
    bound = records.length_bound(seq_len)
    plan = plan_split(fd.Device(0), dt, n_heads, n_kv_heads, head_dim, bound)
    ws = fd.empty(max(plan.workspace_floats(n_heads, head_dim), 1), np.float32)
    direct = poisoned(q.shape, dt)
    for launch in split_launches(
        plan, qd, kd, vd, direct, ws, **kw, seq_len=seq_len, seq_len_dev=None
    ):
        launch.run(None, qd.device)
    recorded = poisoned(q.shape, dt)
    fd.gqa_decode(qd, kd, vd, **kw, out=recorded)
    first, second = direct.to_host(), recorded.to_host()
    assert np.array_equal(first.view(np.uint8), second.view(np.uint8))
    assert rel_err(second, fd.reference_gqa_decode(q, k, v, **kw)) < TOL[dtype]


def test_repeated_calls_reuse_their_record_and_new_pointers_are_used(rng):
    dt = DTYPES["bf16"]
    a = random_decode_inputs(rng, 32, 8, 128, 640, dt)
    b = random_decode_inputs(rng, 32, 8, 128, 640, dt)
    dev_a = [fd.to_device(x) for x in a]
    dev_b = [fd.to_device(x) for x in b]
    fd.gqa_decode(*dev_a, **KW)
    before = len(records.store)
    for inputs, host in ((dev_b, b), (dev_a, a), (dev_b, b)):
        got = fd.gqa_decode(*inputs, **KW).to_host()
        assert rel_err(got, fd.reference_gqa_decode(*host, **KW)) < TOL["bf16"]
    assert len(records.store) == before  # one signature, one record


def test_outputs_come_back_to_the_pool_only_when_dropped(rng):
    dt = DTYPES["f16"]
    inputs = [fd.to_device(x) for x in random_decode_inputs(rng, 32, 8, 128, 300, dt)]
    ref = fd.reference_gqa_decode(*(x.to_host() for x in inputs), **KW)
    first = fd.gqa_decode(*inputs, **KW)
    held = fd.gqa_decode(*inputs, **KW)
    assert held.ptr != first.ptr  # both alive: two blocks
    ptr = first.ptr
    del first
    gc.collect()
    again = fd.gqa_decode(*inputs, **KW)
    assert again.ptr == ptr  # the dropped block, reused on the same stream
    assert rel_err(again.to_host(), ref) < TOL["f16"]
    assert rel_err(held.to_host(), ref) < TOL["f16"]


def test_host_appends_reach_the_device_length_before_device_work(rng):
    dt = DTYPES["bf16"]
    n = 300
    q, k, v = random_decode_inputs(rng, 32, 8, 128, n + 1, dt)
    with fd.KVCache(8, 128, 1024, dtype=dt) as kv:
        for t in range(n):
            kv.append(k[t], v[t])  # host appends: the device's length catches up lazily
        kd, vd = fd.to_device(k[n]), fd.to_device(v[n])
        fd.kv_append_async(kv, kd, vd, stream=kv.stream)
        qd, out = fd.to_device(q), poisoned(q.shape, dt)
        fd.gqa_decode_async(qd, kv, out, n_heads=32, stream=kv.stream)
        assert kv.seq_len == n + 1
        got = out.to_host(kv.stream)
    assert rel_err(got, fd.reference_gqa_decode(q, k, v, **KW)) < TOL["bf16"]


def test_a_graph_of_our_async_ops_sees_host_appends_made_after_its_capture(rng):
    dt = DTYPES["f16"]
    q, k, v = random_decode_inputs(rng, 32, 8, 128, 200, dt)
    with fd.KVCache(8, 128, 512, dtype=dt) as kv, fd.Stream() as s:
        kv.extend(k[:100], v[:100])
        kv.prepare(32)
        qd, out = fd.to_device(q), fd.empty(q.shape, dt)
        fd.gqa_decode_async(qd, kv, out, n_heads=32, stream=s)  # records made outside
        s.synchronize()
        with s.capture() as graph:
            fd.gqa_decode_async(qd, kv, out, n_heads=32, stream=s)
        exe = graph.instantiate()
        graph.close()
        for t in range(100, 200):
            kv.append(k[t], v[t])  # after the capture: each must update the device length
        kv.stream.synchronize()
        out.fill_bytes(0xFF, s)
        exe.launch(s)
        got = out.to_host(s)
        exe.close()
    assert rel_err(got, fd.reference_gqa_decode(q, k, v, **KW)) < TOL["f16"]


def test_overrides_change_the_plan_of_a_repeated_call(rng, monkeypatch):
    dt = DTYPES["bf16"]
    inputs = [fd.to_device(x) for x in random_decode_inputs(rng, 32, 8, 128, 4096, dt)]
    ref = fd.reference_gqa_decode(*(x.to_host() for x in inputs), **KW)
    kernels = set()
    for wide in (True, False):
        monkeypatch.setattr(attention, "OVERRIDES", attention.Overrides(wide=wide))
        assert rel_err(fd.gqa_decode(*inputs, **KW).to_host(), ref) < TOL["bf16"]
        kernels |= {r.kernels for r in records.store.values()}
    assert any("wide" in name for names in kernels for name in names)
    assert any(all("wide" not in name for name in names) for names in kernels)


def test_threads_sharing_one_record_each_get_their_own_result(rng):
    # one signature, so one record and one packed argument block for every thread
    import threading

    dt = DTYPES["bf16"]
    inputs = [random_decode_inputs(rng, 32, 8, 128, 512, dt) for _ in range(8)]
    refs = [fd.reference_gqa_decode(*x, **KW) for x in inputs]
    devs = [[fd.to_device(a) for a in x] for x in inputs]
    errors: list[str] = []
    shared = fd.Stream()  # one stream: one record for every thread

    def worker(i: int) -> None:
        try:  # a thread's exception must fail the test, not just end the thread
            for _ in range(50):
                got = fd.gqa_decode(*devs[i], **KW, stream=shared).to_host(shared)
                if not rel_err(got, refs[i]) < TOL["bf16"]:
                    errors.append(f"thread {i}: {rel_err(got, refs[i])}")
        except Exception as exc:
            errors.append(f"thread {i}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shared.close()
    assert errors == []
