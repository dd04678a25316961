"""The packet relay behind ``bench.wan_link``: two TUN devices, one bottleneck per direction.

Run by ``WanLink`` as its own process (``python -m bench.wan_relay``), so that the packet loop
has an interpreter and a core of its own. It opens two TUN devices, reports their names on
stdout, then moves every IP packet read from one to the other. Each direction is modelled as a
link of ``rate`` bit/s with one FIFO of ``queue_bytes`` in front of it, shared by every
connection, followed by ``delay`` seconds of propagation (see ``Bottleneck``). A packet that
finds the FIFO full is dropped (tail drop), which is what lets TCP's own congestion control
show. Commands come as JSON lines on stdin (``stats``, ``set``); end of stdin ends the relay,
and with it the TUN devices, so a parent that dies takes the link down with it.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import json
import os
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
PR_SET_PDEATHSIG = 1
READ_BATCH = 256  # packets read from one device before looking at the other and the clock
MAX_PACKET = 65536
EARLY_S = 20e-6  # a packet due this soon is written now: sleeping less costs more than it buys


def open_tun(name: str) -> int:
    """A non-persistent TUN device (no packet-info header): it vanishes with the last fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class Bottleneck:
    """One direction of the link: a FIFO drained at ``rate_bps``, then a fixed delay.

    The FIFO is kept virtually: ``finish`` is when the last admitted packet will have left the
    bottleneck, so the bytes still queued at time ``now`` are ``(finish - now) * rate``. Every
    packet leaves at ``finish + delay``, which never decreases, so one deque ordered by arrival
    is also ordered by departure.

    Parameters
    ----------
    delay_s
        One-way propagation delay.
    rate_bps
        Bottleneck rate in bit/s; ``None`` for no cap (and then no queue either).
    queue_bytes
        FIFO size in bytes; a packet that does not fit whole is dropped.
    """

    def __init__(self, delay_s: float, rate_bps: float | None, queue_bytes: int) -> None:
        self.line: collections.deque[tuple[float, bytes]] = collections.deque()
        self.finish = 0.0
        self.counts = dict.fromkeys(
            ("packets_in", "bytes_in", "dropped", "dropped_bytes", "packets_out", "bytes_out"), 0
        )
        self.peak_queue_bytes = 0.0
        self.late_max_s = 0.0
        self.late_1ms = 0  # packets written more than 1 ms after their due time
        self.configure(delay_s, rate_bps, queue_bytes)

    def configure(self, delay_s: float, rate_bps: float | None, queue_bytes: int) -> None:
        self.delay_s = float(delay_s)
        self.rate_Bps = None if not rate_bps else float(rate_bps) / 8.0
        self.queue_bytes = int(queue_bytes)

    def admit(self, now: float, packet: bytes) -> float | None:
        """Queue ``packet`` arrived at ``now``; its departure time, or ``None`` if dropped."""
        size = len(packet)
        c = self.counts
        c["packets_in"] += 1
        c["bytes_in"] += size
        if self.rate_Bps is None:
            due = now + self.delay_s
        else:
            start = self.finish if self.finish > now else now
            queued = (start - now) * self.rate_Bps
            if queued + size > self.queue_bytes:
                c["dropped"] += 1
                c["dropped_bytes"] += size
                return None
            if queued + size > self.peak_queue_bytes:
                self.peak_queue_bytes = queued + size
            self.finish = start + size / self.rate_Bps
            due = self.finish + self.delay_s
        self.line.append((due, packet))
        return due

    def due(self, now: float) -> list[bytes]:
        """Pop the packets whose departure time has come, oldest first."""
        out = []
        line = self.line
        while line and line[0][0] <= now + EARLY_S:
            due, packet = line.popleft()
            late = now - due
            if late > self.late_max_s:
                self.late_max_s = late
            if late > 1e-3:
                self.late_1ms += 1
            out.append(packet)
        return out

    def stats(self) -> dict:
        return dict(
            self.counts,
            queued_packets=len(self.line),
            peak_queue_bytes=int(self.peak_queue_bytes),
            late_max_ms=round(self.late_max_s * 1e3, 3),
            late_over_1ms=self.late_1ms,
        )


def _pump(src: int, dst: int, link: Bottleneck, readable: bool) -> None:
    """Read what ``src`` has (up to a batch), admit it, write what is due to ``dst``."""
    now = time.monotonic()  # one stamp per batch: reading a batch takes microseconds
    read, admit = os.read, link.admit
    for _ in range(READ_BATCH if readable else 0):
        try:
            packet = read(src, MAX_PACKET)
        except BlockingIOError:
            break
        admit(now, packet)
    _deliver(dst, link, now)


def _deliver(dst: int, link: Bottleneck, now: float) -> None:
    c = link.counts
    for packet in link.due(now):
        try:
            os.write(dst, packet)
        except OSError:  # the far device is gone or full: the packet is lost, as on a wire
            c["dropped"] += 1
            continue
        c["packets_out"] += 1
        c["bytes_out"] += len(packet)


def _command(line: str, links: list[Bottleneck]) -> dict:
    msg = json.loads(line)
    if msg["cmd"] == "set":
        for link in links:
            link.configure(msg["delay_s"], msg["rate_bps"], msg["queue_bytes"])
        return {"ok": True}
    if msg["cmd"] == "stats":
        return {"ok": True, "a_to_b": links[0].stats(), "b_to_a": links[1].stats()}
    return {"ok": False, "error": f"unknown command {msg['cmd']!r}"}


def serve(fd_a: int, fd_b: int, links: list[Bottleneck], control: int = 0) -> None:
    """Relay until ``control`` (a JSON-lines command stream) reaches end of file."""
    # select, not epoll: epoll's timeout is whole milliseconds, select's is microseconds,
    # and at 200 Mbit/s a millisecond is 17 packets of 1500 bytes.
    fds = [fd_a, fd_b, control]
    pending = b""
    while True:
        heads = [link.line[0][0] for link in links if link.line]
        timeout = max(0.0, min(heads) - time.monotonic()) if heads else None
        readable, _, _ = select.select(fds, [], [], timeout)
        if control in readable:
            chunk = os.read(control, 65536)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                sys.stdout.write(json.dumps(_command(line.decode(), links)) + "\n")
                sys.stdout.flush()
        # Both directions each turn: a readable device or a packet come due in the other.
        _pump(fd_a, fd_b, links[0], fd_a in readable)
        _pump(fd_b, fd_a, links[1], fd_b in readable)


def raise_priority() -> str:
    """Real-time scheduling if allowed, else nice -10; what was granted.

    On a loaded machine a relay at normal priority wakes milliseconds after its packets are
    due (measured: up to 60 ms with two other benchmarks running); SCHED_FIFO brings that to a
    few ms. The relay sleeps in ``select`` between packets (about a fifth of a core at 200
    Mbit/s), and the kernel's real-time throttling bounds it anyway.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        return "SCHED_FIFO"
    except (OSError, AttributeError):
        pass
    try:
        os.nice(-10)
        return "nice -10"
    except OSError:
        return "normal"


def main(argv: list[str]) -> int:
    name_a, name_b, delay_s, rate_bps, queue_bytes, realtime = argv
    # Die with the parent: then the TUN devices go too and the namespaces lose their link.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    fd_a, fd_b = open_tun(name_a), open_tun(name_b)
    rate = float(rate_bps) or None
    links = [Bottleneck(float(delay_s), rate, int(queue_bytes)) for _ in range(2)]
    priority = raise_priority() if realtime == "1" else "normal"
    ready = {"ok": True, "ready": [name_a, name_b], "priority": priority}
    sys.stdout.write(json.dumps(ready) + "\n")
    sys.stdout.flush()
    serve(fd_a, fd_b, links)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
