"""Who leads: the election's decisions as pure functions of (clock, view, options).

Each candidate holds an etcd lease of its own, renewed every TTL/3 (``coordinator.ha.etcd_election``
does the I/O). The leader is whoever created the leader key, attached to its lease, by a
transaction that succeeds only while the key does not exist (``create_revision == 0``); the key
names the leader's advertised address. When the leader's lease lapses, etcd deletes the key and
the next transaction elects another candidate.

A leader must stop acting *before* etcd can elect another one. Its lease lives in etcd at least
until its last successful renewal was *sent* plus the TTL, so ``renewed_until`` is reckoned from
the send time, and the leader stops ``margin_s`` earlier still (clock drift, a manifest write on
its way). Past that point it is no longer the leader, whatever the key says: it cannot know
whether the renewal it is waiting for will ever land.

A leader's term is the etcd revision at which it created the key: every later election creates
the key again, at a higher revision, and the store refuses to count the start of a candidate
elected at a revision no higher than one it counted (``coordinator.persist.s3_epochs``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from coordinator.ha.options import HaOptions


@dataclass(frozen=True)
class KeyHolder:
    """The leader key as last read: the address it names, its lease, its creation revision."""

    address: str
    lease: int
    revision: int


@dataclass(frozen=True)
class ElectionView:
    """What one candidate knows of the election.

    Attributes
    ----------
    lease
        This candidate's etcd lease ID; None while it holds none (not granted yet, or lapsed).
    renewed_until
        Local clock time until which that lease surely lives in etcd.
    holder
        The leader key as last seen; None when it did not exist.
    error
        The last etcd failure, "" when the last call succeeded.
    """

    lease: int | None = None
    renewed_until: float = float("-inf")
    holder: KeyHolder | None = None
    error: str = ""


@dataclass(frozen=True)
class Leadership:
    """What a candidate is now: the leader (with its epoch) or a standby naming the leader."""

    leading: bool
    leader: str | None  # the address to name; None: no leader known
    epoch: int = 0  # the leader key's creation revision, while leading
    reason: str = ""


@dataclass(frozen=True)
class Term:
    """One leadership: the election revision it began at, and the check that it still holds
    (``fence`` raises ``StoreError`` once it does not; see ``coordinator.ha.role``)."""

    revision: int
    fence: Callable[[], None]


def _mine(view: ElectionView) -> bool:
    return view.lease is not None and view.holder is not None and view.holder.lease == view.lease


def leadership_compute(now: float, view: ElectionView, opts: HaOptions) -> Leadership:
    """Whether this candidate leads at ``now``, and otherwise whom it names as the leader."""
    if _mine(view):
        left = view.renewed_until - opts.margin_s - now
        if left > 0:
            return Leadership(True, opts.advertise, view.holder.revision, "holds the leader key")
        why = view.error or "no renewal answered"
        return Leadership(
            False,
            None,
            reason=f"its etcd lease may have lapsed ({-left:.1f}s past its margin; {why})",
        )
    if view.holder is not None:
        return Leadership(False, view.holder.address, reason=f"{view.holder.address} leads")
    why = f" ({view.error})" if view.error else ""
    return Leadership(False, None, reason=f"no leader elected{why}")


def should_campaign(now: float, view: ElectionView, opts: HaOptions) -> bool:
    """Try the election transaction: nobody holds the key and this lease is alive."""
    return view.holder is None and view.lease is not None and view.renewed_until - now > 0


def transition(was_leading: bool, now: Leadership) -> str:
    """``"take_over"``, ``"step_down"`` or ``"stay"``: what the coordinator does about it."""
    if now.leading and not was_leading:
        return "take_over"
    if was_leading and not now.leading:
        return "step_down"
    return "stay"


def standby_message(now: Leadership) -> str:
    """The words of a standby's refusal (``UNAVAILABLE``): whom to call instead."""
    if now.leader:
        return f"standby; the leader is {now.leader}"
    return f"standby; {now.reason or 'no leader elected'}; retry"
