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

Nothing spooled counts again unchecked: each update's file is compared with the length and
digest its record holds (``coordinator.intake.spool_check``). A damaged one is moved aside and not
counted, its site is asked to send it again (``RoundInfo.update_wanted``), and in shared-data
mode its unit is uncommitted again (it was never committed in the checkpointed ledger: replay
simply does not commit it), so it is re-sent, re-trained elsewhere or carried over, and
counted once. A close record naming a damaged update cannot be replayed: see ``_replay_close``.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import replace

from coordinator.data.federated import FederatedData
from coordinator.data.shared import SharedData
from coordinator.intake.spool_check import SpoolCheck, Wanted, check_round
from coordinator.model_source import initial_theta, trainable_names
from coordinator.persist.local_store import Checkpoint, StoreError
from coordinator.persist.theta_file import ThetaSource
from coordinator.records import PinnedClose, UpdateKey, closed_round_of
from coordinator.round.driver import CloseOrder
from coordinator.round.publish import publication
from coordinator.round.rules import RoundState
from coordinator.shards.lead import composed, records_to_json
from coordinator.state import CoordinatorState
from strategies.base import call_hook
from strategies.robust import norm_of
from wire.digest import state_digest

log = logging.getLogger("isthmus.coordinator")


def load(core) -> tuple[CoordinatorState, object, list[str]]:
    cfg = core.cfg
    ckpt = core.store.load_latest()
    core.new_job = ckpt is None  # no leader ran before this one
    if ckpt is None:
        ckpt, file = _first_checkpoint(core)
    elif ckpt.meta.get("job") != cfg.name:
        raise StoreError(
            f"state folder {cfg.state_dir} belongs to job {ckpt.meta.get('job')!r}, "
            f"not {cfg.name!r}: use another job.state_dir"
        )
    else:
        where = f"the checkpoint of round {ckpt.round}"
        if core.term is None:  # elected through etcd: another host's log wrote that seq
            core.events.check_known(ckpt.meta.get("events_seq"), where)
        call_hook(core.strategy, "load_state_dict", ckpt.strategy_state)
        file = core.theta_files.start(ckpt.round, ckpt.theta, ckpt.theta_file)
        log.info("resumed job %r at round %d (epoch %d)", cfg.name, ckpt.round, core.members.epoch)
    if core.downlink is not None:
        core.downlink.load_state_dict(ckpt.downlink, ckpt.round)
    closed = ckpt.meta.get("closed_round", {})
    last_closed = closed_round_of(closed) if closed else None
    if cfg.data.mode == "shared":
        data = SharedData.from_meta(ckpt.meta, cfg.speculation)
    else:
        fragments = cfg.streaming.fragments if cfg.streaming is not None else 1
        data = FederatedData.from_meta(
            ckpt.meta, core.strategy, last_closed, fragments, cfg.rounds.max_staleness
        )
    theta = file.theta
    theta_hash = ckpt.theta_hash  # with shards: composed with the other shards' (recorded)
    if (core.shards is not None) != ("shard_tensors" in ckpt.meta):
        split = "split over coordinator shards" if core.shards is None else "one coordinator's"
        raise StoreError(
            f"the state in {cfg.state_dir} is {split}: keep [shards] count as the job started with"
        )
    source = ThetaSource.of_file(file)
    state = CoordinatorState(
        round=RoundState(number=ckpt.round),
        theta=theta,
        published=publication(ckpt.round, theta, theta_hash, core.downlink, source),
        wake=core.wake,
        total_rounds=cfg.rounds.total,
        last_closed=last_closed,
    )
    for key, reason in sorted(closed.get("rejected", {}).items()):
        state.rejections.append(f"round {closed['number']}: {key}: {reason}")
    return state, data, trainable_names(theta.tensors)


def _first_checkpoint(core):
    """A new job's checkpoint of theta_0, and theta_0's file."""
    cfg = core.cfg
    meta = {"job": cfg.name, "events_seq": core.events.last_seq}
    if core.shards is None:
        initial = initial_theta(cfg.model)  # the model goes once its file is written
        theta_hash = state_digest(initial)
    else:  # the lead keeps shard 0's tensors; the other shards say what theirs are
        initial = initial_theta(cfg.model, core.shards.plan.names(0))
        others = core.shards.served_records(0)
        meta["shard_tensors"] = records_to_json(others)
        theta_hash = composed(initial, others)
    file = core.theta_files.start(0, initial)
    del initial
    theta = file.theta.tensors
    ckpt = Checkpoint(0, theta, {}, meta, {}, theta_hash, file.path)
    core.store.save(ckpt)
    log.info("new job %r: theta_0 has %d tensors", cfg.name, len(theta))
    return ckpt, file


def resume(core) -> None:
    s = core.state
    core.sink.post("start", epoch=core.members.epoch, round=s.round.number)
    first = s.round.number
    checks = _SpoolChecks(core)
    record = core.spool.read_close(first)
    pin = None
    if record is not None and not s.finished:
        pin = _replay_close(core, first, record, checks(first))
    if core.shards is not None:  # every shard serves this theta, and follows this start
        core.shards.align(s.round.number, core.members.epoch)
    expected = _reopen(core, s.round.number, checks(s.round.number), pin)
    if expected is None:
        # Between rounds, or after the last one (the sites still fetch the final theta):
        # the sites of the round closed last are expected back.
        expected = sorted(s.last_closed.sites) if s.last_closed else []
        for update in checks(s.round.number).good:
            if update.key.late_from is not None:  # folded before the round opened
                s.accepted[update.key] = update
    # After a takeover every update of the round in flight (and of the next) is wanted: they
    # went to a spool on another host (a site re-sends one it delivered there; one never sent
    # is just sent). The first leader of a new job takes over from nobody.
    lost = _lost(checks(s.round.number), pin)
    takeover = core.term is not None and not core.new_job
    s.wanted = (Wanted.after_takeover if takeover else Wanted)(s.round.number, lost)
    s.pinned = pin if s.round.opened_at is not None else None
    # A drained site is refused when it re-joins: holding a lease for it would only keep the
    # round waiting for an update that cannot come.
    expected = [site for site in expected if site not in core.control.drains]
    core.members.provisional(expected, core.clock())
    if expected:
        log.info("expecting %s to re-join", ", ".join(expected))
    core.spool.drop_rounds_before(first)


class _SpoolChecks:
    """Each replayed round's spool, checked once (``coordinator.intake.spool_check``)."""

    def __init__(self, core) -> None:
        self.core, self.done = core, {}

    def __call__(self, number: int) -> SpoolCheck:
        if number not in self.done:
            self.done[number] = _checked(self.core, number)
        return self.done[number]


def _checked(core, number: int) -> SpoolCheck:
    """Round ``number``'s spool checked, each damaged update in the event log too."""
    check = check_round(core.spool, number)
    for d in check.damaged:
        core.sink.post("update_damaged", round=number, key=d.key.label, why=d.describe())
    return check


def _replay_close(core, number: int, record: dict, check: SpoolCheck) -> PinnedClose | None:
    """Carry out a close decided before the restart, from its record and the spool.

    When the record names an update the spool no longer holds intact, the close cannot be
    carried out and is *pinned* instead (returned): the round opens again, takes back exactly
    the recorded updates (their sites are asked to send the lost ones again), and then closes
    as recorded. A site's update is a deterministic payload it keeps until the round after
    next opens (``site_client.agent.tasks``), so an identical re-send gives the same theta_{r+1} bit
    for bit, which is the safest outcome: theta_{r+1} may have been served already. Dropping
    the record and closing by the ordinary rules could count a different set of updates (a
    straggler's late one, none of the lost ones) and publish a different theta_{r+1} under the
    same version; the pin holds only until the round's deadline, counted from this restart
    (and kept across further ones), so a site that can no longer re-send does not stall the
    job for good. The record itself stays: a restart meanwhile pins the round again. What
    round r+1 spooled before the restart is left alone until then (``after_pinned_close``).
    """
    s = core.state
    keys = [UpdateKey.from_json(k) for k in record["keys"]]
    spooled = {u.key: u for u in check.good}
    lost = [k.label for k in keys if k not in spooled]
    if lost:
        log.error(
            "round %d was decided before the restart, but its close record names spooled "
            "update(s) that are damaged or missing: %s. The close cannot be replayed: the round "
            "opens again and waits for exactly its recorded updates; an identical re-send gives "
            "the same theta_%d. theta_%d may have been served already: should the round close "
            "without them (its deadline), theta_%d differs and the sites that fetched it must "
            "fetch it again",
            number,
            ", ".join(lost),
            number + 1,
            number + 1,
            number + 1,
        )
        return PinnedClose(tuple(keys), record["reason"])
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
        downlink_rung=record.get("downlink", {}).get("rung"),
    )
    core.pipeline.run(order)
    return None


def _reopen(core, number: int, check: SpoolCheck, pin: PinnedClose | None) -> list[str] | None:
    """Open the round in flight at the crash again; the sites expected back, or None."""
    s = core.state
    saved = None if s.finished else core.spool.read_round(number)
    if saved is None:
        return None
    if pin is not None and "reopened_wall" not in saved:
        saved = {**saved, "reopened_wall": time.time()}
        core.spool.write_round(number, saved)
    expected = sorted(saved["participants"])
    # The deadline runs from when the round first opened (for a pinned round: first opened
    # again), not from this restart, or repeated crashes could hold a round open for ever.
    since = saved.get("reopened_wall" if pin is not None else "opened_wall", time.time())
    elapsed = max(0.0, time.time() - since)
    s.round = RoundState(number, opened_at=core.clock() - elapsed, participants=frozenset(expected))
    core.data.round_opened(s.round, core.sink.post)
    s.slots = list(saved.get("slots") or core.data.slots(s.round))
    for update in check.good:
        s.round = core.data.replay(s.round, update.key, update.weight)
        s.accepted[update.key] = update
    for key in sorted(_lost(check, pin) - s.accepted.keys(), key=lambda k: k.label):
        core.data.readmit(s.round, key)  # the site may send it again
    _measure(core)
    s.running_sum = core.new_sum(s.slots)
    call_hook(core.strategy, "begin_round", s.round.number, s.theta.tensors)
    log.info("round %d replays with %d spooled update(s)", number, len(s.accepted))
    return expected


def after_pinned_close(core, kept: bool) -> None:
    """The round after a pinned one (see ``_replay_close``), once that closed.

    Closed as recorded (``kept``), theta_{r+1} is the one served before the restart, so what
    round r+1 spooled before it stays valid: the round opens again from its spool, exactly as
    at a restart after an ordinary close replay. Closed by the ordinary rules instead, theta_{r+1}
    is another one and round r+1's spooled updates were trained from the old one: they go.
    """
    number = core.state.round.number
    folder = core.spool.round_dir(number)
    if not kept:
        if folder.exists():
            log.error(
                "round %d: dropping the updates spooled before the restart (trained from the "
                "old theta_%d): %s",
                number,
                number,
                ", ".join(u.key.label for u in core.spool.completed(number)) or "none",
            )
            shutil.rmtree(folder, ignore_errors=True)
        return
    check = _checked(core, number)  # the hashing, without the lock
    with core.lock:
        s = core.state
        if s.round.number != number or s.round.opened_at is not None:
            return
        if _reopen(core, number, check, None) is not None:
            s.wanted = Wanted(number, _lost(check, None), s.wanted.every_through)
            s.changed()


def _lost(check: SpoolCheck, pin: PinnedClose | None) -> frozenset[UpdateKey]:
    """Updates of the round whose spooled copy is gone: set aside as damaged (now or at an
    earlier start), or named by a close record that cannot be replayed."""
    return check.set_aside | frozenset(pin.keys if pin is not None else ())


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
