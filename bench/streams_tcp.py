"""Raw TCP over the emulated WAN: a sink and a sender of K parallel streams.

Both run inside the link's namespaces through ``WanLink.call_in`` (JSON in, JSON out). The
sender opens all K connections first, then starts every stream at once; each stream sends its
share of the bytes and waits for the sink's one-byte receipt of the last one, so a stream's
time is from its first byte sent to the receipt: the bytes on the wire plus one round trip,
like an RPC on an open connection. With ``shared`` the streams have no fixed shares: each
takes the next ``CHUNK`` of the bytes as soon as the kernel has taken its last one, as the
product's streams take pieces from one queue, and ends its connection when none is left. No
socket buffer is set by hand (that would switch off the kernel's autotuning): the windows are
what the namespace's ``tcp_rmem``/``tcp_wmem`` allow.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

CHUNK = 1 << 20
TCP_INFO_FIELDS = {"rtt_us": 15, "snd_cwnd": 18, "total_retrans": 23}  # u32 after 8 bytes


def shares(total: int, streams: int) -> list[int]:
    """``total`` bytes split over ``streams`` as evenly as whole bytes allow."""
    base, extra = divmod(total, streams)
    return [base + (1 if i < extra else 0) for i in range(streams)]


def tcp_info(sock: socket.socket) -> dict[str, int]:
    """A few fields of the kernel's ``struct tcp_info`` for ``sock``."""
    raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    words = struct.unpack_from("24I", raw, 8)
    return {name: words[i] for name, i in TCP_INFO_FIELDS.items()}


def _receive(conn: socket.socket, size: int | None, out: dict) -> None:
    """Read ``size`` bytes (None: until the sender ends the connection), then the receipt."""
    buf = bytearray(CHUNK)
    got, first = 0, None
    while size is None or got < size:
        n = conn.recv_into(buf)
        if not n:
            break
        if first is None:
            first = time.monotonic()
        got += n
    out.update(bytes=got, first_byte=first, last_byte=time.monotonic())
    conn.sendall(b"k")  # the receipt: the sender's clock stops when it arrives


def sink(host: str, port: int, streams: int, total: int, shared: bool = False) -> dict:
    """Accept ``streams`` connections and read each one's share (``shared``: whatever each
    sends); the receiver's timings."""
    with socket.create_server((host, port), backlog=streams) as server:
        conns = [server.accept()[0] for _ in range(streams)]
    results = [{} for _ in conns]
    # Shares are assigned by the 4-byte stream index each connection sends first.
    order = [struct.unpack("!I", _exactly(c, 4))[0] for c in conns]
    size = [None] * streams if shared else shares(total, streams)
    threads = [
        threading.Thread(target=_receive, args=(c, size[i], results[i]))
        for c, i in zip(conns, order, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in conns:
        c.close()
    return {"streams": results, "bytes": sum(r["bytes"] for r in results)}


def _exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            raise ConnectionError("closed early")
        data += more
    return data


def _connect(host: str, port: int, deadline_s: float = 15.0) -> socket.socket:
    # The sink starts in another process: retry until it listens.
    end = time.monotonic() + deadline_s
    while True:
        try:
            return socket.create_connection((host, port), timeout=30)
        except ConnectionRefusedError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


class _Pool:
    """The bytes not yet sent by any stream, taken ``CHUNK`` at a time."""

    def __init__(self, total: int) -> None:
        self.left, self.lock = total, threading.Lock()

    def take(self) -> int:
        with self.lock:
            n = min(CHUNK, self.left)
            self.left -= n
            return n


def _send(sock: socket.socket, size: int | _Pool, go: threading.Event, out: dict) -> None:
    view = memoryview(bytes(CHUNK))
    pool = size if isinstance(size, _Pool) else _Pool(size)
    go.wait()
    started = time.monotonic()
    sent = 0
    while n := pool.take():
        sock.sendall(view[:n])
        sent += n
    if isinstance(size, _Pool):
        sock.shutdown(socket.SHUT_WR)  # the sink reads to the end
    receipt = sock.recv(1)
    out.update(start=started, end=time.monotonic(), receipt=receipt == b"k", sent=sent)
    out.update(tcp_info(sock))


def send(host: str, port: int, streams: int, total: int, shared: bool = False) -> dict:
    """Send ``total`` bytes over ``streams`` parallel connections, in equal shares or
    (``shared``) each taking the next chunk while any is left; the sender's timings."""
    socks, connect_s = [], []
    for i in range(streams):
        t = time.monotonic()
        s = _connect(host, port)
        connect_s.append(time.monotonic() - t)
        s.sendall(struct.pack("!I", i))
        socks.append(s)
    congestion = socks[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
    go, results = threading.Event(), [{} for _ in socks]
    size = [_Pool(total)] * streams if shared else shares(total, streams)
    threads = [
        threading.Thread(target=_send, args=(s, size[i], go, results[i]))
        for i, s in enumerate(socks)
    ]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    go.set()
    for t in threads:
        t.join()
    for s in socks:
        s.close()
    return {
        "elapsed_s": max(r["end"] for r in results) - t0,
        "connect_s": min(connect_s),
        "congestion": congestion.split(b"\0")[0].decode(),
        "streams": results,
    }


def ping(host: str, port: int, count: int) -> dict:
    """Round trips of one byte on one connection (``TCP_NODELAY``): the link's RTT."""
    s = _connect(host, port)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(count):
        t = time.monotonic()
        s.sendall(b"p")
        if s.recv(1) != b"p":
            raise ConnectionError("no echo")
        times.append(time.monotonic() - t)
    s.close()
    return {"rtts_s": times}


def echo(host: str, port: int) -> dict:
    """Echo bytes back on one accepted connection until it closes."""
    with socket.create_server((host, port)) as server:
        conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    n = 0
    while data := conn.recv(4096):
        conn.sendall(data)
        n += len(data)
    conn.close()
    return {"bytes": n}
