"""Errors of the site's WAN client."""

from __future__ import annotations

import grpc


class CoordinatorError(RuntimeError):
    """The coordinator refused a request for good; the message is its reason."""

    def __init__(self, code: grpc.StatusCode | None, message: str) -> None:
        super().__init__(message)
        self.code = code


class PushAborted(RuntimeError):
    """The caller withdrew an update while it was being pushed (its ``abort`` became true)."""
