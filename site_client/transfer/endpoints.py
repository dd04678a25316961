"""The connections a transfer's streams use, per endpoint (``[transfer] streams = K``).

Every piece of a transfer names the ``plan.Endpoint`` it goes to, and stream ``i`` of the
transfer uses that endpoint's connection ``i``: today the coordinator the client follows
(``coordinator_endpoint``), or, for an upload, that coordinator over the upload's own
connections; a sharded coordinator would be one endpoint per shard, each with its own.

Stream 0 is the client's bulk channel; each stream beyond it has a TCP connection of its own
(one connection would carry them all through one congestion window), opened on first use and
kept, so later transfers start on warm connections. They belong to an address: when the
client follows a new leader (``coordinator serve --ha``), the streams of the next transfer,
and the next attempt of every stream already running, go to the new one. So a stream's stub
is resolved at each call (``FollowingStub``), never kept from the start of a transfer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc

from site_client.transfer.plan import Endpoint
from wire.bulk import BulkStub
from wire.proto import isthmus_pb2 as pb

COORDINATOR = "coordinator"


def coordinator_endpoint(client, streams: int) -> Endpoint:
    """The coordinator ``client`` follows, over ``streams`` streams of its own connections."""
    return Endpoint(COORDINATOR, tuple(FollowingStub(client, i) for i in range(max(1, streams))))


class StreamChannels:
    """Extra connections per address, for the streams beyond the first."""

    def __init__(self, open_channel: Callable[[str], grpc.Channel]) -> None:
        self._open = open_channel
        self._lock = threading.Lock()
        self._channels: dict[str, list[grpc.Channel]] = {}
        self._stubs: dict[str, list[BulkStub]] = {}

    def stub(self, address: str, index: int) -> BulkStub:
        """The stub of extra stream ``index`` (1, 2, ...) to ``address``, opened if new."""
        with self._lock:
            stubs = self._stubs.setdefault(address, [])
            channels = self._channels.setdefault(address, [])
            while len(stubs) < index:
                channels.append(self._open(address))
                stubs.append(BulkStub(channels[-1]))
            return stubs[index - 1]

    def channels(self, address: str, extra: int) -> list[grpc.Channel]:
        """The first ``extra`` extra channels to ``address`` (opening them if new)."""
        if extra > 0:
            self.stub(address, extra)
        with self._lock:
            return list(self._channels.get(address, [])[:extra])

    def close(self) -> None:
        with self._lock:
            for channels in self._channels.values():
                for channel in channels:
                    channel.close()
            self._channels.clear()
            self._stubs.clear()


class FollowingStub:
    """Stream ``index`` of a client's transfers, to whichever address it uses at each call."""

    def __init__(self, client, index: int) -> None:
        self.client, self.index = client, index

    def _now(self) -> BulkStub:
        c = self.client
        if self.index == 0:
            return c.bulk
        return c.streams.stub(c.address, self.index)

    def Fetch(self, request: pb.FetchRequest, timeout: float) -> Iterator[bytes]:  # noqa: N802
        return self._now().Fetch(request, timeout=timeout)

    def Push(self, frames: Iterator[bytes], timeout: float) -> pb.PushReply:  # noqa: N802
        return self._now().Push(frames, timeout=timeout)


class UploadConnection:
    """The connection of one upload's data streams, to the address the client uses at each
    attempt (reopened when the client follows a new leader), closed with the upload. Two
    pieces of a stream may be pushed on it at once (the next one starts while the reply of
    the one before it is on its way), so it is opened and reopened under a lock."""

    def __init__(self, client, open_channel: Callable[[str], grpc.Channel]) -> None:
        self.client, self._open = client, open_channel
        self._lock = threading.Lock()
        self._address: str | None = None
        self._channel: grpc.Channel | None = None
        self._stub: BulkStub | None = None

    def Push(self, frames: Iterator[bytes], timeout: float) -> pb.PushReply:  # noqa: N802
        return self._now().Push(frames, timeout=timeout)

    def _now(self) -> BulkStub:
        address = self.client.address
        with self._lock:
            if address != self._address:
                self._close()
                self._channel, self._address = self._open(address), address
                self._stub = BulkStub(self._channel)
            return self._stub

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = self._address = None
