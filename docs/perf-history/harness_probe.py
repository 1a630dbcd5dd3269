"""Why combine plans time 0.5-1 us slower in the benchmark (measure_point) than in
time_split_plan: the same decodes, back to back over the same rotated KV sets, timed
(a) as time_split_plan does, (b) the same after instantiating one single-decode graph
per KV set (as measure_point does before its chain), (c) measure_point's own chain
(launch_decode per decode, a fresh stream).

    PYTHONPATH=. python3 docs/perf-history/harness_probe.py [shape ...]
"""

from __future__ import annotations

import functools
import sys

from points import Point, points

import ferrox_driver as fd
from ferrox_driver.attention import launch_decode
from ferrox_driver.bench_decode import captured, time_events

CASES = [
    ((32, 8, 128), "bf16", [512, 4096]),
    ((64, 8, 128), "bf16", [512]),
]


def probe(p: Point) -> str:
    plan = p.plan(clusters=False)
    a = p.time(plan)

    def eager(i: int, s: fd.Stream) -> None:
        k, v = p.sets[i % len(p.sets)]
        launch_decode(
            p.q, k, v, p.out, n_heads=p.n_heads, n_kv_heads=p.n_kv, head_dim=p.head_dim,
            seq_len=p.seq, stream=s, plan=plan,
        )  # fmt: skip

    n = len(p.sets)
    singles = [captured(p.stream, functools.partial(eager, i, p.stream)) for i in range(n)]
    b = p.time(plan)
    fresh = fd.Stream()
    eager(0, fresh)
    fresh.synchronize()
    chained = captured(fresh, lambda: [eager(i, fresh) for i in range(p.chain)])
    c = time_events(lambda i: chained.launch(fresh), fresh, 30, 3, p.chain)
    d = p.time(plan)
    for e in [*singles, chained]:
        e.close()
    fresh.close()
    return (
        f"{p.label} {plan.kernel} ({plan.splits} chunks, {n} sets): time_split_plan {a:.2f} "
        f"us, after {n} single graphs {b:.2f}, launch_decode chain on a fresh stream {c:.2f}, "
        f"time_split_plan again {d:.2f}"
    )


def main() -> None:
    for p in points(CASES, fd.Stream(), sys.argv[1:]):
        print(probe(p), flush=True)


if __name__ == "__main__":
    main()
