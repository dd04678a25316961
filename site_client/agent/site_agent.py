"""The site agent: all WAN work for one site, while torch's elastic launcher runs its trainers.

Composed of parts, each with one job, over one shared ``AgentState``:

* ``TrainerChannel``: answers the trainers (``site_client.trainer.session``) on a Unix socket;
* ``WanWorker``: fetches theta_r when a task needs it, pushes the updates handed over;
* three threads here: heartbeats (renew the lease every ``heartbeat_interval_s`` whatever the
  trainers are doing, report their progress), the round watch (a ``WaitRound`` long-poll, so
  the site hears of a new round, a backup unit or a cancelled one the moment it happens rather
  than on its next heartbeat), and the WAN worker's loop.

The main thread runs the launcher (it installs signal handlers, so it must be the main thread).
"""

from __future__ import annotations

import logging
import shutil
import threading
import tomllib

from site_client.agent.compression import CODEC_STATE_FILE, compression_of, load_codec_state
from site_client.agent.node_encoding import PartEncoder
from site_client.agent.scratch import claim, reclaim_abandoned
from site_client.agent.state import AgentConfig, AgentState, default_shm_dir
from site_client.agent.trainer_channel import TrainerChannel
from site_client.agent.wan import WanWorker
from site_client.local_ipc import IpcServer
from site_client.transfer.client import CoordinatorClient, CoordinatorError
from wire.backoff import DeadlineExceeded
from wire.codecs.adaptive import overlap_of
from wire.proto import isthmus_pb2 as pb

__all__ = ["AgentConfig", "SiteAgent", "default_shm_dir"]
log = logging.getLogger("isthmus.site")
WATCH_TIMEOUT_S = 30.0


class SiteAgent:
    """One site's agent: its lease, its WAN transfers, and the trainers' requests."""

    def __init__(self, cfg: AgentConfig, client: CoordinatorClient) -> None:
        self.cfg = cfg
        self.client = client
        self.state = AgentState(cfg.site)
        self.channel = TrainerChannel(self.state, cfg)
        self.wan: WanWorker | None = None
        self.heartbeat_interval_s = 5.0
        self.job_name = ""
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        # A killed agent of this site could not remove its folder: its theta is still in memory.
        reclaim_abandoned(cfg.shm_dir.parent, cfg.site, keep=cfg.shm_dir)
        self._owner = claim(cfg.shm_dir)
        self.ipc = IpcServer(cfg.shm_dir / "agent.sock", self.channel.handlers())
        self._threads: list[threading.Thread] = []

    @property
    def error(self) -> str | None:
        return self.state.error

    @property
    def codec_state(self):
        """The error-feedback residuals of this site's updates (``wire.codecs.CodecState``)."""
        return self.wan.codec_state

    def heard(self, reply: pb.HeartbeatReply | pb.WaitRoundReply) -> None:
        """Take in what the coordinator said: the task asked for now, units cancelled."""
        self.state.heard(reply.round, reply.commands)

    # ---- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Join the job (with backoff) and start the agent's threads."""
        reply = self.client.join()
        self.joined(reply)
        self.ipc.start()
        loops = (
            ("heartbeat", self._heartbeat_loop),
            ("watch", self._watch_loop),
            ("wan", lambda: self.wan.loop(self.heartbeat_interval_s)),
        )
        for name, target in loops:
            t = threading.Thread(target=target, name=f"agent-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        log.info("[%s] joined job %r at round %d", self.cfg.site, self.job_name, reply.round.round)

    def joined(self, reply: pb.JoinReply) -> None:
        """Take in the join reply: job config, codec state, the first task."""
        self.heartbeat_interval_s = reply.heartbeat_interval_s or 5.0
        self.job_name = reply.job_name
        job_config = reply.job_config.decode("utf-8", "replace")
        self.channel.job_config = job_config
        self.channel.streaming = "streaming" in _toml_or_empty(job_config)
        codec_state = load_codec_state(self.cfg.run_dir / CODEC_STATE_FILE)
        self.wan = WanWorker(
            self.state,
            self.client,
            self.cfg,
            compression_of(job_config),
            codec_state,
            overlap_of(_toml_or_empty(job_config)),
        )
        if self.cfg.nodes > 1:
            if self.wan.codecs.adaptive:
                log.warning(
                    "[%s] compression.mode = 'adaptive' is not built for sites of several "
                    "hosts: every part goes up with the ladder's first rung",
                    self.cfg.site,
                )
            self.channel.encoder = PartEncoder(0, self.wan.compression, codec_state)
            self.channel.lease = lambda: self.client.lease
        self.state.heard(reply.round, [])

    def stop(self, leave: bool = True, reason: str = "site stopping") -> None:
        with self.state.cond:
            self.state.stopping = True
            self.state.cond.notify_all()
        # Leave first, while the lease is still renewed: the round watch may sit in a
        # WaitRound for a while yet, and no heartbeat goes out once the loops are told to stop.
        if leave:
            self.client.leave(reason)
        for t in self._threads:
            t.join(timeout=0.5 if t.name == "agent-watch" else 5)
        self.ipc.close()
        shutil.rmtree(self.cfg.shm_dir, ignore_errors=True)
        self._owner.close()

    def finish_pushes(self, timeout_s: float) -> bool:
        """After the trainers left: wait until the updates they handed over are pushed (or
        given up on); False if some were still unsent after ``timeout_s``."""
        s = self.state
        with s.cond:
            return s.cond.wait_for(lambda: s.error or not s.book.pending, timeout=timeout_s)

    def fail(self, message: str) -> None:
        self.state.fail(message)

    # ---- threads --------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        s = self.state
        while True:
            with s.cond:
                if s.cond.wait_for(lambda: s.stopping, timeout=self.heartbeat_interval_s):
                    return
                progress = pb.Progress()
                progress.CopyFrom(s.progress)
                health = s.health
            try:
                reply = self.client.heartbeat(progress, health)
            except (CoordinatorError, DeadlineExceeded) as exc:
                if not s.stopping:  # a heartbeat in flight while the site leaves: no loss
                    self.fail(f"lost the coordinator: {exc}")
                return
            self.heard(reply)

    def _watch_loop(self) -> None:
        """Hear of every change to what this site should do as it happens."""
        s = self.state
        while True:
            with s.cond:
                if s.stopping or s.error:
                    return
                known = None
                if s.info is not None:
                    known = pb.RoundInfo()
                    known.CopyFrom(s.info)
            try:
                reply = self.client.wait_round(known, WATCH_TIMEOUT_S)
            except (CoordinatorError, DeadlineExceeded):
                # The heartbeat thread decides when the coordinator is lost; watch again soon.
                with s.cond:
                    s.cond.wait_for(lambda: s.stopping, timeout=self.heartbeat_interval_s)
                continue
            self.heard(reply)


def _toml_or_empty(text: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return {}
