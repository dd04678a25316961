"""Shards found through etcd (``coordinator.shards.registry``) against a real etcd member: each
shard holds its key while it runs, a second process of the same index waits for it, and the
lead reads every address in index order, waiting for a shard not registered yet."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
from shard_helpers import ShardProc, job_toml, make_pki

from coordinator.ha.options import ha_options
from coordinator.shards.receipts import KEY_FILE, create_key
from coordinator.shards.registry import ShardRegistration, missing, resolve, shard_key

TTL_S = 2


def test_a_shards_key_sits_beside_the_leader_key_and_missing_ones_are_named():
    assert shard_key("isthmus/job/leader", 3) == "isthmus/job/shards/3"
    assert shard_key("a/b/c/job/leader", 1) == "a/b/c/job/shards/1"
    assert missing({1: "h:1", 3: "h:3"}, 4) == [2]
    assert missing({1: "h:1", 2: ""}, 3) == [2]
    assert missing({}, 1) == []


def _opts(etcd, job: str, advertise: str = ""):
    return ha_options(etcd.url, job, advertise, TTL_S)


def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_lead_finds_each_shard_and_waits_for_one_not_registered(etcd, caplog):
    job = f"j{uuid.uuid4().hex[:8]}"
    one = ShardRegistration(_opts(etcd, job, "h1:7071"), 1).start()
    two = None
    try:
        _until(one.registered)
        stop = threading.Event()
        threading.Timer(1.5, stop.set).start()
        with caplog.at_level(logging.WARNING, "isthmus.coordinator"):
            assert resolve(_opts(etcd, job), 3, stop) is None
        assert (
            f"waiting for shard(s) 2 to register in etcd ({shard_key(f'isthmus/{job}/leader', 2)})"
            in caplog.text
        )
        two = ShardRegistration(_opts(etcd, job, "h2:7072"), 2).start()
        _until(two.registered)
        assert resolve(_opts(etcd, job), 3, threading.Event()) == ["h1:7071", "h2:7072"]
    finally:
        one.close()
        if two is not None:
            two.close()


def test_a_second_process_of_an_index_waits_until_the_first_is_gone(etcd):
    job = f"j{uuid.uuid4().hex[:8]}"
    first = ShardRegistration(_opts(etcd, job, "h1:7071"), 1).start()
    second = ShardRegistration(_opts(etcd, job, "h9:7079"), 1).start()
    try:
        _until(lambda: first.registered() or second.registered())
        holder, other = (first, second) if first.registered() else (second, first)
        time.sleep(1.0)
        assert not other.registered() and other.holder() == holder.holder()
        holder.close()  # its lease revoked: the key goes at once, and the other takes it
        _until(other.registered, timeout=TTL_S + 10)
        (address,) = resolve(_opts(etcd, job), 2, threading.Event())
        assert address == other.holder()
    finally:
        first.close()
        second.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_a_shard_process_registers_its_address_and_leaves_when_stopped(tmp_path, pki, etcd):
    job = "shards"  # the helpers' job name
    state = tmp_path / "lead"
    (tmp_path / "job.toml").write_text(job_toml(state))
    create_key(state / KEY_FILE)
    ha = ("--ha", etcd.url, "--ha-ttl", str(TTL_S))
    shard = ShardProc(
        1,
        2,
        tmp_path / "job.toml",
        tmp_path / "shard-1",
        pki / "shards",
        state / KEY_FILE,
        extra=ha,
    ).start()
    try:
        found = None

        def registered():
            nonlocal found
            found = resolve(_opts(etcd, job), 2, _stopped_after(0.5))
            return found is not None

        _until(registered, timeout=20)
        assert found == [shard.address]
        assert "registering shard 1 as 127.0.0.1:" in shard.log.read_text()
    finally:
        shard.stop()
    assert resolve(_opts(etcd, job), 2, _stopped_after(0.5)) is None  # gone with it


def _stopped_after(seconds: float) -> threading.Event:
    stop = threading.Event()
    threading.Timer(seconds, stop.set).start()
    return stop
