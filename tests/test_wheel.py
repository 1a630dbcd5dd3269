"""A wheel built from the repository carries the kernels and works outside the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

from ferrox_driver import __version__ as fd_version

ROOT = Path(__file__).resolve().parents[1]


def test_installed_wheel_compiles_the_kernels_outside_the_checkout(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(ROOT),
        ],
        check=True,
    )
    (wheel,) = wheels.glob("ferrox_driver-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    # the product only: the package and its kernels, the licence; no benchmarks or tests
    assert {n.split("/")[0] for n in names} == {
        "ferrox_driver",
        f"ferrox_driver-{fd_version}.dist-info",
    }, names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert "License-Expression: Apache-2.0" in metadata
    assert f"\nVersion: {fd_version}\n" in metadata  # read from the one place it is written
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # A fresh environment: the wheel and its declared dependencies, nothing from the checkout
    # (with PYTHONPATH on the checkout, pip would take its egg-info for an installed copy).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([python, "-m", "pip", "install", "-q", str(wheel)], check=True, env=env)
    script = (
        "import ferrox_driver as fd, ferrox_driver.driver.compiler as c, pathlib, sys;"
        "import ferrox_driver.kernels.catalogue as k;"
        "assert str(pathlib.Path(fd.__file__)).startswith(sys.prefix), fd.__file__;"
        "assert c.source_dir().is_relative_to(sys.prefix), c.source_dir();"
        "p = fd.compile_source(k.kernel_source('gqa_decode.cu'), arch='sm_90');"
        "print(sorted(p.resources));"
        # the split kernels' parts ship too (kernel_source puts them in place)
        "print(len(k.kernel_source('gqa_decode_split.cu')))"
    )
    done = subprocess.run(
        [python, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "gqa_decode_f32" in done.stdout
    assert int(done.stdout.split()[-1]) > 50_000  # the expanded split file, every part in it
