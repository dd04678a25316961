"""The ``[shards]`` table: how many processes (or hosts) the model's tensors are split over.

::

    [shards]
    count = 4                  # K: the lead holds shard 0, K - 1 shard processes the rest
    addresses = []             # shards 1..K-1 on other hosts: ["10.0.0.2:7071", ...];
                               # empty: `coordinator serve` starts them on its own host

What shards do not do yet is refused by name (``unsupported``), before any state is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

from wire.config_table import ConfigError, check_listen, rule, setting
from wire.shard_plan import MAX_SHARDS


def _addresses(value: list) -> str | None:
    for a in value:
        if not isinstance(a, str) or (problem := check_listen(a)):
            return f"each address is HOST:PORT ({problem if isinstance(a, str) else 'a string'})"
    return None


@dataclass(frozen=True)
class ShardsConfig:
    """The ``[shards]`` table (see the module docstring)."""

    count: int = setting(
        1,
        check=rule(lambda v: 1 <= v <= MAX_SHARDS, f"must be in [1, {MAX_SHARDS}]"),
        help="K, the shards the model's tensors are split over (``wire.shard_plan``): the lead "
        "holds shard 0, ``coordinator shard`` processes hold 1..K-1; 1: one process",
    )
    addresses: list = setting(
        factory=list,
        check=_addresses,
        help="``HOST:PORT`` of shards 1..K-1 when they run on other hosts (``coordinator shard "
        "--index i``), in index order; empty: ``coordinator serve`` starts them as processes "
        "of its own host",
    )

    def check(self) -> None:
        if self.addresses and len(self.addresses) != self.count - 1:
            raise ConfigError(
                f"shards.addresses: {len(self.addresses)} addresses for {self.count} shards; "
                f"list shards 1..{self.count - 1} (the lead is shard 0), or none to start them "
                "on this host"
            )


def unsupported(cfg, strategy) -> str | None:
    """What of job config ``cfg`` coordinator shards cannot do yet, or None."""
    agg = cfg.aggregation
    problems = [
        (cfg.streaming is not None, "[streaming]"),
        (agg.method != "mean", f"aggregation.method = {agg.method!r} (robust rules need whole "
         "updates)"),
        (agg.clip_norm > 0, "aggregation.clip_norm (clipping needs whole updates' norms)"),
        (agg.outlier_zscore > 0, "aggregation.outlier_zscore (screening needs whole updates)"),
        (cfg.downlink is not None, "[compression.downlink] (shards serve whole parts)"),
        (cfg.evaluation is not None, "[evaluation]"),
        (cfg.data.mode != "federated", "data.mode = 'shared'"),
        (not strategy.separable, f"strategy {cfg.strategy.name!r}, which is not separable per "
         "tensor (DiLoCo, FedAvg, FedAvgM and the FedOpt family are)"),
        (getattr(strategy.config, "late_discount", 0) > 0, "late updates (strategy."
         "late_discount > 0: a shard keeps a round's parts only until it closes)"),
    ]  # fmt: skip
    found = [what for bad, what in problems if bad]
    if not found:
        return None
    return f"coordinator shards do not support {found[0]} yet; use [shards] count = 1"
