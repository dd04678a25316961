"""The WAN relay of ``bench.relay`` against a local echo server: bytes pass unchanged, a cut
drops and refuses connections until restored, the rate cap slows a transfer, and a corruption
flips exactly one byte."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import pytest

from bench.relay import Relay


class EchoServer:
    """Sends back whatever each connection sends, until the client closes it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def target(self) -> tuple[str, int]:
        return ("127.0.0.1", self.sock.getsockname()[1])

    def _serve(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def relay():
    echo = EchoServer()
    r = Relay(target=echo.target).start()
    yield r
    r.stop()
    echo.stop()


def dial(relay: Relay) -> socket.socket:
    return socket.create_connection(("127.0.0.1", relay.port), timeout=10)


def roundtrip(sock: socket.socket, payload: bytes) -> bytes:
    """Send ``payload`` from one thread, read the echo from this one."""
    sender = threading.Thread(target=sock.sendall, args=(payload,), daemon=True)
    sender.start()
    got = bytearray()
    while len(got) < len(payload):
        data = sock.recv(1 << 16)
        if not data:
            break
        got += data
    sender.join(10)
    return bytes(got)


def test_passthrough_is_byte_exact_and_counted(relay):
    payload = os.urandom(3 << 20)
    with dial(relay) as s:
        assert roundtrip(s, payload) == payload
    # The relay counts a piece once its send returned: the peer can see the bytes first.
    deadline = time.monotonic() + 10
    while relay.counters().bytes_down < len(payload) and time.monotonic() < deadline:
        time.sleep(0.01)
    c = relay.counters()
    assert c.bytes_up == c.bytes_down == len(payload)
    assert c.connections == 1 and c.refused == 0 and c.corrupted == []


def test_half_close_passes_the_fin_on(relay):
    with dial(relay) as s:
        s.sendall(b"last words")
        s.shutdown(socket.SHUT_WR)
        got = b""
        while data := s.recv(100):
            got += data
    assert got == b"last words"  # the echo server saw EOF, answered, then closed


def test_cut_drops_open_connections_and_refuses_new_ones_until_restored(relay):
    with dial(relay) as s:
        assert roundtrip(s, b"x" * 100) == b"x" * 100
        relay.cut()
        with pytest.raises(OSError):  # a reset, or EOF then a broken pipe
            for _ in range(50):
                s.sendall(b"y" * 1000)
                if not s.recv(1000):
                    raise ConnectionResetError("closed")
                time.sleep(0.01)
    assert relay.open_connections == 0
    with pytest.raises(OSError), dial(relay) as s:  # the reset may even beat connect()
        s.sendall(b"z")
        if not s.recv(10):
            raise ConnectionResetError("closed")
    assert relay.counters().refused >= 1
    relay.restore()
    with dial(relay) as s:
        assert roundtrip(s, b"back") == b"back"


def test_timed_cut_ends_by_itself(relay):
    relay.cut(0.5)
    assert relay.is_cut
    deadline = time.monotonic() + 10
    while relay.is_cut and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not relay.is_cut
    with dial(relay) as s:
        assert roundtrip(s, b"again") == b"again"


def test_rate_cap_slows_a_transfer_roughly_as_asked(relay):
    payload = os.urandom(256 << 10)
    with dial(relay) as s:
        started = time.monotonic()
        assert roundtrip(s, payload) == payload
        fast = time.monotonic() - started
        relay.set_rate(512 << 10)  # 256 KiB at 512 KiB/s: about 0.5 s each way, pipelined
        started = time.monotonic()
        assert roundtrip(s, payload) == payload
        slow = time.monotonic() - started
        relay.set_rate(None)
    # Loose bounds only: the machine is shared and timing varies.
    assert slow >= 0.35, f"capped transfer took {slow:.2f}s, expected about 0.5s or more"
    assert slow < 10 and slow > 2 * fast, (slow, fast)


def test_delay_holds_bytes_back(relay):
    relay.set_delay(0.2)
    with dial(relay) as s:
        started = time.monotonic()
        assert roundtrip(s, b"ping") == b"ping"
        elapsed = time.monotonic() - started
    assert 0.35 <= elapsed < 5, elapsed  # 0.2 s each way


def test_corruption_flips_exactly_one_byte_at_the_asked_offset(relay):
    payload = bytes(range(256)) * 1024  # 256 KiB
    with dial(relay) as s:
        assert roundtrip(s, b"warm-up") == b"warm-up"
        relay.corrupt_next("up", after_bytes=100_000)
        got = roundtrip(s, payload)
        assert roundtrip(s, payload) == payload  # one-shot: the next pass is clean
    diffs = [i for i in range(len(payload)) if got[i] != payload[i]]
    assert diffs == [100_000]
    assert got[100_000] == payload[100_000] ^ 0xFF
    (event,) = relay.counters().corrupted
    assert (event.direction, event.offset) == ("up", len(b"warm-up") + 100_000)
    assert (event.before, event.after) == (payload[100_000], payload[100_000] ^ 0xFF)


def test_corruption_downstream_and_bad_arguments(relay):
    with pytest.raises(ValueError):
        relay.corrupt_next("sideways", 0)
    with pytest.raises(ValueError):
        relay.set_rate(0)
    relay.corrupt_next("down", after_bytes=0)
    with dial(relay) as s:
        got = roundtrip(s, b"\x00abc")
    assert got == b"\xffabc"


def test_rate_cap_can_apply_to_one_direction(relay):
    payload = os.urandom(128 << 10)
    relay.set_rate(128 << 10, direction="down")  # the echo back takes about 1 s
    with dial(relay) as s:
        started = time.monotonic()
        assert roundtrip(s, payload) == payload
        elapsed = time.monotonic() - started
    assert relay.rates == {"up": None, "down": float(128 << 10)}
    assert 0.6 <= elapsed < 10, elapsed


def test_rate_cap_is_shared_by_concurrent_connections(relay):
    payload = os.urandom(96 << 10)
    relay.set_rate(192 << 10, direction="up")  # two 96 KiB uploads share it: about 1 s
    results: list[bytes] = []
    with dial(relay) as a, dial(relay) as b:
        started = time.monotonic()
        threads = [
            threading.Thread(target=lambda s=s: results.append(roundtrip(s, payload)))
            for s in (a, b)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        elapsed = time.monotonic() - started
    assert results == [payload, payload]
    assert 0.7 <= elapsed < 10, elapsed  # one connection alone would take about 0.5 s
