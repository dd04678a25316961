"""The configuration reference: every ``job.toml`` key, read from the config dataclasses.

Each table's dataclass holds its keys' types, defaults, checks and help text
(``wire.config_table.setting``), so this page is built from them and no default is written
twice. ``python -m coordinator.config_reference`` prints the page as Markdown; the docs site
builds it the same way (``docs/hooks.py``), and ``tests/test_docs.py`` checks that every field
of every table listed here has help text and that every table the loader reads is listed.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.config import DataConfig, JobTable, ServerConfig, StrategyConfig
from coordinator.data.speculation import SpeculationOptions
from coordinator.events.segments import EventsConfig
from coordinator.members.failure_detector import TimeoutsConfig
from coordinator.model_source import ModelConfig
from coordinator.observe.evaluation import EvaluationConfig
from coordinator.round.rules import RoundsConfig
from coordinator.shards.config import ShardsConfig
from strategies.loader import BUILTINS
from strategies.robust import AggregationConfig
from wire.codecs.base import Codec
from wire.codecs.registry import CODECS
from wire.codecs.rules import CodecRule, CompressionConfig
from wire.config_table import describe_check
from wire.fragments import FragmentRule, StreamingConfig
from wire.health import HealthConfig
from wire.objstore.config import StorageConfig
from wire.transfer import TransferConfig


@dataclass(frozen=True)
class Table:
    """One TOML table of a job config and the dataclass it is read into.

    Attributes
    ----------
    key
        The table's key (``rounds``, ``compression.rules``).
    cls
        The dataclass whose fields are the table's keys.
    about
        A sentence on the table as a whole: when it applies, what its absence means.
    array
        An array of tables (``[[streaming.rules]]``).
    """

    key: str
    cls: type
    about: str = ""
    array: bool = False


TABLES: tuple[Table, ...] = (
    Table("job", JobTable, "Required: the job's name."),
    Table("model", ModelConfig, "Required: where theta_0 comes from, a factory or a file."),
    Table(
        "strategy",
        StrategyConfig,
        "The outer optimiser. The built-ins' parameters are in "
        "[Built-in strategies' parameters](#built-in-strategies-parameters).",
    ),
    Table(
        "aggregation",
        AggregationConfig,
        "How the round's updates are screened and combined before any strategy's step "
        "(robust aggregation works with every strategy).",
    ),
    Table(
        "compression",
        CompressionConfig,
        "Codecs for the pseudo-gradients the sites push. A `[compression.downlink]` table with "
        "the same two keys makes each new theta go down as an encoded delta from the last one; "
        "without it theta is fetched whole.",
    ),
    Table(
        "compression.rules",
        CodecRule,
        "Per-tensor codec rules; non-floating tensors always get `none`.",
        array=True,
    ),
    Table("rounds", RoundsConfig, "Required: how many rounds, and who is in one for how long."),
    Table(
        "timeouts",
        TimeoutsConfig,
        "Checked at start: heartbeat interval < suspicion (computed from the detector's "
        "settings for a steadily heartbeating site) < lease TTL < `rounds.deadline_s`; the error "
        "names the four values.",
    ),
    Table("data", DataConfig),
    Table(
        "speculation",
        SpeculationOptions,
        'Backup copies of straggling data units: only with `data.mode = "shared"` (the '
        "table is refused otherwise).",
    ),
    Table("server", ServerConfig, "Where the coordinator listens and what one call may bring."),
    Table("events", EventsConfig, "The event log's rotation into gzip segments."),
    Table(
        "evaluation",
        EvaluationConfig,
        "Optional: a server-side evaluation hook on the global model. Without the table, none.",
    ),
    Table(
        "streaming",
        StreamingConfig,
        "Optional: streaming outer steps (Streaming DiLoCo). Without the table every round "
        "syncs every tensor; with it, federated data only.",
    ),
    Table(
        "streaming.rules",
        FragmentRule,
        "Optional: tensors put in a fragment by name, before the pattern applies.",
        array=True,
    ),
    Table("health", HealthConfig, "Site health probes, and draining a site for them."),
    Table(
        "storage",
        StorageConfig,
        "Where the coordinator's checkpoints live: the state folder unless `url` names an "
        "object store.",
    ),
    Table(
        "transfer",
        TransferConfig,
        "Parallel streams for large fetches and pushes (both sides read it).",
    ),
    Table(
        "shards",
        ShardsConfig,
        "Optional: the model's tensors split over K coordinator shards (processes or hosts); "
        "the coordinator is the lead and holds shard 0. Without the table, one process.",
    ),
)

_KINDS = {
    int: "integer",
    float: "number",
    str: "string",
    bool: "boolean",
    Path: "path",
    dict: "table",
    list: "array",
    tuple: "array of tables",
}


def table_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` a TOML table may set (``init`` fields)."""
    return [f for f in dataclasses.fields(cls) if f.init]


def field_help(cls: type, name: str) -> str:
    """The help text of field ``name``: its own, else that of the same field in a base class
    (``Int4Codec`` changes ``block``'s default, not its meaning)."""
    for klass in cls.__mro__:
        f = getattr(klass, "__dataclass_fields__", {}).get(name)
        if f is not None and f.metadata.get("help"):
            return f.metadata["help"]
    return ""


def missing_help(tables: tuple[Table, ...] = TABLES) -> list[str]:
    """``table.key`` of every field without help text, over the tables, the built-in
    strategies' parameters and the codecs' parameters."""
    classes = [(t.key, t.cls) for t in tables]
    classes += [(f"strategy ({name})", s.Config) for name, s in BUILTINS.items()]
    classes += [(f"codec {name}", c) for name, c in CODECS.items()]
    return [
        f"{key}.{f.name}"
        for key, cls in classes
        for f in table_fields(cls)
        if not field_help(cls, f.name)
    ]


def type_name(hint: Any) -> str:
    """A field's type as a reader of TOML sees it: ``integer``, ``number, optional``."""
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
    kind = typing.get_origin(hint) or hint
    if inspect.isclass(kind) and issubclass(kind, Codec):
        name = "codec"
    else:
        name = _KINDS.get(kind, getattr(kind, "__name__", str(kind)))
    return f"{name}, optional" if optional else name


def default_text(f: dataclasses.Field, key: str) -> str:
    """A field's default as TOML would write it, ``required`` or ``unset``."""
    if f.metadata.get("required"):
        return "required"
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if f.metadata.get("rest"):
        return "-"
    return toml_value(value, key)


def toml_value(value: Any, key: str = "") -> str:
    """``value`` in TOML's spelling, with a size in MiB or GiB for a ``*_bytes`` key."""
    if value is None:
        return "unset"
    if isinstance(value, Codec):
        return f'`"{value.name}"`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str | Path):
        return f'`"{value}"`'
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    if isinstance(value, list | tuple):
        return "`[]`" if not value else f"`{list(value)}`"
    text = f"`{value!r}`"
    if key.endswith("_bytes") and isinstance(value, int) and value >= 1 << 20:
        size = f"{value >> 30} GiB" if value % (1 << 30) == 0 else f"{value >> 20} MiB"
        text += f" ({size})"
    return text


def markdown(text: str) -> str:
    """Help text (written with reST's double backquotes, as docstrings are) as one Markdown
    table cell."""
    return re.sub(r"``(.+?)``", r"`\1`", text).replace("|", "\\|").replace("\n", " ")


def fields_table(cls: type, prefix: str) -> list[str]:
    """The Markdown table of ``cls``'s fields, each key spelt ``prefix.name``."""
    hints = typing.get_type_hints(cls)
    rows = ["| key | type | default | accepted | meaning |", "|---|---|---|---|---|"]
    for f in table_fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        shown = "*(any other key)*" if f.metadata.get("rest") else f"`{key}`"
        kind = "any" if f.metadata.get("rest") else type_name(hints[f.name])
        rows.append(
            f"| {shown} | {kind} | {default_text(f, f.name)} | "
            f"{markdown(describe_check(f.metadata.get('check')))} | "
            f"{markdown(field_help(cls, f.name))} |"
        )
    return rows


def where(cls: type) -> str:
    """``module.Class`` of a dataclass, for the reader who wants the code."""
    return f"`{cls.__module__}.{cls.__qualname__}`"


INTRO = """\
# Configuration reference

Every key of a job's `job.toml`, generated from the dataclasses that read it
(`python -m coordinator.config_reference` prints this page), so each default is written once, on
its field. The coordinator reads the file; the sites are handed the same file on `Join` and
read the tables that concern them (`[compression]`, `[streaming]`, `[health]`, `[transfer]`)
from it.

Everything is checked at start, before any state is touched: an error names the key
(`rounds.inner_steps: must be > 0, got 0`), a value of the wrong type is refused
(`rounds.total: expected an integer, got str '10'`), and unknown keys and tables are refused,
since a typo must not fall back to a default silently. Relative paths (`job.state_dir`,
`model.path`) are taken from the config file's folder. `coordinator serve --set TABLE.KEY=VALUE`
and `coordinator local --set ...` change a key for one run, checked exactly like the file.

The *accepted* column is what the key's own checks require; rules that span keys (the timeout
hierarchy, `rounds.max_sites >= rounds.min_sites`, exactly one of `model.factory` and
`model.path`, streaming's refusals) are said in the table's text and the *meaning* column.
"""


def render() -> str:
    """The whole reference page, as Markdown."""
    out = [INTRO]
    for table in TABLES:
        brackets = f"[[{table.key}]]" if table.array else f"[{table.key}]"
        out += [f"## `{brackets}`", ""]
        if table.about:
            out += [table.about, ""]
        out += [f"Read into {where(table.cls)}.", ""]
        out += [*fields_table(table.cls, "" if table.array else table.key), ""]
    out += [
        "## Built-in strategies' parameters",
        "",
        "The keys of `[strategy]` besides `name`, for each built-in `name`. A Flower strategy "
        "(`flower:...`) takes its constructor's keyword arguments instead, and a strategy of "
        "your own the fields of its `Config` dataclass.",
        "",
    ]
    default = StrategyConfig().name
    for name, strategy in sorted(BUILTINS.items(), key=lambda item: item[0] != default):
        out += [f'### `name = "{name}"`', "", f"Read into {where(strategy.Config)}.", ""]
        out += [*fields_table(strategy.Config, "strategy"), ""]
    out += [
        "## Codecs' parameters",
        "",
        'A codec is named alone (`default = "int8"`) or as a table with its parameters '
        '(`default = { codec = "int4", block = 128 }`, or the other keys of a '
        "`[[compression.rules]]` entry).",
        "",
    ]
    for name, codec in CODECS.items():
        out += [f'### `codec = "{name}"`', ""]
        doc = " ".join((codec.__doc__ or "").strip().split("\n\n")[0].split())
        if doc:
            out += [markdown(doc), ""]
        if table_fields(codec):
            out += [*fields_table(codec, ""), ""]
        else:
            out += ["No parameters.", ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m coordinator.config_reference",
        description="Print the configuration reference (Markdown), built from the config "
        "dataclasses.",
    )
    parser.add_argument("--out", metavar="FILE", help="write it to FILE instead of stdout")
    args = parser.parse_args(argv)
    page = render()
    if args.out:
        Path(args.out).write_text(page)
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
