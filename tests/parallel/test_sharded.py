"""Sharding one sequence across ranks, without a GPU: the dealing rule, the launcher, the
[distributed] extra's isolation and its argument checks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ferrox_driver.parallel import launcher
from ferrox_driver.parallel.sharded import shard_count, shard_owner, shard_slot


@given(st.integers(1, 9), st.integers(1, 17), st.integers(0, 400))
def test_every_token_has_one_owner_and_the_next_slot_of_its_shard(world, block, length):
    # against a token-by-token deal
    held = [0] * world
    for g in range(length):
        r = shard_owner(g, world, block)
        assert shard_slot(g, world, block) == held[r]
        held[r] += 1
    assert [shard_count(length, r, world, block) for r in range(world)] == held
    assert max(held) - min(held) <= block  # equal shares, within a block


def test_each_rank_gets_its_environment_and_the_groups_id():
    envs = launcher.rank_environments(
        3, bytes(range(128)), {"PATH": "/bin", "NCCL_NVLS_ENABLE": "1"}
    )
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert all(e["WORLD_SIZE"] == "3" and e["PATH"] == "/bin" for e in envs)
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["FERROX_NCCL_ID"] for e in envs} == {bytes(range(128)).hex()}
    assert all(e["NCCL_NVLS_ENABLE"] == "1" for e in envs)  # the caller's choice stays
    assert launcher.rank_environments(1, bytes(128), {})[0]["NCCL_NVLS_ENABLE"] == "0"


def _ranks(code: str, n: int) -> tuple[list[dict[str, str]], list[str]]:
    return [dict(RANK=str(r), PATH="/usr/bin:/bin") for r in range(n)], [sys.executable, "-c", code]


def test_the_launcher_returns_the_first_failing_ranks_status_and_stops_the_rest():
    envs, cmd = _ranks(
        "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(60)",
        3,
    )
    assert launcher.launch(cmd, envs, poll=0.02) == 3  # the sleepers were stopped


def test_the_launcher_returns_zero_when_every_rank_succeeds(tmp_path):
    envs, cmd = _ranks(
        f"import os; open(os.path.join({str(tmp_path)!r}, os.environ['RANK']), 'w').close()", 4
    )
    assert launcher.launch(cmd, envs, poll=0.02) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1", "2", "3"]


def test_the_launcher_refuses_no_program_and_no_ranks(capsys):
    for argv in (["-n", "2"], ["-n", "0", "x.py"]):
        with pytest.raises(SystemExit) as exc:
            launcher.main(argv)
        assert exc.value.code == 2
    assert "-n" in capsys.readouterr().err


def test_importing_ferrox_imports_neither_nccl_nor_the_distributed_module():
    code = ("import sys, ferrox_driver, ferrox_driver.parallel.sharded; "
            "print(any(m == 'nccl' or m.startswith(('nccl.', "
            "'ferrox_driver.parallel.distributed')) "
            "for m in sys.modules))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


def test_an_nccl_group_checks_its_arguments_before_touching_nccl():
    from ferrox_driver.parallel.distributed import NcclGroup

    with pytest.raises(ValueError, match="rank"):
        NcclGroup(2, 2, bytes(128))
    with pytest.raises(ValueError, match="unique_id"):
        NcclGroup(0, 2, bytes(16))


def test_without_nccl4py_the_error_says_how_to_install_it(monkeypatch):
    from ferrox_driver.parallel import distributed

    monkeypatch.setitem(sys.modules, "nccl", None)  # import nccl fails
    monkeypatch.setitem(sys.modules, "nccl.bindings", None)
    with pytest.raises(ImportError, match=r"pip install 'nccl4py>=0\.6'") as info:
        distributed.new_unique_id()
    assert "ferrox-driver[" not in str(info.value)  # not on PyPI: a hint that cannot work
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_the_programs_own_options_pass_through_the_launcher():
    assert launcher._split(["-n", "2", "-m", "pkg.mod", "--seqs", "1", "-n", "3"]) == (
        ["-n", "2", "-m", "pkg.mod"],
        ["--seqs", "1", "-n", "3"],
    )
    assert launcher._split(["-n", "4", "run.py", "-x"]) == (["-n", "4"], ["run.py", "-x"])


def test_the_scale_table_compares_with_one_gpu_and_says_where_it_did_not_fit():
    from ferrox_driver.apps.bench.scale import scale_table

    rows = [{"gpus": 2, "seq_len": 1 << 20, "sharded_us": 300.0, "unsharded_us": 600.0},
            {"gpus": 8, "seq_len": 1 << 22, "sharded_us": 10.0, "unsharded_us": None}]  # fmt: skip
    lines = scale_table(rows).splitlines()
    assert lines[1].split() == ["2", "1048576", "300.0", "600.0", "0.500", "0.625"]
    assert "(no fit)" in lines[2] and lines[2].split()[-1] == "0.156"
