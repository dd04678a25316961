"""``coordinator local``: a whole job on this machine with real processes over real TLS, its
summary, the exported model loaded into the example's model, Ctrl-C and a resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
    from .test_coordinator_cli import one_line_error
    from .test_copied_config import as_installed
except ImportError:
    import coord_harness as h
    from test_coordinator_cli import one_line_error
    from test_copied_config import as_installed

from coordinator.cli.local_job import LocalPlan, site_names
from coordinator.cli.local_report import by_round, summary_table
from coordinator.persist.export import load_model, read_card

pytestmark = pytest.mark.e2e
EXAMPLE = h.REPO / "examples" / "gpt_diloco"
SMALL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "seq_len": 32}
TRAIN_ARGS = ["--batch-size", "4", "--eval-batches", "1", "--corpus-bytes", str(1 << 20)]


def local_command(run_dir, rounds: int, steps: int = 3, script: str = "train.py") -> list[str]:
    kwargs = ", ".join(f"{k} = {v}" for k, v in SMALL.items())
    sets = [f"rounds.total={rounds}", f"rounds.inner_steps={steps}", "rounds.join_window_s=1",
            f"model.kwargs={{ {kwargs} }}"]  # fmt: skip
    cmd = [sys.executable, "-m", "coordinator.cli", "local", "--sites", "2"]
    cmd += ["--config", str(EXAMPLE / "job.toml"), "--run-dir", str(run_dir)]
    cmd += [f for kv in sets for f in ("--set", kv)]
    return cmd + ["--", str(EXAMPLE / script), *TRAIN_ARGS]


def run(cmd, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=h.REPO, env=h.subprocess_env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def explicit(tmp_path_factory):
    """A two-round job of the example's explicit ``rounds()``/``steps()`` form."""
    tmp_path = tmp_path_factory.mktemp("explicit")
    result = run(local_command(tmp_path / "run", rounds=2))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tmp_path, result


def test_a_local_job_ends_with_a_model_the_example_loads(explicit):
    tmp_path, result = explicit
    out = result.stdout
    assert "round 1/2 closed" in out and "round 2/2 closed" in out, out
    final = tmp_path / "run" / "coordinator" / "final" / "model.safetensors"
    assert f"final model: {final} (round 2)" in out, out
    assert "theta hashes: every site matches the coordinator" in out, out
    assert f"plots in {tmp_path / 'run' / 'metrics.png'}" in out, out
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 0
    header = next(x for x in out.splitlines() if x.split()[:2] == ["round", "train_loss"])
    assert header.split() == ["round", "train_loss", "val_loss"], header
    # The example's own model takes the file as it is.
    from examples.gpt_diloco.model import build_model

    model = build_model(**SMALL)
    model.load_state_dict(load_file(str(final)), strict=True)
    card = read_card(final)
    assert card.model["kwargs"] == SMALL and card.round == 2
    loaded, want = load_model(final).state_dict(), model.state_dict()
    assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], want[k]) for k in want)
    # The sites ran the example without --site-index/--num-sites: the session told them.
    for site in ("site-0", "site-1"):
        lines = (tmp_path / "run" / site / "metrics.jsonl").read_text().splitlines()
        assert {json.loads(x)["site"] for x in lines} == {site}


def test_a_job_runs_from_any_folder(tmp_path):
    """From an empty folder elsewhere, with isthmus installed and the repository not on the
    import path: the example's factory and evaluation hook are found from the config file,
    the job completes, and the user sees no third-party INFO line (a fresh MPLCONFIGDIR has
    matplotlib build its font cache, which it announces at INFO)."""
    kwargs = ", ".join(f"{k} = {v}" for k, v in SMALL.items())
    sets = ["rounds.total=1", "rounds.inner_steps=2", "rounds.join_window_s=1",
            f"model.kwargs={{ {kwargs} }}"]  # fmt: skip
    cmd = [*h.coordinator_command(), "local", "--sites", "2"]
    cmd += ["--config", str(EXAMPLE / "job.toml"), *[f for kv in sets for f in ("--set", kv)]]
    cmd += ["--", str(EXAMPLE / "train.py"), *TRAIN_ARGS]
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    env = {**os.environ, **as_installed(tmp_path), "MPLCONFIGDIR": str(tmp_path / "mpl")}
    result = subprocess.run(cmd, cwd=empty, env=env, capture_output=True, text=True, timeout=240)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    final = empty / "runs" / "local" / "coordinator" / "final" / "model.safetensors"
    assert f"final model: {final} (round 1)" in out, out
    assert f"import path: added {h.REPO} (holds examples.gpt_diloco.model, " in out, out
    assert (tmp_path / "mpl").is_dir()  # matplotlib did write its cache there
    assert not [x for x in out.splitlines() if " INFO " in x and " isthmus" not in x], out


def test_a_factory_found_nowhere_is_refused_before_anything_starts(tmp_path):
    job = h.job_config(model={"factory": "nowhere_pkg.model:build", "kwargs": {}})
    config = h.write_config(tmp_path, job)
    result = h.run_cli(
        "local", "--sites", "1", "--config", str(config), "--run-dir", str(tmp_path / "run"),
        "--", str(EXAMPLE / "train.py"), cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    line = one_line_error(result)
    assert "model.factory: cannot find module 'nowhere_pkg.model'" in line, line
    assert f"in {tmp_path} or any folder above it" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # 14 s; the loop form's own unit tests stay
def test_the_loop_form_trains_the_same_model(explicit, tmp_path):
    """examples/gpt_diloco/train_loop.py (``SiteLoop`` around an ordinary loop) against the
    explicit form: the same table and the same final theta, bit for bit."""
    result = run(local_command(tmp_path / "run", rounds=2, script="train_loop.py"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    def card_and_table(folder, out: str):
        card = read_card(folder / "run" / "coordinator" / "final" / "model.safetensors")
        words = [x.split() for x in out.splitlines()]
        rows = [
            w for w in words if w[:2] == ["round", "train_loss"] or w[:1] in (["0"], ["1"], ["2"])
        ]
        return card.theta_digest, rows

    explicit_dir, explicit_result = explicit
    want = card_and_table(explicit_dir, explicit_result.stdout)
    assert card_and_table(tmp_path, result.stdout) == want
    assert len(want[1]) == 4, want


@pytest.mark.slow  # 14 s; tests/test_streaming_e2e.py checks the rounds bit for bit
def test_streaming_with_one_fragment_no_delay_is_blocking_diloco(explicit, tmp_path):
    """``[streaming] fragments = 1, delay_steps = 0, merge_alpha = 0`` takes the streaming
    loop (train on after the hand-off, merge before the next round's step 0) and must give
    blocking DiLoCo's final theta bit for bit."""
    cmd = local_command(tmp_path / "run", rounds=2)
    at = cmd.index("--")
    cmd[at:at] = ["--set", "streaming.fragments=1", "--set", "streaming.delay_steps=0"]
    result = run(cmd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    got = read_card(tmp_path / "run" / "coordinator" / "final" / "model.safetensors")
    want = read_card(explicit[0] / "run" / "coordinator" / "final" / "model.safetensors")
    assert got.theta_digest == want.theta_digest
    timings = (tmp_path / "run" / "site-0" / "trainer_timings.jsonl").read_text().splitlines()
    merges = [json.loads(x) for x in timings if '"kind": "merge"' in x]
    assert [(m["round"], m["step"]) for m in merges] == [(1, 0)], merges  # the streaming loop ran


@pytest.mark.slow
def test_the_same_job_twice_gives_the_same_model(explicit, tmp_path):
    """The README's claim, run to run on one machine: the same table, the same final theta."""
    result = run(local_command(tmp_path / "run", rounds=2))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    again = read_card(tmp_path / "run" / "coordinator" / "final" / "model.safetensors")
    first = read_card(explicit[0] / "run" / "coordinator" / "final" / "model.safetensors")
    assert again.theta_digest == first.theta_digest
    table = [x for x in result.stdout.splitlines() if x[:5].strip().isdigit()]
    assert table == [x for x in explicit[1].stdout.splitlines() if x[:5].strip().isdigit()]
    assert "reproducible with: torch " in result.stdout and "CPU kernels " in result.stdout


@pytest.mark.slow
def test_ctrl_c_stops_every_process_and_the_same_command_resumes(tmp_path):
    cmd = local_command(tmp_path / "run", rounds=3, steps=20)
    proc = subprocess.Popen(
        cmd, cwd=h.REPO, env=h.subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    pid_file = tmp_path / "run" / "site-1" / "trainers" / "rank-0.pid"
    try:
        h.wait_until(pid_file.exists, timeout=120, what="the trainers to start")
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 130, out + err
    assert "stopped by SIGINT" in out and "the same command resumes it" in out, out
    trainer = int(pid_file.read_text().split()[0])
    with pytest.raises(ProcessLookupError):
        os_kill(trainer)
    log = (tmp_path / "run" / "coordinator.log").read_text()
    assert "coordinator: stopped by SIGTERM" in log, log[-2000:]
    result = run(cmd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "theta hashes: every site matches the coordinator" in result.stdout


def os_kill(pid: int) -> None:
    import os

    os.kill(pid, 0)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--sites", "0", "--", "x.py"], ["--sites and --nproc-per-node must be >= 1"]),
        (["--sites", "2"], ["training script '' not found after --"]),
        (["--sites", "2", "--config", "nope.toml", "--", __file__], ["no job config nope.toml"]),
    ],
    ids=["no-sites", "no-script", "no-config"],
)
def test_local_refusals(argv, words, tmp_path):
    result = h.run_cli("local", "--run-dir", str(tmp_path / "r"), *argv)
    assert result.returncode == 2
    line = one_line_error(result)
    assert all(w in line for w in words), line


def test_plan_and_table():
    plan = LocalPlan(h.REPO, h.REPO / "job.toml", site_names(2), 2, ("t.py", "-x"), ("a.b=1",))
    assert plan.serve_command()[-2:] == ["--set", "a.b=1"]
    site = plan.site_command("site-1", "127.0.0.1:9")
    assert site[-3:] == ["--", "t.py", "-x"] and "--nproc-per-node" in site
    records = [
        {"site": "a", "round": 0, "loss": 1.0},
        {"site": "b", "round": 0, "loss": 3.0},
        {"site": "a", "round": 1, "acc": 0.5, "final": 1},
    ]
    rounds = by_round(records)
    assert rounds == {0: {"loss": 2.0}, 1: {"acc": 0.5}}
    assert [r.split() for r in summary_table(rounds)] == [
        ["round", "acc", "loss"],
        ["0", "-", "2.0000"],
        ["1", "0.5000", "-"],
    ]
