"""Admission of each call before its request arrives: who calls, how many at once, how long.

grpc's sync server gives a call a worker thread the moment it arrives; for a method registered
as unary that thread then waits, with no bound, for the request message. Forty calls that never
send one (from any certificate, even a revoked one) used to park every worker, and honest
heartbeats timed out until every lease expired. So every method is registered here with a
streaming request side: the gate runs as soon as the call arrives, with the TLS peer already
known, and

* refuses a revoked, foreign-chained or malformed certificate at once (the thread goes back to
  the pool in microseconds; nothing else is held);
* bounds the calls one caller may have open at once, per kind of call (``CallLimits``), so one
  site holding calls or push streams open cannot take what another site needs;
* bounds how long a request message may take to arrive (``server.request_timeout_s``) and how
  long a stream may sit idle between messages (``server.stream_idle_s``): a call past its bound
  is cancelled (``CallWatchdog``).

The wire is unchanged: a client's unary request is one message followed by half-close, which a
streaming handler reads the same way.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from coordinator.service.auth import AuthError, Authorizer
from coordinator.service.watchdog import CallWatchdog
from wire import bulk
from wire.proto import isthmus_pb2 as pb
from wire.transfer import TransferConfig

log = logging.getLogger("isthmus.coordinator")

COORDINATOR = "isthmus.v1.Coordinator"


@dataclass(frozen=True)
class CallLimits:
    """How many calls of each kind one certificate may have open at once.

    An honest site has at most one heartbeat or join, one round watch, and one fetch and one
    push per transfer stream in flight; the limits leave room for a retry overlapping a call
    the site gave up on."""

    control: int = 4  # Join, Heartbeat, Leave
    wait: int = 2  # WaitRound (a long poll)
    fetch: int = 2
    push: int = 2
    status: int = 4  # operators: Status, Drain

    @classmethod
    def for_transfer(cls, transfer: TransferConfig) -> CallLimits:
        """The limits for a job whose transfers take ``transfer.streams`` (K) streams each: K
        fetch (and push) streams, and room for a retry of each."""
        k = transfer.streams
        return cls(fetch=2 * k, push=2 * k)

    def of(self, kind: str) -> int:
        return getattr(self, kind)

    def per_caller(self) -> int:
        return self.control + self.wait + self.fetch + self.push + self.status


def admit(open_calls: Counter, caller: str, kind: str, limits: CallLimits) -> str | None:
    """Why a new ``kind`` call from ``caller`` is refused, or None to let it in (pure)."""
    limit = limits.of(kind)
    if open_calls[(caller, kind)] >= limit:
        return (
            f"{caller} already has {limit} {kind} call(s) open, the most one caller may; "
            "retry when one finishes"
        )
    return None


class CallGate:
    """Identifies each call, counts it against its caller's limits, bounds its waits."""

    def __init__(
        self,
        authorizer: Authorizer,
        limits: CallLimits,
        request_timeout_s: float,
        stream_idle_s: float,
        watchdog: CallWatchdog,
        on_refused: Callable[[str, str], None] = lambda kind, code: None,
    ) -> None:
        self.authorizer = authorizer
        self.limits = limits
        self.request_timeout_s = request_timeout_s
        self.stream_idle_s = stream_idle_s
        self.watchdog = watchdog
        self.on_refused = on_refused  # (kind of call, status name): for the metrics
        self._lock = threading.Lock()
        self._open: Counter = Counter()

    def _caller(self, context) -> str:
        try:
            who = self.authorizer.identify(context.auth_context())
        except AuthError as exc:
            log.info("call refused before its request: %s", exc)
            code = grpc.StatusCode.UNAUTHENTICATED
            if exc.code == "denied":
                code = grpc.StatusCode.PERMISSION_DENIED
            self.on_refused("call", code.name)
            context.abort(code, str(exc))
        if who is None:  # --insecure: no certificates; a connection is the best name there is
            return f"peer {context.peer()}"
        return f"{who.role} {who.name!r}"

    def enter(self, context, kind: str) -> str:
        """Count a new call or abort it; returns the caller's name for ``leave``."""
        caller = self._caller(context)
        with self._lock:
            refusal = admit(self._open, caller, kind, self.limits)
            if refusal is None:
                self._open[(caller, kind)] += 1
        if refusal is not None:
            log.warning("call refused: %s", refusal)
            self.on_refused(kind, "RESOURCE_EXHAUSTED")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        return caller

    def leave(self, caller: str, kind: str) -> None:
        with self._lock:
            self._open[(caller, kind)] -= 1
            if not self._open[(caller, kind)]:
                del self._open[(caller, kind)]

    def next_message(self, requests: Iterator, context, timeout_s: float, what: str):
        """The next request message (None at the end of the stream), cancelling the call if
        it does not arrive within ``timeout_s``."""
        ticket = self.watchdog.arm(timeout_s, context, what)
        try:
            return next(requests, None)
        finally:
            self.watchdog.disarm(ticket)

    def request(self, requests: Iterator, context, what: str):
        """The one request message of a unary call, within the request bound."""
        request = self.next_message(requests, context, self.request_timeout_s, what)
        if request is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request message is missing")
        return request

    def messages(self, requests: Iterator, context, what: str) -> Iterator:
        """A request stream whose first message must come within the request bound and each
        later one within the idle bound."""
        bound = self.request_timeout_s
        while True:
            msg = self.next_message(requests, context, bound, what)
            if msg is None:
                return
            yield msg
            bound = self.stream_idle_s

    def replies(self, replies: Iterator, context, what: str) -> Iterator:
        """A reply stream cancelled when the client stops reading for the idle bound (grpc
        asks for the next reply only once the previous one was sent)."""
        for reply in replies:
            ticket = self.watchdog.arm(self.stream_idle_s, context, what)
            try:
                yield reply
            finally:
                self.watchdog.disarm(ticket)

    # ---- the method wrappers --------------------------------------------------------------

    @contextlib.contextmanager
    def admitted(self, context, kind: str, method: Callable):
        """Count the call while it runs (or abort it); yields its name for the logs."""
        caller = self.enter(context, kind)
        try:
            yield f"{method.__name__} from {caller}"
        finally:
            self.leave(caller, kind)

    def unary(self, kind: str, method: Callable) -> Callable:
        @functools.wraps(method)
        def handler(requests, context):
            with self.admitted(context, kind, method) as what:
                return method(self.request(requests, context, what), context)

        return handler

    def unary_stream(self, kind: str, method: Callable) -> Callable:
        @functools.wraps(method)
        def handler(requests, context):
            with self.admitted(context, kind, method) as what:
                request = self.request(requests, context, what)
                yield from self.replies(method(request, context), context, what)

        return handler

    def stream_unary(self, kind: str, method: Callable) -> Callable:
        @functools.wraps(method)
        def handler(requests, context):
            with self.admitted(context, kind, method) as what:
                return method(self.messages(requests, context, what), context)

        return handler


def _unary(gate: CallGate, kind: str, method: Callable, request_type) -> grpc.RpcMethodHandler:
    return grpc.stream_unary_rpc_method_handler(
        gate.unary(kind, method),
        request_deserializer=request_type.FromString,
        response_serializer=lambda reply: reply.SerializeToString(),
    )


def method_handlers(gate: CallGate, servicer) -> tuple[grpc.GenericRpcHandler, ...]:
    """Both services' methods, each behind the gate, for ``server.add_generic_rpc_handlers``."""
    stream_unary = grpc.stream_unary_rpc_method_handler
    stream_stream = grpc.stream_stream_rpc_method_handler
    coordinator = {
        "Join": _unary(gate, "control", servicer.Join, pb.JoinRequest),
        "Heartbeat": _unary(gate, "control", servicer.Heartbeat, pb.HeartbeatRequest),
        "Leave": _unary(gate, "control", servicer.Leave, pb.LeaveRequest),
        "WaitRound": _unary(gate, "wait", servicer.WaitRound, pb.WaitRoundRequest),
        "Status": _unary(gate, "status", servicer.Status, pb.StatusRequest),
        "Drain": _unary(gate, "status", servicer.Drain, pb.DrainRequest),
        "Fetch": stream_stream(
            gate.unary_stream("fetch", servicer.Fetch),
            request_deserializer=pb.FetchRequest.FromString,
            response_serializer=pb.FetchMessage.SerializeToString,
        ),
        "Push": stream_unary(
            gate.stream_unary("push", servicer.Push),
            request_deserializer=pb.PushMessage.FromString,
            response_serializer=pb.PushReply.SerializeToString,
        ),
    }
    bulk_methods = {
        "Fetch": stream_stream(
            gate.unary_stream("fetch", servicer.FetchBulk),
            request_deserializer=pb.FetchRequest.FromString,
            response_serializer=None,
        ),
        "Push": stream_unary(
            gate.stream_unary("push", servicer.PushBulk),
            request_deserializer=None,
            response_serializer=pb.PushReply.SerializeToString,
        ),
    }
    return (
        grpc.method_handlers_generic_handler(COORDINATOR, coordinator),
        grpc.method_handlers_generic_handler(bulk.SERVICE, bulk_methods),
    )
