"""Host time of one eager decode over a head-major static cache (a transformers StaticCache
layer's buffers), as the transformers integration makes it per layer and step, in one
process: ``gqa_decode`` on the view of its first n tokens (the integration's call before),
``gqa_decode_async`` of the whole buffers with the length on the device checked at every
call (the pair path before its call cache), the same through the call cache (now), and
PyTorch's SDPA on the same view. Soft-cap and scale on (Gemma 2's features); bf16.

    PYTHONPATH=. python3 benchmarks/host_pair.py [n_heads/n_kv/head_dim] [tokens]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import ferrox_driver as fd
from ferrox_driver.apps.bench.host import burst_us
from ferrox_driver.decode import pair as decode_pair


def main(argv: list[str]) -> int:
    n_heads, n_kv, hd = (int(x) for x in (argv[1] if len(argv) > 1 else "32/8/128").split("/"))
    n = int(argv[2]) if len(argv) > 2 else 4096
    cap = 2 * n
    dev, dt = torch.device("cuda"), torch.bfloat16
    stream = torch.cuda.current_stream()
    q = torch.randn(n_heads, hd, device=dev, dtype=dt)
    k = torch.randn(1, n_kv, cap, hd, device=dev, dtype=dt)
    v = torch.randn(1, n_kv, cap, hd, device=dev, dtype=dt)
    out = torch.empty(n_heads, hd, device=dev, dtype=dt)
    length = torch.full((1,), n, dtype=torch.int32, device=dev)
    feats = dict(logits_soft_cap=50.0, scale=0.0625)

    def view_decode() -> None:
        fd.gqa_decode(q, k[:, :, :n], v[:, :, :n], n_heads=n_heads, n_kv_heads=n_kv,
                      head_dim=hd, out=out, kv_layout="HND", stream=stream, **feats)  # fmt: skip

    def pair_decode() -> None:
        fd.gqa_decode_async(q, (k, v), out, n_heads=n_heads, stream=stream, seq_len=length,
                            kv_layout="HND", **feats)  # fmt: skip

    kw = dict(sliding_window=None, sinks=None, alibi_slopes=None, **feats)
    sid = stream.cuda_stream

    def pair_checked() -> None:  # every argument checked, the record found (before)
        record, _, _ = decode_pair._pair_checked(q, (k, v), out, n_heads, stream, sid, "auto",
                                                  length, "HND", kw, None)  # fmt: skip
        record.run((q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0))

    def sdpa() -> None:
        F.scaled_dot_product_attention(q.view(1, n_heads, 1, hd), k[:, :, :n], v[:, :, :n],
                                       enable_gqa=True, scale=0.0625)  # fmt: skip

    pair_decode()
    torch.cuda.synchronize()
    want = out.float().clone()
    view_decode()
    torch.cuda.synchronize()
    assert (out.float() - want).abs().max().item() < 1e-2, "the two calls disagree"
    print(f"host us per call, {n_heads}/{n_kv}/{hd} bf16, {n} of {cap} tokens, soft-cap")
    rows = [("gqa_decode on the view (the integration before)", view_decode),
            ("gqa_decode_async pair, checked every call (before)", pair_checked),
            ("gqa_decode_async pair, call cache (now)", pair_decode),
            ("PyTorch SDPA on the view", sdpa)]  # fmt: skip
    for _ in range(2):  # two rounds, alternating; the second printed
        times = [(name, burst_us(fn, torch.cuda.synchronize)) for name, fn in rows]
    for name, us in times:
        print(f"  {name:<52} {us:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
