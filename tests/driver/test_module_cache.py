"""The in-process and on-disk kernel caches (no GPU needed: get_program compiles only)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from ferrox_driver.driver import compiler, module_cache
from ferrox_driver.driver.compiler import nvrtc_version_string

ARCH = "sm_90"


def _source(tag: str) -> str:
    # A unique source per test, so no test sees another's cached program.
    return f'extern "C" __global__ void k_{tag}(float* x) {{ x[threadIdx.x] *= 2.0f; }}'


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FERROX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FERROX_DISK_CACHE", raising=False)
    module_cache.clear_memory_cache()
    monkeypatch.setattr(module_cache, "stats", module_cache.CacheStats())
    return tmp_path


def _cached_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.cubin"))


def test_second_request_is_a_memory_hit_and_compiles_once(cache: Path) -> None:
    a = module_cache.get_program(_source("hit"), arch=ARCH)
    b = module_cache.get_program(_source("hit"), arch=ARCH)
    assert a is b
    assert module_cache.stats.compiles == 1
    assert module_cache.stats.memory_hits == 1


def test_new_process_reads_the_disk_cache_instead_of_compiling(cache: Path) -> None:
    first = module_cache.get_program(_source("disk"), arch=ARCH)
    assert len(_cached_files(cache)) == 1
    module_cache.clear_memory_cache()  # as if a new process started
    second = module_cache.get_program(_source("disk"), arch=ARCH)
    assert module_cache.stats.compiles == 1
    assert module_cache.stats.disk_hits == 1
    assert second.cubin == first.cubin
    assert second.resources == first.resources


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # truncated
        lambda b: b[:-1] + bytes([b[-1] ^ 0xFF]),  # one flipped byte in the cubin
        lambda b: b"",  # empty
        lambda b: b"garbage" * 10,  # not a cache file at all
    ],
    ids=["truncated", "flipped-byte", "empty", "garbage"],
)
def test_damaged_disk_file_is_a_miss_that_recompiles_and_rewrites(cache: Path, damage) -> None:
    good = module_cache.get_program(_source("corrupt"), arch=ARCH)
    (path,) = _cached_files(cache)
    path.write_bytes(damage(path.read_bytes()))
    module_cache.clear_memory_cache()
    again = module_cache.get_program(_source("corrupt"), arch=ARCH)
    assert module_cache.stats.compiles == 2
    assert again.cubin == good.cubin
    assert module_cache._decode(path.read_bytes()) is not None  # rewritten intact


def test_sixteen_threads_asking_at_once_compile_once(cache: Path) -> None:
    barrier = threading.Barrier(16)
    results: list[object] = []
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            barrier.wait()
            results.append(module_cache.get_program(_source("threads"), arch=ARCH))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 16
    assert all(r is results[0] for r in results)
    assert module_cache.stats.compiles == 1


def test_disk_cache_off_writes_nothing(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERROX_DISK_CACHE", "0")
    assert module_cache.cache_dir() is None
    module_cache.get_program(_source("off"), arch=ARCH)
    assert _cached_files(cache) == []


def test_unwritable_cache_dir_falls_back_to_memory_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("FERROX_CACHE_DIR", str(blocker / "cache"))
    module_cache.clear_memory_cache()
    with pytest.warns(RuntimeWarning, match="cannot write the kernel cache"):
        program = module_cache.get_program(_source("ro1"), arch=ARCH)
    assert program.cubin
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module_cache.get_program(_source("ro2"), arch=ARCH)  # no second warning


def test_key_changes_with_every_labelled_field() -> None:
    base = module_cache.cache_key("src", ("-DA",), "sm_90", "13.0")
    variants = [
        module_cache.cache_key("src2", ("-DA",), "sm_90", "13.0"),
        module_cache.cache_key("src", ("-DB",), "sm_90", "13.0"),
        module_cache.cache_key("src", ("-DA",), "sm_80", "13.0"),
        module_cache.cache_key("src", ("-DA",), "sm_90", "13.1"),
        # length prefixes keep field boundaries: moving text between fields changes the key
        module_cache.cache_key("src-DA", (), "sm_90", "13.0"),
    ]
    assert len({base, *variants}) == len(variants) + 1
    assert base == module_cache.cache_key("src", ("-DA",), "sm_90", "13.0")


def _miss_after(cache: Path, tag: str, change) -> None:
    """Compile once, change one input of the compile as an upgrade would, then ask again
    as a new process would: the cubin on disk must not be served."""
    module_cache.get_program(_source(tag), arch=ARCH)
    module_cache.clear_memory_cache()
    change()
    module_cache.get_program(_source(tag), arch=ARCH)
    assert module_cache.stats.disk_hits == 0
    assert module_cache.stats.compiles == 2
    assert len(_cached_files(cache)) == 2


def test_a_changed_prelude_alone_is_a_disk_miss(cache: Path, monkeypatch) -> None:
    changed = compiler.prelude_source() + "\n// the prelude of a later release\n"

    def change() -> None:
        monkeypatch.setattr(compiler, "prelude_source", lambda: changed)
        monkeypatch.setattr(module_cache, "prelude_source", lambda: changed)

    _miss_after(cache, "prelude", change)


def test_a_changed_fixed_flag_alone_is_a_disk_miss(cache: Path, monkeypatch) -> None:
    real = compiler.nvrtc_options

    def with_fast_math(arch: str, options=()) -> tuple[str, ...]:
        return (*real(arch, ()), "--use_fast_math", *options)

    def change() -> None:
        monkeypatch.setattr(compiler, "nvrtc_options", with_fast_math)
        monkeypatch.setattr(module_cache, "nvrtc_options", with_fast_math)

    _miss_after(cache, "flag", change)


def test_a_new_package_version_alone_is_a_disk_miss(cache: Path, monkeypatch) -> None:
    _miss_after(cache, "version", lambda: monkeypatch.setattr(module_cache, "__version__", "9.9"))


def test_key_depends_on_the_nvrtc_version_in_use(cache: Path) -> None:
    module_cache.get_program(_source("ver"), arch=ARCH)
    (path,) = _cached_files(cache)
    expected = module_cache.cache_key(_source("ver"), (), ARCH, nvrtc_version_string())
    assert path.name == f"{expected}.cubin"


def test_two_processes_compiling_one_module_at_once_leave_one_intact_file(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    script = (
        "from ferrox_driver.driver import module_cache as m\n"
        "from ferrox_driver.kernels.catalogue import kernel_source\n"
        "p = m.get_program(kernel_source('kv_cache.cu'), arch='sm_90', name='kv_cache.cu')\n"
        "assert 'kv_append_row' in p.resources\n"
    )
    env = dict(os.environ, FERROX_CACHE_DIR=str(tmp_path), PYTHONPATH=str(root))
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()
    (path,) = _cached_files(tmp_path)
    assert module_cache._decode(path.read_bytes()) is not None
    assert not list(tmp_path.glob("*.tmp"))  # no temporary file left behind
