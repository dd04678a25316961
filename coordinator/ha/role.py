"""A coordinator's part in the election (``coordinator serve --ha``): stand by, take over, fence.

``HaRole`` joins the election (``coordinator.ha.etcd_election``), owns the gRPC front that refuses
calls while this coordinator does not lead (``coordinator.ha.standby``), and hands the core a
``Term`` once elected:

* ``Term.revision``: the leader key's creation revision, which ``CoordinatorCore`` passes to
  ``store.next_epoch``: the store counts the start (one more than the last, so every lease
  token of an earlier leader is stale) only if no start elected later was counted
  (``coordinator.persist.s3_epochs``);
* ``Term.fence``: raises ``StoreError`` once this coordinator may no longer act as the leader;
  the object store calls it before committing a manifest (``S3CheckpointStore.fence``), and
  the core before it takes or counts an update.

What ``serve`` does with the answer (take over, step down) follows ``election.transition``.
"""

from __future__ import annotations

import logging
import threading

from coordinator.ha.election import Leadership, Term, standby_message
from coordinator.ha.etcd_election import EtcdElection
from coordinator.ha.options import HaOptions
from coordinator.ha.standby import LeaderSwitch
from coordinator.persist.local_store import StoreError
from coordinator.service.auth import Authorizer

__all__ = ["Deposed", "HaRole", "Term"]
log = logging.getLogger("isthmus.coordinator")


class Deposed(StoreError):
    """This coordinator is no longer the leader; the message says who is, if known."""


class HaRole:
    """This coordinator as one candidate of the election of ``opts.key``."""

    def __init__(self, opts: HaOptions, authorizer: Authorizer) -> None:
        self.opts = opts
        self.election = EtcdElection(opts)
        self.switch = LeaderSwitch(self.election.leadership, authorizer)
        self.term: Term | None = None

    def start(self) -> None:
        self.election.start()
        log.info(
            "standing by for job key %s on etcd %s as %s",
            self.opts.key,
            ",".join(f"{h}:{p}" for h, p in self.opts.endpoints),
            self.opts.advertise,
        )

    def wait_elected(self, stop: threading.Event) -> Term | None:
        """Stand by until elected (a ``Term``), or None once ``stop`` is set."""
        said = ""
        while not stop.is_set():
            now = self.election.leadership()
            if now.leading:
                log.info("elected leader (etcd revision %d); taking over", now.epoch)
                self.term = Term(now.epoch, self.fence)
                return self.term
            if now.reason != said:
                log.info("standing by: %s", standby_message(now))
                said = now.reason
            self.election.wait(0.5)
        return None

    def lost(self) -> Leadership | None:
        """The leadership as it is now, if this coordinator was elected and no longer leads
        (or leads under another revision: the key was lost and won again meanwhile)."""
        now = self.election.leadership()
        if self.term is None or (now.leading and now.epoch == self.term.revision):
            return None
        return now

    def fence(self) -> None:
        """``Deposed`` unless this coordinator still leads in the term it was elected for."""
        now = self.lost()
        if now is not None:
            self.switch.stand_by()
            raise Deposed(f"this coordinator is no longer the leader: {standby_message(now)}")

    def step_down(self) -> None:
        """Refuse every call from now on (the server is about to stop)."""
        self.switch.stand_by()

    def close(self) -> None:
        """Leave the election; a leader resigns, so a standby takes over at once."""
        self.switch.stand_by()
        self.election.close(resign=self.term is not None)
