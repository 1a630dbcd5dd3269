"""A DeepSeek-shaped MLA decode (docs/guides/mla.md): 128 heads, q_nope absorbed through
W_UK into the 512 latent dims plus 64 rope dims, one latent row per token; checked against
the float64 reference, then captured in a CUDA graph that serves every length."""

import math

import ml_dtypes
import numpy as np

import ferrox_driver as fd

n_heads, kv_lora_rank, rope_dim, nope_dim = 128, 512, 64, 128
bf16 = ml_dtypes.bfloat16
rng = np.random.default_rng(0)
capacity = 4096

# the latent cache: one row of c_kv (512) then k_rope (64) per token
latent = rng.standard_normal((capacity, kv_lora_rank + rope_dim)).astype(bf16)
ckv = fd.to_device(latent)

# one token's queries: q_nope (n_heads, 128) and q_rope (n_heads, 64); W_UK (n_heads, 128,
# 512) absorbs q_nope into the latent space
q_nope = rng.standard_normal((n_heads, nope_dim))
q_rope = rng.standard_normal((n_heads, rope_dim))
w_uk = rng.standard_normal((n_heads, nope_dim, kv_lora_rank)) / math.sqrt(nope_dim)
q_host = np.concatenate([np.einsum("hd,hdc->hc", q_nope, w_uk), q_rope], axis=1).astype(bf16)
q = fd.to_device(q_host)  # (128, 576)

# DeepSeek's softmax scale: 1/sqrt(nope + rope head dims) (times its YaRN mscale)
scale = 1 / math.sqrt(nope_dim + rope_dim)
out, lse = fd.mla_decode(q, ckv, 1000, scale=scale, return_lse=True)
# out: (128, 512) in the latent space; the layer's output is out @ W_UV per head, then W_O
ref = fd.reference_mla_decode(q_host, latent[:1000], scale=scale)
err = np.linalg.norm(out.to_host().astype(np.float64) - ref) / np.linalg.norm(ref)
print(f"mla_decode: out {out.shape}, lse {lse.shape}, relative error {err:.1e}")
assert err < 1e-2

# in a CUDA graph: the length on the device, out given; one eager call first compiles the
# kernels and makes the workspace
seq = fd.to_device(np.array([1], np.int32))
out = fd.empty((n_heads, kv_lora_rank), bf16)
stream = fd.Stream()
fd.mla_decode(q, ckv, seq, out=out, scale=scale, stream=stream)
with stream.capture() as graph:
    fd.mla_decode(q, ckv, seq, out=out, scale=scale, stream=stream)
step = graph.instantiate()
for n in (1, 100, 4096):
    seq.copy_from_host(np.array([n], np.int32), stream)
    step.launch(stream)
    stream.synchronize()
    ref = fd.reference_mla_decode(q_host, latent[:n], scale=scale)
    err = np.linalg.norm(out.to_host().astype(np.float64) - ref) / np.linalg.norm(ref)
    print(f"graph replay at {n} tokens: relative error {err:.1e}")
    assert err < 1e-2
