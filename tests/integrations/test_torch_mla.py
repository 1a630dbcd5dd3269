"""ferrox_driver.integrations.torch_mla without a GPU: torch.ops.ferrox.mla_decode is
registered with a fake implementation (a layer calling it traces with fake tensors, and
torch.compile(fullgraph=True) captures it in one graph, to the shapes the real op returns),
writes nothing it is given, and bad arguments are named before any device work."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import ferrox_driver.integrations.torch_mla as fxm  # noqa: E402

H, D, DV = 16, 576, 512


def _layer(q, latent, seq):
    out, lse = fxm.mla_decode(q, latent, seq, return_lse=True, scale=0.1)
    return out.float().sum(-1) + lse


def _args(n_q=2, dtype=torch.bfloat16):
    return (torch.randn(n_q, H, D, dtype=dtype), torch.zeros(64, D, dtype=dtype),
            torch.tensor([5], dtype=torch.int32))  # fmt: skip


def test_a_layer_traces_with_fake_tensors_to_the_op():
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(_layer, tracing_mode="fake")(*_args())
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert "ferrox.mla_decode.default" in targets


def test_torch_compile_captures_the_op_in_one_graph():
    graphs = []

    class Traced(Exception):
        pass

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])

        def run(*args):  # (the real op needs a GPU: tracing is what is checked here)
            raise Traced

        return run

    compiled = torch.compile(_layer, fullgraph=True, backend=backend)
    with pytest.raises(Traced):
        compiled(*_args())
    assert len(graphs) == 1 and "ferrox.mla_decode" in graphs[0]


@pytest.mark.parametrize(
    ("q_shape", "latent_dtype", "kw", "out_shape", "lse_shape"),
    [
        ((H, D), torch.bfloat16, {}, (H, DV), (H,)),
        ((3, H, D), torch.float16, {}, (3, H, DV), (3, H)),
        ((H, D), torch.float8_e4m3fn, {"kv_scale": 0.5}, (H, DV), (H,)),
        ((H, D), torch.uint8, {"kv_scale": 0.5}, (H, DV), (H,)),
        ((2, H, 256), torch.bfloat16, {"head_dim_v": 128}, (2, H, 128), (2, H)),
    ],
)
def test_the_fake_gives_the_outputs_shapes(q_shape, latent_dtype, kw, out_shape, lse_shape):
    from torch._subclasses.fake_tensor import FakeTensorMode

    dtype = torch.float16 if latent_dtype == torch.float16 else torch.bfloat16
    with FakeTensorMode():
        q = torch.empty(q_shape, dtype=dtype)
        latent = torch.empty(40, q_shape[-1], dtype=latent_dtype)
        out, lse = fxm.mla_decode(q, latent, torch.empty(1, dtype=torch.int32), return_lse=True,
                                  **kw)  # fmt: skip
        plain = fxm.mla_decode(q, latent, None, **kw)
    assert out.shape == out_shape and out.dtype == dtype and plain.shape == out_shape
    assert lse.shape == lse_shape and lse.dtype == torch.float32


def test_the_op_writes_nothing_it_is_given():
    schema = torch.ops.ferrox.mla_decode.default._schema
    assert not any(a.alias_info and a.alias_info.is_write for a in schema.arguments)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(q=torch.zeros(H, D)), TypeError, "q: expected float16 or bfloat16"),
        (dict(q=torch.zeros(1, 1, H, D, dtype=torch.bfloat16)), ValueError, "q: expected"),
        (dict(latent=torch.zeros(64, 512, dtype=torch.bfloat16)), ValueError, r"latent: expected"),
        (dict(latent=torch.zeros(64, D, dtype=torch.float16)), TypeError, "latent: expected q's"),
        (dict(latent=torch.zeros(D, 64, dtype=torch.bfloat16).t()), ValueError, "C-contiguous"),
        (dict(kv_scale=0.5), ValueError, "kv_scale: only for an fp8 latent"),
        (dict(kv_scale="x"), TypeError, "kv_scale: expected a float"),
        (dict(seq=torch.tensor([5])), ValueError, "seq_len: expected one int32"),
        (dict(head_dim_v=500), ValueError, "head_dim_v: a multiple of 128"),
        (dict(head_dim_v=512.0), TypeError, "head_dim_v: expected an int"),
        (dict(return_lse=1), TypeError, "return_lse: expected a bool"),
        (dict(scale="0.1"), TypeError, "scale"),
        (dict(sliding_window=0), ValueError, "sliding_window"),
        (dict(sliding_window=2.5), TypeError, "sliding_window"),
        (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    ],
)
def test_bad_arguments_are_refused_by_name(change, error, match):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, latent, seq = _args(n_q=1)
    kw = {k: v for k, v in change.items() if k not in ("q", "latent", "seq")}
    q, latent, seq = change.get("q", q[0]), change.get("latent", latent), change.get("seq", seq)
    # (the fake's checks are the op's)
    with pytest.raises(error, match=match), FakeTensorMode(allow_non_fake_inputs=True):
        fxm.mla_decode(q, latent, seq, **kw)


def test_cpu_tensors_are_refused_naming_q():
    q, latent, seq = _args()
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        fxm.mla_decode(q, latent, seq)
