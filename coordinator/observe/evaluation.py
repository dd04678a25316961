"""Server-side evaluation of the global model: the ``[evaluation]`` table and its rules.

``fn = "package.module:function"`` names a function of the user's project, called at the
coordinator as ``fn(model, round)`` with an ``nn.Module`` built by the job's ``model.factory``
and holding theta (``round``: the number of rounds closed before it, 0 for theta_0). It returns
a mapping of metric names to numbers (``{"val_loss": 3.16}``), or None. It runs on a thread of
its own after theta is published (``coordinator.observe.evaluator``), so it never holds a round up.

Which versions are evaluated (``is_due``): theta_0, every ``every_rounds``-th version, and the
final one.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.model_source import FactoryImportError, factory_spec
from wire.config_table import ConfigError, non_empty, positive, setting

Hook = Callable[[Any, int], Any]


class EvaluationError(RuntimeError):
    """The evaluation hook failed or returned something that is not metrics."""


@dataclass(frozen=True)
class EvaluationConfig:
    """The ``[evaluation]`` table: the hook, and how often it runs."""

    fn: str = setting(
        check=(non_empty, factory_spec),
        help="``package.module:function`` called as ``fn(model, round)`` on the global model at "
        "the coordinator, off the round's path; needs ``model.factory``. Without the "
        "``[evaluation]`` table: no evaluation",
    )
    every_rounds: int = setting(
        1, check=positive, help="evaluate theta_0, every N-th theta and the last one"
    )


@dataclass(frozen=True)
class Evaluation:
    """One evaluation's outcome: theta's version, the hook's metrics and its wall time."""

    version: int
    metrics: dict[str, float]
    seconds: float


def is_due(version: int, every_rounds: int, total_rounds: int) -> bool:
    """Whether theta of ``version`` is evaluated: theta_0, every ``every_rounds``-th, the last."""
    return version == 0 or version == total_rounds or version % every_rounds == 0


def load_hook(spec: str) -> Hook:
    """The function ``module:function`` names; a ``ConfigError`` naming ``evaluation.fn``
    when it cannot be imported or is not callable."""
    module_name, _, attr = spec.partition(":")
    try:
        hook = getattr(importlib.import_module(module_name), attr)
    except ModuleNotFoundError as exc:  # serve adds where the module could be found
        raise FactoryImportError(
            f"evaluation.fn: cannot load {spec!r}: {type(exc).__name__}: {exc}",
            module_name,
            exc.name,
            key="evaluation.fn",
        ) from exc
    except Exception as exc:  # the user's own import-time code may raise anything
        raise ConfigError(
            f"evaluation.fn: cannot load {spec!r}: {type(exc).__name__}: {exc}"
        ) from exc
    if not callable(hook):
        raise ConfigError(f"evaluation.fn: {spec!r} is a {type(hook).__name__}, not a function")
    return hook


def checked_metrics(who: str, result: Any) -> dict[str, float]:
    """The hook's result as ``{name: float}``: a mapping of strings to finite real numbers
    (0-d tensors and numpy scalars included), or None for no metrics. ``who`` names the hook
    and theta's version in errors (``'pkg.m:fn' on theta_3``)."""
    if result is None:
        return {}
    if not isinstance(result, Mapping):
        raise EvaluationError(
            f"evaluation {who} returned a {type(result).__name__}; return a dict of "
            "metric names to numbers, e.g. {'val_loss': 3.2}"
        )
    out = {}
    for name, value in result.items():
        number = _as_float(value)
        if not isinstance(name, str) or number is None:
            raise EvaluationError(
                f"evaluation {who} returned {name!r}: {value!r}; metrics are finite "
                "numbers under string names"
            )
        out[name] = number
    return out


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if not isinstance(value, numbers.Real):
        try:  # a 0-d tensor or array
            value = value.item() if getattr(value, "ndim", None) == 0 else None
        except Exception:
            return None
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            return None
    number = float(value)
    return number if math.isfinite(number) else None


def describe(ev: Evaluation) -> str:
    """``val_loss 3.1605, ppl 23.6`` (``no metrics`` when the hook returned none)."""
    if not ev.metrics:
        return "no metrics"
    return ", ".join(f"{k} {v:.6g}" for k, v in sorted(ev.metrics.items()))


def needs_factory(cfg: EvaluationConfig | None, factory: str | None) -> None:
    """An evaluation builds its model with ``model.factory``; ``model.path`` gives tensors only."""
    if cfg is not None and factory is None:
        raise ConfigError(
            "evaluation.fn: needs model.factory to build the model it evaluates (model.path "
            "gives theta_0's tensors, not a module)"
        )
