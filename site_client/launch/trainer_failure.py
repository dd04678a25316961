"""Why the trainers failed, in one block: the rank, its exit, the exception and where it was
raised, and the last lines of that rank's stderr.

torch's launcher ends a failed site with a ``ChildFailedError`` whose text is a banner of
``=`` signs unless the script used torch's ``@record``; the cause is in the rank's stderr, which
the agent has the launcher copy into ``<log dir>/<run id>_<suffix>/attempt_<k>/<local
rank>/stderr.log`` while still showing it. A trainer that exits 2
made a usage error (argparse's exit status): running it again would fail the same way, so it
is not restarted (``restartable``).
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path

USAGE_EXIT = 2
TAIL_LINES = 12
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)')
# torch prefixes what a distributed rank prints as it dies ("[rank0]: Traceback ...").
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b.*")


@dataclass(frozen=True)
class TrainerFailure:
    """One failed trainer process, as the launcher reported it."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    stderr_path: Path | None
    stderr_tail: tuple[str, ...] = ()


@dataclass(frozen=True)
class RootCause:
    """What the stderr tail says: the exception line and the innermost frame, if any."""

    summary: str  # "ValueError: boom", or the last line (argparse's "error: ...")
    where: str | None = None  # "train.py:42"


def restartable(exitcodes: list[int]) -> bool:
    """Whether a failed worker group is worth starting again: not after a usage error."""
    return USAGE_EXIT not in exitcodes


def root_cause(lines: tuple[str, ...]) -> RootCause:
    """The last traceback's exception and innermost frame; else the last non-empty line."""
    lines = tuple(_RANK_PREFIX.sub("", line).rstrip() for line in lines)
    lines = tuple(line for line in lines if line.strip())
    if not lines:
        return RootCause("(nothing on stderr)")
    start = max((i for i, x in enumerate(lines) if x.startswith("Traceback")), default=None)
    if start is None:
        return RootCause(lines[-1])
    where, summary = None, lines[-1]
    for line in lines[start:]:
        frame = _FRAME.match(line)
        if frame:
            where = f"{frame['file']}:{frame['line']}"
        elif not line.startswith((" ", "Traceback")) and _EXCEPTION.match(line):
            summary = line
    return RootCause(summary, where)


def exit_text(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    note = " (a usage error: not restarted)" if exitcode == USAGE_EXIT else ""
    return f"exited with {exitcode}{note}"


def headline(f: TrainerFailure) -> str:
    """One line: which rank, how it ended, and why."""
    cause = root_cause(f.stderr_tail)
    where = f" at {cause.where}" if cause.where else ""
    return f"rank {f.rank} {exit_text(f.exitcode)}: {cause.summary}{where}"


def block(site: str, first: TrainerFailure, others: list[TrainerFailure], attempts: int) -> str:
    """The whole report: the headline, the other ranks, then the first one's stderr tail."""
    lines = [f"siteclient: error: trainers of site {site} failed: {headline(first)}"]
    tried = f"after {attempts} attempt(s)" if attempts else ""
    lines.append(
        f"  rank {first.rank} (local rank {first.local_rank}, pid {first.pid}) "
        f"{exit_text(first.exitcode)} {tried}".rstrip()
    )
    lines += [f"  rank {f.rank} {exit_text(f.exitcode)} too" for f in others]
    if first.stderr_tail:
        lines.append(f"  last lines of rank {first.rank}'s stderr ({first.stderr_path}):")
        lines += [f"    | {line}" for line in first.stderr_tail]
    return "\n".join(lines)


def read_tail(path: Path, n: int = TAIL_LINES) -> tuple[str, ...]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ()
    return tuple(text.splitlines()[-n:])


def last_attempt(log_dir: Path, run_id: str) -> tuple[Path | None, int]:
    """The folder of the launcher's last attempt for ``run_id`` and how many there were."""
    runs = sorted(Path(log_dir).glob(f"{run_id}_*"), key=lambda p: p.stat().st_mtime)
    if not runs:
        return None, 0
    attempts = [p for p in runs[-1].glob("attempt_*") if p.name[8:].isdigit()]
    if not attempts:
        return None, 0
    return max(attempts, key=lambda p: int(p.name[8:])), len(attempts)


def failures_of(exc, attempt: Path | None) -> list[TrainerFailure]:
    """The failures a ``ChildFailedError`` holds, the first to fail first, with the stderr
    each left in the ``attempt`` folder."""
    first_rank, _ = exc.get_first_failure()
    out = []
    for rank, pf in sorted(exc.failures.items(), key=lambda kv: (kv[0] != first_rank, kv[0])):
        stderr = attempt / str(pf.local_rank) / "stderr.log" if attempt is not None else None
        tail = read_tail(stderr) if stderr is not None else ()
        out.append(TrainerFailure(rank, pf.local_rank, pf.pid, pf.exitcode, stderr, tail))
    return out
