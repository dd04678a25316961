"""The Strategy ABC: the few hooks an outer-loop algorithm implements.

The coordinator owns the data path (receiving, verifying and combining updates) and calls a
strategy at three moments: when a round opens, when an update is admitted (to weigh it), and
when the round closes (to turn the combined pseudo-gradient into the next global state).
Pseudo-gradients follow DiLoCo's sign: ``delta = theta_r - theta_site``, so plain averaging is
``theta_r - mean(delta)``.

A strategy that needs every site's update rather than their mean (Krum, the Flower adapter)
sets ``needs_updates = True``; it then also gets ``Aggregate.updates``, read lazily from the
coordinator's spool, and the coordinator checks at start-up that buffering them fits in
``aggregation.max_buffer_bytes`` (see ``Strategy.buffer_bytes``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

Tensors = dict[str, torch.Tensor]


class StrategyError(RuntimeError):
    """A strategy refused its input or failed in one of its hooks."""


@dataclass(frozen=True)
class SiteUpdate:
    """One site's pseudo-gradient, read from where the coordinator keeps it only when asked.

    Attributes
    ----------
    site
        The site that sent it.
    weight
        Its weight, as ``Strategy.update_weight`` returned it.
    reader
        Returns ``(name, tensor)`` pairs: zero-copy (memory-mapped) views in the wire dtype.
    scale
        Factor applied on reading (below 1 when ``aggregation.clip_norm`` clipped the update).
    key
        Unique within the round; the key of ``Aggregate.weights`` and of rejections. It is the
        site's name in federated mode, ``site@unit`` in shared-data mode (where one site may
        commit two units in a round) and ``site@lateR`` for a late update of round R.
    """

    site: str
    weight: float
    reader: Callable[[], Iterable[tuple[str, torch.Tensor]]]
    scale: float = 1.0
    key: str = ""

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", self.site)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, float32 tensor)`` one tensor at a time, with ``scale`` applied."""
        for name, t in self.reader():
            out = t.to(torch.float32)
            yield name, out if self.scale == 1.0 else out * self.scale

    def tensors(self) -> Tensors:
        """The whole update as float32 tensors (one model of memory)."""
        return dict(self.items())


@dataclass(frozen=True)
class Aggregate:
    """The round's updates, already combined by the coordinator.

    Attributes
    ----------
    mean_delta
        ``sum_i w_i * delta_i / sum_i w_i`` in float32 for every floating-point tensor (with
        ``[streaming]``: for the tensors of the round's fragment only; the step leaves the
        others as they are); with ``aggregation.method = "median"`` or ``"trimmed_mean"`` the
        coordinate-wise median or trimmed mean of the updates instead (unweighted, as in Yin
        et al. 2018).
    total_weight
        ``sum_i w_i`` over the counted updates.
    weights
        The weight each counted update received, keyed by ``SiteUpdate.key`` (the site's name
        in federated mode).
    round
        The round these updates belong to.
    updates
        The counted updates one by one, sorted by site; filled only for strategies with
        ``needs_updates = True``.
    rejected
        Updates of this round the robust aggregation refused, with the reason.
    metrics
        What each counted site reported for this round (``train_loss`` when it did), by site.
    """

    mean_delta: Tensors
    total_weight: float
    weights: dict[str, float]
    round: int
    updates: tuple[SiteUpdate, ...] = ()
    rejected: Mapping[str, str] = field(default_factory=dict)
    metrics: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


class Strategy(ABC):
    """An outer optimiser.

    Subclasses set ``Config`` to a dataclass of their hyperparameters; the job config's
    ``[strategy]`` table is checked against it and passed to ``__init__``.
    """

    Config: ClassVar[type]
    #: Set to True to receive ``Aggregate.updates`` (every site's update, read lazily).
    needs_updates: ClassVar[bool] = False
    #: Set to True when the outer step treats each tensor on its own: a tensor's new value and
    #: state depend only on its own theta, mean delta and state (no global norm, no shared step
    #: counter). ``outer_step_in_place`` is then called once per tensor, so that the
    #: coordinator holds one tensor of theta_r in memory rather than all of it.
    separable: ClassVar[bool] = False

    def __init__(self, config: Any) -> None:
        self.config = config

    def begin_round(self, round: int, theta: Tensors) -> None:  # noqa: B027 - optional hook
        """Called when round ``round`` opens with global parameters ``theta``."""

    def update_weight(self, site: str, reported_weight: float) -> float:
        """The weight an admitted update gets in the average (default: what the site reported)."""
        return reported_weight

    def staleness_weight(self, site: str, staleness: int) -> float:
        """Federated mode: what a late update is worth. An update for round r that arrives
        after round r closed (``staleness`` = 1) is folded into round r+1 (round r+P with P
        streaming fragments: the next to sync its tensors) with its weight multiplied by this
        number in [0, 1]; 0 drops it. Default: the config's
        ``late_discount`` if it has one (``staleness_weight = late_discount ** staleness``),
        else 0."""
        return float(getattr(self.config, "late_discount", 0.0)) ** staleness

    def outer_step_in_place(self, theta: Tensors, aggregate: Aggregate) -> Tensors | None:
        """Optional, to save memory at large model sizes: ``outer_step``, allowed to write
        theta_{r+1} into the tensors of ``aggregate.mean_delta`` (the coordinator no longer
        needs them) and to update the strategy's own state in place. It must give the same
        bits as ``outer_step``. Return None (the default) to have ``outer_step`` called.

        A failure here stops the job, which restarts from the last checkpoint, so in-memory
        state need not survive a failed step."""
        return None

    @abstractmethod
    def outer_step(self, theta: Tensors, aggregate: Aggregate) -> Tensors:
        """Return theta_{r+1}. Must not modify ``theta`` in place: the coordinator keeps
        theta_r until theta_{r+1} is durably checkpointed. Internal state (momentum...) should
        change only once the step succeeded, so that a failed step leaves it as it was."""

    def state_dict(self) -> Tensors:
        """Outer-optimiser state to checkpoint (tensors only, saved without pickle)."""
        return {}

    def load_state_dict(self, state: Tensors) -> None:  # noqa: B027 - stateless default
        """Restore what ``state_dict`` returned."""

    def buffer_bytes(self, n_updates: int, like: Tensors) -> int:
        """Memory the strategy holds at round close beyond one model, for ``n_updates``.

        The default assumes a strategy with ``needs_updates`` reads every update as float32.
        """
        return n_updates * float32_bytes(like) if self.needs_updates else 0

    @property
    def plugin_name(self) -> str:
        """How errors name this strategy: its import path, as a job config would write it."""
        cls = type(self)
        return f"{cls.__module__}:{cls.__qualname__}"

    def describe(self) -> str:
        return f"{type(self).__name__}({self.config})"


def steps_in_place(strategy: Strategy) -> bool:
    """Whether ``outer_step_in_place`` stands for this strategy's ``outer_step``: not when a
    subclass overrode ``outer_step`` alone (its own step must run)."""

    def owner(hook: str) -> type:
        return next(c for c in type(strategy).__mro__ if hook in vars(c))

    in_place, step = owner("outer_step_in_place"), owner("outer_step")
    return in_place is not Strategy and issubclass(in_place, step)


def all_finite(t: torch.Tensor) -> bool:
    """Whether a floating tensor holds no NaN or Inf (min and max are NaN-propagating, and
    an order of magnitude faster than ``isfinite(t).all()``)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def float32_bytes(like: Mapping[str, torch.Tensor]) -> int:
    """Bytes of ``like`` held in float32 (float64 tensors stay 8 bytes per element)."""
    return sum(t.numel() * max(t.element_size(), 4) for t in like.values())


def apply_in_float32(theta: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """theta - step computed in float32 (float64 for float64 theta), returned in theta's dtype."""
    compute = torch.promote_types(theta.dtype, torch.float32)
    return (theta.to(compute) - step.to(compute)).to(theta.dtype)


def call_hook(strategy: Strategy, hook: str, *args: Any) -> Any:
    """Call one of the strategy's hooks; any failure becomes a StrategyError that names the
    plugin and the hook, so the operator knows whose code to look at."""
    try:
        return getattr(strategy, hook)(*args)
    except StrategyError as exc:
        if strategy.plugin_name in str(exc):
            raise
        raise StrategyError(f"strategy {strategy.plugin_name!r} failed in {hook}: {exc}") from exc
    except Exception as exc:
        raise StrategyError(
            f"strategy {strategy.plugin_name!r} failed in {hook}: {type(exc).__name__}: {exc}"
        ) from exc


def checked_weight(strategy: Strategy, site: str, reported: float) -> float:
    """``update_weight`` for one site, refused unless it is a finite number > 0."""
    weight = call_hook(strategy, "update_weight", site, reported)
    ok = isinstance(weight, int | float) and not isinstance(weight, bool)
    if not (ok and math.isfinite(weight) and weight > 0):
        raise StrategyError(
            f"strategy {strategy.plugin_name!r} failed in update_weight: returned {weight!r} "
            f"for site {site!r}; a weight must be a finite number > 0"
        )
    return float(weight)


def checked_staleness_weight(strategy: Strategy, site: str, staleness: int) -> float:
    """``staleness_weight`` for a late update, refused unless it is a number in [0, 1]."""
    weight = call_hook(strategy, "staleness_weight", site, staleness)
    ok = isinstance(weight, int | float) and not isinstance(weight, bool)
    if not (ok and 0.0 <= weight <= 1.0):
        raise StrategyError(
            f"strategy {strategy.plugin_name!r} failed in staleness_weight: returned "
            f"{weight!r}; expected a number in [0, 1]"
        )
    return float(weight)


def check_outer_result(strategy: Strategy, theta: Tensors, new: Any) -> Tensors:
    """Refuse an outer_step result that is not theta's names, shapes and dtypes, all finite."""

    def bad(problem: str) -> StrategyError:
        return StrategyError(
            f"strategy {strategy.plugin_name!r} failed in outer_step: it returned {problem}"
        )

    if not isinstance(new, Mapping):
        raise bad(f"a {type(new).__name__}, not a dict of tensors named like theta")
    if new.keys() != theta.keys():
        missing, extra = sorted(theta.keys() - new.keys()), sorted(new.keys() - theta.keys())
        raise bad(f"other tensor names than theta (missing {missing}, unexpected {extra})")
    for name, t in new.items():
        old = theta[name]
        if not isinstance(t, torch.Tensor):
            raise bad(f"a {type(t).__name__} for {name!r}, not a torch.Tensor")
        if t.shape != old.shape or t.dtype != old.dtype:
            raise bad(
                f"{name!r} as {t.dtype} {tuple(t.shape)}; theta has {old.dtype} {tuple(old.shape)}"
            )
        if t.is_floating_point() and not all_finite(t):
            raise bad(f"NaN or Inf in {name!r}")
    return dict(new)


def check_state(strategy: Strategy, state: Any) -> Tensors:
    """Refuse a state_dict that safetensors cannot store (non-tensors, non-string keys)."""
    if not isinstance(state, Mapping):
        raise StrategyError(
            f"strategy {strategy.plugin_name!r} failed in state_dict: it returned a "
            f"{type(state).__name__}, not a dict of tensors"
        )
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise StrategyError(
                f"strategy {strategy.plugin_name!r} failed in state_dict: entry {key!r} is a "
                f"{type(value).__name__}; checkpoints hold tensors only (no pickle)"
            )
    return dict(state)
