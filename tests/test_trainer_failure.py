"""A failed trainer says why, in one block: rank, exit, exception, file:line, its stderr's last
lines; a usage error (exit 2) is not restarted. Real agents and trainers on a real coordinator."""

from __future__ import annotations

import re

import pytest

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

from site_client.launch.trainer_failure import TrainerFailure, block, restartable, root_cause

pytestmark = pytest.mark.e2e

USAGE = """import argparse
p = argparse.ArgumentParser(prog="train.py")
p.add_argument("--site-index", type=int, required=True)
p.parse_args()
"""
RAISES = """import os

def step():
    raise ValueError("loss is nan at rank " + os.environ["RANK"])

print("training")
step()
"""


@pytest.fixture(scope="module")
def coord(tmp_path_factory):
    folder = tmp_path_factory.mktemp("coord")
    proc = h.start_coordinator(folder, h.job_config(name="fails", rounds={"max_sites": 4}))
    yield proc
    proc.kill()


def start_site(coord, tmp_path, script: str, site: str, *flags: str):
    path = tmp_path / "train.py"
    path.write_text(script)
    return h.run_cli_module(
        "site_client.cli", "start", "--coordinator", coord.address, "--site", site,
        "--insecure", "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "2", *flags,
        "--", str(path), timeout=120,
    )  # fmt: skip


def report_of(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("siteclient: error:"))
    return lines[start:]


def test_a_usage_error_is_said_and_not_restarted(coord, tmp_path):
    result = start_site(coord, tmp_path, USAGE, "usage-site")
    assert result.returncode == 1
    report = report_of(result.stderr)
    # Both ranks fail alike; which the launcher hears of first is a race.
    head = (
        r"siteclient: error: trainers of site usage-site failed: rank [01] exited with 2 \(a "
        r"usage error: not restarted\): train\.py: error: the following arguments are "
        r"required: --site-index"
    )
    assert re.fullmatch(head, report[0]), report
    assert "after 1 attempt(s)" in report[1], report
    assert "    | usage: train.py [-h] --site-index SITE_INDEX" in report, report
    assert result.stderr.count("failed (exitcode: 2)") == 1, "restarted after a usage error"


def test_an_exception_names_its_rank_file_and_line(coord, tmp_path):
    result = start_site(coord, tmp_path, RAISES, "raise-site", "--max-restarts", "1")
    assert result.returncode == 1
    report = report_of(result.stderr)
    script = tmp_path / "train.py"
    rank = r"rank (?P<rank>[01]) exited with 1"
    cause = rf"ValueError: loss is nan at rank (?P=rank) at {re.escape(str(script))}:4"
    head = rf"siteclient: error: trainers of site raise-site failed: {rank}: {cause}"
    assert re.fullmatch(head, report[0]), report
    assert "after 2 attempt(s)" in report[1], report
    assert any(x.startswith("    | ValueError: loss is nan") for x in report), report
    assert "ChildFailedError" not in result.stderr and "=====" not in result.stderr


def test_root_cause_rules():
    traceback = (
        "noise",
        "Traceback (most recent call last):",
        '  File "/x/train.py", line 9, in <module>',
        "    main()",
        '  File "/x/lib.py", line 3, in main',
        "    raise RuntimeError('bad')",
        "RuntimeError: bad",
    )
    cause = root_cause(traceback)
    assert (cause.summary, cause.where) == ("RuntimeError: bad", "/x/lib.py:3")
    assert root_cause(("usage: t", "t: error: no")).summary == "t: error: no"
    prefixed = tuple(f"[rank1]: {x}" for x in traceback)
    assert root_cause(prefixed) == cause, "torch's rank prefix"
    assert root_cause(()).summary == "(nothing on stderr)"
    assert not restartable([2, 1]) and restartable([1, -9])
    killed = TrainerFailure(3, 1, 99, -9, None)
    text = block("s", killed, [], 2)
    assert text.splitlines()[0].startswith("siteclient: error: trainers of site s failed: rank 3")
    assert "was killed by SIGKILL" in text
