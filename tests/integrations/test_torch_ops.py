"""ferrox_driver.integrations.torch without a GPU: the ops are registered under
torch.ops.ferrox with fake implementations (a decode layer traces with fake tensors to the
shapes and dtypes the real ops return, the append declared as writing its cache), and bad
arguments are named before any device work."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import ferrox_driver.integrations.torch as fxt  # noqa: E402

H, KV, D = 8, 2, 64


def _layer(q, kc, vc, k, v, state):
    fxt.kv_append(kc, vc, k, v, state)
    return fxt.gqa_decode(q, kc, vc, state[:1], return_lse=True)


def _args(dtype=torch.bfloat16):
    return (torch.randn(H, D, dtype=dtype), torch.zeros(32, KV, D, dtype=dtype),
            torch.zeros(32, KV, D, dtype=dtype), torch.randn(KV, D, dtype=dtype),
            torch.randn(KV, D, dtype=dtype), torch.zeros(2, dtype=torch.int32))  # fmt: skip


def test_a_decode_layer_traces_with_fake_tensors_to_the_ops():
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(_layer, tracing_mode="fake")(*_args())
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert "ferrox.kv_append.default" in targets
    assert "ferrox.gqa_decode.default" in targets
    assert targets.index("ferrox.kv_append.default") < targets.index("ferrox.gqa_decode.default")


@pytest.mark.parametrize("q_shape", [(H, D), (1, H, 1, D), (H * D,)])
def test_the_fake_decode_gives_qs_shape_and_lse_per_head(q_shape):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(q_shape, dtype=torch.float16)
        k = torch.empty(1, KV, 40, D, dtype=torch.float16)
        out, lse = fxt.gqa_decode(q, k, k, torch.empty(1, dtype=torch.int32), kv_layout="HND",
                                  return_lse=True)  # fmt: skip
        plain = fxt.gqa_decode(q, k, k, torch.empty(1, dtype=torch.int32), kv_layout="HND")
    assert out.shape == q.shape and out.dtype == torch.float16
    assert lse.shape == (H,) and lse.dtype == torch.float32
    assert plain.shape == q.shape


def test_the_append_op_says_what_it_writes():
    schema = torch.ops.ferrox.kv_append.default._schema
    written = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
    assert written == {"k_cache", "v_cache", "state"}
    schema = torch.ops.ferrox.kv_append_4bit.default._schema
    written = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
    assert written == {"k_cache", "v_cache", "state", "k_block_scales", "v_block_scales"}
    assert not any(a.alias_info and a.alias_info.is_write
                   for a in torch.ops.ferrox.gqa_decode.default._schema.arguments)  # fmt: skip


def test_cpu_tensors_and_bad_shapes_are_refused_by_name():
    q, kc, vc, k, v, state = _args()
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        fxt.gqa_decode(q, kc, vc, state[:1])
    with pytest.raises(ValueError, match="k_cache: expected a CUDA tensor"):
        fxt.kv_append(kc, vc, k, v, state)
    with pytest.raises(ValueError, match="outs: expected a CUDA tensor"):
        fxt.merge_states(torch.zeros(2, H, D), torch.zeros(2, H))
    with pytest.raises(ValueError, match="kv_layout"):
        fxt.gqa_decode(q, kc, vc, state[:1], kv_layout="THD")
    with pytest.raises(ValueError, match="head_dim"):
        fxt.gqa_decode(q, kc, vc, state[:1], head_dim=32)
    with pytest.raises(ValueError, match="q: shape"):
        fxt.gqa_decode(torch.zeros(3, 5), kc, vc, state[:1])
    with pytest.raises(ValueError, match="outs, lses"):
        fxt.merge_states(torch.zeros(2, H, D), torch.zeros(2, H, 1))


def test_new_state_is_the_length_and_a_clear_flag():
    state = fxt.new_state("cpu", 7)
    assert state.dtype == torch.int32 and state.tolist() == [7, 0]
