"""``torch.ops.ferrox.gqa_decode`` with values of their own width on the GPU (issue 50):
DeepSeek's expanded heads (K 192, V 128, V a ``torch.split`` view of wider rows) and a GQA
shape, against ``reference_gqa_decode(..., head_dim_v=)`` on fresh random inputs, the op's
output allocation poisoned (NaN left in the allocator's block); the LSE; the features; a
``seq_len`` tensor (lengths 0, 1, odd, the rows past it NaN), the op captured first inside
torch.cuda.graph and replayed at every length; and decode layers under
torch.compile(fullgraph=True), over all of K's tokens and over a static buffer and its
length (reduce-overhead: CUDA graphs), matching the eager ones."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ferrox_driver as fd  # noqa: E402
import ferrox_driver.integrations.torch as fxt  # noqa: E402

pytestmark = pytest.mark.gpu

# (n_heads, n_kv_heads, head_dim, head_dim_v): DeepSeek V2/V3 expanded, and GQA
SHAPES = [(16, 16, 192, 128), (32, 8, 256, 128)]
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2}
LSE_TOL = 2e-2


@pytest.fixture
def gen():
    return torch.Generator("cuda").manual_seed(np.random.SeedSequence().entropy % 2**31)


def _poison(shape, dtype):
    """NaN into the caching allocator's next block of this size (the op's output)."""
    torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def _caches(gen, shape, n, layout, dtype):
    """K and V as a torch.split of one buffer of D + DV columns, token-major ("NHD") or
    head-major ("HND", transformers' ``(1, n_kv_heads, n, width)``)."""
    _, n_kv, d, dv = shape
    full = (n, n_kv, d + dv) if layout == "NHD" else (1, n_kv, n, d + dv)
    kv = torch.randn(full, generator=gen, device="cuda", dtype=dtype)
    return kv[..., :d], kv[..., d:]


def _ref(q, k, v, layout, **kw):
    host = [x.float().contiguous().cpu().numpy() for x in (q, k, v)]
    return fd.reference_gqa_decode(*host, head_dim_v=v.shape[-1], kv_layout=layout,
                                   return_lse=True, **kw)  # fmt: skip


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("q_form", ["heads", "sdpa", "three"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_the_op_matches_the_reference(shape, q_form, layout, dtype, gen):
    n_heads, _, d, dv = shape
    q_shape = {"heads": (n_heads, d), "sdpa": (1, n_heads, 1, d), "three": (3, n_heads, d)}
    for n in (3, 17, 777):
        q = torch.randn(q_shape[q_form], generator=gen, device="cuda", dtype=dtype)
        k, v = _caches(gen, shape, n, layout, dtype)
        out_shape = (*q.shape[:-1], dv)
        _poison(out_shape, dtype)
        out, lse = fxt.gqa_decode(q, k, v, kv_layout=layout, return_lse=True, head_dim_v=dv)
        want, want_lse = _ref(q, k, v, layout)
        assert out.shape == out_shape and out.dtype == dtype
        got = out.float().cpu().numpy()
        assert np.isfinite(got).all() and _rel(got, want) < TOL[dtype], (n, _rel(got, want))
        np.testing.assert_allclose(lse.cpu().numpy(), np.reshape(want_lse, lse.shape),
                                   rtol=LSE_TOL, atol=LSE_TOL)  # fmt: skip


@pytest.mark.parametrize("n_q", [1, 3])
@pytest.mark.parametrize(
    "kw",
    [dict(scale=0.02), dict(sliding_window=40), dict(logits_soft_cap=5.0, scale=0.2),
     dict(sinks="bf16"), dict(sliding_window=100, logits_soft_cap=3.0, sinks="bf16", scale=0.05)],
    ids=["scale", "window", "cap", "sinks", "all"],
)  # fmt: skip
def test_every_feature_the_kernels_take_matches_the_reference(kw, n_q, gen):
    shape = SHAPES[0]
    n_heads, _, d, dv = shape
    kw = dict(kw)
    if kw.get("sinks") == "bf16":  # (a model's sinks: the op makes its float32 copy)
        kw["sinks"] = torch.randn(n_heads, generator=gen, device="cuda").to(torch.bfloat16)
    q = torch.randn(n_q, n_heads, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    k, v = _caches(gen, shape, 777, "HND", torch.bfloat16)
    out = fxt.gqa_decode(q, k, v, kv_layout="HND", **kw)
    ref_kw = dict(kw)
    if "sinks" in ref_kw:
        ref_kw["sinks"] = ref_kw["sinks"].float().cpu().numpy()
    want, _ = _ref(q, k, v, "HND", **ref_kw)
    assert out.shape == (n_q, n_heads, dv)
    assert _rel(out.float().cpu().numpy(), want) < TOL[torch.bfloat16]


def _first(t, n, layout):
    return t[:n] if layout == "NHD" else t[:, :, :n]


def _nan_past(kv, n, layout):
    """The buffer's rows from token ``n`` on NaN (reading one would show)."""
    if layout == "NHD":
        kv[n:] = float("nan")
    else:
        kv[:, :, n:] = float("nan")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("n_q", [1, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_a_seq_len_tensor_reads_only_the_tokens_before_it(shape, n_q, layout, gen):
    n_heads, n_kv, d, dv = shape
    cap = 1000
    full = (cap, n_kv, d + dv) if layout == "NHD" else (1, n_kv, cap, d + dv)
    for n in (0, 1, 17, 777, cap) if n_q == 1 else (3, 17, 777, cap):
        clean = torch.randn(full, generator=gen, device="cuda", dtype=torch.bfloat16)
        kv = clean.clone()
        _nan_past(kv, n, layout)
        q_shape = (n_heads, d) if n_q == 1 else (n_q, n_heads, d)
        q = torch.randn(q_shape, generator=gen, device="cuda", dtype=torch.bfloat16)
        seq = torch.tensor([n], dtype=torch.int32, device="cuda")
        _poison((*q_shape[:-1], dv), torch.bfloat16)
        out, lse = fxt.gqa_decode(q, kv[..., :d], kv[..., d:], seq, kv_layout=layout,
                                  return_lse=True)  # fmt: skip
        got = out.float().cpu().numpy()
        if n == 0:
            assert not got.any() and torch.isneginf(lse).all()
            continue
        k, v = _first(clean[..., :d], n, layout), _first(clean[..., d:], n, layout)
        want, want_lse = _ref(q, k, v, layout)
        assert np.isfinite(got).all() and _rel(got, want) < TOL[torch.bfloat16], (n, shape)
        np.testing.assert_allclose(lse.cpu().numpy(), np.reshape(want_lse, lse.shape),
                                   rtol=LSE_TOL, atol=LSE_TOL)  # fmt: skip


def test_the_op_captured_first_inside_a_torch_graph_serves_every_length(gen):
    """The op's first call on a fresh stream inside torch.cuda.graph (its workspace and
    kernels made there, relaxed), with sinks and the LSE; the graph replayed at lengths up
    to the buffer's, its rows past each length NaN: each replay the reference at its
    length."""
    n_heads, n_kv, d, dv, cap = 16, 16, 192, 128, 1200
    clean = torch.randn((1, n_kv, cap, d + dv), generator=gen, device="cuda",
                        dtype=torch.bfloat16)  # fmt: skip
    kv = clean.clone()
    q = torch.randn((2, n_heads, d), generator=gen, device="cuda", dtype=torch.bfloat16)
    sinks = torch.randn(n_heads, generator=gen, device="cuda")
    seq = torch.full((1,), 2, dtype=torch.int32, device="cuda")
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=side):
        out, lse = fxt.gqa_decode(q, kv[..., :d], kv[..., d:], seq, kv_layout="HND",
                                  sinks=sinks, return_lse=True, scale=0.05)  # fmt: skip
    for n in (2, 3, 64, 65, 777, cap, 17):
        kv.copy_(clean)
        _nan_past(kv, n, "HND")
        seq.fill_(n)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        k, v = clean[:, :, :n, :d], clean[:, :, :n, d:]
        want, want_lse = _ref(q, k, v, "HND", sinks=sinks.cpu().numpy(), scale=0.05)
        assert _rel(out.float().cpu().numpy(), want) < TOL[torch.bfloat16], n
        np.testing.assert_allclose(lse.cpu().numpy(), want_lse, rtol=LSE_TOL, atol=LSE_TOL)


class _Layer(torch.nn.Module):
    """A DeepSeek-shaped decode layer: q, one buffer of K and V rows (192 + 128 columns per
    head, split), the decode, o_proj."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.q = torch.nn.Linear(512, 16 * 192, bias=False)
        self.o = torch.nn.Linear(16 * 128, 512, bias=False)
        for lin in (self.q, self.o):
            lin.weight.data = torch.randn(lin.weight.shape, generator=g) * 0.05

    def forward(self, x, kv):
        k, v = kv[..., :192], kv[..., 192:]
        out = fxt.gqa_decode(self.q(x).view(16, 192), k, v, kv_layout="HND", scale=0.07)
        return self.o(out.reshape(1, 16 * 128))


class _StaticLayer(_Layer):
    """The layer over a static buffer of K and V rows and its length on the device."""

    def forward(self, x, kv, seq):
        k, v = kv[..., :192], kv[..., 192:]
        out = fxt.gqa_decode(self.q(x).view(16, 192), k, v, seq, kv_layout="HND", scale=0.07)
        return self.o(out.reshape(1, 16 * 128))


@torch.no_grad()
def test_a_compiled_layer_over_a_static_buffer_matches_the_eager_one(gen):
    """torch.compile(fullgraph=True, mode="reduce-overhead"): the op captured in torch's
    CUDA graphs, the same buffer and length tensor at every step, the length growing: each
    step the eager layer's over the buffer's first n tokens (rows past it NaN)."""
    torch._dynamo.reset()
    layer = _Layer().to(device="cuda", dtype=torch.bfloat16)
    static = _StaticLayer().to(device="cuda", dtype=torch.bfloat16)
    static.load_state_dict(layer.state_dict())
    compiled = torch.compile(static, fullgraph=True, mode="reduce-overhead")
    cap = 512
    clean = torch.randn(1, 16, cap, 320, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv = clean.clone()
    seq = torch.zeros(1, dtype=torch.int32, device="cuda")
    for n in (5, 6, 7, 100, 333, cap):
        x = torch.randn(1, 512, generator=gen, device="cuda", dtype=torch.bfloat16)
        kv.copy_(clean)
        _nan_past(kv, n, "HND")
        seq.fill_(n)
        got = compiled(x, kv, seq).clone()
        want = layer(x, clean[:, :, :n])
        assert torch.isfinite(got).all()
        assert _rel(got.float().cpu(), want.float().cpu()) < 2e-2, n


@torch.no_grad()
def test_a_compiled_decode_layer_matches_the_eager_one(gen):
    torch._dynamo.reset()
    layer = _Layer().to(device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)
    for n in (50, 50, 333):
        x = torch.randn(1, 512, generator=gen, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(1, 16, n, 320, generator=gen, device="cuda", dtype=torch.bfloat16)
        want = layer(x, kv)
        got = compiled(x, kv)
        assert _rel(got.float().cpu(), want.float().cpu()) < 2e-2, n
