"""The transformers integration with DeepSeek V2/V3 on the CPU (no GPU): their attention
hands ferrox expanded heads whose keys are 192 wide (128 + 64 rope) and whose values, a
``torch.split`` view, are 128 wide. What a decode step becomes (``head_dim_v``, the length,
a verify's query rows), what falls back and why, a compiled step traced whole onto ferrox's
op (one query token; a compiled verify's rows onto SDPA), and whole greedy and
prompt-lookup generations with ``fd.gqa_decode`` standing in as the float64 reference (the
plumbing: query rows, views, output layout; the kernels' numbers are the GPU tests')."""

from __future__ import annotations

import copy
import logging
import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ferrox_driver as fd  # noqa: E402
import ferrox_driver.driver.stream as fd_stream  # noqa: E402
import ferrox_driver.integrations.transformers as fxt  # noqa: E402

LOGGER = "ferrox_driver.integrations.transformers"
H, DK, DV = 4, 192, 128
# every expert used by every token (no top-k choice for a rounding to flip)
MOE = dict(n_routed_experts=2, num_experts_per_tok=2, n_group=1, topk_group=1,
           moe_intermediate_size=32, first_k_dense_replace=1)  # fmt: skip


def deepseek(version="v3", **extra):
    """A tiny random DeepSeek V3 (or V2) config with the real head widths."""
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=H, num_key_value_heads=H, kv_lora_rank=32,
                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=DV,
                  max_position_embeddings=256, eos_token_id=None, **MOE)  # fmt: skip
    if version == "v3":
        return transformers.DeepseekV3Config(**{**common, "q_lora_rank": 32, **extra})
    return transformers.DeepseekV2Config(**{**common, "q_lora_rank": None, **extra})


def model_pair(config, dtype=torch.bfloat16):
    """The same random weights with attn_implementation "ferrox" and "sdpa"."""
    fxt.register()
    torch.manual_seed(0)
    auto = transformers.AutoModelForCausalLM
    ours = auto.from_config(copy.deepcopy(config), attn_implementation="ferrox", dtype=dtype)
    theirs = auto.from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=dtype)
    theirs.load_state_dict(ours.state_dict())
    return ours.eval(), theirs.eval()


def _decode_calls(model, monkeypatch, cache, n_new=5):
    """(q_len, DecodeCall or why not) of every attention call of a greedy generation
    (CPU tensors planned as if on CUDA); each then runs on SDPA."""
    seen = []
    real = fxt.decode_call

    def spy(*args, **kwargs):
        seen.append((args[1].shape[2], real(*args, require_cuda=False, **kwargs)))
        return "recorded by the test"

    monkeypatch.setattr(fxt, "decode_call", spy)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                       do_sample=False, cache_implementation=cache)  # fmt: skip
    return seen


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("version", ["v3", "v2"])
def test_a_deepseek_decode_step_takes_values_of_their_own_width(version, cache, monkeypatch):
    ours, _ = model_pair(deepseek(version))
    seen = _decode_calls(ours, monkeypatch, cache)
    layers = 2
    prefill, steps = seen[:layers], seen[layers:]
    assert all(q == 4 and "prefill" in why for q, why in prefill), prefill
    assert len(steps) == layers * 4  # (the first new token is the prefill's)
    scaling = ours.model.layers[0].self_attn.scaling
    for i, (q_len, call) in enumerate(steps):
        assert q_len == 1 and isinstance(call, fxt.DecodeCall), call
        assert call.head_dim_v == DV and call.length == 5 + i // layers
        assert call.sliding_window is None and call.scale == pytest.approx(scaling)
        assert call.logits_soft_cap is None and call.sinks is None


def _split_kv(n, width=DK + DV, dtype=torch.bfloat16, at=DK, n_heads=H):
    """K (contiguous) and V (a torch.split view of wider rows), head-major, as DeepSeek's
    expand_kv makes them: V's rows ``width`` elements apart, starting ``at`` in."""
    kv = torch.randn(1, n, n_heads, width, dtype=dtype).transpose(1, 2)
    return kv[..., :DK].contiguous(), kv[..., at : at + DV]


def _rows(n_q, kv_len, end, window=None):
    """A mask of n_q causal query rows, the last ending at token ``end``."""
    at = torch.arange(kv_len)
    ends = torch.arange(end - n_q + 1, end + 1)[:, None]
    keep = at < ends
    if window is not None:
        keep &= at >= ends - window
    return keep.view(1, 1, n_q, kv_len)


Q1 = torch.zeros(1, H, 1, DK, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "n_q,mask,length,window",
    [
        (1, None, 10, None),  # a dynamic cache's step: every token
        (1, _rows(1, 10, 6), 6, None),  # a static cache's
        (3, _rows(3, 10, 9), 9, None),  # a verify's three rows after six earlier tokens
        (16, _rows(16, 20, 20), 20, None),
        (4, _rows(4, 12, 11, window=5), 11, 5),  # a sliding window's band, every row
    ],
)
def test_query_rows_read_the_run_their_mask_keeps(n_q, mask, length, window):
    k, v = _split_kv(10 if mask is None else mask.shape[-1])
    q = torch.zeros(1, H, n_q, DK, dtype=torch.bfloat16)
    call = fxt.decode_call(None, q, k, v, mask, scaling=0.1, require_cuda=False)
    assert isinstance(call, fxt.DecodeCall), call
    assert (call.length, call.sliding_window, call.head_dim_v) == (length, window, DV)


def _misaligned():
    k, _ = _split_kv(10)
    return k, _split_kv(10, width=DK + DV + 4, at=DK + 4)[1]  # V 8 bytes past a boundary


def _causal_but(row, keep):
    mask = _rows(3, 10, 9)
    mask[0, 0, row] = torch.tensor(keep, dtype=torch.bool)
    return mask


K10, V10 = _split_kv(10)


@pytest.mark.parametrize(
    "q,kv,kwargs,reason",
    [
        (Q1.float(), tuple(x.float() for x in (K10, V10)), {}, "in torch.float32"),
        (torch.zeros(1, H, 1, 160, dtype=torch.bfloat16),
         (torch.zeros(1, H, 10, 160, dtype=torch.bfloat16), V10), {}, "keys a multiple of 64"),
        (Q1, (K10, torch.zeros(1, H, 10, 96, dtype=torch.bfloat16)), {}, "values 96 wide"),
        (Q1, (K10, torch.zeros(1, H, 10, 640, dtype=torch.bfloat16)), {}, "values 640 wide"),
        (torch.zeros(1, H, 3, DK, dtype=torch.bfloat16), (K10, V10),
         {"read_mask": False, "mask": _rows(3, 10, 9)}, "3 query tokens compiled"),
        (Q1, _misaligned(), {}, "V rows not 16-byte aligned"),
        (Q1, (K10, V10.transpose(2, 3).contiguous().transpose(2, 3)), {}, "V rows not contiguous"),
        (torch.zeros(1, 6, 1, DK, dtype=torch.bfloat16), (K10, V10), {},
         "6 query heads over 4 KV heads"),
        (Q1, (K10, torch.zeros(1, H, 9, DV, dtype=torch.bfloat16)), {}, "do not match"),
        (torch.zeros(1, H, 17, DK, dtype=torch.bfloat16), _split_kv(20),
         {"mask": _rows(17, 20, 20)}, "17 query tokens (prefill; ferrox decodes 1 to 16"),
        (torch.zeros(1, H, 3, DK, dtype=torch.bfloat16), (K10, V10), {}, "prefill"),  # no mask
        (torch.zeros(1, H, 3, DK, dtype=torch.bfloat16), (K10, V10), {"mask": _rows(3, 10, 3)},
         "prefill"),  # a prompt's three rows
        (torch.zeros(1, H, 3, DK, dtype=torch.bfloat16), (K10, V10),
         {"mask": _causal_but(1, [1, 1, 1, 1, 1, 1, 1, 1, 1, 0])}, "not the last tokens"),
        (torch.zeros(1, H, 3, DK, dtype=torch.bfloat16), (K10, V10),
         {"mask": _causal_but(0, [1, 0, 1, 1, 1, 1, 1, 0, 0, 0])}, "not one run"),
        (torch.zeros(1, H, 3, DK, dtype=torch.bfloat16), (K10, V10),
         {"mask": _causal_but(0, [0, 1, 1, 1, 1, 1, 1, 0, 0, 0])}, "windows differ"),
        (torch.zeros(1, H, 3, DK, dtype=torch.bfloat16), (K10, V10),
         {"mask": _causal_but(2, [0] * 10)}, "hides every token"),
        (torch.zeros(1, H, 3, DK, dtype=torch.bfloat16), (K10, V10),
         {"mask": _rows(1, 10, 9)}, "mask of shape (1, 1, 1, 10) for 3 query tokens"),
    ],
)  # fmt: skip
def test_values_ferrox_cannot_decode_say_why(q, kv, kwargs, reason):
    kwargs = dict(kwargs)
    mask = kwargs.pop("mask", None)
    got = fxt.decode_call(None, q, *kv, mask, require_cuda=False, **kwargs)
    assert isinstance(got, str) and reason in got, got


@pytest.mark.parametrize("window", [None, 6, 16])
def test_a_compiled_step_plans_the_whole_buffer_and_the_layers_window(window):
    """Compiled (nothing read on the host), a one-token step is ferrox's: the length is the
    buffer's (the op reads the real one on the device), the window the layer's keyword
    where it is smaller than the buffer."""
    k, v = _split_kv(16)
    call = fxt.decode_call(None, Q1, k, v, _rows(1, 16, 5), scaling=0.1, require_cuda=False,
                           read_mask=False, sliding_window=window)  # fmt: skip
    assert isinstance(call, fxt.DecodeCall), call
    assert (call.length, call.head_dim_v) == (16, DV)
    assert call.sliding_window == (6 if window == 6 else None)


def _compiled_graph(monkeypatch, q, mask):
    """The graph of one compiled DeepSeek attention call over a static cache's buffers
    (16 tokens; CPU tensors planned as if on CUDA; a backend that keeps the graph and runs
    nothing), fullgraph: no break (the fallback's log line included)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
        fakes = [n.meta["example_value"] for n in outputs]
        return lambda *args: [torch.zeros(f.shape, dtype=f.dtype) for f in fakes]

    ours, _ = model_pair(deepseek())
    module = ours.model.layers[0].self_attn
    monkeypatch.setattr(fxt, "_EAGER", {})  # (the first lookup of the eager one traced too)
    real = fxt.decode_call
    monkeypatch.setattr(fxt, "decode_call", lambda *a, **kw: real(*a, require_cuda=False, **kw))

    def step(q, k, v, mask):
        return fxt.ferrox_attention_forward(module, q, k, v, mask, scaling=0.1)[0]

    k, v = _split_kv(16)
    torch._dynamo.reset()
    out = torch.compile(step, backend=keep, fullgraph=True)(q, k, v, mask)
    assert out.shape == (1, q.shape[2], H, DV)
    (graph,) = graphs
    return graph


def test_a_compiled_deepseek_step_is_traced_whole_onto_ferroxs_op(monkeypatch):
    """A compiled decode step (one query token) runs ferrox's op inside the graph over the
    whole buffers, its length computed on the device from the mask: V's width out, no SDPA."""
    graph = _compiled_graph(monkeypatch, Q1, _rows(1, 16, 5))
    nodes = [n for n in graph.graph.nodes if n.op == "call_function"]
    targets = [str(n.target) for n in nodes]
    assert not any("scaled_dot_product_attention" in t for t in targets), targets
    (op,) = [n for n in nodes if "ferrox.gqa_decode" in str(n.target)]
    assert tuple(op.meta["example_value"][0].shape) == (H, DV)
    k, v, seq_len = (op.args[i].meta["example_value"] for i in (1, 2, 3))
    assert (k.shape[2], k.shape[3], v.shape[3]) == (16, DK, DV)  # (the buffers, whole)
    assert seq_len.dtype == torch.int32 and seq_len.numel() == 1


def test_a_compiled_verify_is_traced_whole_onto_sdpa(monkeypatch):
    """A compiled call of several query rows (their causal run is checked on the host
    only) runs on SDPA inside the graph, with no break at the fallback's log line."""
    q = torch.zeros(1, H, 3, DK, dtype=torch.bfloat16)
    graph = _compiled_graph(monkeypatch, q, _rows(3, 16, 9))
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert any("scaled_dot_product_attention" in t for t in targets), targets
    assert not any("ferrox" in t for t in targets), targets


def _reference_decode(monkeypatch):
    """``fd.gqa_decode`` on the CPU as the float64 reference of the call it is given, into
    its ``out`` (poisoned first); the calls ``(q shape, K shape, V strides, head_dim_v)``."""
    calls = []

    def decode(q, k, v, *, out, head_dim_v, kv_layout, stream, n_heads, n_kv_heads, head_dim,
               sinks=None, **features):  # fmt: skip
        assert kv_layout == "HND" and (n_heads, n_kv_heads, head_dim) == (H, H, DK)
        calls.append((tuple(q.shape), tuple(k.shape), v.stride(), head_dim_v))
        out.fill_(float("nan"))
        q, k, v = (x.float().contiguous().numpy() for x in (q, k, v))
        want = fd.reference_gqa_decode(q, k, v,
                                       head_dim_v=head_dim_v, kv_layout="HND",
                                       sinks=None if sinks is None else sinks.numpy(),
                                       **features)  # fmt: skip
        out.copy_(torch.from_numpy(want))
        return out

    real = fxt.decode_call
    monkeypatch.setattr(fxt, "decode_call", lambda *a, **kw: real(*a, require_cuda=False, **kw))
    monkeypatch.setattr(fd, "gqa_decode", decode)
    monkeypatch.setattr(fd_stream, "torch_stream", lambda ordinal: 0)
    return calls


def _generate(model, ids, **kw):
    kw = {**dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                 return_dict_in_generate=True, attention_mask=torch.ones_like(ids)),
          **kw}  # fmt: skip
    with torch.no_grad():
        return model.generate(ids, **kw)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


PROMPT = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("version", ["v3", "v2"])
def test_greedy_generation_through_the_decode_is_sdpas(version, cache, monkeypatch, caplog):
    """Every decode step through ``fd.gqa_decode(..., head_dim_v=128)`` (the reference
    standing in), V read as the split view: the tokens and each step's logits (within
    1e-2) of the SDPA model; only the prompt falls back."""
    ours, theirs = model_pair(deepseek(version))
    calls = _reference_decode(monkeypatch)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        got = _generate(ours, PROMPT, cache_implementation=cache)
    want = _generate(theirs, PROMPT, cache_implementation=cache)
    assert len(calls) == 2 * 5
    n = PROMPT.shape[1]
    for i, (q, k, v_strides, dv) in enumerate(calls):
        assert q == (1, H, DK) and dv == DV and k == (1, H, n + 1 + i // 2, DK)
        assert v_strides[-1] == 1 and v_strides[-2] == H * (128 + DV)  # (the split view)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 2 and all("prefill" in m for m in lines), lines
    assert got.sequences.tolist() == want.sequences.tolist()
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        assert _rel(a, b) < 1e-2, step


def test_a_prompt_lookup_verify_decodes_its_query_rows_together(monkeypatch):
    """Assisted generation (prompt lookup) verifies several drafted tokens in one call:
    those rows go through one ``fd.gqa_decode`` of q ``(n_q, heads, 192)``, causal after
    the earlier tokens, and the generation is the SDPA model's: its tokens, and each
    token's logits within 1e-2."""
    ours, theirs = model_pair(deepseek())
    calls = _reference_decode(monkeypatch)
    got = _generate(ours, PROMPT, prompt_lookup_num_tokens=3)
    want = _generate(theirs, PROMPT, prompt_lookup_num_tokens=3)
    assert got.sequences.tolist() == want.sequences.tolist()
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        assert _rel(a, b) < 1e-2, step
    assert any(q[0] > 1 for q, *_ in calls), calls
    assert all(len(q) == 3 and 1 <= q[0] <= 16 for q, *_ in calls), calls


def test_the_decodes_output_moves_the_logits(monkeypatch):
    """The test above can fail: with the decode's output zeroed, the first decode step's
    logits move by more than 0.05."""
    ours, theirs = model_pair(deepseek())
    _reference_decode(monkeypatch)
    real = fd.gqa_decode

    def zeroed(*args, **kwargs):
        return real(*args, **kwargs).zero_()

    monkeypatch.setattr(fd, "gqa_decode", zeroed)
    got = _generate(ours, PROMPT, max_new_tokens=2, min_new_tokens=2)
    want = _generate(theirs, PROMPT, max_new_tokens=2, min_new_tokens=2)
    assert _rel(got.logits[1], want.logits[1]) > 0.05


def test_values_decode_into_the_layout_transformers_reads(monkeypatch):
    """One call of three query rows against a float64 attention of the same rows: the
    output ``[1, q_len, heads, 128]``, query t reading the tokens up to its own."""
    _reference_decode(monkeypatch)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, H, 3, DK, generator=g).bfloat16()
    kv = torch.randn(1, 12, H, DK + DV, generator=g).bfloat16().transpose(1, 2)
    k, v = kv[..., :DK].contiguous(), kv[..., DK:]
    mask = _rows(3, 12, 10)
    module = types.SimpleNamespace(is_causal=True, training=False)
    out, weights = fxt.ferrox_attention_forward(module, q, k, v, mask, scaling=0.07)
    assert weights is None and out.shape == (1, 3, H, DV)
    qd, kd, vd = q.double(), k.double(), v.double()
    for t in range(3):
        logits = (kd[0, :, : 8 + t] @ qd[0, :, t, :, None])[..., 0] * 0.07
        want = torch.softmax(logits, dim=-1)[:, None, :] @ vd[0, :, : 8 + t]
        torch.testing.assert_close(out[0, t].double(), want[:, 0], rtol=2e-2, atol=2e-2)
