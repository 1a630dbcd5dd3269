"""benchmarks/toy_llama.py on the GPU, small: a whole token of a Llama-shaped model in one
PyTorch CUDA graph with ferrox's attention gives logits as close to float32 attention's as
SDPA's are (the script exits non-zero otherwise) and prints its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "toy_llama.py"


def test_a_token_graph_of_a_toy_llama_matches_sdpa():
    pytest.importorskip("torch")
    args = ["--small", "--layers", "2", "--contexts", "1,777", "--steps", "8"]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [
        line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["1"], ["777"])
    ]
    # the first-step logits against float32 attention's: ferrox's (KVCache), ferrox's over
    # the static cache in place, SDPA's (2 layers: all close)
    assert len(rows) == 2 and all(float(e) < 1e-2 for r in rows for e in r[-3:]), done.stdout


def test_the_toy_models_logits_with_quantized_caches_rank_by_their_bits():
    """cache_logits_errors (bench --only kv4's toy row): every format's logits differ from
    the bf16 cache's (nothing silently read as bf16), fp8's least, the 4-bit ones' more but
    within the accuracy table's range."""
    pytest.importorskip("torch")
    import ml_dtypes

    from ferrox_driver.apps.toy_llama import SMALL, ToyLlama, cache_logits_errors

    model = ToyLlama(2, **SMALL)
    errors = cache_logits_errors(
        model, 300, {"e4m3": ml_dtypes.float8_e4m3fn, "int4": "int4", "nvfp4": "nvfp4"}
    )
    assert set(errors) == {"e4m3", "int4", "nvfp4"}
    assert 0 < errors["e4m3"] < min(errors["int4"], errors["nvfp4"]), errors
    assert max(errors.values()) < 0.5, errors
