"""Does the KV layout account for PyTorch's lead where both read at the ceiling (MHA)?

The cache is [token][kv_head][head_dim] (DESIGN.md: one token, one row and one copy), so a
block of one KV head reads head_dim elements out of every n_kv_heads * head_dim. The
benchmark hands PyTorch [kv_head][token][head_dim] tensors, each head's tokens in a row.
Here each library reads each layout, on the same rotated sets (the bytes are the same;
only the reading differs):
- ours token-major: the plan as the library runs it;
- ours head-major: the same kernels with the KV head's base and token stride edited
  (compiled per length: the length is the head stride);
- PyTorch head-major: the benchmark's own tensors (bench_decode._torch_sdpa_us);
- PyTorch token-major: views of a [sets][2][seq][kv_head][head_dim] pool, permuted to
  (1, kv_head, seq, head_dim), strides and all.
Ours first, then PyTorch's, on one stream each (the benchmark's order: NOTES.md v14).

    PYTHONPATH=. python3 docs/perf-history/layout_probe.py [shape ...]
"""

from __future__ import annotations

import statistics
import sys

from points import CEILING, edited_source, load_variant, points

from ferrox_driver.bench_decode import (
    _torch_sdpa_us,
    bench_stream,
    import_torch,
    rotation,
    torch_side_stream,
)
from ferrox_driver.device import default_device

CASES = [
    ((32, 32, 128), "bf16", [32768, 131072]),
    ((32, 8, 128), "bf16", [32768, 131072]),
    ((28, 4, 128), "bf16", [32768]),
    ((16, 2, 64), "bf16", [32768]),
]
WARP_RING = """k + (long long)g_kv * D,
        v + (long long)g_kv * D, (long long)n_kv_heads * D,"""


def head_major(seq: int) -> str:
    """The split-kernel file reading [kv_head][token][head_dim] caches of ``seq`` tokens."""
    return edited_source(
        [
            (
                WARP_RING,
                f"""k + (long long)g_kv * {seq}LL * D,
        v + (long long)g_kv * {seq}LL * D, (long long)D,""",
            )
        ]
    )


def torch_token_major_us(shape: tuple[int, int, int], seq: int, iters: int = 30) -> float:
    """PyTorch SDPA per decode, back to back in one graph, on token-major views."""
    torch = import_torch()
    import torch.nn.functional as F

    n_heads, n_kv, hd = shape
    tdt = torch.bfloat16
    n_sets, chain = rotation(2 * seq * n_kv * hd * 2)
    q = torch.rand(1, n_heads, 1, hd, device="cuda", dtype=tdt) * 2 - 1
    pool = torch.empty(n_sets, 2, seq, n_kv, hd, device="cuda", dtype=tdt).uniform_(-1, 1)
    sets = [(pool[i, 0].permute(1, 0, 2)[None], pool[i, 1].permute(1, 0, 2)[None])
            for i in range(n_sets)]  # fmt: skip
    side = torch_side_stream(torch)
    with torch.cuda.stream(side):
        for k, v in sets:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            for i in range(chain):
                k, v = sets[i % n_sets]
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(iters + 5):
        start.record()  # the replay runs on the current stream, as in the benchmark
        g.replay()
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end) * 1e3 / chain)
    g.reset()
    del pool, sets
    torch.cuda.empty_cache()
    return statistics.median(times)


def main() -> None:
    stream = bench_stream(default_device())
    rows = []
    for p in points(CASES, stream, sys.argv[1:]):
        plan = p.plan()
        variant = load_variant(head_major(p.seq), f"hm{p.seq}.cu", stream.device)
        kernel = variant.get_function(plan.kernel)
        token = min(p.time(plan) for _ in range(2))
        head = min(p.time(plan, kernel) for _ in range(2))
        rows.append((p, plan, token, head))
        print(f"{p.label} ours: token-major {token:.1f} us, head-major {head:.1f} us", flush=True)
    for p, plan, token, head in rows:
        shape = (p.n_heads, p.n_kv, p.head_dim)
        t_head, _ = _torch_sdpa_us(shape, p.seq, p.dtype_name, 30)
        t_token = torch_token_major_us(shape, p.seq)
        print(
            f"{p.label} ({plan.splits} chunks) token-major: ours {token:.1f} us "
            f"({p.pct(token):.0f}%), PyTorch {t_token:.1f} ({p.pct(t_token):.0f}%); "
            f"head-major: ours {head:.1f} ({p.pct(head):.0f}%), PyTorch {t_head:.1f} "
            f"({p.pct(t_head):.0f}%)  [% of {CEILING / 1e12:.2f} TB/s]",
            flush=True,
        )


if __name__ == "__main__":
    main()
