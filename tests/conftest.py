"""Shared test set-up: the `gpu` marker, an isolated kernel cache, random inputs."""

from __future__ import annotations

import os

import numpy as np
import pytest

import ferrox_driver as fd

REQUIRE_GPU = os.environ.get("FERROX_REQUIRE_GPU") == "1"
SHARD = os.environ.get("FERROX_SHARD", "")
SHARD_WEIGHT_INTEGRATIONS = 4


@pytest.hookimpl(trylast=True)  # (after -m and -k have deselected theirs)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """FERROX_SHARD=i/n keeps the i-th of n contiguous runs of the collected tests, so n
    processes at once run them all once (benchmarks/gpu_suite.sh). The runs are of equal
    weight, a test of tests/integrations weighing SHARD_WEIGHT_INTEGRATIONS (PyTorch and
    transformers models, torch.compile: on an H100 the last seventh of the GPU tests by
    count, mostly those, took 460 s where the others took 50-180 s)."""
    if not SHARD:
        return
    i, sep, n = SHARD.partition("/")
    if not (sep and i.isdigit() and n.isdigit() and 0 <= int(i) < int(n)):
        raise pytest.UsageError(f"FERROX_SHARD: expected i/n with 0 <= i < n, got {SHARD!r}")
    weights = [SHARD_WEIGHT_INTEGRATIONS if "integrations" in item.nodeid else 1
               for item in items]  # fmt: skip
    total, at, kept, dropped = sum(weights), 0, [], []
    for item, weight in zip(items, weights, strict=True):
        middle = at + weight / 2  # (the run a test falls in, by its middle)
        at += weight
        (kept if int(middle * int(n) // max(total, 1)) == int(i) else dropped).append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


_AVAILABLE: bool | None = None


def pytest_runtest_setup(item: pytest.Item) -> None:
    """GPU tests skip without a GPU, and fail instead when FERROX_REQUIRE_GPU=1."""
    global _AVAILABLE
    if item.get_closest_marker("gpu") is None:
        return
    if _AVAILABLE is None:
        _AVAILABLE = fd.cuda_available()
    if _AVAILABLE:
        return
    if REQUIRE_GPU:
        pytest.fail("FERROX_REQUIRE_GPU=1 but no CUDA driver/device is available", pytrace=False)
    pytest.skip("needs an NVIDIA GPU (no CUDA driver/device)")


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep the tests' disk cache out of the user's."""
    os.environ["FERROX_CACHE_DIR"] = str(tmp_path_factory.mktemp("kernel-cache"))
    os.environ.pop("FERROX_DISK_CACHE", None)


@pytest.fixture
def rng() -> np.random.Generator:
    """Fresh random inputs every run (the seed is printed on failure by numpy's repr)."""
    return np.random.default_rng()


@pytest.fixture(scope="session")
def device() -> fd.Device:
    return fd.Device(0)


@pytest.fixture(params=["split", "rows"])
def verify_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A verify's kernels: the tail, split and combine ones (split_verify.cuh), or the rows
    kernel where it takes the call (split_rows.cuh, Overrides.verify_rows)."""
    import dataclasses

    from ferrox_driver.decode import plan as attention

    rows = request.param == "rows"
    monkeypatch.setattr(
        attention, "OVERRIDES", dataclasses.replace(attention.OVERRIDES, verify_rows=rows)
    )
    return str(request.param)
