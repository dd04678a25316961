"""Server-side evaluation (``[evaluation] fn``): its config, its rules, its thread (never in the
round's way), what it reports (log, status, event log), a broken hook, and real jobs with a
built-in, a Flower and a plugin strategy.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.config import ConfigError, parse_config
from coordinator.events.log import read_history
from coordinator.model_source import ModelConfig
from coordinator.observe.evaluation import (
    EvaluationConfig,
    EvaluationError,
    checked_metrics,
    is_due,
    load_hook,
)
from coordinator.observe.evaluator import MAX_PENDING, Evaluator, Reports
from coordinator.observe.status import format_status, status_reply
from wire.proto import isthmus_pb2 as pb

try:
    from . import coord_harness as h
    from . import eval_hooks
    from . import strategy_helpers as sh
    from .core_helpers import Clock, core_config, delta_like, heartbeat_all, push
except ImportError:
    import coord_harness as h
    import eval_hooks
    import strategy_helpers as sh
    from core_helpers import Clock, core_config, delta_like, heartbeat_all, push

TINY = ModelConfig(factory="coord_harness:tiny_model", seed=0, kwargs={"d_in": 4, "d_out": 3})


# ---- the rules ------------------------------------------------------------------------------


@pytest.mark.parametrize("every", [1, 2, 3, 5])
def test_theta_0_every_nth_version_and_the_last_are_due(every):
    total = 7
    due = [v for v in range(total + 1) if is_due(v, every, total)]
    assert due[0] == 0 and due[-1] == total
    assert set(due) - {0, total} == {v for v in range(1, total) if v % every == 0}


def test_metrics_are_finite_numbers_under_names():
    got = checked_metrics(
        "'m:f' on theta_1", {"a": 1, "b": np.float32(0.5), "c": torch.tensor(2.0)}
    )
    assert got == {"a": 1.0, "b": 0.5, "c": 2.0} and all(type(v) is float for v in got.values())
    assert checked_metrics("'m:f' on theta_1", None) == {}
    for bad, words in [
        ("fine", "returned a str; return a dict"),
        ({"loss": float("nan")}, "returned 'loss': nan"),
        ({"loss": True}, "returned 'loss': True"),
        ({"loss": torch.ones(2)}, "returned 'loss'"),
        ({3: 1.0}, "returned 3: 1.0"),
    ]:
        with pytest.raises(
            EvaluationError, match=re.escape(f"evaluation 'm:f' on theta_1 {words}")
        ):
            checked_metrics("'m:f' on theta_1", bad)


@pytest.mark.parametrize(
    ("table", "key", "words"),
    [
        ({"fn": "eval_hooks:weight_norm", "every": 2}, "evaluation.every", "unknown key"),
        ({"fn": "eval_hooks:weight_norm", "every_rounds": 0}, "evaluation.every_rounds", "> 0"),
        ({"fn": "eval_hooks.weight_norm"}, "evaluation.fn", "package.module:function"),
        ({"fn": 3}, "evaluation.fn", "expected a string"),
        ({}, "evaluation.fn", "missing"),
    ],
)
def test_bad_evaluation_table_names_the_key(tmp_path, table, key, words):
    with pytest.raises(ConfigError) as info:
        core_config(tmp_path, evaluation=table)
    assert str(info.value).startswith(key) and words in str(info.value), str(info.value)


def test_evaluation_needs_a_model_factory(tmp_path):
    data = {
        "job": {"name": "j"},
        "model": {"path": "theta0.safetensors"},
        "rounds": {"total": 1, "inner_steps": 1},
        "evaluation": {"fn": "eval_hooks:weight_norm"},
    }
    with pytest.raises(ConfigError, match=r"^evaluation.fn: needs model.factory"):
        parse_config(data, tmp_path)
    cfg = core_config(tmp_path, evaluation={"fn": "eval_hooks:weight_norm", "every_rounds": 2})
    assert cfg.evaluation == EvaluationConfig("eval_hooks:weight_norm", 2)
    assert core_config(tmp_path).evaluation is None


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("no_such_module_for_isthmus:f", "cannot load 'no_such_module_for_isthmus:f': Module"),
        ("eval_hooks:missing", "cannot load 'eval_hooks:missing': AttributeError"),
        ("eval_hooks:NOT_A_FUNCTION", "'eval_hooks:NOT_A_FUNCTION' is a int, not a function"),
    ],
)
def test_a_hook_that_cannot_load_is_refused_naming_the_key(spec, words):
    with pytest.raises(ConfigError, match=re.escape(f"evaluation.fn: {words}")):
        load_hook(spec)


# ---- the thread -----------------------------------------------------------------------------


class Collected:
    def __init__(self) -> None:
        self.done, self.failed, self.skipped = [], [], []
        self.reports = Reports(self.done.append, self._failed, self._skipped)

    def _failed(self, version, message):
        self.failed.append((version, message))

    def _skipped(self, version, why):
        self.skipped.append(version)


def _theta(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    m = eval_hooks_model()
    return {
        k: torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in m.items()
    }


def eval_hooks_model() -> dict[str, torch.Tensor]:
    return dict(h.tiny_model(4, 3).state_dict())


def test_the_hook_runs_on_its_own_thread_with_theta_in_a_module_of_its_own():
    eval_hooks.CALLS.clear()
    out = Collected()
    rng = torch.random.get_rng_state()
    ev = Evaluator(EvaluationConfig("eval_hooks:recording"), TINY, 4, out.reports)
    assert torch.equal(torch.random.get_rng_state(), rng), "building the model moved torch's RNG"
    thetas = {v: _theta(v) for v in range(3)}
    kept = {v: {k: t.clone() for k, t in th.items()} for v, th in thetas.items()}
    for v, th in thetas.items():
        assert ev.submit(v, th)
        assert ev.wait_idle(10)
    ev.close()
    assert [c[0] for c in eval_hooks.CALLS] == [0, 1, 2]
    for v, given, thread in eval_hooks.CALLS:
        assert thread == "evaluation"
        assert all(torch.equal(given[k], kept[v][k]) for k in kept[v])
        assert all(
            torch.equal(thetas[v][k], kept[v][k]) for k in kept[v]
        )  # hook wrecked only its own
    assert [(e.version, e.metrics) for e in out.done] == [
        (v, {"round": float(v), "zero_dim": 0.5, "as_int": 3.0}) for v in range(3)
    ]


def test_submit_returns_at_once_while_a_slow_hook_runs_and_the_oldest_waiting_is_skipped():
    eval_hooks.GATE.clear()
    eval_hooks.STARTED.clear()
    out = Collected()
    ev = Evaluator(EvaluationConfig("eval_hooks:gated"), TINY, 10, out.reports)
    ev.submit(0, _theta(0))
    assert eval_hooks.STARTED.wait(10)  # theta_0's evaluation runs, and waits for the gate
    started = time.monotonic()
    for v in range(1, 1 + MAX_PENDING + 1):  # MAX_PENDING waiting, and one too many
        ev.submit(v, _theta(v))
    assert time.monotonic() - started < 1.0
    assert not ev.idle() and out.done == []
    assert out.skipped == [1]
    eval_hooks.GATE.set()
    assert ev.wait_idle(20)
    ev.close()
    assert [e.version for e in out.done] == [0, *range(2, 2 + MAX_PENDING)]
    want = {v: eval_hooks.weight_norm(_model_with(_theta(v)), v) for v in (0, 2, 3)}
    assert {e.version: e.metrics for e in out.done} == want


def _model_with(theta):
    m = h.tiny_model(4, 3)
    m.load_state_dict(theta)
    return m


def test_only_due_versions_are_evaluated():
    out = Collected()
    ev = Evaluator(EvaluationConfig("eval_hooks:weight_norm", every_rounds=2), TINY, 5, out.reports)
    queued = []
    for v in range(6):
        if ev.submit(v, _theta(v)):
            queued.append(v)
        assert ev.wait_idle(10)
    ev.close()
    assert queued == [0, 2, 4, 5] and [e.version for e in out.done] == queued


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        ("eval_hooks:broken", "failed on theta_2: ValueError: no validation data for round 2"),
        ("eval_hooks:not_metrics", "on theta_0 returned a str"),
        ("eval_hooks:nan_metric", "on theta_0 returned 'val_loss': nan"),
    ],
)
def test_a_broken_hook_is_reported_once_naming_it_and_evaluation_stops(fn, words):
    out = Collected()
    ev = Evaluator(EvaluationConfig(fn), TINY, 5, out.reports)
    for v in range(4):
        ev.submit(v, _theta(v))
        ev.wait_idle(10)
    assert ev.idle()
    assert not ev.submit(4, _theta(4))
    ev.close()
    assert len(out.failed) == 1
    assert f"evaluation {fn!r} {words}" in out.failed[0][1]


# ---- in the coordinator: status, event log, fatal state --------------------------------------


def _core(tmp_path, fn, **sections):
    from coordinator.core import CoordinatorCore

    cfg = core_config(
        tmp_path,
        model={"factory": "coord_harness:tiny_model", "kwargs": {"d_in": 4, "d_out": 3}},
        evaluation={"fn": fn},
        **sections,
    )
    clock = Clock()
    return CoordinatorCore(cfg, clock=clock), clock


def _evaluations_done(core, timeout_s: float = 20.0) -> bool:
    """Whether every evaluation submitted so far finished (theta's file is written first)."""
    deadline = time.monotonic() + timeout_s
    while not core.evaluations_done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _close_a_round(core, clock, r, tokens):
    for site, token in tokens.items():
        push(core, site, token, r, delta_like(core, 0.1 * (r + 1)))
    heartbeat_all(core, clock, tokens, 2.0)


def test_results_reach_status_and_the_event_log(tmp_path):
    core, clock = _core(tmp_path, "eval_hooks:weight_norm")
    try:
        tokens = {s: core.join(s)[0].token for s in ("site-a", "site-b")}
        heartbeat_all(core, clock, tokens, 1.0)
        _close_a_round(core, clock, 0, tokens)
        assert core.round.number == 1
        assert _evaluations_done(core)
        theta_1 = {k: v.clone() for k, v in core.theta.items()}
        text = format_status(status_reply(core.snapshot()))
        want = eval_hooks.weight_norm(_model_with(theta_1), 1)
        line = f"evaluation of theta_1: bias_sum {want['bias_sum']:.6g}, weight_norm "
        assert line in text, text
        core.sink.flush()
        events = [e for e in read_history(core.events.path).events if e["kind"] == "evaluation"]
        assert [e["version"] for e in events] == [0, 1]
        assert events[1]["metrics"] == want
    finally:
        core.close()
    reply = status_reply(core.snapshot())
    assert reply.evaluation.version == 1 and dict(reply.evaluation.metrics) == want
    assert "evaluation" not in format_status(pb.StatusReply(job_name="j"))


def test_a_failing_hook_makes_the_job_fatal_naming_it(tmp_path):
    from coordinator.records import FatalError

    core, clock = _core(tmp_path, "eval_hooks:broken")
    try:
        tokens = {s: core.join(s)[0].token for s in ("site-a", "site-b")}
        heartbeat_all(core, clock, tokens, 1.0)
        _close_a_round(core, clock, 0, tokens)
        for site, token in tokens.items():
            push(core, site, token, 1, delta_like(core, 0.2))
        while not core.tick():  # until round 1 closes: theta_2 goes to the failing hook
            clock.now += 1.0
            for site, token in tokens.items():
                core.heartbeat(site, token, None)
        assert _evaluations_done(core)
        with pytest.raises(
            FatalError, match=re.escape("evaluation 'eval_hooks:broken' failed on theta_2")
        ):
            core.tick()
        core.sink.flush()
        kinds = [e["kind"] for e in read_history(core.events.path).events]
        assert kinds.count("evaluation") == 2 and kinds.count("evaluation_failed") == 1
    finally:
        core.close()


# ---- real jobs ------------------------------------------------------------------------------

WEIGHTS = {"site-a": 1.0, "site-b": 3.0}
STRATEGIES = [
    pytest.param({"name": "fedavg"}, id="fedavg"),
    # A real job each (6-7 s): the built-in one stays fast.
    pytest.param({"name": "flower:serverapp.FedAvg"}, id="FedAvg", marks=pytest.mark.slow),
    pytest.param(
        {"name": "examples.custom_strategy.strategy:CosineMomentum", "total_rounds": 3},
        id="CosineMomentum",
        marks=pytest.mark.slow,
    ),
]


def _events(state: Path, kind: str) -> list[dict]:
    return [e for e in read_history(state / "events.jsonl").events if e["kind"] == kind]


def _fetched(runs) -> dict[int, dict[str, torch.Tensor]]:
    a = runs[0]
    out = {v: g.theta for v, g in a.fetched.items()}
    out[a.final.version] = a.final.theta
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_due_theta_is_evaluated_in_a_real_job(tmp_path, strategy):
    cfg = h.job_config(
        strategy=strategy,
        rounds={"total": 3, "min_sites": 2, "max_sites": 2},
        evaluation={"fn": "eval_hooks:weight_norm", "every_rounds": 2},
    )
    coord = h.start_coordinator(tmp_path, cfg)
    try:
        runs = sh.run_sites(coord.address, WEIGHTS)
        assert coord.wait(timeout=30) == 0, coord.log_tail()
    finally:
        coord.kill()
    assert all(run.error is None for run in runs), [run.error for run in runs]
    thetas = _fetched(runs)
    events = _events(tmp_path / "state", "evaluation")
    assert [e["version"] for e in events] == [0, 2, 3]
    for e in events:
        want = eval_hooks.weight_norm(_model_with_tiny(thetas[e["version"]]), e["version"])
        assert e["metrics"] == want
    assert "evaluation of theta_3: bias_sum" in coord.log_path.read_text()


def _model_with_tiny(theta):
    m = h.tiny_model(8, 16)
    m.load_state_dict(theta)
    return m


@pytest.mark.e2e
def test_a_slow_hook_never_holds_up_the_rounds(tmp_path, monkeypatch):
    gate = tmp_path / "gate"
    monkeypatch.setenv("ISTHMUS_TEST_GATE", str(gate))
    cfg = h.job_config(
        rounds={"total": 3, "min_sites": 2, "max_sites": 2},
        evaluation={"fn": "eval_hooks:gated"},
    )
    coord = h.start_coordinator(tmp_path, cfg)
    try:
        runs = sh.run_sites(coord.address, WEIGHTS)  # every round, while theta_0's evaluation waits
        assert all(run.error is None and run.final.version == 3 for run in runs)
        assert _events(tmp_path / "state", "evaluation") == []
        assert coord.proc.poll() is None, "the job ended before its evaluations"
        gate.touch()
        assert coord.wait(timeout=30) == 0, coord.log_tail()
    finally:
        coord.kill()
    state = tmp_path / "state"
    assert [e["version"] for e in _events(state, "evaluation")] == [0, 2, 3]
    assert [e["version"] for e in _events(state, "evaluation_skipped")] == [1]
    closed = max(e["wall"] for e in _events(state, "round_closed"))
    assert closed < min(e["wall"] for e in _events(state, "evaluation"))


@pytest.mark.e2e
def test_a_hook_that_cannot_load_stops_serve_before_any_state(tmp_path):
    cfg = h.job_config(evaluation={"fn": "eval_hooks:missing"})
    with pytest.raises(RuntimeError, match="exited with 2 before listening") as info:
        h.start_coordinator(tmp_path, cfg)
    assert "coordinator: error: evaluation.fn: cannot load 'eval_hooks:missing'" in str(info.value)
    assert not (tmp_path / "state" / "checkpoints").exists()


def _run_job(folder: Path, cfg: dict) -> tuple[h.CoordinatorProcess, list]:
    coord = h.start_coordinator(folder, cfg)
    try:
        runs = sh.run_sites(coord.address, WEIGHTS)
        assert coord.wait(timeout=30) == 0, coord.log_tail()
    finally:
        coord.kill()
    assert all(run.error is None for run in runs), [run.error for run in runs]
    return coord, runs


@pytest.mark.e2e
@pytest.mark.slow  # 8 s; in-process broken hooks stay
def test_a_broken_hook_stops_the_job_naming_it_and_the_job_resumes_once_fixed(tmp_path):
    rounds = {"total": 4, "min_sites": 2, "max_sites": 2}
    _, clean = _run_job(tmp_path / "clean", h.job_config(rounds=rounds))
    folder = tmp_path / "broken"
    cfg = h.job_config(rounds=rounds, evaluation={"fn": "eval_hooks:broken"})
    coord = h.start_coordinator(folder, cfg)
    box: dict = {}
    give_up = sh.BackoffPolicy(initial_s=0.05, cap_s=0.2, deadline_s=1.0)
    t = threading.Thread(
        target=lambda: box.setdefault(
            "runs", sh.run_sites(coord.address, WEIGHTS, backoff=give_up)
        ),
        daemon=True,
    )
    try:
        t.start()
        assert coord.wait(timeout=30) == 3, coord.log_tail()
        t.join(60)
        log = coord.log_path.read_text()
        message = (
            "evaluation 'eval_hooks:broken' failed on theta_2: ValueError: no validation data "
            "for round 2; the job stops (theta and its checkpoints are unchanged)"
        )
        assert f"stopping: {message}" in log, coord.log_tail()
        state = folder / "state"
        assert [e["version"] for e in _events(state, "evaluation_failed")] == [2]
        name, meta, _ = sh.latest_checkpoint(state)
        closed = {e["round"]: e["theta_digest"] for e in _events(state, "round_closed")}
        assert meta["theta_digest"] == closed[int(name.rpartition("-")[2]) - 1]

        h.write_config(
            folder, h.job_config(rounds=rounds, evaluation={"fn": "eval_hooks:weight_norm"})
        )
        coord.start()  # fixed: the job resumes from its checkpoint and ends
        runs = sh.run_sites(coord.address, WEIGHTS)
        assert coord.wait(timeout=30) == 0, coord.log_tail()
    finally:
        coord.kill()
    assert all(run.error is None for run in runs), [run.error for run in runs]
    assert runs[0].final.theta_hash == clean[0].final.theta_hash  # as if no hook had failed
    assert 4 in [e["version"] for e in _events(folder / "state", "evaluation")]


def test_the_demo_evaluates_theta_at_the_coordinator_as_its_sites_do(tmp_path):
    from coordinator.config import load_config
    from coordinator.model_source import build_module
    from examples.gpt_diloco import train
    from examples.gpt_diloco.data import CorpusConfig, evaluate, load_corpus

    cfg = load_config(h.REPO / "examples" / "gpt_diloco" / "job.toml")
    hook = load_hook(cfg.evaluation.fn)
    model = build_module(cfg.model)
    args = train.parse_args(["--site-index", "0", "--num-sites", "1"])
    corpus = load_corpus(CorpusConfig(max_bytes=args.corpus_bytes, seq_len=model.config.seq_len))
    want = evaluate(model, corpus, args.eval_batches, args.batch_size)
    assert hook(model, 0) == {"val_loss": want}
