"""4-bit caches in the torch ops without a GPU: the formats decoded in torch bit for bit as
the host helpers do (token-major and head-major), a decode layer over a 4-bit cache of
either layout traced with fake tensors to the ops, the old call forms unchanged, and every
bad 4-bit argument named before any device work."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ferrox_driver as fd  # noqa: E402
import ferrox_driver.integrations.torch as fxt  # noqa: E402

H, KV, D, CAP = 8, 2, 128, 32
GROUP = {"int4": 32, "nvfp4": 16}


def _cache(fmt, cap=CAP, d=D, layout="NHD"):
    """A 4-bit cache's tensors on the CPU: values, block scales, nvfp4's kv_scales; rows
    token-major ("NHD", (cap, KV, ...)) or head-major ("HND", (KV, cap, ...))."""
    lead = (KV, cap) if layout == "HND" else (cap, KV)
    vals = [torch.zeros(*lead, d // 2, dtype=torch.uint8) for _ in "kv"]
    sdt = torch.float16 if fmt == "int4" else torch.uint8
    scales = [torch.zeros(*lead, d // GROUP[fmt], dtype=sdt) for _ in "kv"]
    kv_scales = torch.ones(2, KV) if fmt == "nvfp4" else None
    return vals, scales, kv_scales


def _kw(fmt, scales, kv_scales, **extra):
    return dict(kv_format=fmt, k_block_scales=scales[0], v_block_scales=scales[1],
                kv_scales=kv_scales, **extra)  # fmt: skip


def test_hadamard_is_the_host_helpers_bit_for_bit(rng):
    for d in (64, 128, 256, 96):
        x = rng.standard_normal((5, KV, d)).astype(np.float32) * 3
        got = fxt.hadamard(torch.from_numpy(x)).numpy()
        assert np.array_equal(got, fd.hadamard(x)), d


@pytest.mark.parametrize("rotated", [False, True])
def test_int4_dequantize_is_the_host_helpers_bit_for_bit(rotated, rng):
    x = rng.standard_normal((7, KV, D)).astype(np.float32)
    x[..., 3] *= 40  # an outlier channel
    vals, scales = fd.quantize_int4(fd.hadamard(x) if rotated else x)
    want = fd.dequantize_int4(vals, scales)
    want = fd.hadamard(want) if rotated else want
    got = fxt.dequantize_4bit(torch.from_numpy(vals), torch.from_numpy(scales), "int4",
                              rotated=rotated)  # fmt: skip
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy(), want)


def test_nvfp4_dequantize_is_the_host_helpers_bit_for_bit(rng):
    x = rng.standard_normal((7, KV, D)).astype(np.float32) * rng.uniform(0.1, 20, (1, KV, 1))
    vals, blocks, g = fd.quantize_nvfp4(x.astype(np.float32))
    want = fd.dequantize_nvfp4(vals, blocks, g)
    raw = torch.from_numpy(blocks.view(np.uint8))
    for scales in (raw, raw.view(torch.float8_e4m3fn)):  # e4m3 bytes as uint8 or float8
        got = fxt.dequantize_4bit(torch.from_numpy(vals), scales, "nvfp4",
                                  global_scale=torch.from_numpy(g))  # fmt: skip
        assert np.array_equal(got.numpy(), want)
    with pytest.raises(ValueError, match="global_scale"):
        fxt.dequantize_4bit(torch.from_numpy(vals), raw, "nvfp4")


def test_dequantize_names_its_bad_arguments():
    vals = torch.zeros(3, KV, D // 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="kv_format"):
        fxt.dequantize_4bit(vals, torch.zeros(3, KV, 4, dtype=torch.float16), "int8")
    with pytest.raises(ValueError, match="block_scales"):
        fxt.dequantize_4bit(vals, torch.zeros(3, KV, 8, dtype=torch.float16), "int4")
    with pytest.raises(TypeError, match="block_scales"):
        fxt.dequantize_4bit(vals, torch.zeros(3, KV, 4, dtype=torch.float32), "int4")
    with pytest.raises(ValueError, match="values"):
        fxt.dequantize_4bit(vals.float(), torch.zeros(3, KV, 4, dtype=torch.float16), "int4")


def _layer(fmt, layout="NHD"):
    def layer(q, kc, vc, k, v, state, ks, vs, kv_scales):
        kw = _kw(fmt, (ks, vs), kv_scales, kv_layout=layout)
        fxt.kv_append(kc, vc, k, v, state, **kw)
        return fxt.gqa_decode(q, kc, vc, state[:1], return_lse=True, **kw)

    return layer


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_a_4bit_decode_layer_traces_with_fake_tensors_to_the_ops(fmt, layout):
    from torch.fx.experimental.proxy_tensor import make_fx

    vals, scales, kv_scales = _cache(fmt, layout=layout)
    args = (torch.randn(H, D, dtype=torch.bfloat16), *vals, torch.randn(KV, D),
            torch.randn(KV, D), torch.zeros(2, dtype=torch.int32), *scales, kv_scales)  # fmt: skip
    graph = make_fx(_layer(fmt, layout), tracing_mode="fake")(*args)
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    names = [str(n.target) for n in calls]
    assert names.index("ferrox.kv_append_4bit.default") < names.index("ferrox.gqa_decode.default")
    append = calls[names.index("ferrox.kv_append_4bit.default")]
    # the layout reaches the append op (the trace leaves out a default: "NHD")
    assert (*append.args[10:], "NHD")[0] == layout
    decode = calls[names.index("ferrox.gqa_decode.default")]
    assert decode.args[13] == fmt and decode.args[16] is (fmt == "int4")  # (rotate_k resolved)
    assert decode.args[7] == layout
    out, lse = decode.meta["val"]
    assert tuple(out.shape) == (H, D) and out.dtype == torch.bfloat16
    assert tuple(lse.shape) == (H,)


def test_the_old_call_forms_keep_their_schemas_positions():
    schema = torch.ops.ferrox.gqa_decode.default._schema
    names = [a.name for a in schema.arguments]
    assert names[:13] == ["q", "k_cache", "v_cache", "seq_len", "kv_scales", "sinks",
                          "alibi_slopes", "kv_layout", "scale", "logits_soft_cap",
                          "sliding_window", "return_lse", "tree_mask"]  # fmt: skip
    assert names[13:] == ["kv_format", "k_block_scales", "v_block_scales", "rotate_k"]
    assert all(a.has_default_value() for a in schema.arguments[12:])
    append = [a.name for a in torch.ops.ferrox.kv_append.default._schema.arguments]
    assert append == ["k_cache", "v_cache", "k", "v", "state", "kv_scales"]
    four = torch.ops.ferrox.kv_append_4bit.default._schema.arguments
    assert [a.name for a in four] == ["k_cache", "v_cache", "k", "v", "state", "k_block_scales",
                                      "v_block_scales", "kv_scales", "kv_format", "rotate_k",
                                      "kv_layout"]  # fmt: skip
    assert four[-1].has_default_value()  # (the calls without kv_layout: token-major)


def _decode(fmt, q=None, vals=None, seq=True, layout="NHD", **kw):
    v0, scales, kv_scales = _cache(fmt, layout=layout)
    vals = v0 if vals is None else vals
    q = torch.zeros(H, D, dtype=torch.bfloat16) if q is None else q
    state = torch.zeros(1, dtype=torch.int32) if seq else None
    args = {**_kw(fmt, scales, kv_scales), **kw}
    return fxt.gqa_decode(q, vals[0], vals[1], state, kv_layout=layout, **args)


def test_bad_4bit_decode_arguments_are_named_before_any_device_work():
    _, scales, _ = _cache("int4")
    cases = [
        (ValueError, "kv_layout", lambda: _decode("int4", layout="NCHW")),
        (ValueError, "kv_format", lambda: _decode("int4", kv_format="int8")),
        (ValueError, "k_block_scales", lambda: _decode("int4", k_block_scales=None)),
        (ValueError, "v_block_scales", lambda: _decode("int4", v_block_scales=scales[1].float())),
        (ValueError, "k_block_scales", lambda: _decode("nvfp4", k_block_scales=scales[0])),
        (TypeError, "kv_scales", lambda: _decode("int4", kv_scales=torch.ones(2, KV))),
        (TypeError, "kv_scales", lambda: _decode("nvfp4", kv_scales=None)),
        (ValueError, "kv_scales", lambda: _decode("nvfp4", kv_scales=torch.ones(2, KV + 1))),
        (TypeError, "rotate_k", lambda: _decode("int4", rotate_k="yes")),
        (ValueError, "seq_len", lambda: _decode("int4", seq=False)),
        (TypeError, "q: expected float16 or bfloat16",
         lambda: _decode("int4", q=torch.zeros(H, D))),
        (ValueError, "v_cache", lambda: _decode("int4", vals=(_cache("int4")[0][0],
                                                             torch.zeros(CAP, KV, D // 2)))),
        (ValueError, "k_cache: .*head_dim 64, 128 or 256",
         lambda: _decode("int4", vals=_cache("int4", d=96)[0])),
        (ValueError, "k_cache: .*uint8",
         lambda: _decode("int4", vals=[torch.zeros(CAP, KV, D)] * 2)),
        (ValueError, "n_heads", lambda: _decode("int4", n_heads=3)),
    ]  # fmt: skip
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_a_head_major_4bit_cache_is_checked_in_its_own_shapes(fmt):
    from ferrox_driver.integrations.torch_kv4 import check_rows, four_bit_args

    vals, scales, kv_scales = _cache(fmt, layout="HND")
    four = four_bit_args(fmt, *vals, *scales, kv_scales, "HND", None)
    assert four is not None and four.k_scales is scales[0] and four.v_scales is scales[1]
    rows = torch.zeros(5, KV, D)
    check_rows(rows, rows, vals[0], "HND")  # (token rows, whatever the cache's layout)
    with pytest.raises(ValueError, match="k: expected"):
        check_rows(torch.zeros(5, CAP, D), torch.zeros(5, CAP, D), vals[0], "HND")
    # all good but on the CPU: the ops say so (the device work they would do)
    q, seq = torch.zeros(H, D, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int32)
    kw = _kw(fmt, scales, kv_scales, kv_layout="HND")
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        fxt.gqa_decode(q, *vals, seq, n_kv_heads=KV, **kw)
    with pytest.raises(ValueError, match="k_cache: expected a CUDA tensor"):
        fxt.kv_append(*vals, rows, rows, fxt.new_state("cpu"), **kw)


def test_bad_head_major_4bit_arguments_are_named_with_the_shape_they_need():
    nhd, hnd = _cache("int4"), _cache("int4", layout="HND")
    want = f"\\({KV}, {CAP}, {D // 32}\\) \\(kv_layout 'HND'"
    cases = [
        # token-major block scales with head-major values
        (ValueError, f"k_block_scales: .*{want}",
         lambda: _decode("int4", layout="HND", k_block_scales=nhd[1][0])),
        (ValueError, f"v_block_scales: .*{want}",
         lambda: _decode("int4", layout="HND", v_block_scales=nhd[1][1])),
        (ValueError, "v_cache: expected k_cache's shape",
         lambda: _decode("int4", layout="HND", vals=(hnd[0][0], hnd[0][1][:, :-1]))),
        (ValueError, "k_cache: .*\\(n_kv_heads, capacity, head_dim // 2\\), head-major",
         lambda: _decode("int4", layout="HND", vals=[torch.zeros(1, KV, CAP, D // 2,
                                                                 dtype=torch.uint8)] * 2)),
        (ValueError, "k_cache: .*strided",
         lambda: _decode("int4", layout="HND", vals=[v.transpose(0, 1) for v in nhd[0]])),
        (ValueError, "k_cache: .*head_dim 64, 128 or 256",
         lambda: _decode("int4", layout="HND", vals=_cache("int4", d=96, layout="HND")[0])),
        (ValueError, "n_kv_heads",
         lambda: _decode("int4", layout="HND", n_kv_heads=CAP)),
    ]  # fmt: skip
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()
    vals, scales, kv_scales = _cache("nvfp4", layout="HND")
    rows = torch.zeros(KV, D, dtype=torch.bfloat16)
    kw = _kw("nvfp4", scales, kv_scales, kv_layout="HND")
    with pytest.raises(ValueError, match=f"k_block_scales: .*\\({KV}, {CAP}, {D // 16}\\)"):
        fxt.kv_append(*vals, rows, rows, fxt.new_state("cpu"),
                      **{**kw, "k_block_scales": scales[0][:, :4]})  # fmt: skip
    with pytest.raises(ValueError, match="k: expected"):
        fxt.kv_append(*vals, torch.zeros(CAP, D), torch.zeros(CAP, D), fxt.new_state("cpu"), **kw)
    bf16 = torch.zeros(KV, CAP, D, dtype=torch.bfloat16)  # (a head-major append: 4-bit only)
    with pytest.raises(ValueError, match="kv_layout: appends into a cache of"):
        fxt.kv_append(bf16, bf16, rows, rows, fxt.new_state("cpu"), kv_layout="HND")


@pytest.mark.parametrize("rotated", [False, True])
def test_head_major_dequantize_is_the_token_major_one_transposed(rotated, rng):
    x = rng.standard_normal((7, KV, D)).astype(np.float32) * rng.uniform(0.1, 20, (1, KV, 1))
    vals, scales = fd.quantize_int4(x)
    nv_vals, blocks, g = fd.quantize_nvfp4(x)
    cases = (
        ("int4", torch.from_numpy(vals), torch.from_numpy(scales), None),
        ("nvfp4", torch.from_numpy(nv_vals), torch.from_numpy(blocks.view(np.uint8)),
         torch.from_numpy(g)),
    )  # fmt: skip
    for fmt, v, s, gs in cases:
        want = fxt.dequantize_4bit(v, s, fmt, global_scale=gs, rotated=rotated)
        got = fxt.dequantize_4bit(v.transpose(0, 1).contiguous(), s.transpose(0, 1).contiguous(),
                                  fmt, global_scale=gs, rotated=rotated,
                                  kv_layout="HND")  # fmt: skip
        assert tuple(got.shape) == (KV, 7, D)
        assert torch.equal(got, want.transpose(0, 1)), fmt
    with pytest.raises(ValueError, match="values: expected uint8 \\(n_kv_heads, n"):
        fxt.dequantize_4bit(torch.from_numpy(vals)[None], torch.from_numpy(scales)[None], "int4",
                            kv_layout="HND")  # fmt: skip
    with pytest.raises(ValueError, match="kv_layout"):
        fxt.dequantize_4bit(torch.from_numpy(vals), torch.from_numpy(scales), "int4",
                            kv_layout="NCHW")  # fmt: skip


def test_4bit_arguments_without_a_4bit_format_are_named():
    vals, scales, _ = _cache("int4")
    q, seq = torch.zeros(H, D, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(TypeError, match="k_cache: uint8 is a 4-bit cache's values"):
        fxt.gqa_decode(q, vals[0], vals[1], seq)
    with pytest.raises(ValueError, match="k_block_scales: only for a 4-bit cache"):
        bf16 = torch.zeros(CAP, KV, D, dtype=torch.bfloat16)
        fxt.gqa_decode(q, bf16, bf16, seq, k_block_scales=scales[0])
    with pytest.raises(ValueError, match="rotate_k: only for a 4-bit cache"):
        fxt.kv_append(bf16, bf16, q[:KV], q[:KV], fxt.new_state("cpu"), rotate_k=True)


def test_bad_4bit_append_arguments_are_named_before_any_device_work():
    vals, scales, kv_scales = _cache("nvfp4")
    state = fxt.new_state("cpu")
    rows = torch.zeros(KV, D, dtype=torch.bfloat16)
    kw = _kw("nvfp4", scales, kv_scales)
    with pytest.raises(ValueError, match="k: expected"):
        fxt.kv_append(*vals, torch.zeros(KV, D // 2), torch.zeros(KV, D // 2), state, **kw)
    with pytest.raises(TypeError, match="k: expected float32, float16 or bfloat16"):
        fxt.kv_append(*vals, rows.to(torch.int32), rows.to(torch.int32), state, **kw)
    with pytest.raises(ValueError, match="v: expected"):
        fxt.kv_append(*vals, rows, rows.float(), state, **kw)
    with pytest.raises(TypeError, match="kv_scales"):
        fxt.kv_append(*vals, rows, rows, state, **{**kw, "kv_scales": None})
    with pytest.raises(ValueError, match="k_block_scales"):
        fxt.kv_append(*vals, rows, rows, state, **{**kw, "k_block_scales": scales[0][:4]})
    # all good but on the CPU: the op says so (the device work it would do)
    with pytest.raises(ValueError, match="k_cache: expected a CUDA tensor"):
        fxt.kv_append(*vals, rows, rows, state, **kw)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_dynamo_traces_a_4bit_decode_layer_whole(fmt, layout):
    """torch.compile(fullgraph=True) of a decode layer over a 4-bit cache: one graph with
    the append and the decode (a backend that keeps the graph and runs nothing: no GPU)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
        fakes = [n.meta["example_value"] for n in outputs]  # (zeros of their shapes)
        return lambda *args: [torch.zeros(f.shape, dtype=f.dtype) for f in fakes]

    vals, scales, kv_scales = _cache(fmt, layout=layout)
    args = (torch.randn(H, D, dtype=torch.bfloat16), *vals, torch.randn(KV, D),
            torch.randn(KV, D), torch.zeros(2, dtype=torch.int32), *scales, kv_scales)  # fmt: skip
    torch._dynamo.reset()
    torch.compile(_layer(fmt, layout), backend=keep, fullgraph=True)(*args)
    (graph,) = graphs
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.index("ferrox.kv_append_4bit") < targets.index("ferrox.gqa_decode")
