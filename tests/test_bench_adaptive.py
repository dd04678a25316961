"""``python -m bench.adaptive``: the link's phases in rounds, the utilisation per phase from
synthetic timing records, the codecs per round, the last line from given runs, and the job
config the adaptive run writes."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest

from bench.adaptive_report import (
    Phase,
    RunResult,
    downlink_codecs,
    headline,
    last_line,
    loss_vs_pct,
    phase_bounds,
    phase_uses,
    rung_runs,
    slowest_phase,
    task_phases,
    uplink_codecs,
)
from bench.utilisation_report import SiteUse, parse_figures

PHASES = [Phase("fast1", 50, 2), Phase("slow", 4, 3), Phase("fast2", 50, 1)]


def _task(round_number: int, first: float, last: float, compute: float) -> dict:
    return {
        "kind": "steps",
        "round": round_number,
        "compute_s": compute,
        "first_step_at": first,
        "last_step_at": last,
        "merge_wait_s": 0.0,
    }


def _use(utilisation: float) -> SiteUse:
    return SiteUse(tasks=1, compute_s=utilisation, wall_s=1.0, gaps_s=0.0, merge_wait_s=0.0)


def _run(name: str, cu: float, slow_cu: float, loss: float) -> RunResult:
    """Two sites; the second one the lower in the whole run and the slow phase."""
    return RunResult(
        name=name,
        sites=[_use(1.0), _use(cu)],
        phases=[[_use(1.0)] * 3, [_use(1.0), _use(slow_cu), _use(0.9)]],
        bytes_up=1,
        bytes_down=1,
        val_loss=loss,
    )


def test_phases_are_consecutive_rounds_and_the_slow_one_is_the_lowest_rate():
    assert phase_bounds(PHASES) == [(0, 2), (2, 5), (5, 6)]
    assert slowest_phase(PHASES) == 1
    assert slowest_phase([Phase("a", 8, 1), Phase("b", 2, 1), Phase("c", 2, 1)]) == 1


def test_a_task_counts_in_the_slower_phase_of_the_sync_it_merges():
    # Task k merges round k-1's sync: task 2 waits for round 1's delta fetched on the slow
    # link, task 5 for round 4's push sent on it; task 6 (past the phases) is not counted.
    assert task_phases(PHASES) == [0, 0, 1, 1, 1, 1]
    assert task_phases([Phase("a", 2, 1), Phase("b", 8, 2)]) == [0, 0, 1]
    records = [
        {"kind": "load", "s": 9.0},
        _task(0, 0.0, 1.0, 1.0),
        _task(1, 1.0, 2.0, 1.0),
        _task(2, 2.0, 3.0, 1.0),
        _task(3, 4.0, 5.0, 1.0),
        _task(4, 7.0, 8.0, 1.0),
        _task(5, 8.0, 10.0, 1.0),
        _task(6, 10.0, 11.0, 1.0),
    ]
    fast1, slow, fast2 = phase_uses(records, PHASES)
    assert (fast1.tasks, slow.tasks, fast2) == (2, 4, None)
    assert fast1.utilisation == pytest.approx(1.0)
    assert slow.utilisation == pytest.approx(4.0 / 8.0)  # 2.0 -> 10.0
    assert slow.gaps_s == pytest.approx(1.0 + 2.0)


def test_a_phase_without_tasks_has_no_use():
    longer = [*PHASES[:2], Phase("fast2", 50, 3)]
    uses = phase_uses([_task(0, 0.0, 1.0, 1.0), _task(6, 1.0, 2.0, 0.5)], longer)
    assert uses[1] is None and uses[2].utilisation == pytest.approx(0.5)


def test_codecs_per_round_take_the_last_push_and_default_to_the_fixed_codec():
    pushes = [
        {"kind": "push", "round": 0, "s": 1.0},  # a fixed job's push names no codec
        {"kind": "push", "round": 1, "codec": "none"},
        {"kind": "push", "round": 1, "codec": "int8"},  # sent again: the last one counts
        {"kind": "fetch", "round": 2, "codec": "int4"},
    ]
    assert uplink_codecs(pushes, "none") == {0: "none", 1: "int8"}
    events = [
        {"kind": "update", "round": 0, "codecs": {"int8": 10}},
        {"kind": "round_closed", "round": 0},
        {"kind": "round_closed", "round": 1, "downlink_codec": "int4"},
    ]
    assert downlink_codecs(events, "int8") == {0: "int8", 1: "int4"}
    assert rung_runs(["none", "none", "int8", "int4", "int4", "none"]) == (
        "none x2, int8 x1, int4 x2, none x1"
    )


def test_the_last_line_compares_with_fp32_and_takes_the_lowest_site():
    results = [
        _run("fp32", cu=0.6, slow_cu=0.3, loss=4.0),
        _run("int4", cu=0.95, slow_cu=0.96, loss=4.2),
        _run("adaptive", cu=0.97, slow_cu=0.8, loss=4.04),
    ]
    line = last_line(headline(results, PHASES))
    assert line.startswith("adaptive_cu=0.9700 adaptive_cu_slow=0.8000 ")
    figures = parse_figures(line)
    assert list(figures) == [
        "adaptive_cu",
        "adaptive_cu_slow",
        "adaptive_loss_vs_fp32_pct",
        "fixed_int4_loss_vs_fp32_pct",
        "fixed_fp32_cu",
        "fixed_fp32_cu_slow",
    ]
    assert figures["adaptive_loss_vs_fp32_pct"] == pytest.approx(1.0)
    assert figures["fixed_int4_loss_vs_fp32_pct"] == pytest.approx(5.0)
    assert figures["fixed_fp32_cu"] == pytest.approx(0.6)
    assert figures["fixed_fp32_cu_slow"] == pytest.approx(0.3)
    assert loss_vs_pct(3.0, 4.0) == pytest.approx(-25.0)


def test_missing_runs_give_nan_not_an_error():
    figures = parse_figures(last_line(headline([_run("adaptive", 0.9, 0.9, 4.0)], PHASES)))
    assert figures["adaptive_cu"] == pytest.approx(0.9)
    assert math.isnan(figures["adaptive_loss_vs_fp32_pct"])
    assert math.isnan(figures["fixed_fp32_cu_slow"])


def test_the_adaptive_run_writes_the_ladder_on_both_links(tmp_path: Path):
    from coord_harness import write_config

    from bench.adaptive import AdaptiveSpec, make_plan, parse_args, spec_of
    from wire.codecs.rules import compression_tables

    plan = make_plan(parse_args(["--quick"]))
    assert [p.rounds for p in plan.phases] == [2, 4, 2] and plan.delay_steps == 30
    cfg = spec_of("adaptive", plan).config(tmp_path)
    assert cfg["rounds"]["total"] * cfg["streaming"]["fragments"] == 8
    table = tomllib.loads(write_config(tmp_path, cfg).read_text())["compression"]
    up, down = compression_tables(table)
    assert (up.mode, down.mode) == ("adaptive", "adaptive")
    assert [c.name for c in up.ladder] == [c.name for c in down.ladder] == ["none", "int8", "int4"]
    assert up.deadline_fraction == 0.6
    fixed = AdaptiveSpec(codec="int4").config(tmp_path)
    assert fixed["compression"] == {"default": "int4"}
    assert "compression" not in AdaptiveSpec(codec="fp32").config(tmp_path)
    with pytest.raises(SystemExit, match="multiple of P"):
        make_plan(parse_args(["--phase-rounds", "2,3,2"]))
