"""Streaming outer steps end to end: ``coordinator local`` with two real sites over TLS, the
example GPT in two fragments merged one step late. Every round carries one fragment up and
down, each merge happens at step tau of the round after, and every site ends on the
coordinator's theta."""

from __future__ import annotations

import json
import subprocess
import tomllib

import pytest
import tomli_w

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
    from .test_local import SMALL, TRAIN_ARGS
except ImportError:
    import coord_harness as h
    from test_local import SMALL, TRAIN_ARGS

from coordinator.persist.export import read_card

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # 21 s: two real FSDP2 sites
EXAMPLE = h.REPO / "examples" / "gpt_diloco"
FRAGMENTS, TAU, H, OUTER_ROUNDS = 2, 1, 4, 2


def job_file(folder, rounds=None, strategy=None, **streaming):
    """The example job, raw float32 both ways (so bytes say which tensors travelled), with
    ``rounds`` and ``strategy`` entries changed."""
    job = tomllib.loads((EXAMPLE / "job.toml").read_text())
    for table in ("compression", "evaluation"):
        job.pop(table)
    job["model"]["kwargs"] = SMALL
    job["rounds"].update(total=OUTER_ROUNDS, inner_steps=H, join_window_s=1.0)
    job["rounds"].update(rounds or {})
    job["strategy"].update(strategy or {})
    job["streaming"] = streaming
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "job.toml"
    path.write_text(tomli_w.dumps(job))
    return path


def run_local(folder, config, faults: str = "", sites: int = 2) -> tuple:
    """``coordinator local`` with ``sites`` sites of the example trainer on ``config``, with
    ``ISTHMUS_FAULTS`` = ``faults``; (its run dir, the finished process), which exited 0."""
    cmd = [*h.coordinator_command(), "local", "--sites", str(sites), "--config", str(config)]
    cmd += ["--run-dir", str(folder / "run"), "--", str(EXAMPLE / "train.py"), *TRAIN_ARGS]
    env = {**h.subprocess_env(), "ISTHMUS_FAULTS": faults}
    result = subprocess.run(cmd, cwd=h.REPO, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return folder / "run", result


def records(path, kind: str) -> list[dict]:
    lines = path.read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("streamed")
    config = job_file(folder, fragments=FRAGMENTS, delay_steps=TAU, merge_alpha=0.5)
    return run_local(folder, config)


def test_every_round_closes_and_every_site_ends_on_the_coordinators_theta(streamed):
    run_dir, result = streamed
    rounds = FRAGMENTS * OUTER_ROUNDS
    assert f"round {rounds}/{rounds} closed" in result.stdout, result.stdout
    assert "theta hashes: every site matches the coordinator" in result.stdout
    card = read_card(run_dir / "coordinator" / "final" / "model.safetensors")
    assert card.round == rounds


def test_each_fragment_merges_tau_steps_into_the_next_round(streamed):
    run_dir, _ = streamed
    for site in ("site-0", "site-1"):
        timings = run_dir / site / "trainer_timings.jsonl"
        merges = [(m["round"], m["step"]) for m in records(timings, "merge")]
        assert merges == [(r, TAU) for r in range(1, FRAGMENTS * OUTER_ROUNDS)], merges
        steps = records(timings, "steps")
        assert [s["round"] for s in steps] == list(range(FRAGMENTS * OUTER_ROUNDS))
        assert all(s["compute_s"] > 0 and s["last_step_at"] >= s["first_step_at"] for s in steps)


def test_one_fragment_travels_each_way_per_round(streamed):
    """Round r's push and theta_{r+1}'s fetch carry fragment r % P only: two rounds in a row
    move about one model's bytes, each well under it."""
    run_dir, _ = streamed
    timings = run_dir / "site-0" / "timings.jsonl"
    fetches = [f["bytes"] for f in records(timings, "fetch")]
    pushes = {p["round"]: p["bytes"] for p in records(timings, "push")}
    whole, n = fetches[0], FRAGMENTS * OUTER_ROUNDS  # theta_0 whole; then n deltas
    assert len(fetches) == n + 1 and sorted(pushes) == list(range(n)), (fetches, pushes)
    ups = [pushes[r] for r in range(n)]
    for moved in (ups, fetches[1:]):
        assert all(b < 0.9 * whole for b in moved), (whole, moved)
        pairs = [a + b for a, b in zip(moved, moved[1:], strict=False)]
        assert all(0.9 * whole < p < 1.2 * whole for p in pairs), (whole, moved)
