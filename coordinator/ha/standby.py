"""The gRPC front of a coordinator elected through etcd: the leader's handlers, or refusals.

A ``coordinator serve --ha`` process listens from the start, leader or not. Every call of both
services goes through ``LeaderSwitch``: while this coordinator leads (asked afresh on each
call: ``leadership()`` is the election's pure rule at the current time) it reaches the real,
gated handlers; otherwise it is refused, after the caller's certificate is checked like any
other call's, with ``UNAVAILABLE`` and the leader's address in words and in the trailing
metadata ``isthmus-leader`` (``wire.net.leader``). Sites and ``coordinator status`` retry with
backoff and move to the leader named. A leader that loses its etcd lease refuses new calls
the moment its margin runs out, before etcd can elect anyone else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from coordinator.ha.election import Leadership, standby_message
from coordinator.service.auth import AuthError, Authorizer
from coordinator.service.call_gate import COORDINATOR
from wire import bulk
from wire.net.leader import LEADER_KEY

log = logging.getLogger("isthmus.coordinator")
SERVICES = (f"/{COORDINATOR}/", f"/{bulk.SERVICE}/")


class LeaderSwitch(grpc.GenericRpcHandler):
    """Routes each call to the leader's handlers or to the standby's refusal."""

    def __init__(self, leadership: Callable[[], Leadership], authorizer: Authorizer) -> None:
        self.leadership = leadership
        self.authorizer = authorizer
        self._handlers: tuple[grpc.GenericRpcHandler, ...] = ()
        self._refusal = grpc.stream_stream_rpc_method_handler(self._refuse)

    def lead(self, handlers: tuple[grpc.GenericRpcHandler, ...]) -> None:
        """Serve with ``handlers`` (``call_gate.method_handlers``) while leading."""
        self._handlers = tuple(handlers)

    def stand_by(self) -> None:
        """Refuse every call from now on, whatever the election says (stepping down)."""
        self._handlers = ()

    def service(self, details: grpc.HandlerCallDetails):
        if not details.method.startswith(SERVICES):
            return None
        if self._handlers and self.leadership().leading:
            for handler in self._handlers:
                found = handler.service(details)
                if found is not None:
                    return found
            return None
        return self._refusal

    def _refuse(self, requests, context):
        try:
            self.authorizer.identify(context.auth_context())
        except AuthError as exc:  # a revoked or foreign certificate learns nothing more
            code = grpc.StatusCode.UNAUTHENTICATED
            if exc.code == "denied":
                code = grpc.StatusCode.PERMISSION_DENIED
            context.abort(code, str(exc))
        now = self.leadership()
        if now.leader:
            context.set_trailing_metadata(((LEADER_KEY, now.leader),))
        # Elected, still loading the newest checkpoint: the client retries here.
        message = "the leader is taking over; retry" if now.leading else standby_message(now)
        context.abort(grpc.StatusCode.UNAVAILABLE, message)
