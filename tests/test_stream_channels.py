"""A site client following a new leader: of calls failing together at one address only the
first moves the client, and the streams of a transfer already running go to the new address
at their next call (their stubs are resolved per call), on connections kept per address and
closed with the client."""

from __future__ import annotations

import grpc

from site_client.transfer.client import CoordinatorClient

A, B = "127.0.0.1:1", "127.0.0.1:2"


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"

    def trailing_metadata(self):
        return ()


def test_calls_failing_together_at_one_address_move_the_client_once():
    client = CoordinatorClient(f"{A},{B}", "site-a")
    try:
        assert client.address == A
        client._follow(Unavailable(), A)  # the first failure at A moves on to B
        client._follow(Unavailable(), A)  # a second call that failed at A: already moved
        assert client.address == B
        client._follow(Unavailable(), B)
        assert client.address == A
    finally:
        client.close()


def test_streams_of_a_running_transfer_go_to_the_address_of_each_call():
    client = CoordinatorClient(f"{A},{B}", "site-a")
    try:
        first, second = client.stream_stubs(2)
        assert first._now() is client.bulk
        at_a = second._now()
        assert second._now() is at_a  # kept: later transfers start on warm connections
        client._follow(Unavailable(), A)
        assert first._now() is client.bulk and client.address == B
        at_b = second._now()
        assert at_b is not at_a
        assert client.streams.stub(A, 1) is at_a  # A's connection is kept, not reopened
        opened = client.streams.channels(B, 1) + client.streams.channels(A, 1)
        assert len(opened) == 2
    finally:
        client.close()
    assert client.streams._channels == {}  # closed with the client
