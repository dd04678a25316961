"""Errors of the site's WAN client and of its trainers."""

from __future__ import annotations

import grpc


class CoordinatorError(RuntimeError):
    """The coordinator refused a request for good; the message is its reason."""

    def __init__(self, code: grpc.StatusCode | None, message: str) -> None:
        super().__init__(message)
        self.code = code


class TlsRefused(CoordinatorError):
    """The coordinator cannot be reached over TLS for a reason no retry fixes (a certificate
    without the name dialled, another job's CA): the message names the fix."""


class PushAborted(RuntimeError):
    """The caller withdrew an update while it was being pushed (its ``abort`` became true)."""


class TrainerError(RuntimeError):
    """The trainer cannot go on (no agent, theta mismatch, misuse of the API)."""


class SiteDrained(SystemExit):
    """The coordinator drained this site and its trainers owe nothing more: every rank leaves
    the training script with exit status 0 (the agent pushes what is left, then leaves)."""

    def __init__(self, reason: str) -> None:
        super().__init__(0)
        self.reason = reason


class PartsStalled(RuntimeError):
    """A multi-node site's update: the other hosts' parts stopped arriving, so node 0
    withdrew it (``site_client.transfer.node``)."""
