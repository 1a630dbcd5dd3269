"""The documentation: every example runs, the site builds strictly, the API page is complete."""

from __future__ import annotations

import html
import inspect
import json
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
CPU_EXAMPLES = [
    "quickstart.py",
    "compile_and_launch.py",
    "reference_on_cpu.py",
    "fp8_scales_on_cpu.py",
    "kv4_on_cpu.py",
    "with_pytorch.py",
]
GPU_EXAMPLES = [
    "quickstart.py",
    "with_pytorch.py",
    "compile_and_launch.py",
    "resident_cache_decode.py",
    "decode_graph_loop.py",
    "torch_graph_async.py",
    "torch_dlpack.py",
    "head_major_torch.py",
    "static_cache_graph_torch.py",
    "transformers_generate.py",
    "transformers_fp8_cache.py",
    "transformers_kv4_cache.py",
    "torch_ops_compile.py",
    "features_gemma2_layer.py",
    "features_sinks.py",
    "features_merge_split.py",
    "sharded_local.py",
    "sharded_nccl.py",
    "speculative_verify.py",
    "kv4_cache_decode.py",
    "mla_layer.py",
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


@pytest.mark.gpu
def test_gpu_quickstart_matches_the_reference():
    done = run_example("quickstart.py")
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.search(r"relative error (\S+) against the float64 reference", done.stdout)
    assert found, done.stdout
    assert float(found.group(1)) < 1e-5


def test_the_quickstart_is_about_ten_lines_of_use():
    body = (EXAMPLES / "quickstart.py").read_text().split('"""', 2)[2]
    code = [ln for ln in body.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(code) <= 14, len(code)
    assert "sys.exit" not in body and "assert" not in body  # no test scaffolding


def test_the_home_page_opens_with_code():
    home = (DOCS / "index.md").read_text()
    first_screen = home.split("\n## ", 1)[0]
    assert len(first_screen.splitlines()) <= 20
    assert re.search(r"```bash\npip install", first_screen)
    assert '--8<-- "docs/examples/quickstart.py"' in first_screen
    assert "(performance.md)" in first_screen  # the speed claim, with its evidence


def test_guides_come_in_the_order_a_user_needs_them():
    yaml = pytest.importorskip("yaml")
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    (guides,) = [entry["Guides"] for entry in nav if "Guides" in entry]
    pages = [next(iter(entry.values())) for entry in guides]
    assert pages[:2] == ["guides/quickstart.md", "guides/pytorch.md"]
    assert pages[-2:] == ["guides/compiling.md", "guides/migrating.md"]
    # every guide is in the menu
    assert sorted(pages) == sorted(f"guides/{p.name}" for p in (DOCS / "guides").glob("*.md"))


def test_performance_page_opens_with_one_compact_bf16_table_from_the_benchmark():
    page = (DOCS / "performance.md").read_text()
    head = page.split("\n## ", 2)[1]  # the first section
    tables = re.findall(r"((?:^\|.*\|\n)+)", head, re.M)
    assert len(tables) == 1, "one table on the first screen"
    rows = [r.split("|")[1:-1] for r in tables[0].strip().splitlines()[2:]]
    data = json.loads((DOCS / "assets" / "bench_decode.json").read_text())
    points = {
        p["seq_len"]: p for p in data["points"] if p["shape"] == "32/8/128" and p["dtype"] == "bf16"
    }
    assert [int(r[0]) for r in rows] == [512, 4096, 32768, 131072]
    for tokens, ours, theirs, speedup, ceiling in rows:
        p = points[int(tokens)]
        assert float(ours) == round(p["graph_us"], 1)
        assert float(theirs) == round(p["torch_us"], 1)
        assert float(speedup.strip(" x")) == pytest.approx(p["torch_us"] / p["graph_us"], abs=0.006)
        percent = 100 * p["kv_bytes"] / p["graph_us"] / 1e6 / data["read_ceiling_tbs"]
        assert float(ceiling.strip(" %")) == pytest.approx(percent, abs=0.6)
    # the plot, and what PyTorch's fp32 path is, before the long tables
    assert "(assets/decode_vs_pytorch.svg)" in head
    assert "math path" in head and "FlashInfer 0.7.2.post1" in head


def test_the_performance_plot_is_drawn_from_the_benchmark_json():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plot_decode.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    svg = (DOCS / "assets" / "decode_vs_pytorch.svg").read_text()
    assert svg.startswith("<svg") and "PyTorch SDPA" in svg and "2026-12-03" in svg


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
    documented = set(re.findall(r"^::: ferrox_driver\.(\w+)$", api, re.M)) - {"types"}
    assert documented == set(fd.__all__)


def test_api_page_says_which_module_defines_each_public_name():
    # "| `ferrox_driver.cache.kv_cache` | `KVCache`, `LayerKVCache` |": the table of where
    # each name lives must name the module that defines it, for every name of fd.__all__
    api = (DOCS / "api.md").read_text()
    rows = re.findall(r"^\| `(ferrox_driver(?:\.\w+)+)` \| (.+?) \|$", api, re.M)
    assert rows
    listed: dict[str, str] = {}
    for module, names in rows:
        for name in re.findall(r"`(\w+)`", names):
            assert name not in listed, name
            listed[name] = module
    assert set(listed) == set(fd.__all__)
    for name, module in listed.items():
        obj = getattr(fd, name)
        defined = obj.__name__ if inspect.ismodule(obj) else obj.__module__
        assert defined == module, (name, defined, module)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once in strict mode (a warning fails the build)."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stderr
    return out


def page_text(site: Path, page: str) -> str:
    """What a reader sees on a built page: the text without tags."""
    return html.unescape(re.sub(r"<[^>]+>", " ", (site / page).read_text()))


def test_site_builds_in_strict_mode(site):
    for page in ("index.html", "performance/index.html", "api/index.html"):
        assert (site / page).is_file()
    # what a reader sees on the API page: no literal Sphinx role, no bare Any for a type
    api = page_text(site, "api/index.html")
    for role in (":meth:", ":class:", ":func:", ":attr:", ":mod:"):
        assert role not in api, role
    assert not re.search(r"\bAny\b", api), " ".join(api[api.find("Any") - 200 :].split())[:300]
    # a Returns section reads as one item where the docstring means one
    assert api.count("With numpy inputs") == 1


def test_site_loads_nothing_from_the_network(site):
    for page in site.rglob("*.html"):
        text = page.read_text()
        remote = re.findall(r"<(?:script|link)\b[^>]*(?:src|href)=\"(?:https?:)?//[^\"]*\"", text)
        assert not remote, (page, remote)


def test_code_is_highlighted_when_the_site_is_built(site):
    # Pygments marks tokens at build time (no highlight.js in the browser) and its style ships
    home = (site / "index.html").read_text()
    assert re.search(r'<div class="highlight"><pre>.*<span class="kn">import</span>', home, re.S)
    assert "highlight.js" not in home and "hljs" not in home
    css = (site / "css" / "pygments.css").read_text()
    assert ".highlight .kn" in css
    assert 'href="css/pygments.css"' in home


def test_the_docs_extra_holds_what_the_site_is_built_with():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]

    def names(extra: str) -> set[str]:
        return {re.split(r"[<>=\[ ]", req, maxsplit=1)[0].lower() for req in extras[extra]}

    needed = {"mkdocs", "mkdocstrings", "mkdocstrings-python", "pymdown-extensions", "pygments"}
    assert needed <= names("docs")
    assert names("docs") <= names("test")  # the tests build the site


# The library's own plumbing: public to its other modules, left off the API page
INTERNAL_MEMBERS = {
    "launch_decode",
    "decode_record",
    "split_workspace",
    "device_length_for",
    "device_length",
    "mark_device_appends",
    "check_open",
    "q_dtype_for",
    "join",
    "rejoin",
    "queue_append",
    "queue_decode",
    "length_for_step",
    "appending_on_device",
    "replay_appended",
    "replays_update_length",
}


def api_headings(site: Path) -> list[str]:
    """The API page's object headings (their ids), in page order."""
    return re.findall(r'<h\d id="(ferrox_driver\.[^"]+)"', (site / "api/index.html").read_text())


def documented_members(cls: type) -> dict[str, object]:
    """A class's members a user calls: public, with a docstring, not an alias of another."""
    found: dict[str, object] = {}
    for name, member in vars(cls).items():
        if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
            continue
        target = member.fget if isinstance(member, property) else member
        target = getattr(target, "__func__", target)
        if name == "__init__" or not callable(target) or not getattr(target, "__doc__", None):
            continue
        if any(target is seen for seen in found.values()):
            continue  # step = __call__: one entry
        found[name] = target
    return found


def test_api_page_shows_each_signature_once(site):
    page = (site / "api/index.html").read_text()
    sections = re.split(r'<h\d id="ferrox_driver\.', page)[1:]
    assert len(sections) > 100
    for section in sections:
        name = section.split('"', 1)[0]
        assert section.count('class="doc-signature') <= 1, name
    (decode,) = [s for s in sections if s.startswith('gqa_decode"')]
    assert decode.count('class="doc-signature') == 1
    # the whole signature, to its return type, under the heading (not cut off inside it)
    (block,) = re.findall(r'class="doc-signature[^>]*>(.*?)</pre>', decode, re.S)
    signature = html.unescape(re.sub(r"<[^>]+>", "", block)).strip()
    assert signature.startswith("gqa_decode(") and signature.endswith(")"), signature
    assert "kv_layout=" in signature


def test_api_page_documents_every_public_member_and_no_internal_one(site):
    headings = set(api_headings(site))
    for name in fd.__all__:
        obj = getattr(fd, name)
        if not isinstance(obj, type):
            continue
        for member in documented_members(obj):
            wanted = f"ferrox_driver.{name}.{member}"
            if member in INTERNAL_MEMBERS:
                assert wanted not in headings, wanted
            else:
                assert wanted in headings, wanted


def test_api_page_starts_with_the_main_calls_and_ends_with_the_driver_layer(site):
    order = api_headings(site)
    first = [h for h in order if h.count(".") == 1][:4]
    assert first[:1] == ["ferrox_driver.gqa_decode"], first
    where = {h: i for i, h in enumerate(order)}
    assert where["ferrox_driver.gqa_decode"] < where["ferrox_driver.KVCache"]
    assert where["ferrox_driver.KVCache"] < where["ferrox_driver.DecodeGraph"]
    kv_members = [h for h in order if h.startswith("ferrox_driver.KVCache.")]
    assert kv_members[0] == "ferrox_driver.KVCache.decode"
    driver = ("Device", "Stream", "DeviceArray", "compile_source", "Kernel")
    last_domain = max(where[f"ferrox_driver.{n}"] for n in ("ShardedKVCache", "KVCapacityError"))
    assert all(where[f"ferrox_driver.{n}"] > last_domain for n in driver)


def test_docstrings_continue_their_returns_item_indented():
    # Google style: a Returns line at the item's own indent starts a new (bogus) item
    import inspect

    for name in fd.__all__:
        obj = getattr(fd, name)
        members = (
            [obj]
            + [m for k, m in vars(obj).items() if inspect.isfunction(m) and not k.startswith("_")]
            if inspect.isclass(obj)
            else [obj]
        )
        for member in members:
            doc = inspect.getdoc(member) or ""
            found = re.search(r"^Returns:\n((?: {4}.*\n?)+)", doc, re.M)
            if not found:
                continue
            lines = [ln for ln in found.group(1).splitlines() if ln.strip()]
            assert all(ln.startswith("        ") for ln in lines[1:]), (name, lines[:2])
