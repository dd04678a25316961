"""Combining a round's updates: the weighted mean, and robust aggregation around any strategy.

Applied at round close, before the strategy's outer step, in this order:

1. **Screening.** An update holding NaN or Inf is rejected (the coordinator already refuses
   them at push time; this is the second line). With ``outlier_zscore > 0`` an update whose L2
   norm has a modified z-score ``0.6745 (norm - median) / MAD`` (Iglewicz and Hoaglin) above the
   threshold is rejected; only large norms count, since a small update cannot pull the
   aggregate far. It needs at least 3 finite updates.
2. **Clipping.** With ``clip_norm > 0`` each update is scaled to an L2 norm (over all its
   tensors) of at most ``clip_norm``. With ``[streaming]`` an update carries one fragment, so
   it is clipped by the norm of its fragment alone (``clip_norm`` bounds each fragment's
   update, not the whole model's).
3. **Combining.** ``mean``: the strategy-weighted mean, streamed one update at a time in
   site-name order (memory: one float32 model). ``median`` / ``trimmed_mean``: coordinate-wise
   and unweighted, as in Yin et al. (2018) and Flower's FedMedian / FedTrimmedAvg; the trimmed
   mean drops ``int(trim_fraction * n)`` values at each end.

Memory: median and trimmed mean need every update at once. They work one tensor at a time,
stacking it from the ``n`` memory-mapped updates and sorting: about ``16 * n * numel`` bytes for
the largest tensor (float32 stack, sorted copy, int64 sort indices). A strategy that takes the
updates one by one (``needs_updates``) adds what ``Strategy.buffer_bytes`` says. Both are
checked against ``max_buffer_bytes`` at start-up for ``rounds.max_sites`` sites.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from strategies.base import (
    Aggregate,
    SiteUpdate,
    Strategy,
    StrategyError,
    Tensors,
    all_finite,
    call_hook,
    check_outer_result,
    float32_bytes,
)
from wire import config_table as ct

METHODS = ("mean", "median", "trimmed_mean")


class AggregationError(StrategyError):
    """The round's updates cannot be combined as configured; the message names the key."""


@dataclass(frozen=True)
class AggregationConfig:
    """The ``[aggregation]`` table: how the round's updates are screened and combined."""

    method: str = ct.setting(
        "mean",
        check=ct.one_of(METHODS),
        help="``mean`` (strategy-weighted, streamed: one model of memory), ``median`` or "
        "``trimmed_mean`` (coordinate-wise, unweighted, need every update at once)",
    )
    trim_fraction: float = ct.setting(
        0.2,
        check=ct.rule(lambda v: 0 <= v < 0.5, "must be in [0, 0.5)"),
        help="``trimmed_mean`` drops ``int(trim_fraction * n)`` values at each end",
    )
    clip_norm: float = ct.setting(
        0.0,
        check=ct.non_negative,
        help="> 0: scale each site's update to at most this L2 norm (over all its tensors)",
    )
    outlier_zscore: float = ct.setting(
        0.0,
        check=ct.non_negative,
        help="> 0: reject an update whose norm's modified z-score (0.6745 (norm - median) / "
        "MAD) exceeds this; needs 3 or more updates; 3.5 is the usual choice",
    )
    max_buffer_bytes: int = ct.setting(
        8 << 30,
        check=ct.positive,
        help="refuse to start if median or trimmed mean (about 16 x max_sites x the largest "
        "tensor) or a strategy that takes every update (the Flower adapters: about 3 x "
        "max_sites x the model in float32) would buffer more",
    )

    @classmethod
    def from_table(cls, data: Any) -> AggregationConfig:
        """Read ``[aggregation]``; a ``trim_fraction`` that the method would ignore is refused,
        since whoever wrote it expects it to do something."""
        cfg = ct.load_table(cls, data, "aggregation")
        if "trim_fraction" in data and cfg.method != "trimmed_mean":
            raise ct.ConfigError(
                f"aggregation.trim_fraction: only used with method = 'trimmed_mean' (method is "
                f"{cfg.method!r})"
            )
        return cfg


def weighted_mean_of(updates: Sequence[SiteUpdate], like: Tensors) -> tuple[Tensors, float]:
    """``sum_i w_i delta_i / sum_i w_i`` in float32, summed in site-name order."""
    acc = {name: torch.zeros(t.shape, dtype=torch.float32) for name, t in like.items()}
    total = 0.0
    for update in sorted(updates, key=lambda u: u.key):
        alpha = update.weight * update.scale
        for name, delta in update.reader():
            acc[name].add_(delta.to(torch.float32), alpha=alpha)
        total += update.weight
    if total <= 0:
        raise ValueError("no update weight to average")
    for t in acc.values():
        t.div_(total)
    return acc, total


@dataclass(frozen=True)
class Outcome:
    """What aggregation made of a round: ``aggregate`` is None if every update was refused."""

    aggregate: Aggregate | None
    rejected: dict[str, str] = field(default_factory=dict)
    clipped: dict[str, float] = field(default_factory=dict)  # site -> norm before clipping


def norm_of(tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[float, str | None]:
    """(L2 norm over all tensors, name of the first tensor holding NaN/Inf or None); the
    coordinator measures each arriving update with it when ``clip_norm`` is set."""
    sq = 0.0
    for name, t in tensors:
        t = t.to(torch.float32)
        if not all_finite(t):
            return math.nan, name
        sq += float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2
    return math.sqrt(sq), None


def _scan(update: SiteUpdate) -> tuple[float, str | None]:
    return norm_of(update.reader())


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _outliers(norms: dict[str, float], threshold: float) -> dict[str, str]:
    med = _median(list(norms.values()))
    mad = _median([abs(v - med) for v in norms.values()])
    if mad > 0:
        scale = mad / 0.6745
    else:  # half the norms tie: Iglewicz and Hoaglin fall back to the mean absolute deviation
        scale = 1.253314 * sum(abs(v - med) for v in norms.values()) / len(norms)
    out = {}
    for site, norm in norms.items():
        z = (norm - med) / scale if scale > 0 else 0.0
        if z > threshold:
            out[site] = (
                f"norm {norm:.4g} is an outlier (median {med:.4g}, modified z-score "
                f"{z:.3g} > aggregation.outlier_zscore = {threshold:g})"
            )
    return out


class RobustAggregator:
    """Screens, clips and combines a round's updates (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Takes ``AggregationConfig``'s fields, by position or name, and checks them as a
        config file's would be (its defaults and rules are the only copy)."""
        cfg = AggregationConfig(*args, **kwargs)
        ct.check_fields(cfg, "aggregation", AggregationError)
        self.config = cfg
        self.method, self.trim_fraction = cfg.method, cfg.trim_fraction
        self.clip_norm, self.outlier_zscore = cfg.clip_norm, cfg.outlier_zscore
        self.max_buffer_bytes = cfg.max_buffer_bytes

    @classmethod
    def from_config(cls, cfg: AggregationConfig) -> RobustAggregator:
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(AggregationConfig)})

    def streams(self, strategy: Strategy) -> bool:
        """Whether updates can be summed as they arrive: the weighted mean, each update on its
        own (clipping needs only its own norm), a strategy that takes the mean."""
        return self.method == "mean" and not self.outlier_zscore and not strategy.needs_updates

    def clip_scale(self, norm: float | None) -> float:
        """The factor ``clip_norm`` puts on an update of L2 norm ``norm``."""
        if not self.clip_norm or norm is None or norm <= self.clip_norm:
            return 1.0
        return self.clip_norm / norm

    def describe(self) -> str:
        parts = [self.method]
        if self.method == "trimmed_mean":
            parts.append(f"trim {self.trim_fraction:g}")
        if self.clip_norm:
            parts.append(f"clip {self.clip_norm:g}")
        if self.outlier_zscore:
            parts.append(f"outlier z {self.outlier_zscore:g}")
        return ", ".join(parts)

    # ---- start-up checks ------------------------------------------------------------------

    def buffer_bytes(self, n: int, like: Tensors, strategy: Strategy | None = None) -> int:
        need = 0
        if self.method != "mean" and like:
            largest = max(t.numel() for t in like.values())
            need += 16 * n * largest
        if strategy is not None:
            need += strategy.buffer_bytes(n, like)
        return need

    def check(self, strategy: Strategy, n: int, like: Tensors) -> None:
        """Refuse, before any round, a combination that cannot run (or not within memory)."""
        if self.method != "mean" and strategy.needs_updates:
            raise AggregationError(
                f"aggregation.method: {self.method!r} cannot be combined with strategy "
                f"{strategy.plugin_name!r}, which combines the individual updates itself; use "
                "method = 'mean' (clip_norm and outlier_zscore still apply)"
            )
        need = self.buffer_bytes(n, like, strategy)
        if need > self.max_buffer_bytes:
            raise AggregationError(
                f"aggregation.max_buffer_bytes: combining {n} updates (rounds.max_sites) of a "
                f"{float32_bytes(like) / 1e6:.1f} MB model with method {self.method!r} and "
                f"strategy {strategy.plugin_name!r} buffers about {need / 1e6:.1f} MB, over "
                f"the limit of {self.max_buffer_bytes / 1e6:.1f} MB; raise "
                "aggregation.max_buffer_bytes, lower rounds.max_sites or use method = 'mean'"
            )

    # ---- round close ----------------------------------------------------------------------

    def aggregate(
        self,
        updates: Sequence[SiteUpdate],
        like: Tensors,
        round: int,
        *,
        needs_updates: bool = False,
        metrics: Mapping[str, Mapping[str, float]] | None = None,
    ) -> Outcome:
        updates = sorted(updates, key=lambda u: u.key)
        rejected: dict[str, str] = {}
        clipped: dict[str, float] = {}
        if self.clip_norm or self.outlier_zscore or self.method != "mean":
            norms = {}
            for u in updates:
                norm, bad = _scan(u)
                if bad is not None:
                    rejected[u.key] = f"NaN or Inf values in tensor {bad!r}"
                else:
                    norms[u.key] = norm
            if self.outlier_zscore and len(norms) >= 3:
                rejected.update(_outliers(norms, self.outlier_zscore))
            kept = []
            for u in updates:
                if u.key in rejected:
                    continue
                if self.clip_norm and norms[u.key] > self.clip_norm:
                    clipped[u.key] = norms[u.key]
                    u = replace(u, scale=self.clip_norm / norms[u.key])
                kept.append(u)
            updates = kept
        if updates and self.method == "mean":
            combined, total = weighted_mean_of(updates, like)
            if not all(all_finite(t) for t in combined.values()):
                # NaN/Inf slipped in unscreened (or the sum overflowed): find culprits, redo.
                for u in updates:
                    _, bad = _scan(u)
                    if bad is not None:
                        rejected[u.key] = f"NaN or Inf values in tensor {bad!r}"
                updates = [u for u in updates if u.key not in rejected]
                if not updates:
                    return Outcome(None, rejected, clipped)
                combined, total = weighted_mean_of(updates, like)
                if not all(all_finite(t) for t in combined.values()):
                    raise AggregationError(
                        f"round {round}: the weighted mean overflows float32; set "
                        "aggregation.clip_norm to bound the updates"
                    )
        elif updates:
            combined, total = self._coordinate_wise(updates, like), sum(u.weight for u in updates)
        else:
            return Outcome(None, rejected, clipped)
        agg = Aggregate(
            combined,
            total,
            {u.key: u.weight for u in updates},
            round,
            tuple(updates) if needs_updates else (),
            dict(rejected),
            {s: m for s, m in (metrics or {}).items() if s not in rejected},
        )
        return Outcome(agg, rejected, clipped)

    def _coordinate_wise(self, updates: Sequence[SiteUpdate], like: Tensors) -> Tensors:
        views = [(dict(u.reader()), u.scale) for u in updates]
        n = len(views)
        cut = int(self.trim_fraction * n) if self.method == "trimmed_mean" else 0
        out = {}
        for name in like:
            stack = torch.stack([v[name].to(torch.float32) * s for v, s in views])
            ordered = torch.sort(stack, dim=0).values
            del stack
            if self.method == "median":
                mid = n // 2
                out[name] = ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
            else:
                out[name] = ordered[cut : n - cut].mean(dim=0)
        return out


def close_round(
    strategy: Strategy,
    aggregator: RobustAggregator,
    theta: Tensors,
    updates: Sequence[SiteUpdate],
    round: int,
    metrics: Mapping[str, Mapping[str, float]] | None = None,
) -> tuple[Tensors, Outcome]:
    """theta_{r+1} from the round's updates: what the coordinator does at round close.

    Screens and combines the updates, then takes the strategy's outer step. If every update
    was rejected, theta stays (and the strategy is not called). Errors name the plugin and the
    hook; the strategy's own state is the strategy's to keep unchanged on failure.
    """
    like = {n: theta[n] for n in theta if theta[n].is_floating_point()}
    aggregator.check(strategy, len(updates), like)
    outcome = aggregator.aggregate(
        updates, like, round, needs_updates=strategy.needs_updates, metrics=metrics
    )
    if outcome.aggregate is None:
        return theta, outcome
    result = call_hook(strategy, "outer_step", theta, outcome.aggregate)
    return check_outer_result(strategy, theta, result), outcome
