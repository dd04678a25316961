"""Where the coordinator's checkpoints live: the state folder's store, or the object store's.

By default (``[storage] url = ""``, ``wire.objstore.config``) checkpoints go to the local state
folder (``coordinator.persist.local_store``): nothing to install for a one-machine job. With
``url = "s3://BUCKET/PREFIX"`` they go to S3-compatible object storage
(``coordinator.persist.s3_store``). Only the checkpoints (theta, strategy and downlink state,
the data ledger in their meta) and the start epoch move to the object store: the spool, the
event log, the drain list, the lock and the final model stay in the local state folder.
"""

from __future__ import annotations

from pathlib import Path

from wire.objstore.config import StorageConfig, check_storage, parse_url, s3_client


def open_store(state_dir: Path, cfg: StorageConfig | None = None, read_only: bool = False):
    """The checkpoint store the config names: the state folder's, or the object store's."""
    from coordinator.persist.local_store import CheckpointStore

    if cfg is None or not cfg.remote:
        return CheckpointStore(state_dir, read_only=read_only)
    check_storage(cfg)
    from coordinator.persist.s3_store import S3CheckpointStore

    bucket, prefix = parse_url(cfg.url)
    client = s3_client(cfg)
    return S3CheckpointStore(
        client, bucket, prefix, part_bytes=cfg.multipart_mib << 20, read_only=read_only
    )


def checkpoint_bytes(saved) -> int:
    """The size of what ``save`` wrote: a local checkpoint folder, or a committed manifest."""
    if isinstance(saved, Path):
        return sum(f.stat().st_size for f in saved.iterdir())
    return int(saved.bytes)
