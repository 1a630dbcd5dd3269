"""``torch.ops.ferrox.gqa_decode`` with values of their own width, without a GPU: a
``v_cache`` whose rows are not K's width gives an output ``q.shape[:-1] + (DV,)`` (the
fake implementation too, so a decode layer traces to it and compiles whole), over a
``seq_len`` tensor as over all of K's tokens, and what its kernels cannot do is refused by
name before any device work."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import ferrox_driver.integrations.torch as fxt  # noqa: E402

H, KV, D, DV = 16, 16, 192, 128
BF16 = dict(dtype=torch.bfloat16)


def _caches(n=40, layout="HND", dv=DV, d=D, **kw):
    """K and V (a torch.split view of one buffer of D + DV columns)."""
    shape = (1, KV, n, d + dv) if layout == "HND" else (n, KV, d + dv)
    kv = torch.zeros(shape, **{**BF16, **kw})
    return kv[..., :d], kv[..., d:]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize(
    "q_shape,out_shape,lse_shape",
    [
        ((H, D), (H, DV), (H,)),
        ((1, H, 1, D), (1, H, 1, DV), (H,)),
        ((H * D,), (H * DV,), (H,)),
        ((3, H, D), (3, H, DV), (3, H)),
        ((16, H, D), (16, H, DV), (16, H)),
    ],
)
def test_the_fake_decode_gives_heads_of_the_values_width(layout, q_shape, out_shape, lse_shape):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        k, v = _caches(layout=layout)
        q = torch.empty(q_shape, **BF16)
        out, lse = fxt.gqa_decode(q, k, v, kv_layout=layout, return_lse=True, head_dim_v=DV)
        plain = fxt.gqa_decode(q, k, v, kv_layout=layout)  # (head_dim_v read from v_cache)
    assert out.shape == out_shape and out.dtype == torch.bfloat16
    assert lse.shape == lse_shape and lse.dtype == torch.float32
    assert plain.shape == out_shape


def test_equal_widths_keep_qs_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        k = torch.empty(40, KV, 128, **BF16)
        out = fxt.gqa_decode(torch.empty(H, 128, **BF16), k, k, head_dim_v=128)
    assert out.shape == (H, 128)


def _layer(q, kv):
    """A DeepSeek-shaped decode: K and V split from one buffer, the output projected."""
    k, v = kv[..., :D], kv[..., D:]
    out = fxt.gqa_decode(q, k, v, kv_layout="HND", scale=0.07)
    return out.reshape(1, H * DV) @ torch.ones(H * DV, 8, **BF16)


def test_a_decode_layer_traces_with_fake_tensors_to_the_op():
    from torch.fx.experimental.proxy_tensor import make_fx

    args = (torch.zeros(H, D, **BF16), torch.zeros(1, KV, 40, D + DV, **BF16))
    graph = make_fx(_layer, tracing_mode="fake")(*args)
    (node,) = [n for n in graph.graph.nodes if str(n.target) == "ferrox.gqa_decode.default"]
    assert tuple(node.meta["val"][0].shape) == (H, DV)


def test_a_compiled_decode_layer_is_one_graph():
    """torch.compile(fullgraph=True) of the layer: the op inside, its output (H, DV) (a
    backend that keeps the graph and runs nothing: no GPU)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
        fakes = [n.meta["example_value"] for n in outputs]
        return lambda *args: [torch.zeros(f.shape, dtype=f.dtype) for f in fakes]

    torch._dynamo.reset()
    got = torch.compile(_layer, backend=keep, fullgraph=True)(
        torch.zeros(H, D, **BF16), torch.zeros(1, KV, 40, D + DV, **BF16)
    )
    assert got.shape == (1, 8)
    (graph,) = graphs
    (node,) = [n for n in graph.graph.nodes if "ferrox.gqa_decode" in str(n.target)]
    assert tuple(node.meta["example_value"][0].shape) == (H, DV)


Q = torch.zeros(H, D, **BF16)
K, V = _caches()
SEQ = torch.ones(1, dtype=torch.int32)


@pytest.mark.parametrize(
    "args,kwargs,error,match",
    [
        ((Q, K, V, SEQ.long()), {}, ValueError, "seq_len: with values .* one int32"),
        ((Q, K, V, torch.ones(2, dtype=torch.int32)), {}, ValueError, r"seq_len: .*\(2,\)"),
        ((Q, K, V), {"kv_scales": torch.ones(2, KV)}, ValueError, "kv_scales"),
        ((Q, K, V), {"alibi_slopes": torch.ones(H)}, ValueError, "alibi_slopes"),
        ((torch.zeros(3, H, D, **BF16), K, V), {"tree_mask": torch.ones(3, 3, dtype=torch.bool)},
         ValueError, "tree_mask"),
        ((Q.float(), K.float(), V.float()), {}, TypeError, "q: values .* float16 or bfloat16"),
        ((Q, K, V.half()), {}, TypeError, "v_cache: expected q's dtype"),
        ((torch.zeros(H, 160, **BF16), *_caches(d=160)), {}, ValueError,
         "k_cache: .* a multiple of 64"),
        ((Q, *_caches(dv=96)), {}, ValueError, "v_cache: its width .* multiple of 128"),
        ((Q, *_caches(dv=640)), {}, ValueError, "v_cache: its width"),
        ((torch.zeros(17, H, D, **BF16), K, V), {}, ValueError, "q: up to 16 query tokens"),
        ((Q, K, _caches(n=41)[1]), {}, ValueError, "v_cache: expected k_cache's tokens"),
        ((Q, K, V), {"head_dim_v": 256}, ValueError, "head_dim_v: 256 given"),
        ((Q, K, V), {"head_dim_v": True}, TypeError, "head_dim_v: expected an int"),
        ((Q, K, K), {"head_dim_v": DV}, ValueError, "head_dim_v: 128 given"),
    ],
)  # fmt: skip
def test_what_the_values_kernels_cannot_do_is_refused_by_name(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        fxt.gqa_decode(*args, kv_layout="HND", **kwargs)


def test_a_call_its_kernels_take_passes_the_checks_to_the_device():
    """(CPU tensors: the op itself names q, after the checks passed.)"""
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        fxt.gqa_decode(torch.zeros(3, H, D, **BF16), K, V, kv_layout="HND", head_dim_v=DV,
                       sinks=torch.zeros(H), sliding_window=8, logits_soft_cap=5.0)  # fmt: skip


def test_a_seq_len_tensor_passes_the_checks_to_the_device():
    """A length on the device (capturable) with values of their own width: the checks pass
    it, the op itself names q (CPU tensors)."""
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        fxt.gqa_decode(torch.zeros(3, H, D, **BF16), K, V, SEQ, kv_layout="HND",
                       return_lse=True, sinks=torch.zeros(H), sliding_window=8)  # fmt: skip


def test_the_op_called_directly_checks_its_seq_len_while_tracing():
    """The op's own fake implementation takes a one-int32 seq_len (out ``(H, DV)``) and
    refuses another by name (not only the wrapper)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def op(seq):
        k, v = _caches()
        return torch.ops.ferrox.gqa_decode(torch.empty(H, D, **BF16), k, v, seq, None, None,
                                           None, "HND", None, None, None, True)  # fmt: skip

    with FakeTensorMode():
        out, lse = op(torch.empty(1, dtype=torch.int32))
        assert out.shape == (H, DV) and lse.shape == (H,)
        with pytest.raises(ValueError, match="seq_len: with values"):
            op(torch.empty(1, dtype=torch.float32))


def _layer_over_a_length(q, kv, seq):
    k, v = kv[..., :D], kv[..., D:]
    out = fxt.gqa_decode(q, k, v, seq, kv_layout="HND", scale=0.07)
    return out.reshape(1, H * DV) @ torch.ones(H * DV, 8, **BF16)


def test_a_compiled_decode_layer_over_a_length_tensor_is_one_graph():
    """torch.compile(fullgraph=True) of a decode layer over a static cache's buffer and its
    length on the device: the op inside with the length as an input (a backend that keeps
    the graph and runs nothing: no GPU)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
        fakes = [n.meta["example_value"] for n in outputs]
        return lambda *args: [torch.zeros(f.shape, dtype=f.dtype) for f in fakes]

    torch._dynamo.reset()
    got = torch.compile(_layer_over_a_length, backend=keep, fullgraph=True)(
        torch.zeros(H, D, **BF16), torch.zeros(1, KV, 40, D + DV, **BF16), SEQ
    )
    assert got.shape == (1, 8)
    (graph,) = graphs
    (node,) = [n for n in graph.graph.nodes if "ferrox.gqa_decode" in str(n.target)]
    assert tuple(node.meta["example_value"][0].shape) == (H, DV)
    assert node.args[3].op == "placeholder"  # (the length: the graph's input, read at run time)
