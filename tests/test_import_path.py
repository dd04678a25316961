"""Where a job's own modules import from (``coordinator.import_path``): the nearest folder up
from the config file that holds the module, whatever the working directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.import_path import (
    describe,
    import_folders,
    job_modules,
    project_folder,
    with_import_path,
)
from wire.config_table import ConfigError

REPO = Path(__file__).resolve().parent.parent


def package(folder: Path, module: str) -> Path:
    """Lay out ``module`` (``a.b.c``) as a package under ``folder``: ``a/__init__.py``,
    ``a/b/__init__.py`` and ``a/b/c.py``."""
    parts = module.split(".")
    for i in range(1, len(parts)):
        pkg = folder.joinpath(*parts[:i])
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").touch()
    path = folder.joinpath(*parts).with_suffix(".py")
    path.write_text("")
    return path


def config_in(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.toml").write_text("")
    return folder / "job.toml"


def test_the_folder_holding_the_package_is_found_above_the_config(tmp_path):
    package(tmp_path / "project", "mypkg.model")
    config = config_in(tmp_path / "project" / "configs" / "deep")
    assert project_folder("mypkg.model", config) == tmp_path / "project"
    # A module file right beside the config counts too.
    package(tmp_path / "project" / "configs" / "deep", "beside")
    assert project_folder("beside", config) == tmp_path / "project" / "configs" / "deep"


def test_a_module_no_folder_above_holds_is_not_found(tmp_path):
    config = config_in(tmp_path / "project")
    assert project_folder("nowhere_pkg.model", config) is None
    # The package alone is not enough: the module itself must be in it.
    package(tmp_path / "project", "mypkg.other")
    assert project_folder("mypkg.model", config) is None


def test_the_nearest_of_two_folders_holding_the_package_wins(tmp_path):
    package(tmp_path / "outer", "mypkg.model")
    package(tmp_path / "outer" / "inner", "mypkg.model")
    config = config_in(tmp_path / "outer" / "inner" / "configs")
    assert project_folder("mypkg.model", config) == tmp_path / "outer" / "inner"


def test_a_relative_config_path_is_taken_from_the_working_directory(tmp_path, monkeypatch):
    package(tmp_path / "project", "mypkg.model")
    config_in(tmp_path / "project" / "configs")
    monkeypatch.chdir(tmp_path / "project")
    assert project_folder("mypkg.model", Path("configs/job.toml")) == tmp_path / "project"
    monkeypatch.chdir(tmp_path / "project" / "configs")
    assert project_folder("mypkg.model", Path("job.toml")) == tmp_path / "project"


def test_the_example_job_imports_from_the_repository_root():
    config = REPO / "examples" / "gpt_diloco" / "job.toml"
    modules = job_modules(load_config(config))
    assert modules == [
        ("model.factory", "examples.gpt_diloco.model"),
        ("evaluation.fn", "examples.gpt_diloco.evaluate"),
    ]
    folders = import_folders(modules, config, Path("/"), is_installed=lambda _: False)
    assert folders == {REPO: ["examples.gpt_diloco.model", "examples.gpt_diloco.evaluate"]}
    line = describe(folders)
    assert line.startswith(f"import path: added {REPO} (holds examples.gpt_diloco.model, ")


def test_a_plugin_strategy_is_a_module_of_the_job_and_a_flower_one_is_not():
    config = REPO / "examples" / "custom_strategy" / "job.toml"
    modules = dict(job_modules(load_config(config)))
    assert modules["strategy.name"] == "examples.custom_strategy.strategy"
    flower = load_config(config, ["strategy.name=flower:FedAvg"])
    assert "strategy.name" not in dict(job_modules(flower))


def test_installed_modules_and_the_working_directory(tmp_path):
    config = config_in(tmp_path / "project")
    cwd = tmp_path / "elsewhere"
    package(cwd, "here_pkg.m")
    modules = [("model.factory", "torch.nn"), ("evaluation.fn", "here_pkg.m")]
    # torch is installed: nothing to add for it; here_pkg only the working directory holds.
    assert import_folders(modules, config, cwd) == {cwd: ["here_pkg.m"]}


def test_a_module_found_nowhere_is_a_one_line_error_naming_key_module_and_places(tmp_path):
    config = config_in(tmp_path / "project" / "configs")
    modules = [("evaluation.fn", "nowhere_pkg.evaluate")]
    with pytest.raises(ConfigError) as info:
        import_folders(modules, config, tmp_path / "cwd", is_installed=lambda _: False)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("evaluation.fn: cannot find module 'nowhere_pkg.evaluate'")
    assert f"in {tmp_path / 'project' / 'configs'} or any folder above it" in message
    assert f"the working directory {tmp_path / 'cwd'}" in message
    assert "no installed package 'nowhere_pkg'" in message
    assert "put nowhere_pkg/ in the config file's folder or one above it" in message


def test_the_folders_come_first_on_pythonpath(tmp_path):
    env = with_import_path({"PYTHONPATH": "/theirs", "X": "1"}, [tmp_path / "a", tmp_path / "b"])
    assert env["PYTHONPATH"].split(os.pathsep) == [
        str(tmp_path / "a"),
        str(tmp_path / "b"),
        "/theirs",
    ]
    assert env["X"] == "1"
    assert with_import_path({"X": "1"}, []) == {"X": "1"}
    assert with_import_path({}, [tmp_path])["PYTHONPATH"] == str(tmp_path)
