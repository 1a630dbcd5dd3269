"""attn_implementation="ferrox" in real transformers model classes on the GPU: small random
models with the real head dims, groups and features of Llama 3, Mistral, Qwen 2.5, Phi-3
and Gemma 2 generate the same greedy tokens as with "sdpa" over 64 new tokens of a static
cache, with logits at each step within 1e-2 (bf16), every decode step on ferrox; random
models' logits are nearly flat, so the two may part at a near tie (checked as one)."""

from __future__ import annotations

import copy
import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ferrox_driver as fd  # noqa: E402
import ferrox_driver.integrations.transformers as fxt  # noqa: E402

pytestmark = pytest.mark.gpu

SMALL = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             max_position_embeddings=512)  # fmt: skip
MODELS = {
    "llama3": (transformers.LlamaConfig, dict(num_attention_heads=32, num_key_value_heads=8,
                                              head_dim=128, rope_theta=500000.0)),
    "mistral": (transformers.MistralConfig, dict(num_attention_heads=32, num_key_value_heads=8,
                                                 head_dim=128, sliding_window=16)),
    "qwen2.5": (transformers.Qwen2Config, dict(num_attention_heads=28, num_key_value_heads=4,
                                               hidden_size=28 * 128)),
    "phi3": (transformers.Phi3Config, dict(num_attention_heads=32, num_key_value_heads=32,
                                           hidden_size=32 * 96, pad_token_id=0,
                                           eos_token_id=2)),
    "gemma2": (transformers.Gemma2Config, dict(num_attention_heads=16, num_key_value_heads=8,
                                               head_dim=256, sliding_window=24,
                                               attn_logit_softcapping=50.0,
                                               final_logit_softcapping=30.0,
                                               query_pre_attn_scalar=256)),
}  # fmt: skip
NEW_TOKENS = 64


def _models(name):
    cls, extra = MODELS[name]
    config = cls(**{**SMALL, **extra})
    fxt.register()
    torch.manual_seed(0)
    auto = transformers.AutoModelForCausalLM
    ours = auto.from_config(copy.deepcopy(config), attn_implementation="ferrox",
                            dtype=torch.bfloat16)  # fmt: skip
    theirs = auto.from_config(copy.deepcopy(config), attn_implementation="sdpa",
                              dtype=torch.bfloat16)  # fmt: skip
    theirs.load_state_dict(ours.state_dict())
    return ours.cuda().eval(), theirs.cuda().eval(), config


def _generate(model, ids, **kw):
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
              cache_implementation="static", output_logits=True, return_dict_in_generate=True,
              **kw)  # fmt: skip
    with torch.no_grad():
        return model.generate(ids, **kw)


def _counted(monkeypatch):
    """ferrox's decodes from here on, (function, layout) (a static cache's steps decode its
    whole buffers with gqa_decode_async, a dynamic one's with gqa_decode)."""
    decodes = []
    for name in ("gqa_decode", "gqa_decode_async"):
        real = getattr(fd, name)

        def counted(*args, _real=real, **kwargs):
            decodes.append((_real.__name__, kwargs.get("kv_layout")))
            return _real(*args, **kwargs)

        monkeypatch.setattr(fd, name, counted)
    return decodes


def _ids(config):
    return torch.randint(0, config.vocab_size, (1, 7), device="cuda",
                         generator=torch.Generator("cuda").manual_seed(1))  # fmt: skip


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _same_until_a_near_tie(got, want, prompt):
    """The new tokens of the two generations agree, and their logits within 1e-2 at each
    step, until (if ever) they part at a near tie: where SDPA's logits put the token
    ferrox chose within 5% of their rms of its own (a random model's logits are nearly
    flat; two right attentions that round differently may pick either). Returns how many
    agree."""
    a, b = got.sequences[0, prompt:].tolist(), want.sequences[0, prompt:].tolist()
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    for step in range(min(same + 1, len(a))):
        assert _rel(got.logits[step], want.logits[step]) < 1e-2, step
    if same < len(a):
        logits = want.logits[same][0].float()
        margin = (logits[b[same]] - logits[a[same]]).item()
        rms = logits.pow(2).mean().sqrt().item()
        assert margin <= 0.05 * rms, (same, margin, rms, a, b)
    return same


@pytest.mark.parametrize("name", sorted(MODELS))
def test_ferrox_generates_the_tokens_sdpa_does(name, monkeypatch, caplog):
    """Both eager (disable_compile): the rest of the two models rounds alike."""
    ours, theirs, config = _models(name)
    decodes = _counted(monkeypatch)
    ids = _ids(config)
    with caplog.at_level(logging.DEBUG, logger=fxt.__name__):
        got = _generate(ours, ids, disable_compile=True)
    want = _generate(theirs, ids, disable_compile=True)
    layers = config.num_hidden_layers
    assert [layout for _, layout in decodes] == ["HND"] * layers * (NEW_TOKENS - 1)
    # every decode step on ferrox: a static cache's whole buffers while they have room (a
    # sliding window's layers keep a buffer of the window, full after its first tokens)
    full = 1 if getattr(config, "sliding_window", None) else layers * (NEW_TOKENS - 2)
    assert sum(f == "gqa_decode_async" for f, _ in decodes) >= full
    fallbacks = [r.getMessage() for r in caplog.records if r.name == fxt.__name__]
    assert len(fallbacks) == layers and all("prefill" in m for m in fallbacks), fallbacks
    assert got.sequences[0, : ids.shape[1]].tolist() == ids[0].tolist()
    print(f"{name}: {_same_until_a_near_tie(got, want, ids.shape[1])} tokens the same")


@pytest.mark.parametrize("name", ["gemma2", "llama3"])
def test_generates_default_torch_compile_runs_ferrox_outside_the_graph(name, monkeypatch):
    """generate's default: a static cache's decode steps compiled, ferrox a graph break.
    Each step on ferrox; the tokens those of the compiled SDPA model, the logits within
    1e-2, until a near tie parts them (the two graphs fuse the other ops differently)."""
    ours, theirs, config = _models(name)
    decodes = _counted(monkeypatch)
    ids = _ids(config)
    got, want = _generate(ours, ids), _generate(theirs, ids)
    assert [layout for _, layout in decodes] == ["HND"] * config.num_hidden_layers * (
        NEW_TOKENS - 1
    )
    print(f"{name}, compiled: {_same_until_a_near_tie(got, want, ids.shape[1])} tokens the same")
