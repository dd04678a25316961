"""A job.toml copied away from the repository: its paths follow the file, and a factory that
does not import says which folder must be importable."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import pytest

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
    from .test_coordinator_cli import one_line_error
except ImportError:
    import coord_harness as h
    from test_coordinator_cli import one_line_error

from coordinator.config import load_config
from coordinator.model_source import import_hint

pytestmark = pytest.mark.e2e
EXAMPLE = h.REPO / "examples" / "gpt_diloco" / "job.toml"
FACTORY = """import torch


def build():
    return torch.nn.Linear(2, 3)
"""


def test_a_copied_example_keeps_its_state_beside_it(tmp_path):
    shutil.copy(EXAMPLE, tmp_path / "job.toml")
    assert load_config(tmp_path / "job.toml").state_dir == tmp_path / "state"


def as_installed(tmp_path) -> dict[str, str]:
    """An environment where isthmus is importable as if installed: its packages, and not the
    repository's ``examples``."""
    site = tmp_path / "site-packages"
    site.mkdir()
    for package in ("coordinator", "site_client", "strategies", "wire"):
        (site / package).symlink_to(h.REPO / package)
    return {"PYTHONPATH": str(site)}


def test_a_copied_example_says_which_folder_must_be_importable(tmp_path):
    shutil.copy(EXAMPLE, tmp_path / "job.toml")
    result = h.run_cli_module(
        "coordinator.cli", "serve", "--config", "job.toml", "--insecure",
        "--set", "server.listen=127.0.0.1:0", cwd=tmp_path, env=as_installed(tmp_path),
    )  # fmt: skip
    assert result.returncode == 2
    line = one_line_error(result)
    assert "No module named 'examples'" in line, line
    assert f"working directory ({tmp_path})" in line and "neither holds examples/" in line, line
    assert "add that folder to PYTHONPATH" in line, line


def test_the_folder_above_the_config_that_holds_the_factory_is_named(tmp_path):
    project = tmp_path / "project"
    (project / "mypkg").mkdir(parents=True)
    (project / "mypkg" / "__init__.py").write_text("")
    (project / "mypkg" / "model.py").write_text(FACTORY)
    (project / "configs").mkdir()
    cfg = h.job_config(name="mine", model={"factory": "mypkg.model:build", "kwargs": {}})
    path = h.write_config(project / "configs", cfg)
    result = h.run_cli("serve", "--config", str(path), "--insecure", cwd=tmp_path)
    assert result.returncode == 2
    line = one_line_error(result)
    assert f"{project} holds mypkg.model: run `coordinator serve` from {project}" in line, line
    # ... and from there it serves.
    proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "serve", "--config", str(path),
        "--insecure"], cwd=project, env=h.subprocess_env(), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    address = project / "configs" / "state" / "address"
    try:
        h.wait_until(address.exists, timeout=60, what="the coordinator to listen")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err


def test_import_hint_rules(tmp_path):
    (tmp_path / "a" / "pkg").mkdir(parents=True)
    (tmp_path / "a" / "pkg" / "m.py").write_text("")
    below = tmp_path / "a" / "conf" / "deep"
    below.mkdir(parents=True)
    assert import_hint("pkg.m", "pkg", below, tmp_path).startswith(f"{tmp_path / 'a'} holds pkg.m")
    assert "not installed" in import_hint("pkg.m", "numpyx", below, tmp_path)
    assert "neither holds nope/" in import_hint("nope.m", "nope", below, tmp_path)
