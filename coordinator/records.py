"""Small types the coordinator's parts share: refusals, per-site records, the served theta."""

from __future__ import annotations

import re
from dataclasses import dataclass

from wire.tensors import Manifest

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class Refused(Exception):
    """A request refused without any change of state. ``code`` picks the gRPC status."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class FatalError(RuntimeError):
    """The job cannot go on (e.g. the strategy failed); the last checkpoint is intact."""


def check_name(kind: str, value: str) -> None:
    if not NAME_RE.fullmatch(value):  # fullmatch: "$" alone would let a trailing newline in
        raise Refused(
            "invalid",
            f"{kind} {value[:70]!r} is invalid: use 1-63 letters, digits, '.', '_' or '-'",
        )


@dataclass
class SiteRecord:
    state: str = "active"
    last_heartbeat: float = 0.0
    last_update_at: float | None = None
    last_round_pushed: int | None = None
    progress: dict | None = None
    last_data_at: float | None = None  # last chunk of an update received


@dataclass(frozen=True)
class Published:
    """What Fetch serves: theta_version whole and, with a compressed downlink, the encoded
    delta from version ``delta_from``."""

    version: int
    theta_hash: bytes
    manifest: Manifest
    payload: memoryview
    delta_from: int | None = None
    delta_manifest: Manifest | None = None
    delta_payload: memoryview | bytes | None = None
