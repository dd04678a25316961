"""Reading one TOML table into typed values, with errors that name the key."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A job config that cannot run; the message names the key."""


class Table:
    """Reads typed keys out of one TOML table and remembers which keys were used."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a table, got {type(data).__name__}")
        self.data = data
        self.path = path
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = ..., check=None) -> Any:
        self.used.add(name)
        if name not in self.data:
            if default is ...:
                raise ConfigError(f"{self.key(name)}: missing (required)")
            return default
        value = self.data[name]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and bool not in kinds:
            raise ConfigError(f"{self.key(name)}: expected {kind_name(kinds)}, got a boolean")
        if not isinstance(value, kinds):
            raise ConfigError(
                f"{self.key(name)}: expected {kind_name(kinds)}, got {type(value).__name__} "
                f"{value!r}"
            )
        if check is not None:
            problem = check(value)
            if problem:
                raise ConfigError(f"{self.key(name)}: {problem}, got {value!r}")
        return value

    def table(self, name: str) -> Table:
        self.used.add(name)
        return Table(self.data.get(name, {}), self.key(name))

    def reject_unknown(self, allow_extra: bool = False) -> None:
        if allow_extra:
            return
        unknown = sorted(set(self.data) - self.used)
        if unknown:
            raise ConfigError(f"{self.key(unknown[0])}: unknown key")


def kind_name(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def positive(v: float) -> str | None:
    return None if v > 0 else "must be > 0"


def non_empty(v: str) -> str | None:
    return None if v.strip() else "must not be empty"


def non_negative(v: float) -> str | None:
    return None if v >= 0 and v != float("inf") else "must be a finite number >= 0 (0 = off)"


def check_listen(v: str) -> str | None:
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        return "expected 'HOST:PORT' (e.g. '0.0.0.0:7070')"
    return None
