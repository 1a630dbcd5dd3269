"""The transformers integration on the CPU (transformers and PyTorch, no GPU): registration,
the fallback to SDPA and its log line, what a decode step becomes (length, window, scale,
soft-cap, sinks) for real model classes' calls, and the calls that must not run on ferrox."""

from __future__ import annotations

import copy
import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ferrox_driver.integrations.transformers as fxt  # noqa: E402

LOGGER = "ferrox_driver.integrations.transformers"


def tiny(config_cls, **extra):
    return config_cls(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        **extra,
    )  # fmt: skip


def model_pair(config):
    """The same random weights with attn_implementation "ferrox" and "sdpa"."""
    fxt.register()
    torch.manual_seed(0)
    auto = transformers.AutoModelForCausalLM
    ours = auto.from_config(copy.deepcopy(config), attn_implementation="ferrox")
    theirs = auto.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    assert ours.config._attn_implementation == "ferrox"
    theirs.load_state_dict(ours.state_dict())
    return ours.eval(), theirs.eval()


def test_register_adds_ferrox_to_transformers_attention_and_mask_functions():
    fxt.register()
    fxt.register()  # twice: the same
    registered = transformers.AttentionInterface._global_mapping["ferrox"]
    assert registered.__wrapped__ is fxt.ferrox_attention_forward
    assert registered._torchdynamo_disable  # generate's torch.compile does not trace it
    assert "ferrox" in transformers.AttentionMaskInterface._global_mapping


def test_on_the_cpu_every_call_falls_back_to_sdpa_with_a_log_line(caplog):
    ours, theirs = model_pair(tiny(transformers.LlamaConfig))
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with caplog.at_level(logging.DEBUG, logger=LOGGER), torch.no_grad():
        got = ours(ids).logits
    want = theirs(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert lines and all("SDPA instead" in line for line in lines)
    assert any("5 query tokens (prefill" in line for line in lines)


def test_greedy_generation_with_a_static_cache_falls_back_token_for_token():
    ours, theirs = model_pair(tiny(transformers.MistralConfig, sliding_window=4))
    ids = torch.tensor([[1, 2, 3]])
    kw = dict(max_new_tokens=8, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        assert ours.generate(ids, **kw).tolist() == theirs.generate(ids, **kw).tolist()


def _decode_calls(model, monkeypatch, n_new=6):
    """The DecodeCall of every attention call of the decode steps of a greedy generation
    with a static cache (CPU tensors planned as if on CUDA)."""
    seen = []
    real = fxt.decode_call

    def spy(*args, **kwargs):
        call = real(*args, require_cuda=False, **kwargs)
        seen.append((args[1].shape[2], call))
        return "recorded by the test"  # then SDPA runs, as on the CPU

    monkeypatch.setattr(fxt, "decode_call", spy)
    with torch.no_grad():
        model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=n_new, do_sample=False,
                       cache_implementation="static")  # fmt: skip
    return [call for q_len, call in seen if q_len == 1]


def test_a_llama_decode_step_reads_the_tokens_so_far(monkeypatch):
    ours, _ = model_pair(tiny(transformers.LlamaConfig))
    calls = _decode_calls(ours, monkeypatch)
    assert len(calls) == 2 * 5  # 2 layers, 5 decode steps (the first token is the prefill's)
    for step, call in enumerate(calls):
        assert isinstance(call, fxt.DecodeCall), call
        assert call.length == 5 + step // 2 and call.sliding_window is None
        assert call.scale == pytest.approx(16**-0.5)
        assert call.logits_soft_cap is None and call.sinks is None


def test_gemma2_maps_its_soft_cap_scale_and_local_layers_window(monkeypatch):
    config = tiny(transformers.Gemma2Config, sliding_window=6, attn_logit_softcapping=50.0,
                  query_pre_attn_scalar=32)  # fmt: skip
    ours, _ = model_pair(config)
    calls = _decode_calls(ours, monkeypatch, n_new=8)
    assert all(isinstance(c, fxt.DecodeCall) for c in calls), calls
    assert {c.logits_soft_cap for c in calls} == {50.0}
    assert all(c.scale == pytest.approx(32**-0.5) for c in calls)
    assert ours.config.layer_types == ["sliding_attention", "full_attention"]
    # the local layer's cache holds the last 6 tokens (a rolled buffer, all of it read once
    # full); the global layer's, every token so far
    assert [(c.length, c.sliding_window) for c in calls[0::2]] == [(5, None)] + [(6, None)] * 6
    assert [(c.length, c.sliding_window) for c in calls[1::2]] == [(n, None) for n in range(5, 12)]


def test_sinks_come_from_s_aux_as_float32_per_query_head():
    q = torch.zeros(1, 8, 1, 16)
    kv = torch.zeros(1, 2, 10, 16)
    call = fxt.decode_call(None, q, kv, kv, None, s_aux=torch.arange(8.0).to(torch.bfloat16),
                           scaling=0.25, require_cuda=False)  # fmt: skip
    assert isinstance(call, fxt.DecodeCall)
    assert call.sinks.dtype == torch.float32 and call.sinks.tolist() == list(range(8))
    assert (call.length, call.sliding_window, call.scale) == (10, None, 0.25)


def _mask(keep):
    return torch.tensor(keep, dtype=torch.bool).view(1, 1, 1, -1)


@pytest.mark.parametrize(
    "mask,length,window",
    [
        (_mask([1, 1, 1, 0, 0, 0]), 3, None),
        (_mask([0, 1, 1, 1, 0, 0]), 4, 3),  # a sliding window's band
        (_mask([1, 1, 1, 1, 1, 1]), 6, None),  # a full (rolled) sliding-window buffer
        (torch.tensor([0.0, 0.0, float("-inf")]).view(1, 1, 1, 3), 2, None),  # additive
    ],
)
def test_a_decode_step_reads_the_run_of_tokens_its_mask_keeps(mask, length, window):
    q = torch.zeros(1, 8, 1, 16)
    kv = torch.zeros(1, 2, mask.shape[-1], 16)
    call = fxt.decode_call(None, q, kv, kv, mask, require_cuda=False)
    assert isinstance(call, fxt.DecodeCall)
    assert (call.length, call.sliding_window) == (length, window)


Q, KV = torch.zeros(1, 8, 1, 16), torch.zeros(1, 2, 10, 16)


@pytest.mark.parametrize(
    "args,kwargs,reason",
    [
        ((torch.zeros(2, 8, 1, 16), torch.zeros(2, 2, 10, 16), torch.zeros(2, 2, 10, 16)), {},
         "a batch of 2"),
        ((torch.zeros(1, 8, 3, 16), KV, KV), {}, "3 query tokens (prefill"),
        ((Q, KV, KV), {"dropout": 0.1}, "dropout 0.1"),
        ((Q, KV, KV), {"output_attentions": True}, "output_attentions"),
        ((Q.double(), KV.double(), KV.double()), {}, "dtypes torch.float64"),
        ((Q.half(), KV, KV), {}, "dtypes torch.float16, torch.float32"),
        ((torch.zeros(1, 8, 1, 300), torch.zeros(1, 2, 10, 300), torch.zeros(1, 2, 10, 300)), {},
         "8 query heads of 300"),
        ((torch.zeros(1, 6, 1, 16), torch.zeros(1, 4, 10, 16), torch.zeros(1, 4, 10, 16)), {},
         "6 query heads of 16 over 4 KV heads"),
        ((Q, KV.transpose(2, 3).contiguous().transpose(2, 3), KV), {}, "K/V rows not contiguous"),
        ((Q, KV, KV), {"mask": _mask([1, 0, 1, 1, 0, 0, 0, 0, 0, 0])}, "not one run of tokens"),
        ((Q, KV, KV), {"mask": _mask([0] * 10)}, "hides every token"),
        ((Q, KV, KV), {"s_aux": torch.zeros(3)}, "3 sinks for 8 query heads"),
        ((Q, KV, KV), {"cuda": True}, "tensors on cpu"),
    ],
)  # fmt: skip
def test_calls_ferrox_cannot_run_say_why(args, kwargs, reason):
    kwargs = dict(kwargs)
    mask = kwargs.pop("mask", None)
    require_cuda = kwargs.pop("cuda", False)
    got = fxt.decode_call(None, *args, mask, require_cuda=require_cuda, **kwargs)
    assert isinstance(got, str) and reason in got, got
