"""One sequence sharded over every GPU of this machine through NCCL: the script starts
itself once per GPU (python -m ferrox_driver.launcher), each rank keeps its share of the
tokens, and every rank's decode, exchanged and merged, is checked against the float64
reference of the whole sequence. Needs the [distributed] extra (nccl4py)."""

import importlib.util
import os
import subprocess
import sys

import numpy as np

import ferrox_driver as fd

if importlib.util.find_spec("nccl") is None:
    print("needs nccl4py: pip install 'nccl4py>=0.6' (or '.[distributed]' from a checkout)")
    sys.exit(0)
if "RANK" not in os.environ:  # start one rank per GPU
    launch = [sys.executable, "-m", "ferrox_driver.launcher", "-n", str(fd.device_count())]
    sys.exit(subprocess.run([*launch, __file__]).returncode)

from ferrox_driver.parallel.distributed import NcclGroup

n_heads, n_kv, hd, tokens = 32, 8, 128, 500
rng = np.random.default_rng(1234)  # every rank draws the same tokens
k = rng.standard_normal((tokens, n_kv, hd)).astype(np.float32)
v = rng.standard_normal((tokens, n_kv, hd)).astype(np.float32)
q = rng.standard_normal((n_heads, hd)).astype(np.float32)

with NcclGroup.from_env() as group:
    cache = fd.ShardedKVCache(n_kv, hd, tokens, group=group, block=16)
    decoder = fd.ShardedDecoder(cache, n_heads=n_heads)
    cache.extend(k, v)  # this rank keeps its blocks of 16 tokens
    stream = fd.Stream(group.device)
    out = fd.empty((n_heads, hd), np.float32, device=group.device)
    decoder.decode_async(fd.to_device(q, device=group.device), out, stream=stream)
    got, held = out.to_host(stream), cache.local_len
    cache.close()
ref = fd.reference_gqa_decode(q, k, v, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd)
err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
print(f"rank {group.rank} of {group.world}: {held} tokens here, error {err:.1e}")
sys.exit(0 if err < 1e-5 else 1)
