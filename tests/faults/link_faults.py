"""Faults of the WAN between site-0 and the coordinator, made by site-0's relay: a cut link,
a link ten times slower than the other site's, a byte corrupted in flight, and an old update
replayed under a lease token from before a coordinator restart."""

from __future__ import annotations

import grpc
import torch

from examples.gpt_diloco.model import build_model
from faults.cluster import Cluster
from wire.identity import Bundle
from wire.net.channel import open_channel
from wire.proto import isthmus_pb2 as pb
from wire.proto import isthmus_pb2_grpc as pb_grpc
from wire.tensors import pack

ROUND = 1
CUT_S = 30.0
WAN_BPS = 1_000_000  # the "good" link of every site in the slow-link scenario
WAN_DELAY_S = 0.02


def cut_link(c: Cluster, seconds: float = CUT_S) -> None:
    """site-0 is cut off in the middle of round 1's training, then the link comes back; its
    trainers go on meanwhile, its heartbeats and push wait for the link."""
    c.wait_trained(c.sites[0], ROUND, 2)
    c.relays[0].cut(seconds)
    c.wait_for(lambda: not c.relays[0].is_cut, seconds + 10, "the link to come back")
    c.mark_fault()  # recovery counts from the link's return: the cut itself lasts 30 s


def slow_link(c: Cluster) -> None:
    """Every site on a WAN (1 MB/s, 20 ms each way); site-0's is 10x slower in both rate and
    latency for the whole job."""
    for relay in c.relays[1:]:
        relay.set_rate(WAN_BPS)
        relay.set_delay(WAN_DELAY_S)
    c.relays[0].set_rate(WAN_BPS / 10)
    c.relays[0].set_delay(WAN_DELAY_S * 10)
    c.mark_fault()


def push_outlasts_lease(c: Cluster) -> None:
    """site-0's uplink drops to 8 KB/s in round 1: its ~100 KB update takes about three lease
    TTLs to send. Round 1 must still close while the link is that slow."""
    c.wait_trained(c.sites[0], ROUND, 2)
    c.relays[0].set_rate(8_000, direction="up")
    c.mark_fault()
    try:
        c.wait_closed(ROUND, timeout=60)
    finally:  # let the job end either way
        c.relays[0].set_rate(None)


def corrupt_push(c: Cluster) -> None:
    """One byte of site-0's round-1 update is flipped on the wire (deep inside the payload:
    the push follows a few small heartbeats on the uplink)."""
    c.wait_trained(c.sites[0], ROUND, 2)
    c.mark_fault()
    c.relays[0].corrupt_next("up", after_bytes=30_000)
    c.wait_closed(ROUND, timeout=90)
    assert c.relays[0].counters().corrupted, "the armed corruption never fired"


def replay_stale_push(c: Cluster) -> None:
    """Round 1 open: remember site-0's lease, restart the coordinator, and replay an update
    for round 1 under the old token. It must be refused as fenced, and change nothing."""
    c.wait_trained(c.sites[0], ROUND, 2)
    before = c.site_status("site-0")
    assert before is not None and before.token
    c.kill_coordinator()
    c.restart_coordinator()
    status = c.status()
    assert status is not None and status.round.round == ROUND
    tls = Bundle.load(c.sites[0].tls_dir) if c.sites[0].tls_dir else None
    lease = pb.Lease(site="site-0", lease_id=before.token, token=before.token)
    with open_channel(c.coordinator.address, tls) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        for round_number in (ROUND - 1, ROUND):  # a closed round, and the open one
            try:
                reply = stub.Push(iter(_forged_update(lease, round_number)), timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.ABORTED, (exc.code(), exc.details())
            else:
                raise AssertionError(f"a replay under a stale token was answered {reply}")
    after = c.status()
    # Nothing moved; that the replay never counted shows in the final theta, which must be
    # the crash-free run's (a delta of 0.5 everywhere would change it beyond recognition).
    assert after.round.round == ROUND and after.round.theta_hash == status.round.theta_hash


def _forged_update(lease: pb.Lease, round_number: int) -> list[pb.PushMessage]:
    """A well-formed update that would move theta a lot if it counted."""
    model = build_model(d_model=32, n_layers=1, n_heads=2, d_ff=64, seq_len=32)
    delta = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    delta = {k: v for k, v in delta.items() if v.is_floating_point()}
    manifest, payload = pack(delta)
    header = pb.PushHeader(
        lease=lease,
        round=round_number,
        upload_id=f"replay-r{round_number}",
        manifest=manifest.to_proto(),
        weight=1.0,
        base_version=round_number,
    )
    return [
        pb.PushMessage(header=header),
        pb.PushMessage(chunk=pb.Chunk(offset=0, data=bytes(payload))),
    ]
