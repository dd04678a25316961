"""The round clock: expiring leases, opening and closing rounds, the outer step.

A mixin of ``CoordinatorCore``. The decisions are the pure functions of ``rounds``; this does
what they decide: the strategy's outer step through ``strategies.robust.close_round``, the
checkpoint, and publishing theta_{r+1}.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from coordinator.records import FatalError, SiteRecord
from coordinator.rounds import (
    RoundState,
    admit_latecomers,
    decide_close,
    next_round,
    open_round,
    waiting_reason,
)
from coordinator.spool import SpooledUpdate
from coordinator.store import Checkpoint
from strategies import StrategyError
from strategies.base import call_hook, check_state
from strategies.robust import Outcome, close_round
from wire.tensors import state_hash

log = logging.getLogger("isthmus.coordinator")


class RoundClock:
    def tick(self) -> bool:
        """Advance membership and the round; returns True if a round was closed."""
        with self.lock:
            if self.fatal:
                raise FatalError(self.fatal)
            if self.finished:
                return False
            now = self.clock()
            for site in self.leases.expire(now):
                self.sites.setdefault(site, SiteRecord()).state = "expired"
                self.detector.forget(site)
                self.events.append("lease_expired", site=site)
                log.warning("lease of site %s expired", site)
            live = self.leases.live(now)
            self._note_suspicion(now, live)
            # A suspected site still joins the round that opens (it may be back in a moment),
            # but the round does not wait for it (``responsive`` below).
            was_open = self.round.opened_at is not None
            self.round = open_round(now, self.round, live, self.opts)
            if not was_open and self.round.opened_at is not None:
                self._save_round(now)
                if self.shared:
                    self._assign_units()
                self.events.append(
                    "round_open", round=self.round.number, sites=sorted(self.round.participants)
                )
                try:
                    call_hook(self.strategy, "begin_round", self.round.number, self.theta)
                except StrategyError as exc:
                    self.fatal = f"round {self.round.number} cannot start: {exc}"
                    log.error("stopping: %s; the last checkpoint is unchanged", self.fatal)
                    raise FatalError(self.fatal) from exc
                log.info(
                    "round %d open with %s",
                    self.round.number,
                    ", ".join(sorted(self.round.participants)),
                )
            before = self.round.participants
            if not self.shared:  # shared-data mode gives idle sites backup copies instead
                self.round = admit_latecomers(now, self.round, live, self.opts)
            if self.round.participants != before:
                self._save_round(now)
                log.warning(
                    "round %d is past its deadline below quorum; admitting %s",
                    self.round.number,
                    ", ".join(sorted(self.round.participants - before)),
                )
            responsive = live - self.suspected
            if self.shared and self.round.opened_at is not None:
                self._speculate(now, responsive, self.suspected)
                decision = decide_close(now, *self._unit_view(responsive), self.opts)
            else:
                decision = decide_close(now, self.round, responsive, self.opts)
            if not decision.act:
                return False
            self.round = replace(self.round, closed=True)
            updates = [self.accepted[s] for s in sorted(self.accepted)]
            updates += [self.late[s] for s in sorted(self.late)]
            closing = self.round
        self._close(closing, updates, decision.reason)
        return True

    def _note_suspicion(self, now: float, live: set[str]) -> None:
        quiet_for = self.suspicion_s
        suspected = {
            s
            for s in self.detector.suspected(now) & live
            if (self.sites.get(s) or SiteRecord()).last_data_at is None
            or now - self.sites[s].last_data_at > quiet_for
        }
        for site in sorted(suspected - self.suspected):
            phi = self.detector.phi(site, now)
            self.events.append("suspected", site=site, phi=round(phi, 2))
            log.warning("site %s suspected (phi %.1f): not waiting for it", site, phi)
        for site in sorted(self.suspected - suspected):
            if site in live:
                log.info("site %s is heartbeating again", site)
        self.suspected = suspected

    def _save_round(self, now: float) -> None:
        """Who is in the open round and since when (wall clock: monotonic time does not
        survive a restart), so a restarted coordinator keeps the round's deadline."""
        opened_wall = time.time() - (now - self.round.opened_at)
        self.spool.write_round(
            self.round.number,
            {"participants": sorted(self.round.participants), "opened_wall": opened_wall},
        )

    def _close(self, state: RoundState, updates: list[SpooledUpdate], reason: str) -> None:
        started = time.monotonic()
        with self.lock:
            metrics = self._round_metrics(state.number, [u.site for u in updates])
        try:
            new_theta, outcome = close_round(
                self.strategy,
                self.aggregator,
                self.theta,
                [u.as_site_update() for u in updates],
                state.number,
                metrics,
            )
            if outcome.aggregate is None:
                log.warning(
                    "round %d: every update was rejected; theta and the strategy state stay",
                    state.number,
                )
            # Read only after a successful step, so a failed one never reaches the checkpoint.
            strategy_state = check_state(self.strategy, call_hook(self.strategy, "state_dict"))
            if self.downlink is not None:
                # theta_{r+1} becomes exactly what the sites will rebuild from the delta.
                new_theta = self.downlink.step(self.theta, new_theta, state.number)
        except Exception as exc:
            with self.lock:
                self.fatal = (
                    f"outer step of round {state.number} failed: {exc}; the checkpoint of "
                    f"round {state.number} is unchanged"
                )
            log.exception("outer step failed; the last checkpoint is unchanged")
            raise FatalError(self.fatal) from exc
        self._note_rejections(state.number, outcome)
        with self.lock:
            carried = self._close_units(state.number) if self.shared else []
        sites = sorted({u.site.partition("@")[0] for u in updates})
        ckpt = Checkpoint(
            state.number + 1,
            new_theta,
            strategy_state,
            {
                "job": self.cfg.name,
                "closed_round": {
                    "number": state.number,
                    "reason": reason,
                    "sites": sorted(u.site for u in updates),
                    "participants": sorted(state.participants),
                    "rejected": outcome.rejected,
                    "clipped": outcome.clipped,
                    "carried_units": carried,
                },
                **({"ledger": self.ledger.to_dict()} if self.shared else {}),
            },
            self.downlink.state_dict() if self.downlink is not None else {},
        )
        self.store.save(ckpt)
        self.events.append(
            "round_closed",
            round=state.number,
            reason=reason,
            updates=[u.site for u in updates],
            theta_sha256=state_hash(new_theta).hex(),
        )
        with self.lock:
            self.theta = new_theta
            self.round = next_round(state)
            self.accepted = {}
            self.late = {}
            self.last_closed = {
                "number": state.number,
                "participants": set(state.participants),
                "sites": set(sites),
            }
            self.last_close_reason = reason
            self._publish()
            self.wake.notify_all()
        self.uploads.drop_rounds_before(state.number + 1)
        self.spool.drop_rounds_before(state.number + 1)
        log.info(
            "round %d closed (%s): %d update(s), outer step + checkpoint in %.2fs; theta_%d %s",
            state.number,
            reason,
            len(updates),
            time.monotonic() - started,
            state.number + 1,
            self.published.theta_hash.hex()[:12],
        )

    def _round_metrics(self, round_number: int, sites: list[str]) -> dict[str, dict[str, float]]:
        """What each site last reported for this round (protobuf sends 0 for "no loss")."""
        out = {}
        for site in sites:
            p = (self.sites.get(site) or SiteRecord()).progress or {}
            if p.get("round") == round_number and p.get("train_loss"):
                out[site] = {"train_loss": float(p["train_loss"])}
        return out

    def _note_rejections(self, round_number: int, outcome: Outcome) -> None:
        for site, norm in outcome.clipped.items():
            log.info("round %d: update of %s clipped (norm %.4g)", round_number, site, norm)
        with self.lock:
            for site, reason in outcome.rejected.items():
                log.warning("round %d: update of %s rejected: %s", round_number, site, reason)
                self.rejections.append(f"round {round_number}: {site}: {reason}")

    def waiting_reason(self) -> str:
        with self.lock:
            if self.fatal:
                return self.fatal
            if self.finished:
                return f"job finished after {self.cfg.rounds.total} rounds"
            now = self.clock()
            live = self.leases.live(now) - self.suspected
            if self.shared and self.round.opened_at is not None:
                return self._units_waiting_reason(now, live)
            return waiting_reason(now, self.round, live, self.opts)
