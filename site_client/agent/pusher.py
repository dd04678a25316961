"""The agent's push of one update (``WanWorker`` runs it on its WAN thread): encode it at the
rung the link allows, send it, and settle what its outcome means: counted (the residuals it
left are kept), not counted (they are given back), early or late for a later round of its
fragment (it waits, to be encoded again the same), or dropped."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc

from site_client.agent.compression import CODEC_STATE_FILE, UplinkCodecs, save_codec_state
from site_client.agent.state import AgentConfig, AgentState
from site_client.agent.tasks import describe, task_of
from site_client.agent.update_payload import build_payload, piece_shapes, residual_snapshot
from site_client.errors import CoordinatorError, PartsStalled, PushAborted
from site_client.timings import record
from site_client.transfer.push import fold_round
from wire.codecs import CodecState

log = logging.getLogger("isthmus.site")
TIMINGS = "timings.jsonl"


class UpdatePusher:
    """Pushes the next update of the site's queue (``TaskBook``); ``measured`` takes each push's
    bytes and seconds for the link models."""

    def __init__(
        self,
        state: AgentState,
        client,
        cfg: AgentConfig,
        codecs: UplinkCodecs,
        codec_state: CodecState,
        measured: Callable[[str, int, float], None],
    ) -> None:
        self.state, self.client, self.cfg = state, client, cfg
        self.codecs, self.codec_state, self.measured = codecs, codec_state, measured
        self._choice = None  # the adaptive choice behind the update being pushed

    def push(self) -> None:
        s = self.state
        with s.cond:
            job = s.book.start_upload(s.info)
            if job is None:  # cancelled since the WAN thread chose to push it
                return
            s.progress.phase = "pushing"
        started = time.monotonic()
        sent_before = self.client.bytes_sent
        residuals = residual_snapshot(self.codec_state)
        outcome, counted, cpu_s, wire_s = self._send(job)
        if outcome is None:  # early, or late for a later round: push it once that is open
            self._hold(job, residuals)
            return
        self._settle_residuals(job, counted, residuals, outcome)
        job.discard_files()  # a held payload keeps its mapping of them
        with s.cond:
            s.book.end_upload(job, counted)
            if counted and s.info is not None and task_of(s.info) == job.task:
                # An ask for it again heard meanwhile predates this count: the
                # coordinator's next reply says whether it still wants it.
                s.info.update_wanted = False
            s.progress.phase = "idle"
            s.cond.notify_all()
        sent, seconds = self.client.bytes_sent - sent_before, time.monotonic() - started
        held_s = getattr(self.client, "last_push_held_s", 0.0)
        self.measured("push", sent, wire_s - held_s)  # the encoding left out
        with s.cond:
            s.transfers.add("push", seconds, held_s)
        record(
            self.cfg.run_dir / TIMINGS,
            "push",
            round=job.task.round,
            unit=job.task.unit,
            s=seconds,
            bytes=sent,
            held_s=held_s,
            counted=counted,
            cpu_s=round(cpu_s, 4),
            **(self._choice.as_record() if self._choice is not None else {}),
        )
        log.info(
            "[%s] %s: pushed %.2f MB in %.2fs (%s)",
            self.cfg.site,
            describe(job.task),
            sent / 1e6,
            seconds,
            outcome,
        )

    def _hold(self, job, residuals) -> None:
        """``job`` waits: for the coordinator to reach its round (refused as early), or for
        the later round it folds into (``job.fold_round``); encoded again then, the same."""
        s = self.state
        self.codec_state.load_state_dict(residuals)
        with s.cond:
            if job.fold_round is not None:
                s.book.defer(job, job.fold_round)
            else:
                s.book.hold(job)
            s.progress.phase = "idle"
            s.cond.notify_all()
        waits_for = (
            "the coordinator to reach it"
            if job.fold_round is None
            else f"round {job.fold_round}, the round of its fragment it folds into"
        )
        log.info("[%s] %s: waiting for %s", self.cfg.site, describe(job.task), waits_for)

    def _send(self, job) -> tuple[str | None, bool, float, float]:
        """Push ``job`` (its held payload when it is sent again); the outcome for the log,
        whether it counted, and the process's CPU seconds and the wall seconds while the push
        ran (the transfer alone, without the encoding before it). Outcome None: refused as
        early, to be pushed later."""
        resend = job.payload is not None and job.part is None  # a part is placed at hand-off
        self._choice = None
        if job.payload is None:
            with self.state.cond:
                compute_s = self.state.compute.last_task_s
            shapes = piece_shapes(job.paths) if self.codecs.adaptive else []
            compression, self._choice = self.codecs.choose(shapes, compute_s)
            job.payload = build_payload(job.paths, compression, self.codec_state)
        cpu, wall = time.process_time(), time.monotonic()
        outcome, counted = self._outcome(job, resend)
        return outcome, counted, time.process_time() - cpu, time.monotonic() - wall

    def _outcome(self, job, resend: bool) -> tuple[str | None, bool]:
        try:
            reply = self.client.push(
                job.task.round,
                job.payload,
                weight=job.weight,
                base_version=job.version,
                data_unit=job.task.unit,
                abort=lambda: job.aborted,
                hold=job.durable,
                # A multi-node site: this host's part, under the id every node pushes with.
                upload_id=job.upload_id,
                part=job.part,
            )
            return reply.message, True
        except PartsStalled as exc:
            return f"withdrawn: {exc}", False
        except PushAborted:
            return "withdrawn: another copy of its unit was committed first", False
        except CoordinatorError as exc:
            if exc.code == grpc.StatusCode.FAILED_PRECONDITION:
                later = fold_round(exc)
                if later is not None and not resend and job.fold_round != later:
                    job.fold_round = later  # late: the coordinator folds it into that round
                    if job.part is None:
                        job.payload = None  # encoded again then
                    return None, False
                if not resend and self._behind(job.task.round):
                    if job.part is None:
                        job.payload = None  # encoded again once the coordinator is there
                    return None, False
                # The round closed without this site (deadline): the strategy's rule for late
                # updates applies, and the trainers go on with the next task.
                return f"dropped: {exc}", False
            if exc.code == grpc.StatusCode.ALREADY_EXISTS:
                return f"lost the race: {exc}", False
            raise

    def _behind(self, round_number: int) -> bool:
        """Whether the coordinator is at a round before ``round_number``, or at that round
        but has not opened it to this site yet (asked afresh: a restarted or new leader
        replaying the round before)."""
        reply = self.client.heartbeat()
        self.state.heard(reply.round, reply.commands)
        with self.state.cond:
            info = self.state.info
            unopened = info.round == round_number and not info.participant
            return not info.finished and (info.round < round_number or unopened)

    def _settle_residuals(self, job, counted: bool, residuals, outcome: str) -> None:
        if counted:
            # Delivered: the residuals the encoding left are what the next update adds back.
            save_codec_state(self.cfg.run_dir / CODEC_STATE_FILE, self.codec_state)
            return
        # Not counted, so the error it carried was never applied: keep carrying it.
        self.codec_state.load_state_dict(residuals)
        log.warning("[%s] %s update not counted: %s", self.cfg.site, describe(job.task), outcome)
