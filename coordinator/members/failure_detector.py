"""Suspecting sites from their heartbeat history: a phi-accrual failure detector.

Instead of a yes/no timeout, the detector reports ``phi``, the suspicion that a site has failed
given how long it has been silent and how regularly it has heartbeated so far (Hayashibara et
al., "The phi accrual failure detector", 2004; the variant here is Akka's and Cassandra's).
``phi = -log10(P(a heartbeat arrives later than now))`` under a normal model of the intervals
between heartbeats, so phi = 1 means a 10% chance that the site is merely slow, phi = 8 one in
10^8. A site whose phi reaches ``threshold`` is suspected; its lease still decides when it is
dropped (see ``coordinator.members.leases``).

Pure: every method takes ``now``; nothing here reads a clock or does I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from wire.config_table import ConfigError, non_negative, positive, rule, setting

# Past this phi the site is as good as gone; capping keeps status output and arithmetic on
# phi finite however long a site stays silent.
MAX_PHI = 1e3
# |y| beyond this already puts phi above MAX_PHI (or at 0); clamping first keeps y**3 finite.
_Y_LIMIT = 50.0


@dataclass(frozen=True)
class DetectorOptions:
    """How quickly silence turns into suspicion.

    Parameters
    ----------
    threshold
        Phi at which a site is suspected.
    window
        Heartbeat intervals remembered per site.
    min_std_s
        Floor on the standard deviation of the intervals; without it very regular heartbeats
        make phi jump from 0 to huge on the smallest delay.
    acceptable_pause_s
        Added to the mean interval: pauses (GC, a congested link) that should not raise phi.
    first_interval_s
        Prior for a site with no intervals yet: its history is seeded as if the site had
        heartbeated with this mean and a standard deviation of a quarter of it.
    """

    threshold: float = 8.0
    window: int = 100
    min_std_s: float = 0.5
    acceptable_pause_s: float = 0.0
    first_interval_s: float = 5.0

    def __post_init__(self) -> None:
        _check("threshold", self.threshold, lo=0.0, lo_open=True)
        if self.threshold >= MAX_PHI:
            raise ValueError(f"threshold: must be < {MAX_PHI:g}, got {self.threshold!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window: must be an integer >= 1, got {self.window!r}")
        _check("min_std_s", self.min_std_s, lo=0.0, lo_open=True)
        _check("acceptable_pause_s", self.acceptable_pause_s, lo=0.0, lo_open=False)
        _check("first_interval_s", self.first_interval_s, lo=0.0, lo_open=True)


def _check(name: str, value: object, *, lo: float, lo_open: bool) -> None:
    ok = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value > lo if lo_open else value >= lo)
    )
    if not ok:
        bound = f"> {lo:g}" if lo_open else f">= {lo:g}"
        raise ValueError(f"{name}: must be a finite number {bound}, got {value!r}")


def _phi(elapsed: float, mean: float, std: float) -> float:
    """Phi after ``elapsed`` seconds of silence, for intervals ~ Normal(mean, std).

    Akka's logistic approximation of the normal tail, ``P(X > t) ~ e / (1 + e)`` with
    ``e = exp(-z)``, ``z = y (1.5976 + 0.070566 y^2)``, gives ``phi = softplus(z) / ln 10``;
    the softplus is written so that neither branch overflows.
    """
    y = max(-_Y_LIMIT, min(_Y_LIMIT, (elapsed - mean) / std))
    z = y * (1.5976 + 0.070566 * y * y)
    softplus = z + math.log1p(math.exp(-z)) if z > 0 else math.log1p(math.exp(z))
    return min(MAX_PHI, softplus / math.log(10.0))


@dataclass
class _History:
    last: float
    intervals: deque[float]
    mean: float = 0.0
    std: float = 0.0

    def refresh(self) -> None:
        # Recomputed from the window on each heartbeat rather than kept as running sums: a
        # detector lives for the whole job, and running sums drift after millions of beats.
        self.mean = statistics.fmean(self.intervals)
        self.std = statistics.pstdev(self.intervals, self.mean)


class PhiAccrualDetector:
    """Heartbeat histories of the sites, and the suspicion each one's silence earns."""

    def __init__(self, opts: DetectorOptions) -> None:
        self.opts = opts
        self._sites: dict[str, _History] = {}

    def heartbeat(self, site: str, now: float) -> None:
        """Record a heartbeat from ``site`` arriving at ``now``.

        The first heartbeat of a site only starts its history. A heartbeat older than the last
        one recorded (reordered delivery) is ignored rather than counted as a negative interval.
        """
        h = self._sites.get(site)
        if h is None:
            # Akka's seed: two intervals at mean -/+ std give exactly that mean and std.
            first = self.opts.first_interval_s
            seed = deque((first * 0.75, first * 1.25), maxlen=self.opts.window)
            h = self._sites[site] = _History(last=now, intervals=seed)
            h.refresh()
            return
        if now < h.last:
            return
        h.intervals.append(now - h.last)
        h.last = now
        h.refresh()

    def forget(self, site: str) -> None:
        """Drop the history of ``site`` (it left or its lease expired); unknown sites are fine."""
        self._sites.pop(site, None)

    def phi(self, site: str, now: float) -> float:
        """Suspicion of ``site`` at ``now``: 0.0 if never heard from, at most ``MAX_PHI``."""
        h = self._sites.get(site)
        if h is None:
            return 0.0
        mean = h.mean + self.opts.acceptable_pause_s
        std = max(h.std, self.opts.min_std_s)
        return _phi(now - h.last, mean, std)

    def suspected(self, now: float) -> set[str]:
        """Sites whose phi has reached the threshold."""
        return {s for s in self._sites if self.phi(s, now) >= self.opts.threshold}

    def sites(self) -> list[str]:
        """Sites with a heartbeat history, sorted."""
        return sorted(self._sites)

    def state_for_status(self, now: float) -> dict[str, float]:
        """Site -> phi at ``now``, sorted by site, for ``coordinator status``."""
        return {s: self.phi(s, now) for s in self.sites()}


def suspicion_after_s(interval_s: float, opts: DetectorOptions) -> float:
    """Seconds of silence after which a steadily heartbeating site is suspected.

    A site that has heartbeated every ``interval_s`` for a whole window has intervals of mean
    ``interval_s`` and standard deviation 0 (so ``min_std_s``); this is the silence at which its
    phi reaches ``opts.threshold``. Start-up uses it to check the timeout hierarchy
    ``heartbeat interval < suspicion < lease TTL < round deadline``.

    Parameters
    ----------
    interval_s
        The heartbeat interval, > 0.
    opts
        The detector's options.

    Returns
    -------
    float
        The silence in seconds, to within 1e-9 relative.
    """
    _check("interval_s", interval_s, lo=0.0, lo_open=True)
    mean = interval_s + opts.acceptable_pause_s
    std = opts.min_std_s
    if _phi(0.0, mean, std) >= opts.threshold:
        return 0.0  # a threshold below phi at the very instant of a heartbeat
    lo, hi = 0.0, mean + std
    # threshold < MAX_PHI, and phi reaches MAX_PHI by y = _Y_LIMIT, so this stops.
    while _phi(hi, mean, std) < opts.threshold:
        lo, hi = hi, hi * 2.0
    # phi is increasing in the silence (dz/dy > 0), so bisection converges on the crossing.
    while hi - lo > max(1e-9 * hi, 1e-12):
        mid = (lo + hi) / 2.0
        if _phi(mid, mean, std) < opts.threshold:
            lo = mid
        else:
            hi = mid
    return hi


@dataclass(frozen=True)
class TimeoutsConfig:
    """The ``[timeouts]`` table: heartbeat interval < suspicion < lease TTL < round deadline.

    Suspicion comes from the phi-accrual detector above, over each site's heartbeat history; by
    default a site that heartbeats steadily is suspected about halfway through its lease,
    sooner than its lease expires, later on a jittery link.
    """

    heartbeat_interval_s: float = setting(
        5.0, check=positive, help="how often a site's agent heartbeats"
    )
    lease_ttl_s: float = setting(
        30.0, check=positive, help="a site's lease lapses this long after its last heartbeat"
    )
    suspicion_phi: float = setting(
        8.0,
        check=rule(lambda v: 0 < v < 100, "must be in (0, 100)"),
        help="the phi-accrual threshold: a site whose phi reaches it is suspected and no longer "
        "waited for",
    )
    suspicion_pause_s: float | None = setting(
        None,
        check=non_negative,
        help="silence tolerated on top of a site's usual heartbeat interval before phi rises. "
        "Unset: ``lease_ttl_s / 2 - heartbeat_interval_s`` (with the defaults, suspicion after "
        "about 21 s of silence)",
    )
    final_fetch_s: float = setting(
        600.0,
        check=positive,
        help="after the last round, how long the final theta is served to sites of that round "
        "that have not fetched it and left (one cut off by the WAN comes back for it)",
    )

    def detector_options(self) -> DetectorOptions:
        hb = self.heartbeat_interval_s
        pause = self.suspicion_pause_s
        if pause is None:
            pause = max(0.0, self.lease_ttl_s / 2 - hb)
        return DetectorOptions(
            threshold=self.suspicion_phi,
            min_std_s=hb / 4,
            acceptable_pause_s=pause,
            first_interval_s=hb,
        )

    def suspicion_after_s(self) -> float:
        """Silence after which a steadily heartbeating site is suspected."""
        return suspicion_after_s(self.heartbeat_interval_s, self.detector_options())

    def check_hierarchy(self, deadline_s: float) -> None:
        """Refuse timeouts out of order: suspecting a site between two of its heartbeats, only
        once its lease has expired, or holding a dead site's lease past the round's deadline
        each defeats the step that comes later."""
        suspicion = self.suspicion_after_s()
        if not self.heartbeat_interval_s < suspicion < self.lease_ttl_s < deadline_s:
            raise ConfigError(
                "timeouts: need heartbeat_interval_s < suspicion < lease_ttl_s < "
                f"rounds.deadline_s, got timeouts.heartbeat_interval_s={self.heartbeat_interval_s}"
                f", suspicion after {suspicion:.2f}s of silence (from timeouts.suspicion_phi="
                f"{self.suspicion_phi} and suspicion_pause_s), timeouts.lease_ttl_s="
                f"{self.lease_ttl_s}, rounds.deadline_s={deadline_s}"
            )
