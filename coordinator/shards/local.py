"""Shards 1..K-1 as processes of the lead's own host (``[shards]`` without ``addresses``).

``coordinator serve`` starts one ``coordinator shard`` per shard, each with its own folder
under ``state_dir/shards/``, the job's config and the lead's TLS bundle, listening on the
lead's host at a port of its own. A shard process found gone (killed, crashed) is started
again on the same port, from its folder: what it had made durable is all it needs.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("isthmus.coordinator")
START_TIMEOUT_S = 120.0
WATCH_S = 0.5  # how often the lead looks for a shard process that is gone


@dataclass(frozen=True)
class ShardLaunch:
    """What a shard process is started with: the lead's command line, in short."""

    config: Path
    overrides: tuple[str, ...]
    state_dir: Path
    host: str
    tls_dir: Path | None  # None: --insecure
    crl: Path | None = None
    lead: str = ""  # the name in the lead's certificate: the only one that closes rounds


class LocalShards:
    def __init__(self, launch: ShardLaunch, count: int) -> None:
        self.launch, self.count = launch, count
        self._procs: dict[int, subprocess.Popen] = {}
        self._ports: dict[int, str] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watch = threading.Thread(target=self._watch_loop, name="shard-watch", daemon=True)

    def folder(self, index: int) -> Path:
        return self.launch.state_dir / "shards" / str(index)

    def start(self) -> list[str]:
        """Start shards 1..K-1 (one after another: each reads the model) and wait until each
        serves; their addresses, in order."""
        try:
            for i in range(1, self.count):
                self._start(i)
        except BaseException:
            self.stop()
            raise
        self._watch.start()
        return [self._ports[i] for i in range(1, self.count)]

    def _watch_loop(self) -> None:
        """A shard process that exits while the job runs is started again at once: sites
        pushing to it, and the lead's close, are retrying meanwhile."""
        while not self._stopping.wait(WATCH_S):
            try:
                self.revive(0)
            except OSError as exc:  # it could not start: tried again at the next look
                log.error("%s", exc)

    def _start(self, i: int) -> None:
        folder = self.folder(i)
        folder.mkdir(parents=True, exist_ok=True)
        address_file = folder / "address"
        address_file.unlink(missing_ok=True)
        listen = self._ports.get(i, f"{self.launch.host}:0")
        security = (
            ["--tls-dir", str(self.launch.tls_dir)] if self.launch.tls_dir else ["--insecure"]
        )
        crl = ["--crl", str(self.launch.crl)] if self.launch.crl else []
        sets = [f for kv in self.launch.overrides for f in ("--set", kv)]
        cmd = [sys.executable, "-m", "coordinator.cli", "shard"]
        cmd += ["--config", str(self.launch.config), "--index", str(i)]
        cmd += ["--shards", str(self.count), "--listen", listen]
        key = self.launch.state_dir / "shard.key"
        cmd += ["--state-dir", str(folder), "--key", str(key), *security, *crl, *sets]
        cmd += ["--parent-pid", str(os.getpid())]
        cmd += ["--lead", self.launch.lead] if self.launch.lead else []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with open(folder / "shard.log", "ab") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
            self._procs[i] = proc
            while not address_file.exists() and proc.poll() is None:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if address_file.exists():
                break
            # An earlier shard process of a coordinator killed with -9 may hold the folder
            # for a moment more (it stops once it sees its parent gone): try again.
            if proc.poll() is None or time.monotonic() > deadline or not _folder_held(folder):
                tail = (folder / "shard.log").read_text(errors="replace")[-2000:]
                raise OSError(f"shard {i} did not start (see {folder / 'shard.log'}):\n{tail}")
            time.sleep(0.5)
        self._ports[i] = address_file.read_text().strip()
        log.info("shard %d serving on %s (pid %d)", i, self._ports[i], proc.pid)

    def revive(self, attempt: int) -> None:
        """Start again every shard process that is gone (the lead found one unreachable)."""
        with self._lock:
            for i, proc in sorted(self._procs.items()):
                if proc.poll() is not None and not self._stopping.is_set():
                    log.warning("shard %d exited (%s); starting it again", i, proc.returncode)
                    self._start(i)

    def pid(self, index: int) -> int:
        return self._procs[index].pid

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _folder_held(folder: Path) -> bool:
    """Whether the last start failed because another process held the shard's folder."""
    tail = (folder / "shard.log").read_text(errors="replace")[-600:]
    return "is in use by another" in tail


def prepare_shards(cfg, remote: bool):
    """Job ``cfg``'s shard plan and key, checked (``ConfigError``): what it asks of shards
    must be built, and shards on hosts of their own (``remote``) hold a copy of the key, so
    the lead must find it rather than make another."""
    from coordinator.model_source import tensor_sizes
    from coordinator.shards.config import unsupported
    from coordinator.shards.lead import load_or_make_plan
    from coordinator.shards.receipts import KEY_FILE, ShardKeyError, create_key, load_key
    from strategies import load_strategy
    from wire.config_table import ConfigError

    if problem := unsupported(cfg, load_strategy(cfg.strategy.name, cfg.strategy.params)):
        raise ConfigError(problem)
    try:
        key = (load_key if remote else create_key)(cfg.state_dir / KEY_FILE)
    except ShardKeyError as exc:
        raise ConfigError(f"{exc} (`coordinator certs shard-key` makes one)") from exc
    try:
        plan = load_or_make_plan(cfg.state_dir, cfg.shards.count, lambda: tensor_sizes(cfg.model))
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return plan, key


def open_shards(cfg, bundle, launch: ShardLaunch | None, addresses: list[str] | None = None):
    """The lead's ``LeadShards`` for job ``cfg`` (``[shards] count > 1``), and the local shard
    processes it started (None when the shards are on hosts of their own: at ``addresses``,
    else ``shards.addresses``)."""
    from coordinator.shards.lead import LeadShards
    from wire.config_table import ConfigError
    from wire.net.channel import open_channel

    addresses = list(addresses or cfg.shards.addresses)
    plan, key = prepare_shards(cfg, remote=bool(addresses))
    local = None
    if not addresses:
        if launch is None:
            raise ConfigError("shards.addresses: needed when the lead does not start the shards")
        local = LocalShards(launch, cfg.shards.count)
        addresses = local.start()
    revive = local.revive if local is not None else None
    lead = LeadShards(plan, key, addresses, lambda a: open_channel(a, bundle), revive)
    return lead, local
