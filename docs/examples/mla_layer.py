"""A DeepSeek-shaped MLA decode (docs/guides/mla.md): 128 heads, q_nope absorbed through
W_UK into the 512 latent dims plus 64 rope dims, one latent row per token. First
fd.mla_decode over latent rows you hold, then a LatentCache grown a row per token, then a
CUDA graph of its append and decode that serves every token; each checked against the
float64 reference."""

import math

import ml_dtypes
import numpy as np

import ferrox_driver as fd

n_heads, kv_lora_rank, rope_dim, nope_dim = 128, 512, 64, 128
width = kv_lora_rank + rope_dim  # 576: one row of c_kv (512) then k_rope (64) per token
bf16 = ml_dtypes.bfloat16
rng = np.random.default_rng(0)
capacity = 4096
# W_UK (n_heads, 128, 512) absorbs each head's q_nope into the latent space
w_uk = rng.standard_normal((n_heads, nope_dim, kv_lora_rank)) / math.sqrt(nope_dim)
# DeepSeek's softmax scale: 1/sqrt(nope + rope head dims) (times its YaRN mscale)
scale = 1 / math.sqrt(nope_dim + rope_dim)


def absorbed_query():
    """One token's queries, (n_heads, 576): q_nope W_UK, then q_rope."""
    q_nope = rng.standard_normal((n_heads, nope_dim))
    q_rope = rng.standard_normal((n_heads, rope_dim))
    return np.concatenate([np.einsum("hd,hdc->hc", q_nope, w_uk), q_rope], axis=1).astype(bf16)


def check(out, q, rows, what):
    ref = fd.reference_mla_decode(q, rows, scale=scale)
    err = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
    print(f"{what}: relative error {err:.1e}")
    assert err < 1e-2


# 1. fd.mla_decode over latent rows you hold (device arrays in, device arrays out)
latent = rng.standard_normal((capacity, width)).astype(bf16)
q = absorbed_query()
out, lse = fd.mla_decode(fd.to_device(q), fd.to_device(latent), 1000, scale=scale,
                         return_lse=True)  # fmt: skip
# out: (128, 512) in the latent space; the layer's output is out @ W_UV per head, then W_O
check(out.to_host().astype(np.float64), q, latent[:1000], f"mla_decode, out {out.shape}")

# 2. a LatentCache: the prompt's rows in one append, then one row per token
cache = fd.LatentCache(capacity, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, dtype=bf16)
cache.append(latent[:900])
for t in range(900, 903):
    cache.append(latent[t])  # one row: staged, one asynchronous copy
    q = absorbed_query()
    got = cache.decode(q, scale=scale)  # numpy in, numpy out
    check(got.astype(np.float64), q, latent[: t + 1], f"LatentCache at {t + 1} tokens")

# 3. a token's step as a CUDA graph: append the row and decode, the length read on the
# device, so the graph captured once serves every token
row_d = fd.empty((width,), bf16)
q_d = fd.empty((n_heads, width), bf16)
out_d = fd.empty((n_heads, kv_lora_rank), bf16)
s = cache.stream
with s.capture() as graph:
    cache.append_async(row_d, stream=s)
    cache.decode_async(q_d, out_d, scale=scale, stream=s)
step = graph.instantiate()
for t in range(903, 906):
    q = absorbed_query()
    row_d.copy_from_host(latent[t], s)
    q_d.copy_from_host(q, s)
    step.launch(s)
    check(out_d.to_host(s).astype(np.float64), q, latent[: t + 1], f"replay at {t + 1} tokens")
print(f"{cache.seq_len} tokens in the cache")
cache.close()
