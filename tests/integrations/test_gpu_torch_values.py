"""``torch.ops.ferrox.gqa_decode`` with values of their own width on the GPU (issue 50):
DeepSeek's expanded heads (K 192, V 128, V a ``torch.split`` view of wider rows) and a GQA
shape, against ``reference_gqa_decode(..., head_dim_v=)`` on fresh random inputs, the op's
output allocation poisoned (NaN left in the allocator's block); the LSE; the features; and
a decode layer under torch.compile(fullgraph=True) matching the eager one."""

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


def test_a_seq_len_tensor_is_refused_by_name(gen):
    k, v = _caches(gen, SHAPES[0], 64, "HND", torch.bfloat16)
    q = torch.randn(16, 192, generator=gen, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="seq_len"):
        fxt.gqa_decode(q, k, v, torch.tensor([10], dtype=torch.int32, device="cuda"),
                       kv_layout="HND")  # fmt: skip


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
