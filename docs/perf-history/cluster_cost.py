# ruff: noqa: B023  (closures are called before the loop moves on)
"""Where the cluster kernel's time goes at short lengths: the on-chip merge, its cluster
barrier and pushes, or the cluster launch itself. 32/8/128 bf16, KV in L2, 20 decodes back
to back in one graph (the harness of `bench --only overhead`).

    PYTHONPATH=. python3 docs/perf-history/cluster_cost.py

Variants of the cluster kernel (compiled from the current source, the v9 push merge):
- full: as shipped;
- pushes + barrier: every block pushes its partial and passes the cluster barrier, but
  the local merge and the output are left out;
- no merge: no pushes, barriers, merge or output (nor the cluster check), so it can also
  run without clusters.
(The v8 logs, cluster-cost-v8*.log, came from this script's v8 form: two barriers and
reads of the other blocks' shared memory; git history has it.)
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import ml_dtypes
import numpy as np

import ferrox_driver as fd
from ferrox_driver.attention import launch_split, plan_split
from ferrox_driver.bench_decode import fill_uniform, time_graph_body
from ferrox_driver.compiler import compile_source, kernel_source
from ferrox_driver.launch import Module

DT = ml_dtypes.bfloat16
N_HEADS, N_KV, HD = 32, 8, 128
NAME = "gqa_split_mma_bf16_d128_cluster"
MERGE = (
    "fx_cluster_merge<T, D, WARPS * 32>(recv, out, h0, group, fx_seq_len(seq_len, seq_len_dev));"
)
CHECK = "fx_check_cluster(splits);\n        fx_cluster_arrive_relaxed();"
PUSHES = 'static_assert(RING % 16 == 0 && D % 4 == 0, "the receive area must be 16-byte aligned");'


def variant(src: str, edits: dict[str, str]) -> str:
    for anchor, replacement in edits.items():
        assert anchor in src, anchor
        src = src.replace(anchor, replacement)
    return src


def main() -> None:
    dev = fd.Device(0)
    stream = fd.Stream()
    src = kernel_source("gqa_decode_split.cu")
    keep = "FX_MMA_ENTRY(gqa_split_mma_bf16_d128,"
    src = re.sub(
        r"^(FX_GENERIC_FOR_TYPE|FX_MMA_ENTRY|FX_TC32_ENTRY)\(.*$",
        lambda m: m.group(0) if m.group(0).startswith(keep) else "",
        src,
        flags=re.MULTILINE,
    )
    sources = {
        "full": src,
        "pushes + barrier": variant(
            src, {MERGE: "fx_cluster_arrive_release(); fx_cluster_wait();"}
        ),
        "no merge": variant(src, {PUSHES: "return;", CHECK: ""}),
    }
    kernels = {
        label: Module(compile_source(s, name="cluster_cost.cu"), dev).get_function(NAME)
        for label, s in sources.items()
    }

    print(f"{'us per decode':48} back to back   single")
    for seq in (64, 512):
        q = fd.empty((N_HEADS, HD), DT)
        out = fd.empty((N_HEADS, HD), DT)
        k = fd.empty((seq, N_KV, HD), DT)
        v = fd.empty((seq, N_KV, HD), DT)
        for i, a in enumerate((q, k, v)):
            fill_uniform(a, 50 + i, stream)
        os.environ["FERROX_CLUSTER"] = "0"
        base = plan_split(dev, DT, N_HEADS, N_KV, HD, seq)
        os.environ.pop("FERROX_CLUSTER")
        ws = fd.empty((base.workspace_floats(N_HEADS, HD),), np.float32)
        call = functools.partial(
            launch_split,
            q=q,
            k=k,
            v=v,
            out=out,
            workspace=ws,
            n_heads=N_HEADS,
            n_kv_heads=N_KV,
            head_dim=HD,
            seq_len=seq,
            seq_len_dev=None,
            stream=stream,
        )
        rows = {
            f"combine plan: split + combine ({base.splits} chunks)": lambda: call(base),
            "combine plan: split kernel alone": lambda: call(base, parts="main"),
        }
        cl = dataclasses.replace(base, kernel=NAME, cluster=base.splits)
        for label, kern in kernels.items():
            rows[f"cluster {cl.cluster}, {label}"] = functools.partial(call, cl, kernel=kern)
        args = (q, k, v, out, np.int32(N_HEADS), np.int32(N_KV), np.int32(seq), None)
        args += (np.int32(base.splits), np.int32(base.tile))
        shared = cl.shared_bytes(HD, 2)  # the cluster entry's ring and receive area
        for label in ("no merge", "full") if base.splits == 1 else ("no merge",):
            kern = kernels[label]
            rows[f"no cluster launch, {label}"] = functools.partial(
                kern.launch,
                (base.splits, N_KV, 1),
                base.threads,
                args,
                shared_mem=shared,
                stream=stream,
            )
        for label, body in rows.items():
            b2b, single = time_graph_body(stream, body)
            print(f"seq {seq:>4} {label:39} {b2b:8.2f} {single:8.2f}", flush=True)
        for a in (q, out, k, v, ws):
            a.close()


if __name__ == "__main__":
    main()
