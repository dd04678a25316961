"""Progress of long transfers (``site_client.transfer.progress``), fed by the push and the theta
fetch, and the benchmarks' step lines (``bench.progress``). A fake clock: nothing sleeps."""

from __future__ import annotations

import io
import logging

import grpc
import pytest
import torch
from rich.console import Console

from bench.progress import steps
from site_client.agent.update_payload import payload_of
from site_client.transfer.progress import (
    ProgressPolicy,
    Snapshot,
    TransferProgress,
    done_line,
    duration,
    progress_line,
    terminal,
)
from site_client.transfer.push import UpdatePush
from site_client.transfer.theta import ThetaFetcher
from wire.bulk import chunk_frame, parse_chunk
from wire.chunking import ChunkError
from wire.digest import state_digest
from wire.proto import isthmus_pb2 as pb
from wire.tensors import pack
from wire.transfer import TransferConfig

MB = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def lines(caplog):
    """The ``isthmus.site`` log's messages."""
    caplog.set_level(logging.INFO, logger="isthmus.site")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "isthmus.site"]


def plain(clock: Clock, **policy) -> TransferProgress:
    return TransferProgress(tty=False, clock=clock, policy=ProgressPolicy(**policy))


def test_plain_lines_come_every_ten_seconds_with_percent_rate_and_eta(lines) -> None:
    clock = Clock()
    p = plain(clock)
    p.start("push round 3", 200 * MB)
    for _ in range(16):  # 12.5 MB a second for 16 s
        clock.now += 1
        p.advance(12_500_000)
    p.finish()
    assert lines() == [
        # the first once it has run 2 s, then at most one each 10 s
        "push round 3: 25.0 of 200.0 MB (12%), 12.5 MB/s, ETA 14 s",
        "push round 3: 150.0 of 200.0 MB (75%), 12.5 MB/s, ETA 4 s",
        "push round 3: 200.0 MB in 16.0 s (12.5 MB/s)",
    ]


def test_a_stalled_transfer_says_its_eta_is_unknown_and_a_slow_one_counts_minutes() -> None:
    assert progress_line(Snapshot("fetch theta v2", 50 * MB, 0, 0, 30.0)).endswith(
        "0.0 of 50.0 MB (0%), 0.0 MB/s, ETA unknown"
    )
    slow = Snapshot("fetch theta v2", 20_000 * MB, 2_000 * MB, 2_000 * MB, 400.0)
    assert progress_line(slow) == (
        "fetch theta v2: 2.00 of 20.00 GB (10%), 5.0 MB/s, ETA 1 h 00 min"
    )
    assert duration(59.7) == "1 min 0 s" and duration(125) == "2 min 5 s"
    assert duration(3.04, precise=True) == "3.0 s"


def test_small_or_quick_transfers_say_nothing(lines) -> None:
    clock = Clock()
    small = plain(clock)
    small.start("push round 0", 4 * MB)  # under 8 MiB, however slow
    for _ in range(4):
        clock.now += 30
        small.advance(MB)
    small.finish()
    quick = plain(clock)
    quick.start("push round 1", 500 * MB)
    for _ in range(5):  # 500 MB in 1.5 s
        clock.now += 0.3
        quick.advance(100 * MB)
    quick.finish()
    assert lines() == []


def test_a_resumed_transfer_goes_on_from_the_acked_offset(lines) -> None:
    clock = Clock()
    p = plain(clock, every_s=1.0)
    p.start("push round 5", 100 * MB)
    for _ in range(3):
        clock.now += 1
        p.advance(10 * MB)
    p.start("push round 5", 100 * MB, 20 * MB)  # the stream broke; 20 MB were acked
    for _ in range(8):
        clock.now += 1
        p.advance(10 * MB)
        if p.snapshot().done == 30 * MB:
            assert lines()[-1] == "push round 5: 30.0 of 100.0 MB (30%), 10.0 MB/s, ETA 7 s"
    assert p.snapshot().done == 100 * MB and p.snapshot().moved == 110 * MB
    p.finish()
    assert lines()[-1] == "push round 5: 100.0 MB in 11.0 s (10.0 MB/s, 10.0 MB sent again)"


def test_bytes_sent_twice_are_named_in_the_closing_line() -> None:
    s = Snapshot("push round 5", 100 * MB, 100 * MB, 120 * MB, 10.0)
    assert done_line(s) == "push round 5: 100.0 MB in 10.0 s (12.0 MB/s, 20.0 MB sent again)"


def test_on_a_terminal_a_bar_shows_the_label_and_the_bytes(lines) -> None:
    clock, out = Clock(), io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    p = TransferProgress(tty=True, console=console, clock=clock)
    p.start("fetch theta v7", 200 * MB)
    clock.now += 1
    p.advance(20 * MB)
    assert p.bar is None and out.getvalue() == ""  # not before 2 s
    clock.now += 2
    p.advance(28 * MB)
    assert p.bar is not None and terminal.locked()
    p.bar.progress.refresh()
    drawn = out.getvalue()
    assert "fetch theta v7" in drawn and "48.0/200.0 MB" in drawn
    p.start("fetch theta v7", 200 * MB, 10 * MB)  # resumed: the bar restarts at the offset
    p.bar.progress.refresh()
    assert "10.0/200.0 MB" in out.getvalue()
    p.update(200 * MB)
    p.finish()
    assert not terminal.locked() and p.bar is None
    assert lines() == ["fetch theta v7: 200.0 MB in 3.0 s (16.0 MB/s)"]  # no plain lines


def test_a_second_bar_at_once_falls_back_to_lines(lines) -> None:
    clock = Clock()
    with terminal:  # a benchmark's bar holds the terminal
        p = TransferProgress(tty=True, console=Console(file=io.StringIO()), clock=clock)
        p.start("push round 1", 100 * MB)
        clock.now += 5
        p.advance(50 * MB)
        assert p.bar is None
    assert lines() == ["push round 1: 50.0 of 100.0 MB (50%), 10.0 MB/s, ETA 5 s"]


# ---- the real push and fetch code, with fake clients ---------------------------------------


class FakePayload:
    """What ``UpdatePush`` reads of a payload: its size, manifest and chunks."""

    def __init__(self, total: int) -> None:
        self.real = payload_of(*pack({"w": torch.zeros(total, dtype=torch.uint8)}))
        self.total_bytes, self.manifest = total, self.real.manifest

    def chunks(self, start: int, size: int):
        return self.real.chunks(start, size)


class FakePushClient:
    def __init__(self, chunk_bytes: int) -> None:
        self.lease = pb.Lease(site="site-0", token=1)
        self.chunk_bytes, self.bytes_sent = chunk_bytes, 0


def test_push_frames_report_every_byte_they_yield() -> None:
    clock = Clock()
    progress = plain(clock)
    client = FakePushClient(chunk_bytes=MB)
    push = UpdatePush(
        client, 3, FakePayload(10 * MB), weight=1.0, base_version=3, data_unit="", progress=progress
    )
    frames = push.frames(0)
    next(frames)  # the header
    sent = 0
    for frame in frames:
        sent += len(parse_chunk(frame)[1])
        clock.now += 1
        assert progress.snapshot().done == sent - MB  # reported once the chunk has gone
    assert sent == 10 * MB and progress.snapshot().done == 10 * MB == client.bytes_sent
    assert progress.label == "push round 3"
    # A resumed stream: progress stands at the acked offset, and counts the resent bytes.
    resumed = push.frames(4 * MB)
    next(resumed)  # the header
    assert progress.snapshot().done == 4 * MB
    assert sum(len(parse_chunk(f)[1]) for f in resumed) == 6 * MB
    assert progress.snapshot().done == 10 * MB and progress.snapshot().moved == 16 * MB


class Broken(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


class FakeFetchClient:
    """Serves a payload in 1 MB chunks, one second each; the first stream breaks after 2."""

    def __init__(self, clock: Clock, manifest, payload: memoryview, theta_hash: bytes) -> None:
        self.clock, self.manifest, self.payload, self.hash = clock, manifest, payload, theta_hash
        self.lease = pb.Lease(site="site-0", token=1)
        self.transfer_timeout_s, self.bytes_received = 10.0, 0
        self.bulk, self.offsets = self, []
        self.transfer = TransferConfig()  # one stream

    def call(self, describe: str, fn):
        for _ in range(3):  # retried like ``CoordinatorClient.call``, without the waits
            try:
                return fn()
            except (Broken, ChunkError):
                continue
        raise AssertionError("fetch did not finish")

    def Fetch(self, req: pb.FetchRequest, timeout=None):  # noqa: N802 - gRPC's name
        self.offsets.append(req.offset)
        header = pb.FetchHeader(version=7, manifest=self.manifest.to_proto(), theta_hash=self.hash)
        yield header.SerializeToString()
        for offset in range(req.offset, len(self.payload), MB):
            if len(self.offsets) == 1 and offset == 2 * MB:
                raise Broken()
            self.clock.now += 1
            yield chunk_frame(offset, self.payload[offset : offset + MB])


def test_a_theta_fetch_reports_its_bytes_and_resumes_where_it_broke(lines) -> None:
    clock = Clock()
    theta = {"w": (torch.arange(5 * MB) % 251).to(torch.uint8)}
    manifest, payload = pack(theta)
    client = FakeFetchClient(clock, manifest, memoryview(payload).cast("B"), state_digest(theta))
    fetcher = ThetaFetcher(client, new_progress=lambda: plain(clock, min_bytes=0, every_s=2.0))
    state = fetcher.fetch()
    assert torch.equal(state.theta["w"], theta["w"]) and state.version == 7
    assert client.offsets == [0, 2 * MB] and client.bytes_received == 5 * MB
    assert lines() == [
        "fetch theta v7: 2.0 of 5.0 MB (40%), 1.0 MB/s, ETA 3 s",
        "fetch theta v7: 4.0 of 5.0 MB (80%), 1.0 MB/s, ETA 1 s",  # 3.0 had it restarted at 0
        "fetch theta v7: 5.0 MB in 5.0 s (1.0 MB/s)",
    ]


# ---- bench.progress ---------------------------------------------------------------------


def test_bench_steps_print_the_plain_lines_off_a_terminal(capsys) -> None:
    for item in steps(["64 MiB, 2 sites", "64 MiB, 4 sites"], tty=False):
        print(f"    ran {item}")
    assert capsys.readouterr().out.splitlines() == [
        "[1/2] 64 MiB, 2 sites ...",
        "    ran 64 MiB, 2 sites",
        "[2/2] 64 MiB, 4 sites ...",
        "    ran 64 MiB, 4 sites",
    ]


def test_bench_steps_draw_a_bar_on_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    seen = list(
        steps([("a", 1), ("b", 2)], lambda s: f"scenario {s[0]}", tty=True, console=console)
    )
    assert seen == [("a", 1), ("b", 2)] and not terminal.locked()
    drawn = out.getvalue()
    assert "[1/2] scenario a ..." in drawn and "[2/2] scenario b ..." in drawn
    assert "2/2" in drawn.rsplit("scenario b ...", 1)[1]  # the bar's last state, all done
