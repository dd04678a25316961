"""The failure-handling sections of the job config: ``[timeouts]``, ``[data]``, ``[speculation]``.

The timeouts form one hierarchy, checked at start-up with an error naming the four values:
heartbeat interval < suspicion (the silence after which the phi-accrual detector suspects a site
that heartbeats steadily) < lease TTL < round deadline.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.config_table import ConfigError, Table, non_negative, positive
from coordinator.failure_detector import DetectorOptions, suspicion_after_s
from coordinator.speculation import SpeculationOptions


@dataclass(frozen=True)
class TimeoutsConfig:
    """The timeout hierarchy: heartbeat interval < suspicion < lease TTL < round deadline.

    Suspicion comes from a phi-accrual detector over each site's heartbeat history
    (``coordinator.failure_detector``); by default a site that heartbeats steadily is suspected
    about halfway through its lease, sooner than its lease expires, later on a jittery link.
    """

    heartbeat_interval_s: float = 5.0
    lease_ttl_s: float = 30.0
    suspicion_phi: float = 8.0
    # Silence tolerated on top of the usual interval; None: lease_ttl_s / 2 - heartbeat.
    suspicion_pause_s: float | None = None
    # After the last round, how long the final theta is served to sites of that round that
    # have not fetched it yet (one cut off by the WAN comes back for it).
    final_fetch_s: float = 600.0

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


DATA_MODES = ("federated", "shared")


@dataclass(frozen=True)
class DataConfig:
    """``federated``: each site trains on its own data; a late update is dropped or folded
    into the next round as the strategy says. ``shared`` (pretraining): the coordinator hands
    out data units each round, backs up stragglers' units and commits each unit once."""

    mode: str = "federated"


def parse_data(d: Table) -> DataConfig:
    mode = d.get(
        "mode",
        str,
        "federated",
        check=lambda v: None if v in DATA_MODES else f"must be one of {DATA_MODES}",
    )
    d.reject_unknown()
    return DataConfig(mode)


def parse_timeouts(t: Table, deadline_s: float) -> TimeoutsConfig:
    timeouts = TimeoutsConfig(
        heartbeat_interval_s=t.get("heartbeat_interval_s", float, 5.0, check=positive),
        lease_ttl_s=t.get("lease_ttl_s", float, 30.0, check=positive),
        suspicion_phi=t.get(
            "suspicion_phi",
            float,
            8.0,
            check=lambda v: None if 0 < v < 100 else "must be in (0, 100)",
        ),
        suspicion_pause_s=t.get("suspicion_pause_s", float, None, check=non_negative),
        final_fetch_s=t.get("final_fetch_s", float, 600.0, check=positive),
    )
    t.reject_unknown()
    suspicion = timeouts.suspicion_after_s()
    if not timeouts.heartbeat_interval_s < suspicion < timeouts.lease_ttl_s < deadline_s:
        raise ConfigError(
            "timeouts: need heartbeat_interval_s < suspicion < lease_ttl_s < rounds.deadline_s, "
            f"got timeouts.heartbeat_interval_s={timeouts.heartbeat_interval_s}, suspicion after "
            f"{suspicion:.2f}s of silence (from timeouts.suspicion_phi={timeouts.suspicion_phi} "
            f"and suspicion_pause_s), timeouts.lease_ttl_s={timeouts.lease_ttl_s}, "
            f"rounds.deadline_s={deadline_s}"
        )
    return timeouts


def parse_speculation(sp: Table, data: DataConfig) -> SpeculationOptions:
    if sp.data and data.mode != "shared":
        raise ConfigError(
            f"speculation: backup copies need data.mode = 'shared' (data.mode is {data.mode!r})"
        )
    defaults = SpeculationOptions()
    try:
        opts = SpeculationOptions(
            enabled=sp.get("enabled", bool, defaults.enabled),
            slow_factor=sp.get("slow_factor", float, defaults.slow_factor),
            min_wait_s=sp.get("min_wait_s", float, defaults.min_wait_s),
            behind_fraction=sp.get("behind_fraction", float, defaults.behind_fraction),
            max_backups_per_unit=sp.get("max_backups_per_unit", int, 1),
        )
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from None
    sp.reject_unknown()
    return opts
