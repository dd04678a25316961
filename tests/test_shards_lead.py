"""The lead of a sharded job (a ``CoordinatorCore`` with ``LeadShards``) against a real shard
process over mutual TLS: it counts an update only with the shard's receipt, refuses a part
with another shard's tensor naming that shard, and what it refuses changes nothing."""

from __future__ import annotations

import shutil

import pytest
import torch
from core_helpers import Clock, core_config
from shard_helpers import (
    MODEL,
    SITES,
    STRATEGY,
    delta,
    make_pki,
    pass_of,
    plan_of,
    push_part,
    split_update,
    start_shards,
    stub,
    theta_0,
)

from coordinator.core import CoordinatorCore
from coordinator.records import PushHeader, Refused
from coordinator.shards.lead import LeadShards
from coordinator.shards.receipts import load_key
from wire.identity import Bundle
from wire.net.channel import open_channel


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def lead(tmp_path, pki):
    shards = start_shards(tmp_path, pki, 2)
    plan = plan_of(2)
    bundle = Bundle.load(pki / "lead")
    lead_shards = LeadShards(
        plan, load_key(shards[0].key), [shards[1].address], lambda a: open_channel(a, bundle)
    )
    clock = Clock()
    cfg = core_config(tmp_path / "lead", model=MODEL, strategy=STRATEGY, rounds={"max_sites": 2})
    core = CoordinatorCore(cfg, clock=clock, shards=lead_shards)
    tokens = {s: core.join(s)[0].token for s in SITES}
    clock.now += 1.0
    core.tick()
    yield core, tokens, shards, plan
    core.close()
    for s in shards:
        s.stop()


def _push(core, site, token, parts, digests, receipts, upload_id):
    own = parts[0]
    header = PushHeader(
        site=site,
        token=token,
        round=0,
        upload_id=upload_id,
        manifest=own.manifest.to_proto(),
        weight=1.0,
        base_version=0,
        shard_digests=tuple(digests),
        shard_receipts=tuple(receipts),
    )
    upload = core.begin_upload(header)
    try:
        core.upload_chunk(upload, 0, bytes(own.payload), token)
        return core.finish_upload(upload, token)
    finally:
        core.release_upload(upload)


def _parts(core, shards, pki, site, plan, upload_id):
    update = delta(theta_0(), site, 0)
    parts = split_update(update, plan)
    granted = pass_of(shards, site, 0)
    to = stub(shards[1].address, pki, site)
    reply = push_part(to, site, 0, upload_id, parts[1], 1.0, shard_pass=granted)
    return parts, [b"", parts[1].manifest.digest], [b"", reply.receipt]


def _closed_never_checkpointed(core, monkeypatch) -> bytes:
    """Close round 0 (the shards step) and die before the checkpoint of round 1 is written;
    theta_1's published digest."""
    from coordinator.persist import local_store as store_mod

    def crash(self, ckpt):
        core.stopping.set()
        raise OSError("killed")

    monkeypatch.setattr(store_mod.CheckpointStore, "save", crash)
    assert core.tick() and core.round.number == 1
    with pytest.raises(OSError):
        core.writer.wait()
    core.events.close()
    monkeypatch.undo()
    return core.published.theta_hash


def _started_again(tmp_path, pki, shards, plan) -> CoordinatorCore:
    """The lead started again on its state folder (a new epoch)."""
    bundle = Bundle.load(pki / "lead")
    again_shards = LeadShards(
        plan, load_key(shards[0].key), [shards[1].address], lambda a: open_channel(a, bundle)
    )
    cfg = core_config(tmp_path / "lead", model=MODEL, strategy=STRATEGY, rounds={"max_sites": 2})
    return CoordinatorCore(cfg, clock=Clock(50.0), shards=again_shards)


def test_the_lead_counts_an_update_only_with_every_receipt(lead, pki):
    core, tokens, shards, plan = lead
    site = "site-a"
    parts, digests, receipts = _parts(core, shards, pki, site, plan, "u1")
    received = dict(core.round.received)

    def refused(digests_, receipts_, words, upload_id="u1"):
        with pytest.raises(Refused) as info:
            _push(core, site, tokens[site], parts, digests_, receipts_, upload_id)
        assert words in str(info.value)
        assert dict(core.round.received) == received  # nothing counted

    refused([], [], "split over 2 shards")
    refused(digests, [b"", b"\0" * 32], "no valid receipt of shard 1")
    refused(digests, receipts, "no valid receipt of shard 1", upload_id="u2")  # another upload
    refused([b"", b"\1" * 32], receipts, "no valid receipt of shard 1")  # another part
    # a tensor of shard 1 in the lead's part
    name = plan.names(1)[0]
    wrong = split_update({name: torch.zeros(4)}, plan)[1]
    with pytest.raises(Refused) as info:
        _push(core, site, tokens[site], [wrong], digests, receipts, "u1")
    assert f"tensor {name!r} belongs to shard 1" in str(info.value)
    assert _push(core, site, tokens[site], parts, digests, receipts, "u1")
    assert site in core.round.received


def test_a_lead_restarted_between_publishing_and_checkpointing_gives_the_same_theta(
    tmp_path, pki, lead, monkeypatch
):
    core, tokens, shards, plan = lead
    for site in SITES:
        parts, digests, receipts = _parts(core, shards, pki, site, plan, f"{site}-0")
        assert _push(core, site, tokens[site], parts, digests, receipts, f"{site}-0")

    published = _closed_never_checkpointed(core, monkeypatch)
    assert (shards[1].folder / "parts" / "v00000001").exists()  # the shard stepped already

    again = _started_again(tmp_path, pki, shards, plan)
    try:
        assert again.round.number == 1 and again.published.theta_hash == published
        again.writer.wait()
    finally:
        again.close()


def test_a_lead_over_an_older_checkpoint_has_the_shard_go_back_and_fences_the_old_one(
    tmp_path, pki, lead, monkeypatch
):
    """As a standby taking over on another host: the close of round 0 reached the shard, the
    checkpoint of round 1 was never written and the spool is not there. The new lead (a higher
    epoch) reopens round 0 over theta_0; the shard serves theta_0 again and refuses the old
    lead's close from then on."""
    import grpc

    core, tokens, shards, plan = lead
    theta_0_hash = core.published.theta_hash
    for site in SITES:
        parts, digests, receipts = _parts(core, shards, pki, site, plan, f"{site}-0")
        assert _push(core, site, tokens[site], parts, digests, receipts, f"{site}-0")

    _closed_never_checkpointed(core, monkeypatch)
    shutil.rmtree(tmp_path / "lead" / "state" / "spool")  # on another host: no spool here
    again = _started_again(tmp_path, pki, shards, plan)
    try:
        assert again.members.epoch > core.members.epoch
        assert again.round.number == 0 and again.published.theta_hash == theta_0_hash
        assert not (shards[1].folder / "parts" / "v00000001").exists()
        (state,) = again.shards.states()
        assert state.version == 0
        with pytest.raises(grpc.RpcError) as info:
            core.shards.close(0, [], core.members.epoch)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"follows the lead of epoch {again.members.epoch}" in info.value.details()
    finally:
        again.close()


def test_status_shows_each_shard_as_it_answers(lead, pki):
    from coordinator.observe.status import format_status, status_reply

    core, _, shards, plan = lead
    reply = status_reply(core.snapshot())
    reply.shards.extend(core.shards.states())
    text = format_status(reply)
    mb = plan.bytes_of(1) / 1e6
    assert f"shard 1 ({shards[1].address}): theta_0, {mb:.1f} MB of tensors" in text
    shards[1].kill()
    (state,) = core.shards.states(timeout_s=1.0)
    assert state.problem.startswith("UNAVAILABLE") or state.problem.startswith("DEADLINE")
    reply = status_reply(core.snapshot())
    reply.shards.append(state)
    assert f"shard 1 ({shards[1].address}): not answering" in format_status(reply)


def test_a_new_job_whose_shard_does_not_answer_does_not_start(tmp_path, pki):
    import socket

    from coordinator.persist.local_store import StoreError

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    bundle = Bundle.load(pki / "lead")
    shards = LeadShards(plan_of(2), b"k" * 32, [dead], lambda a: open_channel(a, bundle))
    cfg = core_config(tmp_path / "lead", model=MODEL, strategy=STRATEGY, rounds={"max_sites": 2})
    with pytest.raises(StoreError, match="shard 1 .* did not answer .* start every shard"):
        CoordinatorCore(cfg, clock=Clock(), shards=shards)
    assert not (tmp_path / "lead" / "state" / "checkpoints" / "round-00000000").exists()
