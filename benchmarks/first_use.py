"""What a first decode costs from an empty kernel cache: each case in a fresh process with
a fresh cache directory, timed from before ``import ferrox_driver`` to the first result on
the host (import, context, compile, load, decode), and then the same call again.

    python3 benchmarks/first_use.py [PACKAGE_DIR [CASES]]

PACKAGE_DIR (default: this checkout) is put first on the path, so an older tree times its
own first use in the same run; CASES: how many of the cases (default: all).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

CASES = [  # dtype, n_heads, n_kv_heads, head_dim
    ("bf16", 32, 8, 128),
    ("f16", 32, 8, 96),
    ("f32", 32, 8, 128),
    ("bf16", 40, 8, 80),
]

CHILD = """
import time
t0 = time.perf_counter()
import numpy as np, ml_dtypes
import ferrox_driver as fd
dt = {{"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}}["{dtype}"]
rng = np.random.default_rng(0)
q = rng.standard_normal(({h}, {d})).astype(dt)
k = rng.standard_normal((4096, {kv}, {d})).astype(dt)
v = rng.standard_normal((4096, {kv}, {d})).astype(dt)
kw = dict(n_heads={h}, n_kv_heads={kv}, head_dim={d})
fd.gqa_decode(q, k, v, **kw)
t1 = time.perf_counter()
fd.gqa_decode(q, k, v, **kw)
t2 = time.perf_counter()
print(f"{{t1 - t0:.2f}} {{t2 - t1:.3f}}")
"""


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    print(f"first use from an empty kernel cache ({root}):")
    print(f"  {'case':<18} {'first result (s)':>17} {'second call (s)':>16}")
    cases = CASES[: int(sys.argv[2])] if len(sys.argv) > 2 else CASES
    for dtype, h, kv, d in cases:
        with tempfile.TemporaryDirectory() as cache:
            code = CHILD.format(dtype=dtype, h=h, kv=kv, d=d)
            env = {"PYTHONPATH": str(root), "FERROX_CACHE_DIR": cache, "PATH": "/usr/bin:/bin"}
            done = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=root
            )
            if done.returncode:
                print(done.stderr[-2000:])
                sys.exit(1)
            first, second = done.stdout.split()
            print(f"  {f'{dtype} {h}/{kv}/{d}':<18} {first:>17} {second:>16}")


if __name__ == "__main__":
    main()
