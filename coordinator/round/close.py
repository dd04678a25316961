"""Closing a round: record -> aggregate -> outer step -> downlink -> publish -> checkpoint.

Each step is one method. ``record`` makes the decision durable (the keys that count, in fold
order); with the previous checkpoint it determines theta_{r+1}. ``aggregate`` takes the running
sum (every update was folded in as it arrived) or, for robust aggregation and strategies that
take every update, screens and combines the spooled updates now. ``outer_step`` is the
strategy's. ``downlink`` makes theta_{r+1} exactly what sites will rebuild from the encoded
delta. ``publish`` hashes theta_{r+1} once, swaps it in and wakes every waiting site. The
``checkpoint`` is written in the background; the round's spool goes once it is durable, and
the event log's live file moves to a segment if it has grown past ``events.rotate_bytes``.
Then theta_{r+1} goes to the ``[evaluation]`` hook, which runs on a thread of its own.

A failure in any step before ``publish`` stops the job with the checkpoint of round r (and the
close record) unchanged: a restart recomputes the same theta_{r+1}.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

from coordinator.events.log import EventLog, EventLogError, EventSink
from coordinator.intake.spool import UpdateSpool
from coordinator.intake.uploads import UploadTable
from coordinator.members.membership import Membership
from coordinator.observe.evaluator import Evaluator
from coordinator.persist.checkpointing import CheckpointWriter
from coordinator.persist.disk import until_written
from coordinator.persist.local_store import Checkpoint
from coordinator.persist.open_store import checkpoint_bytes
from coordinator.persist.theta_file import ThetaFile
from coordinator.persist.theta_writer import ThetaFiles
from coordinator.records import ClosedRound, FatalError
from coordinator.round.downlink import Downlink
from coordinator.round.driver import CloseOrder
from coordinator.round.publish import hash_theta, publication
from coordinator.round.round_tensors import RoundTensors
from coordinator.round.rules import next_round
from coordinator.shards.lead import LeadShards, composed, records_to_json
from coordinator.state import CoordinatorState
from strategies import RobustAggregator, Strategy
from strategies.base import (
    Aggregate,
    StrategyError,
    all_finite,
    call_hook,
    check_outer_result,
    check_state,
    steps_in_place,
)
from strategies.robust import Outcome
from wire.theta import ThetaBuffer

log = logging.getLogger("isthmus.coordinator")


@dataclass
class CloseParts:
    """What the pipeline works with (owned by the core)."""

    job_name: str
    state: CoordinatorState
    lock: threading.RLock
    strategy: Strategy
    aggregator: RobustAggregator
    downlink: Downlink | None
    members: Membership
    data: object  # the data mode
    spool: UpdateSpool
    uploads: UploadTable
    writer: CheckpointWriter
    sink: EventSink
    events: EventLog
    stopping: threading.Event  # gives up waiting for disk space (``coordinator.persist.disk``)
    theta_files: ThetaFiles  # theta_r's file; theta_{r+1}'s is written once it is served
    evaluator: Evaluator | None = None  # ``[evaluation]``: given theta_{r+1} once in its file
    tensors: RoundTensors | None = None  # with ``[streaming]``: the fragment each round syncs
    shards: LeadShards | None = None  # ``[shards]``: the other shards, which step with this one


class ClosePipeline:
    def __init__(self, parts: CloseParts) -> None:
        self.p = parts

    def run(self, order: CloseOrder) -> None:
        started = time.monotonic()
        r = order.round.number
        clock = _Phases()
        try:
            rung = order.downlink_rung if order.replay else self.record(order)
            clock.lap("record_s")
            outcome = self.aggregate(order)
            clock.lap("aggregate_s")
            self.p.theta_files.wait()  # theta_r in its file (the fold worker wrote it first)
            theta = self.p.state.theta
            nxt = self.outer_step(order, theta, outcome)
            clock.lap("outer_step_s")
            if self.p.downlink is not None:
                if nxt is theta:  # nothing counted: theta_r is being served, do not write it
                    nxt = ThetaBuffer.copy_of(theta.tensors)
                self.p.downlink.step(theta.tensors, nxt.tensors, r, self._synced(r), rung)
            self.p.theta_files.release()
            clock.lap("downlink_s")
            strategy_state = check_state(self.p.strategy, call_hook(self.p.strategy, "state_dict"))
            shard_records = None
            if self.p.shards is not None:  # every shard steps before theta_{r+1} is served
                shard_records = self.p.shards.close(r, order.updates, self.p.members.epoch)
                clock.lap("shards_s")
        except Exception as exc:
            with self.p.lock:
                self.p.state.fatal = (
                    f"outer step of round {r} failed: {exc}; the checkpoint of round {r} is "
                    "unchanged"
                )
            log.exception("outer step failed; the last checkpoint is unchanged")
            raise FatalError(self.p.state.fatal) from exc
        self._note(r, outcome)
        theta_hash, meta, nxt = self.publish(order, nxt, outcome, clock, rung, shard_records)
        served = functools.partial(self._served_from_file, r + 1)
        written = self.p.theta_files.submit(r + 1, nxt, served)
        del nxt  # theta_{r+1}'s buffer goes once its file serves (the next sum needs the room)
        self.checkpoint(order, written, theta_hash, strategy_state, meta)
        log.info(
            "round %d closed (%s): %d update(s), published theta_%d %s in %.2fs",
            r,
            order.reason,
            len(order.keys),
            r + 1,
            theta_hash.hex()[:12],
            time.monotonic() - started,
        )

    def _served_from_file(self, version: int, file: ThetaFile) -> None:
        """theta_``version``'s file is written (on the fold worker): serve and step from it."""
        with self.p.lock:
            s = self.p.state
            if s.published.version == version:
                s.published.payload.to_file(file)
                s.theta = file.theta
        if self.p.evaluator is not None:  # on its own thread: returns at once
            self.p.evaluator.submit(version, file.theta.tensors)

    # ---- the steps --------------------------------------------------------------------------

    def record(self, order: CloseOrder) -> int | None:
        """The decision, durable before anything is computed from it; with an adaptive
        downlink its rung is part of it (returned)."""
        record = {
            "keys": [k.to_json() for k in order.keys],
            "reason": order.reason,
            "participants": sorted(order.round.participants),
            "slots": list(order.slots),
        }
        choice = self._downlink_choice(order)
        if choice is not None:
            record["downlink"] = choice.as_record()
        until_written(
            lambda: self.p.spool.write_close(order.round.number, record),
            f"recording the close of round {order.round.number}",
            self.p.stopping,
        )
        return None if choice is None else choice.rung

    def _downlink_choice(self, order: CloseOrder):
        """An adaptive downlink's rung for theta_{r+1}'s delta (None: not adaptive)."""
        down = self.p.downlink
        if down is None or not down.adaptive:
            return None
        with self.p.lock:
            sites = self.p.members.sites
            reports = [
                sites[x].progress or {} for x in sorted(order.round.participants) if x in sites
            ]
        r = order.round.number
        return down.choose_for(self.p.state.theta.tensors, self._synced(r), reports, r)

    def aggregate(self, order: CloseOrder) -> Outcome:
        r = order.round.number
        with self.p.lock:
            metrics = self._metrics(r, sorted({k.site for k in order.keys}))
        if order.running_sum is not None:
            folded = order.running_sum.finish(order.keys).result()
            if all(all_finite(t) for t in folded.mean.values()):
                weights = {k.label: w for k, w in folded.weights.items()}
                agg = Aggregate(folded.mean, folded.total_weight, weights, r, (), {}, metrics)
                return Outcome(agg, {}, dict(order.clipped))
            log.warning("round %d: the running sum is not finite; combining again", r)
        updates = [u.as_site_update() for u in order.updates]
        like = {n: t for n, t in self.p.state.theta.tensors.items() if t.is_floating_point()}
        if self.p.tensors is not None:  # [streaming]: the round's fragment (clipped as one)
            like = self.p.tensors.restrict(like, r)
        self.p.aggregator.check(self.p.strategy, len(updates), like)
        return self.p.aggregator.aggregate(
            updates, like, r, needs_updates=self.p.strategy.needs_updates, metrics=metrics
        )

    def outer_step(self, order: CloseOrder, theta: ThetaBuffer, outcome: Outcome) -> ThetaBuffer:
        """theta_{r+1}, in the running sum's buffer when the strategy can write there."""
        self.p.writer.wait()  # the state about to change may still be being written
        if outcome.aggregate is None:
            log.warning(
                "round %d: every update was rejected; theta and the strategy state stay",
                order.round.number,
            )
            return theta
        s, agg = self.p.strategy, outcome.aggregate
        own = order.running_sum is not None and order.running_sum.buffer is not None
        own = own and steps_in_place(s)
        new = None
        if own and s.separable:
            new = self._step_by_tensor(theta, agg)
        elif own:
            new = call_hook(s, "outer_step_in_place", theta.tensors, agg)
        if new is None:
            new = check_outer_result(
                s, theta.tensors, call_hook(s, "outer_step", theta.tensors, agg)
            )
            return ThetaBuffer.copy_of(new)
        new = check_outer_result(s, theta.tensors, new)
        buffer = order.running_sum.buffer
        for name, t in new.items():  # names the step did not write into the buffer
            if t.data_ptr() != buffer.tensors[name].data_ptr():
                buffer.tensors[name].copy_(t)
        return buffer

    def _step_by_tensor(self, theta: ThetaBuffer, agg: Aggregate):
        """A separable strategy's in-place step, one tensor at a time, each tensor of theta_r
        given back to its file once stepped: theta_r is never resident whole."""
        current = self.p.theta_files.current
        release = current.release if current is not None and theta is current.theta else None
        return step_by_tensor(self.p.strategy, theta.tensors, agg, release)

    def publish(
        self, order: CloseOrder, nxt: ThetaBuffer, outcome: Outcome, clock=None, rung=None,
        shard_records=None,
    ):  # fmt: skip
        """Hash theta_{r+1}, make it the served theta and open the way to round r+1
        (``rung``: an adaptive downlink's, for the event; ``shard_records``: the other shards'
        tensors, whose digests theta's is composed with)."""
        r = order.round.number
        if shard_records is None:
            theta_hash = hash_theta(nxt)
        else:
            theta_hash = composed(nxt.tensors, shard_records)
        phases = clock.lap("hash_s") if clock is not None else {}
        closed = ClosedRound(r, frozenset(order.round.participants), order.keys, order.reason)
        with self.p.lock:
            s = self.p.state
            carried = self.p.data.round_closed(closed, self.p.sink.post)
            s.theta, s.round = nxt, next_round(order.round)
            ranged = s.published.payload.blocks_asked
            s.published = publication(r + 1, nxt, theta_hash, self.p.downlink)
            if ranged:
                s.published.payload.take_block_digests_soon()
            s.accepted, s.norms, s.slots, s.running_sum = {}, {}, [], None
            s.last_closed, s.last_close_reason = closed, order.reason
            meta = {
                "job": self.p.job_name,
                "closed_round": {
                    "number": r,
                    "reason": order.reason,
                    "sites": sorted(k.label for k in order.keys),
                    "keys": [k.to_json() for k in order.keys],
                    "participants": sorted(order.round.participants),
                    "rejected": outcome.rejected,
                    "clipped": outcome.clipped,
                    "carried_units": carried,
                },
                **self.p.data.meta(),
            }
            if shard_records is not None:
                meta["shard_tensors"] = records_to_json(shard_records)
            if self.p.events.last_closed_round != r:  # a replayed close logged before a crash
                self._post_closed(order, outcome, theta_hash, phases, rung)
            s.changed()
        self.p.uploads.drop_rounds_before(r + 1)
        return theta_hash, meta, nxt

    def _post_closed(self, order: CloseOrder, outcome: Outcome, theta_hash: bytes, phases, rung):
        agg = outcome.aggregate
        self.p.sink.post(
            "round_closed",
            round=order.round.number,
            reason=order.reason,
            updates=[k.label for k in order.keys],
            theta_digest=theta_hash.hex(),
            phases=phases,
            # What history needs (``coordinator history``):
            participants=sorted(order.round.participants),
            update_bytes=sum(u.manifest.total_bytes for u in order.updates),
            losses={
                site: m["train_loss"]
                for site, m in (agg.metrics if agg is not None else {}).items()
                if "train_loss" in m
            },
            rejected=dict(outcome.rejected),
            **(self.p.downlink.event_fields(rung) if self.p.downlink else {}),
        )

    def checkpoint(self, order, theta: Future, theta_hash: bytes, strategy_state, meta):
        """Write round r+1's checkpoint in the background, linking theta's file (``theta``:
        the future of ``ThetaFiles.submit``) once it is written."""
        r = order.round.number
        downlink = self.p.downlink.state_dict() if self.p.downlink is not None else {}
        # Every event up to this one is durable before the checkpoint is: a restart that finds
        # the log ending earlier knows that events were lost (EventLog.check_known).
        meta = {**meta, "events_seq": self.p.events.last_seq}

        def ckpt() -> Checkpoint:
            file = theta.result()
            tensors = file.theta.tensors
            return Checkpoint(r + 1, tensors, strategy_state, meta, downlink, theta_hash, file.path)

        def written(seconds: float, folder: Path) -> None:
            # An upload of a closed round still arriving (a grace or deadline closed it) is
            # refused as late when it ends: its file stays until then.
            self.p.spool.drop_rounds_before(r + 1, keep=self.p.uploads.busy_paths())
            size = checkpoint_bytes(folder)
            self.p.sink.post(
                "checkpoint_written", round=r + 1, seconds=round(seconds, 4), bytes=size
            )
            self.p.sink.flush()
            _rotate(self.p.events)

        self.p.writer.submit(ckpt, written)

    # ---- helpers ----------------------------------------------------------------------------

    def _synced(self, round_number: int):
        """The tensors round ``round_number``'s delta carries (None: all of theta)."""
        return self.p.tensors.synced(round_number) if self.p.tensors is not None else None

    def _metrics(self, round_number: int, sites: list[str]) -> dict[str, dict[str, float]]:
        """What each site last reported for this round (protobuf sends 0 for "no loss")."""
        out = {}
        for site in sites:
            p = (self.p.members.sites.get(site) or _NO_RECORD).progress or {}
            if p.get("round") == round_number and p.get("train_loss"):
                out[site] = {"train_loss": float(p["train_loss"])}
        return out

    def _note(self, round_number: int, outcome: Outcome) -> None:
        for key, norm in outcome.clipped.items():
            log.info("round %d: update of %s clipped (norm %.4g)", round_number, key, norm)
        with self.p.lock:
            for key, reason in outcome.rejected.items():
                log.warning("round %d: update of %s rejected: %s", round_number, key, reason)
                self.p.state.rejections.append(f"round {round_number}: {key}: {reason}")


def _rotate(events: EventLog) -> None:
    # The history's upkeep must not stop the job: a log that cannot rotate now grows until
    # the next checkpoint tries again.
    try:
        events.rotate()
    except (OSError, EventLogError) as exc:
        log.error(
            "event log %s: rotation failed (%s); it is tried again after the next checkpoint",
            events.path,
            exc,
        )


class _Phases:
    """Seconds each step of a close took, for the event log (and ``bench.sync``)."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.seconds: dict[str, float] = {}

    def lap(self, name: str) -> dict[str, float]:
        now = time.monotonic()
        self.seconds[name] = round(now - self.last, 4)
        self.last = now
        return dict(self.seconds)


class _NoRecord:
    progress = None


_NO_RECORD = _NoRecord()


def step_by_tensor(strategy: Strategy, theta: dict, agg: Aggregate, stepped=None):
    """A separable strategy's in-place step over ``theta``'s tensors, one at a time (the
    coordinator's close and each coordinator shard's: the same operations on each tensor).
    ``stepped(name)`` is told each tensor once it is done. None if the strategy has no in-place
    step after all (it must say so on the first tensor: after that its state has moved)."""
    new = dict(theta)
    for i, (name, delta) in enumerate(agg.mean_delta.items()):
        one = {name: theta[name]}
        only = replace(agg, mean_delta={name: delta})
        got = call_hook(strategy, "outer_step_in_place", one, only)
        if got is None and i == 0:
            return None
        if got is None:
            raise StrategyError(
                f"strategy {strategy.plugin_name!r} failed in outer_step_in_place: it returned "
                f"None for {name!r} after stepping earlier tensors (a separable strategy "
                "steps every tensor or none)"
            )
        new[name] = check_outer_result(strategy, one, got)[name]
        if stepped is not None:
            stepped(name)
    return new
