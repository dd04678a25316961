"""A Message-API strategy's state as tensors, for the coordinator's checkpoint, and back.

Flower's strategies keep their outer-optimiser state in plain attributes: ``m_t`` and ``v_t``
(dicts of arrays by name: FedAdam, FedYogi, FedAdagrad), ``momentum_vector`` (a list of arrays:
FedAvgM), and numbers. Each attribute of one of these kinds becomes tensors under a key that
says how to rebuild it:

- ``array.ATTR``: one numpy array;
- ``list.ATTR.I``: item ``I`` of a list or tuple of arrays;
- ``dict.ATTR.NAME``: a dict of arrays (``NAME`` may hold dots: attribute names do not);
- ``record.ATTR.NAME``: an ``ArrayRecord``;
- ``scalar.ATTR``: an int or float the strategy changed (int64 or float64).

``current_arrays`` is the strategy's copy of theta_r, given again every round by
``configure_train``, so it is not state. Attributes starting with ``_`` are left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from strategies.base import Tensors
from strategies.flower.compat import to_tensor
from strategies.flower.messages import import_serverapp

PER_ROUND = frozenset({"current_arrays"})
KINDS = ("array", "list", "dict", "record")


def kind_of(value: Any) -> str | None:
    """Which of ``KINDS`` an attribute's value is, or None if it is none of them."""
    if isinstance(value, np.ndarray):
        return "array"
    arrays = (np.ndarray, np.generic)
    if isinstance(value, list | tuple) and value and all(isinstance(a, arrays) for a in value):
        return "list"
    if isinstance(value, dict) and value and all(isinstance(a, arrays) for a in value.values()):
        return "dict" if all(isinstance(k, str) for k in value) else None
    if isinstance(value, import_serverapp().app.ArrayRecord):
        return "record"
    return None


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def state_of(obj: Any, scalars: set[str]) -> Tensors:
    """The attributes of ``obj`` that are state, as tensors (copies) under their keys."""
    state: Tensors = {}
    for attr, value in vars(obj).items():
        if attr in PER_ROUND or attr.startswith("_"):
            continue
        kind = kind_of(value)
        if kind == "array":
            state[f"array.{attr}"] = to_tensor(value).clone()
        elif kind == "list":
            for i, a in enumerate(value):
                state[f"list.{attr}.{i}"] = to_tensor(a).clone()
        elif kind == "dict":
            for name, a in value.items():
                state[f"dict.{attr}.{name}"] = to_tensor(a).clone()
        elif kind == "record":
            for name, a in value.items():
                state[f"record.{attr}.{name}"] = to_tensor(a.numpy()).clone()
    for attr in sorted(scalars):
        value = getattr(obj, attr)
        dtype = torch.int64 if isinstance(value, int) else torch.float64
        state[f"scalar.{attr}"] = torch.tensor(value, dtype=dtype)
    return state


def load_state(obj: Any, state: Mapping[str, torch.Tensor]) -> set[str]:
    """Set the attributes ``state_of`` saved; returns the names of the scalars among them."""
    app = import_serverapp().app
    groups: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    scalars = set()
    for key, t in state.items():
        kind, _, rest = key.partition(".")
        if kind == "array":
            setattr(obj, rest, t.numpy().copy())
        elif kind == "scalar":
            setattr(obj, rest, t.item())
            scalars.add(rest)
        elif kind in KINDS:
            attr, _, name = rest.partition(".")
            groups.setdefault((kind, attr), {})[name] = t.numpy().copy()
    for (kind, attr), items in groups.items():
        if kind == "list":
            value: Any = [items[i] for i in sorted(items, key=int)]
        elif kind == "dict":
            value = dict(items)
        else:
            value = app.ArrayRecord({n: app.Array(a) for n, a in items.items()})
        setattr(obj, attr, value)
    return scalars


def changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> tuple[set[str], set[str]]:
    """What one step changed that ``state_of`` does not already take: numeric attributes
    (checkpointed from now on), and attributes of any other type (which cannot be)."""
    missing = object()
    numbers, others = set(), set()
    for attr, value in after.items():
        old = before.get(attr, missing)
        if old is value or attr in PER_ROUND or attr.startswith("_"):
            continue
        if value is None or kind_of(value) is not None:
            continue
        if is_number(value):
            if old != value:
                numbers.add(attr)
        else:
            others.add(attr)
    return numbers, others
