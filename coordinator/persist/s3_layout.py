"""The object-store checkpoint layout and its decisions, as pure functions (no I/O).

Under ``PREFIX/checkpoints/``, round r's checkpoint is::

    round-NNNNNNNN/ATTEMPT/theta.safetensors      data objects, under a key unique to one
    round-NNNNNNNN/ATTEMPT/strategy.safetensors   writer's attempt (so no writer ever
    round-NNNNNNNN/ATTEMPT/downlink.safetensors   overwrites another's data)
    round-NNNNNNNN/ATTEMPT/meta.json
    round-NNNNNNNN/MANIFEST.json                  the commit: names the attempt's objects

A checkpoint exists once its manifest does, and the manifest is written once, with
``If-None-Match: *``: of two writers of one round only one commits. Data objects without a
manifest (a writer stopped half-way) are never read, and go when their round is pruned.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MANIFEST = "MANIFEST.json"
FORMAT = "isthmus-s3-checkpoint-1"
OBJECTS = ("theta.safetensors", "strategy.safetensors", "downlink.safetensors", "meta.json")
_ROUND = re.compile(r"^round-(\d{8})/")
_ATTEMPT = re.compile(r"^[0-9a-f]{32}$")


class ManifestError(ValueError):
    """A manifest that cannot be a checkpoint's; the message says why."""


@dataclass(frozen=True)
class Part:
    """One data object a manifest names: its key (below the round's folder), SHA-256, size."""

    key: str
    sha256: str
    bytes: int


@dataclass(frozen=True)
class Manifest:
    round: int
    attempt: str
    objects: dict[str, Part]
    written_at: float = 0.0
    epoch: int = (
        0  # the start that wrote it (``coordinator.persist.s3_epochs``; 0: an older version)
    )

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.objects.values())


def round_folder(round_number: int) -> str:
    return f"round-{round_number:08d}/"


def manifest_key(round_number: int) -> str:
    return round_folder(round_number) + MANIFEST


def data_key(round_number: int, attempt: str, name: str) -> str:
    return f"{round_folder(round_number)}{attempt}/{name}"


def round_of(key: str) -> int | None:
    """The round a key (relative to ``checkpoints/``) belongs to, or None."""
    m = _ROUND.match(key)
    return int(m.group(1)) if m else None


def committed_rounds(keys: list[str]) -> list[int]:
    """The rounds whose manifests are among ``keys``, oldest first."""
    rounds = (round_of(k) for k in keys)
    return sorted(
        {r for r, k in zip(rounds, keys, strict=True) if r is not None and k == manifest_key(r)}
    )


def prune_plan(keys: list[str], keep: int, keep_round: int) -> tuple[list[str], list[str]]:
    """What to delete so that the ``keep`` newest committed rounds stay (and ``keep_round``,
    the one just written): the older rounds' manifests (deleted first, so that no reader
    finds a manifest whose data is going), then every other key of those rounds (their data,
    and any attempt that never committed)."""
    committed = committed_rounds(keys)
    kept = set(committed[-keep:]) | {keep_round}
    oldest = min(kept)
    old = [k for k in keys if (r := round_of(k)) is not None and r < oldest]
    manifests = [k for k in old if k.endswith("/" + MANIFEST)]
    return manifests, [k for k in old if k not in set(manifests)]


def newest_first(committed: list[int]) -> list[int]:
    return sorted(committed, reverse=True)


def manifest_json(m: Manifest) -> bytes:
    objects = {
        n: {"key": p.key, "sha256": p.sha256, "bytes": p.bytes} for n, p in m.objects.items()
    }
    doc = {
        "format": FORMAT,
        "round": m.round,
        "attempt": m.attempt,
        "written_at": m.written_at,
        "epoch": m.epoch,
        "objects": objects,
    }
    return json.dumps(doc, indent=1, sort_keys=True).encode()


def parse_manifest(data: bytes, round_number: int) -> Manifest:
    """The manifest of ``round_number`` from its bytes; ``ManifestError`` if it is not one."""
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise ManifestError(f"{MANIFEST} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError(f"{MANIFEST}: not an isthmus checkpoint manifest")
    if doc.get("round") != round_number:
        raise ManifestError(f"{MANIFEST} names round {doc.get('round')!r}, not {round_number}")
    attempt = doc.get("attempt")
    if not isinstance(attempt, str) or not _ATTEMPT.match(attempt):
        raise ManifestError(f"{MANIFEST}: bad attempt {attempt!r}")
    objects = doc.get("objects")
    if not isinstance(objects, dict) or set(objects) != set(OBJECTS):
        raise ManifestError(f"{MANIFEST}: expected the objects {OBJECTS}")
    parts = {
        name: _part(name, spec, data_key(round_number, attempt, name))
        for name, spec in objects.items()
    }
    epoch = doc.get("epoch", 0)
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ManifestError(f"{MANIFEST}: bad epoch {epoch!r}")
    return Manifest(round_number, attempt, parts, float(doc.get("written_at", 0.0)), epoch)


def _part(name: str, spec: Any, want_key: str) -> Part:
    if not isinstance(spec, dict) or spec.get("key") != want_key:
        raise ManifestError(f"{MANIFEST}: {name} is not at {want_key}")
    sha, size = spec.get("sha256"), spec.get("bytes")
    if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise ManifestError(f"{MANIFEST}: {name} has no SHA-256")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ManifestError(f"{MANIFEST}: {name} has no size")
    return Part(want_key, sha, size)
