"""Run a Flower Message-API strategy (``flwr.serverapp.strategy``, Flower 1.21+) as the outer step.

``name = "flower:serverapp.FedAdam"`` in ``[strategy]`` names one of Flower's own; a class of
your own project that subclasses ``flwr.serverapp.strategy.Strategy`` is named like any plugin,
``package.module:Class``. Every other key is a keyword argument of its constructor.

At round close the adapter plays the part of Flower's ``Strategy.start`` loop for one round:

1. ``configure_train(server_round, theta_r, ConfigRecord(), grid)``, where the grid's nodes are
   the sites whose updates count (``flower_messages.check_plan`` refuses a plan that samples
   sites, sends other records or other message types);
2. one reply per site, in site order: the site model ``theta_r - delta_i`` as an
   ``ArrayRecord`` (one float32 array per floating-point tensor, by name; bfloat16 and float16
   are upcast, float64 stays) and a ``MetricRecord`` with the site's weight under the
   strategy's ``weighted_by_key`` (``num-examples``) and the metrics every site reported
   (``train_loss``);
3. ``aggregate_train(server_round, replies)``: its arrays, cast back to theta's dtypes, are
   theta_{r+1}. Integer buffers never reach Flower and pass through unchanged. When it returns
   no arrays (Bulyan with too few sites), theta stays, as in Flower's own loop.

``server_round`` is isthmus's round plus one (Flower counts from 1). The replies are built
afresh for every call, so a strategy that consumes its input (``pop()`` in FedMedian and
FedTrimmedAvg, ``keep_input=False`` in Bulyan and QFedAvg) touches neither the spool nor a
retry. The strategy's copy of the global model (``current_arrays``) is cleared before every
round, so it always starts from the theta sites hold (after a compressed downlink, say).

State: see ``strategies.flower.state``; a failed step restores the attributes it had.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from strategies.base import Aggregate, Strategy, StrategyError, Tensors, float32_bytes
from strategies.flower.compat import check_kwargs, compute_dtype
from strategies.flower.messages import (
    WEIGHT_KEY,
    check_plan,
    common_metrics,
    import_serverapp,
    model_record,
    node_ids,
    site_grid,
    site_reply,
    theta_from,
)
from strategies.flower.state import PER_ROUND, changes, load_state, state_of

log = logging.getLogger("isthmus.strategy.flower")
PREFIX = "flower:serverapp."

_EVALUATION = (
    "isthmus does not run Flower's federated evaluation (configure_evaluate); an "
    "[evaluation] fn evaluates the global model at the coordinator after each round"
)
NOT_FROM_CONFIG = {
    "fraction_train": "every site of a round trains (client sampling cannot map); "
    "rounds.min_sites and rounds.max_sites choose the sites",
    "min_train_nodes": "use rounds.min_sites",
    "min_available_nodes": "use rounds.min_sites",
    "fraction_evaluate": _EVALUATION,
    "min_evaluate_nodes": _EVALUATION,
}
# Set so that Flower's node sampling takes every site of the round, however few.
SAMPLE_ALL = {"min_train_nodes": 1, "min_available_nodes": 1}
UNSUPPORTED = {
    "FedXgbBagging": "it exchanges XGBoost models as bytes, not tensors",
    "FedXgbCyclic": "it exchanges XGBoost models as bytes, not tensors",
    "Strategy": "it is the abstract base class",
    "Result": "it is the result of Strategy.start, not a strategy",
}


@dataclass(frozen=True)
class ServerAppConfig:
    """The strategy as named in ``[strategy]`` and its constructor's keyword arguments."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)


class FlowerMessageStrategy(Strategy):
    """A Message-API strategy's ``configure_train`` and ``aggregate_train`` as the outer step
    (see the module docstring)."""

    Config = ServerAppConfig
    needs_updates = True

    def __init__(self, config: ServerAppConfig, cls: type) -> None:
        super().__init__(config)
        kwargs = check_kwargs(config.name, cls, config.kwargs, NOT_FROM_CONFIG, frozenset())
        params = inspect.signature(cls.__init__).parameters
        kwargs.update({k: v for k, v in SAMPLE_ALL.items() if k in params})
        self.flower = _construct(config.name, cls, kwargs)
        _trial_plan(config.name, _construct(config.name, cls, kwargs))
        self.steps = 0
        self._scalars: set[str] = set()  # numeric attributes aggregate_train changed
        self._warned: set[str] = set()

    @property
    def plugin_name(self) -> str:
        return self.config.name

    def describe(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in sorted(self.config.kwargs.items()))
        return f"{self.plugin_name}({args})"

    def buffer_bytes(self, n_updates: int, like: Tensors) -> int:
        # The replies' serialised site models, the strategy's deserialised copies and its sum.
        return 3 * n_updates * float32_bytes(like)

    def outer_step(self, theta: Tensors, aggregate: Aggregate) -> Tensors:
        if not aggregate.updates:
            raise StrategyError(f"{self.plugin_name} needs the individual updates")
        names = sorted(aggregate.mean_delta)
        base = {n: theta[n].to(compute_dtype(theta[n].dtype)) for n in names}
        before = dict(vars(self.flower))
        try:
            arrays, metrics = self._one_round(aggregate, base, names)
            out = theta_from(arrays, theta, names) if arrays is not None else None
        except BaseException:
            vars(self.flower).clear()
            vars(self.flower).update(before)
            raise
        self._note_changes(before)
        self.steps += 1
        if metrics:
            log.info("%s round %d: %s", self.plugin_name, aggregate.round, dict(metrics))
        if out is None:
            log.warning(
                "%s returned no arrays for round %d (as Flower's loop does, theta stays)",
                self.plugin_name,
                aggregate.round,
            )
            return dict(theta)
        return out

    def _one_round(self, aggregate: Aggregate, base: Tensors, names: list[str]):
        server_round = aggregate.round + 1
        updates = aggregate.updates
        nodes = node_ids((u.key, u.site) for u in updates)
        for attr in PER_ROUND & vars(self.flower).keys():
            setattr(self.flower, attr, None)  # given again by configure_train, from theta_r
        plan = self.flower.configure_train(
            server_round,
            model_record(base, names),
            import_serverapp().app.ConfigRecord(),
            site_grid(sorted(nodes.values())),
        )
        by_node, record_key = check_plan(list(plan), set(nodes.values()), names)
        weight_key = getattr(self.flower, "weighted_by_key", WEIGHT_KEY)
        reported = common_metrics(aggregate.metrics, [u.site for u in updates])
        replies = []
        for update, metrics in zip(updates, reported, strict=True):
            delta = update.tensors()
            model = {n: (base[n] - delta[n].to(base[n].dtype)).numpy() for n in names}
            instruction = by_node[nodes[update.key]]
            replies.append(
                site_reply(instruction, record_key, model, weight_key, update.weight, metrics)
            )
            del delta, model
        return self.flower.aggregate_train(server_round, replies)

    def _note_changes(self, before: dict[str, Any]) -> None:
        numbers, others = changes(before, vars(self.flower))
        self._scalars |= numbers
        for attr in sorted(others - self._warned):
            self._warned.add(attr)
            log.warning(
                "%s keeps state in %r (a %s) that isthmus cannot checkpoint: after a "
                "coordinator restart it starts again from its initial value",
                self.plugin_name,
                attr,
                type(getattr(self.flower, attr)).__name__,
            )

    def state_dict(self) -> Tensors:
        state = state_of(self.flower, self._scalars)
        state["steps"] = torch.tensor(self.steps, dtype=torch.int64)
        return state

    def load_state_dict(self, state: Tensors) -> None:
        self.steps = int(state["steps"]) if "steps" in state else 0
        self._scalars |= load_state(self.flower, {k: v for k, v in state.items() if k != "steps"})


def _construct(name: str, cls: type, kwargs: dict[str, Any]) -> Any:
    try:
        return cls(**kwargs)
    except Exception as exc:
        raise StrategyError(f"strategy {name!r}: {type(exc).__name__}: {exc}") from exc


def _trial_plan(name: str, trial: Any) -> None:
    """Refuse at start a strategy whose ``configure_train`` cannot map, tried on a throwaway
    copy with three sites and a one-array model. A strategy that fails on that model for its
    own reasons is checked at its first round instead."""
    f = import_serverapp()
    probe = {"probe": np.zeros(1, dtype=np.float32)}
    record = f.app.ArrayRecord({k: f.app.Array(v) for k, v in probe.items()})
    nodes = sorted(node_ids((f"trial-{i}", f"trial-{i}") for i in range(3)).values())
    try:
        with _quiet("flwr"):  # its "Sampled 3 nodes" is about the trial, not the job
            plan = list(trial.configure_train(1, record, f.app.ConfigRecord(), site_grid(nodes)))
    except StrategyError as exc:
        raise StrategyError(f"strategy {name!r} cannot run in isthmus: {exc}") from exc
    except Exception as exc:  # its own code, on a model it was not written for
        log.debug("%s: configure_train refused the trial model (%s)", name, exc)
        return
    try:
        check_plan(plan, set(nodes), list(probe))
    except StrategyError as exc:
        raise StrategyError(f"strategy {name!r} cannot run in isthmus: {exc}") from exc


@contextlib.contextmanager
def _quiet(logger_name: str):
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def flower_class(name: str) -> type:
    """The Flower strategy ``flower:serverapp.ClassName`` names, or a StrategyError."""
    module = import_serverapp().strategies
    short = name.removeprefix(PREFIX)
    if short in UNSUPPORTED:
        raise StrategyError(f"strategy {name!r} cannot run in isthmus: {UNSUPPORTED[short]}")
    cls = getattr(module, short, None)
    if not (isinstance(cls, type) and issubclass(cls, module.Strategy)):
        known = sorted(n for n in module.__all__ if n not in UNSUPPORTED)
        raise StrategyError(f"strategy {name!r}: no such Flower strategy {known}")
    return cls


def is_message_strategy(cls: Any) -> bool:
    """Whether ``cls`` is a Message-API strategy class (without importing flwr if the
    class's own module did not)."""
    module = sys.modules.get("flwr.serverapp.strategy")
    return module is not None and isinstance(cls, type) and issubclass(cls, module.Strategy)


def load_serverapp_strategy(
    name: str, params: dict[str, Any], cls: type | None = None
) -> FlowerMessageStrategy:
    """``flower:serverapp.ClassName`` (or ``cls``, a class of the user's own) with the
    [strategy] table's other keys as constructor arguments."""
    import_serverapp()
    cls = cls if cls is not None else flower_class(name)
    return FlowerMessageStrategy(ServerAppConfig(name, dict(params)), cls)
