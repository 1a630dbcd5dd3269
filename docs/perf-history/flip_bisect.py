"""Which part of measure_point flips a process into the slow mode (flip-probe*-v13.log: a
whole measure_point does, each of its steps done by hand on the indicator's arrays does
not): a copy of measure_point cut after stage N (1-6), then everything closed, with the
time_split_plan indicator (32/8/128 bf16 at 4096; fast ~9.45 us, slow ~10.1) before and
after. One stage count per process:

    for n in 1 2 3 4 5 6; do PYTHONPATH=. python3 docs/perf-history/flip_bisect.py $n; done
"""

from __future__ import annotations

import functools
import sys

import ml_dtypes
from points import points

import ferrox_driver as fd
from ferrox_driver.attention import launch_decode
from ferrox_driver.bench_decode import (
    captured,
    fill_uniform,
    rotated_kv_sets,
    time_events,
    time_replays,
)


def cut_measure_point(stages: int, seq: int = 4096) -> None:
    n_heads, n_kv, hd, dt = 32, 8, 128, ml_dtypes.bfloat16
    stream = fd.Stream()
    q = fd.empty((n_heads, hd), dt)
    out = fd.empty((n_heads, hd), dt)
    fill_uniform(q, 7, stream)
    rotated = rotated_kv_sets(seq, n_kv, hd, dt, stream, stream.device)
    sets, chain = rotated.sets, rotated.chain

    def eager(i: int) -> None:
        k, v = sets[i % len(sets)]
        launch_decode(
            q, k, v, out, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd, seq_len=seq,
            stream=stream,
        )  # fmt: skip

    execs = []
    if stages >= 2:
        eager(0)
        stream.synchronize()
    if stages >= 3:
        execs = [captured(stream, functools.partial(eager, i)) for i in range(len(sets))]
    if stages >= 4:
        execs.append(captured(stream, lambda: [eager(i) for i in range(chain)]))
    if stages >= 5:
        time_replays(execs[-1], chain, execs[:-1], stream, 30)
    if stages >= 6:
        time_events(eager, stream, 30, 5)
    stream.synchronize()
    for e in execs:
        e.close()
    rotated.close()
    q.close()
    out.close()
    stream.close()


def main() -> None:
    stages = int(sys.argv[1])
    stream = fd.Stream()
    gen = points([((32, 8, 128), "bf16", [4096])], stream)  # held: closing it frees the point
    ind = next(gen)
    before = ind.time(ind.plan())
    cut_measure_point(stages)
    after = [ind.time(ind.plan()) for _ in range(2)]
    print(f"stages {stages}: before {before:.2f} us, after {after[0]:.2f} {after[1]:.2f}")


if __name__ == "__main__":
    main()
