"""``coordinator history`` and ``coordinator status --json`` on a real finished job."""

from __future__ import annotations

import csv
import io
import json

import pytest

try:
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

import test_coordinator_e2e as e2e

from coordinator.events.history import rounds_of

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 3-round, 2-site job's folder, and what status said during round 1."""
    folder = tmp_path_factory.mktemp("history")
    # A lease that outlives site-a's pause while the status command runs.
    cfg = h.job_config(strategy=e2e.STRATEGIES["fedavg"], timeouts={"lease_ttl_s": 20.0})
    coord = h.start_coordinator(folder, cfg)
    hooks = e2e.Hooks()
    hooks.pause("site-a", "before_push", 1)
    seen = {}

    def during(logs):
        hooks.wait_arrived("site-a", "before_push", 1)
        seen["status"] = h.run_cli("status", "--coordinator", coord.address, "--insecure", "--json")

    try:
        e2e.run_job(coord, hooks=hooks, during=during)
        assert coord.wait(timeout=20) == 0, coord.log_tail()
    finally:
        coord.kill()
    return folder / "state", seen


def test_status_json_is_the_reply(finished):
    _, seen = finished
    done = seen["status"]
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["round"]["round"] == 1 and data["job_name"] == "testjob"
    assert len(data["round"]["theta_hash"]) == 64  # hex, not base64
    assert {s["site"] for s in data["sites"]} == set(e2e.SITES)


def test_history_has_a_row_per_round_in_every_form(finished, tmp_path):
    state, _ = finished
    done = h.run_cli("history", "--state-dir", str(state))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].split()[0] == "ROUND" and [x.split()[0] for x in lines[1:]] == ["0", "1", "2"]

    rounds = json.loads(h.run_cli("history", "--state-dir", str(state), "--json").stdout)
    assert [r["round"] for r in rounds] == [0, 1, 2]
    for r in rounds:
        assert sorted(r["participants"]) == sorted(e2e.SITES) == sorted(r["updates"])
        assert r["update_bytes"] > 0 and r["seconds"] > 0
        assert {"aggregate", "outer_step"} <= set(r["phases"])
    # The JSON says what the log says.
    from coordinator.events.segments import read_events

    direct = [x.as_json() for x in rounds_of(read_events(state / "events.jsonl"))]
    assert json.loads(json.dumps(direct)) == rounds

    table = list(
        csv.DictReader(io.StringIO(h.run_cli("history", "--state-dir", str(state), "--csv").stdout))
    )
    assert [int(row["round"]) for row in table] == [0, 1, 2]
    assert [int(row["update_bytes"]) for row in table] == [r["update_bytes"] for r in rounds]

    plots = tmp_path / "plots"
    done = h.run_cli("history", "--state-dir", str(state), "--plots", str(plots))
    assert done.returncode == 0, done.stderr
    pngs = sorted(p.name for p in plots.iterdir())
    assert pngs == sorted(["loss_by_round.png", "loss_by_wan_bytes.png", "round_time.png"])
    for p in plots.iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000


def test_history_of_a_folder_without_a_log_says_so(tmp_path):
    done = h.run_cli("history", "--state-dir", str(tmp_path))
    assert done.returncode == 2
    assert "no event log" in done.stderr and "Traceback" not in done.stderr
