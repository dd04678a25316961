"""Building a strategy from the job config's ``[strategy]`` table.

``name`` is a built-in (``fedavg``, ``fedavgm``, ``fedadam``, ``fedyogi``, ``fedadagrad``,
``diloco``), ``flower:ClassName`` (or ``flower:server.ClassName``) for a strategy of Flower's
legacy API ``flwr.server.strategy``, ``flower:serverapp.ClassName`` for one of its Message API
``flwr.serverapp.strategy`` (for both, the other keys are the Flower constructor's arguments),
or ``package.module:ClassName`` for a strategy in the user's own code: an isthmus
``Strategy``, whose ``Config`` dataclass must have a field for every other key, or a Flower
Message-API strategy. Every error names the plugin, and the key or the hook at fault.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from collections.abc import Mapping
from typing import Any

from strategies.base import Strategy, StrategyError
from strategies.diloco import DiLoCo
from strategies.fedavg import FedAvg
from strategies.fedavgm import FedAvgM
from strategies.fedopt import FedAdagrad, FedAdam, FedYogi

BUILTINS: dict[str, type[Strategy]] = {
    "fedavg": FedAvg,
    "fedavgm": FedAvgM,
    "fedadam": FedAdam,
    "fedyogi": FedYogi,
    "fedadagrad": FedAdagrad,
    "diloco": DiLoCo,
}
FLOWER_PREFIX = "flower:"
LEGACY_PREFIX = "flower:server."
SERVERAPP_PREFIX = "flower:serverapp."


def resolve_strategy_class(name: str) -> type[Strategy]:
    cls = _named_class(name)
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        attr = name.partition(":")[2]
        raise StrategyError(f"strategy {name!r}: {attr!r} is not a Strategy subclass")
    return cls


def _named_class(name: str) -> Any:
    """The built-in, or whatever ``package.module:Class`` names (checked by the caller)."""
    if name in BUILTINS:
        return BUILTINS[name]
    if ":" not in name:
        raise StrategyError(
            f"unknown strategy {name!r}: use one of {sorted(BUILTINS)}, 'flower:ClassName', "
            "'flower:serverapp.ClassName' or 'package.module:Class'"
        )
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the plugin's own import-time code may raise anything
        raise StrategyError(
            f"strategy {name!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    return getattr(module, attr, None)


def load_strategy(name: str, params: Mapping[str, Any]) -> Strategy:
    """Instantiate strategy ``name`` with hyperparameters ``params``; errors name the key."""
    if name.startswith(SERVERAPP_PREFIX):
        from strategies.flower.serverapp import load_serverapp_strategy  # imports flwr

        return load_serverapp_strategy(name, dict(params))
    if name.startswith(FLOWER_PREFIX):
        from strategies.flower.strategy import load_flower_strategy  # imports flwr: only when named

        short = name.removeprefix(LEGACY_PREFIX).removeprefix(FLOWER_PREFIX)
        return load_flower_strategy(FLOWER_PREFIX + short, dict(params))
    if name not in BUILTINS:
        from strategies.flower.serverapp import is_message_strategy, load_serverapp_strategy

        named = _named_class(name)
        if is_message_strategy(named):  # the user's own Flower Message-API strategy
            return load_serverapp_strategy(name, dict(params), named)
    cls = resolve_strategy_class(name)
    config_cls = getattr(cls, "Config", None)
    if config_cls is None or not dataclasses.is_dataclass(config_cls):
        raise StrategyError(f"strategy {name!r} has no Config dataclass")
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception as exc:
        raise StrategyError(
            f"strategy {name!r}: the annotations of {config_cls.__name__} cannot be resolved: {exc}"
        ) from exc
    kwargs: dict[str, Any] = {}
    for key, value in params.items():
        if key not in hints:
            raise StrategyError(
                f"strategy.{key}: not a hyperparameter of {name!r} (known: {sorted(hints)})"
            )
        want = hints[key]
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        wrong_bool = want in (int, float) and isinstance(value, bool)
        if wrong_bool or (isinstance(want, type) and not isinstance(value, want)):
            raise StrategyError(
                f"strategy.{key}: expected {getattr(want, '__name__', want)}, "
                f"got {type(value).__name__} {value!r}"
            )
        kwargs[key] = value
    try:
        config = config_cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise StrategyError(f"strategy {name!r}: {exc}") from exc
    try:
        return cls(config)
    except Exception as exc:  # a plugin's own constructor, or an abstract method left out
        raise StrategyError(
            f"strategy {name!r} failed to start (in __init__): {type(exc).__name__}: {exc}"
        ) from exc
