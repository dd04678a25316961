"""One task of a site's trainers, as a training script sees it (see
``site_client.trainer.session``).

A task is an outer round on one data unit. ``Round.steps()`` yields the inner steps still to
run; after each it reports progress and learns whether the task was cancelled (another copy of
its unit was committed first), a decision every rank receives, so that all of them leave the
loop at the same step. What happens around each step (progress, fault injection, periodic site
checkpoints) is the session's, handed in as ``RoundHooks``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from site_client.agent.tasks import unit_index


@dataclass
class RoundSpec:
    """A task as the agent hands it out: train ``data_unit`` for ``round`` from theta_version."""

    round: int
    version: int
    inner_steps: int
    total_rounds: int
    finished: bool
    theta_path: str = ""
    theta_hash: str = ""
    data_unit: str = ""
    site_index: int = 0
    num_sites: int = 0


@dataclass(frozen=True)
class RoundHooks:
    """What a round calls back into its session.

    Attributes
    ----------
    cancel_requested
        Report progress at this step; whether to stop (agreed on by every rank).
    after_step
        Called once a step is done (fault injection for tests and drills).
    checkpoint
        Write a site checkpoint of this step (in the background).
    settle
        Wait for the checkpoint being written. Called after every step: a checkpoint overlaps
        the one inner step after it, so a crash loses at most that step; and before a task's
        first step: the checkpoint of the last task's end (which overlaps the WAN sync) holds
        no copy of the optimiser's state.
    checkpoint_every
        Inner steps between periodic checkpoints (0: only at the end of the task).
    report
        Send metrics to the agent.
    record
        Write a timing record (``site_client.timings``): a task's ``steps`` record, with the
        time spent inside the script's step bodies.
    before_step
        Called before each step is yielded; False stops the task there (streaming outer
        steps merge a fragment's late result here, see ``site_client.trainer.streaming_rounds``).
    """

    cancel_requested: Callable[[Round, int], bool]
    after_step: Callable[[Round, int], None]
    checkpoint: Callable[[Round, int], None]
    settle: Callable[[], None]
    checkpoint_every: int
    report: Callable[..., None]
    record: Callable[..., None] = lambda kind, **fields: None
    before_step: Callable[[Round, int], bool] | None = None


class Round:
    """One task (an outer round on one data unit) as a training script sees it.

    Attributes
    ----------
    number
        The outer round.
    data_unit, data_unit_index
        ``""`` and ``None`` in federated mode (train on the site's own data); ``"u<k>"`` and
        ``k`` in shared-data mode (train on unit ``k`` of the shared data stream).
    inner_steps, total_rounds
        H, and the job's number of rounds.
    site_index, num_sites
        This site's place among the round's participants (sorted by name) and how many
        there are: the shard of data that is this site's in this round.
    start_step, completed_steps
        Where this task (re)started, and the inner steps done so far.
    cancelled
        Another copy of the unit was committed first: ``steps()`` stopped early and the
        update will not be submitted.
    loss
        Set it each step: reported as progress.
    weight
        The update's weight (default: the inner steps of the round).
    compute_s, merge_wait_s
        Seconds spent inside the step bodies so far, and blocked waiting for a fragment's
        late result (streaming outer steps).
    """

    def __init__(self, spec: RoundSpec, start_step: int, hooks: RoundHooks) -> None:
        self.number = spec.round
        self.data_unit = spec.data_unit
        self.data_unit_index = unit_index(spec.data_unit)
        self.inner_steps = spec.inner_steps
        self.total_rounds = spec.total_rounds
        self.site_index = spec.site_index
        self.num_sites = spec.num_sites
        self.start_step = start_step
        self.completed_steps = start_step
        self.cancelled = False
        self.loss = float("nan")
        self.weight = float(spec.inner_steps)
        self.compute_s = 0.0
        self.merge_wait_s = 0.0
        self.merge_pending: bool | None = None  # streaming: the last fragment is not merged yet
        self._hooks = hooks

    def steps(self) -> Iterator[int]:
        """Inner step numbers still to run in this task; ends early if it is cancelled."""
        hooks = self._hooks
        if self.start_step < self.inner_steps and self._cancel_requested():
            return
        # The checkpoint of the last task's end reads the optimiser's own tensors (no copy):
        # it must be on disk before the first step changes them.
        hooks.settle()
        first_at = last_at = None
        try:
            for step in range(self.start_step, self.inner_steps):
                if hooks.before_step is not None and not hooks.before_step(self, step):
                    return
                started, at = time.monotonic(), time.time()
                first_at = at if first_at is None else first_at
                yield step
                self.compute_s += time.monotonic() - started
                last_at = time.time()
                if self._after(step):
                    return
        finally:
            if first_at is not None:
                hooks.record(
                    "steps",
                    round=self.number,
                    steps=self.completed_steps - self.start_step,
                    compute_s=round(self.compute_s, 6),
                    first_step_at=first_at,
                    last_step_at=last_at if last_at is not None else first_at,
                    merge_wait_s=round(self.merge_wait_s, 6),
                )

    def _after(self, step: int) -> bool:
        """Progress, checkpoints and faults after ``step``; whether the task stops here."""
        hooks = self._hooks
        self.completed_steps = step + 1
        cancel = self._cancel_requested()
        hooks.settle()
        hooks.after_step(self, self.completed_steps)
        if cancel:
            return True
        every = hooks.checkpoint_every
        done = self.completed_steps
        if every and done % every == 0 and done < self.inner_steps:
            hooks.checkpoint(self, done)
        return False

    def _cancel_requested(self) -> bool:
        self.cancelled = self._hooks.cancel_requested(self, self.completed_steps)
        return self.cancelled

    def report(self, **metrics: float) -> None:
        """Send metrics to the agent, tagged with this round (and unit, in shared mode)."""
        unit = {"data_unit": self.data_unit} if self.data_unit else {}
        self._hooks.report(round=self.number, **unit, **metrics)
