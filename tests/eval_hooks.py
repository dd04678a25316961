"""Evaluation hooks the tests name in ``[evaluation] fn`` (``eval_hooks:function``)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

CALLS: list[tuple[int, dict[str, torch.Tensor], str]] = []  # in-process tests read these
GATE = threading.Event()
STARTED = threading.Event()  # set once ``gated`` is running


def weight_norm(model: torch.nn.Module, round: int) -> dict[str, float]:
    """Metrics that are a function of theta alone: the norms of the model's float tensors."""
    sd = model.state_dict()
    return {
        "weight_norm": float(torch.linalg.vector_norm(sd["lin.weight"], dtype=torch.float64)),
        "bias_sum": float(sd["lin.bias"].double().sum()),
    }


def recording(model: torch.nn.Module, round: int) -> dict[str, float]:
    """Keeps a copy of what it was given and on which thread; then wrecks its module."""
    CALLS.append(
        (
            round,
            {k: v.clone() for k, v in model.state_dict().items()},
            threading.current_thread().name,
        )
    )
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # the module is the hook's own: theta must not change
    return {"round": round, "zero_dim": torch.tensor(0.5), "as_int": 3}


def gated(model: torch.nn.Module, round: int) -> dict[str, float]:
    """Waits for the gate (``GATE`` in-process, the file ``$ISTHMUS_TEST_GATE`` across
    processes), at most 60 s, then answers like ``weight_norm``."""
    STARTED.set()
    gate = os.environ.get("ISTHMUS_TEST_GATE")
    deadline = time.monotonic() + 60
    while not (GATE.is_set() or (gate and Path(gate).exists())):
        if time.monotonic() > deadline:
            raise TimeoutError("the test never opened the gate")
        time.sleep(0.02)
    return weight_norm(model, round)


def broken(model: torch.nn.Module, round: int) -> dict[str, float]:
    if round >= 2:
        raise ValueError(f"no validation data for round {round}")
    return weight_norm(model, round)


def not_metrics(model: torch.nn.Module, round: int):
    return "all good"


def nan_metric(model: torch.nn.Module, round: int):
    return {"val_loss": float("nan")}


NOT_A_FUNCTION = 42
