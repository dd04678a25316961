"""A real job on 127.0.0.1 for fault injection: one coordinator, N ``siteclient start`` agents,
each site dialling the coordinator through its own ``bench.relay.Relay`` (its WAN link).

The harness starts, kills (``kill -9`` of a site's whole process group, or of the coordinator)
and restarts the processes on the same run and state folders, watches the coordinator's
checkpoints as they appear (a checkpoint folder keeps only the last few rounds), and sums a
run up as a ``RunRecord`` that ``faults.invariants`` checks.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import grpc
from coord_harness import CoordinatorProcess, subprocess_env, write_config

from bench.relay import Relay
from faults.record import CheckpointWatcher, RunRecord, read_events
from faults.site import SiteProcess, wait_while_sites_live
from faults.spec import JobSpec
from wire.identity import Bundle, init_ca, issue
from wire.net.channel import open_channel
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc

__all__ = ["Cluster", "JobSpec", "RunRecord", "SiteProcess"]


class Cluster:
    """One job in ``folder``: ``start()``, inject faults, ``finish()``, ``close()``."""

    def __init__(
        self,
        folder: Path,
        spec: JobSpec,
        faults_env: str = "",
        delay_s: float = 0.0,
        rate_bps: float | None = None,
        trainer_args: dict[int, tuple[str, ...]] | None = None,
    ) -> None:
        """``delay_s``, ``rate_bps``: every site's link from the start (see ``Relay``);
        ``trainer_args``: more arguments for the trainers of site ``i``."""
        self.folder = Path(folder)
        self.trainer_args = trainer_args or {}
        self.link = (delay_s, rate_bps)
        self.spec = spec
        self.faults_env = faults_env
        self.folder.mkdir(parents=True, exist_ok=True)
        self.markers = self.folder / "markers"
        self.markers.mkdir(exist_ok=True)
        self.state = self.folder / "state"
        self.coordinator: CoordinatorProcess | None = None
        self.relays: list[Relay] = []
        self.sites: list[SiteProcess] = []
        self.watcher = CheckpointWatcher(self.state / "checkpoints")
        self.fault_at: float | None = None
        self._operator: Bundle | None = None

    # ---- life cycle -----------------------------------------------------------------------

    def start(self) -> Cluster:
        cfg = self.spec.config(self.markers)
        coord_tls = None
        if self.spec.tls:
            init_ca(self.folder / "ca", cfg["job"]["name"])
            coord_tls = self.folder / "pki" / "coordinator"
            issue(self.folder / "ca", "coordinator", "coordinator", coord_tls, hosts=("127.0.0.1",))
            issue(self.folder / "ca", "operator", "lead", self.folder / "pki" / "operator")
            self._operator = Bundle.load(self.folder / "pki" / "operator")
        self.coordinator = CoordinatorProcess(
            write_config(self.folder, cfg),
            self.state,
            self.folder / "coordinator.log",
            tls_dir=coord_tls,
        )
        self.coordinator.start()
        self.watcher.start()
        env = subprocess_env()
        if self.faults_env:
            env["ISTHMUS_FAULTS"] = self.faults_env
        for i in range(self.spec.sites):
            relay = Relay(
                target=("127.0.0.1", self.coordinator.port),
                delay_s=self.link[0],
                rate_bps=self.link[1],
            ).start()
            self.relays.append(relay)
            tls_dir = None
            if self.spec.tls:
                tls_dir = self.folder / "pki" / f"site-{i}"
                issue(self.folder / "ca", "site", f"site-{i}", tls_dir)
            extra = self.trainer_args.get(i, ())
            site = SiteProcess(self.folder, self.spec, i, relay.address, tls_dir, env, extra)
            self.sites.append(site)
            site.start()
        return self

    def finish(self, timeout: float = 240.0) -> RunRecord:
        """Wait for every agent and the coordinator to exit; sum the run up."""
        problems = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(s.running for s in self.sites):
            if any(s.exited_badly() for s in self.sites):
                # A failed site usually stalls the others: do not wait the full timeout.
                deadline = min(deadline, time.monotonic() + 30)
            time.sleep(0.1)
        codes = {s.name: s.wait(0.1) for s in self.sites}
        problems += [f"{name} still running" for name, code in codes.items() if code is None]
        coord_code = None
        try:
            failed = any(code != 0 for code in codes.values())
            coord_code = self.coordinator.wait(5 if failed else 60)
        except subprocess.TimeoutExpired:
            problems.append("the coordinator did not exit")
        self.watcher.stopped.set()
        self.watcher.join(5)
        self.watcher.scan()
        total = self.spec.coordinator_rounds  # theta_{total} closes the last coordinator round
        final_meta = self.state / "checkpoints" / f"round-{total:08d}" / "meta.json"
        final = json.loads(final_meta.read_text()) if final_meta.exists() else {}
        return RunRecord(
            total_rounds=total,
            site_codes=codes,
            coordinator_code=coord_code,
            checkpoints=self.watcher.closed_rounds(),
            final_hash=final.get("theta_digest"),
            site_hashes={s.name: s.final_hash() for s in self.sites},
            fault_at=self.fault_at,
            problems=problems,
            events=read_events(self.state / "events.jsonl"),
            ledger=final.get("ledger"),
        )

    def close(self) -> None:
        """Kill whatever still runs and stop the relays (always safe to call)."""
        self.watcher.stopped.set()
        for site in self.sites:
            site.kill()
        if self.coordinator is not None:
            self.coordinator.kill()
        for relay in self.relays:
            relay.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- faults ---------------------------------------------------------------------------

    def mark_fault(self) -> None:
        """Note when the fault hit: recovery time runs from here to the next round close."""
        self.fault_at = time.time()

    def kill_coordinator(self) -> None:
        self.mark_fault()
        self.coordinator.kill(signal.SIGKILL)

    def restart_coordinator(self) -> None:
        self.coordinator.restart()

    # ---- observing ------------------------------------------------------------------------

    def status(self) -> pb.StatusReply | None:
        """The coordinator's Status, or None while it does not answer."""
        with open_channel(self.coordinator.address, self._operator) as channel:
            try:
                return pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=2)
            except grpc.RpcError:
                return None

    def site_status(self, name: str) -> pb.SiteStatus | None:
        reply = self.status()
        for s in reply.sites if reply else ():
            if s.site == name:
                return s
        return None

    def wait_phase(self, site: str, phase: str, round_number: int, timeout: float = 60.0):
        """Until the coordinator is at ``round_number`` and ``site`` last reported ``phase``
        (heartbeats carry it: a phase shorter than one heartbeat may never show)."""

        def there():
            reply = self.status()
            if reply is None or reply.round.round != round_number:
                return None
            mine = [s for s in reply.sites if s.site == site]
            return reply if mine and mine[0].progress.phase == phase else None

        return self.wait_for(there, timeout, f"{site} {phase} in round {round_number}")

    def wait_trained(self, site: SiteProcess, round_number: int, step: int, timeout=60.0):
        """Until ``site`` checkpointed inner step ``step`` of ``round_number``."""
        return self.wait_for(
            lambda: site.reached(round_number, step), timeout, f"{site.name} r{round_number}"
        )

    def checkpoint_path(self, round_closed: int) -> Path:
        return self.state / "checkpoints" / f"round-{round_closed + 1:08d}"

    def wait_closed(self, round_number: int, timeout: float = 120.0) -> None:
        meta = self.checkpoint_path(round_number) / "meta.json"
        self.wait_for(meta.exists, timeout, f"round {round_number} to close")

    def wait_for(self, predicate, timeout: float, what: str, interval: float = 0.02):
        return wait_while_sites_live(predicate, timeout, what, self.sites, self.tails, interval)

    def check_clean(self, record: RunRecord, name: str) -> None:
        """Raise, naming what went wrong and with the processes' last log lines, unless the
        run ended cleanly: no problem recorded, every agent and the coordinator exited 0
        (what a benchmark's run must be to be measured)."""
        bad = record.problems + [f"{s} exited with {c}" for s, c in record.site_codes.items() if c]
        if record.coordinator_code != 0:
            bad.append(f"the coordinator exited with {record.coordinator_code}")
        if bad:
            raise RuntimeError(f"{name}: {'; '.join(bad)}\n{self.tails()}")

    def tails(self) -> str:
        parts = [f"--- coordinator ---\n{self.coordinator.log_tail(40)}"]
        parts += [f"--- {s.name} ---\n{s.tail(40)}" for s in self.sites]
        return "\n".join(parts)
