"""The modules one eager ``fd.gqa_decode`` passes through, entry to launch: the first call of
a signature (checks, plan, record) and a repeat (the validated call). Counts the package's
modules that run Python code, the calls that enter a module other than the caller's, and
the returns that come back up into one. Needs a GPU; runs against whatever
``ferrox_driver`` is importable (so it can measure an older checkout too).

    PYTHONPATH=. python3 benchmarks/call_path.py
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

import ferrox_driver as fd


def trace(fn: Any) -> tuple[list[str], int, int]:
    """(modules in order of first entry, cross-module calls, cross-module returns)."""
    order: list[str] = []
    stack: list[str] = []
    calls = returns = 0

    def hook(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls, returns
        if event not in ("call", "return"):
            return
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("ferrox_driver"):
            return
        if event == "call":
            if stack and stack[-1] != name:
                calls += 1
            if name not in order:
                order.append(name)
            stack.append(name)
        else:
            stack.pop()
            if stack and stack[-1] != name:
                returns += 1

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return order, calls, returns


def main() -> None:
    rng = np.random.default_rng(0)
    n_heads, n_kv, hd, seq = 32, 8, 128, 4096
    q = fd.to_device(rng.standard_normal((n_heads, hd), dtype=np.float32).astype(np.float16))
    k = fd.to_device(rng.standard_normal((seq, n_kv, hd), dtype=np.float32).astype(np.float16))
    v = fd.to_device(rng.standard_normal((seq, n_kv, hd), dtype=np.float32).astype(np.float16))
    kw = {"n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": hd}
    for label in ("first call", "repeat call"):
        order, calls, returns = trace(lambda: fd.gqa_decode(q, k, v, **kw))
        print(f"{label}: {len(order)} modules, {calls} calls into another module, "
              f"{returns} returns back up")  # fmt: skip
        print("  " + " -> ".join(m.removeprefix("ferrox_driver.") for m in order))
    fd.Device().synchronize()


if __name__ == "__main__":
    main()
