"""Choosing a codec per tensor: ordered rules from the job config, first match wins.

Example (``job.toml``; ``from_dict`` takes the ``compression`` table)::

    [compression]
    default = "int8"                          # or { codec = "int8", block = 128 }

    [[compression.rules]]                     # norms and biases travel exactly
    match = "*.norm*"
    codec = "none"

    [[compression.rules]]
    match = "*.bias"
    codec = "none"

    [[compression.rules]]                     # big matrices: 1 % top-k with error feedback
    match = "*"
    min_numel = 1_000_000
    codec = "topk"
    fraction = 0.01

``match`` is an ``fnmatch`` pattern, case-sensitive, where ``*`` also spans dots; ``min_numel``
and ``max_numel`` bound the tensor's element count (inclusive). Non-floating tensors always get
``none``. Every other key of a rule is a parameter of its codec (``make_codec``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch

from wire.codecs.base import Codec
from wire.codecs.cast import NoneCodec
from wire.codecs.registry import CODECS, make_codec
from wire.config_table import setting


class CodecConfigError(ValueError):
    """A compression config that cannot be used; the message names the key."""


@dataclass(frozen=True)
class CodecRule:
    """Use ``codec`` for tensors whose name matches ``match`` and whose element count lies in
    ``[min_numel, max_numel]``."""

    codec: Codec = setting(
        help="the codec's name (``none``, ``bf16``, ``fp16``, ``int8``, ``int4``, ``topk``); "
        "every key of the rule but ``match``, ``min_numel`` and ``max_numel`` is one of its "
        "parameters (the codecs' table below)"
    )
    match: str = setting(
        "*",
        help="an fnmatch pattern on the tensor's name, case-sensitive, where ``*`` also spans dots",
    )
    min_numel: int = setting(0, help="the rule applies to tensors of at least this many elements")
    max_numel: int | None = setting(None, help="and of at most this many (unset: no upper bound)")

    def matches(self, name: str, numel: int) -> bool:
        return (
            fnmatchcase(name, self.match)
            and numel >= self.min_numel
            and (self.max_numel is None or numel <= self.max_numel)
        )


@dataclass(frozen=True)
class CompressionConfig:
    """Codec selection: ``rules`` in order, then ``default``."""

    default: Codec = setting(
        factory=NoneCodec,
        help="the codec of every floating-point tensor no rule matches: a name, or a table "
        'with its parameters (``{ codec = "topk", fraction = 0.01 }``)',
    )
    rules: tuple[CodecRule, ...] = setting(
        (),
        help="``[[compression.rules]]``, tried in order, the first match wins (the next table); "
        "sites read the same rules from the config the coordinator hands them",
    )
    mode: str = setting(
        "fixed",
        help="``fixed``: every transfer uses ``default`` and ``rules`` as written; "
        "``adaptive``: each transfer takes the least lossy rung of ``ladder`` whose predicted "
        "time (its size over the link's measured throughput) fits ``deadline_fraction`` of "
        "the compute it overlaps (``wire.codecs.adaptive``); ``rules`` still apply",
    )
    ladder: tuple[Codec, ...] = setting(
        (),
        help='with ``mode = "adaptive"``: the codecs to choose from, least lossy first, each a '
        'name or a table (``["none", "bf16", "int8", "int4", { codec = "topk", fraction = '
        "0.01 }]``); the chosen rung stands for ``default``",
    )
    deadline_fraction: float = setting(
        0.6,
        help='with ``mode = "adaptive"``: the share of the compute time a transfer overlaps '
        "(``delay_steps`` of a streaming round, the round's steps when blocking) it may take, "
        "in (0, 1]; each direction gets half. 0.6 leaves room for the close and the "
        "merge (``bench.adaptive``: at 0.8 both directions' rungs filled tau and the "
        "trainers waited)",
    )

    @property
    def adaptive(self) -> bool:
        """Whether each transfer takes a rung of ``ladder`` (``wire.codecs.adaptive``)."""
        return self.mode == "adaptive"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str = "compression") -> CompressionConfig:
        """Parse the ``[compression]`` table of a job config.

        Parameters
        ----------
        data
            The table's contents (``tomllib.loads(...)["compression"]``).
        path
            The table's key, prefixed to every error message.

        Raises
        ------
        CodecConfigError
            Naming the key: ``compression.rules[2].fraction: must be a number in (0, 1], got 2``.
            Unknown keys are refused, so a typo never falls back to a default silently.
        """
        if not isinstance(data, Mapping):
            raise CodecConfigError(f"{path}: expected a table, got {type(data).__name__}")
        _reject_unknown(data, ("default", "rules", "mode", "ladder", "deadline_fraction"), path)
        mode = data.get("mode", "fixed")
        if mode not in ("fixed", "adaptive"):
            raise CodecConfigError(f"{path}.mode: expected 'fixed' or 'adaptive', got {mode!r}")
        rules = data.get("rules", [])
        if not isinstance(rules, list):
            raise CodecConfigError(f"{path}.rules: expected an array of tables")
        rules = tuple(_rule_from(r, f"{path}.rules[{i}]") for i, r in enumerate(rules))
        if mode == "adaptive":
            ladder, fraction = _adaptive_from(data, path)
            return cls(ladder[0], rules, mode, ladder, fraction)
        for key in ("ladder", "deadline_fraction"):
            if key in data:
                raise CodecConfigError(f"{path}.{key}: only with mode = 'adaptive'")
        return cls(
            _codec_from(_as_codec_table(data.get("default", "none")), f"{path}.default", ()), rules
        )


def compression_tables(
    data: Mapping[str, Any], path: str = "compression"
) -> tuple[CompressionConfig, CompressionConfig | None]:
    """The uplink rules and the optional ``downlink`` sub-table of a ``[compression]`` table.

    Raises
    ------
    CodecConfigError
        As ``CompressionConfig.from_dict``, naming ``compression.downlink.*`` keys too.
    """
    if not isinstance(data, Mapping):
        raise CodecConfigError(f"{path}: expected a table, got {type(data).__name__}")
    up = {k: v for k, v in data.items() if k != "downlink"}
    down = data.get("downlink")
    return (
        CompressionConfig.from_dict(up, path),
        None if down is None else CompressionConfig.from_dict(down, f"{path}.downlink"),
    )


def _reject_unknown(data: Mapping[str, Any], allowed: Sequence[str], path: str) -> None:
    for key in data:
        if key not in allowed:
            raise CodecConfigError(f"{path}.{key}: unknown key (expected one of {list(allowed)})")


def _as_codec_table(value: Any) -> Any:
    return {"codec": value} if isinstance(value, str) else value


def _adaptive_from(data: Mapping[str, Any], path: str) -> tuple[tuple[Codec, ...], float]:
    """The ladder and deadline fraction of an adaptive table."""
    if "default" in data:
        raise CodecConfigError(
            f"{path}.default: not used with mode = 'adaptive' (the chosen rung of "
            f"{path}.ladder stands for it); remove it"
        )
    ladder = data.get("ladder")
    if not isinstance(ladder, list) or not ladder:
        raise CodecConfigError(
            f"{path}.ladder: mode = 'adaptive' needs a non-empty array of codecs, least lossy "
            f'first (e.g. ["none", "bf16", "int8", "int4"]), got {ladder!r}'
        )
    codecs = tuple(
        _codec_from(_as_codec_table(c), f"{path}.ladder[{i}]", ()) for i, c in enumerate(ladder)
    )
    fraction = data.get("deadline_fraction", CompressionConfig.deadline_fraction)
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        raise CodecConfigError(f"{path}.deadline_fraction: expected a number, got {fraction!r}")
    if not 0 < fraction <= 1 or not math.isfinite(fraction):
        raise CodecConfigError(f"{path}.deadline_fraction: must be in (0, 1], got {fraction!r}")
    return codecs, float(fraction)


def _rule_from(data: Any, path: str) -> CodecRule:
    if not isinstance(data, Mapping):
        raise CodecConfigError(f"{path}: expected a table, got {type(data).__name__}")
    extra = ("match", "min_numel", "max_numel")
    match = data.get("match", "*")
    if not isinstance(match, str) or not match:
        raise CodecConfigError(f"{path}.match: expected a non-empty pattern, got {match!r}")
    lo = _count(data, "min_numel", 0, path)
    hi = _count(data, "max_numel", None, path)
    if hi is not None and hi < lo:
        raise CodecConfigError(f"{path}.max_numel: must be >= min_numel ({lo}), got {hi}")
    return CodecRule(_codec_from(data, path, extra), match, lo, hi)


def _count(data: Mapping[str, Any], key: str, default: int | None, path: str) -> int | None:
    value = data.get(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise CodecConfigError(f"{path}.{key}: expected an integer >= 0, got {value!r}")
    return value


def _codec_from(data: Any, path: str, extra: Sequence[str]) -> Codec:
    if not isinstance(data, Mapping):
        raise CodecConfigError(f"{path}: expected a codec name or table, got {data!r}")
    name = data.get("codec")
    if not isinstance(name, str):
        raise CodecConfigError(f"{path}.codec: missing (required), expected a codec name")
    if name not in CODECS:
        raise CodecConfigError(f"{path}.codec: unknown codec {name!r}; known: {list(CODECS)}")
    fields = CODECS[name].__dataclass_fields__
    params = {}
    for key, value in data.items():
        if key == "codec" or key in extra:
            continue
        spec = fields.get(key)
        if spec is None or not spec.init:
            takes = [f for f in fields if fields[f].init]
            raise CodecConfigError(f"{path}.{key}: unknown key for codec {name!r} (takes {takes})")
        params[key] = _typed_value(value, spec.default, f"{path}.{key}")
    try:
        return make_codec(name, **params)
    except ValueError as exc:
        raise CodecConfigError(f"{path}.{exc}") from None


def _typed_value(value: Any, default: Any, key: str) -> Any:
    kind = type(default) if default is not MISSING else object
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise CodecConfigError(f"{key}: expected {kind.__name__}, got {value!r}")
    return value


def choose_codec(
    name: str,
    tensor: torch.Tensor | Sequence[int],
    rules: CompressionConfig | Sequence[CodecRule],
) -> Codec:
    """The codec for one tensor; pure (no I/O, no state).

    Parameters
    ----------
    name
        The tensor's name, matched against each rule's pattern.
    tensor
        The tensor, or just its shape. A non-floating tensor always gets ``none``.
    rules
        A ``CompressionConfig``, or a bare list of rules (default ``none``).

    Returns
    -------
    Codec
        The first matching rule's codec, else the default.
    """
    if isinstance(tensor, torch.Tensor):
        if not tensor.is_floating_point():
            return NoneCodec()
        numel = tensor.numel()
    else:
        numel = math.prod(int(d) for d in tensor)
    config = (
        rules if isinstance(rules, CompressionConfig) else CompressionConfig(rules=tuple(rules))
    )
    for rule in config.rules:
        if rule.matches(name, numel):
            return rule.codec
    return config.default
