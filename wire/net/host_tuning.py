"""What this host's TCP settings do to a long link, said once at start.

Two of Linux's settings decide how much of a long fat link a transfer gets (measured with
``python -m bench.streams``; README, "WAN host tuning"):

- ``net.ipv4.tcp_slow_start_after_idle`` (1 by default): a connection idle for longer than a
  round trip starts again from TCP's initial window, so every round's transfer pays slow start
  even on a connection kept open. It matters on whichever end sends: the coordinator for
  fetches, a site for its pushes when it keeps its connections (``[transfer]
  keep_connections``; without that each upload opens connections of its own).
- ``net.ipv4.tcp_wmem``'s largest value: a sender's window, so one stream carries at most
  about that many bytes per round trip (4 MiB by default: 336 Mbit/s at a 100 ms round trip).
  Past that, ``[transfer] streams`` or a larger buffer fills the link.

``read_tcp_host`` reads them (None for what a host does not expose); ``tcp_advice`` is pure;
``log_tcp_advice`` is what ``coordinator serve`` and ``siteclient start`` call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from wire.net.metrics_http import is_loopback

PROC_IPV4 = Path("/proc/sys/net/ipv4")
REFERENCE_RTT_S = 0.1  # the round trip the one-stream ceiling is given at


@dataclass(frozen=True)
class Advice:
    """One sentence for the operator; ``warn``: it costs throughput as the host stands."""

    text: str
    warn: bool


@dataclass(frozen=True)
class TcpHost:
    """The host's TCP settings that shape a long transfer (None: not readable here)."""

    slow_start_after_idle: int | None
    send_buffer_max: int | None  # bytes: net.ipv4.tcp_wmem's third value
    congestion: str | None


def read_tcp_host(folder: Path = PROC_IPV4) -> TcpHost:
    """This host's settings, from ``/proc/sys/net/ipv4`` (of the caller's network namespace)."""

    def read(name: str) -> str | None:
        try:
            return (folder / name).read_text().strip()
        except OSError:
            return None

    idle, wmem = read("tcp_slow_start_after_idle"), read("tcp_wmem")
    fields = wmem.split() if wmem else []
    return TcpHost(
        slow_start_after_idle=int(idle) if idle and idle.isdigit() else None,
        send_buffer_max=int(fields[2]) if len(fields) == 3 and fields[2].isdigit() else None,
        congestion=read("tcp_congestion_control"),
    )


def one_stream_mbit(host: TcpHost, rtt_s: float = REFERENCE_RTT_S) -> float | None:
    """The most one stream sent from this host carries at ``rtt_s``: its largest window per
    round trip, in Mbit/s."""
    if host.send_buffer_max is None:
        return None
    return host.send_buffer_max * 8 / rtt_s / 1e6


def tcp_advice(host: TcpHost, sends_on_kept_connections: bool) -> list[Advice]:
    """What a WAN operator should know about ``host`` (empty: nothing).

    ``sends_on_kept_connections``: whether this process sends its large transfers on
    connections that stay open between rounds (the coordinator always; a site with
    ``keep_connections``)."""
    advice = []
    if host.slow_start_after_idle == 1 and sends_on_kept_connections:
        advice.append(
            Advice(
                "net.ipv4.tcp_slow_start_after_idle is 1: every round's transfer starts TCP's "
                "slow start again after the idle between rounds, which costs several round trips "
                "per transfer on a long link; on WAN hosts set it to 0 "
                "(sysctl -w net.ipv4.tcp_slow_start_after_idle=0)",
                warn=True,
            )
        )
    ceiling = one_stream_mbit(host)
    if ceiling is not None and ceiling < 1000:
        advice.append(
            Advice(
                f"net.ipv4.tcp_wmem allows a send window of "
                f"{host.send_buffer_max / 2**20:.1f} MiB: "
                f"one stream carries at most about {ceiling:.0f} Mbit/s at a "
                f"{REFERENCE_RTT_S * 1000:.0f} ms round trip; for a faster or longer link raise "
                "its third value or use [transfer] streams > 1",
                warn=False,
            )
        )
    return advice


def over_loopback(address: str) -> bool:
    """Whether ``host:port`` (or ``[v6]:port``) names this machine: no WAN to advise on."""
    return is_loopback(address.rsplit(":", 1)[0].strip("[]"))


def log_tcp_advice(log: logging.Logger, address: str, sends_on_kept_connections: bool) -> None:
    """Log this host's ``tcp_advice`` for traffic to or from ``address`` (nothing over
    loopback): a warning where it costs throughput, else info."""
    if over_loopback(address):
        return
    for a in tcp_advice(read_tcp_host(), sends_on_kept_connections):
        log.log(logging.WARNING if a.warn else logging.INFO, "host TCP: %s", a.text)
