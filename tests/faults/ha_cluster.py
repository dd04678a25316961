"""A real job with standby coordinators for fault injection: two ``coordinator serve --ha``
processes (one etcd, one SeaweedFS S3 store, a local state folder each) and N ``siteclient
start`` agents given both addresses (``--coordinator A,B``), all over mutual TLS.

The checkpoints live in the object store, so they are watched there (``S3Watcher``); each
coordinator keeps its own event log, and the run's record reads both. The run is judged by
``faults.invariants`` as every other fault run is.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from pathlib import Path

import grpc
from coord_harness import CoordinatorProcess, subprocess_env, write_config

from coordinator.ha_cli import call_leader
from coordinator.storage import StorageConfig, open_store
from faults.record import RunRecord, read_events
from faults.site import SiteProcess
from faults.spec import JobSpec
from wire.identity import Bundle, init_ca, issue
from wire.proto import isthmus_pb2 as pb

TTL_S = 3


class S3Watcher(threading.Thread):
    """Records each committed checkpoint's meta as soon as its manifest appears (the store
    keeps only the last few rounds)."""

    def __init__(self, store) -> None:
        super().__init__(name="s3-watcher", daemon=True)
        self.store = store
        self.seen: dict[str, dict] = {}
        self.stopped = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self.stopped.wait(0.1):
            self.scan()

    def scan(self) -> None:
        for r in self.store.kept_rounds():
            try:
                meta = self.store.load_round(r, theta_only=True).meta
            except Exception:  # pruned while we read
                continue
            with self.lock:
                self.seen.setdefault(f"{r}@{meta.get('written_at')}", meta)

    def closed_rounds(self) -> dict[int, list[dict]]:
        with self.lock:
            metas = sorted(self.seen.values(), key=lambda m: m.get("written_at", 0))
        out: dict[int, list[dict]] = {}
        for meta in metas:
            if (closed := meta.get("closed_round")) is not None:
                out.setdefault(int(closed["number"]), []).append(meta)
        return out


class HaCluster:
    """One job in ``folder`` led by one of two coordinators: ``start()``, faults, ``finish()``."""

    def __init__(self, folder: Path, spec: JobSpec, etcd, seaweed) -> None:
        self.folder, self.spec, self.etcd = Path(folder), spec, etcd
        self.folder.mkdir(parents=True, exist_ok=True)
        self.markers = self.folder / "markers"
        self.markers.mkdir(exist_ok=True)
        self.url = f"s3://{seaweed.bucket}/{uuid.uuid4().hex}/faults"
        self.env = {**subprocess_env(), **seaweed.env()}
        self.coordinators: list[CoordinatorProcess] = []
        self.sites: list[SiteProcess] = []
        self.store = None
        self.watcher: S3Watcher | None = None
        self.fault_at: float | None = None
        self.killed: list[CoordinatorProcess] = []

    def start(self) -> HaCluster:
        cfg = self.spec.config(self.markers)
        cfg["storage"] = {"url": self.url}
        ca = self.folder / "ca"
        init_ca(ca, cfg["job"]["name"])
        tls = self.folder / "pki" / "coordinator"
        issue(ca, "coordinator", "coordinator", tls, hosts=("127.0.0.1",))
        issue(ca, "operator", "lead", self.folder / "pki" / "operator")
        self.operator = Bundle.load(self.folder / "pki" / "operator")
        config = write_config(self.folder, cfg)
        for name in ("a", "b"):
            state = self.folder / name / "state"
            ha = ("--ha", self.etcd.url, "--ha-ttl", str(TTL_S), "--state-dir", str(state))
            log = self.folder / f"coordinator-{name}.log"
            self.coordinators.append(CoordinatorProcess(config, state, log, tls, extra_args=ha))
        starting = [threading.Thread(target=c.start) for c in self.coordinators]
        for t in starting:
            t.start()
        for t in starting:
            t.join(timeout=60)
        self.store = open_store(self.folder, StorageConfig(self.url))
        self.watcher = S3Watcher(self.store)
        self.watcher.start()
        both = ",".join(c.address for c in self.coordinators)
        for i in range(self.spec.sites):
            tls_dir = self.folder / "pki" / f"site-{i}"
            issue(ca, "site", f"site-{i}", tls_dir)
            site = SiteProcess(self.folder, self.spec, i, both, tls_dir, self.env)
            self.sites.append(site)
            site.start()
        return self

    # ---- observing and faults ---------------------------------------------------------------

    def status(self) -> tuple[pb.StatusReply, str] | tuple[None, None]:
        """The leader's Status and address, or (None, None) while no coordinator leads."""
        both = ",".join(c.address for c in self.coordinators if c not in self.killed)
        try:
            return call_leader(
                both, self.operator, lambda s: s.Status(pb.StatusRequest(), timeout=2)
            )
        except grpc.RpcError:
            return None, None

    def leader(self) -> CoordinatorProcess:
        _, address = self.wait_for(lambda: self.status()[1] and self.status(), 60, "a leader")
        return next(c for c in self.coordinators if c.address == address)

    def kill_leader(self) -> CoordinatorProcess:
        leader = self.leader()
        self.fault_at = time.time()
        leader.kill(signal.SIGKILL)
        self.killed.append(leader)
        return leader

    def wait_for(self, predicate, timeout: float, what: str, interval: float = 0.02):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            for site in self.sites:
                if site.exited_badly():
                    raise AssertionError(f"{site.name} died waiting for {what}:\n{site.tail()}")
            time.sleep(interval)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}\n{self.tails()}")

    # ---- the end ----------------------------------------------------------------------------

    def finish(self, timeout: float = 300.0) -> RunRecord:
        problems = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(s.running for s in self.sites):
            time.sleep(0.1)
        codes = {s.name: s.wait(0.1) for s in self.sites}
        problems += [f"{name} still running" for name, code in codes.items() if code is None]
        live = [c for c in self.coordinators if c not in self.killed]
        coord_codes = [self._exit_code(c, problems) for c in live]
        self.watcher.stopped.set()
        self.watcher.join(5)
        self.watcher.scan()
        total = self.spec.coordinator_rounds
        closed = self.watcher.closed_rounds()
        finals = [m for metas in closed.values() for m in metas if m.get("round") == total]
        events = [e for c in self.coordinators for e in read_events(c.state_dir / "events.jsonl")]
        return RunRecord(
            total_rounds=total,
            site_codes=codes,
            coordinator_code=0 if coord_codes and all(c == 0 for c in coord_codes) else 1,
            checkpoints=closed,
            final_hash=finals[-1]["theta_sha256"] if finals else None,
            site_hashes={s.name: s.final_hash() for s in self.sites},
            fault_at=self.fault_at,
            problems=problems,
            events=events,
        )

    @staticmethod
    def _exit_code(c: CoordinatorProcess, problems: list[str]) -> int | None:
        try:
            return c.wait(60)
        except Exception:
            problems.append(f"coordinator {c.address} did not exit")
            return None

    def tails(self) -> str:
        parts = [f"--- coordinator {c.address} ---\n{c.log_tail(40)}" for c in self.coordinators]
        parts += [f"--- {s.name} ---\n{s.tail(40)}" for s in self.sites]
        return "\n".join(parts)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stopped.set()
        for site in self.sites:
            site.kill()
        for c in self.coordinators:
            c.kill()

    def __enter__(self) -> HaCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
