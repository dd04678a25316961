"""Every benchmark under ``bench/`` starts: ``python -m bench.NAME --help`` imports all it
needs and prints its usage (a broken import or help string is otherwise found only by the
person who runs it, minutes in)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Child programs the benchmarks start themselves, with positional arguments of their own.
CHILDREN = {"netns", "sync_floor", "sync_trainer", "wan_relay"}


def entry_points() -> list[str]:
    """Modules of ``bench`` that a person runs as ``python -m``: a file with a ``__main__``
    guard, or a package with a ``__main__.py``, less the benchmarks' own child programs."""
    found = []
    for path in sorted((ROOT / "bench").iterdir()):
        if path.suffix == ".py" and 'if __name__ == "__main__"' in path.read_text():
            found.append(path.stem)
        elif (path / "__main__.py").is_file():
            found.append(path.name)
    return [name for name in found if name not in CHILDREN]


def test_the_benchmarks_are_found():
    assert {"sync", "dataplane", "fold", "scale", "comm_efficiency"} <= set(entry_points())


@pytest.mark.parametrize("name", entry_points())
def test_a_benchmark_prints_its_usage(name):
    result = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "usage:" in result.stdout, result.stdout[-2000:]
