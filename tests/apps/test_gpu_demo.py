"""The demo on the GPU, small: the decode loop's three paths pass their reference checks,
and the toy Llama-shaped model's token graph with ferrox's attention runs next to SDPA's
with logits as close to float32 attention's (the demo exits 1 otherwise)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def test_the_demo_runs_every_path_and_the_toy_model():
    pytest.importorskip("torch")
    argv = ["--layers", "2", "--tokens", "70", "--heads", "8", "--kv-heads", "2",
            "--model-context", "777", "--model-shape", "small"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "ferrox_driver", "demo", *argv],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "reference checks: all passed" in out and "model check: passed" in out, out
    for path in ("eager", "a graph per layer", "a graph per token"):
        assert any(line.startswith(path) for line in done.stdout.splitlines()), out
    row = next(line.split() for line in done.stdout.splitlines() if line.split()[:1] == ["777"])
    # ms per token of the three attentions, then the three logits' distances from float32's
    assert all(float(x) > 0 for x in row[1:4]) and all(float(e) < 1e-2 for e in row[-3:]), out


def test_the_demo_can_leave_the_model_out():
    argv = ["--layers", "1", "--tokens", "3", "--no-model"]
    done = subprocess.run([sys.executable, "-m", "ferrox_driver", "demo", *argv],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "reference checks: all passed" in done.stdout and "model" not in done.stdout


def test_the_demo_piped_into_a_reader_that_leaves_ends_quietly():
    # `python -m ferrox_driver demo | head -1` on a GPU: no BrokenPipeError, no traceback
    argv = ["--layers", "1", "--tokens", "3", "--no-model"]
    cmd = [sys.executable, "-m", "ferrox_driver", "demo", *argv]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with subprocess.Popen(cmd, **pipes) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read()
        status = proc.wait(timeout=600)
    assert first.startswith("decode loop: 1 layers x 3 tokens"), first
    assert status == 1 and "Traceback" not in err and "BrokenPipeError" not in err, err


def test_info_names_each_device_and_its_architecture():
    import ferrox_driver as fd

    done = subprocess.run([sys.executable, "-m", "ferrox_driver", "info"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    dev = fd.Device(0)
    line = next(x for x in done.stdout.splitlines() if x.startswith("device 0 "))
    assert f"{dev.name}, {dev.arch}, {dev.multiprocessor_count} SMs" in line, line
    assert "GPUs           compute capability 7.5 or newer" in done.stdout
