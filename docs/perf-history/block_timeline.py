"""When do the split kernel's blocks start, leave their loop and finish? A copy of the
fp16/bf16 tensor-core kernel (combine plans) that reads %globaltimer (ns) at its start,
after each warp's main loop, at two points of its epilogue and at its end, into scratch
past the workspace; one decode (the last of a run over rotated KV sets, so from memory),
eager.

    PYTHONPATH=. python3 docs/perf-history/block_timeline.py

Per point, microseconds from the first block's start: the spread over the blocks of their
start, their first and last warp's loop end, and their end (min / median / 90th percentile
/ max); then the epilogue's stages, from the last warp's loop end: warp statistics parked
(a barrier), fragments parked (a barrier), the end (partial written). The last block's end
is what the combine kernel waits for; a wide spread of loop ends at equal work is the
memory system serving the blocks (or warps) unevenly.
"""

from __future__ import annotations

import os
import re

import numpy as np

os.environ["FERROX_CLUSTER"] = "0"

from points import edited_source, load_variant, points

import ferrox_driver as fd

CASES = [
    ((32, 8, 128), "bf16", [4096, 32768, 131072]),
    ((32, 32, 128), "bf16", [32768]),
    ((28, 4, 128), "bf16", [32768]),
    ((16, 2, 64), "bf16", [32768, 131072]),
    ((8, 1, 256), "bf16", [131072]),
]
NOW = 'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(NAME));'
# the end of gqa_split_mma: its fx_finish call (T: not the fp32 kernel's)
FINISH = re.compile(
    r"(    fx_finish<CLUSTER, WARPS, D, SLOTS, WARPS \* S \* 2 \* STEP \* \(int\)sizeof\(T\)>"
    r"\([^;]*;)\n}"
)
END = (
    "\n    __syncthreads();\n    "
    + NOW.replace("NAME", "t_end")
    + "\n    if (threadIdx.x == 0) {\n"
    "        unsigned long long* tb = reinterpret_cast<unsigned long long*>(\n"
    "            ws_ml + (long long)n_heads * splits * 2)\n"
    "            + 12 * (blockIdx.y * gridDim.x + split);\n"
    "        tb[0] = t_start; tb[1] = t_end;\n"
    "        tb[10] = t_stats; tb[11] = t_parked;\n"
    "        for (int w = 0; w < WARPS; ++w) tb[2 + w] = t_warp[w];\n"
    "    }\n}"
)
EDITS = [
    (
        "    const int split = blockIdx.x;\n    int start, end;\n"
        "    if (!fx_block_chunk<CLUSTER, D>(WARPS * S * 2 * STEP * sizeof(T),",
        "    const int split = blockIdx.x;\n    unsigned long long t_start, t_loop, t_end;\n    "
        + NOW.replace("NAME", "t_start")
        + "\n    int start, end;\n"
        "    if (!fx_block_chunk<CLUSTER, D>(WARPS * S * 2 * STEP * sizeof(T),",
    ),
    (  # every warp's loop end, kept in shared memory until the block's end
        "    fx_cp_async_wait<0>();  // no copy may land after the block has left",
        "    fx_cp_async_wait<0>();  // no copy may land after the block has left\n    "
        + NOW.replace("NAME", "t_loop")
        + "\n    __shared__ unsigned long long t_warp[WARPS];\n"
        "    if (lane == 0) t_warp[warp] = t_loop;",
    ),
    (  # the epilogue's stages: warp statistics parked (barrier), fragments parked (barrier)
        "    fx_warp_weights<WARPS>(m_s, w_s);\n    fx_park_fragments(o_f, oacc, warp, lane);\n"
        "    __syncthreads();\n    // d = hb*64",
        "    unsigned long long t_stats, t_parked;\n    "
        + NOW.replace("NAME", "t_stats")
        + "\n    fx_warp_weights<WARPS>(m_s, w_s);\n    fx_park_fragments(o_f, oacc, warp, lane);\n"
        "    __syncthreads();\n    " + NOW.replace("NAME", "t_parked") + "\n    // d = hb*64",
    ),
]


def timeline_source() -> str:
    src, n = FINISH.subn(lambda m: m.group(1) + END, edited_source(EDITS))
    assert n == 1, n
    return src


def spread(x: np.ndarray, digits: int = 1) -> str:
    q = np.percentile(x, [0, 50, 90, 100]) / 1e3
    return "/".join(f"{v:.{digits}f}" for v in q)


def main() -> None:
    stream = fd.Stream()
    module = load_variant(timeline_source(), "timeline.cu")
    print("us from the first block's start: min/median/p90/max")
    for p in points(CASES, stream):
        plan = p.plan()
        kernel = module.get_function(plan.kernel)
        blocks = plan.splits * p.n_kv
        floats = plan.workspace_floats(p.n_heads, p.head_dim)
        ws = fd.to_device(np.zeros(floats + 24 * blocks + 2, np.float32))
        for kv in p.sets:  # the last decode's times stay
            p.decode(plan, ws, kernel, kv)
        stream.synchronize()
        t = ws.to_host()[floats : floats + 24 * blocks].view(np.uint64).reshape(blocks, 12)
        ws.close()
        t = t[t[:, 0] > 0].astype(np.int64)
        warps = plan.threads // 32
        t0 = t[:, 0].min()
        loops = t[:, 2 : 2 + warps]
        print(
            f"{p.label} ({len(t)} blocks): "
            f"start {spread(t[:, 0] - t0)}  first warp's loop end "
            f"{spread(loops.min(1) - t0)}  last warp's {spread(loops.max(1) - t0)}  "
            f"end {spread(t[:, 1] - t0)}; from the last warp's loop end: statistics "
            f"parked {spread(t[:, 10] - loops.max(1), 2)}, fragments parked "
            f"{spread(t[:, 11] - loops.max(1), 2)}, end {spread(t[:, 1] - loops.max(1), 2)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
