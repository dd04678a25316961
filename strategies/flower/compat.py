"""The Flower side of the adapter: importing flwr, checking a [strategy] table against a
Flower constructor, and the stand-ins Flower's ``aggregate_fit`` expects.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from strategies.base import StrategyError

# Client sampling and evaluation belong to isthmus (rounds.min_sites, the training script).
NOT_FROM_CONFIG = {
    "fraction_fit": "rounds.min_sites / rounds.max_sites choose the sites",
    "fraction_evaluate": "isthmus does not run Flower's federated evaluation",
    "min_fit_clients": "use rounds.min_sites",
    "min_evaluate_clients": "isthmus does not run Flower's federated evaluation",
    "min_available_clients": "use rounds.min_sites",
    "accept_failures": "isthmus never passes failures to aggregate_fit",
    "initial_parameters": "isthmus gives the strategy theta_r every round",
}
UNSUPPORTED = {
    "FedXgbBagging": "it exchanges XGBoost trees, not tensors",
    "FedXgbCyclic": "it exchanges XGBoost trees, not tensors",
    "FedXgbNnAvg": "it exchanges XGBoost trees, not tensors",
    "FedAvgAndroid": "it reads its own byte format; use 'flower:FedAvg'",
    "Strategy": "it is the abstract base class",
}


@contextlib.contextmanager
def flwr_imports():
    """Around importing flwr: telemetry and the update check turned off, the warnings its CLI
    dependencies raise on import silenced, a missing flwr said as what to install, and its
    logger at WARNING once imported."""
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
    os.environ["FLWR_DISABLE_UPDATE_CHECK"] = "1"
    try:
        with warnings.catch_warnings():  # flwr's CLI dependencies warn about click on import
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    except ImportError as exc:
        raise StrategyError(
            f"Flower strategies need flwr 1.42: pip install 'isthmus[flower]' ({exc})"
        ) from exc
    # flwr logs every round's sampling and aggregation at INFO through a console handler of its
    # own, past isthmus's log handler: a library's INFO, kept out like any other's.
    logging.getLogger("flwr").setLevel(logging.WARNING)


def import_flower():
    """``(flwr.common, flwr.server.strategy)`` (see ``flwr_imports``)."""
    with flwr_imports():
        import flwr.common as common
        import flwr.server.strategy as strategies
    return common, strategies


def check_kwargs(
    name: str,
    cls: type,
    params: dict[str, Any],
    refused: Mapping[str, str] = NOT_FROM_CONFIG,
    filled: frozenset[str] = frozenset({"initial_parameters"}),
) -> dict[str, Any]:
    """The [strategy] table's keys as keyword arguments of ``cls``: every key a parameter
    (unless ``cls`` takes ``**kwargs``) of a type TOML can give, none of ``refused`` (which say
    what to use instead), and every required parameter given but those the adapter ``filled``."""
    sig = inspect.signature(cls.__init__)
    takes_extra = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    kwargs = {}
    for key, value in params.items():
        if key in refused:
            raise StrategyError(f"strategy.{key}: not used with {name!r}: {refused[key]}")
        p = sig.parameters.get(key)
        if p is not None and takes_object(p):
            raise StrategyError(
                f"strategy.{key}: {name!r} takes a Python object here ({p.annotation}), which "
                "a job config cannot give; write a plugin strategy instead"
            )
        if p is None or p.kind is p.VAR_KEYWORD:
            if takes_extra:
                kwargs[key] = value
                continue
            known = sorted(
                k
                for k, q in sig.parameters.items()
                if k != "self" and k not in refused and not takes_object(q)
            )
            raise StrategyError(f"strategy.{key}: not a parameter of {name!r} (known: {known})")
        want = p.annotation
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        simple = want in (float, int, bool, str)
        if simple and (type(value) is not want):
            raise StrategyError(
                f"strategy.{key}: expected {want.__name__}, got {type(value).__name__} {value!r}"
            )
        kwargs[key] = value
    for key, p in sig.parameters.items():
        named = p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and key != "self"
        if named and p.default is p.empty and key not in kwargs and key not in filled:
            raise StrategyError(
                f"strategy {name!r} cannot run from a job config: it requires {key!r} "
                f"({p.annotation})"
            )
    return kwargs


def takes_object(p: inspect.Parameter) -> bool:
    """Callables and strategy objects cannot come from TOML."""
    return "Callable" in str(p.annotation) or "Strategy" in str(p.annotation)


def mean_metrics(items: list[tuple[int, dict]]) -> dict[str, float]:
    """Example-weighted mean of the sites' numeric metrics (``train_loss``): what Flower asks
    of a ``fit_metrics_aggregation_fn``, given so that it does not warn every job."""
    total = sum(n for n, _ in items) or 1
    keys = {k for _, m in items for k, v in m.items() if isinstance(v, int | float)}
    return {k: sum(n * m[k] for n, m in items if k in m) / total for k in sorted(keys)}


def to_tensor(a) -> torch.Tensor:
    # asarray, not ascontiguousarray: that one turns 0-d arrays (and numpy scalars, which
    # np.median returns for 0-d layers) into shape (1,).
    return torch.from_numpy(np.asarray(a, order="C"))


def is_arrays(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(isinstance(a, np.ndarray | np.generic) for a in value)
    )


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def integer_weights(weights: list[float]) -> list[int]:
    if all(float(w).is_integer() and w >= 1 for w in weights):
        return [int(w) for w in weights]
    factor = 1e6 / min(weights)
    return [max(1, round(w * factor)) for w in weights]


_PROXY_CLASS: type | None = None


def site_proxy(site: str):
    """A stand-in ClientProxy: Flower's aggregate_fit only carries it along."""
    global _PROXY_CLASS
    if _PROXY_CLASS is None:
        from flwr.server.client_proxy import ClientProxy

        def unused(self, *args, **kwargs):
            raise NotImplementedError("isthmus sites are not Flower clients")

        _PROXY_CLASS = type(
            "SiteProxy",
            (ClientProxy,),
            {
                m: unused
                for m in ("get_properties", "get_parameters", "fit", "evaluate", "reconnect")
            },
        )
    return _PROXY_CLASS(site)
