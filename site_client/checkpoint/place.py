"""Where a site's trainers keep their checkpoints: the run folder (default) or object storage.

``CheckpointPlace`` gives the trainer one interface over both: the target of a new checkpoint,
the committed ones (oldest first), writing (the ``AsyncCheckpointer``'s ``write``), loading,
pruning. ``load_newest`` is the resume rule: the newest checkpoint that loads, and where the
newest is damaged, the one before it, with an ERROR naming what was refused and what is used
instead (every rank reaches the same verdict: a load fails on all ranks or on none).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from site_client.checkpoint.collectives import SiteCheckpointError
from site_client.checkpoint.local import (
    Extra,
    complete_checkpoints,
    load_site_checkpoint,
    prune_site_checkpoints,
    site_checkpoint_path,
    write_staged,
)
from site_client.checkpoint.s3 import S3SiteCheckpoints

log = logging.getLogger("isthmus.trainer")


@dataclass(frozen=True)
class CheckpointPlace:
    """A local ``folder``, or ``s3`` (then ``folder`` is unused)."""

    folder: Path
    s3: S3SiteCheckpoints | None = None

    def target(self, seq: int) -> Path | str:
        """Where checkpoint ``seq`` goes: a folder's path, or a name in the bucket."""
        path = site_checkpoint_path(self.folder, seq)
        return path.name if self.s3 is not None else path

    def where(self, target: Path | str) -> str:
        return self.s3.url(target) if self.s3 is not None else str(target)

    def committed(self) -> list[Path | str]:
        """The complete checkpoints, oldest first."""
        return self.s3.names() if self.s3 is not None else complete_checkpoints(self.folder)

    @property
    def write(self):
        return self.s3.write if self.s3 is not None else write_staged

    def load(self, target: Path | str, model, optimizer) -> Extra:
        if self.s3 is not None:
            return self.s3.load(target, model, optimizer)
        return load_site_checkpoint(target, model, optimizer)

    def prune(self, keep_last: int) -> list:
        if self.s3 is not None:
            return self.s3.prune(keep_last)
        return prune_site_checkpoints(self.folder, keep_last)


def load_newest(
    place: CheckpointPlace, model, optimizer, before: Path | str | None = None
) -> tuple[Path | str, Extra] | None:
    """The newest checkpoint that loads (older than ``before`` when given), loaded into
    ``model`` and ``optimizer``: its target and saved values; None when there is none. A
    damaged one is logged (naming it) and the one before it is tried.

    Raises
    ------
    SiteCheckpointError
        Checkpoints exist but none of them loads (every refusal is in the message), or
        ``before`` is not among them.
    """
    targets = place.committed()
    if before is not None:
        if before not in targets:
            where = place.where(before)
            raise SiteCheckpointError(f"no checkpoint before {where}: it is no longer there")
        targets = targets[: targets.index(before)]
    refused: list[str] = []
    for target in reversed(targets):
        try:
            extra = place.load(target, model, optimizer)
        except SiteCheckpointError as exc:
            refused.append(str(exc))
            log.error("%s; trying the checkpoint before it", exc)
            continue
        if refused:
            log.error("resuming from the previous site checkpoint %s", place.where(target))
        return target, extra
    if refused:
        raise SiteCheckpointError("no site checkpoint loads: " + "; ".join(refused))
    return None
