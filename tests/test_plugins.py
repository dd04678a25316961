"""Researchers' own strategies: the example plugin, and broken plugins against a real
coordinator (the error names the plugin and the hook; the checkpoint stays as it was)."""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load as load_safetensors

from coordinator.config import load_config
from coordinator.intake.spool import UpdateSpool
from strategies import Aggregate, Strategy, StrategyError, load_strategy
from strategies.base import call_hook, check_outer_result, check_state, checked_weight
from wire.backoff import BackoffPolicy

try:
    from . import coord_harness as h
    from . import strategy_helpers as sh
except ImportError:
    import coord_harness as h
    import strategy_helpers as sh

EXAMPLE = "examples.custom_strategy.strategy:CosineMomentum"


@dataclass(frozen=True)
class HalfConfig:
    scale: float = 0.5


PARAMS = {"lr": 0.9, "lr_min": 0.3, "momentum": 0.6, "total_rounds": 4}


class CosineReference:
    """The example's algorithm in float64, from its description: heavy-ball momentum, a
    cosine learning rate from lr to lr_min, sites weighted by sqrt(examples)."""

    def __init__(self, lr, lr_min, momentum, total_rounds) -> None:
        self.lr, self.lr_min, self.mu, self.total = lr, lr_min, momentum, total_rounds
        self.v: dict[str, torch.Tensor] = {}

    def step(self, theta, deltas: dict[str, dict], examples: dict[str, float], r: int):
        w = {s: math.sqrt(examples[s]) for s in deltas}
        g = sh.weighted_mean64(deltas, w)
        lr = self.lr_min + (self.lr - self.lr_min) * (1 + math.cos(math.pi * min(r / 3, 1))) / 2
        out = dict(theta)
        for k, gk in g.items():
            self.v[k] = self.mu * self.v.get(k, 0 * gk) + gk
            out[k] = theta[k].double() - lr * self.v[k]
        return out


def test_example_plugin_matches_its_float64_reference(tmp_path):
    sites = sh.make_sites(3)
    examples = {s: float(m.examples) for s, m in sites.items()}
    strategy = load_strategy(EXAMPLE, PARAMS)
    ref = CosineReference(**PARAMS)
    theta, want = sh.theta0(), sh.as64(sh.theta0())
    for r in range(6):  # past total_rounds: the rate stays at lr_min
        deltas = {s: m.delta(theta) for s, m in sites.items()}
        theta, _ = sh.coordinator_round(
            strategy, UpdateSpool(tmp_path / f"{r}"), r, theta, deltas, examples
        )
        want = ref.step(want, {s: m.delta(want) for s, m in sites.items()}, examples, r)
        sh.assert_close(theta, want, tol=2e-5, what=f"round {r}")
    state = strategy.state_dict()
    again = load_strategy(EXAMPLE, PARAMS)
    again.load_state_dict(state)
    assert all(torch.equal(again.velocity[k], strategy.velocity[k]) for k in strategy.velocity)


def test_example_job_toml_loads_and_names_the_plugin():
    cfg = load_config(h.REPO / "examples" / "custom_strategy" / "job.toml")
    assert cfg.strategy.name == EXAMPLE
    strategy = load_strategy(cfg.strategy.name, cfg.strategy.params)
    assert type(strategy).__name__ == "CosineMomentum" and strategy.plugin_name == EXAMPLE
    with pytest.raises(StrategyError, match=re.escape(f"strategy {EXAMPLE!r}: momentum must be")):
        load_strategy(EXAMPLE, {"momentum": 1.5})


def test_hook_checks_name_the_plugin_and_the_hook():
    s = load_strategy("broken_plugins:Broken", {"fail_in": "begin_round"})
    with pytest.raises(
        StrategyError,
        match=r"^strategy 'broken_plugins:Broken' failed in begin_round: RuntimeError: begin_round "
        r"exploded$",
    ):
        call_hook(s, "begin_round", 0, {})
    theta = {"w": torch.ones(2, 3), "n": torch.tensor(1)}
    problems = [
        ([1, 2], "a list, not a dict of tensors"),
        ({"w": theta["w"]}, "other tensor names than theta (missing ['n'], unexpected [])"),
        ({"w": theta["w"].numpy(), "n": theta["n"]}, "a ndarray for 'w', not a torch.Tensor"),
        (
            {"w": torch.ones(3, 2), "n": theta["n"]},
            "'w' as torch.float32 (3, 2); theta has torch.float32 (2, 3)",
        ),
        ({"w": theta["w"].double(), "n": theta["n"]}, "'w' as torch.float64 (2, 3)"),
        ({"w": theta["w"] * math.inf, "n": theta["n"]}, "NaN or Inf in 'w'"),
    ]
    for result, message in problems:
        with pytest.raises(
            StrategyError,
            match=re.escape(f"'broken_plugins:Broken' failed in outer_step: it returned {message}"),
        ):
            check_outer_result(s, theta, result)
    with pytest.raises(StrategyError, match=r"failed in state_dict: entry 'x' is a float"):
        check_state(s, {"x": 1.0})
    s.update_weight = lambda site, w: -w
    with pytest.raises(StrategyError, match=r"failed in update_weight: returned -2.0 for site 'a'"):
        checked_weight(s, "a", 2.0)


# ---- against a real coordinator -------------------------------------------------------------

WEIGHTS = {"site-a": 1.0, "site-b": 3.0}
GIVE_UP = BackoffPolicy(initial_s=0.05, cap_s=0.2, deadline_s=1.0)


def _cfg(strategy: dict, total: int = 3):
    return h.job_config(strategy=strategy, rounds={"total": total, "min_sites": 2, "max_sites": 2})


def _sites_in_background(address: str):
    box: dict = {}
    t = threading.Thread(
        target=lambda: box.setdefault("runs", sh.run_sites(address, WEIGHTS, backoff=GIVE_UP)),
        daemon=True,
    )
    t.start()
    return t, box


def _start_fails(coord: h.CoordinatorProcess, message: str) -> None:
    with pytest.raises(RuntimeError, match="exited with 2 before listening"):
        coord.start()
    assert message in coord.log_tail(), coord.log_tail()


@pytest.mark.e2e
def test_example_plugin_runs_in_a_real_coordinator(tmp_path):
    coord = h.start_coordinator(tmp_path, _cfg({"name": EXAMPLE, **PARAMS}))
    try:
        runs = sh.run_sites(coord.address, WEIGHTS)
        assert coord.wait(timeout=20) == 0, coord.log_tail()
    finally:
        coord.kill()
    assert all(run.error is None for run in runs), [run.error for run in runs]
    a = runs[0]
    thetas = [a.fetched[r].theta for r in range(3)] + [a.final.theta]
    ref = CosineReference(**PARAMS)
    for r in range(3):
        deltas = {s: sh.sine_delta(thetas[r], k, r) for k, s in enumerate(WEIGHTS)}
        want = ref.step(thetas[r], deltas, WEIGHTS, r)
        sh.assert_close(thetas[r + 1], want, tol=1e-5, what=f"round {r}")


@pytest.mark.e2e
@pytest.mark.slow  # 13 s; the broken-hook cases stay
def test_failed_outer_step_then_broken_restarts_leave_the_checkpoint_unchanged(tmp_path):
    plugin = "broken_plugins:Broken"
    coord = h.start_coordinator(
        tmp_path, _cfg({"name": plugin, "fail_in": "outer_step", "fail_round": 1})
    )
    try:
        t, box = _sites_in_background(coord.address)
        assert coord.wait(timeout=30) == 3, coord.log_tail()
        t.join(30)
        log = coord.log_path.read_text()
        assert (
            "outer step of round 1 failed: strategy 'broken_plugins:Broken' failed in outer_step: "
            "RuntimeError: outer step exploded; the checkpoint of round 1 is unchanged"
        ) in log
        name, meta, files = sh.latest_checkpoint(tmp_path / "state")
        theta_1 = box["runs"][0].fetched[1]
        assert name == "round-00000001" and meta["theta_digest"] == theta_1.theta_hash.hex()
        # outer_step counted the failed step in memory; the checkpoint must not have it.
        assert int(load_safetensors(files["strategy.safetensors"])["steps"]) == 1

        h.write_config(tmp_path, _cfg({"name": plugin, "fail_in": "load_state_dict"}))
        _start_fails(coord, "strategy 'broken_plugins:Broken' failed in load_state_dict: KeyError")
        h.write_config(tmp_path, _cfg({"name": "broken_plugin_import:Fine"}))
        _start_fails(
            coord,
            "strategy 'broken_plugin_import:Fine': cannot import 'broken_plugin_import': "
            "ModuleNotFoundError: No module named 'no_such_dependency_for_isthmus_tests'",
        )
        assert sh.latest_checkpoint(tmp_path / "state")[2] == files  # byte for byte

        h.write_config(tmp_path, _cfg({"name": plugin}))  # fixed: the job resumes and ends
        coord.start()
        runs = sh.run_sites(coord.address, WEIGHTS)
        assert coord.wait(timeout=30) == 0, coord.log_tail()
    finally:
        coord.kill()
    assert all(run.error is None for run in runs), [run.error for run in runs]
    name, meta, files = sh.latest_checkpoint(tmp_path / "state")
    assert name == "round-00000003"
    assert int(load_safetensors(files["strategy.safetensors"])["steps"]) == 3


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("fail_in", "mode", "message"),
    [
        (
            "outer_step",
            "bad_shape",
            "failed in outer_step: it returned 'lin.weight' as torch.float32 (16, 2)",
        ),
        ("outer_step", "not_dict", "failed in outer_step: it returned a list, not a dict"),
        # A real coordinator each (3 s): two hooks stay fast, the others run in test-slow.
        pytest.param(
            "begin_round",
            "raise",
            "failed in begin_round: RuntimeError: begin_round exploded",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "update_weight",
            "raise",
            "failed in update_weight: ZeroDivisionError: update_weight exploded",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_broken_hook_stops_the_job_naming_plugin_and_hook(tmp_path, fail_in, mode, message):
    cfg = _cfg({"name": "broken_plugins:Broken", "fail_in": fail_in, "mode": mode})
    coord = h.start_coordinator(tmp_path, cfg)
    before = sh.latest_checkpoint(tmp_path / "state")
    try:
        t, _ = _sites_in_background(coord.address)
        assert coord.wait(timeout=30) == 3, coord.log_tail()
        t.join(30)
    finally:
        coord.kill()
    log = coord.log_path.read_text()
    assert f"strategy 'broken_plugins:Broken' {message}" in log, coord.log_tail()
    assert "stopping:" in log
    assert sh.latest_checkpoint(tmp_path / "state") == before
    assert before[0] == "round-00000000"


def test_aggregate_keeps_its_old_positional_form():
    agg = Aggregate({"w": torch.ones(1)}, 2.0, {"s": 2.0}, 4)
    assert agg.updates == () and dict(agg.rejected) == {} and dict(agg.metrics) == {}


class MedoidStep(Strategy):
    """A researcher's plugin that needs every update: steps along the site update closest
    to all the others (a medoid), read lazily from the spool."""

    Config = HalfConfig
    needs_updates = True

    def outer_step(self, theta, aggregate):
        deltas = {u.site: u.tensors() for u in aggregate.updates}

        def spread(site):
            return sum(
                float(sum(((deltas[site][k] - d[k]) ** 2).sum() for k in d))
                for d in deltas.values()
            )

        best = deltas[min(deltas, key=spread)]
        return {k: theta[k] - self.config.scale * best[k] if k in best else theta[k] for k in theta}


def test_a_plugin_can_ask_for_every_update(tmp_path):
    sites = sh.make_sites(3)
    theta = sh.theta0()
    deltas = {s: m.delta(theta) for s, m in sites.items()}
    deltas["site-a"] = {k: v * 30 for k, v in deltas["site-a"].items()}
    s = MedoidStep(HalfConfig(0.5))
    new, outcome = sh.coordinator_round(
        s, UpdateSpool(tmp_path), 0, theta, deltas, dict.fromkeys(sites, 1.0)
    )
    assert [u.site for u in outcome.aggregate.updates] == sorted(sites)
    spread = {
        a: sum(float(sum(((deltas[a][k] - deltas[b][k]) ** 2).sum() for k in theta)) for b in sites)
        for a in sites
    }
    best = min(spread, key=spread.get)
    assert best != "site-a"
    sh.assert_close(
        new, {k: theta[k].double() - 0.5 * deltas[best][k].double() for k in theta}, tol=1e-6
    )
    # Buffering every update is what the start-up memory check counts for such a plugin.
    assert s.buffer_bytes(3, theta) == 3 * sum(t.numel() * 4 for t in theta.values())
