"""Making theta_{r+1} servable: hashed once, served from its buffer, then from its file.

Two digests are taken of each new theta, in parallel (hashlib releases the GIL): its state hash
(``wire.tensors.state_hash``: names, dtypes, shapes and bytes, the value every site checks
bit-identity against) and the SHA-256 of its payload (what a whole-theta Fetch stream is checked
against). Neither is taken again: the checkpoint records the first, and a site that receives
theta whole and verifies the second holds the first too.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from coordinator.persist.theta_file import ThetaSource
from coordinator.records import Published
from coordinator.round.downlink import Downlink
from wire.tensors import state_hash
from wire.theta import ThetaBuffer

_hashers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="theta-hash")


def hash_theta(theta: ThetaBuffer) -> tuple[bytes, ThetaBuffer]:
    """(state hash, the buffer with its payload digest), computed side by side."""
    state = _hashers.submit(state_hash, theta.tensors)
    digested = _hashers.submit(theta.with_digest)
    return state.result(), digested.result()


def publication(
    version: int,
    theta: ThetaBuffer,
    theta_hash: bytes,
    downlink: Downlink | None,
    source: ThetaSource | None = None,
) -> Published:
    """What Fetch serves for ``version``: ``theta`` (already digested; from ``source``, by
    default its buffer) and, with a compressed downlink, the delta that leads to it."""
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
