"""Host time of one eager ``gqa_decode`` over a growing cache: the first n tokens of a
token-major cache, n one more at every call (as a decode loop without a KVCache calls
it), next to the same call at a fixed length, the growing call with the records of its
plan forgotten before each call (each new length made its own record before), and
PyTorch's SDPA over the first n tokens of a head-major cache, n growing too. In one
process, two rounds alternating, the second printed; bf16.

    PYTHONPATH=. python3 benchmarks/host_growing.py [n_heads/n_kv/head_dim] [tokens]
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable

import ml_dtypes

import ferrox_driver as fd
from ferrox_driver import decode
from ferrox_driver.bench_decode import fill_uniform
from ferrox_driver.bench_host import burst_us


def main(argv: list[str]) -> int:
    n_heads, n_kv, hd = (int(x) for x in (argv[1] if len(argv) > 1 else "32/8/128").split("/"))
    n0 = int(argv[2]) if len(argv) > 2 else 4096
    cap = n0 + 4096
    dt = ml_dtypes.bfloat16
    stream = fd.Stream()
    q = fd.empty((n_heads, hd), dt)
    k, v = (fd.empty((cap, n_kv, hd), dt) for _ in range(2))
    for a in (q, k, v):
        fill_uniform(a, 1, stream)
    out = fd.empty((n_heads, hd), dt)
    kw = {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": hd, "out": out, "stream": stream}
    lengths = itertools.cycle(range(n0, cap))

    def fixed() -> None:
        fd.gqa_decode(q, k.view((n0, n_kv, hd)), v.view((n0, n_kv, hd)), **kw)

    def growing() -> None:
        n = next(lengths)
        fd.gqa_decode(q, k.view((n, n_kv, hd)), v.view((n, n_kv, hd)), **kw)

    def growing_before() -> None:  # a record of its own per length, as before
        decode._plan_records.clear()
        growing()

    rows: list[tuple[str, Callable[[], None], Callable[[], None]]] = [
        ("ferrox, fixed length", fixed, stream.synchronize),
        ("ferrox, growing (a record per plan: now)", growing, stream.synchronize),
        ("ferrox, growing (a record per length: before)", growing_before, stream.synchronize),
    ]
    try:
        import torch
        import torch.nn.functional as F

        tdev = torch.device("cuda")
        tq = torch.randn(1, n_heads, 1, hd, device=tdev, dtype=torch.bfloat16)
        tk, tv = (torch.randn(1, n_kv, cap, hd, device=tdev, dtype=torch.bfloat16) for _ in "kv")
        t_lengths = itertools.cycle(range(n0, cap))

        def sdpa_growing() -> None:
            n = next(t_lengths)
            F.scaled_dot_product_attention(tq, tk[:, :, :n], tv[:, :, :n], enable_gqa=True)

        rows.append(("PyTorch SDPA, growing", sdpa_growing, torch.cuda.synchronize))
    except ImportError:
        print("(no PyTorch: its row is left out)")
    print(f"host us per call, {n_heads}/{n_kv}/{hd} bf16, {n0} tokens and up")
    for _ in range(2):
        times = [(name, burst_us(fn, sync)) for name, fn, sync in rows]
    for name, us in times:
        print(f"  {name:<48} {us:7.1f}")
    for a in (q, k, v, out):
        a.close()
    stream.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
