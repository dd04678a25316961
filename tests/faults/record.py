"""What a fault run leaves behind: the coordinator's checkpoints, watched as they appear (only
the last few are kept on disk), its event log, and every process's exit code and final theta."""

from __future__ import annotations

import gzip
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunRecord:
    """What a run left behind, read after every process has ended."""

    total_rounds: int  # coordinator rounds (outer rounds x fragments in a streaming job)
    site_codes: dict[str, int | None]
    coordinator_code: int | None
    checkpoints: dict[int, list[dict]]  # round closed -> every distinct meta seen closing it
    final_hash: str | None  # the coordinator's theta_{total}
    site_hashes: dict[str, str | None]
    fault_at: float | None = None
    problems: list[str] = field(default_factory=list)  # harness-level failures (timeouts)
    events: list[dict] = field(default_factory=list)  # the coordinator's event log, if kept
    ledger: dict | None = None  # the data ledger of the last checkpoint (shared-data mode)


class CheckpointWatcher(threading.Thread):
    """Records each checkpoint's meta.json as soon as it appears (older ones get pruned)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(name="checkpoint-watcher", daemon=True)
        self.folder = folder
        self.seen: dict[str, dict] = {}  # "round-N@written_at" -> meta
        self.stopped = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self.stopped.wait(0.02):
            self.scan()

    def scan(self) -> None:
        for meta_path in sorted(self.folder.glob("round-*/meta.json")):
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, ValueError):  # pruned or replaced while we read
                continue
            with self.lock:
                self.seen.setdefault(f"{meta_path.parent.name}@{meta.get('written_at')}", meta)

    def closed_rounds(self) -> dict[int, list[dict]]:
        with self.lock:
            metas = list(self.seen.values())
        out: dict[int, list[dict]] = {}
        for meta in sorted(metas, key=lambda m: m.get("written_at", 0)):
            closed = meta.get("closed_round")
            if closed is not None:
                out.setdefault(int(closed["number"]), []).append(meta)
        return out

    def closed_after(self, t: float) -> float | None:
        """Wall time of the first round close checkpointed after ``t``."""
        with self.lock:
            times = [m.get("written_at", 0) for m in self.seen.values() if "closed_round" in m]
        later = sorted(x for x in times if x > t)
        return later[0] if later else None


def read_events(path: Path) -> list[dict]:
    """The event log's whole lines, its rotated segments first (a torn last line is skipped, as
    the coordinator does; a record both in a segment and the live file, as a rotation cut short
    leaves it, is read once)."""
    from coordinator.events.segments import list_segments

    texts = [gzip.decompress(s.path.read_bytes()).decode() for s in list_segments(path)]
    texts.append(path.read_text() if path.exists() else "")
    events, seen = [], set()
    for line in "\n".join(texts).splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("seq") not in seen:
            seen.add(event.get("seq"))
            events.append(event)
    return events
