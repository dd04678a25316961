"""``coordinator shard``: serve one shard of a job's model (``coordinator.shards``)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from wire.cli_flags import add_security_flags, bundle_from_flags
from wire.config_table import ConfigError, check_listen


def add_shard_parser(sub) -> None:
    p = sub.add_parser("shard", help="serve one shard of a job's model (one per process or host)")
    p.add_argument("--config", required=True, help="the job's TOML config file (the lead's)")
    p.add_argument("--index", type=int, required=True, help="this shard's index, 0 to K-1")
    p.add_argument("--shards", type=int, required=True, metavar="K", help="how many shards")
    p.add_argument("--listen", required=True, help="HOST:PORT to listen on (port 0: a free one)")
    p.add_argument("--state-dir", help="this shard's folder (default: job.state_dir/shards/INDEX)")
    p.add_argument(
        "--key", metavar="FILE", help="the job's shard key (default: job.state_dir/shard.key)"
    )
    p.add_argument(
        "--addresses",
        default="",
        metavar="HOST:PORT,...",
        help="every shard's address in index order, named in a wrong-shard refusal",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="TABLE.KEY=VALUE", help="as for serve"
    )
    p.add_argument("--crl", metavar="FILE", help="the CA's revocation list")
    add_security_flags(p, "the shard (a coordinator certificate)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])


def check_shard_config(cfg, strategy) -> None:
    """What shards cannot do yet, refused before any state is touched."""
    if cfg.streaming is not None:
        raise ConfigError("[streaming] is not supported with coordinator shards yet")
    agg = cfg.aggregation
    if agg.clip_norm > 0 or agg.outlier_zscore > 0 or agg.method != "mean":
        raise ConfigError(
            '[aggregation] with coordinator shards: only method = "mean", without clip_norm '
            "or outlier_zscore (robust rules, clipping and screening need whole updates)"
        )
    if not strategy.separable:
        raise ConfigError(
            f"strategy {cfg.strategy.name!r} is not separable per tensor: it cannot run on "
            "coordinator shards (DiLoCo, FedAvg, FedAvgM and the FedOpt family can)"
        )


def run_shard(args: argparse.Namespace) -> int:
    from coordinator.config import load_config

    if problem := check_listen(args.listen):
        raise ConfigError(f"--listen {args.listen}: {problem}")
    if not 0 <= args.index < args.shards:
        raise ConfigError(f"--index {args.index}: must be in [0, {args.shards - 1}]")
    cfg = load_config(args.config, args.set)
    bundle = bundle_from_flags(args)
    sys.path.insert(0, os.getcwd())  # model factories in the user's project, as serve does
    from coordinator.model_source import initial_theta
    from coordinator.service.server_process import lock_state_dir
    from coordinator.shards.receipts import KEY_FILE, load_key
    from coordinator.shards.service import ShardServer
    from coordinator.shards.shard_core import ShardCore, ShardSpec
    from strategies import load_strategy
    from wire.shard_plan import plan_shards

    strategy = load_strategy(cfg.strategy.name, cfg.strategy.params)
    check_shard_config(cfg, strategy)
    key = load_key(Path(args.key) if args.key else cfg.state_dir / KEY_FILE)
    folder = Path(args.state_dir or cfg.state_dir / "shards" / str(args.index)).absolute()
    lock = lock_state_dir(folder)
    theta_0 = initial_theta(cfg.model)
    sizes = {n: t.numel() * t.element_size() for n, t in theta_0.items()}
    plan = plan_shards(sizes, args.shards)
    addresses = tuple(a for a in args.addresses.split(",") if a)
    spec = ShardSpec(args.index, plan, addresses, cfg.server.max_update_bytes)
    whole = [theta_0]  # read once if the shard has no saved version; then let go

    core = ShardCore(spec, strategy, whole.pop, folder, key)
    del theta_0, whole
    server = ShardServer(core, args.listen, bundle, Path(args.crl) if args.crl else None)
    (folder / "address").write_text(f"{server.address}\n")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"shard {args.index} of {args.shards} serving on {server.address}", flush=True)
    stop.wait()
    server.stop()
    lock.close()
    return 0
