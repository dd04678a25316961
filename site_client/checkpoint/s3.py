"""Site checkpoints in S3-compatible object storage (``siteclient start --checkpoint-url``).

The same checkpoints as ``site_client.checkpoint.local`` writes into a local folder (DCP shards of
the model and inner optimiser, and a manifest with the caller's ``extra`` values and every file's
size and SHA-256), kept in a bucket in the layout of ``site_client.checkpoint.s3_layout``:

- ``write`` (collective over the site): every rank writes its shard through
  ``site_client.checkpoint.dcp_s3.S3StorageWriter`` (staged in a local folder, uploaded, deleted),
  the ranks share what they uploaded, and rank 0 writes the manifest last, with
  ``If-None-Match: *``. Until then the checkpoint does not exist for any reader.
- ``load``: every rank reads the manifest, then DCP reads the shards this rank needs through
  ``S3StorageReader``, which checks each one's SHA-256 and unpickles the metadata through the
  allow-list. A damaged object is refused with a message naming it.
- ``prune``: manifests first, then data.

Endpoint and credentials come from the usual AWS variables (as the coordinator's
``[storage]``); ``open_site_checkpoints`` refuses a URL, or missing settings, in one line.
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from site_client.checkpoint import s3_layout as layout
from site_client.checkpoint.collectives import (
    SiteCheckpointError,
    all_gather_json,
    all_ok,
    describe,
    rank,
    run_on_rank0,
    single_process_ok,
    world,
)
from site_client.checkpoint.dcp_s3 import ObjectFolder, S3StorageReader, S3StorageWriter
from site_client.checkpoint.local import (
    Extra,
    SiteCheckpointConfig,
    Staged,
    check_manifest,
    encode_extra,
    load_staged,
    manifest_doc,
    natural_key,
)
from site_client.checkpoint.url import CheckpointUrlError, open_checkpoint_url
from wire.objstore.objects import delete_keys, get_with_etag, list_keys, put_if


@dataclass(frozen=True)
class S3SiteCheckpoints:
    """One site's checkpoints in ``place``; ``staging``: a local folder for files in transit."""

    client: Any = field(repr=False)
    place: layout.SiteBucket
    staging: Path
    part_bytes: int = 64 << 20

    def url(self, name: str) -> str:
        return f"{self.place.url}{name}"

    def names(self) -> list[str]:
        """The committed checkpoints, oldest first (numbers in names compared numerically)."""
        keys = list_keys(self.client, self.place.bucket, self.place.prefix)
        return layout.committed(keys, natural_key)

    def latest(self) -> str | None:
        names = self.names()
        return names[-1] if names else None

    def _folder(self, name: str, attempt: str) -> ObjectFolder:
        keys = self.place.prefix + layout.data_prefix(name, attempt)
        return ObjectFolder(self.client, self.place.bucket, keys, self.part_bytes)

    def _scratch(self, kind: str, group=None) -> Path:
        where = self.staging / f"rank-{rank(group)}-{kind}"
        shutil.rmtree(where, ignore_errors=True)  # a write cut short left it behind
        where.mkdir(parents=True)
        return where

    # ---- writing ----------------------------------------------------------------------------

    def write(
        self,
        name: str,
        staged: Staged,
        extra: Extra | None = None,
        *,
        config: SiteCheckpointConfig | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> str:
        """Write ``staged`` as checkpoint ``name`` and commit it; collective over ``group``.
        Returns its URL. ``config`` is accepted for the local writer's signature: objects are
        always checked on the way in and out, and durability is the store's."""
        layout.check_name(name)
        encoded = encode_extra(extra)
        attempt = all_gather_json(uuid.uuid4().hex, group)[0]  # rank 0's, for every rank
        staging = self._scratch("save", group)
        writer = S3StorageWriter(staging, self._folder(name, attempt))
        try:
            with single_process_ok():
                on_group = {"process_group": group} if group is not None else {}
                dcp.save(staged.state, storage_writer=writer, **on_group)
        except (Exception, CheckpointException) as exc:
            raise SiteCheckpointError(
                f"cannot write site checkpoint {self.url(name)}: {describe(exc)}"
            ) from exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        files: dict[str, Any] = {}
        for uploaded in all_gather_json(writer.uploaded, group):
            files.update(uploaded)
        manifest = manifest_doc(staged, encoded, files, world(group))
        manifest["attempt"] = attempt
        run_on_rank0(lambda: self._commit(name, manifest), self.url(name), group)
        return self.url(name)

    def _commit(self, name: str, manifest: dict) -> None:
        body = json.dumps(manifest, indent=1, sort_keys=True).encode()
        key = self.place.prefix + layout.manifest_key(name)
        if not put_if(self.client, self.place.bucket, key, body, None):
            raise SiteCheckpointError(f"{self.url(name)} is already committed; not overwritten")

    # ---- reading ----------------------------------------------------------------------------

    def load(self, name: str, model, optimizer=None) -> Extra:
        """Restore ``model`` (and ``optimizer``) from checkpoint ``name``; every rank.

        Raises
        ------
        SiteCheckpointError
            It is not committed, its manifest is not one, or an object is damaged (the message
            names it); the model and optimiser are left as they were.
        """
        manifest, error = self._manifest(name, want_optimizer=optimizer is not None)
        if not all_ok(not error):
            why = error or "see rank 0"
            raise SiteCheckpointError(f"cannot load site checkpoint {self.url(name)}: {why}")
        folder = self._folder(name, manifest["attempt"])
        staging = self._scratch("load")
        try:
            reader = S3StorageReader(staging, folder, manifest["files"])
            return load_staged(self.url(name), model, optimizer, manifest, reader)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _manifest(self, name: str, want_optimizer: bool) -> tuple[dict, str]:
        try:
            layout.check_name(name)
            key = self.place.prefix + layout.manifest_key(name)
            found = get_with_etag(self.client, self.place.bucket, key)
        except Exception as exc:  # botocore's errors, a bad name
            return {}, f"cannot read its manifest: {exc}"
        if found is None:
            return {}, "no such checkpoint (missing, or never completed)"
        manifest, error = check_manifest(found[0], want_optimizer)
        if error:
            return {}, error
        try:
            layout.check_attempt(manifest.get("attempt"))
            for file, spec in manifest["files"].items():
                layout.check_file(file)
                _check_spec(file, spec)
        except ValueError as exc:
            return {}, f"unreadable manifest: {exc}"
        if layout.METADATA_FILE not in manifest["files"]:
            return {}, "unreadable manifest: it names no DCP metadata"
        return manifest, ""

    # ---- pruning ----------------------------------------------------------------------------

    def prune(self, keep_last: int) -> list[str]:
        """Delete all but the ``keep_last`` newest checkpoints (manifests first); one rank."""
        bucket, prefix = self.place.bucket, self.place.prefix
        keys = list_keys(self.client, bucket, prefix)
        doomed, manifests, data = layout.prune_plan(keys, keep_last, natural_key)
        delete_keys(self.client, bucket, [prefix + k for k in manifests])
        delete_keys(self.client, bucket, [prefix + k for k in data])
        return doomed


def _check_spec(file: str, spec: Any) -> None:
    size = spec.get("size") if isinstance(spec, dict) else None
    sha = spec.get("sha256") if isinstance(spec, dict) else None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"{file} has no size")
    if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise ValueError(f"{file} has no SHA-256")


def open_site_checkpoints(url: str, site: str, staging: Path) -> S3SiteCheckpoints:
    """The checkpoints of ``site`` under ``url`` (``s3://BUCKET[/PREFIX]``).

    Raises
    ------
    SiteCheckpointError
        The URL is not one, a setting is missing (named), or the bucket cannot be reached.
    """
    try:
        client, place = open_checkpoint_url(url, site)
    except CheckpointUrlError as exc:
        raise SiteCheckpointError(str(exc)) from None
    return S3SiteCheckpoints(client, place, Path(staging))
