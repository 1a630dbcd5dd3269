"""A model's caches larger than one GPU's memory, decoded across GPUs: ``--layers`` layers
of H/KV/D bf16 caches of ``--tokens`` tokens, sharded over the launcher's ranks (filled on
the devices), every layer decoded once per token in one captured graph (the median of
replays: ms per token, all layers), and ``--check`` sampled layers against the float64
reference, computed shard by shard on the host (each rank its own tokens, with the LSE)
and merged exactly.

    python -m ferrox_driver.launcher -n 2 benchmarks/sharded_big.py \\
        [--layers 40] [--shape 64/8/128] [--tokens 1048576] [--check 3]

(40 layers of 64/8/128 at one million tokens are 164 GB of K and V: more than one H200
holds, half of it on each of two.) Exit status 1 on a mismatch (relative error 1e-2).
"""

from __future__ import annotations

import argparse
import sys

import ml_dtypes
import numpy as np

import ferrox_driver as fd
from ferrox_driver.apps.bench.harness import captured, fill_uniform, time_events
from ferrox_driver.decode.merge import merge_states
from ferrox_driver.parallel.distributed import NcclGroup


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--shape", default="64/8/128")
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--check", type=int, default=3, help="layers checked on the host")
    a = ap.parse_args(argv)
    n_heads, n_kv, hd = (int(x) for x in a.shape.split("/"))
    dt = ml_dtypes.bfloat16
    with NcclGroup.from_env() as group:
        dev, r = group.device, group.rank
        stream = fd.Stream(dev)
        caches = [fd.ShardedKVCache(n_kv, hd, a.tokens, group=group, dtype=dt)
                  for _ in range(a.layers)]  # fmt: skip
        decoders = [fd.ShardedDecoder(c, n_heads=n_heads) for c in caches]
        rng = np.random.default_rng(11)  # the same queries on every rank
        qs = rng.uniform(-1, 1, (a.layers, n_heads, hd)).astype(dt)
        q_d = [fd.to_device(q, device=dev) for q in qs]
        outs = [fd.empty((n_heads, hd), dt, device=dev) for _ in caches]
        for i, c in enumerate(caches):
            fill_uniform(c.k, 1000 * i + 2 * r, stream)  # (each rank its own tokens' values)
            fill_uniform(c.v, 1000 * i + 2 * r + 1, stream)
            c.set_length(a.tokens)
        held = 2 * a.layers * caches[0].local_len * n_kv * hd * 2
        total = 2 * a.layers * a.tokens * n_kv * hd * 2
        _, memory = dev.mem_info()

        def token() -> None:
            for d, q, out in zip(decoders, q_d, outs, strict=True):
                d.decode_async(q, out, stream=stream)

        token()
        stream.synchronize()
        exe = captured(stream, token)
        ms = time_events(lambda i: exe.launch(stream), stream, 20, 3) / 1e3
        exe.close()
        worst = 0.0
        for i in np.linspace(0, a.layers - 1, a.check).astype(int):
            got = outs[i].to_host(stream).astype(np.float64)
            n = caches[i].local_len
            k = caches[i].k.to_host(stream)[:n].astype(np.float64)
            v = caches[i].v.to_host(stream)[:n].astype(np.float64)
            part = fd.reference_gqa_decode(qs[i], k, v, n_heads=n_heads, n_kv_heads=n_kv,
                                           head_dim=hd, return_lse=True)  # fmt: skip
            outs_all = group.all_gather_host(np.asarray(part[0], np.float64))
            lses_all = group.all_gather_host(np.asarray(part[1], np.float64))
            ref, _ = merge_states(outs_all, lses_all)
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            worst = max(worst, err)
        if r == 0:
            print(f"{a.layers} layers of {a.shape} bf16 at {a.tokens} tokens: {total / 1e9:.1f} "
                  f"GB of K and V over {group.world} GPU(s) ({held / 1e9:.1f} GB on each, of "
                  f"{memory / 1e9:.0f}); {ms:.3f} ms per token, all layers; {a.check} layers "
                  f"against the float64 reference: worst {worst:.1e}", flush=True)  # fmt: skip
        for c in caches:
            c.close()
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
