"""``python -m bench.utilisation``: the utilisation arithmetic on a synthetic timings file, and
(slow) the quick run end to end."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.utilisation_report import (
    Result,
    SiteUse,
    figures,
    headline,
    parse_figures,
    site_use,
)
from site_client.timings import record

REPO = Path(__file__).resolve().parent.parent


def _write_tasks(run_dir: Path, tasks: list[tuple[float, float, float, float]]) -> None:
    """``(first_step_at, last_step_at, compute_s, merge_wait_s)`` per task, as a trainer would
    write them, between records of other kinds."""
    path = run_dir / "trainer_timings.jsonl"
    record(path, "load", s=0.5)
    for i, (first, last, compute, wait) in enumerate(tasks):
        record(
            path,
            "steps",
            round=i,
            compute_s=compute,
            first_step_at=first,
            last_step_at=last,
            merge_wait_s=wait,
        )
        record(path, "handoff", s=0.1)


def test_utilisation_is_compute_over_the_training_phase(tmp_path: Path):
    # Three tasks written out of order: 1000-1004 (3 s of compute), 1006-1010 (3.5 s),
    # 1011-1013 (1.5 s, 0.25 s of it waiting for a merge). Phase 1000-1013: 13 s.
    _write_tasks(
        tmp_path,
        [(1006.0, 1010.0, 3.5, 0.0), (1000.0, 1004.0, 3.0, 0.0), (1011.0, 1013.0, 1.5, 0.25)],
    )
    use = site_use(tmp_path)
    assert use.tasks == 3
    assert use.compute_s == pytest.approx(8.0)
    assert use.wall_s == pytest.approx(13.0)
    assert use.utilisation == pytest.approx(8.0 / 13.0)
    assert use.gaps_s == pytest.approx(2.0 + 1.0)  # 1004 -> 1006, 1010 -> 1011
    assert use.merge_wait_s == pytest.approx(0.25)
    assert use.blocked_per_round_s == pytest.approx(3.0 / 2 + 0.25 / 3)


def test_overlapping_tasks_count_no_negative_gap():
    # Records that overlap in time (a wall clock stepped back) never add a negative gap.
    use = SiteUse.from_records(
        [
            {"kind": "steps", "compute_s": 1.0, "first_step_at": 0.0, "last_step_at": 1.0},
            {"kind": "steps", "compute_s": 1.0, "first_step_at": 0.9, "last_step_at": 2.0},
        ]
    )
    assert use.gaps_s == 0.0
    assert use.merge_wait_s == 0.0
    assert use.utilisation == pytest.approx(1.0)


def test_no_steps_records_is_an_error(tmp_path: Path):
    record(tmp_path / "trainer_timings.jsonl", "load", s=0.5)
    with pytest.raises(ValueError, match='no "steps" records'):
        site_use(tmp_path)
    with pytest.raises(ValueError, match="trainer_timings.jsonl"):
        site_use(tmp_path / "missing")


def test_last_line_figures_round_trip():
    def result(mode: str, codec: str, utilisations: list[float], mbit: float = 10.0) -> Result:
        sites = [SiteUse(1, u, 1.0, 0.0, 0.0) for u in utilisations]
        return Result(mode, codec, 4 if mode == "streaming" else 1, 2, sites, 0, 0, mbit)

    runs = [
        result("blocking", "fp32", [0.4, 0.6]),
        result("streaming", "fp32", [0.8, 0.9]),
        result("blocking", "fp32", [0.7, 0.7], mbit=20.0),
        result("streaming", "int8", [0.9, 0.9]),
    ]
    got = parse_figures(" ".join(f"{k}={v}" for k, v in figures(runs).items()))
    assert got == pytest.approx(
        {
            "util_blocking_fp32_10mbit": 0.5,
            "util_streaming_fp32_10mbit": 0.85,
            "util_blocking_fp32_20mbit": 0.7,
            "util_streaming_int8_10mbit": 0.9,
        }
    )
    last = parse_figures(" ".join(f"{k}={v}" for k, v in headline(runs, 10.0, 100, 3.5).items()))
    assert last == pytest.approx(
        {
            "blocking_cu": 0.5,
            "streaming_cu": 0.85,
            "link_mbit": 10,
            "rtt_ms": 100,
            "model_mb": 3.5,
            "fragments": 4,
            "tau": 2,
            "streaming_over_blocking": 1.7,
        }
    )


@pytest.mark.slow
@pytest.mark.e2e
def test_quick_run_end_to_end(tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-m", "bench.utilisation", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    *_, runs, last = done.stdout.strip().splitlines()
    utils = parse_figures(runs)
    assert set(utils) == {"util_blocking_fp32_4mbit", "util_streaming_fp32_4mbit"}, utils
    assert all(0.0 < v <= 1.0 and not math.isnan(v) for v in utils.values()), utils
    got = parse_figures(last)
    assert 0.0 < got["blocking_cu"] <= 1.0 and 0.0 < got["streaming_cu"] <= 1.0, got
    assert (got["link_mbit"], got["rtt_ms"], got["fragments"]) == (4, 100, 2), got
    assert (tmp_path / "utilisation.png").stat().st_size > 0
