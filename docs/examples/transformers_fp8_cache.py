"""An fp8 KV cache for a Hugging Face transformers model: a small random Llama-shaped model
(32 query heads of 128 over 8 KV heads, bf16) generates greedily with ferrox's FP8Cache, its
K and V quantized to e4m3 on the GPU as each token arrives and read in place by ferrox's
kernels (generate's default torch.compile), against the same model on SDPA with a bf16
StaticCache: the tokens, each step's logits within a tolerance, and the cache's bytes.
Needs a GPU of compute capability 8.9 or newer, PyTorch and transformers. Exits non-zero
when a check fails.
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

# The fp8 cache binds itself to the model's attention layers: make it for the model that
# uses it, one per generation. Its scales come from the prompt (each KV head's largest
# magnitude, times 2, at e4m3's largest value, 448).
fp8_cache = fx_transformers.FP8Cache(models["ferrox"], max_cache_len=max_cache_len)
ours = models["ferrox"].generate(ids, past_key_values=fp8_cache, **greedy)
bf16_cache = transformers.StaticCache(config=config, max_cache_len=max_cache_len)
theirs = models["sdpa"].generate(ids, past_key_values=bf16_cache, **greedy)

# The tokens agree until (if ever) a step where a random model's nearly flat logits let the
# rounding of the fp8 cache pick another; up to there, both read the same tokens, and each
# step's logits (that one's too) must be within the tolerance.
got, want = (out.sequences[0, ids.shape[1] :].tolist() for out in (ours, theirs))
same = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), new_tokens)
worst = 0.0
for step in range(min(same + 1, new_tokens)):
    a, b = ours.logits[step].float(), theirs.logits[step].float()
    worst = max(worst, ((a - b).norm() / b.norm()).item())
fp8_bytes = fp8_cache.nbytes  # K, V, their scales and lengths, every layer
bf16_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in bf16_cache.layers)
print(f"{same} of {new_tokens} greedy tokens as SDPA's over a bf16 cache; logits within "
      f"{worst:.1e} (relative) of its until then")  # fmt: skip
print(f"cache: {fp8_bytes} bytes in fp8, {bf16_bytes} in bf16 ({fp8_bytes / bf16_bytes:.3f}x)")
sys.exit(0 if worst < 5e-2 and fp8_bytes <= 0.52 * bf16_bytes else 1)
