"""``[streaming] merge = "when_ready"`` end to end: ``coordinator local`` with two real sites
over TLS, the example GPT in two fragments. One site stalls before it hands over round 1, so
round 1 closes late: the other site trains on past step tau of its next task instead of
waiting there, and merges round 1's result at its last step, the one step that waits. Every
site still ends on the coordinator's theta."""

from __future__ import annotations

import pytest

try:  # tests/ as a package or as a plain folder on sys.path
    from .test_streaming_local import job_file, records, run_local
except ImportError:
    from test_streaming_local import job_file, records, run_local

pytestmark = [pytest.mark.e2e]  # about 20 s: two real FSDP2 sites
FRAGMENTS, TAU, H = 2, 1, 8  # 4 inner steps a task, the merge from step 1 on
LAST = H // FRAGMENTS - 1
STALL = f"site=site-1,round=1,step={H // FRAGMENTS},action=stall,seconds=4"


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    folder = tmp_path_factory.mktemp("when_ready")
    rounds = {"total": 2, "inner_steps": H}
    config = job_file(folder, rounds, fragments=FRAGMENTS, delay_steps=TAU, merge="when_ready")
    return run_local(folder, config, STALL)


def test_every_site_ends_on_the_coordinators_theta(ran):
    _, result = ran
    assert "theta hashes: every site matches the coordinator" in result.stdout


def test_a_site_trains_on_past_tau_while_the_round_is_late(ran):
    run_dir, _ = ran
    merges = {
        site: {
            m["round"]: m["step"]
            for m in records(run_dir / site / "trainer_timings.jsonl", "merge")
        }
        for site in ("site-0", "site-1")
    }
    rounds = FRAGMENTS * 2  # rounds.total = 2 outer rounds of P coordinator rounds
    for site, at in merges.items():
        assert sorted(at) == list(range(1, rounds)), (site, at)
        assert all(TAU <= step <= LAST for step in at.values()), (site, at)
    # Round 1 closed only once site-1 was past its 4 s stall: site-0 trained steps 1 and 2
    # of round 2 on the fragment as it was, and merged before its last step, waiting there.
    assert merges["site-0"][2] == LAST, merges
    steps = {s["round"]: s for s in records(run_dir / "site-0" / "trainer_timings.jsonl", "steps")}
    assert steps[2]["merge_wait_s"] > 0, steps[2]
    assert all(s["steps"] == LAST + 1 for s in steps.values()), steps  # none cut short
