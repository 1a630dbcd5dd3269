"""The slow mode under Nsight Compute: one process profiles two decodes of the 32/8/128
bf16 4096-token point while fast (first thing in the process), another after the
benchmark's measure_point has run three times (which turned every probed process slow).
Only the region between cuProfilerStart and cuProfilerStop is profiled.

    ncu --profile-from-start off --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum,lts__t_sector_hit_rate.pct,... \
        python3 docs/perf-history/ncu_mode_probe.py fast|slow
"""

from __future__ import annotations

import sys

from points import points

import ferrox_driver as fd
from ferrox_driver import bench_decode
from ferrox_driver._driver import cu
from ferrox_driver.attention import stream_workspace


def main() -> None:
    bench_decode._torch = None  # no PyTorch in this process
    stream = fd.Stream()
    gen = points([((32, 8, 128), "bf16", [4096])], stream)  # held: closing it frees the point
    p = next(gen)
    plan = p.plan(clusters=False)
    if sys.argv[1] == "slow":
        for _ in range(3):
            bench_decode.measure_point((32, 8, 128), 4096, "bf16", 30, stream.device)
    print(f"{sys.argv[1]}: indicator {p.time(plan):.2f} us", flush=True)
    ws = stream_workspace(p.q.device, stream, plan.workspace_floats(p.n_heads, p.head_dim))
    stream.synchronize()
    cu.cuProfilerStart()
    for i in (1, 2):
        p.decode(plan, ws, kv=p.sets[i])
    stream.synchronize()
    cu.cuProfilerStop()


if __name__ == "__main__":
    main()
