"""End to end: a real coordinator process, two sites over real gRPC, kill -9 and restart.

Every round each site fetches theta_r, makes a deterministic local change, pushes the
pseudo-gradient ``delta = theta_r - theta_site`` and the coordinator's theta_{r+1} is checked
against an independent float64 outer step. The crash tests then check that a coordinator killed
between rounds, or mid-round after one site pushed, resumes with the same theta and ends with the
crash-free run's model, bit for bit.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, field

import grpc
import pytest
import torch

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

from site_client.transfer.client import CoordinatorClient, GlobalState
from wire.digest import state_digest
from wire.proto import isthmus_pb2 as pb
from wire.tensors import pack

pytestmark = pytest.mark.e2e

SITES = ("site-a", "site-b")
WEIGHTS = (1.0, 3.0)
ROUNDS = 3
STRATEGIES = {
    "fedavg": {"name": "fedavg", "server_lr": 1.0},
    "diloco": {"name": "diloco", "lr": 0.7, "momentum": 0.9},
}


def make_delta(theta: dict[str, torch.Tensor], k: int, r: int) -> dict[str, torch.Tensor]:
    """Site k's pseudo-gradient in round r: a fixed function of theta_r, computed in float32."""
    out = {}
    for name in h.TRAINABLE:
        t = theta[name]
        theta_site = t - 0.01 * (k + 1) * torch.sin(3.0 * t + r + 0.5 * k)
        out[name] = t - theta_site
    return out


class Reference:
    """The outer step in float64, written from the papers, not from ``strategies/``."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.momentum: dict[str, torch.Tensor] = {}

    def step(self, theta: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
        deltas = [make_delta(theta, k, r) for k in range(len(SITES))]
        # FedAvg weighs by the examples sites report; DiLoCo averages uniformly by default.
        weights = WEIGHTS if self.spec["name"] == "fedavg" else (1.0,) * len(SITES)
        out = {k: v.clone() for k, v in theta.items()}
        for name in h.TRAINABLE:
            g = sum(w * d[name].double() for w, d in zip(weights, deltas, strict=True))
            g = g / sum(weights)
            t = theta[name].double()
            if self.spec["name"] == "fedavg":
                out[name] = t - self.spec["server_lr"] * g
            else:
                mu, lr = self.spec["momentum"], self.spec["lr"]
                m = mu * self.momentum.get(name, torch.zeros_like(g)) + g
                self.momentum[name] = m
                out[name] = t - lr * (g + mu * m)
        return out


def assert_close_to_reference(got: dict, want: dict, before: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in got:
        if name not in h.TRAINABLE:
            assert torch.equal(got[name], before[name]), f"{what}: {name} must not change"
            continue
        assert got[name].dtype == torch.float32
        assert not torch.equal(got[name], before[name]), f"{what}: {name} did not move"
        torch.testing.assert_close(
            got[name].double(), want[name], rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}"
        )


# ---- the sites ----------------------------------------------------------------------------


class Hooks:
    """Pause points for the site threads, so the test can kill the coordinator at a chosen
    moment: ``pause(site, point, round)`` makes that site wait there until ``release``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arrived: dict[tuple, threading.Event] = {}
        self._go: dict[tuple, threading.Event] = {}
        self.repush: set[tuple[str, int]] = set()

    def pause(self, site: str, point: str, r: int) -> None:
        key = (site, point, r)
        with self._lock:
            self._arrived[key] = threading.Event()
            self._go[key] = threading.Event()

    def hit(self, site: str, point: str, r: int) -> None:
        with self._lock:
            arrived, go = self._arrived.get((site, point, r)), self._go.get((site, point, r))
        if arrived is None:
            return
        arrived.set()
        assert go.wait(60), f"{site} was never released at {point} {r}"

    def wait_arrived(self, site: str, point: str, r: int, timeout: float = 30) -> None:
        assert self._arrived[(site, point, r)].wait(timeout), f"{site} never reached {point} {r}"

    def release(self, site: str, point: str, r: int) -> None:
        self._go[(site, point, r)].set()

    def release_all(self) -> None:
        with self._lock:
            for ev in self._go.values():
                ev.set()


@dataclass
class SiteLog:
    name: str
    fetched: dict[int, GlobalState] = field(default_factory=dict)
    status_hash: dict[int, bytes] = field(default_factory=dict)
    replies: dict[int, pb.PushReply] = field(default_factory=dict)
    repush: dict[int, pb.PushReply] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)  # round -> lease token at fetch
    retries: list[str] = field(default_factory=list)
    final: GlobalState | None = None
    error: BaseException | None = None


def run_site(address: str, k: int, log: SiteLog, hooks: Hooks, tls=None) -> None:
    """``tls``: (the site's bundle, an operator's bundle for Status) or None for plaintext."""
    site_tls, ops_tls = tls or (None, None)
    client = CoordinatorClient(
        address,
        SITES[k],
        tls=site_tls,
        backoff=h.FAST_BACKOFF,
        num_examples=int(WEIGHTS[k]),
        rpc_timeout_s=5.0,
        transfer_timeout_s=20.0,
        on_retry=lambda what, n, delay, exc: log.retries.append(f"{what}: {exc}"),
    )
    operator = CoordinatorClient(address, "ops", tls=ops_tls) if ops_tls else client
    try:
        client.join()
        last = -1
        while True:
            info = client.wait_for_round(after=last, poll_s=0.05)
            if info.finished:
                break
            r = info.round
            g = client.fetch()
            assert g.version == r, f"{log.name} fetched version {g.version} in round {r}"
            log.fetched[r] = g
            log.tokens[r] = client.lease.token
            status = operator.status()
            assert status.round.round == r
            log.status_hash[r] = status.round.theta_hash
            hooks.hit(log.name, "before_push", r)
            delta = make_delta(g.theta, k, r)
            log.replies[r] = client.push(
                r, delta, weight=WEIGHTS[k], base_version=g.version, upload_id=f"{log.name}-r{r}"
            )
            hooks.hit(log.name, "after_push", r)
            if (log.name, r) in hooks.repush:
                log.repush[r] = client.push(r, delta, weight=WEIGHTS[k], base_version=g.version)
            last = r
        hooks.hit(log.name, "before_final_fetch", ROUNDS)
        log.final = client.fetch()
        client.leave("done")
    except BaseException as exc:  # reported by the test thread
        log.error = exc
    finally:
        client.close()
        operator.close()


def run_job(
    coord: h.CoordinatorProcess, hooks: Hooks | None = None, during=None, tls=None
) -> list[SiteLog]:
    """Run both sites to the end of the job; ``during(logs)`` runs in the test thread meanwhile
    (to kill and restart the coordinator). ``tls``: ``run_site``'s, by site name."""
    hooks = hooks or Hooks()
    logs = [SiteLog(name) for name in SITES]
    threads = [
        threading.Thread(
            target=run_site,
            args=(coord.address, k, logs[k], hooks, (tls or {}).get(SITES[k])),
            daemon=True,
        )
        for k in range(len(SITES))
    ]
    for t in threads:
        t.start()
    try:
        if during is not None:
            during(logs)
    finally:
        hooks.release_all()
        for t in threads:
            t.join(60)
    for log in logs:
        if log.error is not None:
            raise AssertionError(
                f"{log.name} failed: {log.error!r}\n--- coordinator log ---\n{coord.log_tail()}"
            ) from log.error
        assert not any(t.is_alive() for t in threads), "a site thread hung"
    return logs


def check_job(logs: list[SiteLog], spec: dict) -> list[bytes]:
    """Every round against the float64 reference; returns the hash of theta_0..theta_ROUNDS."""
    a, b = logs
    assert sorted(a.fetched) == sorted(b.fetched) == list(range(ROUNDS))
    ref = Reference(spec)
    hashes = []
    for r in range(ROUNDS):
        for log in logs:
            got = log.fetched[r]
            assert state_digest(got.theta) == got.theta_hash == log.status_hash[r], (
                f"{log.name} round {r}: its theta differs from the coordinator's"
            )
        assert a.fetched[r].theta_hash == b.fetched[r].theta_hash
        hashes.append(a.fetched[r].theta_hash)
        theta_r = a.fetched[r].theta
        nxt = a.fetched[r + 1] if r + 1 < ROUNDS else a.final
        assert nxt is not None
        assert_close_to_reference(nxt.theta, ref.step(theta_r, r), theta_r, f"theta_{r + 1}")
    assert a.final.theta_hash == b.final.theta_hash == state_digest(a.final.theta)
    assert a.final.version == ROUNDS
    hashes.append(a.final.theta_hash)
    return hashes


_crash_free: dict[str, list[bytes]] = {}


def crash_free_hashes(tmp_path_factory, strategy: str) -> list[bytes]:
    """Hashes of theta_0..theta_ROUNDS of an uninterrupted run (run once per strategy)."""
    if strategy not in _crash_free:
        folder = tmp_path_factory.mktemp(f"crash-free-{strategy}")
        coord = h.start_coordinator(folder, h.job_config(strategy=STRATEGIES[strategy]))
        try:
            logs = run_job(coord)
            _crash_free[strategy] = check_job(logs, STRATEGIES[strategy])
            assert coord.wait(timeout=20) == 0, coord.log_tail()
            for log in logs:
                assert all(reply.complete for reply in log.replies.values())
                assert not [x for x in log.retries if "ABORTED" in x], log.retries
        finally:
            coord.kill()
    return _crash_free[strategy]


# ---- tests --------------------------------------------------------------------------------


@pytest.fixture
def coordinator(tmp_path):
    """Start a coordinator on a job config in tmp_path; killed at teardown whatever happens."""
    started: list[h.CoordinatorProcess] = []

    def start(cfg: dict) -> h.CoordinatorProcess:
        coord = h.start_coordinator(tmp_path, cfg)
        started.append(coord)
        return coord

    yield start
    for coord in started:
        coord.kill()


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_two_sites_follow_the_reference_outer_step(tmp_path_factory, strategy):
    hashes = crash_free_hashes(tmp_path_factory, strategy)
    assert len(set(hashes)) == ROUNDS + 1  # theta moved every round


def _old_lease_is_fenced(address: str, lease: pb.Lease) -> None:
    raw = h.RawStub(address)
    try:
        with pytest.raises(grpc.RpcError) as err:
            raw.stub.Heartbeat(pb.HeartbeatRequest(lease=lease), timeout=5)
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert lease.site in err.value.details()
    finally:
        raw.close()


def _push_first_bytes(address, lease, r, upload_id, manifest, payload, n) -> pb.PushReply:
    """Send the first ``n`` bytes of an update with the raw stub, then end the stream."""
    raw = h.RawStub(address)
    try:
        header = pb.PushHeader(
            lease=lease,
            round=r,
            upload_id=upload_id,
            manifest=manifest.to_proto(),
            weight=WEIGHTS[SITES.index(lease.site)],
            base_version=r,
        )
        msgs = [pb.PushMessage(header=header)]
        msgs.append(pb.PushMessage(chunk=pb.Chunk(offset=0, data=bytes(payload[:n]))))
        return raw.stub.Push(iter(msgs), timeout=10)
    finally:
        raw.close()


# DiLoCo here: its momentum must come back from the checkpoint, or theta_3 differs.
@pytest.mark.parametrize("strategy", ["diloco"])
def test_kill_between_rounds_resumes_same_round_and_theta(coordinator, tmp_path_factory, strategy):
    expected = crash_free_hashes(tmp_path_factory, strategy)
    coord = coordinator(h.job_config(strategy=STRATEGIES[strategy]))
    hooks = Hooks()
    for site in SITES:
        hooks.pause(site, "before_push", 1)
        hooks.pause(site, "before_final_fetch", ROUNDS)
    hooks.pause(SITES[1], "after_push", 1)

    def during(logs):
        for site in SITES:
            hooks.wait_arrived(site, "before_push", 1)
        before = h.status(coord.address)
        assert before.round.round == 1 and before.round.theta_hash == expected[1]
        old_leases = [pb.Lease(site=log.name, token=log.tokens[1]) for log in logs]
        # site-b's upload is half-way when the coordinator dies (sent here on its behalf, under
        # the upload id its client will use): the half on disk must count after the restart.
        manifest, payload = pack(make_delta(logs[1].fetched[1].theta, 1, 1))
        half = len(payload) // 2
        reply = _push_first_bytes(
            coord.address, old_leases[1], 1, "site-b-r1", manifest, payload, half
        )
        assert (reply.complete, reply.acked_offset) == (False, half), reply
        coord.kill(signal.SIGKILL)
        coord.restart()
        after = h.status(coord.address)
        assert after.round.round == 1, "the restarted coordinator lost its round"
        assert after.round.theta_hash == before.round.theta_hash, "theta changed over a restart"
        for lease in old_leases:  # tokens from before the crash are fenced out
            _old_lease_is_fenced(coord.address, lease)
        # site-b first, alone: the round must wait for site-a to re-join, not close without it.
        hooks.release(SITES[1], "before_push", 1)
        hooks.wait_arrived(SITES[1], "after_push", 1)
        mid = h.status(coord.address)
        assert (mid.round.round, mid.updates_received) == (1, 1), mid
        # Only the second half crossed the wire again (the new process counts from zero).
        assert mid.wan_bytes_in == len(payload) - half, (mid.wan_bytes_in, len(payload), half)
        hooks.release(SITES[1], "after_push", 1)
        hooks.release(SITES[0], "before_push", 1)
        # Once more after the last round, before the sites fetched the final theta: the
        # restarted coordinator must wait for them rather than exit with nobody holding a lease.
        for site in SITES:
            hooks.wait_arrived(site, "before_final_fetch", ROUNDS)
        done = h.status(coord.address)
        assert done.round.finished and done.round.theta_hash == expected[ROUNDS]
        coord.kill(signal.SIGKILL)
        coord.restart()
        again = h.status(coord.address)
        assert again.round.finished and again.round.theta_hash == expected[ROUNDS]
        for site in SITES:
            hooks.release(site, "before_final_fetch", ROUNDS)

    logs = run_job(coord, hooks, during)
    assert check_job(logs, STRATEGIES[strategy]) == expected
    assert coord.wait(timeout=20) == 0, coord.log_tail()
    for log in logs:
        # The site's lease was fenced, it re-joined by itself under a newer token.
        assert any("ABORTED" in r or "lease" in r for r in log.retries), log.retries
        assert log.tokens[2] > log.tokens[1]
        assert all(reply.complete for reply in log.replies.values())


# FedAvg here: the spooled update's weight (1 against 3) must survive the crash too.
@pytest.mark.parametrize("strategy", ["fedavg"])
def test_kill_mid_round_keeps_the_spooled_update(coordinator, tmp_path_factory, strategy):
    expected = crash_free_hashes(tmp_path_factory, strategy)
    coord = coordinator(h.job_config(strategy=STRATEGIES[strategy]))
    a, b = SITES
    hooks = Hooks()
    hooks.pause(a, "after_push", 1)
    hooks.pause(b, "before_push", 1)
    hooks.repush.add((a, 1))

    def during(logs):
        hooks.wait_arrived(a, "after_push", 1)
        hooks.wait_arrived(b, "before_push", 1)
        before = h.status(coord.address)
        assert (before.round.round, before.updates_received) == (1, 1)
        coord.kill(signal.SIGKILL)
        coord.restart()
        after = h.status(coord.address)
        assert after.round.round == 1
        assert after.round.theta_hash == before.round.theta_hash
        assert after.updates_received == 1, "the spooled update of site-a was lost"
        # site-a sends its update again: the coordinator says it already counts.
        hooks.release(a, "after_push", 1)
        h.wait_until(lambda: 1 in logs[0].repush or logs[0].error, what="site-a re-push")
        # site-a has re-joined, site-b not yet: the round must wait for site-b, not close.
        mid = h.status(coord.address)
        assert (mid.round.round, mid.updates_received) == (1, 1), mid
        assert {s.site: s.state for s in mid.sites} == {a: "active", b: "rejoining"}, mid
        hooks.release(b, "before_push", 1)

    logs = run_job(coord, hooks, during)
    assert logs[0].repush[1].complete
    assert logs[0].repush[1].message.startswith("already counted"), logs[0].repush[1]
    assert check_job(logs, STRATEGIES[strategy]) == expected
    assert coord.wait(timeout=20) == 0, coord.log_tail()
