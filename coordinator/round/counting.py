"""Whether an update counts, and counting it exactly once (under the coordinator's lock).

An upload is admitted when its stream starts (lease, round, data unit, base version: the data
mode's rule), checked again once every byte is in and verified (the round may have moved on),
*reserved* while it is made durable without the lock (no second copy of the same key, or of the
same data unit, can be reserved meanwhile, and the round does not close), then counted: the data
mode records it, the running sum gets it, the event log says so. A strategy hook that fails
while an update is weighed stops the job.
"""

from __future__ import annotations

import logging

from coordinator.intake.spool import SpooledUpdate
from coordinator.intake.uploads import Upload, UploadTable
from coordinator.members.membership import Membership
from coordinator.records import Admission, PushHeader, Refused
from coordinator.state import CoordinatorState
from strategies import RobustAggregator, Strategy, StrategyError
from strategies.base import checked_weight

log = logging.getLogger("isthmus.coordinator")


class UpdateCounter:
    def __init__(
        self,
        state: CoordinatorState,
        members: Membership,
        data,
        strategy: Strategy,
        aggregator: RobustAggregator,
        uploads: UploadTable,
        post,
    ) -> None:
        self.state, self.members, self.data = state, members, data
        self.strategy, self.aggregator, self.uploads, self.post = (
            strategy,
            aggregator,
            uploads,
            post,
        )

    def admit(self, header: PushHeader, now: float) -> Admission:
        """May this push start (its lease, its round and unit, the version it trained from)."""
        self.members.check(header.site, header.token, now)
        self._unless_finished(header.round)
        try:
            a = self.data.admit(
                self.state.round, header.site, header.round, header.data_unit, self.state.accepted
            )
        except StrategyError as exc:  # the strategy's staleness rule failed
            raise self._stop_for(exc) from exc
        pin = self.state.pinned
        if pin is not None and not pin.released and a.key not in pin.keys:
            # The round was decided before a restart: only its recorded updates are taken
            # back, so that it closes exactly as decided (``coordinator.round.recovery``).
            raise Refused(
                "late",
                f"round {header.round} was closed before the coordinator restarted; it takes "
                f"back only its recorded updates, not {a.key.label}",
            )
        if header.base_version != a.trained_from:
            raise Refused(
                "invalid",
                f"update was trained from version {header.base_version}, "
                f"round {header.round} trains from version {a.trained_from}",
            )
        return a

    def reserve(self, upload: Upload, token: int, now: float) -> tuple[Admission, float]:
        """May the complete upload still count, and with what weight; hold its key."""
        s = self.state
        # A lease that lapsed while the bytes were on their way: the upload stays whole, so
        # the site re-joins and completes it with one header instead of resending it.
        self.members.check(upload.site, token, now)
        try:
            self._unless_finished(upload.round)
            admission = self.data.recheck(s.round, upload.admission, s.accepted)
            if self._colliding(admission):
                raise Refused("busy", f"another copy of {admission.key.label} is being counted")
            weight = checked_weight(self.strategy, upload.site, upload.weight)
        except Refused as exc:
            if exc.code != "busy":  # busy is for a retry, which finds the upload whole
                self.uploads.discard(upload)
            raise
        except StrategyError as exc:
            self.uploads.discard(upload)
            raise self._stop_for(exc) from exc
        s.committing.add(admission.key)
        return admission, weight * admission.weight_factor

    def _unless_finished(self, round_number: int) -> None:
        """Once the job's last round closed nothing more counts: a late update would be
        admitted into a round that never closes (and its site told it counted)."""
        if self.state.finished:
            raise Refused(
                "late",
                f"round {round_number}: the job finished after round "
                f"{self.state.round.number - 1}; nothing more is counted",
            )

    def _colliding(self, admission: Admission) -> bool:
        """Whether an update for the same key, or the same data unit, is being committed."""
        slot = self.data.slot_of(admission.key)
        return any(
            k == admission.key or (slot is not None and self.data.slot_of(k) == slot)
            for k in self.state.committing
        )

    def count(self, upload: Upload, spooled: SpooledUpdate, a: Admission, norm, now) -> None:
        s, key = self.state, a.key
        s.committing.discard(key)
        s.round = self.data.record(s.round, key, spooled.weight, now, self.post)
        s.accepted[key] = spooled
        if norm is not None:
            s.norms[key] = norm
        if s.running_sum is not None:
            alpha = spooled.weight * self.aggregator.clip_scale(norm)
            s.running_sum.offer(self.data.slot_of(key), key, spooled, alpha)
        codecs = upload.manifest.bytes_by_codec()
        self.members.note_update(upload.site, upload.round, now, codecs, a.staleness)
        self.post(
            "update",
            round=upload.round,
            site=upload.site,
            key=key.label,
            unit=key.unit,
            late_from=key.late_from,
            weight=spooled.weight,
            digest=upload.manifest.digest.hex(),
            bytes=upload.manifest.total_bytes,
            fp32_bytes=upload.manifest.fp32_bytes(),
            codecs=codecs,
        )
        log.info("round %d: update %s counted (weight %g)", upload.round, key.label, spooled.weight)
        s.changed()

    def _stop_for(self, exc: StrategyError) -> Refused:
        """A strategy hook failed while an update was being weighed: the job stops."""
        self.state.fatal = f"{exc}; the last checkpoint is unchanged"
        log.error("stopping: %s", self.state.fatal)
        self.state.changed()
        # UNAVAILABLE: the site keeps its update and retries once the job restarts.
        return Refused("busy", f"the coordinator is stopping: {self.state.fatal}")
