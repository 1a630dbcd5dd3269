"""The package's layering, as a test: each folder is a floor and imports only from its own
folder or a lower floor (docs/design.md, "The folders"). An import that climbs, cuda.bindings
outside driver/, a private name taken from another folder, the planner or the kernel specs
reaching for the driver, or a library module importing apps/ fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ferrox_driver"

# base modules sit below everything; the face (the package's own __init__ and its commands)
# may import anything; parallel/ and integrations/ share a floor but not each other
FLOORS = {
    "": 0,
    "driver": 1,
    "kernels": 2,
    "decode": 3,
    "cache": 4,
    "parallel": 5,
    "integrations": 5,
    "apps": 6,
}
FACE = {"__init__", "__main__", "experimental", "launcher"}
# they run, and are tested, on a machine with no GPU and no driver
NO_DRIVER = {"decode.plan", "kernels.spec", "kernels.traits"}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def folder(module: str) -> str:
    """The folder (floor) a module lives in: '' for the base modules and the face."""
    return module.split(".")[0] if "." in module or module in FLOORS else ""


def imports(module: str, path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module relative to the package or 'cuda...' for outside ones, names)."""
    is_package = path.name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]
    if module in FLOORS:  # a folder's __init__
        here = [module] if module else []
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level == 0:
                target = node.module or ""
                if target.startswith("ferrox_driver"):
                    target = target.removeprefix("ferrox_driver").lstrip(".")
                    found.append((node.lineno, target, names))
                elif target.startswith("cuda"):
                    found.append((node.lineno, target, names))
                continue
            base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
            target = ".".join([*base, *([node.module] if node.module else [])])
            if node.module is None:  # from . import a, b: each a module of that folder
                found.extend((node.lineno, ".".join([*base, n]), []) for n in names)
            else:
                found.append((node.lineno, target, names))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("ferrox_driver"):
                    target = alias.name.removeprefix("ferrox_driver").lstrip(".")
                    found.append((node.lineno, target, []))
                elif alias.name.startswith("cuda"):
                    found.append((node.lineno, alias.name, []))
    return found


def violations() -> list[str]:
    known = modules()
    problems = []
    for module, path in known.items():
        mine = folder(module)
        face = module in FACE
        for line, target, names in imports(module, path):
            where = f"{path.relative_to(PACKAGE.parent)}:{line}"
            if target.startswith("cuda"):
                if module != "driver._bindings":
                    problems.append(f"{where}: imports {target} (only driver/_bindings may)")
                continue
            theirs = folder(target)
            if theirs == "apps" and mine != "apps" and module != "__main__":
                problems.append(f"{where}: imports {target} (nothing in the library imports apps/)")
            elif not face and FLOORS[theirs] > FLOORS[mine]:
                problems.append(f"{where}: {mine or 'base'}/ imports {target}, a higher floor")
            elif not face and theirs != mine and FLOORS[theirs] == FLOORS[mine] and mine:
                problems.append(f"{where}: {mine}/ imports {target}, a folder beside it")
            if module in NO_DRIVER and theirs == "driver":
                problems.append(
                    f"{where}: {module} imports {target} (it must run without a driver)"
                )
            if theirs != mine and not face:
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                if any(p.startswith("_") for p in target.split(".") if p != "_version"):
                    problems.append(
                        f"{where}: imports the private module {target} from another folder"
                    )
                if private:
                    problems.append(f"{where}: imports private {private} from {target}")
    return problems


def test_every_module_sits_on_a_known_floor() -> None:
    unknown = sorted(m for m in modules() if folder(m) not in FLOORS)
    assert not unknown


def test_no_import_climbs_a_floor_or_crosses_into_a_private_name() -> None:
    problems = violations()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("module", "planted", "says"),
    [
        ("driver.stream", "from ..decode.eager import gqa_decode\n", "higher floor"),
        ("decode.merge", "from cuda.bindings import driver\n", "only driver/_bindings"),
        ("cache.kv_cache", "from ..driver._bindings import drv\n", "private module"),
        ("decode.eager", "from ..apps.progress import progress\n", "nothing in the library"),
        ("parallel.sharded", "from ..integrations import transformers\n", "folder beside it"),
    ],
)
def test_the_rule_catches_a_planted_import(
    module: str, planted: str, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = modules()[module]
    text = path.read_text()
    monkeypatch.setattr(
        Path,
        "read_text",
        lambda self, *a, **k: text + planted if self == path else Path.read_bytes(self).decode(),
    )
    assert any(says in p for p in violations())
