"""How each site trains, in status, metrics and the page's data: inner steps per second, the
share of time in tasks, updates counted (and how many late), from the agents' clocks and the
coordinator's counts; figures a site reports that are no measurement count as none."""

from __future__ import annotations

import pytest
from core_helpers import Clock, delta_like, new_core, push

from coordinator.observe.metrics import SnapshotCollector
from coordinator.observe.status import format_status, status_reply
from site_client.agent.metrics import ComputeClock
from wire.codecs.link_rate import measured

SITES = ("site-a", "site-b")


def test_the_agent_times_its_tasks_steps_and_utilisation():
    clock = ComputeClock()
    assert clock.utilisation(5.0) == 0.0 and clock.last_steps_per_s == 0.0
    clock.task_taken(10.0, steps=40)
    clock.task_handed_over(14.0)  # 40 steps in 4 s
    assert clock.last_task_s == 4.0 and clock.last_steps_per_s == 10.0
    clock.task_taken(18.0, steps=40)  # 4 s waiting on the WAN between the tasks
    clock.task_handed_over(20.0)
    assert clock.last_steps_per_s == 20.0
    assert clock.utilisation(20.0) == pytest.approx(6.0 / 10.0)


def test_a_task_counts_the_compute_its_trainers_report_not_when_it_was_taken():
    """A streaming task is taken at its merge, after most of its steps: the seconds its
    trainers report in step bodies are the task's compute, for the pace and the deadline."""
    clock = ComputeClock()
    clock.task_taken(10.0, steps=80)
    clock.task_handed_over(11.0, compute_s=4.0)  # taken at step 60: held 1 s, computed 4 s
    assert clock.last_task_s == 4.0 and clock.last_steps_per_s == 20.0
    assert clock.utilisation(15.0) == pytest.approx(4.0 / 5.0)


def test_status_and_metrics_show_each_sites_pace_and_counts(tmp_path):
    clock = Clock()
    core = new_core(tmp_path, clock, rounds={"max_sites": 2})
    try:
        tokens = {s: core.join(s)[0].token for s in SITES}
        clock.now += 1.0
        core.tick()
        core.heartbeat(
            "site-a", tokens["site-a"], {"steps_per_s": 12.5, "compute_utilisation": 0.9}
        )
        for site in SITES:
            push(core, site, tokens[site], 0, delta_like(core, 1.0))
        assert core.tick() and core.round.number == 1
        clock.now += 1.0
        core.tick()  # round 1 opens
        push(core, "site-a", tokens["site-a"], 1, delta_like(core, 1.0))
        reply = status_reply(core.snapshot())
        by_site = {s.site: s for s in reply.sites}
        assert by_site["site-a"].progress.steps_per_s == 12.5
        assert by_site["site-a"].progress.compute_utilisation == 0.9
        assert (by_site["site-a"].updates_counted, by_site["site-b"].updates_counted) == (2, 1)
        lines = format_status(reply).splitlines()
        header = next(x for x in lines if x.startswith("SITE"))
        assert "STEPS/S  UTIL  COUNTED" in header
        row = {x.split()[0]: x.split() for x in lines if x.startswith("site-")}
        assert row["site-a"][-5:-2] == ["12.5", "90%", "2"]
        assert row["site-b"][-5:-2] == ["-", "-", "1"]
        families = {f.name: f for f in SnapshotCollector(core.snapshot).collect()}
        late = families["isthmus_site_late_updates"].samples
        assert {s.labels["site"]: s.value for s in late} == {"site-a": 0.0, "site-b": 0.0}
        pace = families["isthmus_site_steps_per_second"].samples
        assert {s.labels["site"]: s.value for s in pace} == {"site-a": 12.5, "site-b": 0.0}
    finally:
        core.close()


@pytest.mark.parametrize("value", [float("nan"), float("-inf"), -1.0])
def test_a_reported_pace_that_is_no_measurement_reads_as_none(value):
    assert measured(value) == 0.0
