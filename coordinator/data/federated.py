"""Federated mode: each site trains on its own data, one update per participant per round.

One of the two data modes behind the coordinator's small data-mode interface (the other is
``coordinator.data.shared``): it says which updates a round admits and in which order they are
summed, and when the round may close. Whether an update counts is ``rounds.admit_update``. An
update that arrives after its round closed is dropped, or folded into the next round of its
fragment with its weight multiplied by the strategy's ``staleness_weight(k)``, k the outer steps its
fragment took without it. Without ``[streaming]`` that is the round after it; with P fragments,
round r's update folds into round r + P, the next to sync the same tensors, or with
``rounds.max_staleness = K`` into the first of r + P, r + 2P, ... r + KP still open (k = 1, 2,
... K): one that arrives while the rounds before that are open is refused as ``"later"``, naming
the round it folds into, which the site holds it for. Only an update from one of its round's
participants that the round closed without folds; one that missed r + KP is dropped. The
closed rounds this needs (the last K x P) are part of every checkpoint (``meta``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from coordinator.records import (
    Admission,
    ClosedRound,
    Refused,
    UpdateKey,
    closed_round_json,
    closed_round_of,
)
from coordinator.round.rules import (
    RoundOptions,
    RoundState,
    UpdateRefused,
    admit_update,
    record_update,
    waiting_reason,
)
from strategies import Strategy
from strategies.base import checked_staleness_weight


class FederatedData:
    kind = "federated"
    admits_latecomers = True  # past the deadline below quorum, sites that joined late count

    def __init__(
        self,
        strategy: Strategy,
        closed: Iterable[ClosedRound] = (),
        fragments: int = 1,
        max_staleness: int = 1,
    ) -> None:
        """``closed``: rounds closed before (the last ``fragments x max_staleness`` are kept);
        ``fragments``: P, so that round r's late update folds into round r + kP."""
        self.strategy, self.fragments, self.max_staleness = strategy, fragments, max_staleness
        self.closed: dict[int, ClosedRound] = {}
        for c in closed:
            self._keep(c)

    @classmethod
    def from_meta(
        cls,
        meta: dict,
        strategy: Strategy,
        last: ClosedRound | None,
        fragments: int = 1,
        max_staleness: int = 1,
    ) -> FederatedData:
        """As a checkpoint left it: its ``closed_round`` (``last``) and the ones before it that
        a late update may still fold from (``meta``)."""
        earlier = [closed_round_of(c) for c in meta.get("federated_closed", [])]
        return cls(strategy, [*earlier, *([last] if last else [])], fragments, max_staleness)

    def _keep(self, closed: ClosedRound) -> None:
        self.closed[closed.number] = closed
        window = self.fragments * self.max_staleness
        for number in [n for n in self.closed if n <= closed.number - window]:
            del self.closed[number]

    def fold_of(self, open_round: int, round_number: int) -> tuple[int, int] | None:
        """(the round a late update of ``round_number`` folds into, its staleness k) while
        round ``open_round`` is open: the first of r + P, ... r + KP not closed yet; None when
        every one of them closed."""
        for k in range(1, self.max_staleness + 1):
            fold = round_number + k * self.fragments
            if fold >= open_round:
                return fold, k
        return None

    # ---- the round ------------------------------------------------------------------------

    def round_opened(self, round: RoundState, post) -> None:
        """Nothing to hand out: every participant trains on its own data."""

    def slots(self, round: RoundState) -> list[str]:
        """Fold order: the participants by name."""
        return sorted(round.participants)

    def slot_of(self, key: UpdateKey) -> str | None:
        return None if key.late_from is not None else key.site

    def task_for(self, round: RoundState, site: str) -> tuple[bool, str]:
        return site in round.participants and not round.closed, ""

    def close_view(self, round: RoundState, responsive: set[str]) -> tuple[RoundState, set[str]]:
        return round, responsive

    def waiting_reason(
        self, now, round: RoundState, live: set[str], opts: RoundOptions, grace=None
    ):
        return waiting_reason(now, round, live, opts, grace)

    def speculate(self, now, round, members, post) -> bool:
        return False  # data stays at its site: no backup copies

    def take_cancels(self, site: str) -> list[str]:
        return []

    def has_cancels(self, site: str) -> bool:
        return False

    def round_closed(self, closed: ClosedRound, post) -> list[str]:
        self._keep(closed)
        return []

    # ---- updates --------------------------------------------------------------------------

    def admit(
        self,
        round: RoundState,
        site: str,
        round_number: int,
        unit: str,
        counted: Collection[UpdateKey],
    ) -> Admission:
        """The site's own update for the open round, or a late one folded into it."""
        try:
            admit_update(round, site, round_number)
            return Admission(UpdateKey(site), round_number, round.number)
        except UpdateRefused as exc:
            fold = self.fold_of(round.number, round_number) if exc.code == "late" else None
            factor = self.fold_weight(site, round_number, fold[1]) if fold else 0.0
            if factor <= 0:
                raise Refused(exc.code, str(exc)) from exc
            if round.number < fold[0]:
                raise Refused(
                    "later",
                    f"round {round_number} closed without this update; it folds into round "
                    f"{fold[0]}, the next round of its fragment: send it once that round is open",
                    fold_round=fold[0],
                ) from exc
        key = UpdateKey(site, late_from=round_number)
        if key in counted:
            raise Refused(
                "duplicate", f"the late update of {site!r} for round {round_number} is counted"
            )
        return Admission(key, round.number, round_number, factor, fold[1])

    def recheck(
        self, round: RoundState, admission: Admission, counted: Collection[UpdateKey]
    ) -> Admission:
        """At the end of an upload: may it still count (the round may have moved on)."""
        key = admission.key
        if key.late_from is None:
            try:
                admit_update(round, key.site, admission.storage_round)
            except UpdateRefused as exc:
                raise Refused(exc.code, str(exc)) from exc
            return admission
        again = self.admit(round, key.site, key.late_from, "", counted)
        if again.key.late_from is None:
            raise Refused("invalid", f"round {key.late_from} is open again")
        return again

    def fold_weight(self, site: str, round_number: int, staleness: int = 1) -> float:
        """The strategy's discount for ``site``'s late update of ``round_number`` folded
        ``staleness`` versions of its fragment behind (0: drop it): only for a participant of
        that round, which closed without it."""
        closed = self.closed.get(round_number)
        if closed is None or site not in closed.participants or site in closed.sites:
            return 0.0
        return checked_staleness_weight(self.strategy, site, staleness)

    def record(self, round: RoundState, key: UpdateKey, weight: float, now: float, post):
        """The open round with ``key`` counted (a late update is not one of its own)."""
        if key.late_from is not None:
            return round
        return record_update(round, key.site, weight, now)

    def replay(self, round: RoundState, key: UpdateKey, weight: float) -> RoundState:
        """Count a spooled update of the round in flight again after a restart."""
        if key.late_from is not None:
            return round
        return record_update(round, key.site, weight)

    def readmit(self, round: RoundState, key: UpdateKey) -> None:
        """A spooled update was lost at a restart: nothing to undo, its site is a participant
        that has not delivered (``admit`` takes its update again)."""

    # ---- persistence ----------------------------------------------------------------------

    def meta(self) -> dict:
        """The closed rounds before the newest that a late update may still fold from (the
        newest is the checkpoint's own ``closed_round``)."""
        newest = max(self.closed, default=None)
        return {
            "federated_closed": [
                closed_round_json(c) for n, c in sorted(self.closed.items()) if n != newest
            ]
        }
