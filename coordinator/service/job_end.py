"""How a ``coordinator serve`` ends: the final model, the record of a completed job, exit codes.

A job is *complete* once its last round closed and the coordinator stopped on its own (every
site fetched the final model and left, or ``timeouts.final_fetch_s`` passed). It then writes
``complete.json`` into the state folder, and a later ``serve`` on that folder says so and exits
0 at once instead of waiting for sites that will not come back. A coordinator stopped by a
signal, or killed, after the last round but before that keeps serving the final model when
restarted: sites of the last round may still need it.

A signal stops the coordinator cleanly (the checkpoint being written is finished) and it exits
as shells expect of a process ended by that signal, 128 + its number (130 for SIGINT, 143 for
SIGTERM), saying how to resume.

With standby coordinators (``serve --ha``) the record also goes to the object store, before the
leader resigns: the coordinator elected next finds it there and exits 0 too, rather than
serving the final model again to sites that already left.
"""

from __future__ import annotations

import json
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

COMPLETE = "complete.json"


@dataclass(frozen=True)
class Completion:
    """The record a completed job leaves in its state folder."""

    job: str
    rounds: int
    model: str  # the final model file
    theta_digest: str


def completion_bytes(done: Completion) -> bytes:
    return json.dumps(asdict(done), indent=1).encode()


def parse_completion(data: bytes) -> Completion | None:
    """The record in ``data``, or None if it is not one (then the job is served)."""
    try:
        return Completion(**json.loads(data))
    except (ValueError, TypeError):
        return None


def write_completion(state_dir: Path, done: Completion) -> None:
    from coordinator.persist.local_store import write_atomic  # torch: not for `coordinator --help`

    write_atomic(Path(state_dir) / COMPLETE, completion_bytes(done))


def read_completion(state_dir: Path) -> Completion | None:
    """The completion record, or None (none written, or unreadable: then the job is served)."""
    try:
        return parse_completion((Path(state_dir) / COMPLETE).read_bytes())
    except OSError:
        return None


def already_complete(done: Completion | None, job: str, total_rounds: int) -> bool:
    """Whether ``serve`` has nothing to do: the job finished every round it is configured for.

    A larger ``rounds.total`` than the job finished with continues training from the last
    checkpoint, so it is not complete; another job's record is not this job's.
    """
    return done is not None and done.job == job and done.rounds >= total_rounds


def complete_message(done: Completion) -> str:
    return (
        f"job {done.job!r} is complete ({done.rounds} rounds); final model: {done.model} "
        f"(theta {done.theta_digest[:12]}). Raise rounds.total to train on."
    )


def signal_exit_code(signum: int) -> int:
    """The status of a process stopped by ``signum`` (shell convention): 130, 143, ..."""
    return 128 + int(signum)


def stopped_message(signum: int, round_number: int, total: int, state: Path, resume: str) -> str:
    """What a coordinator stopped by ``signum`` says: where it was, and how to go on."""
    name = signal.Signals(signum).name
    where = "after the last round"
    if round_number < total:
        where = f"in round {round_number} of {total}"
    return f"stopped by {name} {where}; the job's state is kept in {state}; resume with `{resume}`"
