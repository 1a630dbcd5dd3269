"""One sequence split over three shards on one GPU (LocalGroup): every token appended from
device rows, the decode of every shard merged exactly, checked against the float64
reference of the whole sequence."""

import sys

import numpy as np

import ferrox_driver as fd

n_heads, n_kv, hd, tokens = 16, 4, 128, 300
rng = np.random.default_rng()
k = rng.standard_normal((tokens, n_kv, hd)).astype(np.float32)
v = rng.standard_normal((tokens, n_kv, hd)).astype(np.float32)
q = rng.standard_normal((n_heads, hd)).astype(np.float32)

stream = fd.Stream()
ranks = fd.LocalGroup.ranks(3)  # three shards, round robin
caches = [fd.ShardedKVCache(n_kv, hd, tokens, group=g) for g in ranks]
decoders = [fd.ShardedDecoder(c, n_heads=n_heads) for c in caches]
outs = [fd.empty((n_heads, hd), np.float32) for _ in ranks]
k_row, v_row = fd.empty((n_kv * hd,), np.float32), fd.empty((n_kv * hd,), np.float32)
for t in range(tokens):  # every rank is given every token and keeps its own
    k_row.copy_from_host(k[t].ravel(), stream)
    v_row.copy_from_host(v[t].ravel(), stream)
    for c in caches:
        c.append_async(k_row, v_row, stream=stream)
fd.ShardedDecoder.decode_all(decoders, fd.to_device(q), outs, stream=stream)

ref = fd.reference_gqa_decode(q, k, v, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd)
errs = [np.linalg.norm(o.to_host(stream) - ref) / np.linalg.norm(ref) for o in outs]
print(
    f"shards hold {[c.local_len for c in caches]} tokens; every rank's result against "
    f"the reference: {max(errs):.1e}"
)
sys.exit(0 if max(errs) < 1e-5 else 1)
