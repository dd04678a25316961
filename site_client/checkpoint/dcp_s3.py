"""``torch.distributed.checkpoint`` storage over S3: a StorageWriter and a StorageReader.

Both are DCP's file-system writer and reader pointed at a local staging folder, with the
object store at their edges:

- ``S3StorageWriter`` lets ``FileSystemWriter`` write each rank's ``__R_N.distcp`` (and rank
  0's ``.metadata``) into the rank's staging folder, then uploads each file (multipart above
  the part size, every part checked by ``Content-MD5``) under ``KEYS/``, records its size and
  SHA-256 in ``uploaded`` and deletes the staged copy. The manifest naming them is written by
  the caller, last (``site_client.checkpoint.s3``).
- ``S3StorageReader`` downloads ``.metadata`` and, for ``read_data``, only the files this
  rank's read plan needs, each checked against the manifest's size and SHA-256 as it streams
  in (a damaged object is refused, naming the file), then lets ``FileSystemReader`` read them.
  The metadata is unpickled through ``site_client.checkpoint.dcp_reader``'s allow-list, never with a
  bare
  ``pickle.load``.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from site_client.checkpoint.dcp_reader import load_metadata
from wire.objstore.objects import FileBlob, download_verified, put_blob

METADATA = ".metadata"


@dataclass(frozen=True)
class ObjectFolder:
    """Objects under ``s3://bucket/keys`` (``keys`` ends in ``/``) through ``client``."""

    client: Any = field(repr=False)
    bucket: str
    keys: str
    part_bytes: int = 64 << 20

    def url(self, name: str = "") -> str:
        return f"s3://{self.bucket}/{self.keys}{name}"


class S3StorageWriter(dcp.FileSystemWriter):
    """DCP's writer staging in ``staging`` and uploading to ``folder`` (see the module
    docstring). ``uploaded``: ``{file: {"size": n, "sha256": hex}}`` of what this rank sent."""

    def __init__(self, staging: str | os.PathLike, folder: ObjectFolder) -> None:
        # fsync is pointless for a file that is uploaded and deleted at once.
        super().__init__(staging, sync_files=False, overwrite=True)
        self.folder = folder
        self.uploaded: dict[str, dict[str, Any]] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        for name in sorted({r.storage_data.relative_path for r in results}):
            self._upload(name)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        self._upload(METADATA)

    def _upload(self, name: str) -> None:
        path = Path(self.path) / name
        blob = FileBlob(path)
        f = self.folder
        put_blob(f.client, f.bucket, f.keys + name, blob, f.part_bytes)
        self.uploaded[name] = {"size": blob.size, "sha256": blob.sha256()}
        path.unlink()


class S3StorageReader(dcp.FileSystemReader):
    """DCP's reader over files downloaded from ``folder`` into ``staging``, each verified
    against ``files`` (the manifest's ``{file: {"size", "sha256"}}``)."""

    def __init__(
        self, staging: str | os.PathLike, folder: ObjectFolder, files: dict[str, dict]
    ) -> None:
        super().__init__(staging)
        self.folder, self.files = folder, files
        Path(staging).mkdir(parents=True, exist_ok=True)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._fetch(METADATA)
        try:
            with open(path, "rb") as f:
                data = f.read()
        finally:
            path.unlink(missing_ok=True)
        return load_metadata(io.BytesIO(data), self.folder.url(METADATA), self.load_id)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        names = sorted({self.storage_data[i.storage_index].relative_path for i in plan.items})
        fetched = []
        try:
            fetched = [self._fetch(n) for n in names]
            return super().read_data(plan, planner)
        finally:
            for path in fetched:
                path.unlink(missing_ok=True)

    def _fetch(self, name: str) -> Path:
        want = self.files.get(name)
        if want is None:
            raise ValueError(f"{name} is not among the files the manifest names")
        dest = Path(self.path) / name
        f = self.folder
        try:
            download_verified(f.client, f.bucket, f.keys + name, want["sha256"], want["size"], dest)
        except ValueError:
            raise ValueError(
                f"{name} does not match its size and SHA-256 in the manifest "
                f"({f.url(name)} is damaged)"
            ) from None
        return dest
