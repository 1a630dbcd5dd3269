"""A pytest plugin that runs the tests on kernels built with other traits: FERROX_TEST_TRAITS
(NAME=VALUE,...) changes SPLIT_TRAITS, and the 4-bit plans' warps and steps read from them,
before any kernel is built. Names may be SPLIT_TRAITS' or the experiments' of
kv4_probe.DEFAULTS (a kernel file's #ifndef defaults), so an experiment is tested as the
library would ship it, with no file edited:

    git apply benchmarks/kv4_pair.patch   # (FX_Q4_PAIR: not in the library; -R after)
    FERROX_TEST_TRAITS=FX_Q4_PAIR=1 PYTHONPATH=.:benchmarks FERROX_REQUIRE_GPU=1 \\
        python3 -m pytest -q -m gpu -p trait_tests tests/decode/test_gpu_kv4.py

(The traits go into the generated header that every kernel source includes, so the module
cache keys on them: a run with other traits never loads these kernels, nor they its.)
"""

from __future__ import annotations

import os

import pytest
from kv4_probe import set_variant


def pytest_configure(config: pytest.Config) -> None:
    spec = os.environ.get("FERROX_TEST_TRAITS", "")
    if spec:  # (none: the library's header as it is)
        set_variant(spec)


def pytest_report_header(config: pytest.Config) -> str:
    return f"FERROX_TEST_TRAITS: {os.environ.get('FERROX_TEST_TRAITS', '') or '(none)'}"
