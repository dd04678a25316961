"""Start-up: the last checkpoint, then whatever the spool says happened after it.

The coordinator's durable state is its newest valid checkpoint (theta_r, strategy and downlink
state, the data ledger), the spool of the rounds since, and the event log. At start:

1. ``load``: the checkpoint (or theta_0 for a new job) becomes the state.
2. ``resume``: if round r has a close record, the coordinator had decided it (and maybe
   published theta_{r+1}) before it stopped: the close is carried out again with exactly the
   recorded updates in the recorded order, which gives the same theta_{r+1} bit for bit. Then,
   if the current round had opened, it opens again with the same participants and deadline and
   every spooled update counts again; otherwise the sites of the round closed last are expected
   back. Either way each of them holds a provisional lease until it re-joins (or it lapses).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from coordinator.federated import FederatedData
from coordinator.model_source import initial_theta, trainable_names
from coordinator.publish import publication
from coordinator.records import ClosedRound, UpdateKey
from coordinator.round_driver import CloseOrder
from coordinator.rounds import RoundState
from coordinator.shared_data import SharedData
from coordinator.state import CoordinatorState
from coordinator.store import Checkpoint, StoreError
from strategies.base import call_hook
from strategies.robust import norm_of
from wire.tensors import state_hash
from wire.theta import ThetaBuffer

log = logging.getLogger("isthmus.coordinator")


def load(core) -> tuple[CoordinatorState, object, list[str]]:
    cfg = core.cfg
    ckpt = core.store.load_latest()
    buffer = None
    if ckpt is None:
        buffer = ThetaBuffer.copy_of(initial_theta(cfg.model))  # the model itself goes now
        theta = buffer.tensors
        meta = {"job": cfg.name, "events_seq": core.events.last_seq}
        ckpt = Checkpoint(0, theta, {}, meta, {}, state_hash(theta))
        core.store.save(ckpt)
        log.info("new job %r: theta_0 has %d tensors", cfg.name, len(theta))
    elif ckpt.meta.get("job") != cfg.name:
        raise StoreError(
            f"state folder {cfg.state_dir} belongs to job {ckpt.meta.get('job')!r}, "
            f"not {cfg.name!r}: use another job.state_dir"
        )
    else:
        where = f"the checkpoint of round {ckpt.round}"
        core.events.check_known(ckpt.meta.get("events_seq"), where)
        call_hook(core.strategy, "load_state_dict", ckpt.strategy_state)
        log.info("resumed job %r at round %d (epoch %d)", cfg.name, ckpt.round, core.members.epoch)
    if core.downlink is not None:
        core.downlink.load_state_dict(ckpt.downlink, ckpt.round)
    closed = ckpt.meta.get("closed_round", {})
    last_closed = _closed_round(closed) if closed else None
    if cfg.data.mode == "shared":
        data = SharedData.from_meta(ckpt.meta, cfg.speculation)
    else:
        data = FederatedData(core.strategy, last_closed)
    theta = (buffer or ThetaBuffer.copy_of(ckpt.theta)).with_digest()
    theta_hash = ckpt.theta_hash or bytes.fromhex(ckpt.meta["theta_sha256"])
    state = CoordinatorState(
        round=RoundState(number=ckpt.round),
        theta=theta,
        published=publication(ckpt.round, theta, theta_hash, core.downlink),
        wake=core.wake,
        total_rounds=cfg.rounds.total,
        last_closed=last_closed,
    )
    for key, reason in sorted(closed.get("rejected", {}).items()):
        state.rejections.append(f"round {closed['number']}: {key}: {reason}")
    return state, data, trainable_names(theta.tensors)


def _closed_round(closed: dict) -> ClosedRound:
    keys = tuple(UpdateKey.from_json(k) for k in closed.get("keys", []))
    participants = frozenset(closed.get("participants", closed.get("sites", [])))
    return ClosedRound(int(closed["number"]), participants, keys, closed.get("reason", ""))


def resume(core) -> None:
    s = core.state
    core.sink.post("start", epoch=core.members.epoch, round=s.round.number)
    first = s.round.number
    record = core.spool.read_close(first)
    if record is not None and not s.finished:
        _replay_close(core, first, record)
    expected = _reopen(core, s.round.number) if not s.finished else None
    if expected is None:
        # Between rounds, or after the last one (the sites still fetch the final theta):
        # the sites of the round closed last are expected back.
        expected = sorted(s.last_closed.sites) if s.last_closed else []
        for update in core.spool.completed(s.round.number):
            if update.key.late_from is not None:  # folded before the round opened
                s.accepted[update.key] = update
    core.members.provisional(expected, core.clock())
    if expected:
        log.info("expecting %s to re-join", ", ".join(expected))
    core.spool.drop_rounds_before(first)


def _replay_close(core, number: int, record: dict) -> None:
    """Carry out a close decided before the restart, from its record and the spool."""
    s = core.state
    keys = [UpdateKey.from_json(k) for k in record["keys"]]
    spooled = {u.key: u for u in core.spool.completed(number)}
    lost = [k.label for k in keys if k not in spooled]
    if lost:
        raise StoreError(
            f"the close record of round {number} names updates the spool no longer has: {lost}"
        )
    rnd = RoundState(number, opened_at=core.clock(), participants=frozenset(record["participants"]))
    core.data.round_opened(rnd, core.sink.post)
    for k in keys:
        rnd = core.data.replay(rnd, k, spooled[k].weight)
    s.round, s.slots = replace(rnd, closed=True), list(record.get("slots", []))
    s.accepted = {k: spooled[k] for k in keys}
    clipped = _measure(core)
    s.running_sum = core.new_sum(s.slots)
    call_hook(core.strategy, "begin_round", number, s.theta.tensors)
    log.info("round %d was decided before the restart; closing it again", number)
    order = CloseOrder(
        s.round,
        tuple(keys),
        tuple(spooled[k] for k in keys),
        record["reason"],
        tuple(s.slots),
        s.running_sum,
        clipped,
        replay=True,
    )
    core.pipeline.run(order)


def _reopen(core, number: int) -> list[str] | None:
    """Open the round in flight at the crash again; the sites expected back, or None."""
    s = core.state
    saved = core.spool.read_round(number)
    if saved is None:
        return None
    expected = sorted(saved["participants"])
    # The deadline runs from when the round first opened, not from this restart, or
    # repeated crashes could hold a round open for ever.
    elapsed = max(0.0, time.time() - saved.get("opened_wall", time.time()))
    s.round = RoundState(number, opened_at=core.clock() - elapsed, participants=frozenset(expected))
    core.data.round_opened(s.round, core.sink.post)
    s.slots = list(saved.get("slots") or core.data.slots(s.round))
    for update in core.spool.completed(number):
        s.round = core.data.replay(s.round, update.key, update.weight)
        s.accepted[update.key] = update
    _measure(core)
    s.running_sum = core.new_sum(s.slots)
    call_hook(core.strategy, "begin_round", s.round.number, s.theta.tensors)
    log.info("round %d replays with %d spooled update(s)", number, len(s.accepted))
    return expected


def _measure(core) -> dict[str, float]:
    """With ``aggregation.clip_norm``, measure every counted update's norm again (it is not
    stored); returns the clipped ones by label."""
    s = core.state
    clipped = {}
    if not core.aggregator.clip_norm:
        return clipped
    for key, update in s.accepted.items():
        norm, _ = norm_of(update.as_site_update().reader())
        s.norms[key] = norm
        if norm > core.aggregator.clip_norm:
            clipped[key.label] = norm
    return clipped
