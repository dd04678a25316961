"""Outer-loop strategies against float64 references, fed through the real spool aggregation."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from coordinator.intake.spool import SpooledUpdate, UpdateSpool
from strategies import Aggregate, DiLoCo, FedAvg, Strategy, StrategyError, load_strategy
from strategies.diloco import DiLoCoConfig
from strategies.robust import weighted_mean_of

try:  # tests/ as a package or as a plain folder on sys.path
    from .strategy_helpers import SHAPES, SITES, QuadraticSite, make_sites, spool_update, theta0
except ImportError:
    from strategy_helpers import SHAPES, SITES, QuadraticSite, make_sites, spool_update, theta0


def weighted_mean(updates: list[SpooledUpdate], like) -> tuple[dict, float]:
    """The mean the coordinator takes at round close, over spooled updates."""
    return weighted_mean_of([u.as_site_update() for u in updates], like)


def _coordinator_round(strategy: Strategy, spool: UpdateSpool, r: int, theta, sites):
    """One round as coordinator.core does it: weight, spool, weighted_mean, outer_step."""
    strategy.begin_round(r, theta)
    updates = []
    for site, model in sites.items():
        local = model.train(theta)
        delta = {k: theta[k] - local[k] for k in theta}  # computed at the site, in float32
        weight = strategy.update_weight(site, float(model.examples))
        updates.append(spool_update(spool, r, site, delta, weight))
    mean, total = weighted_mean(updates, theta)
    agg = Aggregate(mean, total, {u.site: u.weight for u in updates}, r)
    before = {k: v.clone() for k, v in theta.items()}
    new_theta = strategy.outer_step(theta, agg)
    for k in theta:  # outer_step must not modify theta in place
        assert torch.equal(theta[k], before[k])
        assert new_theta[k].dtype == theta[k].dtype and new_theta[k].shape == theta[k].shape
    return new_theta


def _sites() -> dict[str, QuadraticSite]:
    return make_sites(len(SITES))


def _close(a: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    for k in ref:
        torch.testing.assert_close(a[k].to(torch.float64), ref[k], rtol=2e-5, atol=2e-5)


def test_fedavg_matches_weighted_mean_of_site_models(tmp_path: Path):
    sites = _sites()
    strategy = FedAvg()
    spool = UpdateSpool(tmp_path / "spool")
    theta = theta0()
    ref = {k: v.to(torch.float64) for k, v in theta.items()}
    n_total = sum(m.examples for m in sites.values())
    for r in range(5):
        theta = _coordinator_round(strategy, spool, r, theta, sites)
        # Reference: theta_{r+1} = sum_i n_i theta_i / sum_i n_i, in float64.
        locals_ = {s: m.train(ref) for s, m in sites.items()}
        ref = {k: sum(sites[s].examples * locals_[s][k] for s in sites) / n_total for k in ref}
        _close(theta, ref)
    # The job moved: the test would not pass with a no-op strategy.
    assert not torch.allclose(theta["layer.w"], theta0()["layer.w"], atol=1e-2)


def test_fedavg_server_lr_scales_the_step(tmp_path: Path):
    sites = _sites()
    theta = theta0()
    full = _coordinator_round(FedAvg(), UpdateSpool(tmp_path / "a"), 0, theta, sites)
    half = _coordinator_round(
        load_strategy("fedavg", {"server_lr": 0.5}), UpdateSpool(tmp_path / "b"), 0, theta, sites
    )
    for k in theta:
        torch.testing.assert_close(half[k], theta[k] + 0.5 * (full[k] - theta[k]))


def _diloco_reference(rounds: int, sites, lr: float, mu: float, nesterov: bool, weighted: bool):
    theta = {k: v.to(torch.float64) for k, v in theta0().items()}
    m = {k: torch.zeros_like(v) for k, v in theta.items()}
    history = []
    for _ in range(rounds):
        deltas = {
            s: {k: theta[k] - v for k, v in site.train(theta).items()} for s, site in sites.items()
        }
        w = {s: float(site.examples) if weighted else 1.0 for s, site in sites.items()}
        g = {k: sum(w[s] * deltas[s][k] for s in sites) / sum(w.values()) for k in theta}
        for k in theta:
            m[k] = mu * m[k] + g[k]
            step = g[k] + mu * m[k] if nesterov else m[k]
            theta[k] = theta[k] - lr * step
        history.append({k: v.clone() for k, v in theta.items()})
    return history


@pytest.mark.parametrize(
    ("params", "nesterov", "weighted"),
    [
        ({}, True, False),  # the paper's lr 0.7, momentum 0.9
        ({"lr": 0.5, "momentum": 0.8, "weighted": True}, True, True),
        ({"lr": 0.9, "momentum": 0.5, "nesterov": False}, False, False),
        ({"lr": 1.0, "momentum": 0.0}, True, False),
    ],
)
def test_diloco_matches_algorithm_1(tmp_path: Path, params, nesterov, weighted):
    sites = _sites()
    strategy = load_strategy("diloco", params)
    cfg = DiLoCoConfig(**params)
    ref = _diloco_reference(6, sites, cfg.lr, cfg.momentum, nesterov, weighted)
    spool = UpdateSpool(tmp_path / "spool")
    theta = theta0()
    for r in range(6):
        theta = _coordinator_round(strategy, spool, r, theta, sites)
        _close(theta, ref[r])


def test_diloco_against_torch_sgd_nesterov(tmp_path: Path):
    """Second, independent reference: torch.optim.SGD(nesterov=True) with grad = mean delta."""
    sites = _sites()
    strategy = DiLoCo()
    spool = UpdateSpool(tmp_path / "spool")
    theta = theta0()
    params = {k: torch.nn.Parameter(v.clone()) for k, v in theta.items()}
    opt = torch.optim.SGD(list(params.values()), lr=0.7, momentum=0.9, nesterov=True)
    for r in range(4):
        current = {k: p.detach().clone() for k, p in params.items()}
        deltas = [{k: current[k] - v for k, v in s.train(current).items()} for s in sites.values()]
        for k, p in params.items():
            p.grad = sum(d[k] for d in deltas) / len(deltas)
        opt.step()
        theta = _coordinator_round(strategy, spool, r, theta, sites)
        for k, p in params.items():
            torch.testing.assert_close(theta[k], p.detach(), rtol=1e-5, atol=1e-5)


def test_diloco_state_dict_round_trip_continues_identically(tmp_path: Path):
    sites = _sites()
    a = DiLoCo()
    theta = theta0()
    for r in range(3):
        theta = _coordinator_round(a, UpdateSpool(tmp_path / f"a{r}"), r, theta, sites)
    state = a.state_dict()
    assert set(state) == {f"momentum.{k}" for k in SHAPES}
    assert all(v.dtype == torch.float32 for v in state.values())
    b = DiLoCo()
    b.load_state_dict({k: v.clone() for k, v in state.items()})
    ta, tb = theta, {k: v.clone() for k, v in theta.items()}
    for r in range(3, 6):
        ta = _coordinator_round(a, UpdateSpool(tmp_path / f"a{r}"), r, ta, sites)
        tb = _coordinator_round(b, UpdateSpool(tmp_path / f"b{r}"), r, tb, sites)
        for k in ta:
            assert torch.equal(ta[k], tb[k])
    # A fresh optimiser (momentum lost) would not have continued the same way.
    tc = _coordinator_round(DiLoCo(), UpdateSpool(tmp_path / "c"), 3, theta, sites)
    b2 = DiLoCo()
    b2.load_state_dict(state)
    tb3 = _coordinator_round(b2, UpdateSpool(tmp_path / "e"), 3, theta, sites)
    assert not all(torch.equal(tc[k], tb3[k]) for k in tc)


def test_diloco_keeps_bf16_params_in_bf16_and_momentum_in_f32(tmp_path: Path):
    sites = _sites()
    s = DiLoCo()
    theta = theta0(torch.bfloat16)
    for r in range(2):
        theta = _coordinator_round(s, UpdateSpool(tmp_path / f"r{r}"), r, theta, sites)
    assert all(v.dtype == torch.bfloat16 for v in theta.values())
    assert all(v.dtype == torch.float32 for v in s.state_dict().values())


def test_float64_params_are_not_rounded_to_float32():
    theta = {"w": torch.tensor([1.0 + 2.0**-40], dtype=torch.float64)}
    agg = Aggregate({"w": torch.tensor([2.0**-20], dtype=torch.float32)}, 1.0, {"s": 1.0}, 0)
    out = FedAvg().outer_step(theta, agg)
    assert out["w"].dtype == torch.float64
    assert out["w"].item() == 1.0 + 2.0**-40 - 2.0**-20


def test_outer_step_passes_through_tensors_without_delta():
    theta = {"w": torch.ones(2), "steps": torch.tensor(7, dtype=torch.int64)}
    agg = Aggregate({"w": torch.full((2,), 0.25)}, 1.0, {"s": 1.0}, 0)
    for strategy in (FedAvg(), DiLoCo()):
        out = strategy.outer_step(theta, agg)
        assert out["steps"] is theta["steps"]
        assert not torch.equal(out["w"], theta["w"])


# ---- weighted_mean ------------------------------------------------------------------------


def test_weighted_mean_is_exact_weighted_average_and_order_independent(tmp_path: Path):
    spool = UpdateSpool(tmp_path / "spool")
    g = torch.Generator().manual_seed(4)
    like = {
        "a": torch.zeros(50, 7),
        "b": torch.zeros(3, dtype=torch.bfloat16),
        "c": torch.zeros(()),
    }
    updates, deltas, weights = [], {}, {}
    for i, site in enumerate(["s3", "s1", "s5", "s2", "s4"]):
        delta = {
            "a": torch.randn(50, 7, generator=g) * 10 ** (i - 2),
            "b": torch.randn(3, generator=g).to(torch.bfloat16),
            "c": torch.randn((), generator=g),
        }
        weights[site] = float(1 + 37 * i)
        deltas[site] = delta
        updates.append(spool_update(spool, 3, site, delta, weights[site]))
    mean, total = weighted_mean(updates, like)
    assert total == sum(weights.values())
    for k in like:
        ref = sum(weights[s] * deltas[s][k].to(torch.float64) for s in deltas) / total
        assert mean[k].dtype == torch.float32
        torch.testing.assert_close(mean[k].to(torch.float64), ref, rtol=1e-5, atol=1e-6)
    for perm in itertools.islice(itertools.permutations(updates), 0, 120, 7):
        again, _ = weighted_mean(list(perm), like)
        for k in like:
            assert torch.equal(again[k], mean[k])  # bitwise
    # Updates read back from the spool after a "crash" give the same bits.
    recovered = spool.completed(3)
    assert sorted(u.site for u in recovered) == sorted(deltas)
    again, _ = weighted_mean(recovered, like)
    assert all(torch.equal(again[k], mean[k]) for k in like)


def test_weighted_mean_without_weight_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="no update weight"):
        weighted_mean([], {"a": torch.zeros(2)})


# ---- loader -------------------------------------------------------------------------------


@dataclass(frozen=True)
class HalfStepConfig:
    scale: float = 0.5
    label: str = "x"


class HalfStep(Strategy):
    """A custom plugin: theta - scale * mean_delta."""

    Config = HalfStepConfig

    def outer_step(self, theta, aggregate):
        return {k: theta[k] - self.config.scale * d for k, d in aggregate.mean_delta.items()}


class NotAStrategy:
    Config = HalfStepConfig


class Broken(Strategy):  # outer_step left abstract
    Config = HalfStepConfig


def test_load_builtins_by_name():
    assert isinstance(load_strategy("fedavg", {}), FedAvg)
    d = load_strategy("diloco", {"lr": 1, "momentum": 0.5, "nesterov": False})
    assert isinstance(d, DiLoCo)
    assert d.config == DiLoCoConfig(lr=1.0, momentum=0.5, nesterov=False)
    assert isinstance(d.config.lr, float)


def test_load_custom_plugin_by_module_path():
    s = load_strategy(f"{__name__}:HalfStep", {"scale": 0.25, "label": "y"})
    assert type(s) is HalfStep and s.config == HalfStepConfig(0.25, "y")
    out = s.outer_step({"w": torch.ones(2)}, Aggregate({"w": torch.ones(2)}, 1.0, {}, 0))
    assert torch.equal(out["w"], torch.full((2,), 0.75))


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("adamw", {}, "unknown strategy 'adamw'"),
        ("diloco", {"learning_rate": 0.1}, "strategy.learning_rate"),
        ("diloco", {"lr": "0.7"}, "strategy.lr: expected float"),
        ("diloco", {"nesterov": 1}, "strategy.nesterov: expected bool"),
        ("diloco", {"lr": True}, "strategy.lr"),
        ("diloco", {"momentum": 1.5}, "momentum must be in"),
        ("diloco", {"lr": -1.0}, "lr must be > 0"),
        ("fedavg", {"server_lr": 0}, "server_lr must be > 0"),
        ("no_such_module_xyz:Thing", {}, "cannot import 'no_such_module_xyz'"),
        (f"{__name__}:Missing", {}, "'Missing' is not a Strategy subclass"),
        (f"{__name__}:NotAStrategy", {}, "is not a Strategy subclass"),
        (f"{__name__}:HalfStep", {"scale": "big"}, "strategy.scale"),
        (f"{__name__}:Broken", {}, "Broken"),
    ],
)
def test_load_strategy_errors_name_the_problem(name, params, message):
    with pytest.raises(StrategyError, match=re.escape(message)):
        load_strategy(name, params)
