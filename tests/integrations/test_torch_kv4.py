"""4-bit caches in the torch ops without a GPU: the formats decoded in torch bit for bit as
the host helpers do, a decode layer over a 4-bit cache traced with fake tensors to the ops,
the old call forms unchanged, and every bad 4-bit argument named before any device work."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ferrox_driver as fd  # noqa: E402
import ferrox_driver.integrations.torch as fxt  # noqa: E402

H, KV, D, CAP = 8, 2, 128, 32
GROUP = {"int4": 32, "nvfp4": 16}


def _cache(fmt, cap=CAP, d=D):
    """A 4-bit cache's tensors on the CPU: values, block scales, nvfp4's kv_scales."""
    vals = [torch.zeros(cap, KV, d // 2, dtype=torch.uint8) for _ in "kv"]
    sdt = torch.float16 if fmt == "int4" else torch.uint8
    scales = [torch.zeros(cap, KV, d // GROUP[fmt], dtype=sdt) for _ in "kv"]
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


def _layer(fmt):
    def layer(q, kc, vc, k, v, state, ks, vs, kv_scales):
        kw = _kw(fmt, (ks, vs), kv_scales)
        fxt.kv_append(kc, vc, k, v, state, **kw)
        return fxt.gqa_decode(q, kc, vc, state[:1], return_lse=True, **kw)

    return layer


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_a_4bit_decode_layer_traces_with_fake_tensors_to_the_ops(fmt):
    from torch.fx.experimental.proxy_tensor import make_fx

    vals, scales, kv_scales = _cache(fmt)
    args = (torch.randn(H, D, dtype=torch.bfloat16), *vals, torch.randn(KV, D),
            torch.randn(KV, D), torch.zeros(2, dtype=torch.int32), *scales, kv_scales)  # fmt: skip
    graph = make_fx(_layer(fmt), tracing_mode="fake")(*args)
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    names = [str(n.target) for n in calls]
    assert names.index("ferrox.kv_append_4bit.default") < names.index("ferrox.gqa_decode.default")
    decode = calls[names.index("ferrox.gqa_decode.default")]
    assert decode.args[13] == fmt and decode.args[16] is (fmt == "int4")  # (rotate_k resolved)
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


def _decode(fmt, q=None, vals=None, seq=True, **kw):
    v0, scales, kv_scales = _cache(fmt)
    vals = v0 if vals is None else vals
    q = torch.zeros(H, D, dtype=torch.bfloat16) if q is None else q
    state = torch.zeros(1, dtype=torch.int32) if seq else None
    args = {**_kw(fmt, scales, kv_scales), **kw}
    return fxt.gqa_decode(q, vals[0], vals[1], state, **args)


def test_bad_4bit_decode_arguments_are_named_before_any_device_work():
    _, scales, _ = _cache("int4")
    cases = [
        (ValueError, "kv_layout", lambda: _decode("int4", kv_layout="HND")),
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


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_dynamo_traces_a_4bit_decode_layer_whole(fmt):
    """torch.compile(fullgraph=True) of a decode layer over a 4-bit cache: one graph with
    the append and the decode (a backend that keeps the graph and runs nothing: no GPU)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
        fakes = [n.meta["example_value"] for n in outputs]  # (zeros of their shapes)
        return lambda *args: [torch.zeros(f.shape, dtype=f.dtype) for f in fakes]

    vals, scales, kv_scales = _cache(fmt)
    args = (torch.randn(H, D, dtype=torch.bfloat16), *vals, torch.randn(KV, D),
            torch.randn(KV, D), torch.zeros(2, dtype=torch.int32), *scales, kv_scales)  # fmt: skip
    torch._dynamo.reset()
    torch.compile(_layer(fmt), backend=keep, fullgraph=True)(*args)
    (graph,) = graphs
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.index("ferrox.kv_append_4bit") < targets.index("ferrox.gqa_decode")
