"""A late update folds into the next round of its fragment, end to end: ``coordinator local``
with two real sites over TLS, the example GPT in two fragments, rounds that close once one
site is in and a short grace has passed. site-1 stalls before it hands round 1 over, so round
1 closes without it; its update, sent while round 2 is open (site-0 stalls before it hands
round 2 over, which keeps it open), is told to wait for round 3 (the next to sync fragment 1),
held by its agent while its round-2 update goes on time, and counted into round 3 at the
strategy's ``late_discount``. Every site ends on the coordinator's theta, and no update counts
twice."""

from __future__ import annotations

from collections import Counter

import pytest

try:  # tests/ as a package or as a plain folder on sys.path
    from .test_streaming_local import job_file, run_local
except ImportError:
    from test_streaming_local import job_file, run_local

from coordinator.events.log import read_events

pytestmark = [pytest.mark.e2e]  # about 25 s: two real FSDP2 sites
FRAGMENTS, H = 2, 8  # 4 inner steps a coordinator round
LAST = H // FRAGMENTS
FAULTS = ";".join(
    [
        f"site=site-1,round=1,step={LAST},action=stall,seconds=3",
        f"site=site-0,round=2,step={LAST},action=stall,seconds=6",
    ]
)


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    folder = tmp_path_factory.mktemp("late_fold")
    rounds = {"total": 3, "inner_steps": H, "min_sites": 1, "grace_s": 0.5}
    config = job_file(folder, rounds, {"late_discount": 0.5}, fragments=FRAGMENTS, delay_steps=1)
    return run_local(folder, config, FAULTS)


def test_every_site_ends_on_the_coordinators_theta(ran):
    _, result = ran
    assert "theta hashes: every site matches the coordinator" in result.stdout


def test_the_late_update_counts_once_in_the_next_round_of_its_fragment(ran):
    run_dir, _ = ran
    events = read_events(run_dir / "coordinator" / "events.jsonl")
    closed = {e["round"]: e["updates"] for e in events if e["kind"] == "round_closed"}
    assert "site-1" not in closed[1], closed  # round 1 closed without it
    assert "site-1@late1" in closed[3], closed  # and round 3 counted it
    for r, labels in closed.items():
        assert len(labels) == len(set(labels)), (r, labels)
    counted = Counter(e["late_from"] for e in events if e["kind"] == "update")
    assert counted[1] == 1, counted  # the late one, once
    folded = [e for e in events if e["kind"] == "update" and e["late_from"] == 1]
    assert [(e["site"], e["round"], e["weight"]) for e in folded] == [("site-1", 3, 0.5)]
    assert (
        "waiting for round 3, the round of its fragment it folds into"
        in (run_dir / "site-1.log").read_text()
    )  # held, and said so
