"""Tensor-core chunk granularity (64, 32 or 16 tokens) at short lengths, with the combine
kernel and, where the chunks fit one resident cluster per KV head, the on-chip merge; in
the benchmark's back-to-back harness (one graph of >= 8 decodes over rotated KV sets).

    PYTHONPATH=. python3 docs/perf-history/tile_variants.py

A cell "tT/N" is a tile of T tokens, N chunks per KV head; "+c" merges in clusters. The
last column is what plan_split picks.
"""

from __future__ import annotations

import dataclasses
import os

import ml_dtypes
import numpy as np

import ferrox_driver as fd
from ferrox_driver.attention import clusters_fit, plan_split
from ferrox_driver.bench_decode import fill_uniform, rotated_kv_sets, time_split_plan

SEQS = [512, 4096]
CASES = [
    ((8, 1, 256), "f32"),
    ((8, 1, 256), "bf16"),
    ((16, 2, 64), "f32"),
    ((16, 2, 64), "bf16"),
    ((28, 4, 128), "bf16"),
    ((32, 8, 128), "bf16"),
]
DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16}
TC_TILES = (64, 32, 16)


def main() -> None:
    dev = fd.Device(0)
    stream = fd.Stream()
    for (n_heads, n_kv, hd), dtn in CASES:
        dt = DTYPES[dtn]
        item = np.dtype(dt).itemsize
        q = fd.empty((n_heads, hd), dt)
        out = fd.empty((n_heads, hd), dt)
        fill_uniform(q, 1, stream)
        print(f"{n_heads}/{n_kv}/{hd} {dtn} (us per decode, back to back)")
        for seq in SEQS:
            sets, chain = rotated_kv_sets(seq, n_kv, hd, dt, stream, dev)
            os.environ["FERROX_CLUSTER"] = "0"
            base = plan_split(dev, dt, n_heads, n_kv, hd, 1 << 20)  # the most chunks
            os.environ.pop("FERROX_CLUSTER")
            picked = plan_split(dev, dt, n_heads, n_kv, hd, seq)
            shared = base.shared_bytes(hd, item)
            runs = []
            for t in TC_TILES:
                s = min(base.splits, -(-seq // t))
                runs.append((f"t{t}/{s}", dataclasses.replace(base, splits=s, tile=t)))
                name = f"{base.kernel}_cluster"
                if clusters_fit(dev, name, s, n_kv, base.threads, shared):
                    plan = dataclasses.replace(base, kernel=name, splits=s, tile=t, cluster=s)
                    runs.append((f"t{t}/{s}+c", plan))
            cells = []
            for label, plan in runs:
                us = time_split_plan(plan, q, out, sets, chain, stream)
                cells.append(f"{label} {us:.1f}")
            pick = f"t{picked.tile}/{picked.splits}{'+c' if picked.cluster else ''}"
            print(f"  {seq:>5}: " + "  ".join(cells) + f"  | picked {pick}", flush=True)
            for k, v in sets:
                k.close()
                v.close()


if __name__ == "__main__":
    main()
