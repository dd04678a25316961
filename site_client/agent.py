"""The site agent: all WAN work for one site, while torch's elastic launcher runs its trainers.

Threads, each with one job:

* heartbeats: renew the lease every ``heartbeat_interval_s`` whatever the trainers are doing,
  report their progress, learn of new tasks and of cancelled data units;
* WAN: fetch theta_r when a round opens (into a safetensors file in shared memory), and push the
  pseudo-gradients the trainers hand over;
* local IPC: answer the trainers (``site_client.trainer``) on a Unix socket.

The main thread runs the launcher (it installs signal handlers, so it must be the main thread).

The trainers work on *tasks*, ``(round, data_unit)``, kept in a ``site_client.tasks.TaskBook``;
what they may ask is in ``site_client.trainer_requests``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from safetensors.torch import load_file, save_file

from site_client.compression import (
    CODEC_STATE_FILE,
    compression_of,
    load_codec_state,
    save_codec_state,
)
from site_client.coordinator_client import (
    CoordinatorClient,
    CoordinatorError,
    GlobalState,
    PushAborted,
)
from site_client.local_ipc import IpcServer
from site_client.tasks import TaskBook, Upload, describe, task_of, unit_index
from site_client.trainer_requests import TrainerRequests
from wire.backoff import DeadlineExceeded
from wire.proto import isthmus_pb2 as pb

log = logging.getLogger("isthmus.site")


@dataclass(frozen=True)
class AgentConfig:
    site: str
    run_dir: Path
    shm_dir: Path
    inner_steps: int | None = None  # None: the job's H
    wait_poll_s: float = 1.0


def default_shm_dir(site: str) -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    return base / f"isthmus-{site}-{os.getpid()}"


class SiteAgent(TrainerRequests):
    """One site's agent: its lease, its WAN transfers, and the trainers' requests."""

    def __init__(self, cfg: AgentConfig, client: CoordinatorClient) -> None:
        self.cfg = cfg
        self.client = client
        self.cond = threading.Condition()
        self.info: pb.RoundInfo | None = None
        self.ready: dict | None = None  # theta published to the trainers
        self.held: GlobalState | None = None  # theta as fetched: the base of the next delta
        self.book = TaskBook()
        self.progress = pb.Progress(phase="idle")
        self.error: str | None = None
        self.stopping = False
        self.heartbeat_interval_s = 5.0
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        cfg.shm_dir.mkdir(parents=True, exist_ok=True)
        self.ipc = IpcServer(cfg.shm_dir / "agent.sock", self.trainer_handlers())
        self._threads: list[threading.Thread] = []

    # ---- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Join the job (with backoff) and start the agent's threads."""
        reply = self.client.join()
        self.joined(reply)
        self.ipc.start()
        for name, target in (("heartbeat", self._heartbeat_loop), ("wan", self._wan_loop)):
            t = threading.Thread(target=target, name=f"agent-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        log.info("[%s] joined job %r at round %d", self.cfg.site, self.job_name, reply.round.round)

    def joined(self, reply: pb.JoinReply) -> None:
        """Take in the join reply: job config, codec state, the first task."""
        self.heartbeat_interval_s = reply.heartbeat_interval_s or 5.0
        self.job_name = reply.job_name
        self.job_config = reply.job_config.decode("utf-8", "replace")
        self.compression = compression_of(self.job_config)
        self.codec_state = load_codec_state(self.cfg.run_dir / CODEC_STATE_FILE)
        with self.cond:
            self._take_round(reply.round)

    def stop(self, leave: bool = True) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        self.ipc.close()
        if leave:
            self.client.leave("site stopping")
        shutil.rmtree(self.cfg.shm_dir, ignore_errors=True)

    def fail(self, message: str) -> None:
        log.error("[%s] %s", self.cfg.site, message)
        with self.cond:
            self.error = message
            self.cond.notify_all()

    # ---- threads --------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        while True:
            with self.cond:
                if self.cond.wait_for(lambda: self.stopping, timeout=self.heartbeat_interval_s):
                    return
                progress = pb.Progress()
                progress.CopyFrom(self.progress)
            try:
                reply = self.client.heartbeat(progress)
            except (CoordinatorError, DeadlineExceeded) as exc:
                self.fail(f"lost the coordinator: {exc}")
                return
            self.heard(reply)

    def heard(self, reply: pb.HeartbeatReply) -> None:
        """Take in a heartbeat reply: the task asked for now, and the units cancelled."""
        with self.cond:
            self._take_round(reply.round)
            for command in reply.commands:
                if command.WhichOneof("kind") == "cancel_unit":
                    self._cancel(command.cancel_unit)

    def _take_round(self, info: pb.RoundInfo) -> None:
        """Adopt ``info`` (called under ``cond``); a malformed data unit stops the site."""
        try:
            unit_index(info.data_unit)
        except ValueError as exc:
            self.fail(f"the coordinator asked for round {info.round}: {exc}")
        self.info = info
        left = [t for t in self.book.issued if t[1] and t[0] < info.round and not self.book.done(t)]
        dropped = self.book.advance(info.round)
        what = self._let_go(left, dropped, None)
        if what:
            log.info("[%s] round %d is open: %s", self.cfg.site, info.round, "; ".join(what))
        self.cond.notify_all()

    def _cancel(self, unit: str) -> None:
        """Another copy of ``unit`` was committed first (called under ``cond``)."""
        training = [t for t in self.book.issued if t[1] == unit and not self.book.done(t)]
        known = self.info.round if self.info is not None else 0
        what = self._let_go(training, *self.book.cancel(unit, known))
        log.info(
            "[%s] unit %s was committed by another site first: %s",
            self.cfg.site,
            unit,
            "; ".join(what) or "nothing of it here",
        )
        self.cond.notify_all()

    def _let_go(self, training: list, dropped: list[Upload], aborted: Upload | None) -> list[str]:
        """Delete the files of updates no longer wanted; say what stopped, for the log."""
        for upload in dropped:
            Path(upload.path).unlink(missing_ok=True)
        what = [f"stopping the trainers on {describe(t)}" for t in training]
        what += [f"dropped the queued update of {describe(u.task)}" for u in dropped]
        if aborted is not None:
            what.append(f"withdrawing the push of {describe(aborted.task)}")
        return what

    def _wan_loop(self) -> None:
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(
                        lambda: self.stopping or self.error or self._work() is not None,
                        timeout=self.heartbeat_interval_s,
                    )
                    if self.stopping or self.error:
                        return
                    work = self._work()
                if work == "fetch":
                    self._fetch()
                elif work == "push":
                    self._push()
        except (CoordinatorError, DeadlineExceeded, OSError) as exc:
            self.fail(f"WAN transfer failed: {exc}")

    def _work(self) -> str | None:
        """What the WAN thread should do next (called under ``cond``)."""
        info = self.info
        if info is None:
            return None
        if self.book.next_upload() is not None:
            return "push"
        task = task_of(info)
        wanted = info.finished or (task is not None and not self.book.done(task))
        if wanted and (self.ready is None or self.ready["version"] != info.version):
            return "fetch"
        return None

    def _fetch(self) -> None:
        with self.cond:
            info = self.info
            self.progress.phase = "fetching"
        started = time.monotonic()
        try:
            state = self.client.fetch(info.version, held=self.held)
        except CoordinatorError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            # The coordinator moved on since the last heartbeat; the next one says where to.
            log.info("[%s] %s; waiting for the next heartbeat", self.cfg.site, exc)
            self.heard(self.client.heartbeat())
            return
        self.held = state
        path = self.cfg.shm_dir / f"theta-v{state.version}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file(state.theta, str(tmp))
        os.replace(tmp, path)
        with self.cond:
            previous = self.ready
            self.ready = {
                "round": info.round,
                "version": state.version,
                "theta_path": str(path),
                "theta_hash": state.theta_hash.hex(),
                "finished": bool(info.finished),
                "inner_steps": info.inner_steps,
                "total_rounds": info.total_rounds,
            }
            self.progress.phase = "training"
            self.cond.notify_all()
        if previous is not None and previous["theta_path"] != str(path):
            Path(previous["theta_path"]).unlink(missing_ok=True)
        log.info(
            "[%s] %s theta_%d (%s) in %.2fs",
            self.cfg.site,
            "final" if info.finished else f"round {info.round}:",
            state.version,
            state.theta_hash.hex()[:12],
            time.monotonic() - started,
        )
        if info.finished:
            self._write_final(state.version, state.theta_hash.hex())

    def _push(self) -> None:
        with self.cond:
            job = self.book.start_upload()
            if job is None:  # cancelled since the WAN thread chose to push it
                return
            self.progress.phase = "pushing"
        started = time.monotonic()
        delta = load_file(job.path)
        sent_before = self.client.bytes_sent
        residuals = {k: v.clone() for k, v in self.codec_state.state_dict().items()}
        counted = False
        try:
            reply = self.client.push(
                job.task[0],
                delta,
                weight=job.weight,
                base_version=job.version,
                data_unit=job.task[1],
                compression=self.compression,
                codec_state=self.codec_state,
                abort=lambda: job.aborted,
            )
            outcome, counted = reply.message, True
        except PushAborted:
            outcome = "withdrawn: another copy of its unit was committed first"
        except CoordinatorError as exc:
            if exc.code == grpc.StatusCode.FAILED_PRECONDITION:
                # The round closed without this site (deadline): the strategy's rule for late
                # updates applies, and the trainers go on with the next task.
                outcome = f"dropped: {exc}"
            elif exc.code == grpc.StatusCode.ALREADY_EXISTS:
                outcome = f"lost the race: {exc}"
            else:
                raise
        if counted:
            # Delivered: the residuals the encoding left are what the next update adds back.
            save_codec_state(self.cfg.run_dir / CODEC_STATE_FILE, self.codec_state)
        else:
            # Not counted, so the error it carried was never applied: keep carrying it.
            self.codec_state.load_state_dict(residuals)
            log.warning(
                "[%s] %s update not counted: %s", self.cfg.site, describe(job.task), outcome
            )
        Path(job.path).unlink(missing_ok=True)
        with self.cond:
            self.book.end_upload(job)
            self.progress.phase = "idle"
            self.cond.notify_all()
        log.info(
            "[%s] %s: pushed %.2f MB in %.2fs (%s)",
            self.cfg.site,
            describe(job.task),
            (self.client.bytes_sent - sent_before) / 1e6,
            time.monotonic() - started,
            outcome,
        )

    def _write_final(self, version: int, theta_hash: str) -> None:
        final = {
            "site": self.cfg.site,
            "version": version,
            "theta_hash": theta_hash,
            "wan_bytes_sent": self.client.bytes_sent,
            "wan_bytes_received": self.client.bytes_received,
        }
        (self.cfg.run_dir / "final.json").write_text(json.dumps(final))
