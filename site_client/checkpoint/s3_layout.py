"""Where a site's checkpoints lie in object storage, and what to read or delete (pure).

``siteclient start --checkpoint-url s3://BUCKET/PREFIX`` keeps the site's checkpoints under
``PREFIX/SITE/`` (the site's name is added, so sites given one URL never meet)::

    NAME/ATTEMPT/.metadata            DCP's metadata, written by rank 0
    NAME/ATTEMPT/__R_0.distcp         rank R's shard of the model and optimiser
    NAME/isthmus_site_checkpoint.json the manifest: the attempt, every file's size and SHA-256

A checkpoint is visible once its manifest is, and the manifest is written last, once, with
``If-None-Match: *``: data without a manifest (an upload cut short) is never read. The attempt
(a fresh id per write) keeps one writer's objects from ever overwriting another's. Pruning
deletes manifests first, then data, so no reader finds a manifest whose data is going.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MANIFEST = "isthmus_site_checkpoint.json"
METADATA_FILE = ".metadata"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ATTEMPT = re.compile(r"^[0-9a-f]{32}$")
_FILE = re.compile(r"^(\.metadata|__\d+_\d+\.distcp)$")


@dataclass(frozen=True)
class SiteBucket:
    """A site's checkpoint folder in a bucket: ``s3://bucket/prefix`` (prefix ends in ``/``)."""

    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def site_bucket(bucket: str, prefix: str, site: str) -> SiteBucket:
    """The folder of ``site``'s checkpoints under ``s3://bucket/prefix``."""
    if not _NAME.match(site):
        raise ValueError(f"site name {site!r} cannot name an object-store folder")
    return SiteBucket(bucket, f"{prefix}/{site}/" if prefix else f"{site}/")


def check_name(name: str) -> str:
    """``name`` if it can name a checkpoint (one path segment), else ``ValueError``."""
    if not _NAME.match(name):
        raise ValueError(f"checkpoint name {name!r}: expected letters, digits, '.', '_', '-'")
    return name


def check_attempt(attempt: object) -> str:
    if not isinstance(attempt, str) or not _ATTEMPT.match(attempt):
        raise ValueError(f"bad attempt {attempt!r}")
    return attempt


def check_file(name: object) -> str:
    """A file a manifest names: DCP's metadata or a rank's shard, nothing else (no paths)."""
    if not isinstance(name, str) or not _FILE.match(name):
        raise ValueError(f"the manifest names a file {name!r} that no DCP checkpoint holds")
    return name


def manifest_key(name: str) -> str:
    return f"{name}/{MANIFEST}"


def data_prefix(name: str, attempt: str) -> str:
    return f"{name}/{attempt}/"


def name_of(key: str) -> str | None:
    """The checkpoint a key (relative to the site's folder) belongs to."""
    head, sep, _ = key.partition("/")
    return head if sep and _NAME.match(head) else None


def committed(keys: list[str], order) -> list[str]:
    """The checkpoints whose manifests are among ``keys``, oldest first by ``order``."""
    names = {n for k in keys if (n := name_of(k)) is not None and k == manifest_key(n)}
    return sorted(names, key=order)


def prune_plan(keys: list[str], keep_last: int, order) -> tuple[list[str], list[str], list[str]]:
    """``(doomed, manifests, data)``: the checkpoints beyond the ``keep_last`` newest, their
    manifests (to delete first), and then every other key older than the oldest kept one
    (their data, and uploads that never committed). Nothing newer than that is touched: it
    may be a write in progress."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    done = committed(keys, order)
    doomed, kept = done[:-keep_last], done[-keep_last:]
    if not kept:
        return [], [], []
    oldest = order(kept[0])
    old = [k for k in keys if (n := name_of(k)) is not None and order(n) < oldest]
    manifests = [manifest_key(n) for n in doomed]
    return doomed, manifests, [k for k in old if k not in set(manifests)]
