"""A real job with standby coordinators for fault injection: two ``coordinator serve --ha``
processes (one etcd, one SeaweedFS S3 store, a local state folder each) and N ``siteclient
start`` agents given both addresses (``--coordinator A,B``), all over mutual TLS.

The checkpoints live in the object store, so they are watched there (``S3Watcher``), and so
does the job's event log (each leader ships its records there before every commit and at its
stop; a standby taking over continues it): the run's record reads that one. The run is judged
by ``faults.invariants`` as every other fault run is, plus the store's own history: each round
committed by one manifest only, and none of them void (``split_brain``).

Links can be cut (``bench.relay.Relay``): with ``etcd_relays`` each coordinator reaches etcd
through a relay of its own (``etcd_relay(c)``), so one coordinator alone can be cut off from
the election; with ``store_relay`` the coordinators reach the object store through one relay
(the harness's own watcher reads it directly). A coordinator that exits ``DEPOSED_EXIT``
(it lost the leadership) is started again on its state folder and address, as a supervisor
would (``exits`` lists each such exit).
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import grpc
from coord_harness import CoordinatorProcess, subprocess_env, write_config
from shard_helpers import ShardProc

from bench.relay import Relay
from coordinator.cli.ha import call_leader
from coordinator.events.remote import RemoteEvents, read_remote
from coordinator.persist import s3_epochs, s3_layout
from coordinator.persist.open_store import open_store
from coordinator.service.server import DEPOSED_EXIT
from coordinator.shards.receipts import KEY_FILE, create_key
from faults.record import RunRecord
from faults.site import SiteProcess, wait_while_sites_live
from faults.spec import JobSpec
from wire.identity import Bundle, init_ca, issue
from wire.net.channel import open_channel
from wire.objstore.config import StorageConfig
from wire.objstore.objects import get_with_etag
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc

TTL_S = 3


class S3Watcher(threading.Thread):
    """Records each committed checkpoint's meta as soon as its manifest appears (the store
    keeps only the last few rounds)."""

    def __init__(self, store) -> None:
        super().__init__(name="s3-watcher", daemon=True)
        self.store = store
        self.seen: dict[str, dict] = {}
        self.manifests: dict[int, dict[str, int]] = {}  # round -> attempt -> epoch that wrote it
        self.stopped = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self.stopped.wait(0.1):
            try:
                self.scan()
            except Exception:  # the store unreachable for a while: scan again later
                continue

    def scan(self) -> None:
        for r in self.store.kept_rounds():
            self._note_manifest(r)
            try:
                meta = self.store.load_round(r, theta_only=True).meta
            except Exception:  # pruned while we read
                continue
            with self.lock:
                self.seen.setdefault(f"{r}@{meta.get('written_at')}", meta)

    def _note_manifest(self, r: int) -> None:
        """Every manifest ever seen at round ``r``'s key, void or not (readers skip a void one,
        so ``load_round`` alone would not show it)."""
        key = self.store.dir + s3_layout.manifest_key(r)
        found = get_with_etag(self.store.client, self.store.bucket, key)
        if found is None:  # pruned meanwhile
            return
        m = s3_layout.parse_manifest(found[0], r)
        with self.lock:
            self.manifests.setdefault(r, {})[m.attempt] = m.epoch

    def split_brain(self) -> list[str]:
        """What the store's history shows of two leaders: a round committed by more than one
        manifest, or a manifest that the starts record voids (a deposed leader's late write)."""
        record = s3_epochs.parse_record(
            (
                get_with_etag(self.store.client, self.store.bucket, self.store.prefix + "epoch")
                or (None,)
            )[0]
        )
        problems = []
        with self.lock:
            manifests = {r: dict(m) for r, m in self.manifests.items()}
        for r, attempts in sorted(manifests.items()):
            if len(attempts) > 1:
                problems.append(f"round {r} committed by {len(attempts)} manifests: {attempts}")
            for attempt, epoch in attempts.items():
                if (by := s3_epochs.void_by(record, r, epoch)) is not None:
                    problems.append(
                        f"round {r}'s manifest {attempt} by start {epoch} is void (start {by})"
                    )
        return problems

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

    def __init__(
        self,
        folder: Path,
        spec: JobSpec,
        etcd,
        seaweed,
        etcd_relays: bool = False,
        store_relay: bool = False,
    ) -> None:
        self.folder, self.spec, self.etcd, self.seaweed = Path(folder), spec, etcd, seaweed
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
        self.with_etcd_relays = etcd_relays
        self.etcd_relays: dict[str, Relay] = {}  # coordinator name -> its link to etcd
        self.store_relay = _relay_to(seaweed.endpoint) if store_relay else None
        self.exits: list[tuple[str, int, float]] = []  # (address, code, time) of each restart
        self._supervising = threading.Event()
        self.harness_problems: list[str] = []
        self.shards: list[ShardProc] = []

    def start(self) -> HaCluster:
        cfg = self.spec.config(self.markers)
        cfg["storage"] = {"url": self.url}
        if self.store_relay is not None:
            cfg["storage"]["endpoint_url"] = f"http://{self.store_relay.address}"
        ca = self.folder / "ca"
        init_ca(ca, cfg["job"]["name"])
        tls = self.folder / "pki" / "coordinator"
        issue(ca, "coordinator", "coordinator", tls, hosts=("127.0.0.1",))
        issue(ca, "operator", "lead", self.folder / "pki" / "operator")
        self.operator = Bundle.load(self.folder / "pki" / "operator")
        if self.spec.shards > 1:
            self._start_shards(cfg, tls)
        config = write_config(self.folder, cfg)
        for name in ("a", "b"):
            state = self.folder / name / "state"
            if self.spec.shards > 1:  # each coordinator holds a copy of the job's shard key
                place_key(self.folder / KEY_FILE, state / KEY_FILE)
            ha = ("--ha", self._etcd_url(name), "--ha-ttl", str(TTL_S), "--state-dir", str(state))
            log = self.folder / f"coordinator-{name}.log"
            self.coordinators.append(CoordinatorProcess(config, state, log, tls, extra_args=ha))
        starting = [threading.Thread(target=c.start) for c in self.coordinators]
        for t in starting:
            t.start()
        for t in starting:
            t.join(timeout=60)
        threading.Thread(target=self._supervise, name="supervisor", daemon=True).start()
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

    def _start_shards(self, cfg: dict, tls: Path) -> None:
        """Shards 1..K-1 on "hosts" of their own (``coordinator shard``), which both
        coordinators may lead: registered in the job's etcd, where the leader finds them."""
        create_key(self.folder / KEY_FILE)
        config = write_config(self.folder, cfg, "shards.toml")
        register = ("--ha", self.etcd.url, "--ha-ttl", str(TTL_S))
        for i in range(1, self.spec.shards):
            shard = ShardProc(
                i, self.spec.shards, config, self.folder / "shards" / str(i), tls,
                self.folder / KEY_FILE, leads=("coordinator",), env=self.env, extra=register,
            )  # fmt: skip
            shard.folder.mkdir(parents=True, exist_ok=True)
            self.shards.append(shard.start())

    def _etcd_url(self, name: str) -> str:
        if not self.with_etcd_relays:
            return self.etcd.url
        self.etcd_relays[name] = relay = _relay_to(f"http://{self.etcd.endpoint}")
        return f"etcd://{relay.address}"

    def etcd_relay(self, c: CoordinatorProcess) -> Relay:
        """``c``'s own link to etcd (``etcd_relays=True``)."""
        return self.etcd_relays["ab"[self.coordinators.index(c)]]

    def _supervise(self) -> None:
        """Start again, as a standby, a coordinator that exited because it was deposed."""
        while not self._supervising.wait(0.05):
            for c in self.coordinators:
                code = c.proc.poll() if c.proc is not None else None
                if code == DEPOSED_EXIT and c not in self.killed:
                    self.exits.append((c.address, code, time.time()))
                    try:
                        c.restart()
                    except Exception as exc:  # judged with the run
                        self.harness_problems.append(f"restarting {c.address}: {exc}")

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

    def leads(self, c: CoordinatorProcess) -> bool:
        """Whether ``c`` itself answers as the leader (a standby refuses, a stopped one is
        not there)."""
        with open_channel(c.address, self.operator) as channel:
            try:
                pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=1)
            except grpc.RpcError:
                return False
        return True

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
        return wait_while_sites_live(predicate, timeout, what, self.sites, self.tails, interval)

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
        self._supervising.set()
        self.watcher.stopped.set()
        self.watcher.join(5)
        self.watcher.scan()
        problems += self.watcher.split_brain() + self.harness_problems
        total = self.spec.coordinator_rounds
        closed = self.watcher.closed_rounds()
        finals = [m for metas in closed.values() for m in metas if m.get("round") == total]
        store = self.store
        events = read_remote(RemoteEvents(store.client, store.bucket, store.prefix)).events
        return RunRecord(
            total_rounds=total,
            site_codes=codes,
            coordinator_code=0 if coord_codes and all(c == 0 for c in coord_codes) else 1,
            checkpoints=closed,
            final_hash=finals[-1]["theta_digest"] if finals else None,
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
        self._supervising.set()
        if self.watcher is not None:
            self.watcher.stopped.set()
        for site in self.sites:
            site.kill()
        for c in self.coordinators:
            c.kill()
        for shard in self.shards:
            shard.stop()
        for relay in [*self.etcd_relays.values(), self.store_relay]:
            if relay is not None:
                relay.stop()

    def __enter__(self) -> HaCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def place_key(key: Path, to: Path) -> None:
    """A copy of the shard ``key`` at ``to``, readable by its owner only."""
    to.parent.mkdir(parents=True, exist_ok=True)
    to.write_bytes(key.read_bytes())
    to.chmod(0o600)


def _relay_to(endpoint: str) -> Relay:
    """A relay to ``http://HOST:PORT``, started."""
    where = urlsplit(endpoint)
    return Relay(target=(where.hostname, where.port)).start()
