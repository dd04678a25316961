"""Running the coordinator: the gRPC server, the round clock thread, shutdown."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from coordinator.auth import Authorizer, RevocationList
from coordinator.call_gate import CallGate, CallLimits, method_handlers
from coordinator.config import JobConfig
from coordinator.core import CoordinatorCore
from coordinator.export import Exported, export_model, final_model_path, write_model_card
from coordinator.heap import return_freed_memory
from coordinator.job_end import Completion, write_completion
from coordinator.metrics import CoordinatorMetrics
from coordinator.records import FatalError
from coordinator.servicer import CoordinatorServicer
from coordinator.store import StoreError, write_atomic
from coordinator.watchdog import CallWatchdog
from wire.grpc_options import server_options
from wire.identity import Bundle

log = logging.getLogger("isthmus.coordinator")
TICK_S = 0.2


@dataclass(frozen=True)
class ServerTls:
    """The coordinator's own bundle (certificate, key, job CA) and the CA's CRL file."""

    bundle: Bundle
    crl: Path | None = None


class CoordinatorServer:
    """A coordinator serving one job until it finishes, fails or is stopped."""

    def __init__(
        self,
        cfg: JobConfig,
        listen: str | None = None,
        tls: ServerTls | None = None,
    ) -> None:
        """``tls=None`` serves plaintext without authentication (``--insecure``)."""
        self.cfg = cfg
        self.tls = tls
        return_freed_memory()
        self._lock = lock_state_dir(Path(cfg.state_dir))
        try:
            self._setup(cfg, listen)
        except BaseException:
            self.close()
            raise

    def _setup(self, cfg: JobConfig, listen: str | None) -> None:
        self.stop_event = threading.Event()
        # Every open call holds a worker thread (a push for its whole transfer, a WaitRound
        # for up to a minute). The gate bounds what each certificate may hold open, so enough
        # workers for every site's share, and a few operators', leaves threads for heartbeats
        # however one caller behaves.
        limits = CallLimits.for_transfer(cfg.transfer)
        workers = max(cfg.server.workers, (cfg.rounds.max_sites + 4) * limits.per_caller() + 8)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers),
            options=server_options(cfg.server.receive_window_bytes),
        )
        # The port first: a coordinator that cannot listen fails before touching its state.
        address = listen or cfg.server.listen
        revocations = None
        try:
            if self.tls is None:
                port = self.server.add_insecure_port(address)
            else:
                b = self.tls.bundle
                revocations = RevocationList(self.tls.crl, b.ca)
                creds = grpc.ssl_server_credentials(
                    [(b.key, b.cert)], root_certificates=b.ca, require_client_auth=True
                )
                port = self.server.add_secure_port(address, creds)
        except RuntimeError:  # grpc raises RuntimeError("Failed to bind ...")
            port = 0
        if port == 0:
            raise OSError(f"cannot listen on {address} (address in use or not local?)")
        self.address = f"{address.rpartition(':')[0]}:{port}"
        self.core = CoordinatorCore(cfg)
        write_model_card(cfg.state_dir, cfg.name, cfg.model)  # what `coordinator export` reads
        self.final: Exported | None = None
        self.stopped_by: int | None = None  # the signal that stopped the job, if one did
        authorizer = Authorizer(revocations)
        self.metrics = CoordinatorMetrics(self.core.snapshot, self.core.slots, self.core.send_slots)
        self.core.sink.observers.append(self.metrics.event)
        servicer = CoordinatorServicer(self.core, authorizer, self.metrics)
        self.watchdog = CallWatchdog()
        self.gate = CallGate(
            authorizer,
            limits,
            cfg.server.request_timeout_s,
            cfg.server.stream_idle_s,
            self.watchdog,
            on_refused=self.metrics.refused,
        )
        self.server.add_generic_rpc_handlers(method_handlers(self.gate, servicer))
        self.exit_code = 0

    def run(self) -> int:
        """Serve until the job is done and its sites have left, or until ``stop``."""
        self.server.start()
        write_atomic(Path(self.cfg.state_dir) / "address", f"{self.address}\n".encode())
        log.info("coordinator for job %r listening on %s", self.cfg.name, self.address)
        finished_at: float | None = None
        complete = False
        try:
            while not self.stop_event.is_set():
                with self.core.wake:
                    self.core.wake.wait(timeout=TICK_S)
                try:
                    while self.core.tick():
                        pass
                except (FatalError, OSError) as exc:  # OSError: stopped while the disk was full
                    log.error("stopping: %s", exc)
                    self.exit_code = 3
                    break
                if self.core.finished:
                    if finished_at is None:
                        finished_at = time.monotonic()
                        self._write_final()
                    if self.core.evaluations_done() and self._sites_gone(finished_at):
                        log.info("job %r finished; all sites have left", self.cfg.name)
                        complete = self.final is not None
                        break
        finally:
            # Bounded: grpc can leave a call it failed to decode unfinished, and then the
            # stop event never fires; the process must still exit on SIGTERM.
            self.core.wake_all()
            if not self.server.stop(grace=1.0).wait(timeout=2.0):
                log.warning("gRPC calls still open after stop; exiting anyway")
            self.core.close()
            self.watchdog.stop()
            if complete:
                self._record_completion()
            self.close()
        return self.exit_code

    def _write_final(self) -> None:
        """The final model as a file of its own, once the last checkpoint is on disk."""
        rounds = self.core.state.round.number
        out = final_model_path(self.cfg.state_dir)
        try:
            self.core.writer.wait()
            out.parent.mkdir(exist_ok=True)
            self.final = export_model(self.cfg.state_dir, out, rounds, self.core.store)
        except (StoreError, OSError) as exc:
            log.error("the final model was not written: %s", exc)
            self.exit_code = 3
            return
        log.info("final model (round %d) written to %s", rounds, self.final.path)

    def _record_completion(self) -> None:
        card = self.final.card
        done = Completion(self.cfg.name, card.round, str(self.final.path), card.theta_sha256)
        try:
            write_completion(self.cfg.state_dir, done)
        except OSError as exc:  # the model is written; a later start just serves it again
            log.warning("could not record the job as complete: %s", exc)

    def close(self) -> None:
        """Let go of the state folder (``run`` does this when it returns)."""
        if not self._lock.closed:
            self._lock.close()

    def _sites_gone(self, finished_at: float) -> bool:
        core = self.core
        with core.lock:
            live = core.members.live(core.clock())
            closed = core.state.last_closed
            last = set(closed.participants) if closed else set()
            left = {s for s, rec in core.members.sites.items() if rec.state == "left"}
        owed = final_fetch_owed(live, last, left)
        if not owed:
            return True
        if time.monotonic() - finished_at > self.cfg.timeouts.final_fetch_s:
            log.warning(
                "stopping without %s: no final fetch within timeouts.final_fetch_s=%gs",
                ", ".join(sorted(owed)),
                self.cfg.timeouts.final_fetch_s,
            )
            return True
        return False

    def stop(self, signum: int | None = None) -> None:
        """Stop serving; ``signum``: the signal that asked for it (the job did not finish)."""
        if signum is not None and self.stopped_by is None:
            self.stopped_by = signum
        self.stop_event.set()
        self.core.stopping.set()  # a write waiting for disk space gives up


def final_fetch_owed(live: set[str], last_round: set[str], left: set[str]) -> set[str]:
    """After the last round, the sites the coordinator still serves the final theta to: those
    holding a lease, and those of the last round that have not fetched it and left (one cut
    off by the WAN comes back for it). The coordinator waits for them up to
    ``timeouts.final_fetch_s``.
    """
    return set(live) | (set(last_round) - set(left))


def lock_state_dir(state_dir: Path):
    """Hold an exclusive lock on the state folder for as long as the returned file is open.

    Two coordinators on one state folder would write over each other's checkpoints and spool;
    the second one is refused here. The kernel drops the lock when the process dies, so a
    coordinator killed with -9 never leaves a stale lock behind.
    """
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        f = open(state_dir / "lock", "a+")  # noqa: SIM115 - kept open while serving
    except OSError as exc:
        raise StoreError(f"cannot use state folder {state_dir}: {exc.strerror}") from exc
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise StoreError(
            f"state folder {state_dir} is in use by another coordinator ({holder}); "
            "stop that one first, or give this job another job.state_dir"
        ) from None
    f.truncate(0)
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    return f
