"""One rank of tests/parallel/test_gpu_sharded_nccl.py (started by ferrox_driver.launcher, one per
GPU): a sequence sharded over the ranks through NCCL, 500 tokens appended from device rows
(every rank the same), decoded eagerly and by a captured graph of the whole token (append,
partial decode, all-gather, merge) replayed, each result against the unsharded decode of
the whole sequence on this rank's GPU (fp32 to 1e-6, bf16 to 1e-2) and the float64
reference. Prints one line; exit status 1 on a mismatch.

    python -m ferrox_driver.launcher -n N tests/helpers/sharded_ranks.py f32|bf16
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

import ferrox_driver as fd
from ferrox_driver.parallel.distributed import NcclGroup

DTYPES = {"f32": (np.float32, 1e-6, 1e-5), "bf16": (ml_dtypes.bfloat16, 1e-2, 1e-2)}


def rel(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), want.astype(np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def main(name: str) -> int:
    dt, tol, tol_ref = DTYPES[name]
    n_heads, n_kv, hd, first, total = 16, 4, 128, 40, 540
    rng = np.random.default_rng(7)  # every rank draws the same sequence
    k = rng.standard_normal((total, n_kv, hd)).astype(dt)
    v = rng.standard_normal((total, n_kv, hd)).astype(dt)
    qs = rng.standard_normal((total, n_heads, hd)).astype(dt)
    sinks = rng.standard_normal(n_heads).astype(np.float32)
    features = dict(logits_soft_cap=30.0, scale=0.09)
    worst = [0.0, 0.0]
    with NcclGroup.from_env() as group:
        dev = group.device
        stream = fd.Stream(dev)
        cache = fd.ShardedKVCache(n_kv, hd, total, group=group, block=3, dtype=dt)
        decoder = fd.ShardedDecoder(cache, n_heads=n_heads, sinks=fd.to_device(sinks, device=dev),
                                    **features)  # fmt: skip
        cache.extend(k[:first], v[:first])
        q_d, out = fd.empty((n_heads, hd), dt, device=dev), fd.empty((n_heads, hd), dt, device=dev)
        k_d, v_d = fd.empty((n_kv * hd,), dt, device=dev), fd.empty((n_kv * hd,), dt, device=dev)

        def token() -> None:
            cache.append_async(k_d, v_d, stream=stream)
            decoder.decode_async(q_d, out, stream=stream)

        def check(t: int) -> None:
            got = out.to_host(stream)
            n = t + 1
            want = fd.gqa_decode(qs[t], k[:n], v[:n], n_heads=n_heads, n_kv_heads=n_kv,
                                 head_dim=hd, device=dev, sinks=sinks, **features)  # fmt: skip
            ref = fd.reference_gqa_decode(qs[t], k[:n], v[:n], n_heads=n_heads, n_kv_heads=n_kv,
                                          head_dim=hd, sinks=sinks, **features)  # fmt: skip
            worst[0], worst[1] = max(worst[0], rel(got, want)), max(worst[1], rel(got, ref))

        graph = None
        for t in range(first, total):
            q_d.copy_from_host(qs[t], stream)
            k_d.copy_from_host(k[t].ravel(), stream)
            v_d.copy_from_host(v[t].ravel(), stream)
            out.fill_bytes(0xFF, stream)  # NaN: an unwritten output shows
            if t < first + 250:  # eager
                token()
            else:  # one captured graph of the whole token, replayed
                if graph is None:
                    with stream.capture() as g:
                        token()
                    graph = g.instantiate()
                graph.launch(stream)
            if t % 37 == 0 or t in (first, first + 250, total - 1):
                check(t)
        stream.synchronize()
        held = cache.local_len
        ok = cache.seq_len == total and worst[0] < tol and worst[1] < tol_ref
        print(f"rank {group.rank} of {group.world} {name}: {held} tokens, worst against the "
              f"unsharded decode {worst[0]:.1e}, the reference {worst[1]:.1e}: "
              f"{'ok' if ok else 'MISMATCH'}", flush=True)  # fmt: skip
        cache.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
