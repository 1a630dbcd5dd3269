"""A speculative decoding loop: append k draft tokens, verify all k queries in one decode
(causal, or a draft tree's mask), keep the accepted tokens and roll the rest back. First
eagerly through KVCache, then captured once as a CUDA graph whose rollback count is read
on the device. Needs a GPU. Exits non-zero when a check fails."""

import sys

import ml_dtypes
import numpy as np

import ferrox_driver as fd

n_heads, n_kv_heads, head_dim, k = 32, 8, 128, 4
bf16 = ml_dtypes.bfloat16
rng = np.random.default_rng()


def rows(n):  # n tokens' K or V rows
    return rng.standard_normal((n, n_kv_heads, head_dim)).astype(bf16)


prompt_k, prompt_v = rows(1000), rows(1000)
with fd.KVCache(n_kv_heads, head_dim, capacity=4096, dtype=bf16) as kv:
    kv.extend(prompt_k, prompt_v)
    kept_k, kept_v = [prompt_k], [prompt_v]

    # 1. Eager: extend by the drafts, verify them, truncate to what was accepted.
    for _ in range(3):
        draft_k, draft_v = rows(k), rows(k)
        q = rng.standard_normal((k, n_heads, head_dim)).astype(bf16)
        kv.extend(draft_k, draft_v)
        out = kv.decode(q)  # (k, n_heads, head_dim): query t sees tokens up to its own
        accepted = int(rng.integers(0, k + 1))  # (a model compares its tokens with the draft's)
        kv.truncate(kv.seq_len - k + accepted)
        kept_k.append(draft_k[:accepted])
        kept_v.append(draft_v[:accepted])

    # A draft tree: token t sees its ancestors only (token 2 branches off token 0).
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=bool)

    # 2. Captured: the same step as one graph (drafts in, verify under the tree mask, roll
    # back to a count on the device), replayed per step.
    q_d = fd.empty((k, n_heads, head_dim), bf16)
    k_d, v_d = fd.empty((k, n_kv_heads, head_dim), bf16), fd.empty((k, n_kv_heads, head_dim), bf16)
    out_d = fd.empty((k, n_heads, head_dim), bf16)
    mask_d = fd.to_device(tree)
    keep_d = fd.to_device(np.array([kv.seq_len], np.int32))  # the length to roll back to
    kv.prepare(n_heads, n_q=k)  # kernels and scratch before the capture
    with fd.Stream() as s:
        with s.capture() as graph:
            fd.kv_append_async(kv, k_d, v_d, stream=s)  # k rows in one launch
            fd.gqa_decode_async(q_d, kv, out_d, stream=s, tree_mask=mask_d)
            fd.kv_truncate_async(kv, keep_d, stream=s)
        step = graph.instantiate()
        graph.close()
        for _ in range(20):
            draft_k, draft_v = rows(k), rows(k)
            q = rng.standard_normal((k, n_heads, head_dim)).astype(bf16)
            accepted = int(rng.integers(0, k + 1))
            for dev, host in ((q_d, q), (k_d, draft_k), (v_d, draft_v)):
                dev.copy_from_host(host)
            keep_d.copy_from_host(np.array([kv.seq_len + accepted], np.int32))
            step.launch(s)
            s.synchronize()
            kept_k.append(draft_k[:accepted])
            kept_v.append(draft_v[:accepted])
        step.close()
    ref = fd.reference_gqa_decode(
        q, np.concatenate([*kept_k[:-1], draft_k]), np.concatenate([*kept_v[:-1], draft_v]),
        tree_mask=tree,
    )  # fmt: skip
    err = np.linalg.norm(out_d.to_host().astype(np.float64) - ref) / np.linalg.norm(ref)
    cache_k, _ = kv.to_host()
    same = cache_k.tobytes() == np.concatenate(kept_k).tobytes()
    print(f"{kv.seq_len} tokens kept after 23 verify steps of {k} drafts; last verify's "
          f"relative error {err:.2e}; cache bytes as kept: {same}")  # fmt: skip
if not (err < 1e-2 and same):
    sys.exit("the verify loop does not match the reference")
