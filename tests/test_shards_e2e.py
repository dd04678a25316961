"""Coordinator shards as real processes over mutual TLS: K = 2 and K = 3 end on the theta one
process gives, bit for bit; a shard killed with -9 goes on from its disk; what a site or the
lead sends wrong is refused, naming the problem, and changes nothing."""

from __future__ import annotations

import grpc
import pytest
import torch
from shard_helpers import (
    SITES,
    OneProcess,
    Part,
    delta,
    fetch_all,
    fetch_part,
    lead_of,
    make_pki,
    pass_of,
    plan_of,
    push_part,
    push_update,
    split_update,
    start_shards,
    stub,
    theta_0,
)

from wire.proto import isthmus_pb2 as pb

ROUNDS = 3


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.parametrize("k", [2, 3])
def test_k_shards_end_on_the_theta_of_one_process_bit_for_bit(tmp_path, pki, k):
    ref = OneProcess(tmp_path / "one")
    shards = start_shards(tmp_path, pki, k)
    plan = plan_of(k)
    lead = lead_of(shards, pki, plan)
    try:
        assert all(plan.names(i) for i in range(k))  # every shard holds some of the model
        for r in range(ROUNDS):
            deltas = {s: delta(ref.core.theta, s, r) for s in SITES}
            want = ref.round(r, deltas)
            counted = []
            for site in SITES:
                update, receipts = push_update(shards, pki, site, r, deltas[site], plan)
                assert not lead.missing_receipts(
                    site, r, update.upload_id, update.digests, 1.0, receipts
                )
                counted.append(update)
            version, digest = lead.close(r, counted)
            assert version == r + 1
            assert digest == want, f"round {r}: K = {k} composed another theta than one process"
        versions, theta = fetch_all(shards, pki)
        assert versions == {ROUNDS}
        one = ref.core.theta
        assert set(theta) == set(one)
        assert all(torch.equal(theta[n], one[n]) for n in one)
    finally:
        lead.shutdown()
        ref.close()
        for s in shards:
            s.stop()


def test_a_shard_killed_with_minus_9_goes_on_from_its_disk(tmp_path, pki):
    ref = OneProcess(tmp_path / "one")
    shards = start_shards(tmp_path, pki, 2)
    plan = plan_of(2)
    lead = lead_of(shards, pki, plan)
    try:
        deltas = {s: delta(ref.core.theta, s, 0) for s in SITES}
        want = ref.round(0, deltas)
        counted = [push_update(shards, pki, s, 0, deltas[s], plan)[0] for s in SITES]
        shards[1].kill()  # after its receipts, before the close: the parts are on its disk
        shards[1].start()
        assert lead.close(0, counted) == (1, want)
        shards[0].kill()  # after the close: the lead sends it again
        shards[0].start()
        reply = stub(shards[0].address, pki, "lead").Close(
            pb.ShardCloseRequest(
                round=0,
                plan_digest=plan.digest(),
                parts=[
                    pb.ShardPart(
                        site=u.site, upload_id=u.upload_id, digest=u.digests[0], weight=1, alpha=1
                    )
                    for u in counted
                ],
            ),
            timeout=60,
        )
        assert reply.replayed and reply.version == 1
        assert lead.close(0, counted) == (1, want)  # every shard answers from its record
        # and round 1 goes on from the restarted shards' state (momentum included)
        deltas = {s: delta(ref.core.theta, s, 1) for s in SITES}
        want = ref.round(1, deltas)
        counted = [push_update(shards, pki, s, 1, deltas[s], plan)[0] for s in SITES]
        assert lead.close(1, counted) == (2, want)
        _, theta = fetch_all(shards, pki)
        assert all(torch.equal(theta[n], ref.core.theta[n]) for n in ref.core.theta)
    finally:
        lead.shutdown()
        ref.close()
        for s in shards:
            s.stop()


@pytest.fixture(scope="module")
def two(tmp_path_factory, pki):
    shards = start_shards(tmp_path_factory.mktemp("two"), pki, 2)
    yield shards, plan_of(2)
    for s in shards:
        s.stop()


def _status(shard, pki) -> pb.ShardStatusReply:
    return stub(shard.address, pki, "ops").Status(pb.ShardStatusRequest(), timeout=10)


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_a_part_sent_to_the_wrong_shard_is_refused_naming_its_owner(two, pki):
    shards, plan = two
    update = delta(theta_0(), "site-a", 0)
    name = plan.names(1)[0]
    wrong = split_update({name: update[name]}, plan)[1]  # a tensor shard 1 owns
    before = _status(shards[0], pki)
    err = _refused(
        lambda: push_part(
            stub(shards[0].address, pki, "site-a"),
            "site-a",
            0,
            "w1",
            wrong,
            1.0,
            shard_pass=pass_of(shards, "site-a", 0),
        )  # fmt: skip
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"tensor {name!r} belongs to shard 1" in err.details()
    assert "send it there" in err.details()
    assert _status(shards[0], pki) == before


def test_what_a_site_or_the_lead_sends_wrong_changes_nothing(two, pki):
    shards, plan = two
    part = split_update(delta(theta_0(), "site-a", 0), plan)[0]
    to = lambda who: stub(shards[0].address, pki, who)  # noqa: E731
    granted = lambda r: pass_of(shards, "site-a", r)  # noqa: E731
    before = _status(shards[0], pki)

    def refused(call, code, words):
        err = _refused(call)
        assert err.code() == code, err.details()
        assert words in err.details()

    denied = grpc.StatusCode.PERMISSION_DENIED
    # a site's certificate claiming another site
    refused(lambda: push_part(to("site-b"), "site-a", 0, "x1", part, 1.0), denied, "site-b")
    # a part for a round that is not open
    refused(
        lambda: push_part(to("site-a"), "site-a", 5, "x2", part, 1.0, shard_pass=granted(5)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "round 5 is not open yet",
    )
    # bytes that are not what the manifest's digest says
    flipped = bytearray(part.payload)
    flipped[3] ^= 0x40
    bad = Part(0, part.manifest, memoryview(flipped))
    refused(
        lambda: push_part(to("site-a"), "site-a", 0, "x3", bad, 1.0, shard_pass=granted(0)),
        grpc.StatusCode.DATA_LOSS,
        "refused",
    )
    # only the lead closes a round
    close = pb.ShardCloseRequest(round=0, plan_digest=plan.digest())
    refused(lambda: to("site-a").Close(close, timeout=10), denied, "coordinator certificate")
    # nor does another coordinator certificate of the job (a shard's own)
    refused(lambda: to("shards").Close(close, timeout=10), denied, "only the lead ('lead')")
    # a part the shard does not hold
    ghost = pb.ShardCloseRequest(
        round=0,
        plan_digest=plan.digest(),
        parts=[pb.ShardPart(site="site-a", upload_id="nope", digest=b"x" * 32, weight=1, alpha=1)],
    )
    refused(lambda: to("lead").Close(ghost, timeout=10), grpc.StatusCode.NOT_FOUND, "pushes it")
    # another plan, a round the shard is not at
    other = pb.ShardCloseRequest(round=0, plan_digest="0" * 16)
    refused(lambda: to("lead").Close(other, timeout=10), grpc.StatusCode.INVALID_ARGUMENT, "plan")
    ahead = pb.ShardCloseRequest(round=3, plan_digest=plan.digest())
    refused(
        lambda: to("lead").Close(ahead, timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
        "cannot close round 3",
    )
    assert _status(shards[0], pki) == before

    # a receipt checks only for what the shard signed
    reply = push_part(to("site-a"), "site-a", 0, "good", part, 1.0, shard_pass=granted(0))
    lead = lead_of(shards, pki, plan)
    try:
        sig, digest = reply.receipt, part.manifest.digest
        other_sig = b"\0" * 32
        assert lead.missing_receipts(
            "site-a", 0, "good", [digest, digest], 1.0, [sig, other_sig]
        ) == [1]
        forged = bytes([sig[0] ^ 1]) + sig[1:]
        assert (
            lead.missing_receipts("site-a", 0, "good", [digest, digest], 1.0, [forged, sig])[0] == 0
        )
        assert 0 in lead.missing_receipts("site-a", 0, "good", [digest, digest], 2.0, [sig, sig])
        assert 0 in lead.missing_receipts("site-b", 0, "good", [digest, digest], 1.0, [sig, sig])
        assert lead.missing_receipts("site-a", 0, "good", [digest], 1.0, [sig]) == [0, 1]
    finally:
        lead.shutdown()


def test_a_site_without_the_leads_pass_gets_nothing_from_a_shard(two, pki):
    """The lead gives a site a pass with theta (``FetchHeader.shard_pass``) only while it
    leases it: without one, with another site's or another version's, a shard takes no part
    and serves none, and says why; the lead's own fetch (its certificate) needs none."""
    shards, plan = two
    part = split_update(delta(theta_0(), "site-a", 0), plan)[0]
    to = lambda who: stub(shards[0].address, pki, who)  # noqa: E731
    before = _status(shards[0], pki)
    v = before.version
    aborted = grpc.StatusCode.ABORTED
    for wrong in (b"", pass_of(shards, "site-b", v), pass_of(shards, "site-a", v + 1), b"\0" * 32):
        err = _refused(
            lambda w=wrong: push_part(to("site-a"), "site-a", v, "p1", part, 1.0, shard_pass=w)
        )
        assert err.code() == aborted and "carries no valid pass of the lead" in err.details()
        err = _refused(lambda w=wrong: fetch_part(to("site-a"), "site-a", shard_pass=w))
        assert err.code() == aborted and "fetch theta from the coordinator first" in err.details()
    assert _status(shards[0], pki) == before
    version, tensors = fetch_part(to("site-a"), "site-a", shard_pass=pass_of(shards, "site-a", v))
    assert version == v and set(tensors) == set(plan.names(0))
    version, _ = fetch_part(to("lead"), "lead")  # the lead, for the final model
    assert version == v


def test_a_pass_binds_its_site_and_version():
    from coordinator.shards.receipts import ShardPass, pass_valid, sign_pass

    key = b"k" * 32
    mac = sign_pass(key, ShardPass("site-a", 3))
    assert pass_valid(key, ShardPass("site-a", 3), mac)
    assert not pass_valid(key, ShardPass("site-a", 4), mac)
    assert not pass_valid(key, ShardPass("site-b", 3), mac)
    assert not pass_valid(b"j" * 32, ShardPass("site-a", 3), mac)
    assert not pass_valid(key, ShardPass("site-a", 3), mac[:-1] + bytes([mac[-1] ^ 1]))
