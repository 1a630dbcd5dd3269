"""Run a few decodes of ferrox and of PyTorch SDPA, for a profiler to time each kernel.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv \
        python3 benchmarks/profile_decode.py > kernels.csv

Each point runs each library twice (the second run is the one to read); the KV data is
fresh random values. Arguments "H/KV/D:dtype:seq" replace the points below.
"""

from __future__ import annotations

import sys

import torch  # first: importing it after ferrox's GPU work failed on the H200 image

import ferrox_driver as fd
from ferrox_driver.decode.checks import SUPPORTED_DTYPES
from ferrox_driver.decode.records import launch_decode

POINTS = [
    ((32, 8, 128), "bf16", 512),
    ((32, 8, 128), "bf16", 4096),
    ((32, 8, 128), "bf16", 32768),
    ((8, 1, 256), "bf16", 512),
    ((8, 1, 256), "bf16", 32768),
    ((16, 2, 64), "bf16", 32768),
    ((32, 8, 128), "f32", 4096),
]
TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def parse_point(arg: str) -> tuple[tuple[int, int, int], str, int]:
    shape, dtype, seq = arg.split(":")
    n_heads, n_kv, hd = (int(x) for x in shape.split("/"))
    return (n_heads, n_kv, hd), dtype, int(seq)


def main() -> None:
    points = [parse_point(a) for a in sys.argv[1:]] or POINTS
    for (n_heads, n_kv, hd), dtype, seq in points:
        tdt = TORCH_DTYPES[dtype]
        q = torch.rand(1, n_heads, 1, hd, device="cuda", dtype=tdt)
        k = torch.rand(1, n_kv, seq, hd, device="cuda", dtype=tdt)
        v = torch.rand(1, n_kv, seq, hd, device="cuda", dtype=tdt)
        torch.cuda.synchronize()
        print(f"point {n_heads}/{n_kv}/{hd} {dtype} {seq}", file=sys.stderr)
        for _ in range(2):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.cuda.synchronize()
        # ferrox layout [token][kv_head][head_dim]
        k_host = k[0].transpose(0, 1).float().cpu().numpy()
        v_host = v[0].transpose(0, 1).float().cpu().numpy()
        q_host = q.reshape(n_heads, hd).float().cpu().numpy()
        np_dt = next(d for d, name in SUPPORTED_DTYPES.items() if name == dtype)
        qd = fd.to_device(q_host.astype(np_dt))
        kd = fd.to_device(k_host.astype(np_dt))
        vd = fd.to_device(v_host.astype(np_dt))
        out = fd.empty((n_heads, hd), np_dt)
        for _ in range(2):
            launch_decode(
                qd, kd, vd, out, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd, seq_len=seq
            )
        fd.Device(0).synchronize()
        for a in (qd, kd, vd, out):
            a.close()


if __name__ == "__main__":
    main()
