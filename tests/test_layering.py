"""The package tree shows the design: imports go one way, and no folder is a flat heap.

``site_client`` never imports ``coordinator`` nor the reverse (a site's install must not drag
the service in, and the service must not depend on a site's internals); ``wire`` and
``strategies`` import neither. No package folder holds more than 25 modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("coordinator", "site_client", "strategies", "wire", "bench")
FORBIDDEN = {
    "coordinator": {"site_client"},
    "site_client": {"coordinator"},
    "wire": {"coordinator", "site_client", "strategies"},
    "strategies": {"coordinator", "site_client"},
}
MAX_MODULES = 25


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(top-level package, line) of every absolute import in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add((node.module.split(".")[0], node.lineno))
        elif isinstance(node, ast.Import):
            found |= {(a.name.split(".")[0], node.lineno) for a in node.names}
    return found


def layer_violations(root: Path) -> list[str]:
    out = []
    for package, banned in FORBIDDEN.items():
        for path in sorted((root / package).rglob("*.py")):
            for top, line in sorted(imported_packages(path)):
                if top in banned:
                    out.append(f"{path.relative_to(root)}:{line} imports {top}")
    return out


def crowded_folders(root: Path, limit: int = MAX_MODULES) -> list[str]:
    out = []
    for package in PACKAGES:
        for folder in [root / package, *(p.parent for p in (root / package).rglob("__init__.py"))]:
            modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
            if len(modules) > limit:
                out.append(f"{folder.relative_to(root)}: {len(modules)} modules")
    return sorted(set(out))


def test_no_layer_reaches_across():
    assert layer_violations(ROOT) == []


def test_no_package_folder_is_crowded():
    assert crowded_folders(ROOT) == []


@pytest.mark.parametrize(
    "package, source, reported",
    [
        ("site_client", "from coordinator.persist import disk\n", "imports coordinator"),
        ("wire", "import strategies.base\n", "imports strategies"),
        (
            "coordinator",
            "def f():\n    from site_client import SiteSession\n",
            "imports site_client",
        ),
    ],
)
def test_a_reaching_import_is_reported(tmp_path, package, source, reported):
    (tmp_path / package).mkdir()
    (tmp_path / package / "leak.py").write_text(source)
    assert [v for v in layer_violations(tmp_path) if reported in v] != []


def test_a_crowded_folder_is_reported(tmp_path):
    folder = tmp_path / "wire" / "codecs"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    for i in range(4):
        (folder / f"m{i}.py").write_text("")
    assert crowded_folders(tmp_path, limit=3) == [f"{Path('wire/codecs')}: 4 modules"]
    assert crowded_folders(tmp_path, limit=4) == []
