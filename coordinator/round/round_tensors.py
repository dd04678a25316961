"""Streaming outer steps, the coordinator's side: which tensors round r syncs.

With ``[streaming] fragments = P`` (``wire.fragments``) each coordinator round is one
fragment's sync: round r's updates carry exactly the tensors of fragment ``r % P``, its outer
step changes only those, and its downlink delta holds only those. ``RoundTensors`` answers
"which tensors does round r carry" for the intake (the manifest check), the running sum and
the robust path's ``like``; without ``[streaming]`` it answers "every trainable tensor", the
very list the coordinator used before, so nothing else changes.

The plan is a pure function of theta's trainable names and shapes and the config, computed
once at start (the sites compute the same one). ``check_start`` refuses, before any state is
touched, what cannot work one fragment at a time: strategies that take every update whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from strategies.base import Strategy
from wire.codecs.rules import CompressionConfig
from wire.config_table import ConfigError
from wire.fragments import FragmentPlan, StreamingConfig, fragment_plan


@dataclass(frozen=True)
class RoundFragment:
    """The fragment one round syncs, for refusals that say so."""

    round: int
    index: int
    plan: FragmentPlan

    @property
    def count(self) -> int:
        return len(self.plan.fragments)

    def outside(self, name: str) -> str:
        """Why a trainable tensor of another fragment may not be sent this round."""
        return (
            f"tensor {name!r} is in fragment {self.plan.index_of(name)}; round {self.round} "
            f"syncs fragment {self.index} of {self.count} ([streaming])"
        )

    def missing(self, names: Sequence[str]) -> str:
        return (
            f"update is missing tensor(s) {list(names[:5])} of fragment {self.index} of "
            f"{self.count}, which round {self.round} syncs ([streaming])"
        )


@dataclass(frozen=True)
class RoundTensors:
    """The tensors each round's updates carry (sorted names): all of ``trainable`` without a
    ``plan``, fragment ``r % P`` of it with one."""

    trainable: tuple[str, ...]
    plan: FragmentPlan | None = None

    @classmethod
    def of(
        cls,
        theta: Mapping[str, torch.Tensor],
        trainable: Sequence[str],
        cfg: StreamingConfig | None,
    ) -> RoundTensors:
        """Plan the fragments of ``theta``'s ``trainable`` tensors (none without ``cfg``).

        Raises
        ------
        ConfigError
            From ``wire.fragments.fragment_plan``: a fragment would hold no tensor.
        """
        names = tuple(trainable)
        if cfg is None:
            return cls(names)
        shapes = {n: tuple(theta[n].shape) for n in names}
        return cls(names, fragment_plan(shapes, cfg))

    @property
    def fragments(self) -> int:
        """P; 0 without ``[streaming]``."""
        return len(self.plan.fragments) if self.plan is not None else 0

    def names(self, round_number: int) -> Sequence[str]:
        """The tensors round ``round_number``'s updates carry and its outer step changes."""
        return self.trainable if self.plan is None else self.plan.names(round_number)

    def synced(self, round_number: int) -> Sequence[str] | None:
        """The tensors round ``round_number``'s downlink delta carries (None: all of theta)."""
        return None if self.plan is None else self.plan.names(round_number)

    def fragment(self, round_number: int) -> int:
        """The fragment round ``round_number`` syncs (``RoundInfo.fragment``); 0 without."""
        return 0 if self.plan is None else round_number % len(self.plan.fragments)

    def scope(self, round_number: int) -> RoundFragment | None:
        if self.plan is None:
            return None
        return RoundFragment(round_number, self.fragment(round_number), self.plan)

    def restrict(self, tensors: dict[str, torch.Tensor], round_number: int):
        """``tensors`` (name -> tensor) cut down to the round's fragment; as given without."""
        if self.plan is None:
            return tensors
        return {n: tensors[n] for n in self.plan.names(round_number)}


def check_start(cfg: StreamingConfig | None, strategy: Strategy) -> None:
    """Refuse, before any state is read or written, a strategy that cannot step per fragment.

    Raises
    ------
    ConfigError
        With ``fragments > 1``: a strategy that takes every update whole (``needs_updates``).
        (A late update folds into the next round of its own fragment, ``coordinator.data.
        federated``, so ``late_discount`` works with any number of fragments.)
    """
    if cfg is None or cfg.fragments == 1:
        return
    p = cfg.fragments
    if strategy.needs_updates:
        raise ConfigError(
            f"streaming.fragments: strategy {strategy.plugin_name!r} combines the individual "
            f"updates of the whole model itself (needs_updates), but with {p} fragments each "
            "round's updates carry one fragment only; use a strategy that steps on the mean "
            "(diloco, fedavg, fedavgm, fedadam, ...) or streaming.fragments = 1"
        )


def downlink_config(
    downlink: CompressionConfig | None, cfg: StreamingConfig | None
) -> CompressionConfig | None:
    """The downlink's codec rules: ``[compression.downlink]`` when set; with more than one
    fragment and none set, a raw float32 delta (codec "none"), so that sites fetch only the
    fragment that changed rather than theta whole each round."""
    if downlink is None and cfg is not None and cfg.fragments > 1:
        return CompressionConfig()
    return downlink
