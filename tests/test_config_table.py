"""The generic TOML-table loader (wire/config_table.py), on a dataclass of its own."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from wire.config_table import (
    ConfigError,
    check_fields,
    load_table,
    non_empty,
    one_of,
    positive,
    rule,
    setting,
)


@dataclass(frozen=True)
class Sample:
    count: int = setting(check=positive)  # no default: required
    ratio: float = setting(0.5, check=rule(lambda v: v < 1, "must be < 1"))
    label: str = setting("a", check=(non_empty, one_of(("a", "b", "  "))))
    on: bool = False
    where: Path = Path("out")
    extra: dict[str, Any] = setting(factory=dict)
    items: list[int] = setting(factory=list)
    limit: float | None = setting(None, check=positive)
    steps: int = setting(7, required=True)

    def check(self) -> None:
        if self.on and self.limit is None:
            raise ConfigError("t.limit: needed when t.on is true")


@dataclass(frozen=True)
class Free:
    name: str = "x"
    rest: dict[str, Any] = setting(factory=dict, rest=True)


@dataclass(frozen=True)
class SelfChecking:
    n: int = 1

    def __post_init__(self) -> None:
        if self.n > 9:
            raise ValueError(f"t.n must be <= 9, got {self.n}")


def _load(base: Path | None = None, **table: Any) -> Sample:
    return load_table(Sample, {"count": 1, "steps": 2, **table}, "t", base)


def test_each_field_kind_is_read(tmp_path: Path):
    s = _load(
        tmp_path,
        ratio=0,
        label="b",
        on=True,
        where="sub/f.bin",
        extra={"k": [1]},
        items=[3, 4],
        limit=2,
    )
    assert (s.count, s.steps, s.label, s.on, s.extra, s.items) == (
        1,
        2,
        "b",
        True,
        {"k": [1]},
        [3, 4],
    )
    assert s.ratio == 0.0 and isinstance(s.ratio, float)
    assert s.limit == 2.0 and isinstance(s.limit, float)
    assert s.where == tmp_path / "sub" / "f.bin"


def test_defaults_come_from_the_dataclass(tmp_path: Path):
    s = _load(tmp_path)
    assert (s.ratio, s.label, s.on, s.extra, s.items, s.limit) == (0.5, "a", False, {}, [], None)
    assert s.where == tmp_path / "out"  # a relative Path default is taken from base_dir too
    assert _load().where == Path("out")
    assert _load(tmp_path, where="/abs/f").where == Path("/abs/f")


def test_unknown_key_is_refused():
    with pytest.raises(ConfigError, match=r"^t\.cuont: unknown key$"):
        _load(cuont=1)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"count": "1"}, "t.count: expected an integer, got str '1'"),
        ({"count": 1.0}, "t.count: expected an integer, got float 1.0"),
        ({"count": True}, "t.count: expected an integer, got a boolean"),
        ({"ratio": False}, "t.ratio: expected a number, got a boolean"),
        ({"on": 1}, "t.on: expected a boolean, got int 1"),
        ({"where": 3}, "t.where: expected a string, got int 3"),
        ({"extra": []}, "t.extra: expected dict, got list []"),
        ({"items": {}}, "t.items: expected list, got dict {}"),
        ({"limit": "2"}, "t.limit: expected a number, got str '2'"),
    ],
)
def test_wrong_type_names_the_key(table, message):
    with pytest.raises(ConfigError) as info:
        _load(**table)
    assert str(info.value) == message


def test_missing_required_keys():
    with pytest.raises(ConfigError, match=r"^t\.count: missing \(required\)$"):
        load_table(Sample, {"steps": 1}, "t")
    # a default for code that builds it, but a config file must say it
    with pytest.raises(ConfigError, match=r"^t\.steps: missing \(required\)$"):
        load_table(Sample, {"count": 1}, "t")
    assert Sample(count=1).steps == 7


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"count": 0}, "t.count: must be > 0, got 0"),
        ({"ratio": 1}, "t.ratio: must be < 1, got 1.0"),
        ({"label": " "}, "t.label: must not be empty, got ' '"),  # the first failing rule
        ({"label": "c"}, "t.label: must be one of ('a', 'b', '  '), got 'c'"),
        ({"limit": -1.5}, "t.limit: must be > 0, got -1.5"),
        ({"on": True}, "t.limit: needed when t.on is true"),  # check(), after the fields
    ],
)
def test_failing_check_names_the_key(table, message):
    with pytest.raises(ConfigError) as info:
        _load(**table)
    assert str(info.value) == message


def test_not_a_table():
    with pytest.raises(ConfigError, match=r"^t: expected a table, got list$"):
        load_table(Sample, [1], "t")


def test_rest_field_collects_the_other_keys():
    assert load_table(Free, {"name": "n", "lr": 0.1, "rest": 1}, "s") == Free(
        "n", {"lr": 0.1, "rest": 1}
    )
    assert load_table(Free, {}, "s").rest == {}


def test_post_init_errors_become_config_errors():
    assert load_table(SelfChecking, {"n": 3}, "t").n == 3
    with pytest.raises(ConfigError, match=r"^t\.n must be <= 9, got 10$"):
        load_table(SelfChecking, {"n": 10}, "t")


def test_check_fields_applies_the_rules_to_code_built_values():
    check_fields(Sample(count=3, limit=None), "t")
    with pytest.raises(RuntimeError, match=r"^t\.count: must be > 0, got 0$"):
        check_fields(Sample(count=0), "t", RuntimeError)


def test_unsupported_annotation_is_a_programming_error():
    @dataclass(frozen=True)
    class Odd:
        pair: tuple[int, int] = (1, 2)

    with pytest.raises(TypeError, match="unsupported config annotation"):
        load_table(Odd, {}, "t")
