"""The documentation: every example runs, the site builds strictly, the API page is complete."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ferrox_driver as fd

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLES = DOCS / "examples"
CPU_EXAMPLES = ["quickstart.py", "compile_and_launch.py", "reference_on_cpu.py"]
GPU_EXAMPLES = [
    "quickstart.py",
    "compile_and_launch.py",
    "resident_cache_decode.py",
    "decode_graph_loop.py",
    "torch_graph_async.py",
    "torch_dlpack.py",
]


def run_example(name: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_every_example_is_run_by_a_test():
    assert {p.name for p in EXAMPLES.glob("*.py")} == set(CPU_EXAMPLES) | set(GPU_EXAMPLES)


@pytest.mark.parametrize("name", CPU_EXAMPLES)
def test_cpu_example_runs(name):
    done = run_example(name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip()


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_EXAMPLES)
def test_gpu_example_runs(name):
    done = run_example(name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip()


def test_the_readme_example_is_the_quickstart_the_tests_run():
    readme = (ROOT / "README.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", readme, re.S)
    quickstart = (EXAMPLES / "quickstart.py").read_text().split('"""', 2)[2].strip()
    assert block.strip() == quickstart


def test_python_blocks_in_pages_are_included_examples():
    # Code in the pages is never a copy that can rot: it is an example the tests run.
    for page in DOCS.rglob("*.md"):
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            lines = [line for line in block.strip().splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith('--8<-- "docs/examples/'), page
            assert (ROOT / lines[0].split('"')[1]).is_file(), lines[0]


def test_api_page_documents_every_public_name():
    api = (DOCS / "api.md").read_text()
    documented = set(re.findall(r"^::: ferrox_driver\.(\w+)$", api, re.M))
    assert documented == set(fd.__all__)


def test_site_builds_in_strict_mode(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stderr
    for page in ("index.html", "performance/index.html", "api/index.html"):
        assert (tmp_path / "site" / page).is_file()
