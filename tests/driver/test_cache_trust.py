"""The disk cache runs only kernels no other user can have written (issue 51; no GPU needed:
get_program compiles only)."""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path

import pytest

from ferrox_driver.driver import module_cache
from ferrox_driver.driver.compiler import Program, nvrtc_version_string

ARCH = "sm_90"
NOBODY = 65534
PLANTED = b"\x7fELF planted by another user"


def _source(tag: str) -> str:
    name = tag.replace("-", "_")
    return f'extern "C" __global__ void t_{name}(float* x) {{ x[threadIdx.x] += 1.0f; }}'


def _key(tag: str) -> str:
    return module_cache.cache_key(_source(tag), (), ARCH, nvrtc_version_string())


def _plant(directory: Path, tag: str) -> Path:
    """A well-formed cache file for ``tag`` whose cubin is not what NVRTC makes."""
    fake = Program(PLANTED, "", ARCH, (), "planted.cu", {})
    path = directory / f"{_key(tag)}.cubin"
    path.write_bytes(module_cache._encode(fake))
    os.chmod(path, 0o600)
    return path


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FERROX_DISK_CACHE", raising=False)
    module_cache.clear_memory_cache()
    monkeypatch.setattr(module_cache, "stats", module_cache.CacheStats())
    monkeypatch.setattr(module_cache, "_warned_dirs", set())


@pytest.fixture
def private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None) -> Path:
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    os.chmod(directory, 0o700)
    monkeypatch.setenv("FERROX_CACHE_DIR", str(directory))
    return directory


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


def test_a_planted_file_of_ours_is_served(private: Path) -> None:
    # The control for the tests below: with the owner and modes right, the file is used.
    _plant(private, "control")
    assert module_cache.get_program(_source("control"), arch=ARCH).cubin == PLANTED
    assert module_cache.stats.disk_hits == 1


@needs_root
def test_a_file_owned_by_another_user_is_not_loaded(private: Path) -> None:
    path = _plant(private, "owner")
    os.chown(path, NOBODY, NOBODY)
    with pytest.warns(RuntimeWarning, match="owned by uid 65534"):
        program = module_cache.get_program(_source("owner"), arch=ARCH)
    assert program.cubin != PLANTED
    assert module_cache.stats.compiles == 1 and module_cache.stats.disk_hits == 0
    # the directory is ours alone, so our compile replaced the planted file
    assert os.stat(path).st_uid == os.geteuid()
    assert module_cache._decode(path.read_bytes()).cubin == program.cubin


def test_a_group_writable_file_is_not_loaded(private: Path) -> None:
    path = _plant(private, "gw-file")
    os.chmod(path, 0o620)
    with pytest.warns(RuntimeWarning, match="writable by its group or by others"):
        program = module_cache.get_program(_source("gw-file"), arch=ARCH)
    assert program.cubin != PLANTED


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o1777], ids=["group", "world", "sticky"])
def test_a_directory_others_can_write_is_neither_read_nor_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None, mode: int
) -> None:
    directory = tmp_path / "shared"
    directory.mkdir()
    path = _plant(directory, f"dir-{mode:o}")
    os.chmod(directory, mode)
    monkeypatch.setenv("FERROX_CACHE_DIR", str(directory))
    with pytest.warns(RuntimeWarning) as record:
        program = module_cache.get_program(_source(f"dir-{mode:o}"), arch=ARCH)
    (warning,) = [w for w in record if "kernel cache" in str(w.message)]
    text = str(warning.message)
    assert str(directory) in text and "chmod 700" in text and "FERROX_CACHE_DIR" in text
    assert program.cubin != PLANTED and program.cubin.startswith(b"\x7fELF")
    assert module_cache.stats.disk_hits == 0 and module_cache.stats.disk_writes == 0
    assert sorted(p.name for p in directory.iterdir()) == [path.name]  # nothing written
    assert path.read_bytes() == module_cache._encode(
        Program(PLANTED, "", ARCH, (), "planted.cu", {})
    )


@needs_root
def test_a_directory_owned_by_another_user_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    _plant(directory, "their-dir")
    os.chown(directory / f"{_key('their-dir')}.cubin", os.geteuid(), -1)
    os.chown(directory, NOBODY, NOBODY)
    monkeypatch.setenv("FERROX_CACHE_DIR", str(directory))
    with pytest.warns(RuntimeWarning, match="owned by uid 65534"):
        program = module_cache.get_program(_source("their-dir"), arch=ARCH)
    assert program.cubin != PLANTED
    assert module_cache.stats.disk_writes == 0


def test_an_untrusted_directory_warns_once_and_every_compile_still_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    directory = tmp_path / "open"
    directory.mkdir()
    os.chmod(directory, 0o777)
    monkeypatch.setenv("FERROX_CACHE_DIR", str(directory))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = module_cache.get_program(_source("once-a"), arch=ARCH)
        second = module_cache.get_program(_source("once-b"), arch=ARCH)
    assert len([w for w in record if "kernel cache" in str(w.message)]) == 1
    assert first.cubin.startswith(b"\x7fELF") and second.cubin.startswith(b"\x7fELF")
    assert "t_once_a" in first.resources and "t_once_b" in second.resources
    assert module_cache.stats.compiles == 2
    assert list(directory.iterdir()) == []


def test_a_symlink_in_place_of_a_cache_file_is_not_followed(private: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    target = _plant(elsewhere, "link")  # ours and well formed: only the link is wrong
    link = private / target.name
    link.symlink_to(target)
    with pytest.warns(RuntimeWarning, match="plain file"):
        program = module_cache.get_program(_source("link"), arch=ARCH)
    assert program.cubin != PLANTED
    assert module_cache.stats.disk_hits == 0
    # the rewrite replaced the link itself, not the file it pointed at
    assert not link.is_symlink() and target.read_bytes().find(PLANTED) >= 0


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077, 0o277], ids=oct)
def test_the_directory_is_created_0700_and_files_0600_whatever_the_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None, umask: int
) -> None:
    directory = tmp_path / "parent" / "cache"
    monkeypatch.setenv("FERROX_CACHE_DIR", str(directory))
    old = os.umask(umask)
    try:
        module_cache.get_program(_source(f"modes-{umask:o}"), arch=ARCH)
    finally:
        os.umask(old)
    assert _mode(directory) == 0o700
    (path,) = directory.iterdir()
    assert path.name == f"{_key(f'modes-{umask:o}')}.cubin"
    assert _mode(path) == 0o600
    # and what was written is read back by the next process
    module_cache.clear_memory_cache()
    module_cache.get_program(_source(f"modes-{umask:o}"), arch=ARCH)
    assert module_cache.stats.disk_hits == 1


def test_an_existing_private_directory_keeps_its_mode(private: Path) -> None:
    os.chmod(private, 0o755)  # readable by others, writable by none: trusted, left as it is
    module_cache.get_program(_source("keep"), arch=ARCH)
    assert _mode(private) == 0o755
    assert len(list(private.glob("*.cubin"))) == 1


def test_disk_cache_state_reports_a_private_directory(private: Path) -> None:
    module_cache.get_program(_source("state-a"), arch=ARCH)
    module_cache.get_program(_source("state-b"), arch=ARCH)
    (private / "notes.txt").write_text("not ours")
    sizes = sum(p.stat().st_size for p in private.glob("*.cubin"))
    state = module_cache.disk_cache_state()
    assert state == {
        "path": str(private),
        "exists": True,
        "trusted": True,
        "why": "",
        "n_files": 2,
        "bytes": sizes,
    }


def test_disk_cache_state_says_why_a_directory_is_not_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    os.chmod(tmp_path, 0o777)
    monkeypatch.setenv("FERROX_CACHE_DIR", str(tmp_path))
    state = module_cache.disk_cache_state()
    assert state["exists"] is True and state["trusted"] is False
    assert "writable by its group or by others (mode 0777)" in state["why"]


def test_disk_cache_state_of_a_missing_and_of_a_disabled_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    monkeypatch.setenv("FERROX_CACHE_DIR", str(tmp_path / "not-yet"))
    missing = module_cache.disk_cache_state()
    assert missing["path"] == str(tmp_path / "not-yet")
    assert (missing["exists"], missing["trusted"], missing["why"]) == (False, True, "")
    assert (missing["n_files"], missing["bytes"]) == (0, 0)
    monkeypatch.setenv("FERROX_DISK_CACHE", "0")
    disabled = module_cache.disk_cache_state()
    assert disabled["path"] is None and disabled["trusted"] is False
    assert "FERROX_DISK_CACHE=0" in disabled["why"]


def test_clear_disk_cache_removes_only_the_names_it_writes(private: Path) -> None:
    module_cache.get_program(_source("clear-a"), arch=ARCH)
    module_cache.get_program(_source("clear-b"), arch=ARCH)
    (private / f".{'0' * 16}.{'a' * 16}.tmp").write_bytes(b"torn")  # a crashed writer's
    keep = ["notes.txt", "abc.cubin", f"{'0' * 64}.cubin.bak"]
    for name in keep:
        (private / name).write_text("someone else's")
    (private / f"{'f' * 64}.cubin").mkdir()  # a directory of our name is not a file
    assert module_cache.clear_disk_cache() == 3
    assert sorted(p.name for p in private.iterdir()) == sorted([*keep, f"{'f' * 64}.cubin"])
    assert module_cache.disk_cache_state()["n_files"] == 0


def test_clear_disk_cache_of_a_missing_or_disabled_cache_removes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None
) -> None:
    monkeypatch.setenv("FERROX_CACHE_DIR", str(tmp_path / "absent"))
    assert module_cache.clear_disk_cache() == 0
    monkeypatch.setenv("FERROX_DISK_CACHE", "0")
    assert module_cache.clear_disk_cache() == 0
