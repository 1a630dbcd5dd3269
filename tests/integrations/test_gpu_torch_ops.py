"""ferrox_driver.integrations.torch on the GPU: the custom ops against the float64
reference (fresh random inputs, outputs poisoned by the op's own allocation being NaN-filled
where it can be), appends checked byte for byte, and torch.compile tracing a decode layer
with no graph break, fullgraph and reduce-overhead (CUDA graphs) alike."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ferrox_driver as fd  # noqa: E402
import ferrox_driver.integrations.torch as fxt  # noqa: E402

pytestmark = pytest.mark.gpu

H, KV, D = 16, 4, 128


def _ref(q, k, v, n, layout="NHD", **kw):
    """float64 reference over the first n tokens (numpy), k/v torch in ``layout``."""
    if layout == "HND":
        k = k.reshape(KV, -1, D).transpose(0, 1).contiguous()
        v = v.reshape(KV, -1, D).transpose(0, 1).contiguous()
    qn, kn, vn = (x.float().cpu().numpy() for x in (q, k[:n], v[:n]))
    return fd.reference_gqa_decode(qn.reshape(H, D), kn, vn, n_heads=H, n_kv_heads=KV,
                                   head_dim=D, **kw)  # fmt: skip


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture
def gen():
    return torch.Generator("cuda").manual_seed(np.random.SeedSequence().entropy % 2**31)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("n", [0, 1, 77, 1000])
def test_decode_op_reads_the_first_seq_len_tokens(layout, n, gen):
    cap = 1024
    shape = (cap, KV, D) if layout == "NHD" else (1, KV, cap, D)
    k, v = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    q = torch.randn(H, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    seq = torch.tensor([n], dtype=torch.int32, device="cuda")
    out, lse = fxt.gqa_decode(q, k, v, seq, kv_layout=layout, return_lse=True)
    torch.cuda.synchronize()
    if n == 0:
        assert torch.all(out == 0)
        return
    want, want_lse = _ref(q, k, v, n, layout, return_lse=True)
    assert _rel(out.float().cpu(), want) < 1e-2
    assert np.allclose(lse.cpu().numpy(), want_lse, atol=1e-3)


def test_decode_op_with_every_feature_and_bf16_sinks(gen):
    cap, n = 2048, 1500
    k, v = (torch.randn(cap, KV, D, generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in "kv")  # fmt: skip
    q = torch.randn(H, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    sinks = torch.randn(H, generator=gen, device="cuda").to(torch.bfloat16)
    slopes = torch.rand(H, generator=gen, device="cuda") * 0.01
    seq = torch.tensor([n], dtype=torch.int32, device="cuda")
    kw = dict(sliding_window=300, logits_soft_cap=20.0, scale=0.1)
    out = fxt.gqa_decode(q, k, v, seq, sinks=sinks, alibi_slopes=slopes, **kw)
    want = _ref(q, k, v, n, sinks=sinks.float().cpu().numpy(), alibi_slopes=slopes.cpu().numpy(),
                **kw)  # fmt: skip
    assert _rel(out.float().cpu(), want) < 1e-2


def test_fp8_pair_append_then_decode(gen):
    cap, n0 = 512, 300
    kc = torch.zeros(cap, KV, D, dtype=torch.float8_e4m3fn, device="cuda")
    vc = torch.zeros_like(kc)
    scales = torch.tensor([[0.05] * KV, [0.03] * KV], device="cuda")
    state = fxt.new_state("cuda")
    rows = [torch.randn(n0, KV, D, generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in "kv"]  # fmt: skip
    fxt.kv_append(kc, vc, rows[0], rows[1], state, kv_scales=scales)
    one = [torch.randn(KV, D, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in "kv"]
    fxt.kv_append(kc, vc, one[0], one[1], state, kv_scales=scales)
    torch.cuda.synchronize()
    assert state.tolist() == [n0 + 1, 0]
    sc = scales.cpu().numpy()
    for i, (cache, new) in enumerate(((kc, (rows[0], one[0])), (vc, (rows[1], one[1])))):
        want = fd.quantize_fp8(torch.cat([new[0], new[1][None]]).float().cpu().numpy(),
                               "float8_e4m3fn", sc[i])  # fmt: skip
        got = cache[: n0 + 1].view(torch.uint8).cpu().numpy()
        assert np.array_equal(got, want.view(np.uint8)), i
        assert torch.all(cache[n0 + 1 :].view(torch.uint8) == 0)
    q = torch.randn(H, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    out = fxt.gqa_decode(q, kc, vc, state[:1], kv_scales=scales)
    kq = kc[: n0 + 1].float() * scales[0].view(1, KV, 1)
    vq = vc[: n0 + 1].float() * scales[1].view(1, KV, 1)
    want = fd.reference_gqa_decode(
        q.float().cpu().numpy(),
        kq.cpu().numpy(),
        vq.cpu().numpy(),
        n_heads=H,
        n_kv_heads=KV,
        head_dim=D,
    )
    assert _rel(out.float().cpu(), want) < 1e-2


def test_bf16_append_of_several_rows_and_the_overflow_flag(gen):
    cap = 100
    kc = torch.zeros(cap, KV, D, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    state = fxt.new_state("cuda", 10)
    k, v = (torch.randn(37, KV, D, generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in "kv")  # fmt: skip
    fxt.kv_append(kc, vc, k, v, state)
    fxt.kv_append(kc, vc, k[0], v[0], state)
    torch.cuda.synchronize()
    assert state.tolist() == [48, 0]
    assert torch.equal(kc[10:47], k) and torch.equal(vc[47], v[0])
    assert torch.all(kc[:10] == 0) and torch.all(kc[48:] == 0)
    fxt.kv_append(kc, vc, torch.cat([k, k]), torch.cat([v, v]), state)  # 74 rows: past 100
    torch.cuda.synchronize()
    assert state.tolist() == [48, 1]  # nothing written, nothing counted, the flag set
    assert torch.all(kc[48:] == 0)


def test_merge_op_is_the_decode_of_the_whole(gen):
    n = 900
    k, v = (torch.randn(n, KV, D, generator=gen, device="cuda", dtype=torch.bfloat16)
            for _ in "kv")  # fmt: skip
    q = torch.randn(H, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    parts = [(0, 300), (300, 900)]
    outs, lses = [], []
    for a, b in parts:
        seq = torch.tensor([b - a], dtype=torch.int32, device="cuda")
        o, s = fxt.gqa_decode(q, k[a:b].contiguous(), v[a:b].contiguous(), seq, return_lse=True)
        outs.append(o)
        lses.append(s)
    out, lse = fxt.merge_states(torch.stack(outs), torch.stack(lses))
    want, want_lse = _ref(q, k, v, n, return_lse=True)
    assert _rel(out.float().cpu(), want) < 1e-2
    assert np.allclose(lse.cpu().numpy(), want_lse, atol=1e-3)


def test_eager_op_form_decodes_every_token(gen):
    for n in (5, 333, 334):
        k, v = (torch.randn(n, KV, D, generator=gen, device="cuda", dtype=torch.bfloat16)
                for _ in "kv")  # fmt: skip
        q = torch.randn(H, D, generator=gen, device="cuda", dtype=torch.bfloat16)
        out, lse = fxt.gqa_decode(q, k, v, return_lse=True)
        want, want_lse = _ref(q, k, v, n, return_lse=True)
        assert _rel(out.float().cpu(), want) < 1e-2
        assert np.allclose(lse.cpu().numpy(), want_lse, atol=1e-3)


def test_bad_arguments_are_named():
    q = torch.zeros(H, D, dtype=torch.bfloat16, device="cuda")
    k = torch.zeros(64, KV, D, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="kv_layout"):
        fxt.gqa_decode(q, k, k, None, kv_layout="XYZ")
    with pytest.raises(ValueError, match="n_heads"):
        fxt.gqa_decode(q, k, k, None, n_heads=3)
    with pytest.raises(TypeError, match="kv_scales"):
        fxt.gqa_decode(q, k.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn),
                       fxt.new_state()[:1])  # fmt: skip
    with pytest.raises(ValueError, match="state"):
        fxt.kv_append(k, k, q[:KV], q[:KV], torch.zeros(2, dtype=torch.int64, device="cuda"))


class _Layer(torch.nn.Module):
    """A decode layer: projections, an append into an NHD cache, the decode, o_proj."""

    def __init__(self, cap):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        w = 4 * D
        self.q = torch.nn.Linear(w, H * D, bias=False)
        self.k = torch.nn.Linear(w, KV * D, bias=False)
        self.v = torch.nn.Linear(w, KV * D, bias=False)
        self.o = torch.nn.Linear(H * D, w, bias=False)
        for lin in (self.q, self.k, self.v, self.o):
            lin.weight.data = torch.randn(lin.weight.shape, generator=g) * 0.05
        self.register_buffer("kc", torch.zeros(cap, KV, D))
        self.register_buffer("vc", torch.zeros(cap, KV, D))
        self.register_buffer("state", torch.zeros(2, dtype=torch.int32))

    def forward(self, x):
        fxt.kv_append(self.kc, self.vc, self.k(x).view(KV, D), self.v(x).view(KV, D), self.state)
        out = fxt.gqa_decode(self.q(x).view(H, D), self.kc, self.vc, self.state[:1])
        return self.o(out.reshape(1, H * D))


def _fresh_layer(cap=256):
    layer = _Layer(cap).to(device="cuda", dtype=torch.bfloat16)
    layer.state.copy_(torch.tensor([50, 0], dtype=torch.int32))
    g = torch.Generator("cuda").manual_seed(9)
    layer.kc.copy_(torch.randn(layer.kc.shape, generator=g, device="cuda"))
    layer.vc.copy_(torch.randn(layer.vc.shape, generator=g, device="cuda"))
    return layer


@torch.no_grad()
def test_dynamo_traces_a_decode_layer_with_no_graph_break():
    layer = _fresh_layer()
    x = torch.randn(1, 4 * D, device="cuda", dtype=torch.bfloat16)
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@torch.no_grad()
def test_a_compiled_decode_layer_matches_the_eager_one_step_after_step(mode):
    torch._dynamo.reset()
    eager, compiled_layer = _fresh_layer(), _fresh_layer()
    compiled = torch.compile(compiled_layer, fullgraph=True, mode=mode)
    g = torch.Generator("cuda").manual_seed(11)
    for step in range(12):
        x = torch.randn(1, 4 * D, device="cuda", dtype=torch.bfloat16, generator=g)
        want = eager(x)
        got = compiled(x).clone()
        assert _rel(got.float().cpu(), want.float().cpu()) < 2e-2, step
    torch.cuda.synchronize()
    assert eager.state.tolist() == compiled_layer.state.tolist() == [62, 0]
    assert torch.equal(eager.kc, compiled_layer.kc)


def test_a_gradient_through_the_decode_is_refused_clearly():
    q = torch.randn(H, D, device="cuda", requires_grad=True)
    k = torch.randn(64, KV, D, device="cuda")
    out = fxt.gqa_decode(q, k, k, torch.tensor([64], dtype=torch.int32, device="cuda"))
    with pytest.raises(RuntimeError, match="no gradient"):
        out.sum().backward()
