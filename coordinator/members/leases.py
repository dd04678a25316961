"""Site membership as leases with fencing tokens.

A lease is granted on Join, renewed by the agent's heartbeats and runs out ``ttl_s`` after the
last renewal. Each grant gets a fencing token larger than every token granted before, including
before a coordinator restart (the token's high bits are the coordinator's start epoch), so a
message carrying an older token is refused: it comes from a process that has since been
replaced, or from before a crash.

Pure: every method takes ``now``; nothing here reads a clock or does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

EPOCH_SHIFT = 32


class LeaseError(Exception):
    """A message whose lease is unknown, stale or expired; the site must re-join."""


@dataclass(frozen=True)
class Lease:
    site: str
    token: int
    granted_at: float
    expires_at: float
    last_heartbeat: float

    def remaining(self, now: float) -> float:
        return self.expires_at - now


class LeaseTable:
    """Current lease of every site, keyed by site name."""

    def __init__(self, epoch: int, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._next_token = (epoch << EPOCH_SHIFT) + 1
        self._leases: dict[str, Lease] = {}

    def grant(self, site: str, now: float) -> Lease:
        """A new lease for ``site``, replacing (and so fencing out) any lease it held."""
        lease = Lease(site, self._next_token, now, now + self.ttl_s, now)
        self._next_token += 1
        self._leases[site] = lease
        return lease

    def check(self, site: str, token: int, now: float) -> Lease:
        """The live lease that ``token`` names, or ``LeaseError`` saying why not."""
        lease = self._leases.get(site)
        if lease is None:
            raise LeaseError(f"site {site!r} holds no lease; join first")
        if token != lease.token:
            raise LeaseError(
                f"stale lease token {token} for site {site!r} (current token {lease.token}); "
                "re-join"
            )
        if now >= lease.expires_at:
            raise LeaseError(
                f"lease of site {site!r} expired {now - lease.expires_at:.1f}s ago; re-join"
            )
        return lease

    def renew(self, site: str, token: int, now: float) -> Lease:
        lease = self.check(site, token, now)
        lease = replace(lease, expires_at=now + self.ttl_s, last_heartbeat=now)
        self._leases[site] = lease
        return lease

    def release(self, site: str, token: int, now: float) -> None:
        self.check(site, token, now)
        del self._leases[site]

    def expire(self, now: float) -> list[str]:
        """Drop leases that ran out; returns the sites dropped."""
        gone = [s for s, lease in self._leases.items() if now >= lease.expires_at]
        for site in gone:
            del self._leases[site]
        return gone

    def live(self, now: float) -> set[str]:
        return {s for s, lease in self._leases.items() if now < lease.expires_at}

    def get(self, site: str) -> Lease | None:
        return self._leases.get(site)

    def all(self) -> dict[str, Lease]:
        return dict(self._leases)
