"""``python -m ferrox_driver.launcher -n N script.py [args]`` (or ``-m module [args]``):
start N ranks of a program on this machine, one per GPU, each with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and the group's NCCL id (``FERROX_NCCL_ID``), which
``distributed.NcclGroup.from_env()`` reads. NVLink multicast (NVLS) stays off unless the
environment says otherwise. If a rank fails, the others are stopped; the exit status is
the first failing rank's (0 when all succeed).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

__all__ = ["launch", "main", "rank_environments"]


def rank_environments(n: int, unique_id: bytes, base: dict[str, str]) -> list[dict[str, str]]:
    """The environment of each of ``n`` ranks: ``base`` and the group's variables."""
    from .distributed import ID_ENV

    envs = []
    for rank in range(n):
        env = dict(base)
        env.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(n))  # fmt: skip
        env[ID_ENV] = unique_id.hex()
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        envs.append(env)
    return envs


def launch(command: Sequence[str], envs: list[dict[str, str]], poll: float = 0.05,
           start: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen) -> int:  # fmt: skip
    """Run ``command`` once per environment; wait for all. A rank that fails stops the rest
    (SIGTERM, then SIGKILL after 10 s). Returns the first failing rank's status, else 0."""
    procs = [start(list(command), env=env) for env in envs]
    failed = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [c for c in codes if c not in (None, 0)]
            if bad and not failed:
                failed = bad[0]
                for p, c in zip(procs, codes, strict=True):
                    if c is None:
                        p.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 10
                while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                    time.sleep(poll)
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            if all(c is not None for c in (p.poll() for p in procs)):
                return failed
            time.sleep(poll)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.kill()
        raise


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The launcher's own options (up to ``-m MODULE`` or the script) and the program's
    arguments, which may look like options (``-m module --seqs 1``)."""
    argv = list(argv)
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] in ("-n", "--nproc", "-m"):
            i += 2
            if argv[i - 2] == "-m":
                break
        else:
            i += 1
    return argv[:i], argv[i:]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ferrox_driver.launcher", description=__doc__)
    ap.add_argument("-n", "--nproc", type=int, required=True, help="ranks (one per GPU)")
    ap.add_argument("-m", dest="module", help="run a module, as python -m")
    ours, program = _split(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(ours)
    if a.nproc < 1:
        ap.error(f"-n: expected at least 1, got {a.nproc}")
    if a.module is None and not program:
        ap.error("a script (or -m module) to run")
    from .distributed import new_unique_id

    command = [sys.executable, *(["-m", a.module] if a.module else []), *program]
    return launch(command, rank_environments(a.nproc, new_unique_id(), dict(os.environ)))


if __name__ == "__main__":
    sys.exit(main())
