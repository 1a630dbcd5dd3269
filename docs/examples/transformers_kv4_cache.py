"""A 4-bit KV cache for a Hugging Face transformers model: a small random Llama-shaped model
(32 query heads of 128 over 8 KV heads, bf16) generates greedily with ferrox's FourBitCache,
its K and V quantized to int4 on the GPU as each token arrives (K Hadamard-rotated first)
and read in place by ferrox's kernels (generate's default torch.compile), against the same
model on SDPA with a bf16 StaticCache: the tokens, each step's logits within a tolerance,
and the cache's bytes. Needs a GPU of compute capability 8.0 or newer (8.9 for "nvfp4"),
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
max_cache_len, new_tokens = 64, 32
greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              output_logits=True, return_dict_in_generate=True)  # fmt: skip

# The 4-bit cache binds itself to the model's attention layers: make it for the model that
# uses it, one per generation. int4: a float16 scale per 32 elements, K rotated; "nvfp4"
# takes its scales per KV head from the prompt, as an FP8Cache does.
kv4_cache = fx_transformers.FourBitCache(models["ferrox"], max_cache_len, fmt="int4")
ours = models["ferrox"].generate(ids, past_key_values=kv4_cache, **greedy)
bf16_cache = transformers.StaticCache(config=config, max_cache_len=max_cache_len)
theirs = models["sdpa"].generate(ids, past_key_values=bf16_cache, **greedy)

# The tokens agree until (if ever) a step where a random model's nearly flat logits let the
# 4-bit rounding pick another; up to there, both read the same tokens, and each step's
# logits (that one's too) must be within the tolerance: 0.1, about 3x what int4 costs the
# logits of a larger model of random weights (the 4-bit guide's 0.035).
got, want = (out.sequences[0, ids.shape[1] :].tolist() for out in (ours, theirs))
same = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), new_tokens)
worst = 0.0
for step in range(min(same + 1, new_tokens)):
    a, b = ours.logits[step].float(), theirs.logits[step].float()
    worst = max(worst, ((a - b).norm() / b.norm()).item())
kv4_bytes = kv4_cache.nbytes  # values, block scales and lengths, every layer
bf16_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in bf16_cache.layers)
print(f"{same} of {new_tokens} greedy tokens as SDPA's over a bf16 cache; logits within "
      f"{worst:.1e} (relative) of its until then")  # fmt: skip
print(f"cache: {kv4_bytes} bytes in int4, {bf16_bytes} in bf16 ({kv4_bytes / bf16_bytes:.3f}x)")
sys.exit(0 if worst < 0.1 and kv4_bytes <= 0.3 * bf16_bytes else 1)
