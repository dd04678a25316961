"""Two real ``coordinator serve --ha`` processes on one SeaweedFS (S3) and one etcd, over
mutual TLS: one leads, the standby refuses site and operator calls naming it, a site given
both addresses follows the leader; when the leader's etcd lease is revoked mid-job it steps
down (refusing calls, exit status 4), the standby takes over from the last committed
checkpoint at a higher epoch and the job completes. (``kill -9`` of the leader with real
sites: ``tests/faults/test_ha_takeover.py``.) Malformed ``--ha`` flags are refused in one line
before anything starts."""

from __future__ import annotations

import asyncio
import threading
import uuid
from pathlib import Path

import grpc
import pytest
import torch

try:  # tests/ as a package or as a plain folder on sys.path
    from . import coord_harness as h
except ImportError:
    import coord_harness as h

from coordinator.cli.ha import call_leader
from coordinator.events.remote import RemoteEvents, read_remote
from coordinator.events.segments import read_events
from coordinator.persist.open_store import open_store
from site_client.transfer.client import CoordinatorClient
from wire.backoff import BackoffPolicy
from wire.config_table import ConfigError
from wire.digest import state_digest
from wire.identity import Bundle, init_ca, issue
from wire.net.channel import open_channel
from wire.net.leader import LEADER_KEY
from wire.objstore.config import StorageConfig, parse_url
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc

ROUNDS = 3


def pki(folder: Path) -> dict[str, Path]:
    init_ca(folder / "ca", "testjob")
    out = {}
    for role, name in (("coordinator", "coordinator"), ("operator", "lead"), ("site", "site-a")):
        out[name] = folder / "pki" / name
        issue(folder / "ca", role, name, out[name], hosts=("127.0.0.1",))
    return out


def candidates(tmp_path: Path, cfg: dict, etcd, tls_dir: Path) -> list[h.CoordinatorProcess]:
    config = h.write_config(tmp_path, cfg)
    procs = []
    for name in ("a", "b"):
        state = tmp_path / name / "state"
        args = ("--ha", etcd.url, "--ha-ttl", "5", "--state-dir", str(state))
        procs.append(
            h.CoordinatorProcess(
                config, state, tmp_path / f"{name}.log", tls_dir=tls_dir, extra_args=args
            )
        )
    return procs


def site_rounds(client: CoordinatorClient, tokens: list[int], stop_after: int | None) -> bytes:
    """The site's side of the job, noting each lease token it pushes under."""
    client.join()
    last = -1
    while True:
        info = client.wait_for_round(after=last, poll_s=0.05)
        if info.finished:
            break
        g = client.fetch()
        delta = {n: torch.full_like(g.theta[n], 0.01) for n in h.TRAINABLE}
        client.push(info.round, delta, base_version=g.version)
        tokens.append(client.lease.token)
        last = info.round
        if stop_after is not None and last >= stop_after:
            return b""
    final = client.fetch()
    client.leave("done")
    return final.theta_hash


def revoke_leader_lease(etcd, key: str) -> None:
    """What an operator's ``etcdctl lease revoke`` does: the leader key goes with the lease."""
    import aetcd

    async def revoke():
        host, port = etcd.endpoint.split(":")
        async with aetcd.Client(host, int(port)) as client:
            got = await client.get(key.encode())
            await client.revoke_lease(got.lease)

    asyncio.run(revoke())


def refused_by_standby(address: str, bundle: Bundle, leader: str) -> None:
    """A push and a status call at the standby: UNAVAILABLE, naming the leader."""
    with open_channel(address, bundle) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        header = pb.PushMessage(header=pb.PushHeader(round=1, upload_id="u1"))
        with pytest.raises(grpc.RpcError) as push:
            stub.Push(iter([header]), timeout=5)
    assert push.value.code() == grpc.StatusCode.UNAVAILABLE
    assert push.value.details() == f"standby; the leader is {leader}"
    assert (LEADER_KEY, leader) in tuple(push.value.trailing_metadata())


@pytest.mark.e2e
def test_standby_refuses_then_takes_over_from_a_deposed_leader(
    etcd, seaweed, monkeypatch, tmp_path
):
    for name, value in seaweed.env().items():
        monkeypatch.setenv(name, value)  # the coordinator processes inherit them
    url = f"s3://{seaweed.bucket}/{uuid.uuid4().hex}/job"
    certs = pki(tmp_path)
    cfg = h.job_config(storage={"url": url})
    cfg["rounds"].update(total=ROUNDS, max_sites=1)
    procs = candidates(tmp_path, cfg, etcd, certs["coordinator"])
    site = Bundle.load(certs["site-a"])
    operator = Bundle.load(certs["lead"])
    try:
        starting = [threading.Thread(target=p.start) for p in procs]  # both at once
        for t in starting:
            t.start()
        for t in starting:
            t.join(timeout=60)
        both = ",".join(p.address for p in procs)
        status = lambda stub: stub.Status(pb.StatusRequest(), timeout=5)  # noqa: E731
        _, leader = h.wait_until(lambda: _try(call_leader, both, operator, status), 20, 0.1)
        old, standby = sorted(procs, key=lambda p: p.address != leader)
        refused_by_standby(standby.address, site, leader)
        store = open_store(tmp_path, StorageConfig(url))
        tokens: list[int] = []
        client = CoordinatorClient(
            both, "site-a", tls=site, backoff=BackoffPolicy(0.05, 2, 0.5, 30), rpc_timeout_s=5
        )
        site_rounds(client, tokens, stop_after=0)  # round 0 counted: theta_1 committed
        h.wait_until(lambda: 1 in store.kept_rounds(), what="round 1's checkpoint in S3")
        revoke_leader_lease(etcd, "isthmus/testjob/leader")
        assert old.wait(timeout=20) == 4, old.log_tail()  # stepped down, and said so
        assert "stepping down" in old.log_tail(30)
        final: list[bytes] = []
        run = threading.Thread(target=lambda: final.append(site_rounds(client, tokens, None)))
        run.start()
        run.join(timeout=60)
        assert standby.wait(timeout=30) == 0, standby.log_tail()
    finally:
        for p in procs:
            p.stop()
    assert store.kept_rounds()[-1] == ROUNDS
    last = store.load_round(ROUNDS)
    assert final == [state_digest(last.theta)]
    assert [r["number"] for r in [last.meta["closed_round"]]] == [ROUNDS - 1]
    epochs = [t >> 32 for t in tokens]
    assert epochs[0] < epochs[-1], epochs  # the new leader's tokens fence the old ones'
    assert "elected leader" in standby.log_tail(400) and "standing by" in standby.log_tail(400)
    assert "reaches etcd without TLS or authentication" in standby.log_tail(400)
    # One event log across the takeover, in the object store: no gap, no seq twice, every
    # round closed once; the new leader's local log adopted the old one's records.
    bucket, prefix = parse_url(url)
    remote = RemoteEvents(store.client, bucket, prefix + "/")
    history = read_remote(remote)
    seqs = [e["seq"] for e in history.events]
    assert seqs == list(range(1, len(seqs) + 1)) and not history.gaps
    closed = [e["round"] for e in history.events if e["kind"] == "round_closed"]
    assert closed == list(range(ROUNDS)), closed
    local = read_events(standby.state_dir / "events.jsonl")
    assert [e["seq"] for e in local] == seqs


def _try(fn, *args):
    try:
        return fn(*args)
    except grpc.RpcError:
        return None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ha", "etcd//127.0.0.1:2379"], "expected etcd://HOST:PORT"),
        (["--ha", "etcd://127.0.0.1:2379,nohost"], "bad endpoint 'nohost'"),
        (["--ha", "etcd://127.0.0.1:2379", "--ha-ttl", "1"], "--ha-ttl must be >= 2"),
        (["--ha", "etcd://127.0.0.1:2379"], '--ha needs [storage] url = "s3://'),
        (["--advertise", "h:1"], "--advertise needs --ha"),
    ],
)
def test_bad_ha_flags_are_refused_in_one_line(flags, message, tmp_path, capsys):
    from coordinator.cli import main

    config = h.write_config(tmp_path, h.job_config())
    assert main(["serve", "--config", str(config), "--insecure", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "state").exists()  # nothing was touched


def test_a_standby_of_a_split_job_wants_the_jobs_shard_key_before_it_stands_by(
    tmp_path, capsys, monkeypatch
):
    from coordinator.cli import main

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")

    cfg = h.job_config()
    cfg["storage"] = {"url": "s3://bucket/job"}
    cfg["shards"] = {"count": 2}
    config = h.write_config(tmp_path, cfg)
    assert main(["serve", "--config", str(config), "--insecure", "--ha", "etcd://h:2379"]) == 2
    err = capsys.readouterr().err
    assert "shard.key: No such file or directory" in err and "certs shard-key" in err
    assert not (tmp_path / "state" / "shard.key").exists()
    assert not (tmp_path / "state" / "checkpoints").exists()


def test_a_lead_of_shards_on_other_hosts_wants_the_jobs_key(tmp_path):
    from core_helpers import core_config

    from coordinator.shards.local import open_shards

    cfg = core_config(tmp_path, shards={"count": 2, "addresses": ["127.0.0.1:7071"]})
    with pytest.raises(ConfigError, match=r"shard\.key: No such file.*certs shard-key"):
        open_shards(cfg, None, None)
    assert not (cfg.state_dir / "shard.key").exists()


def test_a_name_the_coordinators_certificate_lacks_is_refused(tmp_path):
    from coordinator.cli.ha import check_advertised_name

    cert = Bundle.load(pki(tmp_path)["coordinator"]).cert
    check_advertised_name("127.0.0.1:7070", cert)  # a name it holds
    with pytest.raises(ConfigError, match=r"named 'db7\.example'.*holds 127\.0\.0\.1.*--advertise"):
        check_advertised_name("db7.example:7070", cert)
