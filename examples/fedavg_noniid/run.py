"""FedAvg against FedProx and FedAdam on a non-IID split of scikit-learn's digits, 3 sites.

``python -m examples.fedavg_noniid.run`` prints the test accuracy of the global model after
every round for each method. The sites are simulated in this process, but every round goes
through isthmus's own path: each site's pseudo-gradient ``theta_r - theta_site`` is written to
an ``UpdateSpool`` and committed, and the round is closed by ``close_round`` (the robust
aggregation layer, then the strategy's outer step), as in the coordinator.

- The split is non-IID by label: each class is shared among the sites in proportions drawn
  from a Dirichlet(alpha) distribution (alpha = 0.3: most sites see few classes).
- FedAvg and FedProx use the ``fedavg`` strategy (example-weighted mean of the site models);
  FedProx adds ``mu / 2 * ||w - theta_r||^2`` to each site's loss (Li et al. 2020), so the
  local models drift less towards their own classes.
- FedAdam uses the ``fedadam`` strategy on the same site training as FedAvg.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from coordinator.intake.spool import UpdateSpool
from strategies import RobustAggregator, load_strategy
from strategies.robust import close_round
from wire.tensors import pack


@dataclass
class Site:
    x: torch.Tensor
    y: torch.Tensor


def split(n_sites: int, alpha: float, seed: int):
    """Train sites (non-IID by label) and the held-out test set."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, digits.target, test_size=0.25, stratify=digits.target, random_state=seed
    )
    rng = np.random.default_rng(seed)
    owners: list[list[int]] = [[] for _ in range(n_sites)]
    for label in range(10):
        idx = rng.permutation(np.flatnonzero(y_tr == label))
        shares = rng.dirichlet([alpha] * n_sites)
        cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
        for k, part in enumerate(np.split(idx, cuts)):
            owners[k] += part.tolist()
    sites = [Site(torch.from_numpy(x_tr[o]), torch.from_numpy(y_tr[o])) for o in owners]
    return sites, (torch.from_numpy(x_te), torch.from_numpy(y_te))


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def train_site(model, theta, site: Site, steps: int, lr: float, mu: float, gen) -> dict:
    """H steps of minibatch SGD from theta_r; returns the pseudo-gradient theta_r - theta_i."""
    model.load_state_dict(theta)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    anchor = [p.detach().clone() for p in model.parameters()]
    for _ in range(steps):
        batch = torch.randint(len(site.y), (32,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(site.x[batch]), site.y[batch])
        if mu:  # FedProx: stay near theta_r
            loss = loss + mu / 2 * sum(
                ((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True)
            )
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: theta[k] - v.detach() for k, v in model.state_dict().items()}


def accuracy(model, theta, test) -> float:
    model.load_state_dict(theta)
    with torch.no_grad():
        return float((model(test[0]).argmax(1) == test[1]).float().mean())


def run_method(strategy_name, params, mu, sites, test, args, spool_root: Path) -> list[float]:
    strategy = load_strategy(strategy_name, params)
    aggregator = RobustAggregator()
    spool = UpdateSpool(spool_root)
    model = build_model(args.seed)
    theta = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(args.seed)
    history = [accuracy(model, theta, test)]
    for r in range(args.rounds):
        strategy.begin_round(r, theta)
        for k, site in enumerate(sites):
            delta = train_site(model, theta, site, args.inner_steps, args.lr, mu, gen)
            manifest, payload = pack(delta)
            with spool.open_part(r, f"site-{k}", "u") as f:
                f.write(payload)
            weight = strategy.update_weight(f"site-{k}", float(len(site.y)))
            spool.commit(r, f"site-{k}", "u", manifest, weight)
        updates = [u.as_site_update() for u in spool.completed(r)]
        theta, _ = close_round(strategy, aggregator, theta, updates, r)
        spool.drop_rounds_before(r + 1)
        history.append(accuracy(model, theta, test))
    return history


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--inner-steps", type=int, default=20, help="H: local SGD steps per round")
    p.add_argument("--lr", type=float, default=0.1, help="local SGD learning rate")
    p.add_argument("--mu", type=float, default=0.1, help="FedProx proximal weight")
    p.add_argument("--eta", type=float, default=0.03, help="FedAdam server learning rate")
    p.add_argument("--alpha", type=float, default=0.3, help="Dirichlet concentration")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # a 2k-parameter model: threads cost more than they give
    started = time.monotonic()
    sites, test = split(3, args.alpha, args.seed)
    for k, s in enumerate(sites):
        counts = np.bincount(s.y.numpy(), minlength=10)
        print(f"site-{k}: {len(s.y):4d} examples, per label {counts.tolist()}")
    methods = {
        "FedAvg": ("fedavg", {}, 0.0),
        f"FedProx mu={args.mu:g}": ("fedavg", {}, args.mu),
        f"FedAdam eta={args.eta:g}": ("fedadam", {"eta": args.eta, "tau": 1e-3}, 0.0),
    }
    results = {}
    with tempfile.TemporaryDirectory(prefix="isthmus-noniid-") as tmp:
        for i, (label, (name, params, mu)) in enumerate(methods.items()):
            results[label] = run_method(name, params, mu, sites, test, args, Path(tmp) / str(i))
    print("\ntest accuracy of the global model after each round")
    print("round  " + "  ".join(f"{m:>16s}" for m in results))
    for r in range(args.rounds + 1):
        print(f"{r:5d}  " + "  ".join(f"{h[r]:16.4f}" for h in results.values()))
    best = {m: max(h) for m, h in results.items()}
    print("best   " + "  ".join(f"{best[m]:16.4f}" for m in results))
    print(f"elapsed {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
