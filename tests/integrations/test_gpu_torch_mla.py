"""torch.ops.ferrox.mla_decode on the GPU (issue 50): against fd.reference_mla_decode on
fresh random inputs (the op's own allocations poisoned: the caching allocator's blocks of
its outputs' sizes NaN-filled before each call), bf16 and fp8 latents, 16 and 128 heads, one
query and two, lengths 0, 1 and odd; a LatentCache's storage read through DLPack, and its
append_async + decode_async in a torch.cuda.graph; a bf16 layer that fills its latent in
torch and calls the op, compiled with fullgraph and reduce-overhead (CUDA graphs), against
the eager one step after step."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ferrox_driver as fd  # noqa: E402
import ferrox_driver.integrations.torch_mla as fxm  # noqa: E402

pytestmark = pytest.mark.gpu

DK, DV = 576, 512
BF16 = ml_dtypes.bfloat16
FP8_SCALE = 1.0 / 16
TOL, FP8_TOL, LSE_TOL = 1e-2, 2e-2, 2e-2


@pytest.fixture
def gen():
    return torch.Generator("cuda").manual_seed(np.random.SeedSequence().entropy % 2**31)


def _poison_allocator(*shapes_dtypes):
    """NaN-fill blocks of the sizes the op will ask for, then give them back: the caching
    allocator hands them out again, so an element the op leaves unwritten reads NaN."""
    held = [torch.full(shape, float("nan"), dtype=dt, device="cuda") for shape, dt in shapes_dtypes]
    torch.cuda.synchronize()
    del held


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert not np.isnan(a).any(), "NaN in output (unwritten or poisoned element)"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _latent(gen, capacity, fp8):
    """A latent cache tensor and what it holds as float64 (an fp8 one's values in units of
    FP8_SCALE: byte * scale is the value)."""
    rows = torch.randn(capacity, DK, generator=gen, device="cuda")
    if fp8:
        latent = (rows / FP8_SCALE).to(torch.float8_e4m3fn)
        return latent, latent.float().cpu().numpy().astype(np.float64) * FP8_SCALE
    latent = rows.to(torch.bfloat16)
    return latent, latent.float().cpu().numpy().astype(np.float64)


def _queries(gen, n_q, n_heads):
    shape = (n_heads, DK) if n_q == 1 else (n_q, n_heads, DK)
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)


def _reference(q, values, n, **kw):
    return fd.reference_mla_decode(q.float().cpu().numpy(), values[:n], return_lse=True, **kw)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("n_heads", [16, 128])
@pytest.mark.parametrize("n_q", [1, 2])
def test_the_op_reads_the_first_seq_len_rows(gen, fp8, n_heads, n_q):
    latent, values = _latent(gen, 1000, fp8)
    scale = {"kv_scale": FP8_SCALE} if fp8 else {}
    for n in sorted({n_q, n_q + 1, 77, 999}):
        q = _queries(gen, n_q, n_heads)
        seq = torch.tensor([n], dtype=torch.int32, device="cuda")
        _poison_allocator(((*q.shape[:-1], DV), q.dtype), (q.shape[:-1], torch.float32))
        out, lse = fxm.mla_decode(q, latent, seq, return_lse=True, **scale)
        torch.cuda.synchronize()
        assert out.shape == (*q.shape[:-1], DV) and out.dtype == q.dtype
        ref, ref_lse = _reference(q, values, n)
        assert _rel(out.float().cpu(), ref) < (FP8_TOL if fp8 else TOL), n
        np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, rtol=LSE_TOL, atol=LSE_TOL)


def test_no_rows_give_zeros_and_a_seq_len_of_none_reads_every_row(gen):
    latent, values = _latent(gen, 300, False)
    q = _queries(gen, 1, 32)
    _poison_allocator(((32, DV), q.dtype), ((32,), torch.float32))
    out, lse = fxm.mla_decode(q, latent, torch.zeros(1, dtype=torch.int32, device="cuda"),
                              return_lse=True)  # fmt: skip
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    _poison_allocator(((32, DV), q.dtype))
    every = fxm.mla_decode(q, latent)
    assert _rel(every.float().cpu(), _reference(q, values, 300)[0]) < TOL


def test_every_feature_with_bf16_sinks_and_a_device_scale(gen):
    latent, values = _latent(gen, 800, True)
    q = _queries(gen, 2, 64)
    sinks = torch.randn(64, generator=gen, device="cuda").to(torch.bfloat16)
    kv_scale = torch.tensor([FP8_SCALE], dtype=torch.float32, device="cuda")
    kw = dict(sliding_window=100, logits_soft_cap=3.0, scale=0.05)
    seq = torch.tensor([701], dtype=torch.int32, device="cuda")
    _poison_allocator(((2, 64, DV), q.dtype), ((2, 64), torch.float32))
    out, lse = fxm.mla_decode(q, latent, seq, kv_scale=kv_scale, sinks=sinks, return_lse=True,
                              **kw)  # fmt: skip
    ref, ref_lse = _reference(q, values, 701, sinks=sinks.float().cpu().numpy(), **kw)
    assert _rel(out.float().cpu(), ref) < FP8_TOL
    np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, rtol=LSE_TOL, atol=LSE_TOL)


def test_a_latent_caches_storage_decodes_as_the_cache_does(gen):
    rng = np.random.default_rng()
    rows = rng.standard_normal((130, DK)).astype(BF16)
    with fd.LatentCache(256) as cache:
        cache.append(rows)
        cache.synchronize()
        latent = torch.from_dlpack(cache.latent_buffer)
        seq = torch.from_dlpack(cache.length)
        assert latent.shape == (256, DK) and latent.dtype == torch.bfloat16
        q = _queries(gen, 2, 16)
        out = fxm.mla_decode(q, latent, seq)
        want = cache.decode(q).to_host()
        torch.cuda.synchronize()
        assert _rel(out.float().cpu(), want.astype(np.float64)) < 1e-3
        assert _rel(out.float().cpu(), _reference(q, rows.astype(np.float64), 130)[0]) < TOL


class _MlaLayer(torch.nn.Module):
    """A DeepSeek-shaped decode step: the latent row and the absorbed q from the hidden
    state, the row written into the latent at the length (torch ops), the length bumped,
    the MLA op over it, an output projection."""

    def __init__(self, cap, n_heads=16):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        w = 1024
        self.n_heads = n_heads
        self.kv = torch.nn.Linear(w, DK, bias=False)
        self.q = torch.nn.Linear(w, n_heads * DK, bias=False)
        self.o = torch.nn.Linear(n_heads * DV, w, bias=False)
        for lin in (self.kv, self.q, self.o):
            lin.weight.data = torch.randn(lin.weight.shape, generator=g) * 0.03
        self.register_buffer("latent", torch.zeros(cap, DK))
        self.register_buffer("seq", torch.zeros(1, dtype=torch.int32))

    def forward(self, x):
        self.latent.index_copy_(0, self.seq.long(), self.kv(x).view(1, DK))
        self.seq.add_(1)
        out = fxm.mla_decode(self.q(x).view(self.n_heads, DK), self.latent, self.seq)
        return self.o(out.reshape(1, self.n_heads * DV))


def _fresh_layer(cap=256):
    layer = _MlaLayer(cap).to(device="cuda", dtype=torch.bfloat16)
    g = torch.Generator("cuda").manual_seed(9)
    layer.latent.copy_(torch.randn(cap, DK, generator=g, device="cuda"))
    layer.seq.fill_(50)
    return layer


@torch.no_grad()
def test_dynamo_traces_an_mla_layer_with_no_graph_break():
    layer = _fresh_layer()
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@torch.no_grad()
def test_a_compiled_mla_layer_matches_the_eager_one_step_after_step(mode):
    torch._dynamo.reset()
    eager, compiled_layer = _fresh_layer(), _fresh_layer()
    compiled = torch.compile(compiled_layer, fullgraph=True, mode=mode)
    g = torch.Generator("cuda").manual_seed(11)
    for step in range(12):
        x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
        want = eager(x)
        got = compiled(x).clone()
        assert _rel(got.float().cpu(), want.float().cpu()) < 2e-2, step
    torch.cuda.synchronize()
    assert eager.seq.tolist() == compiled_layer.seq.tolist() == [62]
    assert torch.equal(eager.latent, compiled_layer.latent)


@torch.no_grad()
def test_a_torch_graph_of_a_latent_caches_append_and_decode_serves_every_step(gen):
    """append_async and decode_async captured in a torch.cuda.graph on its side stream:
    each replay appends the row at the device's length and decodes over it."""
    rng = np.random.default_rng()
    rows = rng.standard_normal((60, DK)).astype(BF16)
    with fd.LatentCache(64) as cache:
        cache.append(rows[:50])
        cache.synchronize()
        row_t = torch.zeros(DK, dtype=torch.bfloat16, device="cuda")
        q_t = torch.zeros(16, DK, dtype=torch.bfloat16, device="cuda")
        out_t = torch.zeros(16, DV, dtype=torch.bfloat16, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cache.append_async(row_t, stream=None)  # (torch's current stream: the capture's)
            cache.decode_async(q_t, out_t, stream=None)
        for t in range(50, 58):
            row_t.copy_(torch.from_numpy(rows[t].view(np.int16)).view(torch.bfloat16))
            q = _queries(gen, 1, 16)
            q_t.copy_(q)
            out_t.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            ref = _reference(q, rows.astype(np.float64), t + 1)[0]
            assert _rel(out_t.float().cpu(), ref) < TOL, t
        assert cache.seq_len == 58


def test_a_gradient_through_the_op_is_refused_clearly(gen):
    latent, _ = _latent(gen, 64, False)
    q = torch.randn(16, DK, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = fxm.mla_decode(q, latent, torch.tensor([64], dtype=torch.int32, device="cuda"))
    with pytest.raises(RuntimeError, match="no gradient"):
        out.float().sum().backward()


def test_cuda_arguments_are_checked_by_name(gen):
    latent, _ = _latent(gen, 64, False)
    q = _queries(gen, 1, 16)
    seq = torch.tensor([10], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="kv_scale: only for an fp8 latent"):
        fxm.mla_decode(q, latent, seq, kv_scale=0.5)
    with pytest.raises(ValueError, match="seq_len"):
        fxm.mla_decode(q, latent, torch.tensor([65], dtype=torch.int32, device="cuda")[:0])
    with pytest.raises(ValueError, match="latent: expected a C-contiguous"):
        fxm.mla_decode(q, torch.zeros(DK, 64, dtype=torch.bfloat16, device="cuda").t(), seq)
    with pytest.raises(ValueError, match="q: 2 query tokens"):
        fxm.mla_decode(_queries(gen, 2, 16), latent[:1])
