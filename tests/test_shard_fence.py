"""A shard follows the newest lead (epoch fencing) and goes back one version when a lead that
takes over holds an older checkpoint (``coordinator.shards.fence``): the pure decisions, then
real shard processes over mutual TLS, judged against the one-process coordinator bit for bit.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from shard_helpers import (
    SITES,
    OneProcess,
    delta,
    fetch_all,
    lead_of,
    make_pki,
    plan_of,
    push_update,
    start_shards,
    stub,
    theta_0,
)

from coordinator.records import Refused
from coordinator.shards.fence import EpochFence, align_compute, fence_compute
from wire.proto import isthmus_pb2 as pb


def test_align_keeps_rewinds_one_kept_version_and_refuses_the_rest():
    assert align_compute(1, 4, [3, 4], 4).action == "keep"
    step = align_compute(1, 4, [3, 4], 3)
    assert step.action == "rewind" and "theta_4 was closed by a lead that did not" in step.why
    gone = align_compute(1, 4, [4], 3)
    assert gone.action == "refuse" and "keeps versions [4], not theta_3" in gone.why
    behind = align_compute(2, 4, [3, 4], 6)
    assert behind.action == "refuse" and "older than the lead's checkpoint" in behind.why
    ahead = align_compute(2, 4, [3, 4], 1)
    assert ahead.action == "refuse" and "shard 2 serves theta_4" in ahead.why


def test_the_fence_takes_a_newer_or_equal_lead_and_remembers_it(tmp_path):
    assert fence_compute(1, 3, 3) is None and fence_compute(1, 3, 4) is None
    assert "epoch is 2" in fence_compute(1, 3, 2)
    fence = EpochFence(tmp_path, 1)
    assert fence.epoch == 0
    fence.admit(5)
    with pytest.raises(Refused) as info:
        EpochFence(tmp_path, 1).admit(4)  # as a restarted shard reads it
    assert info.value.code == "stale" and "follows the lead of epoch 5" in str(info.value)
    (tmp_path / "fence.json").write_text("{not json")
    with pytest.raises(ValueError, match="fence.json is damaged"):
        EpochFence(tmp_path, 1)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _align(shard, pki, who, version, epoch, plan) -> pb.ShardStatusReply:
    request = pb.ShardAlignRequest(version=version, epoch=epoch, plan_digest=plan.digest())
    return stub(shard.address, pki, who).Align(request, timeout=30)


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_a_lead_that_takes_over_rewinds_the_shards_and_fences_the_old_one(tmp_path, pki):
    """The leader of epoch 1 closes round 0 on the shards but never checkpoints it; its
    successor (epoch 2, another certificate) holds theta_0: the shards go back to theta_0,
    refuse the old leader from then on (also after a kill -9), and the rounds the new leader
    closes, with other updates, end on the one-process theta bit for bit (momentum too)."""
    shards = start_shards(tmp_path, pki, 2, leads=("lead", "standby"))
    plan = plan_of(2)
    old, new = lead_of(shards, pki, plan), lead_of(shards, pki, plan, "standby")
    ref = OneProcess(tmp_path / "one")
    try:
        lost = {s: delta(theta_0(), s, 100) for s in SITES}  # what the old leader closed
        counted = [push_update(shards, pki, s, 0, lost[s], plan)[0] for s in SITES]
        assert old.close(0, counted, epoch=1)[0] == 1
        first = [_status(s, pki) for s in shards]
        assert all(r.version == 1 for r in first)

        assert all(_align(s, pki, "standby", 0, 2, plan).version == 0 for s in shards)
        _, theta = fetch_all(shards, pki)
        assert all(torch.equal(theta[n], t) for n, t in theta_0().items())
        err = _refused(lambda: old.close(0, counted, epoch=1))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "follows the lead of epoch 2" in err.details()
        shards[1].kill()  # the fence is on disk
        shards[1].start()
        err = _refused(lambda: _align(shards[1], pki, "lead", 0, 1, plan))
        assert "follows the lead of epoch 2" in err.details()
        assert [_status(s, pki).version for s in shards] == [0, 0]

        for r in range(2):
            deltas = {s: delta(ref.core.theta, s, r) for s in SITES}
            want = ref.round(r, deltas)
            counted = [
                push_update(shards, pki, s, r, deltas[s], plan, f"{s}-new-{r}")[0] for s in SITES
            ]
            assert new.close(r, counted, epoch=2) == (r + 1, want)
        _, theta = fetch_all(shards, pki)
        assert all(torch.equal(theta[n], ref.core.theta[n]) for n in ref.core.theta)
    finally:
        old.shutdown()
        new.shutdown()
        ref.close()
        for s in shards:
            s.stop()


def _status(shard, pki) -> pb.ShardStatusReply:
    return stub(shard.address, pki, "ops").Status(pb.ShardStatusRequest(), timeout=10)


def test_an_align_that_cannot_be_carried_out_changes_nothing(tmp_path, pki):
    shards = start_shards(tmp_path, pki, 2)
    plan = plan_of(2)
    try:
        shard = shards[0]
        before = _status(shard, pki)

        def refused(who, version, epoch, code, words, digest=None):
            request = pb.ShardAlignRequest(
                version=version, epoch=epoch, plan_digest=digest or plan.digest()
            )
            err = _refused(lambda: stub(shard.address, pki, who).Align(request, timeout=30))
            assert err.code() == code, err.details()
            assert words in err.details()

        invalid = grpc.StatusCode.INVALID_ARGUMENT
        refused("lead", 3, 1, invalid, "shard 0 serves theta_0, the lead's checkpoint holds")
        refused("lead", 0, 1, invalid, "plan", digest="0" * 16)
        denied = grpc.StatusCode.PERMISSION_DENIED
        refused("site-a", 0, 1, denied, "coordinator certificate")
        refused("shards", 0, 1, denied, "only the lead ('lead') sets the theta served")
        refused("standby", 0, 1, denied, "this certificate is 'standby'")
        assert _status(shard, pki) == before
        assert not (shard.folder / "fence.json").exists()  # no refused call moved the fence
    finally:
        for s in shards:
            s.stop()
