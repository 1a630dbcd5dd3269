"""A sequence sharded over every GPU here through NCCL (one rank per GPU, started by the
launcher): eager and graph-replayed decodes equal to the unsharded one (tests/
sharded_ranks.py checks each rank's). With one GPU, a group of one rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ferrox_driver as fd

pytestmark = pytest.mark.gpu

RANKS = Path(__file__).parents[1] / "helpers" / "sharded_ranks.py"


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_every_rank_decodes_the_whole_sequence_eagerly_and_in_a_graph(dtype):
    pytest.importorskip("nccl.bindings.nccl", reason="the [distributed] extra (nccl4py)")
    n = fd.device_count()
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "ferrox_driver.launcher", "-n", str(n), str(RANKS), dtype],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == n and all(line.endswith(": ok") for line in lines), out
