"""The agent of node k > 0 of a multi-node site: its own host's WAN transfers, no lease.

A site that spans hosts runs ``siteclient start --nnodes N --node-rank k ...`` on each. Node
0's agent is the site's member of the job (``site_client.agent.site_agent``): it joins, holds the
lease, hears the rounds and completes the site's update. The agent of every other node never joins:
its trainers pass it what node 0's agent said (the lease, the task, the layout of the update)
over their own process group, and it does for its host only what needs the WAN:

``hello`` (``attempt``) -> as node 0's agent answers, with ``node``; ``job_config`` is empty
    until ``configure``.
``configure`` (``job_config``) -> ``{}``; the job's config as node 0 received it (the
    ``[compression]`` and ``[transfer]`` rules).
``fetch`` (``version``, ``theta_hash``, ``lease``, ``boxes``) -> ``{"theta_path": ...}`` once
    the bytes of that theta holding ``boxes`` (this host's trainers' shards) are in this host's
    shared memory, each block checked against its digest (``site_client.transfer.node``).
``encode`` (``round``, ``data_unit``, ``paths``) -> ``{"part": ...}``: this host's trainers'
    shard files encoded as this node's part (``site_client.agent.node_parts``).
``push_part`` (``round``, ``data_unit``, ``layout``, ``upload_id``, ``weight``,
    ``base_version``, ``lease``) -> ``{}`` at once; the part goes up in the background
    (``site_client.transfer.node``). A part that cannot be sent fails the agent, and the next
    request of the trainers says why.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from site_client.agent.compression import compression_of
from site_client.agent.node_encoding import PartEncoder, lease_of, site_part
from site_client.agent.scratch import claim, reclaim_abandoned
from site_client.agent.state import AgentConfig
from site_client.agent.tasks import Task
from site_client.agent.wan import TIMINGS
from site_client.errors import CoordinatorError
from site_client.local_ipc import Handler, IpcServer
from site_client.timings import record
from site_client.transfer.client import CoordinatorClient
from site_client.transfer.node import Box, fetch_boxes
from wire.codecs import CodecState
from wire.transfer import transfer_from_toml

log = logging.getLogger("isthmus.site")
# None: fenced, and no newer lease passed on (``CoordinatorClient(joins=False)``).
NOT_WANTED = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS, None)


@dataclass(frozen=True)
class Held:
    """The theta this host's trainers map: its version and hash, the boxes it was fetched
    for (``boxes_key``) and its file."""

    version: int
    theta_hash: str
    boxes: str
    path: Path

    def same(self, other: Held) -> bool:
        return (self.version, self.theta_hash, self.boxes) == (
            other.version,
            other.theta_hash,
            other.boxes,
        )


def boxes_key(boxes: list[Box] | None) -> str:
    """What a fetch was for, to tell whether a held file serves another ask."""
    return "whole" if boxes is None else repr(boxes)


class NodeAgent:
    """Node ``node`` (> 0) of a site: fetches theta for its host, pushes its host's part."""

    def __init__(self, cfg: AgentConfig, client: CoordinatorClient, node: int) -> None:
        self.cfg, self.client, self.node = cfg, client, node
        self.encoder = PartEncoder(node, None, CodecState())
        self.job_config = ""
        self.error: str | None = None
        self.held: Held | None = None  # the theta this host's trainers map now
        self._fetch_lock = threading.Lock()
        self._fetches = 0  # names each fetched file: a new one never truncates a mapped one
        self._pushes: queue.Queue = queue.Queue()
        self._pending = 0
        self._cond = threading.Condition()
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        reclaim_abandoned(cfg.shm_dir.parent, cfg.site, keep=cfg.shm_dir)
        self._owner = claim(cfg.shm_dir)
        self.ipc = IpcServer(cfg.shm_dir / "agent.sock", self.handlers())
        self._worker = threading.Thread(target=self._push_loop, name="node-push", daemon=True)

    def handlers(self) -> dict[str, Handler]:
        return {
            "hello": self.hello,
            "configure": self.configure,
            "fetch": self.fetch,
            "encode": self._checked(self.encoder.encode),
            "push_part": self._checked(self.push_part),
        }

    def start(self) -> None:
        self.ipc.start()
        self._worker.start()
        log.info(
            "[%s] node %d: agent ready (node 0 holds the site's lease)", self.cfg.site, self.node
        )

    def stop(self) -> None:
        self._pushes.put(None)
        if self._worker.is_alive():
            self._worker.join(timeout=5)
        self.ipc.close()
        shutil.rmtree(self.cfg.shm_dir, ignore_errors=True)
        self._owner.close()

    def finish_pushes(self, timeout_s: float) -> bool:
        """Wait until every part handed over is pushed (or failed); False after ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(lambda: self.error or not self._pending, timeout_s)

    # ---- requests -------------------------------------------------------------------------

    def _checked(self, handler: Handler) -> Handler:
        def run(req: dict) -> dict:
            if self.error:
                raise RuntimeError(self.error)
            return handler(req)

        return run

    def hello(self, req: dict) -> dict:
        return {
            "site": self.cfg.site,
            "node": self.node,
            "nodes": self.cfg.nodes,
            "run_dir": str(self.cfg.run_dir),
            "shm_dir": str(self.cfg.shm_dir),
            "job_config": self.job_config,
            "checkpoint_url": self.cfg.checkpoint_url,
            "checkpoint_dir": self.cfg.checkpoint_dir,
        }

    def configure(self, req: dict) -> dict:
        self.job_config = str(req["job_config"])
        self.encoder.compression = compression_of(self.job_config)
        self.client.transfer = transfer_from_toml(self.job_config.encode())
        return {}

    def fetch(self, req: dict) -> dict:
        """The bytes of theta ``version`` holding ``boxes`` (None: all of it) in this host's
        shared memory, in a file of their own: a file fetched for other boxes (the ranks were
        placed otherwise after a restart) is never handed out for these."""
        version, want = int(req["version"]), str(req["theta_hash"])
        given = req.get("boxes")
        boxes = None if given is None else sorted(Box.from_json(b) for b in given)
        asked = Held(version, want, boxes_key(boxes), Path())
        with self._fetch_lock:
            held = self.held
            if held is not None and held.same(asked):
                return {"theta_path": str(held.path)}
            self._adopt(req["lease"])
            self._fetches += 1
            dest = self.cfg.shm_dir / f"theta-v{version}-{want[:12]}-{self._fetches}.safetensors"
            try:
                moved = fetch_boxes(self.client, version, want, boxes, dest)
            except BaseException:
                dest.unlink(missing_ok=True)
                raise
            if held is not None:
                Path(held.path).unlink(missing_ok=True)  # trainers keep their mapping
            self.held = Held(version, want, asked.boxes, dest)
        log.info(
            "[%s] node %d: theta_%d (%s): %.2f MB of its trainers' shards",
            self.cfg.site,
            self.node,
            version,
            want[:12],
            moved / 1e6,
        )
        return {"theta_path": str(dest)}

    def push_part(self, req: dict) -> dict:
        task = Task(int(req["round"]), str(req.get("data_unit", "")))
        payload, part = site_part(self.encoder.take(task), req["layout"], self.node)
        with self._cond:
            self._pending += 1
        self._pushes.put((task, payload, part, req))
        return {}

    # ---- the push thread ------------------------------------------------------------------

    def _push_loop(self) -> None:
        while (item := self._pushes.get()) is not None:
            task, payload, part, req = item
            sent, started = self.client.bytes_sent, time.monotonic()
            try:
                self._adopt(req["lease"])
                self.client.push(
                    task.round,
                    payload,
                    weight=float(req["weight"]),
                    base_version=int(req["base_version"]),
                    upload_id=str(req["upload_id"]),
                    data_unit=task.unit,
                    part=part,
                )
                seconds, sent = time.monotonic() - started, self.client.bytes_sent - sent
                record(
                    self.cfg.run_dir / TIMINGS,
                    "push",
                    round=task.round,
                    s=seconds,
                    bytes=sent,
                    part=part.length,
                )
                log.info(
                    "[%s] node %d: round %d: pushed its part, %.2f MB in %.2fs",
                    self.cfg.site,
                    self.node,
                    task.round,
                    sent / 1e6,
                    seconds,
                )
            except Exception as exc:  # any failure stops this host's trainers, saying why
                self._failed(task, exc)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def _adopt(self, value: dict) -> None:
        """Work under node 0's lease ``value`` unless a newer one is held already (the fetch
        and the push threads each pass on the one they were given)."""
        lease = lease_of(value)
        with self._cond:
            held = self.client.lease
            if held is None or lease.token >= held.token:
                self.client.lease = lease

    def _failed(self, task: Task, exc: BaseException) -> None:
        site, node = self.cfg.site, self.node
        if exc_is_fenced(exc):
            log.warning("[%s] node %d: round %d's part not taken: %s", site, node, task.round, exc)
            return
        self.error = f"node {node}: pushing round {task.round}'s part failed: {exc}"
        log.error("[%s] %s", site, self.error)


def exc_is_fenced(exc: BaseException) -> bool:
    """A refusal that only says the part is no longer wanted (its round closed, another copy
    of its unit won, the lease it was sent under was fenced): the site goes on."""
    return isinstance(exc, CoordinatorError) and exc.code in NOT_WANTED
