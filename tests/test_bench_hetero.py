"""``bench.hetero``'s figures from given records (``bench.hetero.report``): tokens trained and
counted, the comparison at equal wall time and equal tokens, the last line; and its plan's
refusals. The runs themselves are the benchmark's (``python -m bench.hetero``)."""

from __future__ import annotations

import math

import pytest

from bench.hetero.plan import make_plan, parse_args, spec_of
from bench.hetero.report import (
    Point,
    RunResult,
    compare,
    counted_by_site,
    counted_by_version,
    headline,
    last_line,
    points_of,
    site_lines,
    tokens_trained,
)
from bench.utilisation_report import SiteUse


def use(utilisation: float) -> SiteUse:
    return SiteUse(tasks=2, compute_s=utilisation * 10, wall_s=10.0, gaps_s=0.0, merge_wait_s=0)


def test_tokens_trained_count_every_task_cancelled_or_not():
    records = [
        {"kind": "steps", "round": 0, "steps": 40},
        {"kind": "steps", "round": 1, "steps": 15},  # cancelled at step 15: trained all the same
        {"kind": "merge", "round": 1, "step": 30},
        {"kind": "steps", "round": 2},  # an older trainer's record: no count
    ]
    assert tokens_trained(records, 256.0) == 55 * 256


def test_counted_tokens_sum_each_closed_rounds_weights_into_the_next_version():
    events = [
        {"kind": "update", "round": 0, "weight": 1.0},
        {"kind": "update", "round": 0, "weight": 1.0},
        {"kind": "round_closed", "round": 0},
        {"kind": "update", "round": 1, "weight": 1.0},
        {"kind": "update", "round": 1, "weight": 0.5},  # a late one at its discount
        {"kind": "round_closed", "round": 1},
        {"kind": "update", "round": 2, "weight": 1.0},  # its round never closed: not in theta
    ]
    assert counted_by_version(events, 100.0) == {0: 0.0, 1: 200.0, 2: 350.0}
    by_site = [{**e, "site": f"site-{i % 2}"} for i, e in enumerate(events)]
    assert counted_by_site(by_site, 100.0) == {"site-0": 250.0, "site-1": 200.0}


def test_points_are_the_versions_with_a_time_a_loss_and_tokens():
    points = points_of({0: 100.0, 1: 103.0, 2: 107.0}, {0: 5.0, 1: 4.0}, {0: 0, 1: 9, 2: 18}, 101)
    assert points == [Point(0, 0.0, 0, 5.0), Point(1, 2.0, 9, 4.0)]  # v2 not evaluated


def run(name: str, points: list[Point], cus=(0.9, 0.95)) -> RunResult:
    sites = {f"site-{i}": use(c) for i, c in enumerate(cus)}
    return RunResult(name, sites, tokens_trained=1e6, points=points)


def test_runs_are_compared_at_the_shortest_span_and_the_fewest_counted_tokens():
    fast = run("async", [Point(0, 0, 0, 5.0), Point(1, 4, 100, 4.0), Point(2, 8, 200, 3.0)])
    slow = run("streaming", [Point(0, 0, 0, 5.0), Point(1, 6, 150, 3.5), Point(2, 12, 300, 3.2)])
    c = compare([fast, slow])
    assert c.wall_s == 8 and c.tokens == 200
    assert c.loss_at_wall == {"async": 3.0, "streaming": 3.5}
    assert c.tokens_at_wall == {"async": 200, "streaming": 150}
    assert c.loss_at_tokens == {"async": 3.0, "streaming": 3.5}
    figures = headline([fast, slow], c)
    assert figures["async_cu_min"] == pytest.approx(0.9)
    assert figures["async_loss_vs_streaming_pct"] == pytest.approx(100 * (3.0 - 3.5) / 3.5)
    assert figures["async_tokens_vs_streaming"] == pytest.approx(200 / 150)
    assert last_line(figures).startswith("async_cu_min=0.9 streaming_cu_min=0.9 ")
    assert math.isnan(run("x", []).span_s)
    killed = run("async-kill", [Point(0, 0, 0, 5.0), Point(1, 5, 90, 3.9)], cus=(0.9, 0.2))
    killed.killed = "site-1"
    assert killed.cu_min == pytest.approx(0.9)  # the killed site's downtime is left out
    with_kill = compare([fast, slow, killed])
    assert (with_kill.wall_s, with_kill.tokens) == (8, 200)  # from the runs without a kill
    assert with_kill.loss_at_wall["async-kill"] == 3.9
    fast.by_site = {"site-1": (20e3, 10e3), "site-0": (30e3, 30e3)}
    assert site_lines([fast]) == ["async      site-0 30/30, site-1 10/20"]


def test_the_plan_and_the_runs_jobs(tmp_path):
    plan = make_plan(parse_args(["--quick"]))
    assert plan.runs == ["blocking", "streaming", "async", "streaming-kill", "async-kill"]
    assert plan.inner_steps == 40 and plan.down_s == 5.0
    assert spec_of("async-kill", plan) == spec_of("async", plan)  # the same job, a kill added
    blocking, asynchronous = spec_of("blocking", plan), spec_of("async", plan)
    assert (blocking.fragments, blocking.min_sites) == (1, 3)
    assert (asynchronous.fragments, asynchronous.delay_steps, asynchronous.min_sites) == (2, 15, 2)
    cfg = asynchronous.config(tmp_path)
    assert cfg["streaming"]["merge"] == "when_ready" and cfg["strategy"]["late_discount"] == 0.5
    assert cfg["rounds"]["max_staleness"] == 3
    assert cfg["rounds"]["grace_s"] == 0.3 and "grace_s" not in blocking.config(tmp_path)["rounds"]
    for argv in (["--runs", "fast"], ["--inner-steps", "42"], ["--slowdown", "0.5"]):
        with pytest.raises(SystemExit):
            make_plan(parse_args(argv))


def test_the_example_trainer_takes_a_slowdown_of_one_or_more(capsys):
    from examples.gpt_diloco import train

    assert train.parse_args([]).slowdown == 1.0
    assert train.parse_args(["--slowdown", "2"]).slowdown == 2.0
    with pytest.raises(SystemExit):
        train.parse_args(["--slowdown", "0.5"])
    assert "--slowdown must be >= 1" in capsys.readouterr().err
