"""Shared pieces of the strategy tests: simulated sites, the coordinator's round-close path,
float64 reference helpers, and a site driver for end-to-end jobs against a real coordinator.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from coordinator.intake.spool import UpdateSpool
from site_client.transfer.client import CoordinatorClient, GlobalState
from strategies import FedAvg, RobustAggregator, Strategy
from strategies.robust import Outcome, close_round
from wire.backoff import BackoffPolicy
from wire.tensors import pack

SHAPES = {"layer.w": (6, 5), "layer.b": (5,), "head.w": (5, 3), "scale": ()}
SITES = ["site-c", "site-a", "site-d", "site-b"]  # deliberately not sorted
EXAMPLES = [120, 7, 55, 1000]


class QuadraticSite:
    """A site's "inner training": a few gradient steps on its own random quadratic loss."""

    def __init__(self, seed: int, examples: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.examples = examples
        self.target = {
            k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in SHAPES.items()
        }
        self.curv = {
            k: torch.rand(s, generator=g, dtype=torch.float64) + 0.5 for k, s in SHAPES.items()
        }

    def train(self, theta: dict[str, torch.Tensor], steps: int = 3, lr: float = 0.2):
        out = {}
        for k, t in theta.items():
            if not t.is_floating_point():
                out[k] = t
                continue
            x = t.clone()
            for _ in range(steps):
                x = x - lr * self.curv[k].to(t.dtype) * (x - self.target[k].to(t.dtype))
            out[k] = x
        return out

    def delta(self, theta):
        """The pseudo-gradient theta_r - theta_site, in theta's dtype (as a site computes it)."""
        local = self.train(theta)
        return {k: theta[k] - local[k] for k in theta if theta[k].is_floating_point()}


class TakesEveryUpdate(FedAvg):
    """FedAvg that asks for every update one by one (as the Flower adapters do)."""

    needs_updates = True


def make_sites(n: int = 4) -> dict[str, QuadraticSite]:
    return {s: QuadraticSite(seed=i + 10, examples=EXAMPLES[i]) for i, s in enumerate(SITES[:n])}


def theta0(dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return {
        k: torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for k, s in SHAPES.items()
    }


def spool_update(spool: UpdateSpool, r: int, site: str, delta, weight: float):
    """What the coordinator does with a verified upload: bytes into the .part file, commit."""
    manifest, payload = pack(delta)
    with spool.open_part(r, site, "u1") as f:
        f.write(payload)
    return spool.commit(r, site, "u1", manifest, weight)


def coordinator_round(
    strategy: Strategy,
    spool: UpdateSpool,
    r: int,
    theta,
    deltas: dict[str, dict[str, torch.Tensor]],
    reported: dict[str, float],
    aggregator: RobustAggregator | None = None,
) -> tuple[dict[str, torch.Tensor], Outcome]:
    """One round as coordinator.core closes it: weigh, spool, close_round."""
    strategy.begin_round(r, theta)
    updates = []
    for site, delta in deltas.items():
        weight = strategy.update_weight(site, reported[site])
        updates.append(spool_update(spool, r, site, delta, weight).as_site_update())
    before = {k: v.clone() for k, v in theta.items()}
    new, outcome = close_round(strategy, aggregator or RobustAggregator(), theta, updates, r)
    for k in theta:  # outer_step must not modify theta in place
        assert torch.equal(theta[k], before[k])
        assert new[k].dtype == theta[k].dtype and new[k].shape == theta[k].shape
    return new, outcome


def as64(theta) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.float64) for k, v in theta.items()}


def assert_close(got, want, tol: float = 2e-5, what: str = "") -> None:
    for k in want:
        torch.testing.assert_close(
            got[k].to(torch.float64),
            want[k].to(torch.float64),
            rtol=tol,
            atol=tol,
            msg=lambda m, k=k: f"{what} {k}: {m}",
        )


def weighted_mean64(deltas: dict[str, dict], weights: dict[str, float]) -> dict:
    total = sum(weights.values())
    names = next(iter(deltas.values())).keys()
    return {n: sum(weights[s] * deltas[s][n].double() for s in deltas) / total for n in names}


# ---- end to end: sites in threads against a real coordinator process -----------------------

QUICK_BACKOFF = BackoffPolicy(initial_s=0.05, cap_s=0.3, deadline_s=3)


def sine_delta(theta: dict[str, torch.Tensor], k: int, r: int) -> dict[str, torch.Tensor]:
    """Site k's pseudo-gradient in round r: a fixed function of theta_r, in float32."""
    out = {}
    for name, t in theta.items():
        if t.is_floating_point():
            out[name] = t - (t - 0.01 * (k + 1) * torch.sin(3.0 * t + r + 0.5 * k))
    return out


@dataclass
class SiteRun:
    name: str
    weight: float
    fetched: dict[int, GlobalState] = field(default_factory=dict)
    final: GlobalState | None = None
    error: BaseException | None = None


def _site(address: str, k: int, run: SiteRun, make_delta, backoff: BackoffPolicy) -> None:
    client = CoordinatorClient(
        address,
        run.name,
        backoff=backoff,
        num_examples=int(run.weight),
        rpc_timeout_s=5.0,
        transfer_timeout_s=20.0,
    )
    try:
        client.join()
        last = -1
        while True:
            info = client.wait_for_round(after=last, poll_s=0.05)
            if info.finished:
                break
            g = client.fetch()
            run.fetched[g.version] = g
            delta = make_delta(g.theta, k, info.round)
            client.push(info.round, delta, weight=run.weight, base_version=g.version)
            last = info.round
        run.final = client.fetch()
        client.leave("done")
    except BaseException as exc:  # the test reads it
        run.error = exc
    finally:
        client.close()


def run_sites(
    address: str,
    weights: dict[str, float],
    make_delta=sine_delta,
    backoff: BackoffPolicy = QUICK_BACKOFF,
    timeout: float = 60.0,
) -> list[SiteRun]:
    """Run every site until the job ends (or the coordinator goes away); returns their logs."""
    runs = [SiteRun(name, w) for name, w in weights.items()]
    threads = [
        threading.Thread(target=_site, args=(address, k, run, make_delta, backoff), daemon=True)
        for k, run in enumerate(runs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a site thread hung"
    return runs


def latest_checkpoint(state_dir: Path) -> tuple[str, dict, dict[str, bytes]]:
    """(name, meta.json, bytes of every file) of the newest checkpoint."""
    ckpt = Path(state_dir) / "checkpoints"
    name = (ckpt / "LATEST").read_text().strip()
    files = {p.name: p.read_bytes() for p in sorted((ckpt / name).iterdir())}
    return name, json.loads(files["meta.json"]), files
