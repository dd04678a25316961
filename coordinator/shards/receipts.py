"""A shard's receipt for a part it holds durably, and the job's shard key that signs it.

A site pushes its part of an update to each shard and carries the shards' receipts to the
lead, which counts the update only with every receipt: so the lead never calls a shard while
updates arrive, and a site cannot claim a part it did not deliver. A receipt is an HMAC-SHA256
under a key the lead and the shards share (``shard.key``, 32 random bytes, mode 0600, in the
lead's state folder; shards on other hosts are given a copy) over what identifies the part.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path

KEY_FILE = "shard.key"
KEY_BYTES = 32


class ShardKeyError(ValueError):
    """A shard key file that cannot be used; the message says what to do."""


@dataclass(frozen=True)
class PartReceipt:
    """What a receipt vouches for: shard ``shard`` holds, durably, the part of upload
    ``upload_id`` of ``site`` for ``round`` whose payload digest is ``digest``."""

    shard: int
    round: int
    site: str
    upload_id: str
    digest: bytes
    weight: float

    def message(self) -> bytes:
        """The signed bytes: every field, length-prefixed (no two receipts share them)."""
        fields = (self.site.encode(), self.upload_id.encode(), self.digest)
        head = struct.pack("<IQd", self.shard, self.round, self.weight)
        return head + b"".join(struct.pack("<I", len(f)) + f for f in fields)


def sign(key: bytes, receipt: PartReceipt) -> bytes:
    return hmac.new(key, receipt.message(), hashlib.sha256).digest()


def valid(key: bytes, receipt: PartReceipt, mac: bytes) -> bool:
    """Whether ``mac`` is the receipt's signature (compared in constant time)."""
    return hmac.compare_digest(sign(key, receipt), bytes(mac))


@dataclass(frozen=True)
class ShardPass:
    """What a pass vouches for: the lead leased ``site`` when it served it theta ``version``,
    so the shards let it fetch their parts of that theta and push theirs of round ``version``.
    A site the lead no longer leases (lapsed, drained, never joined) gets no pass for the next
    version, and so nothing more from the shards."""

    site: str
    version: int

    def message(self) -> bytes:
        site = self.site.encode()
        return b"pass\0" + struct.pack("<QI", self.version, len(site)) + site


def sign_pass(key: bytes, granted: ShardPass) -> bytes:
    return hmac.new(key, granted.message(), hashlib.sha256).digest()


def pass_valid(key: bytes, granted: ShardPass, mac: bytes) -> bool:
    """Whether ``mac`` is the pass's signature (compared in constant time)."""
    return hmac.compare_digest(sign_pass(key, granted), bytes(mac))


def create_key(path: Path) -> bytes:
    """A new key at ``path`` (mode 0600), or the one already there."""
    path = Path(path)
    if path.exists():
        return load_key(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(KEY_BYTES)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return key


def load_key(path: Path) -> bytes:
    """The key in ``path``: exactly 32 bytes, readable by its owner only."""
    path = Path(path)
    try:
        mode = path.stat().st_mode & 0o777
        key = path.read_bytes()
    except OSError as exc:
        raise ShardKeyError(
            f"shard key {path}: {exc.strerror}; copy the lead's state_dir/{KEY_FILE} there"
        ) from exc
    if mode & 0o077:
        raise ShardKeyError(
            f"shard key {path} is readable by others (mode {mode:o}): chmod 600 {path}"
        )
    if len(key) != KEY_BYTES:
        raise ShardKeyError(
            f"shard key {path} holds {len(key)} bytes, not {KEY_BYTES}: copy the lead's "
            f"state_dir/{KEY_FILE} again"
        )
    return key
