"""``--set TABLE.KEY=VALUE``: changing a job.toml key from the command line.

An override goes into the parsed document before any check, so it is validated exactly as the
same key written in the file (a typo is an unknown key; a wrong type names the key) and a
relative path in it is taken from the config file's folder, like the file's own. ``VALUE`` is a
TOML value (``3``, ``0.5``, ``true``, ``"text"``, ``[1, 2]``, ``{ codec = "int8" }``); anything
that does not parse as one is taken as a string, so ``--set job.name=trial-2`` works unquoted.
Sites are handed the config with the overrides in it.
"""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Sequence
from typing import Any

from wire.config_table import ConfigError


def parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    """``"rounds.total=3"`` -> ``(("rounds", "total"), 3)``."""
    key, sep, raw = text.partition("=")
    path = tuple(part.strip() for part in key.split("."))
    if not sep or len(path) < 2 or not all(path):
        raise ConfigError(f"--set {text}: expected TABLE.KEY=VALUE (e.g. rounds.total=10)")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word: a string
    return path, value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of the parsed document ``data`` with every override set, in order."""
    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        table = out
        for depth, part in enumerate(path[:-1]):
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                where = ".".join(path[: depth + 1])
                raise ConfigError(f"--set {text}: {where} is not a table")
        table[path[-1]] = value
    return out
