"""Streaming outer steps at a site: train on while a fragment's update travels, merge it late.

Round r of a streaming job (``[streaming]``, ``wire.fragments``) syncs fragment ``r % P`` and
lasts H/P inner steps. At the end of round r the trainers hand over that fragment's
pseudo-gradient and go straight on with round r+1, which the agent has not heard of yet (its
number, length and this site's place in it are known). Before step tau of round r+1 they wait
for theta_{r+1}, usually there by then, and merge fragment ``r % P`` of it into the model:
``local <- alpha * local + (1 - alpha) * global``. The other fragments train on unmerged. Time
blocked at a merge is measured: ``merge_wait_s`` in the task's ``steps`` timing record, and
reported to the agent when it is more than a millisecond. With ``merge = "when_ready"`` they do
not wait at tau: each step from tau on asks the agent (without waiting) whether theta_{r+1} is
there, and the merge happens before the first step at which it is; only the task's last step
waits for it (the next hand-over needs the merged model's task). The ``merge`` timing record
says at which step it happened.

What a task starts from is a pure function of (round, step, config) and the site's newest
checkpoint:

* a task that continues this site's own work (the round after the one whose end it
  checkpointed, or the same task resumed mid-way) keeps the model and merges at step tau,
  unless the checkpoint says that merge was already done;
* anything else (the first task, a site that rejoined or fell behind): theta_r is loaded whole
  at step 0 and nothing is merged in that round.

No periodic checkpoint is written while a merge is pending (the steps before tau of a task that
continues from the last): until that merge, the newest checkpoint is the end of the round whose
fragment is in flight. A site restarted whole while that round is still open is handed it
again, and only that checkpoint can hand over the same update again (theta_r - its model at
the round's end); resumed from a later one, the task would start over from theta_r and train
another model. A crash before the merge so costs at most tau steps, trained again the same way.

The last round's end waits for the final theta, as blocking DiLoCo does. If the task the agent
hands out at a merge is not the one the trainers went on with (the job moved past it while this
site was slow, or ended), the steps trained ahead are dropped and the trainers start that task
from its theta; one whose agent already has a task of a later round when it hands a task over
(asked without waiting) starts that one at once rather than train ahead. With ``fragments = 1,
delay_steps = 0, merge_alpha = 0`` this is blocking DiLoCo bit for bit: the merge before step
0 of round r+1 copies theta_{r+1} exactly.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from site_client.errors import TrainerError
from site_client.trainer.round import Round, RoundSpec
from site_client.trainer.shards import local_pieces, merge_pieces
from wire.fragments import FragmentPlan, StreamingConfig, fragment_plan
from wire.safetensors_io import MappedTensors, map_tensors

PROGRESS_S = 0.25  # how often rank 0 tells the agent its step


class StreamingRounds:
    """``SiteSession.rounds`` for a streaming job (see the module docstring)."""

    def __init__(self, session, cfg: StreamingConfig) -> None:
        self.s, self.cfg = session, cfg
        self.model: torch.nn.Module | None = None
        self.plan: FragmentPlan | None = None
        self.theta: MappedTensors | None = None
        self.pieces: list = []
        self._superseded: RoundSpec | None = None
        self._reported = float("-inf")

    def run(self, model: torch.nn.Module, optimizer) -> Iterator[Round]:
        s = self.s
        extra = s._resume_extra(model, optimizer)
        spec = s._wait_round()
        self.model = model
        self._use(spec)
        if spec.finished:
            return self._finish(spec)
        start, pending = self._start(extra, spec)
        # A checkpoint is not awaited after each step, as the blocking loop does: the task's
        # end is written while the next round trains ahead (the update counts only once it is
        # on disk, and the next save waits for it), rather than blocking its first step.
        hooks = s._hooks(
            model,
            optimizer,
            before_step=self._before_step,
            settle=_no_wait,
            cancel_requested=self._progress,
        )
        hooks = dataclasses.replace(hooks, checkpoint=_unless_merge_pending(hooks.checkpoint))
        while True:
            rnd = Round(spec, start, hooks)
            rnd.merge_pending = pending
            yield rnd
            if self._superseded is not None or rnd.cancelled:
                nxt = self._superseded or s._wait_round()
                self._superseded = None
            elif self._hand_over(model, optimizer, rnd, spec, start):
                nxt = self._moved_past(spec.round + 1)
                if nxt is None:
                    spec, start, pending = _ahead(spec), 0, True
                    continue
            else:
                nxt = s._wait_round()
            if nxt.finished:
                return self._finish(nxt)
            spec, start, pending = nxt, 0, False
            self._use(spec)
            s._load(self.pieces, self.theta, spec)

    # ---- pieces ---------------------------------------------------------------------------

    def _hand_over(self, model, optimizer, rnd: Round, spec: RoundSpec, start: int) -> bool:
        """Submit the round's fragment; whether the trainers go on ahead to the next round."""
        s = self.s
        if rnd.completed_steps < spec.inner_steps:
            raise TrainerError(
                f"round {spec.round}: the loop over rnd.steps() stopped after "
                f"{rnd.completed_steps} of {spec.inner_steps} steps"
            )
        done = start >= spec.inner_steps  # resumed at the task's end: already checkpointed
        names = frozenset(self.plan.names(spec.round))
        s._submit(self.pieces, self.theta, spec, rnd, durable=done, names=names)
        if not done:
            s._checkpoint(model, optimizer, rnd, spec.inner_steps, task_end=True)
        return spec.round + 1 < spec.total_rounds

    def _moved_past(self, ahead: int) -> RoundSpec | None:
        """The agent's task, asked without waiting as a task is handed over, if the job has
        moved past round ``ahead`` (the one the trainers would go on with): a site that fell
        behind starts the newest task at once from its theta, rather than train tau steps
        ahead only to drop them at the merge. None: go on ahead."""
        nxt = self.s._poll_round()
        return nxt if nxt is not None and (nxt.finished or nxt.round > ahead) else None

    def _start(self, extra: dict | None, spec: RoundSpec) -> tuple[int, bool]:
        """(first step, merge pending) of the first task after (re)starting."""
        if extra is not None:
            r, step = int(extra["round"]), int(extra["step"])
            if r == spec.round and step > 0:  # the model holds this very task's checkpoint
                default = int(r > 0 and step <= self.cfg.delay_steps)
                return step, bool(extra.get("merge_pending", default))
            if r == spec.round - 1 and step >= spec.inner_steps:  # the end of the one before
                return 0, True
        self.s._load(self.pieces, self.theta, spec)
        return 0, False

    def _progress(self, rnd: Round, step: int) -> bool:
        """Progress for the agent at most every ``PROGRESS_S``, and no collective: nothing
        cancels a streaming task (federated data), so the ranks need not agree each step."""
        now = time.monotonic()
        if self.s.ipc is not None and (now - self._reported >= PROGRESS_S or step == 0):
            self.s._progress(rnd, step)
            self._reported = now
        return False

    def _before_step(self, rnd: Round, step: int) -> bool:
        """From step tau of a continuing task: merge the last fragment's result, waiting for
        it at tau (``merge = "blocking"``) or, with ``"when_ready"``, at the first step it is
        there, waiting only before the task's last step."""
        if not rnd.merge_pending or step < self.cfg.delay_steps:
            return True
        s = self.s
        wait = self.cfg.merge == "blocking" or step >= rnd.inner_steps - 1
        started = time.monotonic()
        nxt = s._wait_round() if wait else s._poll_round()
        if nxt is None:  # not here yet: train this step on the fragment as it is
            return True
        waited = time.monotonic() - started if wait else 0.0
        rnd.merge_wait_s += waited
        if nxt.finished or (nxt.round, nxt.data_unit) != (rnd.number, rnd.data_unit):
            self._superseded = nxt
            rnd.cancelled = True  # nothing of it is submitted or reported
            return False
        self._use(nxt)
        self._merge(frozenset(self.plan.names(rnd.number - 1)), nxt, step)
        rnd.merge_pending = False
        if waited > 1e-3:
            rnd.report(merge_wait_s=waited)
        return True

    def _merge(self, names: frozenset[str], spec: RoundSpec, step: int) -> None:
        started = time.monotonic()
        self.s._all_exact(
            merge_pieces(self.pieces, self.theta, names, self.cfg.merge_alpha),
            f"theta_{spec.version}: merging its fragment into the model failed",
        )
        self.s._timing(
            "merge", started, round=spec.round, step=step, version=spec.version, tensors=len(names)
        )

    def _use(self, spec: RoundSpec) -> None:
        """Map ``spec``'s theta; the fragment plan comes from the first one's tensors."""
        self.theta = map_tensors(Path(spec.theta_path))
        self.pieces = local_pieces(self.model, self.s.rank)
        if self.plan is None:
            shapes = {
                n: tuple(t.shape) for n, t in self.theta.tensors.items() if t.is_floating_point()
            }
            self.plan = fragment_plan(shapes, self.cfg)

    def _finish(self, spec: RoundSpec) -> None:
        self._use(spec)
        self.s._load(self.pieces, self.theta, spec)
        self.s.final = spec


def _unless_merge_pending(checkpoint):
    """The periodic checkpoint hook, skipped while ``rnd.merge_pending`` (module docstring)."""

    def hook(rnd: Round, step: int) -> None:
        if not rnd.merge_pending:
            checkpoint(rnd, step)

    return hook


def _ahead(spec: RoundSpec) -> RoundSpec:
    """The next round as the trainers start it, before the agent has heard of it."""
    return dataclasses.replace(spec, round=spec.round + 1, version=-1, theta_path="", theta_hash="")


def _no_wait() -> None:
    return None
