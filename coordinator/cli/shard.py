"""``coordinator shard``: serve one shard of a job's model (``coordinator.shards``)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from coordinator.cli.ha import etcd_from_flags
from wire.cli_flags import add_security_flags, bundle_from_flags
from wire.config_table import ConfigError, check_listen

log = logging.getLogger("isthmus.shard")


def add_shard_parser(sub) -> None:
    p = sub.add_parser("shard", help="serve one shard of a job's model (one per process or host)")
    p.add_argument("--config", required=True, help="the job's TOML config file (the lead's)")
    p.add_argument(
        "--index",
        type=int,
        required=True,
        help="this shard's index, 1 to K-1 (the lead, `coordinator serve`, holds 0)",
    )
    p.add_argument(
        "--shards", type=int, metavar="K", help="how many shards (default: shards.count)"
    )
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
    p.add_argument(
        "--lead",
        action="append",
        default=[],
        metavar="NAME",
        help="the name in the lead's certificate: only it may close rounds here; once per "
        "coordinator that may lead (with --ha, the standbys too; default: any coordinator "
        "certificate of the job)",
    )
    p.add_argument("--crl", metavar="FILE", help="the CA's revocation list")
    p.add_argument(
        "--ha",
        metavar="etcd://HOST:PORT[,HOST:PORT][/PREFIX]",
        help="register this shard's address in the etcd of the job's standby coordinators "
        "(the key PREFIX/JOB/shards/INDEX), where a lead with no [shards] addresses finds it",
    )
    p.add_argument(
        "--advertise",
        metavar="HOST:PORT",
        help="with --ha: the address registered (default: the listen address; a wildcard host "
        "becomes this machine's name)",
    )
    p.add_argument(
        "--ha-ttl", type=int, default=10, metavar="SECONDS", help="with --ha: the etcd lease TTL"
    )
    p.add_argument(
        "--parent-pid",
        type=int,
        metavar="PID",
        help="stop when this process is gone (the coordinator that started this shard)",
    )
    add_security_flags(p, "the shard (a coordinator certificate)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])


def _outlive_not(parent: int, stop: threading.Event) -> None:
    """Set ``stop`` once process ``parent`` is gone (killed with -9, it could not stop us):
    a shard must not hold its folder when its coordinator starts again."""
    while not stop.wait(0.2):
        if os.getppid() != parent:
            stop.set()


def run_shard(args: argparse.Namespace) -> int:
    from coordinator.config import load_config

    if problem := check_listen(args.listen):
        raise ConfigError(f"--listen {args.listen}: {problem}")
    cfg = load_config(args.config, args.set)
    ha = etcd_from_flags(args, cfg)
    args.shards = args.shards or cfg.shards.count
    if not 0 <= args.index < args.shards:
        raise ConfigError(f"--index {args.index}: must be in [0, {args.shards - 1}]")
    bundle = bundle_from_flags(args)
    sys.path.insert(0, os.getcwd())  # model factories in the user's project, as serve does
    from coordinator.model_source import initial_theta, tensor_sizes
    from coordinator.service.server_process import lock_state_dir
    from coordinator.shards.config import unsupported
    from coordinator.shards.lead import load_or_make_plan
    from coordinator.shards.part_store import PartStoreError
    from coordinator.shards.receipts import KEY_FILE, ShardKeyError, load_key
    from coordinator.shards.service import ShardServer
    from coordinator.shards.shard_core import ShardCore, ShardSpec
    from strategies import load_strategy

    strategy = load_strategy(cfg.strategy.name, cfg.strategy.params)
    if problem := unsupported(cfg, strategy):
        raise ConfigError(problem)
    try:
        key = load_key(Path(args.key) if args.key else cfg.state_dir / KEY_FILE)
    except ShardKeyError as exc:
        raise ConfigError(str(exc)) from exc
    folder = Path(args.state_dir or cfg.state_dir / "shards" / str(args.index)).absolute()
    lock = lock_state_dir(folder)
    try:  # made once, from theta_0's sizes, and kept in the folder as the lead keeps its own
        plan = load_or_make_plan(folder, args.shards, lambda: tensor_sizes(cfg.model))
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    addresses = tuple(a for a in args.addresses.split(",") if a)
    leads = tuple(args.lead)
    spec = ShardSpec(args.index, plan, addresses, cfg.server.max_update_bytes, leads)
    own = plan.names(args.index)
    try:
        core = ShardCore(spec, strategy, lambda: initial_theta(cfg.model, own), folder, key)
    except (PartStoreError, ValueError) as exc:
        raise ConfigError(f"shard {args.index}: {exc}") from exc
    server = ShardServer(core, args.listen, bundle, Path(args.crl) if args.crl else None)
    (folder / "address").write_text(f"{server.address}\n")
    _serve_until_stopped(server, args, ha)
    lock.close()
    return 0


def _serve_until_stopped(server, args: argparse.Namespace, ha) -> None:
    """Serve (registered in etcd with ``ha``) until SIGTERM, SIGINT or the parent's end."""
    from dataclasses import replace

    from coordinator.ha.options import advertised
    from coordinator.shards.registry import ShardRegistration

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.parent_pid:
        threading.Thread(target=_outlive_not, args=(args.parent_pid, stop), daemon=True).start()
    server.start()
    registration = None
    if ha is not None:
        where = advertised(args.listen, server.address, ha.advertise)
        registration = ShardRegistration(replace(ha, advertise=where), args.index).start()
        log.info("registering shard %d as %s under %s", args.index, where, registration.key)
    print(f"shard {args.index} of {args.shards} serving on {server.address}", flush=True)
    stop.wait()
    if registration is not None:
        registration.close()
    server.stop()
