"""Reading one TOML table into a frozen dataclass, with errors that name the key.

Each component declares its settings once, as a dataclass next to the code it configures: the
field's type, its default and its check sit on the field, so nothing is written twice::

    @dataclass(frozen=True)
    class RoundsConfig:
        min_sites: int = setting(1, check=positive)
        total: int = setting(10, check=positive, required=True)

``load_table(RoundsConfig, data.get("rounds", {}), "rounds")`` then reads the table by the
dataclass's fields and type annotations: ``int``, ``float`` (an integer is accepted), ``str``,
``bool``, ``Path`` (a string, taken relative to ``base_dir``), ``dict``, ``list`` and
``X | None``. Unknown keys are refused, since a typo must not silently fall back to a default,
and every error is one line that starts with the key (``rounds.inner_steps: must be > 0, got
0``). Rules that span fields go in the dataclass's ``check()`` method, which the loader calls.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
Check = Callable[[Any], "str | None"]
"""A rule on one value: None if it holds, else the problem (``"must be > 0"``)."""

_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "a boolean",
    Path: "a string",
}


class ConfigError(ValueError):
    """A job config that cannot run; the message names the key."""


def setting(
    default: Any = dataclasses.MISSING,
    *,
    factory: Callable[[], Any] | None = None,
    check: Check | Sequence[Check] | None = None,
    required: bool = False,
    rest: bool = False,
    help: str = "",
) -> Any:
    """A dataclass field that carries its config rules.

    Parameters
    ----------
    default, factory
        The default (or a function making it, for a ``dict`` or ``list``). Without either the
        key is required.
    check
        Rule(s) on the value read from TOML, in order; a ``Path`` field's rule sees the string.
    required
        Required in TOML even though the dataclass has a default for code that builds it
        directly (``RoundsConfig.total``).
    rest
        This ``dict`` field collects the table's keys that are not fields, instead of their
        being refused: a free-form table such as ``[strategy]``.
    help
        What the key means, in a sentence or two: kept in the field's metadata, where the
        configuration reference (``coordinator.config_reference``) reads it.
    """
    meta = {"check": check, "required": required, "rest": rest, "help": help}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def load_table(cls: type[T], data: Any, path: str, base_dir: Path | None = None) -> T:
    """Read the TOML table ``data`` (at key ``path``) into the dataclass ``cls``.

    Fields are read in declaration order; absent ones take the dataclass's default (a relative
    ``Path`` default is taken from ``base_dir`` too). Then unknown keys are refused, ``cls``
    is built (a ``ValueError`` from its ``__post_init__`` becomes a ``ConfigError``), and its
    ``check()`` method, if it has one, is called.

    Raises
    ------
    ConfigError
        The first problem found, naming its key.
    """
    table = as_table(data, path)
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    known: set[str] = set()
    rest = None
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.metadata.get("rest"):
            rest = f.name
            continue
        key, kind = join(path, f.name), field_kind(hints[f.name])
        known.add(f.name)
        if f.name in table:
            values[f.name] = read_value(table[f.name], kind, key, f.metadata.get("check"))
        elif f.metadata.get("required") or (
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ):
            raise ConfigError(f"{key}: missing (required)")
        elif kind is Path and isinstance(f.default, Path):
            values[f.name] = f.default
        if kind is Path and base_dir is not None and isinstance(values.get(f.name), Path):
            values[f.name] = base_dir / values[f.name]
    extra = {k: v for k, v in table.items() if k not in known}
    if rest is not None:
        values[rest] = extra
    elif extra:
        raise ConfigError(f"{join(path, sorted(extra)[0])}: unknown key")
    try:
        obj = cls(**values)
    except ConfigError:
        raise
    except ValueError as exc:  # the dataclass's own __post_init__ checks
        raise ConfigError(str(exc)) from None
    check = getattr(obj, "check", None)
    if callable(check):
        check()
    return obj


def read_value(value: Any, kind: type, key: str, check: Check | Sequence[Check] | None) -> Any:
    """``value`` from TOML as a ``kind``: an integer becomes a float where a number is wanted,
    a string a ``Path``; a value of another type, or one failing ``check``, is refused."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and kind is not bool:
        raise ConfigError(f"{key}: expected {kind_name(kind)}, got a boolean")
    if not isinstance(value, str if kind is Path else kind):
        raise ConfigError(
            f"{key}: expected {kind_name(kind)}, got {type(value).__name__} {value!r}"
        )
    run_checks(value, check, key, ConfigError)
    return Path(value) if kind is Path else value


def run_checks(
    value: Any, check: Check | Sequence[Check] | None, key: str, error: type[Exception]
) -> None:
    """Raise ``error("key: problem, got value")`` for the first rule ``value`` breaks."""
    checks = () if check is None else (check,) if callable(check) else check
    for rule in checks:
        problem = rule(value)
        if problem:
            raise error(f"{key}: {problem}, got {value!r}")


def check_fields(obj: Any, path: str, error: type[Exception] = ConfigError) -> None:
    """Run each field's rules on a dataclass built in code rather than read from TOML.

    For classes such as ``RobustAggregator`` that take their settings as arguments: the same
    rules, and the same messages, as a config file gets.
    """
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, Path):
            value = str(value)
        if value is not None:
            run_checks(value, f.metadata.get("check"), join(path, f.name), error)


def field_kind(hint: Any) -> type:
    """The type a field holds in TOML: ``float | None`` -> float, ``dict[str, Any]`` -> dict."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(kinds) != 1:
            raise TypeError(f"unsupported config annotation {hint!r}: one type or X | None")
        hint = kinds[0]
    kind = typing.get_origin(hint) or hint
    if kind not in (int, float, str, bool, Path, dict, list):
        raise TypeError(f"unsupported config annotation {hint!r}")
    return kind


def as_table(data: Any, path: str) -> dict[str, Any]:
    """``data`` if it is a TOML table, else a ``ConfigError`` naming ``path``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table, got {type(data).__name__}")
    return data


def join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def kind_name(kind: type) -> str:
    return _NAMES.get(kind, kind.__name__)


# ---- rules ---------------------------------------------------------------------------------


def rule(holds: Callable[[Any], bool], problem: str) -> Check:
    """A check from a predicate and the problem to report when it is false (also what
    ``describe_check`` says of it)."""

    def check(v: Any) -> str | None:
        return None if holds(v) else problem

    check.__doc__ = problem
    return check


def describe_check(check: Check | Sequence[Check] | None) -> str:
    """What a field's rules require, for the configuration reference: each rule's docstring
    (its first paragraph; ``rule`` makes it the problem the rule reports), joined by ``; ``;
    empty without rules."""
    checks = () if check is None else (check,) if callable(check) else check
    said = (" ".join((c.__doc__ or "").strip().split("\n\n")[0].split()) for c in checks)
    return "; ".join(text for text in said if text)


def one_of(choices: Sequence[Any]) -> Check:
    return rule(lambda v: v in choices, f"must be one of {tuple(choices)}")


def positive(v: float) -> str | None:
    """must be > 0"""
    return None if v > 0 else "must be > 0"


def non_empty(v: str) -> str | None:
    """must not be empty"""
    return None if v.strip() else "must not be empty"


def non_negative(v: float) -> str | None:
    """must be a finite number >= 0"""
    return None if v >= 0 and v != float("inf") else "must be a finite number >= 0 (0 = off)"


def check_listen(v: str) -> str | None:
    """expected 'HOST:PORT'"""
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        return "expected 'HOST:PORT' (e.g. '0.0.0.0:7070')"
    return None
