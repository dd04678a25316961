"""Flower Message-API strategies of a user's own, named ``flower_plugins:Class`` in tests: one
that runs in isthmus, and one for each thing the adapter must refuse at start."""

from __future__ import annotations

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp.strategy import FedAvg


class HalfwayAvg(FedAvg):
    """FedAvg that moves only ``step`` of the way from the global model to the average."""

    def __init__(self, step: float = 0.5, **kwargs) -> None:
        super().__init__(**kwargs)
        self.step = step
        self.start: ArrayRecord | None = None

    def configure_train(self, server_round, arrays, config, grid):
        self.start = arrays.copy()
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        avg, metrics = super().aggregate_train(server_round, replies)
        out = {
            k: Array(np.asarray(a.numpy() + self.step * (avg[k].numpy() - a.numpy())))
            for k, a in self.start.items()
        }
        return ArrayRecord(out), metrics


class FirstNodeOnly(FedAvg):
    """Samples one node, whatever the round holds."""

    def configure_train(self, server_round, arrays, config, grid):
        return list(super().configure_train(server_round, arrays, config, grid))[:1]


class SendsMetrics(FedAvg):
    """Sends the nodes a MetricRecord beside the model."""

    def configure_train(self, server_round, arrays, config, grid):
        msgs = []
        for node in grid.get_node_ids():
            content = RecordDict(
                {"arrays": arrays, "config": config, "hint": MetricRecord({"lr": 0.1})}
            )
            msgs.append(Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN))
        return msgs


class SendsControlVariates(FedAvg):
    """SCAFFOLD-like: a second ArrayRecord (the server's control variate) for every node."""

    def configure_train(self, server_round, arrays, config, grid):
        c = ArrayRecord({k: Array(np.zeros_like(a.numpy())) for k, a in arrays.items()})
        return [
            Message(
                content=RecordDict({"arrays": arrays, "c": c, "config": ConfigRecord()}),
                dst_node_id=node,
                message_type=MessageType.TRAIN,
            )
            for node in grid.get_node_ids()
        ]


class EvaluatesInstead(FedAvg):
    """Sends evaluation messages from configure_train."""

    def configure_train(self, server_round, arrays, config, grid):
        return self.configure_evaluate(server_round, arrays, config, grid)


class UsesTheGrid(FedAvg):
    """Talks to the nodes itself."""

    def configure_train(self, server_round, arrays, config, grid):
        grid.send_and_receive([], timeout=1.0)
        return []
