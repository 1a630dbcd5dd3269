"""attn_implementation="ferrox" in real transformers model classes on the GPU: small random
models with the real head dims, groups and features of Llama 3, Mistral, Qwen 2.5, Phi-3
and Gemma 2 generate the same greedy tokens as with "sdpa" over 64 new tokens of a static
cache, with logits at each step within 1e-2 (bf16), every decode step on ferrox."""

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


@pytest.mark.parametrize("name", sorted(MODELS))
def test_ferrox_generates_the_tokens_sdpa_does(name, monkeypatch, caplog):
    ours, theirs, config = _models(name)
    decodes = []
    real = fd.gqa_decode

    def counted(*args, **kwargs):
        decodes.append(kwargs.get("kv_layout"))
        return real(*args, **kwargs)

    monkeypatch.setattr(fd, "gqa_decode", counted)
    ids = torch.randint(0, config.vocab_size, (1, 7), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))  # fmt: skip
    kw = dict(
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        cache_implementation="static",
        output_logits=True,
        return_dict_in_generate=True,
    )
    with caplog.at_level(logging.DEBUG, logger=fxt.__name__), torch.no_grad():
        got = ours.generate(ids, **kw)
    want = theirs.generate(ids, **kw)
    layers = config.num_hidden_layers
    assert decodes == ["HND"] * layers * (NEW_TOKENS - 1)  # every decode step on ferrox
    fallbacks = [r.getMessage() for r in caplog.records if r.name == fxt.__name__]
    assert len(fallbacks) == layers and all("prefill" in m for m in fallbacks), fallbacks
    assert got.sequences.tolist() == want.sequences.tolist()
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < 1e-2, (step, err)
