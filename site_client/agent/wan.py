"""The agent's WAN worker: fetch theta when a task needs it, push the updates handed over.

Theta arrives straight into a safetensors file in shared memory (``theta-vN.safetensors``),
whole or rebuilt from the delta to the version held; the trainers map their own boxes of it.
The file of the theta before last is written over in place once no process maps it
(``site_client.agent.theta_spare``).
An update goes up as the trainers' shard files, encoded piece by piece
(``site_client.agent.update_payload``), pushed by ``site_client.agent.pusher``. Its last chunk
waits until the trainers' checkpoint of the task is on disk: once the coordinator counts the
update, the site can always go on exactly from where that update left it.

A counted update stays held (``site_client.agent.tasks``): when the coordinator says it lost its
copy (``RoundInfo.update_wanted``, after a restart found the spooled file damaged) the same payload
is pushed again, byte for byte. An update for a round the coordinator is not at yet waits (a
restarted coordinator may have gone back to the round before, to take such an update back).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import grpc

from site_client.agent.compression import UplinkCodecs
from site_client.agent.pusher import TIMINGS, UpdatePusher
from site_client.agent.state import AgentConfig, AgentState, Offer
from site_client.agent.tasks import describe, task_of
from site_client.agent.theta_spare import ThetaSpare
from site_client.errors import CoordinatorError
from site_client.timings import record
from site_client.transfer.theta import GlobalState
from wire.backoff import DeadlineExceeded
from wire.codecs import CodecState
from wire.codecs.rules import CompressionConfig
from wire.safetensors_io import map_tensors, write_tensors

log = logging.getLogger("isthmus.site")


class WanWorker:
    def __init__(
        self,
        state: AgentState,
        client,
        cfg: AgentConfig,
        compression: CompressionConfig | None,
        codec_state: CodecState,
        overlap: float = 1.0,
    ) -> None:
        self.state, self.client, self.cfg = state, client, cfg
        self.compression, self.codec_state = compression, codec_state
        # The codec of each update (``mode = "adaptive"``: chosen from the pushes before).
        self.codecs = UplinkCodecs(compression, overlap, cfg.site)
        self.pusher = UpdatePusher(state, client, cfg, self.codecs, codec_state, self._measured)
        self.spare = ThetaSpare(cfg.shm_dir)  # the theta before last, written over by the next

    def loop(self, interval_s: float) -> None:
        """The WAN thread: wait for work, do it, until the agent stops or fails."""
        state = self.state
        try:
            while True:
                with state.cond:
                    state.cond.wait_for(
                        lambda: state.stopping or state.error or self.work() is not None,
                        timeout=interval_s,
                    )
                    if state.stopping or state.error:
                        return
                    work = self.work()
                if work == "fetch":
                    self.fetch()
                elif work == "resend":
                    self.resend()
                elif work == "push":
                    self.push()
        except (CoordinatorError, DeadlineExceeded, OSError) as exc:
            if state.stopping:  # the site left meanwhile (its trainers failed, say): not a cause
                log.info("[%s] WAN transfer ended as the site stops: %s", self.cfg.site, exc)
                return
            state.fail(f"WAN transfer failed: {exc}")

    def work(self) -> str | None:
        """What to do next (called under ``cond``)."""
        s = self.state
        if s.info is None:
            return None
        if s.book.wanted_again(s.info) is not None:
            return "resend"
        upload = s.book.next_upload(s.info)
        if upload is not None and _may_push(upload, s.info):
            return "push"
        task = task_of(s.info)
        # A drained site leaves once it has pushed what it owes: the job's final theta is
        # not its to take (the job may finish while it is leaving).
        final = s.info.finished and not s.drained
        wanted = final or (task is not None and not s.book.done(task))
        if wanted and not _holds(s.ready, s.info):
            return "fetch"
        return None

    def resend(self) -> None:
        """Queue the delivered update the coordinator asks for again, then push it."""
        s = self.state
        with s.cond:
            task = s.book.wanted_again(s.info)
            if task is None or s.book.take_back(task) is None:
                return
            # Acted on: the coordinator's next reply says whether it still wants it.
            s.info.update_wanted = False
        log.warning(
            "[%s] the coordinator lost its copy of the %s update: sending it again",
            self.cfg.site,
            describe(task),
        )
        self.push()

    def fetch(self) -> None:
        s = self.state
        with s.cond:
            info, held = s.info, s.held
            s.progress.phase = "fetching"
        name = f"theta-v{info.version}"
        if held is not None and held.version == info.version:
            # Same version, another theta: a restarted coordinator had to close its round
            # again without an update it lost. Fetched whole, into a new file (the trainers
            # may still map the old one).
            log.warning("[%s] theta_%d changed; fetching it again", self.cfg.site, info.version)
            held, name = None, f"{name}-{info.theta_hash.hex()[:12]}"
        started, cpu = time.monotonic(), time.process_time()
        received = self.client.bytes_received
        dest = self.cfg.shm_dir / f"{name}.safetensors"
        over_spare = self.spare.place(dest)
        got = self._fetch_into(info, held, dest)
        if got is None:
            return
        cpu_s = time.process_time() - cpu
        seconds = time.monotonic() - started
        got_bytes = self.client.bytes_received - received
        self._measured("fetch", got_bytes, seconds)
        with s.cond:
            s.transfers.add("fetch", seconds)
            previous = s.ready
            s.held = got
            s.ready = Offer(
                info.round,
                got.version,
                str(got.path),
                got.theta_hash.hex(),
                bool(info.finished),
                info.inner_steps,
                info.total_rounds,
            )
            s.progress.phase = "training"
            s.cond.notify_all()
        record(
            self.cfg.run_dir / TIMINGS,
            "fetch",
            version=got.version,
            s=seconds,
            bytes=got_bytes,
            cpu_s=round(cpu_s, 4),
            over_spare=over_spare,
        )
        if previous is not None and previous.theta_path != str(got.path):
            # Trainers may still read it: kept, and written over only once none maps it.
            self.spare.keep(Path(previous.theta_path))
        log.info(
            "[%s] %s theta_%d (%s) in %.2fs",
            self.cfg.site,
            "final" if info.finished else f"round {info.round}:",
            got.version,
            got.theta_hash.hex()[:12],
            seconds,
        )
        if info.finished:
            self.write_final(got.version, got.theta_hash.hex())

    def _fetch_into(self, info, held: GlobalState | None, dest: Path) -> GlobalState | None:
        """Theta ``info.version`` into ``dest``; None when it is no longer served (the round
        was asked for again)."""
        try:
            got = self.client.fetch(info.version, held=held, dest=dest)
            if got.path is None:  # served in a layout the file could not take: write it out
                write_tensors(dest, got.theta)
                file = map_tensors(dest)
                got = GlobalState(got.version, file.tensors, got.theta_hash, dest, file)
            return got
        except CoordinatorError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            # The coordinator moved on since we last heard; ask it where to.
            log.info("[%s] %s; asking for the round again", self.cfg.site, exc)
            reply = self.client.heartbeat()
            self.state.heard(reply.round, reply.commands)
            return None

    def push(self) -> None:
        self.pusher.push()

    def _measured(self, direction: str, nbytes: int, seconds: float) -> None:
        """A transfer into the link models (``UplinkCodecs.measured``); the fetch model goes
        to the coordinator with each heartbeat (its adaptive downlink reads it)."""
        self.codecs.measured(direction, nbytes, seconds)
        with self.state.cond:
            self.state.progress.fetch_bytes_per_s = self.codecs.down.bytes_per_s or 0.0
            self.state.progress.fetch_latency_s = self.codecs.down.latency_s

    def write_final(self, version: int, theta_hash: str) -> None:
        final = {
            "site": self.cfg.site,
            "version": version,
            "theta_hash": theta_hash,
            "wan_bytes_sent": self.client.bytes_sent,
            "wan_bytes_received": self.client.bytes_received,
        }
        (self.cfg.run_dir / "final.json").write_text(json.dumps(final))


def _may_push(upload, info) -> bool:
    """Whether ``upload`` may go now: its round is the coordinator's or past, and a push
    refused as early waits until the round is open to this site."""
    if info.finished or upload.task.round < info.round:
        return True
    return upload.task.round == info.round and (info.participant or not upload.early)


def _holds(ready: Offer | None, info) -> bool:
    """Whether the theta published to the trainers is the one ``info`` names."""
    if ready is None or ready.version != info.version:
        return False
    return not info.theta_hash or ready.theta_hash == info.theta_hash.hex()
