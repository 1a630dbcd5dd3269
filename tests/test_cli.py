"""The command line works with or without a GPU."""

from __future__ import annotations

import subprocess
import sys

from ferrox_driver import cli


def test_info_exits_zero_and_names_versions_and_cache(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for field in ("ferrox_driver", "cuda-bindings", "NVRTC", "kernel cache"):
        assert field in out


def test_resource_report_lists_every_kernel_with_no_stack(capsys):
    cli.show_resources("sm_90")
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert {"gqa_decode_f32", "gqa_decode_bf16", "kv_append_row"} <= set(rows)
    assert all(cols[1] == "0" and cols[2] == "0" for cols in rows.values())


def test_module_entry_point_runs():
    done = subprocess.run(
        [sys.executable, "-m", "ferrox_driver", "info"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "ferrox_driver" in done.stdout
