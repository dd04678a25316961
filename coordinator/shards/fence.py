"""Which lead a shard obeys, and which theta it serves when a lead starts or takes over.

Every start of a lead has an epoch one higher than the last (``coordinator.members``; under
``--ha`` counted in the object store, so a deposed leader's epoch is lower than its
successor's). A shard keeps the highest epoch a lead has sent it (``EpochFence``: written and
fsynced before the shard acts on it) and refuses a close or an align of a lower one: a deposed
leader that still runs cannot step a shard once its successor has spoken to it.

A lead that starts tells every shard the version its checkpoint holds (``Shard.Align``), and
``align_compute`` says what the shard does. The lead publishes theta_{r+1} once every shard has
closed round r, and writes its checkpoint after; the next outer step waits for that write
(``coordinator.persist.checkpointing``), so a shard is at most one version ahead of the lead's
newest checkpoint. One ahead means the lead that closed the round did not checkpoint it: after a
restart on the same host the lead replays the close from its spool and the shard answers from
its record, so no align sees it; after a takeover on another host the new leader opens that
round again, and the shard goes back to the version before, which it keeps
(``part_store.KEEP``). Anything further apart is a folder from another job or restored from an
older copy, and is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from coordinator.persist.local_store import write_atomic
from coordinator.records import Refused

FENCE_FILE = "fence.json"


@dataclass(frozen=True)
class AlignStep:
    """What a shard does when the lead's checkpoint holds theta ``want``: ``keep`` (it serves
    that already), ``rewind`` (to ``want``, which it keeps) or ``refuse``; and why."""

    action: str
    why: str


def align_compute(index: int, serving: int, kept: Sequence[int], want: int) -> AlignStep:
    """The step of shard ``index``, serving theta ``serving`` and keeping versions ``kept``,
    for a lead whose checkpoint holds theta ``want``."""
    if want == serving:
        return AlignStep("keep", f"shard {index} serves theta_{want}")
    if want == serving - 1 and want in kept:
        return AlignStep(
            "rewind",
            f"shard {index}: theta_{serving} was closed by a lead that did not checkpoint it; "
            f"serving theta_{want} again",
        )
    if want == serving - 1:
        fix = f"it keeps versions {sorted(kept)}, not theta_{want}"
    elif want > serving:
        fix = (
            "its folder is older than the lead's checkpoint: restore the shard's folder of "
            "this job, or the lead's state to that version"
        )
    else:
        fix = "its folder is newer than the lead's checkpoint: it is another job's or restored"
    return AlignStep(
        "refuse",
        f"shard {index} serves theta_{serving}, the lead's checkpoint holds theta_{want}: {fix}",
    )


def fence_compute(index: int, fenced: int, epoch: int) -> str | None:
    """Why shard ``index``, fenced at epoch ``fenced``, refuses a lead of ``epoch`` (None: it
    takes its calls)."""
    if epoch >= fenced:
        return None
    return (
        f"shard {index} follows the lead of epoch {fenced}; this lead's epoch is {epoch}: it "
        "was deposed or replaced, and steps nothing here"
    )


class EpochFence:
    """The highest lead epoch a shard has seen, kept in ``folder/fence.json``."""

    def __init__(self, folder: Path, index: int) -> None:
        self.path, self.index = Path(folder) / FENCE_FILE, index
        try:
            self.epoch = int(json.loads(self.path.read_text())["epoch"])
        except FileNotFoundError:
            self.epoch = 0
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{self.path} is damaged ({type(exc).__name__}: {exc}): it says which lead "
                'this shard follows; restore it, or write {"epoch": N} with the lead\'s '
                "epoch from its log"
            ) from exc

    def check(self, epoch: int) -> None:
        """Raise ``Refused`` for a lead older than the one followed."""
        if problem := fence_compute(self.index, self.epoch, epoch):
            raise Refused("stale", problem)

    def admit(self, epoch: int) -> None:
        """``check``, then follow a newer lead (made durable before the caller acts)."""
        self.check(epoch)
        if epoch > self.epoch:
            write_atomic(self.path, json.dumps({"epoch": epoch}).encode())
            self.epoch = epoch
