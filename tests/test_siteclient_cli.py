"""Bad `siteclient start` command lines: non-zero exit and one line that says what to fix."""

from __future__ import annotations

import subprocess
import sys

import pytest
from coord_harness import REPO, free_port, subprocess_env

TRAIN = str(REPO / "examples" / "gpt_diloco" / "train.py")


def siteclient(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "site_client.cli", *args],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--coordinator", "127.0.0.1:1", "--site", "a", "--", "no/such/train.py"],
            "training script 'no/such/train.py' not found",
        ),
        (
            ["--coordinator", "127.0.0.1:1", "--site", "a", "--bogus-flag", "3", "--", TRAIN],
            "unknown flag --bogus-flag",
        ),
        (
            ["--coordinator", "127.0.0.1:1", "--site", "a", "--inner-steps", "0", "--", TRAIN],
            "--inner-steps must be > 0, got 0",
        ),
        (
            ["--coordinator", "127.0.0.1:1", "--site", "a", "--inner-steps", "-5", "--", TRAIN],
            "--inner-steps must be > 0, got -5",
        ),
        (["--coordinator", "127.0.0.1:1", "--site", "a", TRAIN], "missing `-- SCRIPT"),
        (["--site", "a", "--", TRAIN], "--coordinator"),
        (
            [
                "--coordinator",
                "127.0.0.1:1",
                "--site",
                "a",
                "--nproc-per-node",
                "zero",
                "--",
                TRAIN,
            ],
            "--nproc-per-node",
        ),
        (
            ["--coordinator", "127.0.0.1:1", "--site", "a", "--outage-timeout", "0", "--", TRAIN],
            "--outage-timeout must be > 0 seconds, got 0.0",
        ),
        (
            ["--coordinator", "127.0.0.1:1", "--site", "a", "--checkpoint-url", "http://b/x"]
            + ["--", TRAIN],
            "--checkpoint-url http://b/x: expected s3://BUCKET[/PREFIX]",
        ),
        (
            ["--coordinator", "127.0.0.1:1", "--site", "a", "--checkpoint-url", "s3://b/../x"]
            + ["--", TRAIN],
            "--checkpoint-url s3://b/../x: expected s3://BUCKET[/PREFIX]",
        ),
        (
            ["--coordinator", "127.0.0.1:1", "--site", "a", "--insecure", "--nnodes", "2"]
            + ["--checkpoint-dir", "/tmp", "--", TRAIN],
            "--nnodes 2: give each host its --node-rank",
        ),
        (
            ["--coordinator", "127.0.0.1:1", "--site", "a", "--insecure", "--nnodes", "2"]
            + ["--node-rank", "2", "--checkpoint-dir", "/tmp", "--", TRAIN],
            "--node-rank 2 is not one of 0..1",
        ),
        (
            ["--coordinator", "127.0.0.1:1", "--site", "a", "--insecure", "--nnodes", "1:2"]
            + ["--node-rank", "1", "--", TRAIN],
            "give --checkpoint-dir on a file system all of them see, or --checkpoint-url",
        ),
    ],
)
def test_bad_command_line_exits_with_one_line(args, expected):
    result = siteclient("start", *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("siteclient: error: ")
    assert expected in lines[0]


def test_tls_is_required_unless_insecure_is_asked_for(tmp_path):
    result = siteclient("start", "--coordinator", "127.0.0.1:1", "--site", "a", "--", TRAIN)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "mutual TLS is required" in line and "--tls-dir" in line and "--insecure" in line
    result = siteclient(
        "start",
        "--coordinator",
        "127.0.0.1:1",
        "--site",
        "a",
        "--tls-dir",
        str(tmp_path / "nothing"),
        "--",
        TRAIN,
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "cannot read cert.pem" in line


def test_unreachable_coordinator_is_retried_then_reported():
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    result = siteclient(
        "start",
        "--coordinator",
        address,
        "--site",
        "a",
        "--insecure",
        "--connect-timeout",
        "3",
        "--",
        TRAIN,
    )
    assert result.returncode == 1
    retries = [line for line in result.stderr.splitlines() if "join failed" in line]
    assert len(retries) >= 2, result.stderr  # backed off and tried again before giving up
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("siteclient: error: cannot join the job at " + address)
    assert "coordinator serve" in last
