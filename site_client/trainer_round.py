"""One task of a site's trainers, as a training script sees it (see ``site_client.trainer``).

A task is an outer round on one data unit. ``Round.steps()`` yields the inner steps still to
run; after each it reports progress to the agent and learns whether the task was cancelled
(another copy of its unit was committed first), a flag rank 0 broadcasts so that every rank
leaves the loop at the same step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from site_client.faults import fault_at, inject
from site_client.tasks import unit_index

if TYPE_CHECKING:
    from site_client.trainer import SiteSession


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
    start_step, completed_steps
        Where this task (re)started, and the inner steps done so far.
    cancelled
        Another copy of the unit was committed first: ``steps()`` stopped early and the
        update will not be submitted.
    loss
        Set it each step: reported as progress.
    weight
        The update's weight (default: the inner steps of the round).
    """

    def __init__(self, session: SiteSession, spec: RoundSpec, start_step: int, ckpt) -> None:
        self.session = session
        self.number = spec.round
        self.data_unit = spec.data_unit
        self.data_unit_index = unit_index(spec.data_unit)
        self.inner_steps = spec.inner_steps
        self.total_rounds = spec.total_rounds
        self.start_step = start_step
        self.completed_steps = start_step
        self.cancelled = False
        self.loss = float("nan")
        self.weight = float(spec.inner_steps)
        self._ckpt = ckpt

    def steps(self) -> Iterator[int]:
        """Inner step numbers still to run in this task; ends early if it is cancelled."""
        if self.start_step < self.inner_steps and self._cancel_requested():
            return
        for step in range(self.start_step, self.inner_steps):
            yield step
            self.completed_steps = step + 1
            cancel = self._cancel_requested()
            s = self.session
            here = (s.site, self.number, self.completed_steps, s.rank, s.restart_count)
            inject(fault_at(s.faults, *here), s.faults_fired)
            if cancel:
                return
            every = s.checkpoint_every
            if (
                every
                and self.completed_steps % every == 0
                and self.completed_steps < self.inner_steps
            ):
                self._ckpt(self, self.completed_steps)

    def _cancel_requested(self) -> bool:
        """Report progress; whether the agent says stop, agreed on by every rank."""
        cancel = self.session._progress(self, self.completed_steps)
        # Rank 0 alone hears the agent; every rank must leave the loop at the same step, or
        # the ones that go on would wait forever in their next collective.
        flag = torch.tensor([1 if cancel else 0], dtype=torch.int64)
        dist.broadcast(flag, src=0)
        self.cancelled = bool(flag.item())
        return self.cancelled

    def report(self, **metrics: float) -> None:
        """Send metrics to the agent, tagged with this round (and unit, in shared mode)."""
        unit = {"data_unit": self.data_unit} if self.data_unit else {}
        self.session.report(round=self.number, **unit, **metrics)
