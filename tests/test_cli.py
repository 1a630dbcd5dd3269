"""The command line works with or without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ferrox_driver as fd
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


@pytest.mark.parametrize(
    "argv,named",
    [
        (["bench", "--shapes", "nonsense"], "--shapes"),
        (["bench", "--shapes", "32/7/128"], "--shapes"),
        (["bench", "--seqs", "0"], "--seqs"),
        (["bench", "--only", "everything"], "--only"),
        (["demo", "--arch", "foo"], "--arch"),
        (["demo", "--arch", "compute_90"], "--arch"),
        (["demo", "--layers", "-5"], "--layers"),
        (["demo", "--tokens", "many"], "--tokens"),
        (["demo", "--head-dim", "999"], "--head-dim"),
        (["demo", "--heads", "30", "--kv-heads", "8"], "--heads"),
        (["demo", "--dtype", "f64"], "--dtype"),
        (["demo", "--model-context", "0"], "--model-context"),
        (["demo", "--model-shape", "llama-70b"], "--model-shape"),
        (["nonsense"], "invalid choice: 'nonsense'"),
    ],
)
def test_a_bad_argument_is_one_line_naming_it_and_exit_status_2(capsys, argv, named):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv, prog="ferrox-driver")
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ferrox-driver"), err
    assert named in err[0] and "error" in err[0]


@pytest.mark.skipif(fd.cuda_available(), reason="the no-GPU behaviour (CI has no GPU)")
def test_bench_without_a_gpu_says_so_and_fails(capsys):
    assert cli.main(["bench", "--only", "host"]) == 1
    assert "need a GPU" in capsys.readouterr().err


@pytest.mark.skipif(fd.cuda_available(), reason="the no-GPU behaviour (CI has no GPU)")
def test_demo_without_a_gpu_shows_the_compiled_kernels_and_succeeds(capsys):
    assert cli.main(["demo", "--arch", "sm_80"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA driver/device found" in out and "gqa_decode_f32" in out


@pytest.mark.parametrize("prog", ["ferrox-driver", "python -m ferrox_driver"])
def test_help_names_the_program_and_shows_every_default(capsys, prog):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--help"], prog=prog)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {prog} demo")
    flat = " ".join(out.split())  # help wraps lines
    for option, default in (("--layers", "32"), ("--head-dim", "128"), ("--arch", "sm_90")):
        text = flat.split(option.upper().lstrip("-").replace("-", "_"), 2)[-1]
        assert f"(default: {default})" in text.split("--")[0], option


def test_top_level_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":meth:" not in out
    assert "info" in out and "demo" in out and "bench" in out


def test_the_module_entry_point_names_itself_python_m():
    done = subprocess.run(
        [sys.executable, "-m", "ferrox_driver", "demo", "--layers", "0"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("python -m ferrox_driver demo: error: argument --layers")


def test_the_demo_says_why_it_skips_the_model_where_pytorch_sees_no_gpu(capsys, monkeypatch):
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        pytest.skip("PyTorch sees a GPU here: the model part runs (tests/test_gpu_demo.py)")
    from ferrox_driver import demo

    assert demo.run_model_demo(demo.DemoConfig()) is False
    out = capsys.readouterr().out
    why = "is not installed" if torch is None else "sees no GPU"
    assert "model: skipped (" in out and why in out, out
    assert "ferrox_driver.toy_llama" not in sys.modules
