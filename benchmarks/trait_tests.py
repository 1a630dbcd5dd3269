"""A pytest plugin that runs the tests on kernels built with other traits: FERROX_TEST_TRAITS
(NAME=VALUE,...) changes SPLIT_TRAITS, and the 4-bit plans' warps and steps read from them,
before any kernel is built. Names may be SPLIT_TRAITS' or a kernel file's experiment defaults
(FX_Q4_PAIR, FX_Q4_PROBE: its #ifndef lines), so an experiment is tested as the library
would ship it, with no file edited:

    FERROX_TEST_TRAITS=FX_Q4_PAIR=1 PYTHONPATH=.:benchmarks FERROX_REQUIRE_GPU=1 \\
        python3 -m pytest -q -m gpu -p trait_tests tests/decode/test_gpu_kv4.py

(The traits go into the generated header that every kernel source includes, so the module
cache keys on them: a run with other traits never loads these kernels, nor they its.)
"""

from __future__ import annotations

import os

import pytest

from ferrox_driver.apps.bench import kv4_speed
from ferrox_driver.kernels.traits import SPLIT_TRAITS

EXPERIMENTS = ("FX_Q4_PAIR", "FX_Q4_PROBE")  # defaults in the kernel files, 0 there


def pytest_configure(config: pytest.Config) -> None:
    spec = os.environ.get("FERROX_TEST_TRAITS", "")
    pairs = [pair for pair in spec.split(",") if pair]
    if not pairs:
        return
    for name in EXPERIMENTS:
        SPLIT_TRAITS.setdefault(name, 0)
    kv4_speed.set_traits(pairs)


def pytest_report_header(config: pytest.Config) -> str:
    return f"FERROX_TEST_TRAITS: {os.environ.get('FERROX_TEST_TRAITS', '') or '(none)'}"
