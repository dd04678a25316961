"""Making theta_{r+1} servable: digested once, served from its buffer, then from its file.

One digest is taken of each new theta: its state digest (``wire.digest.state_digest``: names,
dtypes, shapes and bytes, one BLAKE3 per tensor, hashed side by side), the value every site
checks bit-identity against and the checkpoint records. A whole-theta Fetch carries no payload
digest of its own: the site takes theta's state digest of what it received.
"""

from __future__ import annotations

from coordinator.persist.theta_file import ThetaSource
from coordinator.records import Published
from coordinator.round.downlink import Downlink
from wire.digest import state_digest
from wire.theta import ThetaBuffer


def hash_theta(theta: ThetaBuffer) -> bytes:
    """theta's state digest."""
    return state_digest(theta.tensors)


def publication(
    version: int,
    theta: ThetaBuffer,
    theta_hash: bytes,
    downlink: Downlink | None,
    source: ThetaSource | None = None,
) -> Published:
    """What Fetch serves for ``version``: ``theta`` (its state digest ``theta_hash``; from
    ``source``, by default its buffer) and, with a compressed downlink, the delta to it."""
    d = downlink
    return Published(
        version,
        theta_hash,
        theta.manifest,
        source if source is not None else ThetaSource(theta.payload()),
        d.from_version if d is not None else None,
        d.manifest if d is not None else None,
        d.payload if d is not None else None,
    )
