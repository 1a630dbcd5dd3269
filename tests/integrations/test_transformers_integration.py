"""The transformers integration on the CPU (transformers and PyTorch, no GPU): registration,
the fallbacks and their log lines (eager attention for gpt-oss's sinks and Gemma 2's
soft-cap, prefill and decode logits as transformers' "eager" model's; SDPA for the rest),
what a decode step becomes (length, window, scale, soft-cap, sinks) for real model classes'
calls, and the calls that must not run on ferrox."""

from __future__ import annotations

import copy
import logging
import sys
import types

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


def model_pair(config, against="sdpa", dtype=torch.float32, setup=None):
    """The same random weights (``setup(model)`` changes them after init) with
    attn_implementation "ferrox" and ``against``."""
    fxt.register()
    torch.manual_seed(0)
    auto = transformers.AutoModelForCausalLM
    ours = auto.from_config(copy.deepcopy(config), attn_implementation="ferrox", dtype=dtype)
    theirs = auto.from_config(copy.deepcopy(config), attn_implementation=against, dtype=dtype)
    assert ours.config._attn_implementation == "ferrox"
    if setup is not None:
        with torch.no_grad():
            setup(ours)
    theirs.load_state_dict(ours.state_dict())
    return ours.eval(), theirs.eval()


def test_register_adds_ferrox_to_transformers_attention_and_mask_functions():
    fxt.register()
    fxt.register()  # twice: the same
    registered = transformers.AttentionInterface._global_mapping["ferrox"]
    assert registered is fxt.ferrox_attention_forward  # traced by torch.compile, not disabled
    assert not hasattr(registered, "_torchdynamo_disable")
    assert hasattr(torch.ops.ferrox, "gqa_decode")  # the ops it traces are registered
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
    ours, _ = model_pair(config, against="eager")  # (5.24+ refuse Gemma 2 on "sdpa")
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


@pytest.mark.parametrize("head_dim", [300, 512])
def test_heads_up_to_512_wide_decode_on_ferrox(head_dim):  # (Gemma 4's global layers: 512)
    q, kv = torch.zeros(1, 8, 1, head_dim), torch.zeros(1, 2, 10, head_dim)
    call = fxt.decode_call(None, q, kv, kv, None, require_cuda=False)
    assert isinstance(call, fxt.DecodeCall) and call.length == 10


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
        ((torch.zeros(1, 8, 1, 520), torch.zeros(1, 2, 10, 520), torch.zeros(1, 2, 10, 520)), {},
         "8 query heads of 520"),
        ((torch.zeros(1, 6, 1, 16), torch.zeros(1, 4, 10, 16), torch.zeros(1, 4, 10, 16)), {},
         "6 query heads of 16 over 4 KV heads"),
        ((Q, KV.transpose(2, 3).contiguous().transpose(2, 3), KV), {}, "K/V rows not contiguous"),
        ((Q, KV, KV), {"mask": _mask([1, 0, 1, 1, 0, 0, 0, 0, 0, 0])}, "not one run of tokens"),
        ((Q, KV, KV), {"mask": _mask([0] * 10)}, "hides every token"),
        ((Q, KV, KV), {"s_aux": torch.zeros(3)}, "3 sinks for 8 query heads"),
        ((Q, KV, KV), {"position_bias": torch.zeros(1, 8, 1, 10)}, "position_bias (not a feature"),
        ((Q, KV, KV), {"sinks": torch.zeros(8)}, "sinks (not a feature"),
        ((Q, KV, KV), {"cuda": True}, "tensors on cpu"),
    ],
)  # fmt: skip
def test_calls_ferrox_cannot_run_say_why(args, kwargs, reason):
    kwargs = dict(kwargs)
    mask = kwargs.pop("mask", None)
    require_cuda = kwargs.pop("cuda", False)
    got = fxt.decode_call(None, *args, mask, require_cuda=require_cuda, **kwargs)
    assert isinstance(got, str) and reason in got, got


# Models whose attention SDPA cannot compute: gpt-oss's sinks (at 0, which still adds
# exp(0) to each softmax's denominator, and at 3) and Gemma 2's soft-cap, its query and key
# projections scaled so that the logits pass the cap. A window of 4 that a prompt of 9 and
# 8 new tokens outgrow. Each test's expected values are transformers' "eager" model's.
def _sinks_at(value):
    def setup(model):
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(value)

    return setup


def _logits_past_the_cap(model):
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight.mul_(8.0)
        layer.self_attn.k_proj.weight.mul_(8.0)


def _gpt_oss():
    return tiny(transformers.GptOssConfig, num_local_experts=4, num_experts_per_tok=2,
                sliding_window=4)  # fmt: skip


def _gemma2(cap=2.0):
    return tiny(transformers.Gemma2Config, sliding_window=4, attn_logit_softcapping=cap,
                query_pre_attn_scalar=16)  # fmt: skip


SINKS_AND_CAPS = {
    "gpt-oss, sinks 0": (_gpt_oss, _sinks_at(0.0)),
    "gpt-oss, sinks 3": (_gpt_oss, _sinks_at(3.0)),
    "gemma2, soft-cap": (_gemma2, _logits_past_the_cap),
}
DTYPES = [torch.float32, torch.bfloat16]


def _prompt(n=9):
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(SINKS_AND_CAPS))
def test_prefill_logits_are_the_eager_models(name, dtype, caplog):
    config, setup = SINKS_AND_CAPS[name]
    ours, theirs = model_pair(config(), against="eager", dtype=dtype, setup=setup)
    ids = _prompt()
    with caplog.at_level(logging.DEBUG, logger=LOGGER), torch.no_grad():
        got = ours(ids).logits
        want = theirs(ids).logits
    torch.testing.assert_close(got, want)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    feature = "a soft-cap of 2.0" if "gemma2" in name else "sinks"
    assert len(lines) == 2 and all(f"eager attention instead ({feature}" in m for m in lines)


@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(SINKS_AND_CAPS))
def test_greedy_decode_tokens_and_logits_are_the_eager_models(name, dtype, cache):
    """On the CPU each decode step falls back too: to the model's eager attention."""
    config, setup = SINKS_AND_CAPS[name]
    ours, theirs = model_pair(config(), against="eager", dtype=dtype, setup=setup)
    ids = _prompt()
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
              return_dict_in_generate=True, cache_implementation=cache)  # fmt: skip
    with torch.no_grad():
        got, want = ours.generate(ids, **kw), theirs.generate(ids, **kw)
    assert got.sequences.tolist() == want.sequences.tolist()
    assert len(got.logits) == 8
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        torch.testing.assert_close(a, b, msg=f"step {step}")


def test_the_sinks_change_the_tiny_gpt_oss_logits(monkeypatch):
    """The tests above can fail: gpt-oss's eager attention without its sinks (what SDPA
    computed for it) moves the logits by more than 0.05 (fp32)."""
    ours, _ = model_pair(_gpt_oss(), against="eager", setup=_sinks_at(0.0))
    ids = _prompt()
    with torch.no_grad():
        with_sinks = ours(ids).logits
        modeling = sys.modules[type(ours.model.layers[0].self_attn).__module__]
        monkeypatch.setattr(fxt, "_EAGER", {})
        monkeypatch.setattr(modeling, "eager_attention_forward",
                            lambda *a, s_aux=None, **kw: fxt.eager_attention(*a, **kw))  # fmt: skip
        without = ours(ids).logits
    assert (with_sinks - without).abs().max().item() > 0.05


def test_the_cap_changes_the_tiny_gemma2_logits():
    """The tests above can fail: without its cap Gemma 2's logits move by more than 0.05."""
    capped, _ = model_pair(_gemma2(), against="eager", setup=_logits_past_the_cap)
    plain, _ = model_pair(_gemma2(cap=None), against="eager", setup=_logits_past_the_cap)
    ids = _prompt()
    with torch.no_grad():
        assert (capped(ids).logits - plain(ids).logits).abs().max().item() > 0.05


def test_the_model_modules_own_eager_attention_runs(monkeypatch):
    """gpt-oss's eager_attention_forward (its sinks from the module), not this module's."""
    ours, _ = model_pair(_gpt_oss(), against="eager", setup=_sinks_at(1.0))
    modeling = sys.modules[type(ours.model.layers[0].self_attn).__module__]
    called = []
    real = modeling.eager_attention_forward

    def spy(module, query, key, value, mask, **kw):
        called.append((module, mask.dtype if mask is not None else None))
        return real(module, query, key, value, mask, **kw)

    monkeypatch.setattr(fxt, "_EAGER", {})  # (the lookup is cached per class)
    monkeypatch.setattr(modeling, "eager_attention_forward", spy)
    monkeypatch.setattr(fxt, "eager_attention", None)  # (never called)
    with torch.no_grad():
        ours(_prompt())
    layers = [layer.self_attn for layer in ours.model.layers]
    assert [m for m, _ in called] == layers
    assert {dtype for _, dtype in called} == {torch.float32}  # additive, not SDPA's booleans


def _reference(q, k, v, keep, scale, cap=None, sinks=None):
    """Attention in float64, one query head and query row at a time: ``keep[i][j]`` whether
    query row i reads token j."""
    q, k, v = q.double(), k.double(), v.double()
    out = torch.empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for i in range(q.shape[2]):
                logits = k[b, h // group] @ q[b, h, i] * scale
                if cap is not None:
                    logits = cap * torch.tanh(logits / cap)
                logits = logits[keep[i]]
                top = logits.max() if sinks is None else max(logits.max(), sinks[h].double())
                e = torch.exp(logits - top)
                denominator = e.sum() + (0 if sinks is None else torch.exp(sinks[h] - top))
                out[b, i, h] = (e / denominator) @ v[b, h // group][keep[i]]
    return out


@pytest.mark.parametrize("cap", [None, 0.7])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("mask", ["band", "none"])
def test_eager_attention_with_a_boolean_mask_is_a_float64_references(cap, with_sinks, mask,
                                                                      caplog):  # fmt: skip
    """A layer whose module has no eager attention of its own (here: ``types``): this
    module's eager_attention, with SDPA's boolean mask made additive, or without a mask,
    causal as SDPA is for more than one query token."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 6, 5, 8, generator=g) * 2
    k, v = torch.randn(2, 3, 7, 8, generator=g) * 2, torch.randn(2, 3, 7, 8, generator=g)
    rows, cols = torch.arange(5)[:, None] + 2, torch.arange(7)[None, :]
    keep = (cols <= rows) & (cols > rows - 3) if mask == "band" else cols <= rows - 2
    sinks = torch.randn(6, generator=g) if with_sinks else None
    bool_mask = keep.view(1, 1, 5, 7) if mask == "band" else None
    kw = {"softcap": cap} if cap is not None else {}
    if with_sinks:
        kw["s_aux"] = sinks
    layer = types.SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        got, weights = fxt.ferrox_attention_forward(layer, q, k, v, bool_mask, scaling=0.3, **kw)
    want = _reference(q, k, v, keep, 0.3, cap, sinks)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    line = [r.getMessage() for r in caplog.records if r.name == LOGGER][-1]
    assert ("eager attention instead" in line) == (cap is not None or with_sinks), line
    assert (weights is None) == (cap is None and not with_sinks)


def test_a_keyword_sdpa_does_not_read_runs_eager(caplog):
    q, kv = torch.randn(1, 8, 3, 16), torch.randn(1, 2, 3, 16)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        fxt.ferrox_attention_forward(None, q, kv, kv, None, indices=torch.zeros(3))
    line = [r.getMessage() for r in caplog.records if r.name == LOGGER][-1]
    assert "eager attention instead (indices, which SDPA does not read)" in line, line


def test_a_model_that_does_not_support_sdpa_runs_its_eager_attention(monkeypatch, caplog):
    """A module whose model class says _supports_sdpa = False: its own eager function,
    given an additive mask, though no keyword needs it."""
    modeling = types.ModuleType("fake_modeling")
    called = []

    def eager_attention_forward(module, query, key, value, mask, **kw):
        called.append(mask)
        return query.transpose(1, 2), None

    attention = type("FakeAttention", (torch.nn.Module,), {"__module__": "fake_modeling"})
    model = type("FakeModel", (transformers.PreTrainedModel,),
                 {"__module__": "fake_modeling", "_supports_sdpa": False})  # fmt: skip
    vars(modeling).update(FakeAttention=attention, FakeModel=model,
                          eager_attention_forward=eager_attention_forward)  # fmt: skip
    monkeypatch.setitem(sys.modules, "fake_modeling", modeling)
    q, kv = torch.randn(1, 8, 3, 16), torch.randn(1, 2, 3, 16)
    keep = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool).view(1, 1, 3, 3)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        fxt.ferrox_attention_forward(attention(), q, kv, kv, keep, scaling=0.25)
    min_ = torch.finfo(torch.float32).min
    want = torch.tensor([[0, min_, min_], [0, 0, min_], [min_, 0, 0]]).view(1, 1, 3, 3)
    assert len(called) == 1 and torch.equal(called[0], want)
    line = [r.getMessage() for r in caplog.records if r.name == LOGGER][-1]
    assert "fake_modeling does not support SDPA" in line, line


def test_an_fp8_cache_binds_to_the_models_attention_modules_and_checks_its_arguments():
    model, _ = model_pair(tiny(transformers.LlamaConfig))
    cache = fxt.FP8Cache(model, max_cache_len=32)
    bound = [m for m in model.modules() if hasattr(m, "ferrox_fp8_layer")]
    assert [m.ferrox_fp8_layer for m in bound] == list(cache.layers)
    assert all(type(m).__name__.endswith("Attention") for m in bound)
    assert cache.nbytes == 0  # (nothing allocated before the first update)
    with pytest.raises(ValueError, match="max_cache_len"):
        fxt.FP8Cache(model, max_cache_len=0)
    with pytest.raises(TypeError, match="fp8_dtype"):
        fxt.FP8Cache(model, max_cache_len=8, fp8_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="scale_margin"):
        fxt.FP8Cache(model, max_cache_len=8, scale_margin=0.0)


def test_fp8_keys_of_another_cache_or_of_no_cache_are_refused():
    layer = types.SimpleNamespace(keys=torch.zeros(8, 2, 16, dtype=torch.float8_e4m3fn))
    module = types.SimpleNamespace(ferrox_fp8_layer=layer)
    query = torch.zeros(1, 4, 1, 16)
    other = torch.zeros(8, 2, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="not those of the FP8Cache"):
        fxt.ferrox_attention_forward(module, query, other, other, None)
    with pytest.raises(ValueError, match="no FP8Cache is bound"):
        fxt.ferrox_attention_forward(types.SimpleNamespace(), query, other, other, None)


def test_a_four_bit_cache_binds_to_the_models_attention_modules_and_checks_its_arguments():
    model, _ = model_pair(tiny(transformers.LlamaConfig))
    cache = fxt.FourBitCache(model, max_cache_len=32)
    bound = [m for m in model.modules() if hasattr(m, "ferrox_kv4_layer")]
    assert [m.ferrox_kv4_layer for m in bound] == list(cache.layers)
    assert all(type(m).__name__.endswith("Attention") for m in bound)
    assert cache.nbytes == 0 and cache.fmt == "int4" and cache.rotate  # (int4's default)
    assert not fxt.FourBitCache(model, max_cache_len=8, fmt="nvfp4").rotate
    assert fxt.FourBitCache(model, max_cache_len=8, fmt="nvfp4", rotate=True).rotate
    with pytest.raises(ValueError, match="fmt"):
        fxt.FourBitCache(model, max_cache_len=8, fmt="int8")
    with pytest.raises(TypeError, match="rotate"):
        fxt.FourBitCache(model, max_cache_len=8, rotate=1)
    with pytest.raises(ValueError, match="max_cache_len"):
        fxt.FourBitCache(model, max_cache_len=0)
    with pytest.raises(ValueError, match="k_scale"):
        fxt.FourBitCache(model, max_cache_len=8, fmt="int4", k_scale=0.1)
    with pytest.raises(ValueError, match="scale_margin"):
        fxt.FourBitCache(model, max_cache_len=8, fmt="nvfp4", scale_margin=0.0)
    layer = cache.layers[0]  # the tiny model's head_dim 16: not a 4-bit kernel's
    with pytest.raises(ValueError, match="head_dim 16"):
        layer.lazy_initialization(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16))
    with pytest.raises(ValueError, match="float32"):  # (q float16 or bfloat16)
        layer.lazy_initialization(torch.zeros(1, 2, 3, 64), torch.zeros(1, 2, 3, 64))


def test_four_bit_keys_of_another_cache_or_of_no_cache_are_refused():
    layer = types.SimpleNamespace(keys=torch.zeros(8, 2, 32, dtype=torch.uint8))
    module = types.SimpleNamespace(ferrox_kv4_layer=layer)
    query = torch.zeros(1, 4, 1, 64)
    other = torch.zeros(8, 2, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not those of the FourBitCache"):
        fxt.ferrox_attention_forward(module, query, other, other, None)
    with pytest.raises(ValueError, match="no FourBitCache is bound"):
        fxt.ferrox_attention_forward(types.SimpleNamespace(), query, other, other, None)


def _host_append(kc, vc, k, v, state, kv_scales=None, kv_format=None, k_block_scales=None,
                 v_block_scales=None, rotate_k=None, kv_layout="NHD"):  # fmt: skip
    """fxt.kv_append on the CPU, by the public numpy helpers (what the GPU stores), into a
    token-major or (kv_layout "HND") head-major cache."""
    import ferrox_driver as fd

    kn, vn = (x.float().reshape(-1, *x.shape[-2:]).numpy() for x in (k, v))
    kn = fd.hadamard(kn) if rotate_k else kn
    at, n = int(state[0]), kn.shape[0]
    for i, (rows, vals, scales) in enumerate(((kn, kc, k_block_scales), (vn, vc, v_block_scales))):
        if kv_format == "int4":
            q, s = fd.quantize_int4(rows)
        else:
            q, s, _ = fd.quantize_nvfp4(rows, kv_scales[i].numpy())
            s = s.view("uint8")
        if kv_layout == "HND":  # (each KV head's rows at..at + n)
            vals[:, at : at + n] = torch.from_numpy(q).transpose(0, 1)
            scales[:, at : at + n] = torch.from_numpy(s).transpose(0, 1)
        else:
            vals[at : at + n] = torch.from_numpy(q)
            scales[at : at + n] = torch.from_numpy(s)
    state[0] += n


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_a_four_bit_layer_attends_over_its_dequantized_tokens_and_the_new_ones(
    fmt, layout, monkeypatch
):
    """A prompt's first chunk attends to itself in the model's dtype; a later chunk of
    several tokens to the cache so far, dequantized in torch (bit for bit the numpy
    helpers', K's rotation undone), then itself. nvfp4's scales come from the first chunk.
    Either storage layout (the module's LAYOUT)."""
    import numpy as np

    import ferrox_driver as fd
    import ferrox_driver.integrations.torch as fxt_torch
    import ferrox_driver.integrations.transformers_kv4 as kv4_module

    monkeypatch.setattr(fxt_torch, "kv_append", _host_append)
    monkeypatch.setattr(kv4_module, "LAYOUT", layout)
    model, _ = model_pair(tiny(transformers.LlamaConfig))  # (the layer: the rows' shapes)
    cache = fxt.FourBitCache(model, max_cache_len=16, fmt=fmt, rotate=True)
    layer = cache.layers[0]
    torch.manual_seed(3)
    k1, v1, k2, v2 = (torch.randn(1, 2, n, 64, dtype=torch.bfloat16) for n in (5, 5, 3, 3))
    k1 = k1 * 3
    got_k, got_v = layer.update(k1, v1)
    assert got_k is k1 and got_v is v1  # the first chunk: itself, unquantized
    assert int(layer.state[0]) == 5 and int(layer.cumulative_length) == 5
    # the layout's rows: head-major, each KV head's rows in one run; else token-major
    per = 64 // (32 if fmt == "int4" else 16)
    rows_of = (2, 16) if layout == "HND" else (16, 2)
    assert layer.keys.shape == layer.values.shape == (*rows_of, 32)
    assert layer.k_block_scales.shape == layer.v_block_scales.shape == (*rows_of, per)
    if fmt == "nvfp4":  # each head's largest magnitude (K's rotated) x 2 at 6 x 448
        amax = np.abs(fd.hadamard(k1[0].transpose(0, 1).float().numpy())).max(axis=(0, 2))
        assert np.allclose(layer.kv_scales[0].numpy(), amax * 2 / 2688, rtol=1e-6)
    got_k, got_v = layer.update(k2, v2)
    assert got_k.shape == (1, 2, 8, 64) and torch.equal(got_k[:, :, 5:], k2)
    assert torch.equal(got_v[:, :, 5:], v2)
    rows = k1[0].transpose(0, 1).float().numpy()
    if fmt == "int4":
        want = fd.hadamard(fd.dequantize_int4(*fd.quantize_int4(fd.hadamard(rows))))
    else:
        g = layer.kv_scales[0].numpy()
        want = fd.hadamard(fd.dequantize_nvfp4(*fd.quantize_nvfp4(fd.hadamard(rows), g)))
    assert got_k.dtype == torch.bfloat16  # (the model's)
    assert torch.equal(got_k[0, :, :5].transpose(0, 1), torch.from_numpy(want).bfloat16())
    err = (got_k[:, :, :5].float() - k1.float()).norm() / k1.float().norm()
    assert 0 < err < 0.2, err  # (4-bit: about 0.1 of the values' norm)
    assert int(layer.state[0]) == 8
    with pytest.raises(ValueError, match="max_cache_len"):
        layer.update(
            torch.zeros(1, 2, 9, 64, dtype=torch.bfloat16),
            torch.zeros(1, 2, 9, 64, dtype=torch.bfloat16),
        )


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_a_compiled_four_bit_decode_step_is_one_graph(fmt):
    """A FourBitCache layer's decode step under torch.compile(fullgraph=True): the append,
    ferrox's decode op and the mask's check on the device in one graph, no break (a
    backend that keeps the graph and runs nothing: no GPU)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
        fakes = [n.meta["example_value"] for n in outputs]
        return lambda *args: [torch.zeros(f.shape, dtype=f.dtype) for f in fakes]

    model, _ = model_pair(tiny(transformers.LlamaConfig))
    cache = fxt.FourBitCache(model, max_cache_len=16, fmt=fmt)
    layer = cache.layers[0]
    bf16 = dict(dtype=torch.bfloat16)
    layer.lazy_initialization(torch.zeros(1, 2, 1, 64, **bf16), torch.zeros(1, 2, 1, 64, **bf16))
    module = types.SimpleNamespace(ferrox_kv4_layer=layer)

    def step(q, k, v, mask):
        keys, values = layer.update(k, v)
        return fxt.ferrox_attention_forward(module, q, keys, values, mask, scaling=0.125)[0]

    mask = torch.zeros(1, 1, 1, 16, dtype=torch.bool)
    mask[..., :5] = True
    torch._dynamo.reset()
    rows = [torch.zeros(shape, **bf16) for shape in ((1, 8, 1, 64), (1, 2, 1, 64), (1, 2, 1, 64))]
    torch.compile(step, backend=keep, fullgraph=True)(*rows, mask)
    (graph,) = graphs
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.index("ferrox.kv_append_4bit") < targets.index("ferrox.gqa_decode")
