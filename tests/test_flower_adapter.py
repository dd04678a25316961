"""The Flower adapter: every strategy Flower shares with isthmus gives the same model as the
built-in on the same inputs, Flower's pitfalls are handled, its state is checkpointed, and
Flower's FedAdam and Krum run end to end in a 2-site job against a real coordinator.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors

from coordinator.intake.spool import UpdateSpool
from strategies import RobustAggregator, StrategyError, load_strategy
from strategies.robust import close_round

try:
    from . import coord_harness as h
    from . import strategy_helpers as sh
except ImportError:
    import coord_harness as h
    import strategy_helpers as sh

ROUNDS = 5

# (built-in name, its params, aggregation, Flower class, its kwargs)
PAIRS = [
    ("fedavg", {}, {}, "FedAvg", {}),
    ("fedavg", {}, {}, "FedProx", {"proximal_mu": 0.1}),  # FedProx's server step is FedAvg
    (
        "fedavgm",
        {"server_learning_rate": 0.7, "server_momentum": 0.9},
        {},
        "FedAvgM",
        {"server_learning_rate": 0.7, "server_momentum": 0.9},
    ),
    (
        "fedavgm",
        {"server_learning_rate": 0.5, "server_momentum": 0.0},
        {},
        "FedAvgM",
        {"server_learning_rate": 0.5},
    ),
    ("fedadam", {}, {}, "FedAdam", {}),
    (
        "fedadam",
        {"eta": 0.05, "beta_1": 0.8, "beta_2": 0.95, "tau": 1e-3},
        {},
        "FedAdam",
        {"eta": 0.05, "beta_1": 0.8, "beta_2": 0.95, "tau": 1e-3},
    ),
    ("fedyogi", {}, {}, "FedYogi", {}),
    ("fedyogi", {"eta": 0.1, "tau": 0.01}, {}, "FedYogi", {"eta": 0.1, "tau": 0.01}),
    ("fedadagrad", {}, {}, "FedAdagrad", {}),
    ("fedadagrad", {"eta": 0.3, "tau": 0.01}, {}, "FedAdagrad", {"eta": 0.3, "tau": 0.01}),
    ("fedavg", {}, {"method": "median"}, "FedMedian", {}),
    (
        "fedavg",
        {},
        {"method": "trimmed_mean", "trim_fraction": 0.25},
        "FedTrimmedAvg",
        {"beta": 0.25},
    ),
]


def _round(strategy, aggregator, theta, deltas, examples, spool, r):
    updates = [
        sh.spool_update(spool, r, s, d, strategy.update_weight(s, examples[s])).as_site_update()
        for s, d in deltas.items()
    ]
    return close_round(strategy, aggregator, theta, updates, r)[0]


@pytest.mark.parametrize(("builtin", "params", "aggregation", "flower", "kwargs"), PAIRS)
def test_builtin_and_flower_agree_round_after_round(
    tmp_path, builtin, params, aggregation, flower, kwargs
):
    sites = sh.make_sites(4)
    examples = {s: float(m.examples) for s, m in sites.items()}
    ours, theirs = load_strategy(builtin, params), load_strategy(f"flower:{flower}", kwargs)
    agg_ours = RobustAggregator(**aggregation)
    theta = sh.theta0()
    theta["steps"] = torch.tensor([3, 1], dtype=torch.int64)  # an integer buffer rides along
    for r in range(ROUNDS):
        deltas = {s: m.delta(theta) for s, m in sites.items()}
        a = _round(ours, agg_ours, theta, deltas, examples, UpdateSpool(tmp_path / f"a{r}"), r)
        b = _round(
            theirs, RobustAggregator(), theta, deltas, examples, UpdateSpool(tmp_path / f"b{r}"), r
        )
        assert all(b[k].dtype == theta[k].dtype for k in theta)
        assert torch.equal(b["steps"], theta["steps"])
        sh.assert_close(b, sh.as64(a), tol=2e-5, what=f"{flower} round {r}")
        assert not torch.equal(a["layer.w"], theta["layer.w"])
        theta = a


def test_bf16_is_upcast_for_flower_and_cast_back(tmp_path):
    sites = sh.make_sites(3)
    examples = {s: float(m.examples) for s, m in sites.items()}
    theta = sh.theta0(torch.bfloat16)
    deltas = {s: m.delta(theta) for s, m in sites.items()}
    flower = _round(
        load_strategy("flower:FedAdam", {}),
        RobustAggregator(),
        theta,
        deltas,
        examples,
        UpdateSpool(tmp_path / "a"),
        0,
    )
    ours = _round(
        load_strategy("fedadam", {}),
        RobustAggregator(),
        theta,
        deltas,
        examples,
        UpdateSpool(tmp_path / "b"),
        0,
    )
    assert all(v.dtype == torch.bfloat16 for v in flower.values())
    sh.assert_close(flower, sh.as64(ours), tol=1e-2)  # within a bfloat16 rounding step


def test_float64_theta_stays_float64_and_fractional_weights_work(tmp_path):
    sites = sh.make_sites(3)
    weights = {s: w for s, w in zip(sites, (0.25, 1.5, 0.75), strict=True)}
    theta = sh.theta0(torch.float64)
    deltas = {s: m.delta(theta) for s, m in sites.items()}
    got = _round(
        load_strategy("flower:FedAvg", {}),
        RobustAggregator(),
        theta,
        deltas,
        weights,
        UpdateSpool(tmp_path),
        0,
    )
    assert all(v.dtype == torch.float64 for v in got.values())
    # Updates travel as float32 (see SiteUpdate), so the match is to float32 precision.
    want = {k: theta[k] - sh.weighted_mean64(deltas, weights)[k] for k in theta}
    sh.assert_close(got, want, tol=1e-6)


@pytest.mark.parametrize("name", ["FedAdam", "FedAvgM"])
def test_flower_state_is_checkpointed_and_restored(tmp_path, name):
    kwargs = {"server_momentum": 0.9} if name == "FedAvgM" else {}
    sites = sh.make_sites(3)
    examples = {s: float(m.examples) for s, m in sites.items()}

    def rounds(strategy, theta, start, stop):
        for r in range(start, stop):
            deltas = {s: m.delta(theta) for s, m in sites.items()}
            spool = UpdateSpool(tmp_path / f"{id(strategy)}-{r}")
            theta = _round(strategy, RobustAggregator(), theta, deltas, examples, spool, r)
        return theta

    a = load_strategy(f"flower:{name}", kwargs)
    theta = rounds(a, sh.theta0(), 0, 3)
    state = a.state_dict()
    prefix = "list.m_t." if name == "FedAdam" else "list.momentum_vector."
    assert {k for k in state if k.startswith(prefix)} == {f"{prefix}{i}" for i in range(4)}
    assert int(state["steps"]) == 3 and not any("current_weights" in k for k in state)
    b = load_strategy(f"flower:{name}", kwargs)
    b.load_state_dict({k: v.clone() for k, v in state.items()})
    ta, tb = rounds(a, theta, 3, 5), rounds(b, theta, 3, 5)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    if name == "FedAdam":
        fresh = rounds(load_strategy("flower:FedAdam", {}), theta, 3, 5)
        assert not all(torch.equal(ta[k], fresh[k]) for k in ta)


def test_a_failed_flower_step_names_the_plugin_and_keeps_its_state(tmp_path):
    sites = sh.make_sites(2)
    examples = {s: 1.0 for s in sites}
    s = load_strategy("flower:FedAdam", {})
    theta = sh.theta0()
    theta = _round(
        s,
        RobustAggregator(),
        theta,
        {k: m.delta(theta) for k, m in sites.items()},
        examples,
        UpdateSpool(tmp_path / "0"),
        0,
    )
    before = {k: v.clone() for k, v in s.state_dict().items()}
    real = s.flower.aggregate_fit

    def half_done(server_round, results, failures):
        real(server_round, results, failures)  # m_t and v_t move...
        raise RuntimeError("disk on fire")  # ...then the step fails

    s.flower.aggregate_fit = half_done
    deltas = {k: m.delta(theta) for k, m in sites.items()}
    with pytest.raises(
        StrategyError,
        match=r"strategy 'flower:FedAdam' failed in outer_step: RuntimeError: disk on fire",
    ):
        _round(s, RobustAggregator(), theta, deltas, examples, UpdateSpool(tmp_path / "1"), 1)
    after = s.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

    s.flower.aggregate_fit = lambda rnd, res, fail: (
        s.common.ndarrays_to_parameters([np.zeros(3)]),
        {},
    )
    with pytest.raises(
        StrategyError,
        match=r"flower:FedAdam' failed in outer_step: aggregate_fit returned 1 arrays",
    ):
        _round(s, RobustAggregator(), theta, deltas, examples, UpdateSpool(tmp_path / "2"), 1)


def test_krum_picks_the_site_model_with_the_lowest_krum_score(tmp_path):
    sites = sh.make_sites(4)
    theta = sh.theta0()
    deltas = {s: m.delta(theta) for s, m in sites.items()}
    deltas["site-d"] = {k: v * 40 for k, v in deltas["site-d"].items()}  # a wild site
    got = _round(
        load_strategy("flower:Krum", {"num_malicious_clients": 1}),
        RobustAggregator(),
        theta,
        deltas,
        {s: 1.0 for s in sites},
        UpdateSpool(tmp_path),
        0,
    )
    # Reference (Blanchard et al. 2017): score_i = sum of the n - f - 2 smallest squared
    # distances from site i's model to the others; the model with the lowest score wins.
    order = sorted(deltas)
    flat = {
        s: torch.cat([(theta[k] - deltas[s][k]).double().flatten() for k in sorted(theta)])
        for s in order
    }
    scores = {
        s: sum(sorted(float(((flat[s] - flat[o]) ** 2).sum()) for o in order if o != s)[:1])
        for s in order
    }
    best = min(order, key=scores.get)
    assert best != "site-d"
    sh.assert_close(got, {k: (theta[k] - deltas[best][k]).double() for k in theta}, tol=1e-6)


def test_bulyan_without_byzantine_sites_is_the_unweighted_mean(tmp_path):
    sites = sh.make_sites(3)
    theta = sh.theta0()
    deltas = {s: m.delta(theta) for s, m in sites.items()}
    got = _round(
        load_strategy("flower:Bulyan", {"num_malicious_clients": 0}),
        RobustAggregator(),
        theta,
        deltas,
        {s: 1.0 + i for i, s in enumerate(sites)},
        UpdateSpool(tmp_path),
        0,
    )
    mean = sh.weighted_mean64(deltas, {s: 1.0 for s in sites})
    sh.assert_close(got, {k: theta[k].double() - mean[k] for k in theta}, tol=1e-6)


def test_qfedavg_weighs_by_the_sites_reported_loss(tmp_path):
    sites = sh.make_sites(3)
    theta = sh.theta0()
    deltas = {s: m.delta(theta) for s, m in sites.items()}
    spool = UpdateSpool(tmp_path)
    updates = [sh.spool_update(spool, 0, s, d, 1.0).as_site_update() for s, d in deltas.items()]
    metrics = {s: {"train_loss": loss} for s, loss in zip(sites, (2.0, 3.0, 4.0), strict=True)}
    q, lr = 0.5, 0.1
    strategy = load_strategy("flower:QFedAvg", {"q_param": q, "qffl_learning_rate": lr})
    got, _ = close_round(strategy, RobustAggregator(), theta, updates, 0, metrics)
    # q-FFL (Li et al. 2020) as Flower writes it, with one loss for all: the sites' mean.
    loss = 3.0 + 1e-10
    grads = {s: {k: d[k].double() / lr for k in d} for s, d in deltas.items()}
    hs = [
        q * loss ** (q - 1) * sum(float((g**2).sum()) for g in grads[s].values()) + loss**q / lr
        for s in deltas
    ]
    want = {
        k: theta[k].double() - sum(loss**q * grads[s][k] for s in deltas) / sum(hs) for k in theta
    }
    sh.assert_close(got, want, tol=1e-6)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        (
            "FedAdam",
            {"etaa": 0.1},
            "strategy.etaa: not a parameter of 'flower:FedAdam' "
            "(known: ['beta_1', 'beta_2', 'eta', 'eta_l', 'tau'])",
        ),
        ("FedAdam", {"eta": "fast"}, "strategy.eta: expected float, got str 'fast'"),
        (
            "FedAvg",
            {"min_fit_clients": 3},
            "strategy.min_fit_clients: not used with 'flower:FedAvg': use rounds.min_sites",
        ),
        (
            "FedAvg",
            {"evaluate_fn": "mod:fn"},
            "strategy.evaluate_fn: 'flower:FedAvg' takes a Python object",
        ),
        (
            "FedTrimmedAvg",
            {"beta": 0.7},
            "strategy 'flower:FedTrimmedAvg': ValueError: `beta` must be in the range",
        ),
        (
            "FedXgbBagging",
            {},
            "strategy 'flower:FedXgbBagging' cannot run in isthmus: it exchanges XGBoost trees",
        ),
        (
            "DPFedAvgFixed",
            {},
            "strategy 'flower:DPFedAvgFixed' cannot run from a job config: it requires 'strategy'",
        ),
        ("FedAwesome", {}, "strategy 'flower:FedAwesome': no such Flower strategy"),
    ],
)
def test_flower_config_errors_name_the_key_or_the_plugin(name, params, message):
    with pytest.raises(StrategyError, match=re.escape(message)):
        load_strategy(f"flower:{name}", params)


def test_flwr_is_imported_only_when_named_with_telemetry_off():
    code = (
        "import os, sys\n"
        "import coordinator.core, strategies\n"
        "from strategies import load_strategy\n"
        "load_strategy('fedadam', {})\n"
        "assert 'flwr' not in sys.modules, 'flwr imported without a flower: strategy'\n"
        "s = load_strategy('flower:FedAvg', {})\n"
        "assert 'flwr' in sys.modules\n"
        "print(os.environ['FLWR_TELEMETRY_ENABLED'], os.environ['FLWR_DISABLE_UPDATE_CHECK'])\n"
    )
    env = {k: v for k, v in h.subprocess_env().items() if not k.startswith("FLWR_")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1"]
    assert "FLWR_TELEMETRY_ENABLED" not in os.environ or os.environ["FLWR_TELEMETRY_ENABLED"] == "0"


# ---- end to end -----------------------------------------------------------------------------

WEIGHTS = {"site-a": 1.0, "site-b": 3.0}


def _job(tmp_path, strategy):
    cfg = h.job_config(strategy=strategy, rounds={"total": 3, "min_sites": 2, "max_sites": 2})
    coord = h.start_coordinator(tmp_path, cfg)
    try:
        runs = sh.run_sites(coord.address, WEIGHTS)
        assert coord.wait(timeout=20) == 0, coord.log_tail()
    finally:
        coord.kill()
    for run in runs:
        assert run.error is None, f"{run.name}: {run.error!r}\n{coord.log_tail()}"
    a, b = runs
    assert a.final.theta_hash == b.final.theta_hash and a.final.version == 3
    return [a.fetched[r].theta for r in range(3)] + [a.final.theta]


@pytest.mark.e2e
def test_flower_fedadam_end_to_end(tmp_path):
    thetas = _job(tmp_path, {"name": "flower:FedAdam", "eta": 0.05, "tau": 1e-3})
    m, v = {}, {}
    b1, b2, eta, tau = 0.9, 0.99, 0.05, 1e-3
    for r in range(3):  # Flower's FedAdam in float64, from the models the sites fetched
        theta = thetas[r]
        for name, t in theta.items():
            if not t.is_floating_point():
                assert torch.equal(thetas[r + 1][name], t)
                continue
            d = {k: sh.sine_delta(theta, k, r)[name].double() for k in (0, 1)}
            delta = -(1.0 * d[0] + 3.0 * d[1]) / 4.0
            m[name] = b1 * m.get(name, 0 * delta) + (1 - b1) * delta
            v[name] = b2 * v.get(name, 0 * delta) + (1 - b2) * delta**2
            eta_t = eta * (1 - b2 ** (r + 2)) ** 0.5 / (1 - b1 ** (r + 2))
            want = t.double() + eta_t * m[name] / (v[name].sqrt() + tau)
            torch.testing.assert_close(thetas[r + 1][name].double(), want, rtol=1e-5, atol=1e-5)
    _, meta, files = sh.latest_checkpoint(tmp_path / "state")
    state = load_safetensors(files["strategy.safetensors"])
    assert int(state["steps"]) == 3 and {"list.m_t.0", "list.v_t.1"} <= set(state)


@pytest.mark.e2e
def test_flower_krum_end_to_end(tmp_path):
    thetas = _job(tmp_path, {"name": "flower:Krum"})
    for r in range(3):
        # Two sites score the same; Krum keeps the first model in site order: site-a's.
        delta = sh.sine_delta(thetas[r], 0, r)
        for name, t in thetas[r].items():
            want = t - delta[name] if name in delta else t
            torch.testing.assert_close(thetas[r + 1][name], want, rtol=1e-6, atol=1e-6)


def test_missing_flwr_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flwr.common", None)
    with pytest.raises(
        StrategyError, match=re.escape("need flwr 1.42: pip install 'isthmus[flower]'")
    ):
        load_strategy("flower:FedAvg", {})
