"""The job config: a TOML file loaded into dataclasses and checked before anything starts.

Every error names the key that is wrong (``rounds.inner_steps: must be > 0, got -1``), unknown
keys are refused (a typo must not silently fall back to a default), and relative paths are
taken from the config file's folder.

Each table is a dataclass owned by the code it configures, where its defaults and checks are
written once (read by ``wire.config_table.load_table``): ``[model]`` in
``coordinator.model_source``, ``[aggregation]`` in ``strategies.robust``, ``[rounds]`` in
``coordinator.round.rules``, ``[timeouts]`` in ``coordinator.members.failure_detector``,
``[speculation]`` in
``coordinator.data.speculation``, ``[compression]`` in ``wire.codecs.rules``, ``[events]`` in
``coordinator.events.segments``, ``[evaluation]`` in ``coordinator.observe.evaluation``,
``[streaming]`` in ``wire.fragments``, ``[health]`` in ``wire.health``, ``[storage]`` in
``wire.objstore.config`` and ``[transfer]`` in ``wire.transfer``. The rest are here, with the
rules that span tables. Each field's ``help=`` is its entry in the configuration reference
(``coordinator.config_reference``).

With ``[streaming]`` (P fragments) each coordinator round syncs one fragment and covers
``H / P`` inner steps, so ``JobConfig.rounds`` holds the *effective* rounds: ``total * P``
rounds of ``inner_steps / P`` steps (``JobConfig.outer_rounds`` keeps the file's ``[rounds]``).
The sites are handed the file as written (``source_toml``).

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

    [events]                 # optional: the event log's live file goes to a gzip segment
    rotate_bytes = 67108864  # once it reaches 64 MiB (0: never)
    keep_segments = 8        # and the newest 8 segments are kept

    [evaluation]             # optional: fn(model, round) on the global model, off the round
    fn = "examples.gpt_diloco.evaluate:val_loss"
    every_rounds = 1         # theta_0, every N-th version and the last one

    [streaming]              # optional: Streaming DiLoCo, one fragment syncs per round
    fragments = 2            # P; rounds.inner_steps % P == 0 (federated data only)
    delay_steps = 1          # tau < inner_steps / P: the site merges tau steps after sending

    [health]                 # optional: site probes at join and every N rounds
    every_rounds = 10
    min_fraction = 0.25      # drain a site below 0.25 x the median (0, the default: never)

    [storage]                # optional: checkpoints in S3-compatible object storage
    url = "s3://bucket/prefix"   # "" (the default): the local state folder

    [transfer]               # optional: large transfers over parallel streams
    streams = 4              # 1..8 (1, the default: one stream per transfer)

    [shards]                 # optional: the model's tensors over K processes or hosts
    count = 2                # (coordinator.shards.config)
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from coordinator.data.speculation import SpeculationOptions
from coordinator.events.segments import EventsConfig
from coordinator.members.failure_detector import TimeoutsConfig
from coordinator.model_source import ModelConfig
from coordinator.observe.evaluation import EvaluationConfig, needs_factory
from coordinator.overrides import apply_overrides
from coordinator.round.rules import RoundsConfig
from coordinator.shards.config import ShardsConfig
from strategies.robust import AggregationConfig
from wire.codecs.rules import CodecConfigError, CompressionConfig, compression_tables
from wire.config_table import (
    ConfigError,
    as_table,
    check_listen,
    load_table,
    non_empty,
    non_negative,
    one_of,
    positive,
    setting,
)
from wire.fragments import StreamingConfig, streaming_from_job
from wire.health import HealthConfig, health_from_job
from wire.objstore.config import StorageConfig
from wire.shard_plan import MAX_SHARDS
from wire.transfer import TransferConfig, transfer_from_job

__all__ = [
    "AggregationConfig",
    "ConfigError",
    "DataConfig",
    "EvaluationConfig",
    "EventsConfig",
    "JobConfig",
    "ModelConfig",
    "RoundsConfig",
    "ServerConfig",
    "StrategyConfig",
    "StorageConfig",
    "StreamingConfig",
    "TimeoutsConfig",
    "TransferConfig",
    "load_config",
    "parse_config",
]

SECTIONS = (
    "job",
    "model",
    "strategy",
    "aggregation",
    "compression",
    "rounds",
    "timeouts",
    "data",
    "speculation",
    "server",
    "events",
    "evaluation",
    "streaming",
    "health",
    "storage",
    "transfer",
    "shards",
)
DATA_MODES = ("federated", "shared")


@dataclass(frozen=True)
class JobTable:
    """The ``[job]`` table; ``JobConfig`` carries its two keys at the top level."""

    name: str = setting(check=non_empty, help="the job's name; a state folder belongs to one job")
    state_dir: Path = setting(
        Path("state"),
        check=non_empty,
        help="the coordinator's folder (relative to the config's): checkpoints and start epoch "
        "(unless ``storage.url`` is set), spooled updates, the event log",
    )


@dataclass(frozen=True)
class StrategyConfig:
    """The ``[strategy]`` table: a built-in's name or ``package.module:Class``; every other key
    is passed to the strategy, which checks its own parameters."""

    name: str = setting(
        "diloco",
        check=non_empty,
        help="a built-in (``diloco``, ``fedavg``, ``fedavgm``, ``fedadam``, ``fedyogi``, "
        "``fedadagrad``), ``flower:ClassName`` (Flower's ``flwr.server.strategy``), "
        "``flower:serverapp.ClassName`` (``flwr.serverapp.strategy``; both need the ``flower`` "
        "extra) or ``package.module:Class`` (your own ``strategies.Strategy`` or Flower "
        "Message-API strategy)",
    )
    params: dict[str, Any] = setting(
        factory=dict,
        rest=True,
        help="every other key of the table: the strategy's parameters (for a built-in, see "
        "the strategies' tables below; for Flower, the constructor's keyword arguments)",
    )


def check_fold_lanes(v: int) -> str | None:
    return None if 1 <= v <= MAX_SHARDS else f"must be in [1, {MAX_SHARDS}], got {v}"


@dataclass(frozen=True)
class ServerConfig:
    """The ``[server]`` table: where the coordinator listens and what one RPC may bring."""

    listen: str = setting(
        "127.0.0.1:7070",
        check=check_listen,
        help="``HOST:PORT`` to listen on (port 0 picks a free one, written to "
        "``state_dir/address``); ``serve --listen`` overrides it",
    )
    max_update_bytes: int = setting(8 << 30, check=positive, help="the largest update accepted")
    workers: int = setting(32, check=positive, help="gRPC worker threads")
    receive_window_bytes: int = setting(
        8 << 20,
        check=non_negative,
        help="what one push stream may have in flight towards the coordinator (its HTTP/2 "
        "window): the memory each concurrent upload can hold, and (divided by the RTT) the most "
        "one stream can upload per second. 0: gRPC sizes it from its bandwidth-delay estimate, "
        "which on a busy coordinator grows to tens of MiB per stream",
    )
    concurrent_uploads: int | None = setting(
        None,
        check=non_negative,
        help="uploads received at once (``coordinator.intake.receive_slots``; the K streams of "
        "an upload sent in pieces share its slot). A site asks for a receive slot (a "
        "header-only push) before it sends, and waiting uploads are granted in the round's fold "
        "order, so the running sum folds each as it arrives and memory for uploads is this many "
        "windows whatever the number of sites; an unused grant lapses after 10 s. Unset: sized "
        "from the model, as many windows as fit in a quarter of an update's float32 bytes, 2 to "
        "8 (logged at start). 0: no limit",
    )
    concurrent_fetches: int = setting(
        8,
        check=non_negative,
        help="fetch streams sent at once (``coordinator.service.send_slots``; a fetch over K "
        "streams takes up to K): the others wait their turn, first come first served, so "
        "their chunks in flight are not held in memory, and are answered ``UNAVAILABLE`` if "
        "none frees within 30 s. 0: no limit",
    )
    fold_lanes: int | None = setting(
        None,
        check=check_fold_lanes,
        help="threads that fold updates into the round's running sum side by side, each over "
        "its own tensors (``coordinator.round.fold_lanes``; the sum is the same bits whatever "
        "the number). Unset: one per core the process may use, at most 8",
    )
    request_timeout_s: float = setting(
        10.0,
        check=positive,
        help="how long a call's request message may take to arrive once the call is open; a "
        "call past it is cancelled, freeing its worker",
    )
    stream_idle_s: float = setting(
        600.0,
        check=positive,
        help="how long a stream may sit between messages (a push waits, before its last "
        "chunk, for the site's checkpoint) before it is cancelled",
    )


@dataclass(frozen=True)
class DataConfig:
    """``federated``: each site trains on its own data; a late update is dropped or folded
    into the next round as the strategy says. ``shared`` (pretraining): the coordinator hands
    out data units each round, backs up stragglers' units and commits each unit once."""

    mode: str = setting(
        "federated",
        check=one_of(DATA_MODES),
        help="``federated``: each site trains on its own data; ``shared`` (pretraining): the "
        "coordinator hands out data units each round and backs up stragglers",
    )


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
    events: EventsConfig = field(default_factory=EventsConfig)
    # None: no server-side evaluation of the global model.
    evaluation: EvaluationConfig | None = None
    # None: every round syncs every tensor. Set: one fragment per round, and ``rounds`` holds
    # the effective rounds (see the module docstring).
    streaming: StreamingConfig | None = None
    # The ``[rounds]`` table as written: ``rounds`` itself unless ``[streaming]`` is set.
    outer_rounds: RoundsConfig | None = None
    health: HealthConfig = field(default_factory=HealthConfig)
    # Where checkpoints live: the local state folder unless ``url`` names an object store.
    storage: StorageConfig = field(default_factory=StorageConfig)
    # How many streams one large fetch (or push) may take at once; the call limits follow it.
    transfer: TransferConfig = field(default_factory=TransferConfig)
    # How many processes (or hosts) hold the model's tensors (1: this one).
    shards: ShardsConfig = field(default_factory=ShardsConfig)

    @property
    def outer_inner_steps(self) -> int:
        """H, the inner steps between two syncs of the same tensor (``rounds.inner_steps`` as
        written in the file)."""
        return (self.outer_rounds or self.rounds).inner_steps


def parse_config(data: dict[str, Any], base_dir: Path, source: bytes = b"") -> JobConfig:
    """Check a job config's tables and build the ``JobConfig``.

    Tables are read in a fixed order (``[rounds]`` before ``[timeouts]``, whose hierarchy ends
    at ``rounds.deadline_s``; ``[data]`` before ``[speculation]``); the first problem raises.

    Parameters
    ----------
    data
        The parsed TOML document.
    base_dir
        The folder relative paths (``job.state_dir``, ``model.path``) are taken from.
    source
        The file's bytes, kept as ``source_toml`` (sites are handed the same config).
    """
    job = load_table(JobTable, data.get("job", {}), "job", base_dir)
    model = load_table(ModelConfig, data.get("model", {}), "model", base_dir)
    strategy = load_table(StrategyConfig, data.get("strategy", {}), "strategy")
    aggregation = AggregationConfig.from_table(data.get("aggregation", {}))
    compression, downlink = _compression(data)
    rounds = load_table(RoundsConfig, data.get("rounds", {}), "rounds")
    timeouts = load_table(TimeoutsConfig, data.get("timeouts", {}), "timeouts")
    timeouts.check_hierarchy(rounds.deadline_s)
    data_cfg = load_table(DataConfig, data.get("data", {}), "data")
    speculation = speculation_from_table(data.get("speculation", {}), data_cfg)
    server = load_table(ServerConfig, data.get("server", {}), "server")
    events = load_table(EventsConfig, data.get("events", {}), "events")
    evaluation = None
    if "evaluation" in data:
        evaluation = load_table(EvaluationConfig, data["evaluation"], "evaluation")
        needs_factory(evaluation, model.factory)
    streaming = streaming_from_job(data)
    effective = streaming_rounds(streaming, rounds, data_cfg)
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown key")
    return JobConfig(
        job.name,
        job.state_dir,
        model,
        strategy,
        effective,
        timeouts,
        server,
        source,
        aggregation,
        compression,
        data_cfg,
        speculation,
        downlink,
        events,
        evaluation,
        streaming,
        rounds if streaming is not None else None,
        health_from_job(data),
        load_table(StorageConfig, data.get("storage", {}), "storage"),
        transfer_from_job(data),
        load_table(ShardsConfig, data.get("shards", {}), "shards"),
    )


def _compression(data: dict[str, Any]) -> tuple[CompressionConfig, CompressionConfig | None]:
    """``[compression]`` and its downlink table (sites read the same table from the config the
    coordinator hands them on Join)."""
    try:
        return compression_tables(as_table(data.get("compression", {}), "compression"))
    except CodecConfigError as exc:
        raise ConfigError(str(exc)) from exc


def streaming_rounds(
    streaming: StreamingConfig | None, rounds: RoundsConfig, data: DataConfig
) -> RoundsConfig:
    """The coordinator's rounds under ``[streaming]``: ``rounds.total * P`` rounds of
    ``rounds.inner_steps / P`` inner steps, each syncing one fragment (``rounds`` itself
    without the table). Only with federated data: see the refusal below."""
    if streaming is None:
        return rounds
    streaming.check_steps(rounds.inner_steps)
    if data.mode != "federated":
        raise ConfigError(
            f"streaming: needs data.mode = 'federated' (data.mode is {data.mode!r}). A "
            "streaming site trains the first streaming.delay_steps steps of the next round on "
            "its own continuing model before that round opens, while shared-data units are "
            "handed out when a round opens and must give the same update wherever they run; "
            "remove [streaming] or use data.mode = 'federated'"
        )
    p = streaming.fragments
    return dataclasses.replace(rounds, total=rounds.total * p, inner_steps=rounds.inner_steps // p)


def speculation_from_table(table: Any, data: DataConfig) -> SpeculationOptions:
    """Read ``[speculation]``, refused outright unless ``data.mode = 'shared'``: backups are
    copies of data units, which only shared-data mode hands out."""
    if isinstance(table, dict) and table and data.mode != "shared":
        raise ConfigError(
            f"speculation: backup copies need data.mode = 'shared' (data.mode is {data.mode!r})"
        )
    return load_table(SpeculationOptions, table, "speculation")


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """Read and validate a job config file, with ``--set TABLE.KEY=VALUE`` ``overrides``
    (``coordinator.overrides``) applied first."""
    path = Path(path)
    try:
        source = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read job config {path}: {exc.strerror}") from exc
    try:
        data = tomllib.loads(source.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    if overrides:
        data = apply_overrides(data, overrides)
        source = tomli_w.dumps(data).encode()  # what the sites are handed
    return parse_config(data, path.resolve().parent, source)
