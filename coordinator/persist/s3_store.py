"""Coordinator checkpoints in S3-compatible object storage (``[storage] url = "s3://..."``).

The same interface as ``coordinator.persist.local_store.CheckpointStore`` (``save``,
``load_latest``,
``kept_rounds``, ``load_round``, ``next_epoch``), over the layout of
``coordinator.persist.s3_layout``:

- ``save`` uploads the four data objects under a fresh attempt id (multipart above the part
  size, every part checked by ``Content-MD5``), then commits by writing the round's small
  manifest (their keys, sizes and SHA-256) with ``If-None-Match: *``. A second writer of the
  round gets 412 and a ``StoreError``; the first commit stays as it was. Then old rounds are
  pruned to ``KEEP``: their manifests first, then their data.
- An object store that does not answer (``s3_objects.unreachable``) makes ``save`` raise
  ``StoreUnavailable``: nothing is committed, and the checkpoint writer tries again until it
  answers (``coordinator.persist.disk.until_written``). A manifest write whose reply was lost may
  still have landed: a later try that finds the round committed by an attempt of this very
  store takes that commit as its own rather than reporting another writer.
- Reading goes only through manifests; every object's SHA-256 is checked, then the state
  hashes in ``meta.json`` as the local store does; a damaged newest checkpoint falls back to
  the one before.
- ``next_epoch``: read-modify-write of the starts record ``PREFIX/epoch``
  (``coordinator.persist.s3_epochs``) with ``If-Match`` on its ETag (``If-None-Match: *`` for the
  first), retried on 412: two coordinators starting on one store never get the same epoch,
  and a candidate elected before a start already counted is refused.
- Fencing: before a manifest is written, ``fence`` (set by a coordinator elected through
  etcd, ``coordinator.ha.role``) must say this coordinator still leads, and ``PREFIX/epoch`` must
  still hold this start's epoch: a coordinator that started after it (a new leader counts its
  start before it loads a checkpoint) has taken the store over, and this one's commit is
  refused. The manifest write itself stays conditional (``If-None-Match: *``), and names
  its start: one that lands after a later start took over from an earlier round is void
  (``s3_epochs.void_by``), skipped by readers and written over.

The event log goes up in segments beside the checkpoints (``coordinator.events.remote``,
through ``ship_events``); the spool, the drain list and the lock stay in the local state folder.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable

from safetensors.torch import load as load_safetensors

from coordinator.persist import s3_epochs as epochs
from coordinator.persist import s3_layout as layout
from coordinator.persist import state_digests
from coordinator.persist.local_store import (
    FORMAT,
    KEEP,
    Checkpoint,
    StoreError,
    StoreUnavailable,
    _contiguous,
)
from wire.digest import state_digest
from wire.objstore.objects import (
    Blob,
    FileBlob,
    delete_keys,
    get_verified,
    get_with_etag,
    list_keys,
    put_blob,
    put_if,
    unreachable,
)
from wire.safetensors_io import canonical_order, contiguous_manifest, header_bytes, tensor_bytes

log = logging.getLogger(__name__)
EPOCH_TRIES = 200


def tensor_blob(tensors: dict) -> Blob:
    """A safetensors file's bytes (the local store's layout, byte for byte), as segments."""
    manifest = contiguous_manifest(tensors, canonical_order(tensors))
    return Blob(
        [header_bytes(manifest), *(tensor_bytes(tensors[e.name]) for e in manifest.entries)]
    )


class S3CheckpointStore:
    """Checkpoints and the start epoch under ``s3://bucket/prefix``."""

    def __init__(
        self, client, bucket: str, prefix: str, part_bytes: int = 64 << 20, read_only: bool = False
    ) -> None:
        self.client, self.bucket, self.part_bytes = client, bucket, part_bytes
        self.prefix = f"{prefix}/" if prefix else ""
        self.dir = f"{self.prefix}checkpoints/"
        self.url = f"s3://{bucket}/{self.prefix}"
        self.read_only = read_only
        self._write = threading.Lock()
        self._damaged: set[int] = set()  # rounds this store found unusable (may be re-written)
        self.epoch: int | None = None  # this start's, once counted (``next_epoch``)
        self._attempts: dict[int, set[str]] = {}  # round -> attempts this store uploaded
        # Raises StoreError when this coordinator may no longer commit (``coordinator.ha.role``).
        self.fence: Callable[[], None] | None = None
        # Publishes the event log's new records (``coordinator.events.remote``): run inside the
        # fencing, before each manifest is written, so a commit's events are never lost.
        self.ship_events: Callable[[], object] | None = None
        try:
            client.head_bucket(Bucket=bucket)
        except Exception as exc:
            raise StoreError(
                f"storage.url {self.url}: bucket {bucket!r} not reachable: {exc}"
            ) from exc

    # ---- writing ----------------------------------------------------------------------------

    def save(self, ckpt: Checkpoint) -> layout.Manifest:
        """Upload ``ckpt`` and commit it; ``StoreError`` if another writer committed its round,
        ``StoreUnavailable`` if the store did not answer (then nothing was committed by this
        call, unless a later one finds that it was)."""
        if self.read_only:
            raise StoreError(f"{self.url} is open read-only")
        with self._write:
            try:
                manifest = self._upload(ckpt)
                manifest = self._commit(manifest)
                self._prune(ckpt.round)
            except StoreError:
                raise
            except Exception as exc:
                if unreachable(exc):
                    raise StoreUnavailable(
                        f"{self.url}: the store did not answer while round {ckpt.round}'s "
                        f"checkpoint was written ({exc})"
                    ) from exc
                raise
            return manifest

    def _upload(self, ckpt: Checkpoint) -> layout.Manifest:
        strategy, downlink = (_contiguous(t) for t in (ckpt.strategy_state, ckpt.downlink))
        theta = ckpt.theta if ckpt.theta_file is not None else _contiguous(ckpt.theta)
        meta = {
            **ckpt.meta,
            "format": FORMAT,
            "round": ckpt.round,
            **state_digests.recorded(ckpt.theta_hash or state_digest(theta), strategy, downlink),
            "written_at": time.time(),
        }
        blobs = {
            "theta.safetensors": (
                FileBlob(ckpt.theta_file) if ckpt.theta_file is not None else tensor_blob(theta)
            ),
            "strategy.safetensors": tensor_blob(strategy),
            "downlink.safetensors": tensor_blob(downlink),
            "meta.json": Blob([json.dumps(meta, indent=1, sort_keys=True).encode()]),
        }
        attempt = uuid.uuid4().hex
        self._attempts.setdefault(ckpt.round, set()).add(attempt)
        parts = {}
        for name, blob in blobs.items():
            key = layout.data_key(ckpt.round, attempt, name)
            put_blob(self.client, self.bucket, self.dir + key, blob, self.part_bytes)
            parts[name] = layout.Part(key, blob.sha256(), blob.size)
        return layout.Manifest(ckpt.round, attempt, parts, meta["written_at"], self.epoch or 0)

    def _commit(self, manifest: layout.Manifest) -> layout.Manifest:
        """Write ``manifest``; the manifest that stands committed for its round (this one, or
        an earlier attempt of this store whose write landed though its reply was lost)."""
        key = self.dir + layout.manifest_key(manifest.round)
        self._check_fenced(f"round {manifest.round}")
        if self.ship_events is not None:
            self.ship_events()
        if manifest.round in self._damaged:  # found unusable here: this writer replaces it
            log.warning("replacing the damaged checkpoint of round %d", manifest.round)
            delete_keys(self.client, self.bucket, [key])
            self._damaged.discard(manifest.round)
        body = layout.manifest_json(manifest)
        if put_if(self.client, self.bucket, key, body, None):
            return manifest
        mine = self._own_commit(manifest.round)
        if mine is not None:
            log.warning(
                "round %d was already committed by this coordinator (attempt %s: a write whose "
                "reply was lost); keeping that commit",
                manifest.round,
                mine.attempt,
            )
            return mine
        if not self._replace_void(manifest.round, body):
            raise StoreError(
                f"round {manifest.round} was already committed by another writer "
                f"({self.url}checkpoints/{layout.manifest_key(manifest.round)}); this one's "
                "data is left uncommitted"
            )
        return manifest

    def _own_commit(self, round_number: int) -> layout.Manifest | None:
        """The manifest of ``round_number`` if one of this store's own attempts wrote it."""
        found = get_with_etag(
            self.client, self.bucket, self.dir + layout.manifest_key(round_number)
        )
        if found is None:
            return None
        try:
            there = layout.parse_manifest(found[0], round_number)
        except layout.ManifestError:
            return None
        return there if there.attempt in self._attempts.get(round_number, ()) else None

    def _replace_void(self, round_number: int, body: bytes) -> bool:
        """After a refused commit: if the manifest there is void (a deposed coordinator's late
        write, ``coordinator.persist.s3_epochs``), write this one over it; False if it stands."""
        key = self.dir + layout.manifest_key(round_number)
        found = get_with_etag(self.client, self.bucket, key)
        if found is None:
            return put_if(self.client, self.bucket, key, body, None)
        try:
            there = layout.parse_manifest(found[0], round_number)
        except layout.ManifestError:
            return False
        if epochs.void_by(self._epochs()[0], round_number, there.epoch) is None:
            return False
        log.warning(
            "round %d's manifest was written late by a deposed coordinator (start %d); "
            "replacing it",
            round_number,
            there.epoch,
        )
        return put_if(self.client, self.bucket, key, body, found[1])

    def _prune(self, keep_round: int) -> None:
        keys = list_keys(self.client, self.bucket, self.dir)
        manifests, data = layout.prune_plan(keys, KEEP, keep_round)
        delete_keys(self.client, self.bucket, [self.dir + k for k in manifests])
        delete_keys(self.client, self.bucket, [self.dir + k for k in data])

    def ship_events_now(self) -> None:
        """Publish the event log's tail (at stop), if this coordinator may still write."""
        if self.ship_events is None or self.read_only:
            return
        with self._write:
            self._check_fenced("the event log's tail")
            self.ship_events()

    def _check_fenced(self, what: str) -> None:
        """``StoreError`` unless this coordinator may still commit (see the module docstring)."""
        if self.fence is not None:
            self.fence()
        if self.epoch is None:
            return
        record, _ = self._epochs()
        if record.epoch != self.epoch:
            raise StoreError(
                f"not committing {what}: {self.url}epoch is at start {record.epoch}, this "
                f"coordinator started as {self.epoch}: a newer coordinator has taken the store "
                "over"
            )

    def _epochs(self) -> tuple[epochs.EpochRecord, str | None]:
        """``PREFIX/epoch``'s record and ETag (None: not written yet)."""
        found = get_with_etag(self.client, self.bucket, self.prefix + "epoch")
        try:
            record = epochs.parse_record(found[0] if found is not None else None)
        except epochs.EpochError as exc:
            raise StoreError(f"{self.url}epoch is damaged: {exc}") from None
        return record, found[1] if found is not None else None

    def _replace_epochs(self, change) -> epochs.EpochRecord:
        """Apply ``change`` (record -> record) to ``PREFIX/epoch`` by conditional writes,
        again while other starts race it; ``StoreError`` if ``change`` refuses."""
        for tries in range(EPOCH_TRIES):
            prev, etag = self._epochs()
            try:
                new = change(prev)
            except epochs.EpochError as exc:
                raise StoreError(f"{self.url}epoch: {exc}") from None
            if put_if(self.client, self.bucket, self.prefix + "epoch", new.to_bytes(), etag):
                return new
            time.sleep(random.uniform(0, min(0.5, 0.005 * 2**tries)))  # another start: again
        raise StoreError(f"{self.url}epoch: still contended after {EPOCH_TRIES} tries")

    def next_epoch(self, revision: int = 0) -> int:
        """Count this start and return its number (1 for the first start). ``revision``: the
        etcd revision it was elected at (``coordinator.ha.role``); ``StoreError`` if a start
        elected later was counted already (this one is deposed)."""
        self.epoch = self._replace_epochs(lambda prev: epochs.count_start(prev, revision)).epoch
        return self.epoch

    def _took_over(self, from_round: int) -> None:
        """Record the round this start loaded: from now on a manifest of a later round by an
        earlier start is void (a deposed leader's write that landed late)."""
        epoch = self.epoch
        self._replace_epochs(lambda prev: epochs.took_over(prev, epoch, from_round))

    def record_completion(self, data: bytes) -> None:
        """Say that the job is complete (``coordinator.service.job_end``), for the standbys."""
        put_blob(self.client, self.bucket, self.prefix + "complete.json", Blob([data]), 1 << 30)

    def completion(self) -> bytes | None:
        found = get_with_etag(self.client, self.bucket, self.prefix + "complete.json")
        return found[0] if found is not None else None

    # ---- reading ----------------------------------------------------------------------------

    def kept_rounds(self) -> list[int]:
        """The committed rounds, oldest first."""
        return layout.committed_rounds(list_keys(self.client, self.bucket, self.dir))

    def load_latest(self, theta_only: bool = False) -> Checkpoint | None:
        """The newest committed checkpoint that verifies, or None if none is committed; with
        ``theta_only`` its strategy and downlink state are not downloaded (and left empty)."""
        problems = []
        for r in layout.newest_first(self.kept_rounds()):
            try:
                ckpt = self._load(r, theta_only)
            except (StoreError, ValueError) as exc:
                self._damaged.add(r)
                problems.append(f"round {r}: {exc}")
                log.error(
                    "checkpoint of round %d in %s is unusable (%s); trying the one before",
                    r,
                    self.url,
                    exc,
                )
            else:
                self._claim(r, theta_only)
                return ckpt
        if problems:
            raise StoreError(f"no usable checkpoint in {self.url}: " + "; ".join(problems))
        self._claim(-1, theta_only)
        return None

    def _claim(self, from_round: int, theta_only: bool) -> None:
        if self.epoch is not None and not theta_only and not self.read_only:
            self._took_over(from_round)

    def load_round(self, round_number: int, theta_only: bool = False) -> Checkpoint:
        """The checkpoint of ``round_number``, verified; ``StoreError`` if it is not kept or
        does not verify."""
        kept = self.kept_rounds()
        if round_number not in kept:
            names = ", ".join(map(str, kept)) or "none"
            raise StoreError(f"no checkpoint of round {round_number} in {self.url} (kept: {names})")
        try:
            return self._load(round_number, theta_only)
        except ValueError as exc:
            raise StoreError(f"round {round_number}: {exc}") from exc

    def _load(self, r: int, theta_only: bool = False) -> Checkpoint:
        found = get_with_etag(self.client, self.bucket, self.dir + layout.manifest_key(r))
        if found is None:
            raise StoreError(f"the manifest of round {r} went away (pruned meanwhile?)")
        manifest = layout.parse_manifest(found[0], r)
        voided = epochs.void_by(self._epochs()[0], r, manifest.epoch)
        if voided is not None:
            raise StoreError(
                f"the manifest of round {r} was written by start {manifest.epoch} after start "
                f"{voided} took over from an earlier round (a deposed coordinator's late "
                "write): not a commit"
            )
        skip = {"strategy.safetensors", "downlink.safetensors"} if theta_only else set()
        raw = {
            name: get_verified(self.client, self.bucket, self.dir + p.key, p.sha256, p.bytes)
            for name, p in manifest.objects.items()
            if name not in skip
        }
        meta = json.loads(raw["meta.json"])
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("round") != r:
            raise StoreError(f"meta.json of round {r} does not describe it")
        try:
            tensors = {
                n: load_safetensors(raw[f"{n}.safetensors"]) if f"{n}.safetensors" in raw else {}
                for n in ("theta", "strategy", "downlink")
            }
        except Exception as exc:  # safetensors raises its own error types
            raise StoreError(f"tensor file unreadable: {exc}") from exc
        for name, t in tensors.items():
            problem = (
                None if f"{name}.safetensors" in skip else state_digests.mismatch(name, t, meta)
            )
            if problem:
                raise StoreError(problem)
        theta_hash = state_digests.theta_digest(meta, tensors["theta"])
        return Checkpoint(
            r, tensors["theta"], tensors["strategy"], meta, tensors["downlink"], theta_hash
        )
