"""The docs stay true to the tree: every config field has help text, the generated reference
lists every table the loader reads, and what README.md and docs/ name exists.

``make test`` also builds the site with ``mkdocs build --strict``, which fails on a link to a
missing page or anchor inside ``docs/``; these tests cover what that build does not see.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import typing
from pathlib import Path

import pytest

from coordinator import config
from coordinator.config_reference import TABLES, missing_help, render, table_fields

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
PACKAGES = ("coordinator", "site_client", "wire", "strategies")
FOLDERS = (*PACKAGES, "examples", "tests", "bench", "docs")
GENERATED = ("reference/configuration.md", "reference/cli.md")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def relative_links(text: str) -> list[str]:
    """The targets of Markdown links and images that are neither URLs nor in-page anchors."""
    return [t for t in LINK.findall(text) if not re.match(r"^([a-z]+:|#)", t)]


def test_every_field_of_every_table_has_help():
    assert missing_help() == []


def test_the_reference_lists_every_table_the_loader_reads():
    listed = {t.key for t in TABLES}
    assert set(config.SECTIONS) <= listed, set(config.SECTIONS) - listed
    classes = {t.cls for t in TABLES}
    hints = typing.get_type_hints(config.JobConfig)
    for f in dataclasses.fields(config.JobConfig):
        kinds = [k for k in typing.get_args(hints[f.name]) or (hints[f.name],) if k is not None]
        for kind in kinds:
            if dataclasses.is_dataclass(kind):
                assert kind in classes, f"JobConfig.{f.name}: {kind.__name__} is not in TABLES"


def test_the_reference_has_a_row_for_every_key():
    page = render()
    for table in TABLES:
        for f in table_fields(table.cls):
            if f.metadata.get("rest"):
                continue
            key = f.name if table.array else f"{table.key}.{f.name}"
            assert f"| `{key}` |" in page, key


def test_a_field_without_help_is_reported():
    @dataclasses.dataclass(frozen=True)
    class Bare:
        n: int = 1

    assert missing_help((dataclasses.replace(TABLES[0], key="bare", cls=Bare),))[-1] == "bare.n"


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 300


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_name_files_that_exist(page):
    """Every relative link names a file in the repository; inside docs/, the two pages
    ``docs/hooks.py`` generates at build time count too (the README links to neither)."""
    generated = {DOCS / uri for uri in GENERATED} if page != README else set()
    missing = []
    for target in relative_links(page.read_text()):
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists() and path not in generated:
            missing.append(target)
    assert missing == []


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_files_and_modules_named_in_code_exist(page):
    """A file path (``coordinator/round/rules.py``) or a dotted name
    (``coordinator.persist.export.load_model``) in backquotes names something in the tree."""
    wrong = []
    for span in CODE.findall(page.read_text()):
        name = span.split(":")[0].rstrip(".,")
        if name.startswith(tuple(f"{f}/" for f in FOLDERS)):
            if not any(c in name for c in "*<") and not (ROOT / name).exists():
                wrong.append(name)
        elif _dotted(name) and not _resolves(name):
            wrong.append(name)
    assert wrong == []


def _dotted(name: str) -> bool:
    return bool(re.fullmatch(r"[a-z_]+(\.[A-Za-z_]\w*)+", name)) and name.split(".")[0] in PACKAGES


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            if importlib.util.find_spec(module) is None:
                continue
        except ModuleNotFoundError:  # a parent that is a module, not a package
            continue
        obj = importlib.import_module(module)
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_included_readme_section_is_marked_in_the_readme():
    readme = README.read_text()
    for page in DOCS.rglob("*.md"):
        for name in re.findall(r'--8<-- "README\.md:([\w-]+)"', page.read_text()):
            assert f"--8<-- [start:{name}]" in readme and f"--8<-- [end:{name}]" in readme, name


def test_the_cli_reference_has_every_command():
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = hooks.cli_reference()
    for command in ("serve", "status", "export", "local", "history", "drain", "undrain"):
        assert f"`coordinator {command}`" in page
    for action in ("init", "server", "issue", "operator", "revoke"):
        assert f"`coordinator certs {action}`" in page
    assert "`siteclient start`" in page and "usage: siteclient start" in page
