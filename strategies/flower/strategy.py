"""Run a Flower strategy (``flwr.server.strategy``, Flower 1.42) as the outer step.

``name = "flower:FedAdam"`` in ``[strategy]``; every other key is a keyword argument of the
Flower class (``eta = 0.01``). At round close the adapter turns each site's pseudo-gradient
into the site model Flower expects, ``theta_i = theta_r - delta_i``, one numpy array per
floating-point tensor in sorted-name order, wraps them as ``FitRes`` and calls
``aggregate_fit(server_round, results, failures=[])``; the arrays it returns are theta_{r+1}.

Flower's pitfalls, handled here:

- integer buffers (step counters, ``num_batches_tracked``) never reach Flower: its in-place
  average would cast the scaling factors to int and zero them; they pass through unchanged;
- results come back as float64 where Flower mixes in numpy float64 scalars (FedAdam): they are
  cast back to each tensor's dtype; bfloat16 and float16 tensors are upcast to float32 for
  Flower (numpy has no bfloat16) and cast back;
- strategies that keep their own copy of the global model get theta_r before every round:
  ``current_weights`` (FedAdam, FedYogi, FedAdagrad), ``initial_parameters`` (FedAvgM with
  server momentum or rate), ``pre_weights`` (QFedAvg); QFedAvg's loss comes from the sites'
  reported train loss (1.0 when none reported); Bulyan gets ``to_keep = 0`` for its Krum step;
- ``num_examples`` must be an int: fractional weights are scaled to integers (rel. error 1e-6).

State: after every step the adapter saves the Flower object's numpy state (``m_t``, ``v_t``,
``momentum_vector``...) and numeric attributes that changed, in their own dtype, so a restarted
coordinator continues exactly; it logs a warning naming any attribute of another type that
changed, since that one is not checkpointed. A failed step restores the attributes it had.
flwr is imported only here, with its telemetry and update check turned off.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from strategies.base import Aggregate, Strategy, StrategyError, Tensors, float32_bytes
from strategies.flower.compat import (
    UNSUPPORTED,
    check_kwargs,
    compute_dtype,
    import_flower,
    integer_weights,
    is_arrays,
    mean_metrics,
    site_proxy,
    to_tensor,
)

log = logging.getLogger("isthmus.strategy.flower")
PREFIX = "flower:"
PER_ROUND = {"current_weights", "initial_parameters", "pre_weights"}


@dataclass(frozen=True)
class FlowerConfig:
    """The Flower class name and the keyword arguments given to its constructor."""

    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)


class FlowerStrategy(Strategy):
    """A Flower strategy's ``aggregate_fit`` as the outer step (see the module docstring)."""

    Config = FlowerConfig
    needs_updates = True

    def __init__(self, config: FlowerConfig) -> None:
        super().__init__(config)
        self.common, module = import_flower()
        if config.name in UNSUPPORTED:
            raise StrategyError(
                f"strategy 'flower:{config.name}' cannot run in isthmus: {UNSUPPORTED[config.name]}"
            )
        cls = getattr(module, config.name, None)
        if not (isinstance(cls, type) and hasattr(cls, "aggregate_fit")):
            known = sorted(n for n in getattr(module, "__all__", []) if n != "Strategy")
            raise StrategyError(f"strategy 'flower:{config.name}': no such Flower strategy {known}")
        kwargs = check_kwargs(f"flower:{config.name}", cls, config.kwargs)
        params = inspect.signature(cls.__init__).parameters
        if "initial_parameters" in params:  # replaced by theta_r before every round
            kwargs["initial_parameters"] = self.common.ndarrays_to_parameters([])
        if "evaluate_fn" in params:  # only QFedAvg calls it: it weighs updates by the loss
            kwargs["evaluate_fn"] = lambda rnd, arrays, cfg: (self._loss, {})
        if "fit_metrics_aggregation_fn" in params:
            kwargs["fit_metrics_aggregation_fn"] = mean_metrics
        if config.name == "Bulyan":
            kwargs.setdefault("to_keep", 0)
        try:
            self.flower = cls(**kwargs)
        except Exception as exc:
            raise StrategyError(
                f"strategy 'flower:{config.name}': {type(exc).__name__}: {exc}"
            ) from exc
        self.steps = 0
        self._loss = 1.0
        self._warned: set[str] = set()
        self._scalars: set[str] = set()  # numeric attributes aggregate_fit changed

    @property
    def plugin_name(self) -> str:
        return f"{PREFIX}{self.config.name}"

    def describe(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in sorted(self.config.kwargs.items()))
        return f"{self.plugin_name}({args})"

    def buffer_bytes(self, n_updates: int, like: Tensors) -> int:
        # Serialised FitRes parameters, Flower's deserialised copy and its weighted copy.
        return 3 * n_updates * float32_bytes(like)

    # ---- the step -------------------------------------------------------------------------

    def outer_step(self, theta: Tensors, aggregate: Aggregate) -> Tensors:
        if not aggregate.updates:
            raise StrategyError(f"{self.plugin_name} needs the individual updates")
        common = self.common
        names = sorted(aggregate.mean_delta)
        base = {n: theta[n].to(compute_dtype(theta[n].dtype)) for n in names}
        base_arrays = [base[n].numpy() for n in names]
        counts = integer_weights([u.weight for u in aggregate.updates])
        results = []
        for update, count in zip(aggregate.updates, counts, strict=True):
            delta = update.tensors()
            arrays = [(base[n] - delta[n].to(base[n].dtype)).numpy() for n in names]
            metrics = dict(aggregate.metrics.get(update.site, {}))
            fit = common.FitRes(
                status=common.Status(code=common.Code.OK, message=""),
                parameters=common.ndarrays_to_parameters(arrays),
                num_examples=count,
                metrics=metrics,
            )
            results.append((site_proxy(update.key), fit))
        losses = [m["train_loss"] for m in aggregate.metrics.values() if "train_loss" in m]
        self._loss = float(np.mean(losses)) if losses else 1.0
        before = dict(vars(self.flower))
        self._give_theta(base_arrays)
        try:
            params, _ = self.flower.aggregate_fit(self.steps + 1, results, [])
            if params is None:
                raise StrategyError("aggregate_fit returned no parameters")
            arrays = common.parameters_to_ndarrays(params)
            if len(arrays) != len(names):
                raise StrategyError(f"aggregate_fit returned {len(arrays)} arrays for {names}")
            out = dict(theta)
            for n, a in zip(names, arrays, strict=True):
                if tuple(a.shape) != tuple(theta[n].shape):
                    raise StrategyError(f"aggregate_fit returned {n!r} with shape {a.shape}")
                out[n] = to_tensor(a).to(theta[n].dtype, copy=True)
        except BaseException:
            vars(self.flower).clear()
            vars(self.flower).update(before)
            raise
        self._note_uncaptured(before)
        self.steps += 1
        return out

    def _give_theta(self, arrays: list[np.ndarray]) -> None:
        f = self.flower
        if hasattr(f, "current_weights"):
            f.current_weights = [a.copy() for a in arrays]
        if getattr(f, "server_opt", False):
            f.initial_parameters = self.common.ndarrays_to_parameters(arrays)
        if hasattr(f, "pre_weights"):
            f.pre_weights = [a.copy() for a in arrays]

    # ---- state ----------------------------------------------------------------------------

    def _captured(self) -> dict[str, Any]:
        out = {}
        for key, value in vars(self.flower).items():
            if key in PER_ROUND or key.startswith("_"):
                continue
            if is_arrays(value) or isinstance(value, np.ndarray):
                out[key] = value
        return out

    def _note_uncaptured(self, before: dict[str, Any]) -> None:
        missing = object()
        for key, value in vars(self.flower).items():
            old = before.get(key, missing)
            if old is value or key in PER_ROUND or is_arrays(value):
                continue
            if isinstance(value, np.ndarray):
                continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                if old != value:
                    self._scalars.add(key)
                continue
            if key in self._warned:
                continue
            self._warned.add(key)
            log.warning(
                "%s keeps state in %r (a %s) that isthmus cannot checkpoint: after a "
                "coordinator restart it starts again from its initial value",
                self.plugin_name,
                key,
                type(value).__name__,
            )

    def state_dict(self) -> Tensors:
        state = {"steps": torch.tensor(self.steps, dtype=torch.int64)}
        for key, value in self._captured().items():
            if isinstance(value, np.ndarray):
                state[f"array.{key}"] = to_tensor(value).clone()
            else:
                for i, a in enumerate(value):
                    state[f"list.{key}.{i}"] = to_tensor(a).clone()
        for key in sorted(self._scalars):
            value = getattr(self.flower, key)
            dtype = torch.int64 if isinstance(value, int) else torch.float64
            state[f"scalar.{key}"] = torch.tensor(value, dtype=dtype)
        return state

    def load_state_dict(self, state: Tensors) -> None:
        self.steps = int(state["steps"]) if "steps" in state else 0
        lists: dict[str, dict[int, np.ndarray]] = {}
        for key, t in state.items():
            kind, _, rest = key.partition(".")
            if kind == "array":
                setattr(self.flower, rest, t.numpy().copy())
            elif kind == "list":
                attr, _, index = rest.rpartition(".")
                lists.setdefault(attr, {})[int(index)] = t.numpy().copy()
            elif kind == "scalar":
                setattr(self.flower, rest, t.item())
                self._scalars.add(rest)
        for attr, items in lists.items():
            setattr(self.flower, attr, [items[i] for i in sorted(items)])


def load_flower_strategy(name: str, params: dict[str, Any]) -> FlowerStrategy:
    """``flower:ClassName`` with the [strategy] table's other keys as constructor arguments."""
    return FlowerStrategy(FlowerConfig(name.removeprefix(PREFIX), dict(params)))
