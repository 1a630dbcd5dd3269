"""The torch ops over 4-bit caches on the GPU, token-major and head-major (kv_layout "HND",
a 4-bit KVCache's layout): what kv_append stores is what the public numpy helpers compute,
bit for bit (K rotated first where asked), one row and several; gqa_decode matches the
float64 reference on the dequantized cache (fresh random inputs; the caches poisoned past
the tokens written); the overflow flag; a decode layer over a 4-bit cache compiled
(fullgraph, reduce-overhead) agrees with the eager one."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ferrox_driver as fd  # noqa: E402
import ferrox_driver.integrations.torch as fxt  # noqa: E402

pytestmark = pytest.mark.gpu

H, KV = 16, 4
GROUP = {"int4": 32, "nvfp4": 16}
# the 4-bit KVCache tests' tolerances (tests/cache/test_gpu_kv4_cache.py): a rotated q is
# rounded to 16 bits after its rotation
TOL, LSE_ATOL = 2e-2, 3e-2
CASES = [("int4", None), ("int4", False), ("nvfp4", None), ("nvfp4", True)]
LAYOUTS = ["NHD", "HND"]


@pytest.fixture
def gen():
    return torch.Generator("cuda").manual_seed(np.random.SeedSequence().entropy % 2**31)


class Cache:
    """A 4-bit cache's tensors, token-major ("NHD", (cap, KV, ...)) or head-major ("HND",
    (KV, cap, ...)), the values and block scales poisoned (0xFF bytes)."""

    def __init__(self, fmt, rotate, cap, d, k_scale=0.02, v_scale=0.005, layout="NHD"):
        self.fmt, self.d, self.cap, self.layout = fmt, d, cap, layout
        self.rotate = (fmt == "int4") if rotate is None else rotate
        lead = (KV, cap) if layout == "HND" else (cap, KV)
        self.kc = torch.full((*lead, d // 2), 0xFF, dtype=torch.uint8, device="cuda")
        self.vc = torch.full_like(self.kc, 0xFF)
        per = (*lead, d // GROUP[fmt])
        raw = [torch.full(per, 0xFF, dtype=torch.uint8, device="cuda") for _ in "kv"]
        if fmt == "int4":  # float16 scales, poisoned as NaN bytes
            raw = [torch.full((*per[:2], 2 * per[2]), 0xFF, dtype=torch.uint8, device="cuda")
                   for _ in "kv"]  # fmt: skip
            raw = [r.view(torch.float16) for r in raw]
        self.ks, self.vs = raw
        self.kv_scales = (
            torch.tensor([[k_scale] * KV, [v_scale] * KV], device="cuda")
            if fmt == "nvfp4" else None
        )  # fmt: skip
        self.state = fxt.new_state("cuda")

    def kw(self):
        return dict(kv_format=self.fmt, k_block_scales=self.ks, v_block_scales=self.vs,
                    kv_scales=self.kv_scales, rotate_k=None if self.rotate == (
                        self.fmt == "int4") else self.rotate, kv_layout=self.layout)  # fmt: skip

    def tokens(self, t, start, stop=None):
        """Tokens ``start:stop`` of one of the cache's tensors, token-major ``(n, KV, ...)``
        whatever its layout."""
        if self.layout == "HND":
            return t[:, start:stop].transpose(0, 1)
        return t[start:stop]

    def append(self, k, v):
        fxt.kv_append(self.kc, self.vc, k, v, self.state, **self.kw())

    def expected(self, k, v):
        """(values, block scales) of K and V as the public helpers compute them."""
        kf, vf = (x.float().cpu().numpy() for x in (k, v))
        if self.rotate:
            kf = fd.hadamard(kf)
        if self.fmt == "int4":
            return fd.quantize_int4(kf), fd.quantize_int4(vf)
        sc = self.kv_scales.cpu().numpy()
        return fd.quantize_nvfp4(kf, sc[0])[:2], fd.quantize_nvfp4(vf, sc[1])[:2]

    def dequantized(self, n):
        """K and V of the first n tokens as float32 numpy, K's rotation undone."""
        got = []
        for i, (vals, scales) in enumerate(((self.kc, self.ks), (self.vc, self.vs))):
            vals = self.tokens(vals, 0, n).contiguous().cpu().numpy()
            scales = self.tokens(scales, 0, n).contiguous().cpu().numpy()
            if self.fmt == "int4":
                x = fd.dequantize_int4(vals, scales)
            else:
                blocks = scales.view(ml_dtypes.float8_e4m3fn)
                x = fd.dequantize_nvfp4(vals, blocks, self.kv_scales[i].cpu().numpy())
            got.append(fd.hadamard(x) if i == 0 and self.rotate else x)
        return got


def _same_bytes(got, want):
    np.testing.assert_array_equal(got.cpu().contiguous().view(torch.uint8).numpy(),
                                  np.asarray(want).view(np.uint8))  # fmt: skip


def _rows(gen, n, d, dtype=torch.bfloat16):
    k = torch.randn(n, KV, d, generator=gen, device="cuda") * 2
    k[:, :, 5] *= 30  # an outlier channel, as real models' K have
    v = torch.randn(n, KV, d, generator=gen, device="cuda")
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt,rotate", CASES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("rows_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_append_stores_what_the_helpers_compute(fmt, rotate, d, rows_dtype, layout, gen):
    cache = Cache(fmt, rotate, 64, d, layout=layout)
    k, v = _rows(gen, 21, d, rows_dtype)
    cache.append(k[:8], v[:8])  # several rows, then one at a time
    for t in range(8, 21):
        cache.append(k[t], v[t])
    torch.cuda.synchronize()
    assert cache.state.tolist() == [21, 0]
    (kw, ksw), (vw, vsw) = cache.expected(k, v)
    _same_bytes(cache.tokens(cache.kc, 0, 21), kw)
    _same_bytes(cache.tokens(cache.vc, 0, 21), vw)
    _same_bytes(cache.tokens(cache.ks, 0, 21), ksw)
    _same_bytes(cache.tokens(cache.vs, 0, 21), vsw)
    for t in (cache.kc, cache.vc, cache.ks.view(torch.uint8), cache.vs.view(torch.uint8)):
        assert torch.all(cache.tokens(t, 21) == 0xFF)  # nothing written past the tokens


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt,rotate", CASES)
@pytest.mark.parametrize("d,n_heads", [(64, 16), (128, 32), (256, 8)])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_decode_matches_the_reference_on_the_dequantized_cache(fmt, rotate, d, n_heads,
                                                               q_dtype, layout, gen):  # fmt: skip
    cache = Cache(fmt, rotate, 4096, d, layout=layout)
    done = 0
    for n in (1, 77, 1500):
        k, v = _rows(gen, n - done, d)
        cache.append(k, v)
        done = n
        q = torch.randn(n_heads, d, generator=gen, device="cuda").to(q_dtype)
        out, lse = fxt.gqa_decode(q, cache.kc, cache.vc, cache.state[:1], return_lse=True,
                                  **cache.kw())  # fmt: skip
        torch.cuda.synchronize()
        kq, vq = cache.dequantized(n)
        want, want_lse = fd.reference_gqa_decode(
            q.float().cpu().numpy(), kq, vq, n_heads=n_heads, n_kv_heads=KV, head_dim=d,
            return_lse=True,
        )  # fmt: skip
        got = out.float().cpu().numpy()
        assert np.isfinite(got).all()
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err < TOL, (n, err)
        assert np.allclose(lse.cpu().numpy(), want_lse, atol=LSE_ATOL), n


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt,rotate", [("int4", None), ("nvfp4", None)])
def test_decode_with_features_and_a_window(fmt, rotate, layout, gen):
    d, n = 128, 1200
    cache = Cache(fmt, rotate, 2048, d, layout=layout)
    k, v = _rows(gen, n, d)
    cache.append(k, v)
    q = torch.randn(H, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    sinks = torch.randn(H, generator=gen, device="cuda")
    kw = dict(sliding_window=300, logits_soft_cap=20.0, scale=0.05)
    out = fxt.gqa_decode(q, cache.kc, cache.vc, cache.state[:1], sinks=sinks, **kw,
                         **cache.kw())  # fmt: skip
    kq, vq = cache.dequantized(n)
    want = fd.reference_gqa_decode(q.float().cpu().numpy(), kq, vq, n_heads=H, n_kv_heads=KV,
                                   head_dim=d, sinks=sinks.cpu().numpy(), **kw)  # fmt: skip
    got = out.float().cpu().numpy()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < TOL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_append_past_the_capacity_writes_nothing_and_sets_the_flag(layout, gen):
    cache = Cache("int4", None, 10, 128, layout=layout)
    k, v = _rows(gen, 8, 128)
    cache.append(k, v)
    before = cache.kc.clone(), cache.ks.clone()
    cache.append(k[:3], v[:3])  # 8 + 3 > 10
    torch.cuda.synchronize()
    assert cache.state.tolist() == [8, 1]
    assert torch.equal(cache.kc, before[0])
    assert torch.equal(cache.ks.view(torch.uint8), before[1].view(torch.uint8))


def test_a_head_major_4bit_cache_with_token_major_block_scales_is_refused_by_name():
    cache, nhd = Cache("int4", None, 16, 128, layout="HND"), Cache("int4", None, 16, 128)
    q = torch.zeros(H, 128, dtype=torch.bfloat16, device="cuda")
    kw = {**cache.kw(), "k_block_scales": nhd.ks}
    with pytest.raises(ValueError, match=r"k_block_scales: .*\(4, 16, 4\) \(kv_layout 'HND'"):
        fxt.gqa_decode(q, cache.kc, cache.vc, cache.state[:1], **kw)
    rows = torch.zeros(KV, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="k_block_scales"):
        fxt.kv_append(cache.kc, cache.vc, rows, rows, cache.state, **kw)


class _Layer(torch.nn.Module):
    """A decode layer over a 4-bit cache of ``layout``: projections, the quantizing append,
    the decode."""

    def __init__(self, fmt, cap, d=128, layout="NHD"):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        w, self.fmt, self.d, self.layout = 4 * d, fmt, d, layout
        lead = (KV, cap) if layout == "HND" else (cap, KV)
        self.q = torch.nn.Linear(w, H * d, bias=False)
        self.k = torch.nn.Linear(w, KV * d, bias=False)
        self.v = torch.nn.Linear(w, KV * d, bias=False)
        self.o = torch.nn.Linear(H * d, w, bias=False)
        for lin in (self.q, self.k, self.v, self.o):
            lin.weight.data = torch.randn(lin.weight.shape, generator=g) * 0.05
        self.register_buffer("kc", torch.zeros(*lead, d // 2, dtype=torch.uint8))
        self.register_buffer("vc", torch.zeros(*lead, d // 2, dtype=torch.uint8))
        sdt = torch.float16 if fmt == "int4" else torch.uint8
        self.register_buffer("ks", torch.zeros(*lead, d // GROUP[fmt], dtype=sdt))
        self.register_buffer("vs", torch.zeros(*lead, d // GROUP[fmt], dtype=sdt))
        self.register_buffer("scales", torch.full((2, KV), 0.01) if fmt == "nvfp4" else None)
        self.register_buffer("state", torch.zeros(2, dtype=torch.int32))

    def forward(self, x):
        kw = dict(kv_format=self.fmt, k_block_scales=self.ks, v_block_scales=self.vs,
                  kv_scales=self.scales, kv_layout=self.layout)  # fmt: skip
        fxt.kv_append(self.kc, self.vc, self.k(x).view(KV, self.d), self.v(x).view(KV, self.d),
                      self.state, **kw)  # fmt: skip
        out = fxt.gqa_decode(self.q(x).view(H, self.d), self.kc, self.vc, self.state[:1], **kw)
        return self.o(out.reshape(1, H * self.d))


def _fresh_layer(fmt, cap=256, layout="NHD"):
    layer = _Layer(fmt, cap, layout=layout).to(device="cuda")
    for lin in (layer.q, layer.k, layer.v, layer.o):
        lin.to(torch.bfloat16)
    x = torch.randn(50, KV, 128, generator=torch.Generator("cuda").manual_seed(9), device="cuda")
    kw = dict(kv_format=fmt, k_block_scales=layer.ks, v_block_scales=layer.vs,
              kv_scales=layer.scales, kv_layout=layout)  # fmt: skip
    fxt.kv_append(layer.kc, layer.vc, x, x * 0.5, layer.state, **kw)
    return layer


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
@torch.no_grad()
def test_dynamo_traces_a_4bit_decode_layer_with_no_graph_break(fmt, layout):
    layer = _fresh_layer(fmt, layout=layout)
    x = torch.randn(1, 4 * 128, device="cuda", dtype=torch.bfloat16)
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
@torch.no_grad()
def test_a_compiled_4bit_decode_layer_matches_the_eager_one_step_after_step(fmt, mode, layout):
    torch._dynamo.reset()
    eager, compiled_layer = _fresh_layer(fmt, layout=layout), _fresh_layer(fmt, layout=layout)
    compiled = torch.compile(compiled_layer, fullgraph=True, mode=mode)
    g = torch.Generator("cuda").manual_seed(11)
    for step in range(12):
        x = torch.randn(1, 4 * 128, device="cuda", dtype=torch.bfloat16, generator=g)
        want = eager(x)
        got = compiled(x).clone()
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 2e-2, (step, err)
    torch.cuda.synchronize()
    assert eager.state.tolist() == compiled_layer.state.tolist() == [62, 0]
    assert torch.equal(eager.kc, compiled_layer.kc)
    assert torch.equal(eager.ks.view(torch.uint8), compiled_layer.ks.view(torch.uint8))
