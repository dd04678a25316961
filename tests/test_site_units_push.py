"""``CoordinatorClient.push`` in shared-data mode: telling a lost race from an update already
counted, and withdrawing an update mid-stream (a fake stub: no network)."""

from __future__ import annotations

import contextlib

import grpc
import pytest
import torch

from site_client.transfer.client import CoordinatorClient, CoordinatorError, PushAborted
from wire.bulk import parse_chunk
from wire.proto import isthmus_pb2 as pb

DELTA = {"w": torch.zeros(1 << 20)}  # 4 MiB: 4 chunks of 1 MiB


class Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, winner: str = "") -> None:
        self._code, self._details, self._winner = code, details, winner

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        """The winner of a data unit travels as a field, not in the words."""
        return (("isthmus-committed-by", self._winner),) if self._winner else ()


class FakeStub:
    """Reads the push stream (``wire.bulk`` frames: a header, then chunks); refuses it, or
    answers ``complete`` once it all arrived."""

    def __init__(self, refusal: Refusal | None = None, on_chunk=None) -> None:
        self.refusal, self.on_chunk = refusal, on_chunk
        self.chunks = self.reservations = 0

    def Push(self, frames, timeout=None) -> pb.PushReply:  # noqa: N802 - gRPC's name
        received = 0
        first = pb.PushMessage.FromString(next(frames))
        assert first.WhichOneof("kind") == "header"
        if first.header.reserve:  # asking for a receive slot: granted at once
            assert next(frames, None) is None, "a reservation carries no chunks"
            self.reservations += 1
            return pb.PushReply(granted=True)
        for frame in frames:
            _, data = parse_chunk(frame)
            self.chunks += 1
            received += len(data)
            if self.on_chunk:
                self.on_chunk(self.chunks)
        if self.refusal is not None:
            raise self.refusal
        return pb.PushReply(complete=received == 4 << 20, acked_offset=received)


@pytest.fixture
def client():
    c = CoordinatorClient("127.0.0.1:1", "site-0", chunk_bytes=1 << 20)
    c.lease = pb.Lease(site="site-0", token=1)
    yield c
    c.close()


def use(client: CoordinatorClient, stub: FakeStub) -> FakeStub:
    """Every push stream of ``client`` to ``stub``: the reservations on its bulk channel, the
    data on the upload's own connection."""
    client.bulk = stub
    client.upload_connection = lambda: contextlib.nullcontext(stub)
    return stub


def refused(details: str, winner: str = "") -> Refusal:
    return Refusal(grpc.StatusCode.ALREADY_EXISTS, details, winner)


def test_a_unit_committed_by_another_site_is_a_lost_race(client) -> None:
    use(client, FakeStub(refused("unit u3 was already committed by site-2 in round 0", "site-2")))
    with pytest.raises(CoordinatorError) as err:
        client.push(0, DELTA, data_unit="u3")
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS and "site-2" in str(err.value)


@pytest.mark.parametrize(
    ("unit", "details", "winner"),
    [
        # Resent after a coordinator restart replayed this site's own commit: it counted.
        (
            "u3",
            "unit u3 was already committed by site-0 in round 0; this copy is not counted",
            "site-0",
        ),
        ("u3", "upload already counted", ""),
        # Federated mode: as before, whatever the words.
        ("", "update of site-0 for round 0 already committed by site-2", "site-2"),
    ],
)
def test_other_already_exists_refusals_mean_already_counted(client, unit, details, winner):
    use(client, FakeStub(refused(details, winner)))
    reply = client.push(0, DELTA, data_unit=unit)
    assert reply.complete and reply.message.startswith("already counted")


def test_a_site_whose_name_extends_the_winners_is_not_the_winner() -> None:
    c = CoordinatorClient("127.0.0.1:1", "site-0")
    try:
        assert c._lost_race("site-01")
        assert c._lost_race("site-0.b")
        assert not c._lost_race("site-0")
        assert not c._lost_race("")  # no winner named
    finally:
        c.close()


def test_abort_ends_the_stream_early_and_raises(client) -> None:
    withdrawn = {"now": False}
    stub = FakeStub(on_chunk=lambda n: withdrawn.update(now=n >= 2))
    use(client, stub)
    with pytest.raises(PushAborted):
        client.push(0, DELTA, data_unit="u1", abort=lambda: withdrawn["now"])
    assert stub.chunks == 2  # no chunk sent once withdrawn, and no retry
    assert stub.reservations == 1  # the data stream was opened once its slot was granted
    # Not withdrawn: the whole update goes.
    stub = use(client, FakeStub())
    assert client.push(0, DELTA, data_unit="u1", abort=lambda: False).complete
    assert stub.chunks == 4


def test_an_update_refused_as_early_waits_until_its_round_is_open_to_the_site():
    """A new leader replaying the round before numbers the next one before it opens it: an
    update refused then waits for the round to open instead of being dropped."""
    from site_client.agent.tasks import Task, Upload
    from site_client.agent.wan import _may_push
    from wire.proto import isthmus_pb2 as pb

    upload = Upload(Task(2, ""), [], 1.0, 2)
    assert _may_push(upload, pb.RoundInfo(round=2, participant=False))  # not refused yet
    upload.early = True
    assert not _may_push(upload, pb.RoundInfo(round=1, participant=True))
    assert not _may_push(upload, pb.RoundInfo(round=2, participant=False))  # not open yet
    assert _may_push(upload, pb.RoundInfo(round=2, participant=True))
    assert _may_push(upload, pb.RoundInfo(round=3, participant=False))  # late: sent, refused
