"""A userspace TCP relay that plays a bad WAN between a site and the coordinator.

``tc netem`` is not available here, so latency, a throughput cap, a cut link and a corrupted
byte are made by a proxy on 127.0.0.1: every accepted connection is paired with one to the
target, and each direction runs through a reader thread (which tags data with the time it may
leave) and a writer thread (which holds it for the one-way delay and paces it at the rate).
The rate is one budget per direction for all connections, as on a site's single WAN link.
Every control can be changed from another thread while connections are open::

    relay = Relay(target=("127.0.0.1", coordinator_port)).start()
    site_dials(relay.address)
    relay.set_delay(0.04); relay.set_rate(2_000_000)   # 40 ms each way, 2 MB/s each way
    relay.cut(30)                                      # drop everything for 30 s
    relay.corrupt_next("up", after_bytes=40_000)       # flip one upstream byte
    relay.stop()
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

DIRECTIONS = ("up", "down")
READ_BYTES = 64 << 10
POLL_S = 0.1  # how soon a pipe thread notices that its connection was dropped
PACE_S = 0.02  # rate-capped data leaves in slices of this many seconds' worth


@dataclass(frozen=True)
class Corruption:
    """One flipped byte: its connection, its offset in that direction's stream, its values."""

    direction: str
    connection: int
    offset: int
    before: int
    after: int


def reset(sock: socket.socket) -> None:
    """Close with a TCP RST rather than a FIN: what a dropped link looks like to the peer."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class _Backlog:
    """Data read but not yet delivered, bounded in bytes so a slow direction pushes back on
    its sender through TCP instead of buffering without limit."""

    def __init__(self, closed: threading.Event) -> None:
        self.cond = threading.Condition()
        self.items: list[tuple[float, bytearray] | None] = []
        self.bytes = 0
        self.closed = closed

    def put(self, item: tuple[float, bytearray] | None, limit: int) -> None:
        with self.cond:
            while item is not None and self.bytes > limit and not self.closed.is_set():
                self.cond.wait(POLL_S)
            self.items.append(item)
            self.bytes += len(item[1]) if item else 0
            self.cond.notify_all()

    def get(self) -> tuple[float, bytearray] | None:
        with self.cond:
            while not self.items and not self.closed.is_set():
                self.cond.wait(POLL_S)
            if self.closed.is_set():
                return None
            item = self.items.pop(0)
            self.bytes -= len(item[1]) if item else 0
            self.cond.notify_all()
            return item


class Pipe:
    """One relayed connection: a reader and a writer thread per direction."""

    def __init__(self, relay: Relay, client: socket.socket, upstream: socket.socket, number: int):
        self.relay, self.number = relay, number
        self.socks = {"up": (client, upstream), "down": (upstream, client)}
        self.closed = threading.Event()
        self.aborted = False
        self.threads: list[threading.Thread] = []
        self._alive = 0
        self._lock = threading.Lock()

    def start(self) -> None:
        for direction, (src, dst) in self.socks.items():
            backlog = _Backlog(self.closed)
            for role, fn, args in (("r", self._read, (src,)), ("w", self._write, (dst,))):
                t = threading.Thread(
                    target=self._run,
                    args=(fn, direction, backlog, *args),
                    name=f"relay-{self.number}-{direction}-{role}",
                    daemon=True,
                )
                self.threads.append(t)
        self._alive = len(self.threads)
        for t in self.threads:
            t.start()

    def close(self) -> None:
        """Drop the connection: both peers see a reset."""
        self.aborted = True
        self.closed.set()

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)

    def _run(self, fn, direction: str, backlog: _Backlog, sock: socket.socket) -> None:
        try:
            fn(direction, backlog, sock)
        except (OSError, ValueError):  # a peer reset, or the socket closed under us
            self.close()
        finally:
            with self._lock:
                self._alive -= 1
                last = self._alive == 0
            if last:  # sockets are closed only once no thread can still be polling them
                for s in self.socks["up"]:
                    if self.aborted:
                        reset(s)
                    else:
                        s.close()
                self.relay.forget(self)

    def _read(self, direction: str, backlog: _Backlog, src: socket.socket) -> None:
        offset = 0
        while not self.closed.is_set():
            if not select.select([src], [], [], POLL_S)[0]:
                continue
            data = bytearray(src.recv(READ_BYTES))
            if not data:
                backlog.put(None, 0)
                return
            self.relay.maybe_corrupt(self, direction, data, offset)
            offset += len(data)
            delay, rate = self.relay.shape(direction)
            # Enough queued to fill the emulated link's bandwidth-delay product; a small floor
            # under a rate cap, like a bottleneck's buffer, so the sender feels the link.
            floor = (64 << 10) if rate else (1 << 20)
            limit = max(floor, int(2 * delay * (rate or 200e6)))
            backlog.put((time.monotonic() + delay, data), limit)

    def _write(self, direction: str, backlog: _Backlog, dst: socket.socket) -> None:
        while (item := backlog.get()) is not None:
            due, data = item
            if self.closed.wait(max(0.0, due - time.monotonic())):
                return
            view = memoryview(data)
            while view:
                n, start = self.relay.reserve(direction, len(view))
                if self.closed.wait(max(0.0, start - time.monotonic())):
                    return
                piece, view = view[:n], view[n:]
                while piece:
                    sent = self._send(dst, piece)
                    if sent is None:
                        return
                    self.relay.count(direction, sent)
                    piece = piece[sent:]
        if not self.closed.is_set():
            dst.shutdown(socket.SHUT_WR)  # the sender finished: pass its FIN on

    def _send(self, dst: socket.socket, view: memoryview) -> int | None:
        while not self.closed.is_set():
            if select.select([], [dst], [], POLL_S)[1]:
                return dst.send(view)
        return None


@dataclass
class RelayCounters:
    """What crossed the relay since it started (a snapshot; see ``Relay.counters``).

    Attributes
    ----------
    bytes_up, bytes_down
        Bytes delivered towards the target and back towards the client.
    connections
        Connections accepted and paired with the target.
    refused
        Connections reset at once because the link was cut (or the target was down).
    corrupted
        Bytes flipped by ``corrupt_next``, as ``Corruption`` records.
    """

    bytes_up: int = 0
    bytes_down: int = 0
    connections: int = 0
    refused: int = 0
    corrupted: list[Corruption] = field(default_factory=list)


class Relay:
    """A TCP proxy from ``127.0.0.1:listen_port`` to ``target`` with live WAN controls.

    Parameters
    ----------
    listen_port
        Local port to listen on; 0 picks a free one (read it from ``address``).
    target
        ``(host, port)`` every connection is forwarded to.
    delay_s, rate_bps
        Initial one-way delay and per-direction rate cap (bytes per second, None: unlimited).
    """

    def __init__(
        self,
        listen_port: int = 0,
        target: tuple[str, int] = ("127.0.0.1", 0),
        delay_s: float = 0.0,
        rate_bps: float | None = None,
    ) -> None:
        self.target = target
        self._listen_port = listen_port
        self.lock = threading.Lock()
        self.delay_s = delay_s
        self.rates: dict[str, float | None] = dict.fromkeys(DIRECTIONS, rate_bps)
        self._next_free = dict.fromkeys(DIRECTIONS, 0.0)  # pacing of the rate cap
        self._cut = False
        self._cut_timer: threading.Timer | None = None
        self._armed: dict[str, int] = {}  # direction -> bytes still to pass before the flip
        self._counters = RelayCounters()
        self._pipes: set[Pipe] = set()
        self._stopped = threading.Event()
        self._server: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None

    # ---- life cycle -----------------------------------------------------------------------

    def start(self) -> Relay:
        """Listen and start accepting; returns ``self`` so it can be chained."""
        server = socket.create_server(("127.0.0.1", self._listen_port), backlog=64)
        server.settimeout(0.1)  # the accept loop notices ``stop`` within this
        self._server = server
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"relay-accept-{self.port}", daemon=True
        )
        self._accept_thread.start()
        return self

    def stop(self) -> None:
        """Close the listener and every connection; joins the relay's threads."""
        self._stopped.set()
        with self.lock:
            if self._cut_timer is not None:
                self._cut_timer.cancel()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)
        if self._server is not None:
            self._server.close()
        self._drop_all()

    def __enter__(self) -> Relay:
        return self if self._server is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() the relay first"
        return self._server.getsockname()[1]

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT`` for clients to dial."""
        return f"127.0.0.1:{self.port}"

    # ---- controls -------------------------------------------------------------------------

    def cut(self, seconds: float | None = None) -> None:
        """Reset every open connection and every new one, until ``restore`` or for
        ``seconds``."""
        with self.lock:
            self._cut = True
            if self._cut_timer is not None:
                self._cut_timer.cancel()
                self._cut_timer = None
            if seconds is not None:
                self._cut_timer = threading.Timer(seconds, self.restore)
                self._cut_timer.daemon = True
                self._cut_timer.start()
        self._drop_all()

    def restore(self) -> None:
        """End a cut: new connections go through again."""
        with self.lock:
            self._cut = False
            if self._cut_timer is not None and self._cut_timer is not threading.current_thread():
                self._cut_timer.cancel()
            self._cut_timer = None

    @property
    def is_cut(self) -> bool:
        return self._cut

    def set_delay(self, seconds: float) -> None:
        """One-way latency added in each direction (applies to data read from now on)."""
        if seconds < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {seconds}")
        with self.lock:
            self.delay_s = float(seconds)

    def set_rate(self, bytes_per_s: float | None, direction: str | None = None) -> None:
        """Cap the link at ``bytes_per_s`` in ``direction`` ("up", "down"; None: both, each at
        that rate), shared by all connections; None lifts the cap."""
        if bytes_per_s is not None and bytes_per_s <= 0:
            raise ValueError(f"rate must be > 0 bytes/s or None, got {bytes_per_s}")
        if direction is not None and direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS} or None, got {direction!r}")
        with self.lock:
            for d in (direction,) if direction else DIRECTIONS:
                self.rates[d] = None if bytes_per_s is None else float(bytes_per_s)

    def corrupt_next(self, direction: str = "up", after_bytes: int = 0) -> None:
        """Flip (XOR 0xFF) the one byte that follows the next ``after_bytes`` bytes relayed in
        ``direction`` ("up": client to target, "down": back), over all connections."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if after_bytes < 0:
            raise ValueError(f"after_bytes must be >= 0, got {after_bytes}")
        with self.lock:
            self._armed[direction] = int(after_bytes)

    def counters(self) -> RelayCounters:
        """A copy of the traffic counters."""
        with self.lock:
            c = self._counters
            return RelayCounters(
                c.bytes_up, c.bytes_down, c.connections, c.refused, list(c.corrupted)
            )

    @property
    def open_connections(self) -> int:
        with self.lock:
            return len(self._pipes)

    # ---- called by the pipes (under no lock) -----------------------------------------------

    def shape(self, direction: str) -> tuple[float, float | None]:
        with self.lock:
            return self.delay_s, self.rates[direction]

    def maybe_corrupt(self, pipe: Pipe, direction: str, data: bytearray, base: int) -> None:
        """Flip the armed byte if it falls inside ``data`` (which starts at stream offset
        ``base`` of that pipe's direction)."""
        with self.lock:
            left = self._armed.get(direction)
            if left is None:
                return
            if left >= len(data):
                self._armed[direction] = left - len(data)
                return
            del self._armed[direction]
            data[left] ^= 0xFF
            self._counters.corrupted.append(
                Corruption(direction, pipe.number, base + left, data[left] ^ 0xFF, data[left])
            )

    def reserve(self, direction: str, size: int) -> tuple[int, float]:
        """How many of ``size`` bytes a writer may send next in ``direction``, and when.

        The cap is one budget for all of the relay's connections (one site's link), handed out
        in slices so that concurrent connections interleave instead of queueing whole bursts.
        """
        with self.lock:
            now = time.monotonic()
            rate = self.rates[direction]
            if rate is None:
                return size, now
            n = max(1, min(size, int(rate * PACE_S)))
            start = max(self._next_free[direction], now)
            self._next_free[direction] = start + n / rate
            return n, start

    def count(self, direction: str, n: int) -> None:
        with self.lock:
            if direction == "up":
                self._counters.bytes_up += n
            else:
                self._counters.bytes_down += n

    def forget(self, pipe: Pipe) -> None:
        with self.lock:
            self._pipes.discard(pipe)

    # ---- internals ------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._admit(client)

    def _admit(self, client: socket.socket) -> None:
        if self.is_cut:
            self._refuse(client)
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:  # the target is down: the client sees what it would see without us
            self._refuse(client)
            return
        for s in (client, upstream):
            s.settimeout(None)  # pipe threads wait in select, never in a blocking call
            # Small gRPC frames (heartbeats, acks) must not wait for Nagle's algorithm.
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.lock:
            if self._cut or self._stopped.is_set():
                refuse = True
            else:
                refuse = False
                self._counters.connections += 1
                pipe = Pipe(self, client, upstream, self._counters.connections)
                self._pipes.add(pipe)
        if refuse:
            reset(upstream)
            self._refuse(client)
            return
        pipe.start()

    def _refuse(self, client: socket.socket) -> None:
        with self.lock:
            self._counters.refused += 1
        reset(client)

    def _drop_all(self) -> None:
        with self.lock:
            pipes = list(self._pipes)
            self._pipes.clear()
        for pipe in pipes:
            pipe.close()
        deadline = time.monotonic() + 5
        for pipe in pipes:
            with contextlib.suppress(RuntimeError):
                pipe.join(max(0.0, deadline - time.monotonic()))
