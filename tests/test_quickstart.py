"""The README's quickstart, run as it stands: provision, serve, two sites, status, export."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

from coordinator.persist.local_store import CheckpointStore

# Slow (about 30 s): `coordinator local` end to end is in test_local.py already.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def quickstart() -> str:
    text = (h.REPO / "README.md").read_text()
    # The markers are pymdownx.snippets sections: the docs' quickstart page includes the block.
    block = text.split("--8<-- [start:quickstart] -->")[1].split("<!-- --8<-- [end:quickstart]")[0]
    return block.split("```sh\n")[1].split("```")[0]


def test_the_readme_quickstart_runs_as_written(tmp_path):
    root = tmp_path / "repo"  # a checkout as the quickstart sees it: examples/ at its root
    root.mkdir()
    (root / "examples").symlink_to(h.REPO / "examples")
    script = quickstart().replace("7070", str(h.free_port()))
    env = h.subprocess_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    # Its own process group: what it starts in the background goes with it, pass or fail.
    proc = subprocess.Popen(
        ["bash", "-e", "-c", script], cwd=root, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=400)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    result = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    folder = root / "quickstart"
    logs = {p.name: p.read_text()[-1500:] for p in folder.glob("*.log")}
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:], logs)
    out = result.stdout
    assert "SITE    STATE" in out and "site-a" in out and "site-b" in out, out
    assert "job 'gpt-diloco' complete; final model: " in out, out
    assert "model of round 3 (theta " in out, out
    want = CheckpointStore(folder / "state", read_only=True).load_round(3).theta
    got = load_file(str(folder / "round3.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
