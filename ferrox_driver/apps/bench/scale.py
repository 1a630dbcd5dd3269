"""``bench --only scale``: one sequence's decode sharded over N GPUs (ferrox_driver.parallel.sharded
over NCCL), per token and per layer, next to the unsharded decode on one GPU.

Each rank of ``python -m ferrox_driver.launcher -n N -m ferrox_driver.apps.bench.scale`` holds
its share of a 32/8/128 bf16 cache (filled on the device), in two layers' caches that a
captured graph decodes in turn (partial decode with LSE, the NCCL all-gather, the merge),
so that two reads of one cache are past the L2 where the shares allow; CUDA events on
the rank's stream, the median of 30 replays. Rank 0 also times the unsharded decode of
the whole sequence on its GPU, where it fits, and prints one JSON line per length
(``SCALE {...}``); ``bench --only scale`` runs the launcher for 1, 2, 4 and 8 GPUs (those
there are) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from ...driver.memory import empty, zeros
from ...driver.stream import Stream
from ...parallel.sharded import ShardedDecoder, ShardedKVCache
from .harness import captured, fill_uniform, time_events

__all__ = ["SCALE_SEQS", "run_scale_bench", "scale_table"]

SCALE_SEQS = [131072, 1 << 20, 4 << 20]
SHAPE = (32, 8, 128)
LAYERS = 2  # caches decoded in turn in one graph


def _time_sharded(group: Any, seq: int, stream: Stream) -> float:
    n_heads, n_kv, hd = SHAPE
    dt = ml_dtypes.bfloat16
    caches = [ShardedKVCache(n_kv, hd, seq, group=group, dtype=dt) for _ in range(LAYERS)]
    decoders = [ShardedDecoder(c, n_heads=n_heads) for c in caches]
    q = empty((n_heads, hd), dt, device=group.device)
    out = empty((n_heads, hd), dt, device=group.device)
    fill_uniform(q, 7, stream)
    for i, c in enumerate(caches):
        fill_uniform(c.k, 2 * i, stream)
        fill_uniform(c.v, 2 * i + 1, stream)
        c.set_length(seq)

    def body() -> None:
        for d in decoders:
            d.decode_async(q, out, stream=stream)

    body()
    stream.synchronize()
    exe = captured(stream, body)
    us = time_events(lambda i: exe.launch(stream), stream, 30, 5, LAYERS)
    exe.close()
    for c in caches:
        c.close()
    return us


def _time_unsharded(device: Any, seq: int, stream: Stream) -> float | None:
    from ...cache.device_ops import gqa_decode_async

    n_heads, n_kv, hd = SHAPE
    dt = ml_dtypes.bfloat16
    need = LAYERS * 2 * seq * n_kv * hd * 2
    free, _ = device.mem_info()
    if need > 0.8 * free:
        return None
    kv = [(empty((seq, n_kv, hd), dt, device=device), empty((seq, n_kv, hd), dt, device=device))
          for _ in range(LAYERS)]  # fmt: skip
    q = empty((n_heads, hd), dt, device=device)
    out = empty((n_heads, hd), dt, device=device)
    length = zeros((1,), np.int32, device=device)
    length.copy_from_host(np.array([seq], np.int32))
    fill_uniform(q, 7, stream)
    for i, (k, v) in enumerate(kv):
        fill_uniform(k, 2 * i, stream)
        fill_uniform(v, 2 * i + 1, stream)

    def body() -> None:
        for pair in kv:
            gqa_decode_async(q, pair, out, n_heads=n_heads, stream=stream, seq_len=length)

    body()
    stream.synchronize()
    exe = captured(stream, body)
    us = time_events(lambda i: exe.launch(stream), stream, 30, 5, LAYERS)
    exe.close()
    for k, v in kv:
        k.close()
        v.close()
    return us


def rank_main(argv: Sequence[str] | None = None) -> int:
    """One rank's part (under the launcher)."""
    from ...parallel.distributed import NcclGroup

    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=SCALE_SEQS)
    a = ap.parse_args(argv)
    with NcclGroup.from_env() as group:
        stream = Stream(group.device)
        for seq in a.seqs:
            us = _time_sharded(group, seq, stream)
            worst = float(group.all_gather_host(np.array([us], np.float64)).max())
            if group.rank == 0:
                alone = _time_unsharded(group.device, seq, stream)
                row = {"gpus": group.world, "seq_len": seq, "sharded_us": worst,
                       "unsharded_us": alone}  # fmt: skip
                print("SCALE " + json.dumps(row), flush=True)
        stream.close()
    return 0


def run_scale_bench(gpus: Sequence[int], seqs: Sequence[int]) -> list[dict[str, Any]]:
    """Run the launcher for each count in ``gpus``; the rows rank 0 printed."""
    rows = []
    for n in gpus:
        cmd = [sys.executable, "-m", "ferrox_driver.launcher", "-n", str(n), "-m",
               "ferrox_driver.apps.bench.scale", "--seqs", *map(str, seqs)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{n} GPUs: the ranks failed:\n{done.stdout}\n{done.stderr}")
        rows += [json.loads(line[6:]) for line in done.stdout.splitlines()
                 if line.startswith("SCALE ")]  # fmt: skip
    return rows


def scale_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a table: per token and layer, against one GPU's unsharded decode."""
    lines = [f"{'GPUs':>4} {'tokens':>9} {'sharded us':>11} {'one GPU us':>11} "
             f"{'ratio':>7} {'target 1.25/N':>14}"]  # fmt: skip
    for r in rows:
        alone = r["unsharded_us"]
        ratio = f"{r['sharded_us'] / alone:7.3f}" if alone else f"{'-':>7}"
        one = f"{alone:11.1f}" if alone else f"{'(no fit)':>11}"
        lines.append(f"{r['gpus']:>4} {r['seq_len']:>9} {r['sharded_us']:>11.1f} {one} "
                     f"{ratio} {1.25 / r['gpus']:>14.3f}")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(rank_main())
