"""Running the coordinator: the gRPC server, the round clock thread, shutdown."""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from coordinator.config import JobConfig
from coordinator.core import CoordinatorCore
from coordinator.ha.election import standby_message
from coordinator.ha.options import HaOptions, advertised
from coordinator.ha.role import Deposed, HaRole, Term
from coordinator.observe.metrics import CoordinatorMetrics
from coordinator.persist.export import Exported, export_model, final_model_path, write_model_card
from coordinator.persist.local_store import StoreError, write_atomic
from coordinator.persist.open_store import open_store
from coordinator.records import FatalError
from coordinator.service.auth import Authorizer, RevocationList
from coordinator.service.call_gate import CallGate, CallLimits, method_handlers
from coordinator.service.heap import return_freed_memory
from coordinator.service.job_end import (
    Completion,
    already_complete,
    complete_message,
    completion_bytes,
    parse_completion,
    write_completion,
)
from coordinator.service.server_process import lock_state_dir
from coordinator.service.servicer import CoordinatorServicer
from coordinator.service.watchdog import CallWatchdog
from coordinator.shards.local import ShardLaunch, open_shards, prepare_shards
from coordinator.shards.registry import resolve
from wire.identity import Bundle, identity_of
from wire.net.grpc_options import server_options
from wire.net.host_tuning import log_tcp_advice

log = logging.getLogger("isthmus.coordinator")
TICK_S = 0.2
DEPOSED_EXIT = 4  # ``serve --ha``: this coordinator lost the leadership (restart it to stand by)


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
        ha: HaOptions | None = None,
        shard_launch: ShardLaunch | None = None,
    ) -> None:
        """``tls=None`` serves plaintext without authentication (``--insecure``); ``ha``: stand
        by until elected through etcd (``coordinator.ha.role``), then load the newest checkpoint;
        ``shard_launch``: how to start shards 1..K-1 here (``[shards]`` without addresses)."""
        self.cfg = cfg
        self.tls = tls
        self.ha: HaRole | None = None
        self.core: CoordinatorCore | None = None
        self.final: Exported | None = None
        self.stopped_by: int | None = None  # the signal that stopped the job, if one did
        self.on_lead: list = []  # run once this coordinator serves the job (pages, metrics)
        self.exit_code = 0
        self.stop_event = threading.Event()
        return_freed_memory()
        self._lock = lock_state_dir(Path(cfg.state_dir))
        self.shards, self.local_shards = None, None
        try:
            self._bind(cfg, listen)
            if cfg.shards.count > 1 and ha is None:
                self._open_shards(cfg, shard_launch)
            elif cfg.shards.count > 1:  # checked now; the shards are found once elected
                prepare_shards(cfg, remote=True)
            if ha is None:
                self.server.add_generic_rpc_handlers(self._build(cfg))
            else:
                where = advertised(listen or cfg.server.listen, self.address, ha.advertise)
                self.ha = HaRole(replace(ha, advertise=where), self.authorizer)
                self.server.add_generic_rpc_handlers((self.ha.switch,))
        except BaseException:
            self.close()
            raise

    def _open_shards(
        self, cfg: JobConfig, launch: ShardLaunch | None, addresses: list[str] | None = None
    ) -> None:
        """Shards 1..K-1: started here (on this coordinator's host) or reached at their
        addresses; the lead's channels to them use this coordinator's certificate."""
        bundle = self.tls.bundle if self.tls is not None else None
        if launch is not None:
            lead = identity_of(bundle.cert).name if bundle is not None else ""
            launch = replace(launch, host=self.address.rpartition(":")[0], lead=lead)
        self.shards, self.local_shards = open_shards(cfg, bundle, launch, addresses)

    def _find_shards(self) -> bool:
        """Under ``--ha``, once elected: the shards of ``[shards] addresses``, else as they
        registered in etcd (``coordinator.shards.registry``); False if stopped first."""
        count = self.cfg.shards.count
        addresses = list(self.cfg.shards.addresses) or resolve(self.ha.opts, count, self.stop_event)
        if addresses is None:
            return False
        log.info("leading %d shard(s) beside this one: %s", count - 1, ", ".join(addresses))
        self._open_shards(self.cfg, None, addresses)
        return True

    def _bind(self, cfg: JobConfig, listen: str | None) -> None:
        # Every open call holds a worker thread (a push for its whole transfer, a WaitRound
        # for up to a minute). The gate bounds what each certificate may hold open, so enough
        # workers for every site's share, and a few operators', leaves threads for heartbeats
        # however one caller behaves.
        self.limits = CallLimits.for_transfer(cfg.transfer)
        per_caller = self.limits.per_caller()
        workers = max(cfg.server.workers, (cfg.rounds.max_sites + 4) * per_caller + 8)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc-handler"),
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
        self.authorizer = Authorizer(revocations)

    def _build(self, cfg: JobConfig, term: Term | None = None) -> tuple:
        """The core (the state, from the newest checkpoint) and the handlers that serve it."""
        self.core = CoordinatorCore(cfg, term=term, shards=self.shards)
        write_model_card(cfg.state_dir, cfg.name, cfg.model)  # what `coordinator export` reads
        self.metrics = CoordinatorMetrics(self.core.snapshot, self.core.slots, self.core.send_slots)
        self.core.sink.observers.append(self.metrics.event)
        leader = self.ha.opts.advertise if self.ha is not None else ""
        servicer = CoordinatorServicer(self.core, self.authorizer, self.metrics, leader=leader)
        self.watchdog = CallWatchdog()
        self.gate = CallGate(
            self.authorizer,
            self.limits,
            cfg.server.request_timeout_s,
            cfg.server.stream_idle_s,
            self.watchdog,
            on_refused=self.metrics.refused,
        )
        return method_handlers(self.gate, servicer)

    def run(self) -> int:
        """Serve until the job is done and its sites have left, or until ``stop``; with
        ``ha``, stand by until elected first."""
        self.server.start()
        write_atomic(Path(self.cfg.state_dir) / "address", f"{self.address}\n".encode())
        log.info("coordinator for job %r listening on %s", self.cfg.name, self.address)
        log_tcp_advice(log, self.address, sends_on_kept_connections=True)  # every fetch
        complete = False
        try:
            if self.ha is not None and not self._take_over():
                return self.exit_code
            for hook in self.on_lead:
                hook()
            complete = self._serve_rounds()
        finally:
            self._shut_down(complete)
        return self.exit_code

    def _take_over(self) -> bool:
        """Stand by, then build the core once elected; False if stopped (or failed) first."""
        self.ha.start()
        term = self.ha.wait_elected(self.stop_event)
        if term is None or self._complete_in_store():
            return False
        if self.cfg.shards.count > 1 and not self._find_shards():
            return False
        try:
            self.ha.switch.lead(self._build(self.cfg, term))
        except (StoreError, FatalError, OSError) as exc:  # deposed while loading, a bad store
            log.error("cannot take over: %s", exc)
            self.exit_code = 3 if not isinstance(exc, Deposed) else DEPOSED_EXIT
            return False
        return True

    def _serve_rounds(self) -> bool:
        """The round clock; True once the job is complete and its sites have left."""
        finished_at: float | None = None
        while not self.stop_event.is_set():
            with self.core.wake:
                self.core.wake.wait(timeout=TICK_S)
            if self.ha is not None and (lost := self.ha.lost()) is not None:
                self.ha.step_down()
                log.error("stepping down: %s", standby_message(lost))
                self.exit_code = DEPOSED_EXIT
                return False
            try:
                while self.core.tick():
                    pass
            except (FatalError, OSError) as exc:  # OSError: stopped while the disk was full
                log.error("stopping: %s", exc)
                self.exit_code = 3
                return False
            if self.core.finished:
                if finished_at is None:
                    finished_at = time.monotonic()
                    self._write_final()
                if self.core.evaluations_done() and self._sites_gone(finished_at):
                    log.info("job %r finished; all sites have left", self.cfg.name)
                    return self.final is not None
        return False

    def _shut_down(self, complete: bool) -> None:
        # Bounded: grpc can leave a call it failed to decode unfinished, and then the
        # stop event never fires; the process must still exit on SIGTERM.
        if self.ha is not None:
            self.ha.step_down()
        if self.core is not None:
            self.core.wake_all()
        if not self.server.stop(grace=1.0).wait(timeout=2.0):
            log.warning("gRPC calls still open after stop; exiting anyway")
        if self.core is not None:
            self.core.close()
        if getattr(self, "watchdog", None) is not None:
            self.watchdog.stop()
        if complete:
            self._record_completion()
        if self.ha is not None:  # after the last checkpoint: a standby takes over from it
            self.ha.close()
        self.close()

    def _write_final(self) -> None:
        """The final model as a file of its own, once the last checkpoint is on disk."""
        rounds = self.core.state.round.number
        out = final_model_path(self.cfg.state_dir)
        try:
            self.core.writer.wait()
            out.parent.mkdir(exist_ok=True)
            self.final = export_model(
                self.cfg.state_dir, out, rounds, self.core.store, self.core.shards
            )
        except (StoreError, OSError) as exc:
            log.error("the final model was not written: %s", exc)
            self.exit_code = 3
            return
        log.info("final model (round %d) written to %s", rounds, self.final.path)

    def _record_completion(self) -> None:
        card = self.final.card
        done = Completion(self.cfg.name, card.round, str(self.final.path), card.theta_digest)
        try:
            write_completion(self.cfg.state_dir, done)
            if self.ha is not None:  # before resigning: the next leader must find it
                self.core.store.record_completion(completion_bytes(done))
        except (OSError, StoreError) as exc:  # the model is written; a later start serves it
            log.warning("could not record the job as complete: %s", exc)

    def _complete_in_store(self) -> bool:
        """Elected after the job completed elsewhere: record it here too, and do not serve."""
        try:
            data = open_store(self.cfg.state_dir, self.cfg.storage, True).completion()
        except (StoreError, OSError) as exc:
            log.warning("could not read the job's completion record: %s", exc)
            return False
        done = parse_completion(data) if data is not None else None
        if not already_complete(done, self.cfg.name, self.cfg.rounds.total):
            return False
        log.info("%s (recorded by the coordinator that finished it)", complete_message(done))
        write_completion(self.cfg.state_dir, done)
        return True

    def close(self) -> None:
        """Let go of the state folder (``run`` does this when it returns) and stop the shard
        processes it started."""
        if self.local_shards is not None:
            self.local_shards.stop()
            self.local_shards = None
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
        if self.core is not None:
            self.core.stopping.set()  # a write waiting for disk space gives up


def final_fetch_owed(live: set[str], last_round: set[str], left: set[str]) -> set[str]:
    """After the last round, the sites the coordinator still serves the final theta to: those
    holding a lease, and those of the last round that have not fetched it and left (one cut
    off by the WAN comes back for it). The coordinator waits for them up to
    ``timeouts.final_fetch_s``.
    """
    return set(live) | (set(last_round) - set(left))
