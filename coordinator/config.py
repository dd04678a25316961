"""The job config: a TOML file loaded into dataclasses and checked before anything starts.

Every error names the key that is wrong (``rounds.inner_steps: expected an integer > 0, got
-1``), unknown keys are refused (a typo must not silently fall back to a default), and relative
paths are taken from the config file's folder.

Example::

    [job]
    name = "gpt-diloco"
    state_dir = "state"

    [model]
    factory = "examples.gpt_diloco.model:build_model"   # or: path = "theta0.safetensors"
    seed = 0
    kwargs = { d_model = 128 }

    [strategy]
    name = "diloco"          # built-in, or "package.module:Class"
    lr = 0.7
    momentum = 0.9

    [aggregation]            # optional: robust aggregation, before any strategy's step
    method = "mean"          # or "median", "trimmed_mean"
    clip_norm = 0.0          # > 0: scale each update to at most this L2 norm
    outlier_zscore = 0.0     # > 0: reject updates whose norm is an outlier (modified z-score)

    [rounds]
    total = 10
    inner_steps = 50         # H
    min_sites = 2
    max_sites = 16
    join_window_s = 5.0
    deadline_s = 1800.0

    [timeouts]
    heartbeat_interval_s = 5.0
    lease_ttl_s = 30.0

    [server]
    listen = "127.0.0.1:7070"

    [compression]            # pseudo-gradients up (see wire/codecs/rules.py)
    default = "int8"
    [compression.downlink]   # optional: theta_{r+1} down as an encoded delta from theta_r
    default = "int8"
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.config_table import (
    ConfigError,
    Table,
    check_listen,
    load_table,
    non_empty,
    one_of,
    positive,
    setting,
)
from coordinator.failure_detector import TimeoutsConfig
from coordinator.rounds import RoundsConfig
from coordinator.speculation import SpeculationOptions
from strategies.robust import AggregationConfig
from wire.codecs.rules import CodecConfigError, CompressionConfig, compression_tables


@dataclass(frozen=True)
class ModelConfig:
    factory: str | None = None
    path: Path | None = None
    seed: int = 0
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StrategyConfig:
    name: str = "diloco"
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerConfig:
    listen: str = "127.0.0.1:7070"
    max_update_bytes: int = 8 << 30
    workers: int = 32


DATA_MODES = ("federated", "shared")


@dataclass(frozen=True)
class DataConfig:
    """``federated``: each site trains on its own data; a late update is dropped or folded
    into the next round as the strategy says. ``shared`` (pretraining): the coordinator hands
    out data units each round, backs up stragglers' units and commits each unit once."""

    mode: str = setting("federated", check=one_of(DATA_MODES))


@dataclass(frozen=True)
class JobConfig:
    name: str
    state_dir: Path
    model: ModelConfig
    strategy: StrategyConfig
    rounds: RoundsConfig
    timeouts: TimeoutsConfig
    server: ServerConfig
    source_toml: bytes = b""
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)
    # None: each round's theta is fetched whole. Set: as an encoded delta from the last one.
    downlink: CompressionConfig | None = None


def parse_config(data: dict[str, Any], base_dir: Path, source: bytes = b"") -> JobConfig:
    root = Table(data, "")
    job = root.table("job")
    name = job.get("name", str, check=non_empty)
    state_dir = base_dir / job.get("state_dir", str, "state", check=non_empty)
    job.reject_unknown()

    m = root.table("model")
    factory = m.get("factory", str, None, check=non_empty)
    path = m.get("path", str, None, check=non_empty)
    if (factory is None) == (path is None):
        raise ConfigError(
            "model: set exactly one of model.factory ('module:function') or model.path"
        )
    module_name, _, function = (factory or "").partition(":")
    if factory is not None and not (module_name.strip() and function.strip()):
        raise ConfigError(f"model.factory: expected 'package.module:function', got {factory!r}")
    model = ModelConfig(
        factory=factory,
        path=base_dir / path if path is not None else None,
        seed=m.get("seed", int, 0),
        kwargs=m.get("kwargs", dict, {}),
    )
    m.reject_unknown()

    s = root.table("strategy")
    strategy_name = s.get("name", str, "diloco", check=non_empty)
    params = {k: v for k, v in s.data.items() if k != "name"}
    strategy = StrategyConfig(strategy_name, params)
    aggregation = AggregationConfig.from_table(root.table("aggregation").data)
    try:  # sites read the same table from the config the coordinator hands them on Join
        compression, downlink = compression_tables(root.table("compression").data)
    except CodecConfigError as exc:
        raise ConfigError(str(exc)) from exc

    rounds = load_table(RoundsConfig, root.table("rounds").data, "rounds")

    timeouts = load_table(TimeoutsConfig, root.table("timeouts").data, "timeouts")
    timeouts.check_hierarchy(rounds.deadline_s)
    data = load_table(DataConfig, root.table("data").data, "data")
    speculation = speculation_from_table(root.table("speculation").data, data)

    sv = root.table("server")
    server = ServerConfig(
        listen=sv.get("listen", str, "127.0.0.1:7070", check=check_listen),
        max_update_bytes=sv.get("max_update_bytes", int, 8 << 30, check=positive),
        workers=sv.get("workers", int, 32, check=positive),
    )
    sv.reject_unknown()
    root.reject_unknown()
    return JobConfig(
        name,
        state_dir,
        model,
        strategy,
        rounds,
        timeouts,
        server,
        source,
        aggregation,
        compression,
        data,
        speculation,
        downlink,
    )


def speculation_from_table(table: Any, data: DataConfig) -> SpeculationOptions:
    """Read ``[speculation]``, refused outright unless ``data.mode = 'shared'``: backups are
    copies of data units, which only shared-data mode hands out."""
    if isinstance(table, dict) and table and data.mode != "shared":
        raise ConfigError(
            f"speculation: backup copies need data.mode = 'shared' (data.mode is {data.mode!r})"
        )
    return load_table(SpeculationOptions, table, "speculation")


def load_config(path: str | Path) -> JobConfig:
    """Read and validate a job config file."""
    path = Path(path)
    try:
        source = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read job config {path}: {exc.strerror}") from exc
    try:
        data = tomllib.loads(source.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return parse_config(data, path.resolve().parent, source)
