"""Flower's Message API (``flwr.serverapp.strategy``) through its adapter: every strategy both of
Flower's APIs have gives the same model in the legacy adapter, this one and the built-in; dtypes,
state, strategies that consume their input, refusals; FedAdam and MultiKrum end to end.
"""

from __future__ import annotations

import hashlib
import logging
import re

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

ROUNDS = 4
LOSS = {"train_loss": 2.5}  # one loss for all: the legacy QFedAvg weighs by one loss

# (built-in or None, its params, its aggregation), (legacy class, kwargs), (Message-API class,
# kwargs). Documented default differences are written out: the built-in FedAdam and FedAdagrad
# and the legacy ones have tau 1e-9, the Message API's 1e-3 (its default here).
TRIPLES = [
    (("fedavg", {}, {}), ("FedAvg", {}), ("FedAvg", {})),
    (("fedavg", {}, {}), ("FedProx", {"proximal_mu": 0.1}), ("FedProx", {"proximal_mu": 0.1})),
    (
        ("fedavgm", {"server_learning_rate": 0.7, "server_momentum": 0.9}, {}),
        ("FedAvgM", {"server_learning_rate": 0.7, "server_momentum": 0.9}),
        ("FedAvgM", {"server_learning_rate": 0.7, "server_momentum": 0.9}),
    ),
    (
        ("fedavgm", {"server_learning_rate": 0.5, "server_momentum": 0.0}, {}),
        ("FedAvgM", {"server_learning_rate": 0.5}),
        ("FedAvgM", {"server_learning_rate": 0.5}),
    ),
    (("fedadam", {"tau": 1e-3}, {}), ("FedAdam", {"tau": 1e-3}), ("FedAdam", {})),
    (
        ("fedadam", {"eta": 0.05, "beta_1": 0.8, "beta_2": 0.95, "tau": 1e-4}, {}),
        ("FedAdam", {"eta": 0.05, "beta_1": 0.8, "beta_2": 0.95, "tau": 1e-4}),
        ("FedAdam", {"eta": 0.05, "beta_1": 0.8, "beta_2": 0.95, "tau": 1e-4}),
    ),
    (("fedyogi", {}, {}), ("FedYogi", {}), ("FedYogi", {})),
    (("fedadagrad", {"tau": 1e-3}, {}), ("FedAdagrad", {"tau": 1e-3}), ("FedAdagrad", {})),
    (("fedavg", {}, {"method": "median"}), ("FedMedian", {}), ("FedMedian", {})),
    (
        ("fedavg", {}, {"method": "trimmed_mean", "trim_fraction": 0.25}),
        ("FedTrimmedAvg", {"beta": 0.25}),
        ("FedTrimmedAvg", {"beta": 0.25}),
    ),
    (None, ("Krum", {"num_malicious_clients": 1}), ("Krum", {"num_malicious_nodes": 1})),
    (
        None,
        ("Krum", {"num_malicious_clients": 1, "num_clients_to_keep": 2}),
        ("MultiKrum", {"num_malicious_nodes": 1, "num_nodes_to_select": 2}),
    ),
    # Bulyan and QFedAvg take 2.5-6 s each in Flower's own code: slow.
    pytest.param(
        None,
        ("Bulyan", {"num_malicious_clients": 0}),
        ("Bulyan", {"num_malicious_nodes": 0}),
        marks=pytest.mark.slow,
    ),
    pytest.param(
        None,
        ("QFedAvg", {"q_param": 0.5, "qffl_learning_rate": 0.1}),
        ("QFedAvg", {"q": 0.5, "client_learning_rate": 0.1}),
        marks=pytest.mark.slow,
    ),
]


def _round(strategy, theta, deltas, weights, spool, r, aggregator=None, metrics=None):
    updates = [
        sh.spool_update(spool, r, s, d, strategy.update_weight(s, weights[s])).as_site_update()
        for s, d in deltas.items()
    ]
    metrics = {s: LOSS for s in deltas} if metrics is None else metrics
    return close_round(strategy, aggregator or RobustAggregator(), theta, updates, r, metrics)[0]


def _new(name, kwargs):
    return load_strategy(f"flower:serverapp.{name}", kwargs)


@pytest.mark.parametrize(("builtin", "legacy", "new"), TRIPLES, ids=lambda t: t and t[0])
def test_the_three_ways_agree_round_after_round(tmp_path, builtin, legacy, new):
    sites = sh.make_sites(4)
    weights = {s: float(m.examples) for s, m in sites.items()}
    runs = {"legacy": load_strategy(f"flower:{legacy[0]}", legacy[1]), "new": _new(*new)}
    aggregators = {"legacy": RobustAggregator(), "new": RobustAggregator()}
    if builtin is not None:
        runs["builtin"] = load_strategy(builtin[0], builtin[1])
        aggregators["builtin"] = RobustAggregator(**builtin[2])
    theta = sh.theta0()
    theta["steps"] = torch.tensor([3, 1], dtype=torch.int64)  # an integer buffer rides along
    for r in range(ROUNDS):
        deltas = {s: m.delta(theta) for s, m in sites.items()}
        out = {
            k: _round(
                s, theta, deltas, weights, UpdateSpool(tmp_path / f"{k}{r}"), r, aggregators[k]
            )
            for k, s in runs.items()
        }
        got = out["new"]
        assert all(got[k].dtype == theta[k].dtype for k in theta)
        assert torch.equal(got["steps"], theta["steps"])
        assert not torch.equal(got["layer.w"], theta["layer.w"])
        for other in out.keys() - {"new"}:
            sh.assert_close(got, sh.as64(out[other]), tol=2e-5, what=f"{new[0]} vs {other} r{r}")
        theta = out["legacy"]


@pytest.mark.parametrize(
    ("builtin", "name"), [("fedadam", "FedAdam"), ("fedadagrad", "FedAdagrad")]
)
def test_message_api_default_tau_is_1e_3_not_the_legacy_1e_9(tmp_path, builtin, name):
    sites = sh.make_sites(3)
    weights = {s: float(m.examples) for s, m in sites.items()}
    theta = sh.theta0()
    deltas = {s: m.delta(theta) for s, m in sites.items()}
    new = _round(_new(name, {}), theta, deltas, weights, UpdateSpool(tmp_path / "n"), 0)
    same = _round(
        load_strategy(builtin, {"tau": 1e-3}),
        theta,
        deltas,
        weights,
        UpdateSpool(tmp_path / "a"),
        0,
    )
    old = _round(load_strategy(builtin, {}), theta, deltas, weights, UpdateSpool(tmp_path / "b"), 0)
    sh.assert_close(new, sh.as64(same), tol=2e-6)
    gap = max(float((new[k].double() - old[k].double()).abs().max()) for k in theta)
    assert gap > 1e-4, "the default tau should make a visible difference"


def test_multikrum_averages_the_site_models_with_the_best_scores(tmp_path):
    sites = sh.make_sites(4)
    theta = sh.theta0()
    deltas = {s: m.delta(theta) for s, m in sites.items()}
    deltas["site-d"] = {k: v * 40 for k, v in deltas["site-d"].items()}  # a wild site
    weights = {s: float(m.examples) for s, m in sites.items()}
    f, keep = 1, 2
    got = _round(
        _new("MultiKrum", {"num_malicious_nodes": f, "num_nodes_to_select": keep}),
        theta,
        deltas,
        weights,
        UpdateSpool(tmp_path),
        0,
    )
    # Blanchard et al. 2017: score_i = sum of the n - f - 2 smallest squared distances from
    # site i's model to the others; the `keep` best are averaged by their examples.
    order = sorted(deltas)
    flat = {
        s: torch.cat([(theta[k] - deltas[s][k]).double().flatten() for k in sorted(theta)])
        for s in order
    }
    n_closest = len(order) - f - 2
    scores = {
        s: sum(sorted(float(((flat[s] - flat[o]) ** 2).sum()) for o in order if o != s)[:n_closest])
        for s in order
    }
    best = sorted(order, key=scores.get)[:keep]
    assert "site-d" not in best
    mean = sh.weighted_mean64({s: deltas[s] for s in best}, {s: weights[s] for s in best})
    sh.assert_close(got, {k: theta[k].double() - mean[k] for k in theta}, tol=1e-6)


def test_bf16_is_upcast_and_cast_back_and_float64_stays(tmp_path):
    sites = sh.make_sites(3)
    weights = {s: float(m.examples) for s, m in sites.items()}
    theta = sh.theta0(torch.bfloat16)
    deltas = {s: m.delta(theta) for s, m in sites.items()}
    new = _round(_new("FedAdam", {}), theta, deltas, weights, UpdateSpool(tmp_path / "a"), 0)
    ours = _round(
        load_strategy("fedadam", {"tau": 1e-3}),
        theta,
        deltas,
        weights,
        UpdateSpool(tmp_path / "b"),
        0,
    )
    assert all(v.dtype == torch.bfloat16 for v in new.values())
    sh.assert_close(new, sh.as64(ours), tol=1e-2)  # within a bfloat16 rounding step

    theta = sh.theta0(torch.float64)
    deltas = {s: m.delta(theta) for s, m in sites.items()}
    fractional = {s: w for s, w in zip(sites, (0.25, 1.5, 0.75), strict=True)}
    got = _round(_new("FedAvg", {}), theta, deltas, fractional, UpdateSpool(tmp_path / "c"), 0)
    assert all(v.dtype == torch.float64 for v in got.values())
    want = {k: theta[k] - sh.weighted_mean64(deltas, fractional)[k] for k in theta}
    sh.assert_close(got, want, tol=1e-6)  # updates travel as float32


def _aggregate(tmp_path, deltas, weights, r=0):
    spool = UpdateSpool(tmp_path)
    updates = [
        sh.spool_update(spool, r, s, d, weights[s]).as_site_update() for s, d in deltas.items()
    ]
    like = next(iter(deltas.values()))
    outcome = RobustAggregator().aggregate(
        updates, like, r, needs_updates=True, metrics={s: LOSS for s in deltas}
    )
    return outcome.aggregate, spool


def _spool_digest(spool: UpdateSpool) -> dict[str, str]:
    return {
        str(p.relative_to(spool.root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(spool.root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("FedMedian", {}),
        ("FedTrimmedAvg", {"beta": 0.25}),
        pytest.param("Bulyan", {}, marks=pytest.mark.slow),  # 5-6 s in Flower's code
        pytest.param("QFedAvg", {"client_learning_rate": 0.1}, marks=pytest.mark.slow),
        ("FedAdam", {}),
    ],
)
def test_a_step_that_consumes_its_input_or_fails_leaves_spool_state_and_retry_intact(
    tmp_path, name, kwargs
):
    sites = sh.make_sites(4)
    theta = sh.theta0()
    deltas = {s: m.delta(theta) for s, m in sites.items()}
    agg, spool = _aggregate(tmp_path, deltas, {s: 1.0 + i for i, s in enumerate(sites)})
    theta_before, spooled = {k: v.clone() for k, v in theta.items()}, _spool_digest(spool)
    s = _new(name, kwargs)
    warm = s.outer_step(theta, agg)  # one step, so that state exists to be kept
    state = {k: v.clone() for k, v in s.state_dict().items()}
    real = s.flower.aggregate_train

    def half_done(server_round, replies):
        real(server_round, replies)  # consumes the replies (and moves m_t, v_t)...
        raise RuntimeError("disk on fire")  # ...then the step fails

    s.flower.aggregate_train = half_done
    with pytest.raises(
        StrategyError,
        match=rf"'flower:serverapp.{name}' failed in outer_step: RuntimeError: disk on fire",
    ):
        close_round(s, RobustAggregator(), theta, list(agg.updates), 0, agg.metrics)
    after = s.state_dict()
    assert state.keys() == after.keys() and all(torch.equal(state[k], after[k]) for k in state)
    s.flower.aggregate_train = real
    retried = s.outer_step(theta, agg)
    clean = _new(name, kwargs)
    clean.load_state_dict(state)
    want = clean.outer_step(theta, agg)
    assert all(torch.equal(retried[k], want[k]) for k in theta)
    assert _spool_digest(spool) == spooled
    assert all(torch.equal(theta[k], theta_before[k]) for k in theta)
    assert not all(torch.equal(warm[k], theta[k]) for k in theta)


@pytest.mark.parametrize(
    ("name", "kwargs", "prefix"),
    [
        ("FedAdam", {}, "dict.m_t."),
        ("FedYogi", {}, "dict.v_t."),
        ("FedAvgM", {"server_momentum": 0.9}, "list.momentum_vector."),
    ],
)
def test_state_is_checkpointed_and_restored(tmp_path, name, kwargs, prefix):
    sites = sh.make_sites(3)
    weights = {s: float(m.examples) for s, m in sites.items()}

    def rounds(strategy, theta, start, stop):
        for r in range(start, stop):
            deltas = {s: m.delta(theta) for s, m in sites.items()}
            spool = UpdateSpool(tmp_path / f"{id(strategy)}-{r}")
            theta = _round(strategy, theta, deltas, weights, spool, r)
        return theta

    a = _new(name, kwargs)
    theta = rounds(a, sh.theta0(), 0, 3)
    state = a.state_dict()
    assert len([k for k in state if k.startswith(prefix)]) == 4
    assert int(state["steps"]) == 3 and not any("current_arrays" in k for k in state)
    b = _new(name, kwargs)
    b.load_state_dict({k: v.clone() for k, v in state.items()})
    ta, tb = rounds(a, theta, 3, 5), rounds(b, theta, 3, 5)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    fresh = rounds(_new(name, kwargs), theta, 3, 5)
    assert not all(torch.equal(ta[k], fresh[k]) for k in ta)


def test_no_arrays_from_the_strategy_keeps_theta(tmp_path, caplog):
    sites = sh.make_sites(4)
    theta = sh.theta0()
    deltas = {s: m.delta(theta) for s, m in sites.items()}
    # Bulyan needs 4f + 3 = 7 replies for f = 1; with 4 it returns no arrays.
    strategy = _new("Bulyan", {"num_malicious_nodes": 1})
    with caplog.at_level(logging.WARNING, logger="isthmus.strategy.flower"):
        got = _round(strategy, theta, deltas, {s: 1.0 for s in sites}, UpdateSpool(tmp_path), 0)
    assert all(torch.equal(got[k], theta[k]) for k in theta)
    assert "flower:serverapp.Bulyan returned no arrays for round 0" in caplog.text


def test_own_message_api_strategy_runs_by_its_import_path(tmp_path):
    sites = sh.make_sites(3)
    weights = {s: float(m.examples) for s, m in sites.items()}
    strategy = load_strategy("flower_plugins:HalfwayAvg", {"step": 0.25})
    assert strategy.plugin_name == "flower_plugins:HalfwayAvg"
    theta = sh.theta0()
    deltas = {s: m.delta(theta) for s, m in sites.items()}
    got = _round(strategy, theta, deltas, weights, UpdateSpool(tmp_path), 0)
    mean = sh.weighted_mean64(deltas, weights)
    sh.assert_close(got, {k: theta[k].double() - 0.25 * mean[k] for k in theta}, tol=1e-6)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        (
            "flower:serverapp.FedAvg",
            {"fraction_train": 0.5},
            "strategy.fraction_train: not used with 'flower:serverapp.FedAvg': every site of a "
            "round trains (client sampling cannot map)",
        ),
        (
            "flower:serverapp.FedAvg",
            {"min_train_nodes": 3},
            "strategy.min_train_nodes: not used with 'flower:serverapp.FedAvg': use "
            "rounds.min_sites",
        ),
        (
            "flower:serverapp.FedAvg",
            {"fraction_evaluate": 0.5},
            "isthmus does not run Flower's federated evaluation (configure_evaluate); an "
            "[evaluation] fn evaluates the global model",
        ),
        (
            "flower:serverapp.FedAvg",
            {"train_metrics_aggr_fn": "m:f"},
            "strategy.train_metrics_aggr_fn: 'flower:serverapp.FedAvg' takes a Python object",
        ),
        ("flower:serverapp.FedAdam", {"etaa": 0.1}, "strategy.etaa: not a parameter of"),
        ("flower:serverapp.FedAdam", {"eta": "fast"}, "strategy.eta: expected float, got str"),
        (
            "flower:serverapp.QFedAvg",
            {},
            "strategy 'flower:serverapp.QFedAvg' cannot run from a job config: it requires "
            "'client_learning_rate'",
        ),
        (
            "flower:serverapp.FedTrimmedAvg",
            {"beta": 0.7},
            "strategy 'flower:serverapp.FedTrimmedAvg': ValueError: `beta` must be in the range",
        ),
        (
            "flower:serverapp.FedXgbBagging",
            {},
            "strategy 'flower:serverapp.FedXgbBagging' cannot run in isthmus: it exchanges XGBoost",
        ),
        (
            "flower:serverapp.DifferentialPrivacyServerSideFixedClipping",
            {},
            "cannot run from a job config: it requires 'strategy'",
        ),
        (
            "flower:serverapp.FedAwesome",
            {},
            "'flower:serverapp.FedAwesome': no such Flower strategy",
        ),
        (
            "flower_plugins:FirstNodeOnly",
            {},
            "'flower_plugins:FirstNodeOnly' cannot run in isthmus: configure_train sampled 1 of "
            "the round's 3 sites: client sampling cannot map",
        ),
        (
            "flower_plugins:SendsMetrics",
            {},
            "configure_train sends a MetricRecord (['hint']) that isthmus sites cannot receive",
        ),
        (
            "flower_plugins:SendsControlVariates",
            {},
            "configure_train sends ArrayRecords other than the global model "
            "({'arrays': 1, 'c': 1})",
        ),
        ("flower_plugins:EvaluatesInstead", {}, "configure_train sends 'evaluate' messages"),
        ("flower_plugins:UsesTheGrid", {}, "isthmus sites are not Flower nodes"),
    ],
)
def test_what_cannot_map_is_refused_at_start_saying_why(name, params, message):
    with pytest.raises(StrategyError, match=re.escape(message)):
        load_strategy(name, params)


def test_node_ids_follow_the_site_across_rounds_and_units():
    from strategies.flower.messages import node_ids

    a = node_ids([("site-a", "site-a"), ("site-b", "site-b")])
    b = node_ids([("site-a@u3", "site-a"), ("site-a@u7", "site-a"), ("site-c@u1", "site-c")])
    assert a["site-a"] == b["site-a@u3"] and len(set(a.values()) | set(b.values())) == 4


def test_missing_flwr_is_a_clear_error(monkeypatch):
    import sys

    from strategies.flower.messages import import_serverapp

    monkeypatch.setitem(sys.modules, "flwr.serverapp.strategy", None)
    import_serverapp.cache_clear()
    try:
        with pytest.raises(StrategyError, match=re.escape("need flwr 1.42: pip install")):
            load_strategy("flower:serverapp.FedAvg", {})
    finally:
        import_serverapp.cache_clear()


def test_legacy_spellings_stay_the_legacy_adapter():
    from strategies.flower.serverapp import FlowerMessageStrategy
    from strategies.flower.strategy import FlowerStrategy

    assert isinstance(load_strategy("flower:FedAvg", {}), FlowerStrategy)
    assert isinstance(load_strategy("flower:server.FedAvg", {}), FlowerStrategy)
    assert isinstance(load_strategy("flower:serverapp.FedAvg", {}), FlowerMessageStrategy)


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
def test_message_api_fedadam_end_to_end(tmp_path):
    thetas = _job(tmp_path, {"name": "flower:serverapp.FedAdam", "eta": 0.05})
    m, v = {}, {}
    b1, b2, eta, tau = 0.9, 0.99, 0.05, 1e-3  # tau: the Message API's default
    for r in range(3):  # FedAdam in float64, from the models the sites fetched
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
    assert int(state["steps"]) == 3 and {"dict.m_t.lin.weight", "dict.v_t.lin.bias"} <= set(state)


@pytest.mark.e2e
def test_message_api_multikrum_end_to_end(tmp_path):
    thetas = _job(tmp_path, {"name": "flower:serverapp.MultiKrum", "num_nodes_to_select": 1})
    for r in range(3):
        # Two sites score the same; MultiKrum keeps the first reply in site order: site-a's.
        delta = sh.sine_delta(thetas[r], 0, r)
        for name, t in thetas[r].items():
            want = t - delta[name] if name in delta else t
            torch.testing.assert_close(thetas[r + 1][name], want, rtol=1e-6, atol=1e-6)


def test_flowers_own_info_lines_stay_out_of_the_output(tmp_path):
    """Flower logs every round's sampling and aggregation at INFO through a console handler of
    its own on the ``flwr`` logger, past isthmus's log handler: no INFO record reaches that
    logger's handlers, like any library's INFO; its warnings do."""
    from flwr.common.logger import log

    class Seen(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.records: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    sites = sh.make_sites(2)
    theta = sh.theta0()
    deltas = {s: m.delta(theta) for s, m in sites.items()}
    strategy = _new("FedAvg", {})
    seen = Seen()
    logging.getLogger("flwr").addHandler(seen)  # beside Flower's console handler
    try:
        _round(strategy, theta, deltas, {s: 1.0 for s in sites}, UpdateSpool(tmp_path), 0)
        log(logging.WARNING, "a warning of flwr's")
    finally:
        logging.getLogger("flwr").removeHandler(seen)
    lines = [(r.levelname, r.getMessage()) for r in seen.records]
    assert lines == [("WARNING", "a warning of flwr's")], lines
