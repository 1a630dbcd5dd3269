"""Host time of ``gqa_decode`` over a growing cache (issue 47): ``k[:n]`` and ``k[:, :n]``
views with n one longer each call, 20,000 calls at random lengths with the device memory
they leave behind, next to the same call at one length and PyTorch's SDPA on the same
views; bf16. The measuring is ``ferrox_driver.apps.bench.growing.growing_rows`` (what
``bench --only torch`` reports); this prints its rows.

    PYTHONPATH=. python3 benchmarks/host_growing.py [n_heads/n_kv/head_dim]
"""

from __future__ import annotations

import json
import sys

from ferrox_driver.apps.bench.growing import growing_rows


def main(argv: list[str]) -> int:
    n_heads, n_kv, hd = (int(x) for x in (argv[1] if len(argv) > 1 else "32/8/128").split("/"))
    rows = growing_rows(n_heads, n_kv, hd)
    print(f"gqa_decode over a growing cache, {n_heads}/{n_kv}/{hd} bf16 (host us per call)")
    for name, value in rows.items():
        print(f"  {name:<30} {value:12.2f}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
