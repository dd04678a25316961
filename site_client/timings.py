"""Where a site's round time goes, one JSON line per transfer or hand-off.

The agent appends its pushes and fetches to ``run_dir/timings.jsonl``, rank 0 of the trainers
its hand-offs and loads to ``run_dir/trainer_timings.jsonl``; ``python -m bench.sync`` reads
them for its phase breakdown, and an operator can read them after a slow round.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def record(path: Path, kind: str, **fields) -> None:
    line = json.dumps({"kind": kind, "wall": time.time(), **fields}) + "\n"
    with open(path, "a") as f:
        f.write(line)
