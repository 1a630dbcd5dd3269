"""The command line works with or without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import ferrox_driver as fd
from ferrox_driver.apps import cli


def test_info_exits_zero_and_names_versions_and_cache(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for field in ("ferrox_driver", "cuda-bindings", "NVRTC", "kernel cache"):
        assert field in out
    assert "GPUs           compute capability 7.5 or newer (plans checked for sm_75, " in out


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
        (["demo", "--arch", "sm_50"], "supported: sm_75, sm_80, sm_86, sm_89, sm_90"),
        (["demo", "--arch", "sm_999"], "'sm_999' is not a supported architecture"),
        (["demo", "--arch", "sm_87"], "--arch"),
        (["cache", "--clear", "now"], "unrecognized arguments: now"),
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


NO_GPU = pytest.mark.skipif(fd.cuda_available(), reason="the no-GPU behaviour (CI has no GPU)")


@NO_GPU
def test_demo_without_a_gpu_shows_the_reference_the_plan_and_its_compiled_kernels(capsys):
    assert cli.main(["demo", "--arch", "sm_80", "--tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA driver/device found" in out
    assert "fd.reference_gqa_decode(q, k, v, n_heads=32, n_kv_heads=8, head_dim=128)" in out
    by_hand = next(line for line in out.splitlines() if "query head 0 by hand" in line)
    assert float(by_hand.split()[-1]) < 1e-12
    # an A100: 108 SMs of one 128 KiB block, 8 KV heads: 13 chunks each; no clusters
    assert "32/8/128 bf16 at 4096 tokens on a GPU of sm_80 (A100: 108 SMs" in out
    assert "gqa_split_mma_bf16_d128: tensor cores" in out
    assert "grid 13 x 8 x 1 = 104 block(s) of 128 threads, 128 KiB of shared memory" in out
    assert "13 chunk(s) per KV head of up to 320 tokens" in out
    assert "then gqa_split_combine_bf16" in out
    assert "for sm_80 with NVRTC" in out and "gqa_split_combine_bf16: " in out
    assert "ptxas" not in out and "gqa_decode_f32" not in out  # not the whole file


@NO_GPU
def test_the_no_gpu_demo_takes_its_arch_plans_for_turing_on_cuda_cores(capsys):
    assert cli.main(["demo", "--arch", "sm_75", "--dtype", "f16", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    assert "on a GPU of sm_75 (Tesla T4: 40 SMs, 64 KiB" in out
    assert "gqa_split_f16_g4_vec: CUDA cores" in out and "for sm_75 with NVRTC" in out


@NO_GPU
def test_the_no_gpu_demo_finishes_in_seconds_once_its_kernels_are_cached(tmp_path):
    env = {**os.environ, "FERROX_CACHE_DIR": str(tmp_path)}
    argv = [sys.executable, "-m", "ferrox_driver", "demo"]
    first = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "compiled 1 module(s) in" in first.stdout
    started = time.perf_counter()
    warm = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    seconds = time.perf_counter() - started
    assert warm.returncode == 0, warm.stderr
    for part in ("1. reference", "2. plan", "3. compile", "loaded from the disk cache"):
        assert part in warm.stdout, warm.stdout
    assert seconds < 10, seconds


def test_output_into_a_closed_pipe_ends_quietly():
    # `python -m ferrox_driver demo | head -3`: the reader leaves after three lines
    with subprocess.Popen(
        [sys.executable, "-m", "ferrox_driver", "demo", "--layers", "1", "--tokens", "2",
         "--no-model"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) as proc:  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        proc.stdout.close()
        err = proc.stderr.read()
        status = proc.wait(timeout=300)
    assert all(lines), lines  # it wrote more than the reader took ...
    assert status == 1 and "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.parametrize("prog", ["ferrox-driver", "python -m ferrox_driver"])
def test_version(capsys, prog):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"], prog=prog)
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"{prog} {fd.__version__}\n"


def test_a_missing_driver_is_one_line_not_a_traceback(monkeypatch, capsys):
    # the GPU demo where the driver cannot be used: NoDeviceError's sentence, exit status 1
    monkeypatch.setattr(fd, "cuda_available", lambda: True)
    boom = fd.NoDeviceError("no NVIDIA driver found (libcuda could not be loaded): install it")
    import ferrox_driver.apps.demo

    def no_driver(cfg):
        try:
            raise OSError("libcuda.so.1: cannot open shared object file")
        except OSError as cause:
            raise boom from cause

    monkeypatch.setattr(ferrox_driver.apps.demo, "run_demo", no_driver)
    assert cli.main(["demo", "--no-model"], prog="ferrox-driver") == 1
    captured = capsys.readouterr()
    assert captured.err == f"ferrox-driver demo: {boom}\n" and captured.out == ""


@NO_GPU
def test_without_a_driver_the_gpu_demo_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(fd, "cuda_available", lambda: True)  # as if one were there
    assert cli.main(["demo", "--no-model", "--layers", "1"], prog="ferrox-driver") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if line.startswith("ferrox-driver demo: ")] == err[-1:], err
    assert "Traceback" not in "".join(err)


def _kernel_in_the_cache() -> None:
    from ferrox_driver.decode.launches import split_program
    from ferrox_driver.kernels.spec import KernelSpec

    split_program([KernelSpec.combine("f32")], "sm_80")  # compiled, written to disk


def test_the_cache_command_shows_and_clears_the_disk_cache(monkeypatch, tmp_path, capsys):
    from ferrox_driver.driver import module_cache

    where = tmp_path / "kernels"
    monkeypatch.setenv("FERROX_CACHE_DIR", str(where))
    assert cli.main(["cache"]) == 0
    assert (
        capsys.readouterr().out
        == f"kernel cache   {where} (not created yet; made private to this user on first use)\n"
    )
    module_cache.clear_memory_cache()
    _kernel_in_the_cache()
    assert cli.main(["cache"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"kernel cache   {where}: 1 file(s), ") and "NOT" not in shown
    assert cli.main(["info"]) == 0
    assert f"kernel cache   {where}: 1 file(s), " in capsys.readouterr().out
    assert cli.main(["cache", "--clear"]) == 0
    assert capsys.readouterr().out == f"kernel cache   removed 1 file(s) from {where}\n"
    assert not list(where.glob("*.cubin"))
    assert cli.main(["cache"]) == 0
    assert f"{where}: 0 file(s), 0.0 MiB" in capsys.readouterr().out


def test_the_cache_command_says_why_a_cache_is_not_used(monkeypatch, capsys):
    from ferrox_driver.driver import module_cache

    monkeypatch.setenv("FERROX_DISK_CACHE", "0")
    assert cli.main(["cache", "--clear"]) == 0
    assert "nothing to clear: disabled (FERROX_DISK_CACHE=0)" in capsys.readouterr().out
    state = {"path": "/x", "exists": True, "trusted": False, "n_files": 2, "bytes": 2**20,
             "why": "the directory is writable by others"}  # fmt: skip
    monkeypatch.setattr(module_cache, "disk_cache_state", lambda: state)
    assert cli.main(["cache"]) == 0
    assert capsys.readouterr().out == (
        "kernel cache   /x: 2 file(s), 1.0 MiB; NOT used: the directory is writable by others "
        "(clear it: cache --clear)\n"
    )


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
    assert "info" in out and "demo" in out and "bench" in out and "cache" in out
    assert "--version" in out


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
        pytest.skip("PyTorch sees a GPU here: the model part runs (tests/apps/test_gpu_demo.py)")
    from ferrox_driver.apps import demo

    assert demo.run_model_demo(demo.DemoConfig()) is False
    out = capsys.readouterr().out
    why = "is not installed" if torch is None else "sees no GPU"
    assert "model: skipped (" in out and why in out, out
    assert "ferrox_driver.apps.toy_llama" not in sys.modules
