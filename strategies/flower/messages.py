"""The Flower side of the Message-API adapter: importing ``flwr.serverapp``, the stand-in grid a
strategy's ``configure_train`` samples its nodes from, and the records of the exchange.

A Message-API strategy (``flwr.serverapp.strategy.Strategy``, Flower 1.21 and later) speaks in
``Message`` objects: ``configure_train`` returns one instruction per node it wants to train,
``aggregate_train`` takes their replies. Here every site whose update counts in the round is a
node with a stable id (from its update key), the instruction must go to every one of them and
carry the global model only, and each reply holds the site model ``theta_r - delta_i`` as an
``ArrayRecord`` and the site's weight (and its metrics) in a ``MetricRecord``. What a strategy
sends that isthmus sites cannot receive is refused by ``check_plan``, with the reason.
"""

from __future__ import annotations

import functools
import hashlib
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from strategies.base import StrategyError, Tensors
from strategies.flower.compat import flwr_imports, to_tensor

REPLY_METRICS = "metrics"  # the MetricRecord's name in a reply, as a Flower ClientApp names it
WEIGHT_KEY = "num-examples"  # Flower's default ``weighted_by_key``


@functools.cache
def import_serverapp() -> types.SimpleNamespace:
    """``flwr.app``, ``flwr.serverapp.strategy`` and ``Grid``, telemetry and the update check
    turned off; the process's task identity set as Flower's own server app sets it, since every
    ``Message`` a strategy builds reads it."""
    with flwr_imports():
        import flwr.app as app
        import flwr.serverapp.strategy as strategies
        from flwr.common.constant import SUPERLINK_NODE_ID
        from flwr.serverapp import Grid
        from flwr.supercore.task_identity import TaskIdentity
    for attr, value in (("run_id", 0), ("node_id", SUPERLINK_NODE_ID), ("task_id", 0)):
        try:
            getattr(TaskIdentity, attr)
        except RuntimeError:  # unset: this process is nobody else's task
            setattr(TaskIdentity, attr, value)
    return types.SimpleNamespace(app=app, strategies=strategies, Grid=Grid)


def node_ids(updates: Iterable[tuple[str, str]]) -> dict[str, int]:
    """A Flower node id for each ``(update key, site)``: 63 bits of the SHA-256 of the site's
    name, the same in every round and after restarts (a strategy may keep state per node). A
    site's second update in a round (two data units, shared-data mode) is named by its key."""
    out: dict[str, int] = {}
    seen: set[str] = set()
    for key, site in updates:
        name = key if site in seen else site
        seen.add(site)
        out[key] = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") >> 1
    if len(set(out.values())) != len(out):
        raise StrategyError(f"two updates map to one Flower node id: {sorted(out)}")
    return out


@functools.cache
def _grid_class() -> type:
    grid_base = import_serverapp().Grid

    def refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise StrategyError(
            "isthmus sites are not Flower nodes: a strategy's configure_train may read the "
            "grid's node ids, not send or receive through it"
        )

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def init(self, nodes: Sequence[int]) -> None:
        self.nodes = tuple(nodes)

    members = {m: refuse for m in ("set_run", "create_message", "push_messages")}
    members.update(pull_messages=refuse, send_and_receive=refuse, run=property(refuse))
    members.update(__init__=init, get_node_ids=get_node_ids)
    return type("SiteGrid", (grid_base,), members)


def site_grid(nodes: Sequence[int]):
    """A ``Grid`` whose nodes are the round's sites; anything but reading them is refused."""
    return _grid_class()(nodes)


def model_record(arrays: Mapping[str, torch.Tensor], names: Sequence[str]):
    """theta_r as the ``ArrayRecord`` ``configure_train`` is given (Flower copies the bytes)."""
    f = import_serverapp()
    return f.app.ArrayRecord({n: f.app.Array(arrays[n].numpy()) for n in names})


def check_plan(messages: Any, nodes: set[int], names: Sequence[str]) -> tuple[dict[int, Any], str]:
    """What ``configure_train`` returned, checked against what isthmus can carry out.

    Every site of the round trains from theta_r, so the instructions must be training messages,
    one per site, each carrying one ``ArrayRecord`` with exactly the model's arrays; a
    ``ConfigRecord`` is allowed (sites take their settings from their own training script).

    Returns
    -------
    tuple
        The instruction for each node id, and the name of the ``ArrayRecord`` replies use.

    Raises
    ------
    StrategyError
        What cannot map, and what to use instead.
    """
    f = import_serverapp()
    by_node: dict[int, Any] = {}
    record_keys = set()
    for m in messages:
        if not isinstance(m, f.app.Message):
            raise StrategyError(f"configure_train returned a {type(m).__name__}, not a Message")
        if m.metadata.message_type != f.app.MessageType.TRAIN:
            raise StrategyError(
                f"configure_train sends {m.metadata.message_type!r} messages; isthmus sites "
                "only train"
            )
        node = m.metadata.dst_node_id
        if node not in nodes or node in by_node:
            raise StrategyError(f"configure_train sends to node {node}, not one site of the round")
        by_node[node] = m
        record_keys.add(_model_record_key(m.content, names))
    if len(by_node) != len(nodes):
        raise StrategyError(
            f"configure_train sampled {len(by_node)} of the round's {len(nodes)} sites: client "
            "sampling cannot map, since every site of a round trains; choose the sites with "
            "rounds.min_sites and rounds.max_sites"
        )
    if len(record_keys) != 1:
        raise StrategyError(f"configure_train names the model differently: {sorted(record_keys)}")
    return by_node, record_keys.pop()


def _model_record_key(content: Any, names: Sequence[str]) -> str:
    arrays, metrics = dict(content.array_records), dict(content.metric_records)
    if metrics:
        raise StrategyError(
            f"configure_train sends a MetricRecord ({sorted(metrics)}) that isthmus sites "
            "cannot receive; sites get theta_r only (write an isthmus plugin strategy instead)"
        )
    if len(arrays) != 1 or set(next(iter(arrays.values())).keys()) != set(names):
        what = {k: len(v) for k, v in arrays.items()}
        raise StrategyError(
            f"configure_train sends ArrayRecords other than the global model ({what}); isthmus "
            "sites receive and send theta only (write an isthmus plugin strategy instead)"
        )
    return next(iter(arrays))


def common_metrics(metrics: Mapping[str, Mapping[str, float]], keys: Sequence[str]) -> list[dict]:
    """Each reply's metrics: only the names every site reported (a Flower strategy refuses
    replies whose MetricRecords differ in their keys), numbers only."""
    per_key = [dict(metrics.get(k, {})) for k in keys]
    shared = set.intersection(*(set(m) for m in per_key)) if per_key else set()
    return [
        {n: float(v) for n, v in sorted(m.items()) if n in shared and _number(v)} for m in per_key
    ]


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def site_reply(
    instruction: Any,
    record_key: str,
    arrays: Mapping[str, np.ndarray],
    weight_key: str,
    weight: float,
    metrics: Mapping[str, float],
):
    """A site's reply to its instruction: its model, its weight and its metrics."""
    app = import_serverapp().app
    record = app.ArrayRecord({n: app.Array(a) for n, a in arrays.items()})
    reported = app.MetricRecord({**metrics, weight_key: float(weight)})
    content = app.RecordDict({record_key: record, REPLY_METRICS: reported})
    return app.Message(content=content, reply_to=instruction)


def theta_from(result: Any, theta: Tensors, names: Sequence[str]) -> Tensors:
    """theta_{r+1}: the strategy's arrays cast back to theta's dtypes (float64 results of
    float32 inputs included), every other tensor of theta as it was."""
    if not isinstance(result, import_serverapp().app.ArrayRecord):
        raise StrategyError(f"aggregate_train returned a {type(result).__name__}, not arrays")
    if set(result.keys()) != set(names):
        missing, extra = sorted(set(names) - set(result)), sorted(set(result) - set(names))
        raise StrategyError(
            f"aggregate_train returned other arrays than the model's (missing {missing}, "
            f"unexpected {extra})"
        )
    out = dict(theta)
    for n in names:
        a = result[n].numpy()
        if tuple(a.shape) != tuple(theta[n].shape):
            raise StrategyError(f"aggregate_train returned {n!r} with shape {tuple(a.shape)}")
        out[n] = to_tensor(a).to(theta[n].dtype, copy=True)
    return out
