"""The election against a real etcd (Debian's etcd-server, ``tests/etcd.py``): two candidates,
one leads and the other names it; the leader's lease revoked from outside or its renewals
stopped, the other leads within the TTL and a few seconds, at a higher epoch; and a deposed
leader's commit to the object store (a real SeaweedFS) is refused."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from coordinator.ha.etcd_election import EtcdElection
from coordinator.ha.options import ha_options
from coordinator.ha.role import Deposed, HaRole
from coordinator.persist.local_store import Checkpoint, StoreError
from coordinator.persist.open_store import open_store
from wire.objstore.config import StorageConfig

TTL_S = 2
STEADY_TTL_S = 5  # where nothing waits for a lease to lapse: a loaded machine renews in time


def candidates(etcd, ttl_s: int = TTL_S, names=("a:1", "b:1")) -> list[EtcdElection]:
    job = uuid.uuid4().hex[:8]
    return [EtcdElection(ha_options(etcd.url, job, name, ttl_s)).start() for name in names]


def wait_leader(elections, timeout=TTL_S + 5.0, not_=None) -> EtcdElection:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        leading = [e for e in elections if e.leadership().leading and e is not not_]
        if leading:
            return leading[0]
        time.sleep(0.02)
    raise TimeoutError(f"no leader within {timeout}s: {[e.leadership() for e in elections]}")


def names(election: EtcdElection, leader: str, timeout: float = 5.0) -> bool:
    """Whether ``election`` names ``leader`` within ``timeout`` (it reads the key on each
    change it is told of)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if election.leadership().leader == leader:
            return True
        time.sleep(0.02)
    return False


def revoke_from_outside(etcd, lease: int) -> None:
    """An operator (or etcd itself, on expiry) ends the lease: not through the candidate."""
    import aetcd

    async def revoke():
        host, port = etcd.endpoint.split(":")
        async with aetcd.Client(host, int(port)) as client:
            await client.revoke_lease(lease)

    asyncio.run(revoke())


@pytest.mark.e2e
def test_one_leads_and_the_other_takes_over_when_its_lease_goes(etcd):
    elections = candidates(etcd, STEADY_TTL_S)
    try:
        first = wait_leader(elections)
        other = elections[1 - elections.index(first)]
        assert names(other, first.opts.advertise)
        epoch = first.leadership().epoch
        started = time.monotonic()
        revoke_from_outside(etcd, first.view().lease)
        second = wait_leader(elections, not_=first)
        assert second is other and time.monotonic() - started < TTL_S + 3
        assert second.leadership().epoch > epoch
        assert not first.leadership().leading  # it saw the key go, and names the new leader
        assert names(first, other.opts.advertise)
    finally:
        for e in elections:
            e.close()


@pytest.mark.e2e
def test_a_leader_whose_renewals_stop_is_replaced_after_the_ttl(etcd):
    elections = candidates(etcd)
    try:
        first = wait_leader(elections)
        epoch = first.leadership().epoch
        first.close()  # its loop stops: no renewal, no resignation (as a kill -9 would)
        stopped = time.monotonic()
        assert first.leadership().leading  # by its own clock, until its margin runs out
        second = wait_leader(elections, not_=first)
        took = time.monotonic() - stopped
        assert took < TTL_S + 3, took
        assert not first.leadership().leading  # past its margin it no longer leads
        assert second.leadership().epoch > epoch
    finally:
        for e in elections:
            e.close()


@pytest.mark.e2e
def test_a_deposed_leader_cannot_commit_a_checkpoint(etcd, seaweed, monkeypatch, tmp_path):
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)
    url = f"s3://{seaweed.bucket}/{uuid.uuid4().hex}/job"
    opts = ha_options(etcd.url, uuid.uuid4().hex[:8], "a:1", STEADY_TTL_S)
    role = HaRole(opts, authorizer=None)
    role.start()
    try:
        import threading

        term = role.wait_elected(threading.Event())
        store = open_store(tmp_path, StorageConfig(url))
        store.fence = term.fence
        store.next_epoch(term.revision)
        ckpt = Checkpoint(1, {"w": __import__("torch").ones(4)}, meta={"job": "j"})
        store.save(ckpt)
        revoke_from_outside(etcd, role.election.view().lease)
        deadline = time.monotonic() + 5
        while role.lost() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        with pytest.raises(Deposed, match="no longer the leader"):
            store.save(Checkpoint(2, {"w": __import__("torch").ones(4)}, meta={"job": "j"}))
        assert store.kept_rounds() == [1]
        # A coordinator that counted its start after this one's takes the store over: even
        # without the election's word, this one's commit is refused.
        store.fence = None
        newer = open_store(tmp_path, StorageConfig(url))
        newer.next_epoch()
        with pytest.raises(StoreError, match="a newer coordinator has taken the store over"):
            store.save(Checkpoint(2, {"w": __import__("torch").ones(4)}, meta={"job": "j"}))
        assert store.kept_rounds() == [1]
    finally:
        role.close()
