"""FedAvgM and the FedOpt family against float64 references written from the papers.

Every round goes through the coordinator's own path (spooled updates, ``close_round``). The
references work on site *models* (theta_i), not on isthmus's pseudo-gradients, so a sign slip
in the pseudo-gradient convention would show.
"""

from __future__ import annotations

import re

import pytest
import torch

from coordinator.intake.spool import UpdateSpool
from strategies import Aggregate, FedAdagrad, FedAdam, FedAvgM, FedYogi, StrategyError
from strategies import load_strategy as load
from strategies.base import apply_in_float32

try:
    from . import strategy_helpers as sh
except ImportError:
    import strategy_helpers as sh

ROUNDS = 6


class Reference:
    """Reddi et al. (2021) Algorithm 2 and Hsu et al. (2019) in float64, on site models."""

    def __init__(self, name: str, **hp) -> None:
        self.name, self.hp = name, hp
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.t = 0

    def step(self, theta: dict, site_models: dict, examples: dict) -> dict:
        n = sum(examples.values())
        avg = {k: sum(examples[s] * site_models[s][k] for s in site_models) / n for k in theta}
        self.t += 1
        hp, out = self.hp, {}
        for k, th in theta.items():
            if self.name == "fedavgm":
                g = th - avg[k]  # the server "gradient": the opposite of the average update
                mu = hp["server_momentum"]
                self.m[k] = mu * self.m[k] + g if k in self.m else g
                step = g + mu * self.m[k] if hp["nesterov"] else self.m[k]
                out[k] = th - hp["server_learning_rate"] * step
                continue
            d = avg[k] - th  # Reddi's Delta_t
            b1 = hp.get("beta_1", 0.0)
            self.m[k] = b1 * self.m.get(k, 0 * d) + (1 - b1) * d
            v = self.v.get(k, 0 * d)
            if self.name == "fedadam":
                v = hp["beta_2"] * v + (1 - hp["beta_2"]) * d * d
            elif self.name == "fedyogi":
                v = v - (1 - hp["beta_2"]) * d * d * torch.sign(v - d * d)
            else:
                v = v + d * d
            self.v[k] = v
            eta = hp["eta"]
            if self.name == "fedadam" and hp.get("bias_correction", True):
                b2 = hp["beta_2"]
                eta = eta * (1 - b2 ** (self.t + 1)) ** 0.5 / (1 - b1 ** (self.t + 1))
            out[k] = th + eta * self.m[k] / (v.sqrt() + hp["tau"])
        return out


CASES = [
    ("fedavgm", {}, {"server_learning_rate": 1.0, "server_momentum": 0.9, "nesterov": False}),
    (
        "fedavgm",
        {"server_learning_rate": 0.5, "server_momentum": 0.7, "nesterov": True},
        {"server_learning_rate": 0.5, "server_momentum": 0.7, "nesterov": True},
    ),
    ("fedadam", {}, {"eta": 0.1, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-9}),
    (
        "fedadam",
        {"eta": 0.03, "beta_1": 0.5, "beta_2": 0.9, "tau": 1e-3, "bias_correction": False},
        {"eta": 0.03, "beta_1": 0.5, "beta_2": 0.9, "tau": 1e-3, "bias_correction": False},
    ),
    ("fedyogi", {}, {"eta": 0.01, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}),
    (
        "fedyogi",
        {"eta": 0.1, "beta_1": 0.0, "beta_2": 0.5, "tau": 1e-2},
        {"eta": 0.1, "beta_1": 0.0, "beta_2": 0.5, "tau": 1e-2},
    ),
    ("fedadagrad", {}, {"eta": 0.1, "tau": 1e-9}),
    (
        "fedadagrad",
        {"eta": 0.3, "tau": 0.01, "beta_1": 0.5},
        {"eta": 0.3, "tau": 0.01, "beta_1": 0.5},
    ),
]


@pytest.mark.parametrize(("name", "params", "hp"), CASES)
def test_builtin_matches_float64_reference_over_rounds(tmp_path, name, params, hp):
    sites = sh.make_sites(3)
    examples = {s: float(m.examples) for s, m in sites.items()}
    strategy = load(name, params)
    ref = Reference(name, **hp)
    spool = UpdateSpool(tmp_path / "spool")
    theta, want = sh.theta0(), sh.as64(sh.theta0())
    for r in range(ROUNDS):
        deltas = {s: m.delta(theta) for s, m in sites.items()}
        theta, _ = sh.coordinator_round(strategy, spool, r, theta, deltas, examples)
        want = ref.step(want, {s: m.train(want) for s, m in sites.items()}, examples)
        sh.assert_close(theta, want, tol=2e-5, what=f"{name} round {r}")
    moved = (theta["layer.w"] - sh.theta0()["layer.w"]).abs().max()
    assert moved > 1e-2, "the strategy did not move theta"


@pytest.mark.parametrize("cls", [FedAvgM, FedAdam, FedYogi, FedAdagrad])
def test_state_dict_round_trip_continues_identically(tmp_path, cls):
    sites = sh.make_sites(3)
    examples = {s: float(m.examples) for s, m in sites.items()}

    def rounds(strategy, theta, start, stop):
        for r in range(start, stop):
            deltas = {s: m.delta(theta) for s, m in sites.items()}
            theta, _ = sh.coordinator_round(
                strategy, UpdateSpool(tmp_path / f"{id(strategy)}-{r}"), r, theta, deltas, examples
            )
        return theta

    a = cls()
    theta = rounds(a, sh.theta0(), 0, 3)
    state = a.state_dict()
    counts = {k for k in state if k == "steps" or k.startswith("t.")}  # FedOpt's step counts
    moments = {k: v for k, v in state.items() if k not in counts}
    assert all(v.dtype == torch.float32 for v in moments.values())
    assert {k.split(".", 1)[1] for k in moments} == set(sh.SHAPES)
    assert counts in (set(), {"steps"} | {f"t.{n}" for n in sh.SHAPES})
    b = cls()
    b.load_state_dict({k: v.clone() for k, v in state.items()})
    ta = rounds(a, theta, 3, 5)
    tb = rounds(b, theta, 3, 5)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    fresh = rounds(cls(), theta, 3, 5)  # state lost: a different model
    assert not all(torch.equal(ta[k], fresh[k]) for k in ta)


@pytest.mark.parametrize("cls", [FedAvgM, FedAdam, FedYogi, FedAdagrad])
def test_failed_outer_step_leaves_the_state_unchanged(cls):
    s = cls()
    theta = {"a": torch.ones(3), "b": torch.ones(2)}
    s.outer_step(theta, Aggregate({"a": torch.full((3,), 0.1), "b": torch.ones(2)}, 1.0, {}, 0))
    before = {k: v.clone() for k, v in s.state_dict().items()}
    broken = Aggregate({"a": torch.full((3,), 0.2), "zzz": torch.ones(2)}, 1.0, {}, 1)
    with pytest.raises(KeyError):
        s.outer_step(theta, broken)  # "zzz" is not in theta: fails after "a" was stepped
    after = s.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("name", ["fedavgm", "fedadam", "fedyogi", "fedadagrad"])
def test_bf16_theta_stays_bf16_with_float32_state(tmp_path, name):
    sites = sh.make_sites(2)
    strategy = load(name, {})
    theta = sh.theta0(torch.bfloat16)
    for r in range(2):
        deltas = {s: m.delta(theta) for s, m in sites.items()}
        theta, _ = sh.coordinator_round(
            strategy, UpdateSpool(tmp_path / f"r{r}"), r, theta, deltas, {s: 1.0 for s in sites}
        )
    assert all(v.dtype == torch.bfloat16 for v in theta.values())
    state = strategy.state_dict()
    moments = {k: v for k, v in state.items() if k != "steps" and not k.startswith("t.")}
    assert moments and all(v.dtype == torch.float32 for v in moments.values())


def test_int_tensors_pass_through_unchanged():
    theta = {"w": torch.ones(2), "steps": torch.tensor(7, dtype=torch.int64)}
    agg = Aggregate({"w": torch.full((2,), 0.25)}, 1.0, {"s": 1.0}, 0)
    for name in ("fedavgm", "fedadam", "fedyogi", "fedadagrad"):
        out = load(name, {}).outer_step(theta, agg)
        assert out["steps"] is theta["steps"]
        assert not torch.equal(out["w"], theta["w"])


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("fedadam", {"eta": 0.0}, "eta must be > 0"),
        ("fedadam", {"tau": 0.0}, "tau must be > 0"),
        ("fedadam", {"beta_1": 1.0}, "beta_1 must be in [0, 1)"),
        ("fedyogi", {"beta_2": -0.1}, "beta_2 must be in [0, 1)"),
        ("fedadagrad", {"beta_2": 0.9}, "strategy.beta_2: not a hyperparameter of 'fedadagrad'"),
        ("fedadam", {"eta": "0.1"}, "strategy.eta: expected float"),
        ("fedadam", {"bias_correction": 1}, "strategy.bias_correction: expected bool"),
        ("fedavgm", {"server_momentum": 1.0}, "server_momentum must be in [0, 1)"),
        ("fedavgm", {"momentum": 0.9}, "strategy.momentum: not a hyperparameter of 'fedavgm'"),
    ],
)
def test_config_errors_name_the_key(name, params, message):
    with pytest.raises(StrategyError, match=re.escape(message)):
        load(name, params)


def test_flower_defaults_and_names():
    assert load("fedadam", {}).config.eta == 0.1 and load("fedadam", {}).config.tau == 1e-9
    assert load("fedyogi", {}).config.eta == 0.01 and load("fedyogi", {}).config.tau == 1e-3
    assert load("fedadagrad", {}).config.beta_1 == 0.0
    s = load("fedadam", {"eta": 1, "eta_l": 0.5})
    assert isinstance(s.config.eta, float) and "eta_l=0.5" in s.describe()


@pytest.mark.slow
def test_fedavg_noniid_example_runs_and_learns(capsys):
    from examples.fedavg_noniid.run import main

    assert main(["--rounds", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("round"))
    assert lines[header].split()[1:] == ["FedAvg", "FedProx", "mu=0.1", "FedAdam", "eta=0.03"]
    rows = [line.split() for line in lines[header + 1 : header + 6]]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3, 4]
    first, last = ([float(x) for x in r[1:]] for r in (rows[0], rows[-1]))
    assert all(b > a + 0.2 for a, b in zip(first, last, strict=True)), (first, last)


class _GlobalCountFedAdam(FedAdam):
    """FedAdam as it was before per-tensor step counts: one eta_t for all tensors."""

    def outer_step(self, theta, aggregate):
        cfg = self.config
        eta = self.eta_t(self.steps + 1)
        out = dict(theta)
        for name, g in aggregate.mean_delta.items():
            zero = torch.zeros_like(g)
            m = cfg.beta_1 * self.m.get(name, zero) + (1 - cfg.beta_1) * g
            v = self.second_moment(self.v.get(name, zero), g * g)
            self.m[name], self.v[name] = m, v
            out[name] = apply_in_float32(theta[name], eta * m / (v.sqrt() + cfg.tau))
        self.steps += 1
        return out


def _grads(r: int, names) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + r)
    return {n: 0.1 * torch.randn(4, 3, generator=g) for n in names}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_per_tensor_counts_are_the_global_count_when_every_tensor_steps():
    names = ("a", "b", "c")
    theta = {n: torch.ones(4, 3) for n in names}
    new, old = FedAdam(), _GlobalCountFedAdam()
    ta, tb = dict(theta), dict(theta)
    for r in range(5):
        ta = new.outer_step(ta, Aggregate(_grads(r, names), 1.0, {}, r))
        tb = old.outer_step(tb, Aggregate(_grads(r, names), 1.0, {}, r))
    assert _equal(ta, tb)
    assert new.counts == dict.fromkeys(names, 5) and new.steps == 5


def test_a_checkpoint_without_per_tensor_counts_loads_as_the_global_count():
    names = ("a", "b")
    theta = {n: torch.ones(4, 3) for n in names}
    run = FedAdam()
    for r in range(3):
        theta = run.outer_step(theta, Aggregate(_grads(r, names), 1.0, {}, r))
    old_format = {k: v for k, v in run.state_dict().items() if not k.startswith("t.")}
    resumed = FedAdam()
    resumed.load_state_dict(old_format)
    assert resumed.counts == {"a": 3, "b": 3}
    agg = Aggregate(_grads(3, names), 1.0, {}, 3)
    assert _equal(run.outer_step(theta, agg), resumed.outer_step(theta, agg))


@pytest.mark.parametrize("cls", [FedAdam, FedYogi, FedAdagrad])
def test_fragment_steps_equal_one_instance_per_fragment(cls):
    """[streaming]: fragment r % 2 steps in round r. One strategy over both fragments gives
    the same bits as a separate instance per fragment that steps whenever its fragment does
    (each tensor's bias correction counts its own steps), also across a checkpoint."""
    frags = (("a", "b"), ("c",))
    theta = {n: torch.ones(4, 3) for f in frags for n in f}
    whole, parts = cls(), [cls(), cls()]
    tw, tp = dict(theta), dict(theta)
    for r in range(7):
        names = frags[r % 2]
        agg = Aggregate(_grads(r, names), 1.0, {}, r)
        tw = whole.outer_step(tw, agg)
        tp = parts[r % 2].outer_step(tp, agg)
        if r == 2:  # a restart in between
            again = cls()
            again.load_state_dict({k: v.clone() for k, v in whole.state_dict().items()})
            whole = again
        assert _equal(tw, tp)
    assert whole.counts == {"a": 4, "b": 4, "c": 3}
