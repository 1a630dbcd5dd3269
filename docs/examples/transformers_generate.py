"""attn_implementation="ferrox" in a Hugging Face transformers model: a small random
Llama-shaped model (32 query heads of 128 over 8 KV heads, bf16) generates greedily with a
static cache, its decode steps on ferrox, the same tokens as with "sdpa". Needs a GPU,
PyTorch and transformers. Exits non-zero when a check fails.
"""

import copy
import sys

import torch
import transformers

import ferrox_driver.integrations.transformers as fx_transformers

fx_transformers.register()  # adds attn_implementation="ferrox"

config = transformers.LlamaConfig(
    vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
)  # fmt: skip
models = {}
for impl in ("ferrox", "sdpa"):
    torch.manual_seed(0)  # the same random weights
    models[impl] = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation=impl, dtype=torch.bfloat16
    ).cuda()

ids = torch.tensor([[1, 17, 42, 7, 99]], device="cuda")
greedy = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, cache_implementation="static")
# disable_compile: both eager, so the rest of the two models rounds alike (generate's
# default torch.compile works too, ferrox outside the compiled graph, but fuses the two
# models' other ops differently: a random model's near-tied tokens can then part)
tokens = {
    impl: model.generate(ids, **greedy, disable_compile=True) for impl, model in models.items()
}
same = tokens["ferrox"].tolist() == tokens["sdpa"].tolist()
print(f"32 greedy tokens, ferrox decode steps: {'the same as' if same else 'NOT'} sdpa's")
sys.exit(0 if same else 1)
