"""``coordinator serve --ha etcd://HOST:PORT[,HOST:PORT...][/PREFIX]``: the standby settings.

With ``--ha`` the same job runs on two or more hosts, each with its own local state folder and
all with the same ``[storage] url = "s3://..."``. They elect one leader through etcd
(``coordinator.ha.election``, ``coordinator.ha.etcd_election``); the others stand by. Everything
here is pure: the URL and the flags become one ``HaOptions``, or a ``ConfigError`` in one line.

The leader key is ``PREFIX/JOB/leader`` (``PREFIX`` defaults to ``isthmus``), so several jobs
may share one etcd cluster.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass

from wire.config_table import ConfigError

USAGE = "expected etcd://HOST:PORT[,HOST:PORT...][/PREFIX]"
DEFAULT_PREFIX = "isthmus"
_HOST = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9]([A-Za-z0-9.\-]{0,251}[A-Za-z0-9])?)$")
_PREFIX = re.compile(r"^[A-Za-z0-9._\-]+(/[A-Za-z0-9._\-]+)*$")
MIN_TTL_S = 2  # etcd counts lease TTLs in whole seconds; a leader keeps its lease alive at TTL/3


@dataclass(frozen=True)
class HaOptions:
    """Where etcd is, which key elects this job's leader, and how this candidate is named.

    Attributes
    ----------
    endpoints
        etcd client endpoints ``(host, port)``; tried in turn when one does not answer.
    key
        The leader key (``PREFIX/JOB/leader``).
    advertise
        The HOST:PORT sites and operators dial to reach this coordinator: the value it writes
        into the key when elected, named by standbys in their refusals.
    ttl_s
        The etcd lease's TTL: a leader that stops renewing it is replaced after about this long.
    margin_s
        A leader stops acting this long before its lease could have lapsed in etcd (its last
        renewal plus the TTL, by its own clock): room for clock drift and for a manifest write
        already on its way.
    """

    endpoints: tuple[tuple[str, int], ...]
    key: str
    advertise: str
    ttl_s: int = 10
    margin_s: float = 1.0

    @property
    def keepalive_s(self) -> float:
        return self.ttl_s / 3


def parse_ha_url(url: str) -> tuple[tuple[tuple[str, int], ...], str]:
    """``etcd://a:2379,b:2379/jobs`` -> ``((("a", 2379), ("b", 2379)), "jobs")``.

    Raises
    ------
    ConfigError
        The URL is not of that form (the message says which part is wrong).
    """
    if not url.startswith("etcd://"):
        raise ConfigError(f"--ha {url!r}: {USAGE}")
    hosts, _, prefix = url[len("etcd://") :].partition("/")
    prefix = prefix.strip("/") or DEFAULT_PREFIX
    if not _PREFIX.match(prefix) or any(p in (".", "..") for p in prefix.split("/")):
        raise ConfigError(f"--ha {url!r}: bad key prefix {prefix!r} ({USAGE})")
    endpoints = []
    for part in hosts.split(","):
        host, sep, port = part.rpartition(":")
        if not sep or not _HOST.match(host) or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--ha {url!r}: bad endpoint {part!r} ({USAGE})")
        endpoints.append((host.strip("[]"), int(port)))
    return tuple(endpoints), prefix


def advertised(listen: str, bound: str, advertise: str | None) -> str:
    """The address to name this coordinator by: ``--advertise``, else the listen address
    with the port it got (``bound``: HOST:PORT; a wildcard host becomes this machine's name)."""
    if advertise:
        return advertise
    host = listen.rpartition(":")[0]
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = socket.getfqdn()
    return f"{host}:{bound.rpartition(':')[2]}"


def ha_options(url: str, job: str, advertise: str, ttl_s: int) -> HaOptions:
    """The options of ``--ha URL`` for job ``job``; ``ConfigError`` if any is unusable."""
    endpoints, prefix = parse_ha_url(url)
    if ttl_s < MIN_TTL_S:
        raise ConfigError(f"--ha-ttl must be >= {MIN_TTL_S} seconds, got {ttl_s}")
    margin = min(1.0, ttl_s / 4)
    return HaOptions(endpoints, f"{prefix}/{job}/leader", advertise, ttl_s, margin)
