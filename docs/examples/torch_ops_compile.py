"""ferrox as PyTorch custom ops (torch.ops.ferrox): tensors in, tensors out, on PyTorch's
current stream. The eager decode, a static cache with its length on the device, merge, an
fp8 cache, then a decode layer compiled with torch.compile(fullgraph=True,
mode="reduce-overhead"): no graph break, one CUDA graph for every step. Each result against
fd.reference_gqa_decode (float64, on the CPU). Needs a GPU and PyTorch 2.4 or newer. Exits
non-zero when a check fails.
"""

import sys

import numpy as np
import torch
from torch._dynamo.utils import counters

import ferrox_driver as fd
import ferrox_driver.integrations.torch as fxt  # registers torch.ops.ferrox.*

n_heads, n_kv_heads, head_dim, capacity = 32, 8, 128, 4096
bf16 = dict(device="cuda", dtype=torch.bfloat16)
errors = {}


def check(what, out, q, k, v, **features):
    """out's relative error against the float64 reference over token-major k and v."""
    k, v = (x.float().cpu().numpy() for x in (k, v))
    q = q.float().cpu().numpy().reshape(n_heads, head_dim)
    want = fd.reference_gqa_decode(q, k, v, n_heads=n_heads, **features)
    got = out.float().cpu().numpy().reshape(want.shape)
    errors[what] = float(np.linalg.norm(got - want) / np.linalg.norm(want))


# The eager decode: every token of k and v (seq_len None), the output a new tensor.
q = torch.randn(n_heads, head_dim, **bf16)
k = torch.randn(1000, n_kv_heads, head_dim, **bf16)  # token-major: (tokens, KV heads, head_dim)
v = torch.randn(1000, n_kv_heads, head_dim, **bf16)
check("eager decode", fxt.gqa_decode(q, k, v, sliding_window=256), q, k, v, sliding_window=256)

# A static cache: appends at the length held on the device, decodes of its first state[0].
k_cache = torch.zeros(capacity, n_kv_heads, head_dim, **bf16)
v_cache = torch.zeros_like(k_cache)
state = fxt.new_state("cuda")  # int32 [length, overflow flag]
fxt.kv_append(k_cache, v_cache, k[:999], v[:999], state)  # 999 rows, then state[0] = 999
fxt.kv_append(k_cache, v_cache, k[999], v[999], state)  # one token, (n_kv_heads, head_dim)
check("static cache", fxt.gqa_decode(q, k_cache, v_cache, state[:1]), q, k, v)

# merge_states: the decodes of two parts and their LSEs make the decode of the whole.
parts = [fxt.gqa_decode(q, x, y, return_lse=True) for x, y in ((k[:600], v[:600]),
                                                               (k[600:], v[600:]))]  # fmt: skip
merged, _ = fxt.merge_states(torch.stack([o for o, _ in parts]), torch.stack([s for _, s in parts]))
check("merge", merged, q, k, v)

# An fp8 cache: bf16 rows quantized on the way in with kv_scales (K's, then V's, one per KV
# head: a value is stored as value / scale), its bytes read with them (compute 8.9+).
if torch.cuda.get_device_capability() >= (8, 9):
    kv_scales = torch.stack([x.float().abs().amax(dim=(0, 2)) / 448 for x in (k, v)])
    k8 = torch.zeros(capacity, n_kv_heads, head_dim, dtype=torch.float8_e4m3fn, device="cuda")
    v8 = torch.zeros_like(k8)
    state8 = fxt.new_state("cuda")
    fxt.kv_append(k8, v8, k, v, state8, kv_scales=kv_scales)
    out8 = fxt.gqa_decode(q, k8, v8, state8[:1], kv_scales=kv_scales)
    k_read = k8[:1000].float() * kv_scales[0].view(1, -1, 1)  # the values the kernel reads
    v_read = v8[:1000].float() * kv_scales[1].view(1, -1, 1)
    check("fp8 cache", out8, q, k_read, v_read)


class DecodeLayer(torch.nn.Module):
    """One attention layer's decode step: its projections, an append to its own static
    cache (buffers, so a CUDA graph reads them where they are) and the decode."""

    def __init__(self, width):
        super().__init__()
        self.q = torch.nn.Linear(width, n_heads * head_dim, bias=False)
        self.k = torch.nn.Linear(width, n_kv_heads * head_dim, bias=False)
        self.v = torch.nn.Linear(width, n_kv_heads * head_dim, bias=False)
        self.o = torch.nn.Linear(n_heads * head_dim, width, bias=False)
        self.register_buffer("k_cache", torch.zeros(capacity, n_kv_heads, head_dim))
        self.register_buffer("v_cache", torch.zeros(capacity, n_kv_heads, head_dim))
        self.register_buffer("state", torch.zeros(2, dtype=torch.int32))

    def forward(self, x):
        k, v = self.k(x).view(n_kv_heads, head_dim), self.v(x).view(n_kv_heads, head_dim)
        fxt.kv_append(self.k_cache, self.v_cache, k, v, self.state)
        attn = fxt.gqa_decode(self.q(x).view(n_heads, head_dim), self.k_cache, self.v_cache,
                              self.state[:1])  # fmt: skip
        return self.o(attn.view(1, -1)), attn


width = 1024
layer = DecodeLayer(width).to(**bf16)
fxt.kv_append(layer.k_cache, layer.v_cache, k, v, layer.state)  # a 1000-token prompt, eagerly
step = torch.compile(layer, fullgraph=True, mode="reduce-overhead")  # fullgraph: no break
worst = 0.0
with torch.no_grad():
    for t in range(16):  # the length grows on the device: one captured graph serves each step
        x = torch.randn(1, width, **bf16)
        _, attn = step(x)  # (a replay's outputs are overwritten by the next: read them first)
        n = 1000 + t + 1
        check("compiled layer", attn, layer.q(x), layer.k_cache[:n], layer.v_cache[:n])
        worst = max(worst, errors["compiled layer"])
errors["compiled layer"] = worst
torch.cuda.synchronize()
length, overflow = layer.state.tolist()
skips = counters["inductor"]["cudagraph_skips"]  # graphs PyTorch declined to capture
print(f"compiled decode layer: 16 steps, length {length}, CUDA graph skips {skips}")
for what, err in errors.items():
    print(f"{what}: relative error {err:.1e} against the float64 reference")
sys.exit(0 if max(errors.values()) < 2e-2 and (length, overflow, skips) == (1016, 0, 0) else 1)
