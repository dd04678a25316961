"""An ordinary training loop as a site: the loop-wrapping form of ``SiteSession``.

For people coming from torchft's ``local_sgd.DiLoCo(manager, model, inner_opt, sync_every=H)``:
wrap the model and its inner optimiser once, and keep the loop as it is::

    session = SiteSession()
    model = build(); fully_shard(...); opt = AdamW(model.parameters())
    with SiteLoop(session, model, opt) as loop:      # theta_0 is loaded into the model
        while not loop.done:
            batch = my_batch(loop.round, loop.step)  # which round, step, shard, unit
            loss = train_step(batch)                 # forward, backward
            loop.loss = loss.item()
            opt.step()           # every H-th step hands theta_r - theta_local to the agent
            opt.zero_grad()      # and loads theta_{r+1}; after the last round, the final theta
    session.report(val_loss=evaluate(model))
    session.close()

A hook after ``opt.step()`` drives ``session.rounds()`` and ``Round.steps()`` exactly as the
explicit form's ``for rnd in session.rounds(...): for step in rnd.steps():`` does, so the two
forms train the same model bit for bit. H is the job's (``rounds.inner_steps``, or the agent's
``--inner-steps``), not an argument: every site must agree on it. The mean of the ``loop.loss``
values of a round is reported as its ``train_loss``; ``on_round(rnd)`` (optional) runs when a
round starts, e.g. to evaluate theta_r.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from site_client.trainer.round import Round
from site_client.trainer.session import SiteSession, TrainerError


class SiteLoop:
    """Turns each ``optimizer.step()`` into one inner step of the site's current round.

    Attributes
    ----------
    round
        The task being trained (``Round``: ``number``, ``site_index``, ``num_sites``,
        ``data_unit_index``, ...); None once ``done``.
    step
        The inner step the next ``optimizer.step()`` completes.
    done
        The job is finished and the model holds the final theta: leave the loop.
    """

    def __init__(
        self,
        session: SiteSession,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        on_round: Callable[[Round], None] | None = None,
    ) -> None:
        self.session, self.model, self.optimizer = session, model, optimizer
        self.on_round = on_round
        self.round: Round | None = None
        self.step: int | None = None
        self.done = False
        self._losses: list[float] = []
        self._hook = None

    @property
    def loss(self) -> float:
        return self.round.loss if self.round is not None else float("nan")

    @loss.setter
    def loss(self, value: float) -> None:
        """The loss of the step being trained: progress, and this round's ``train_loss``."""
        if self.round is not None:
            self.round.loss = value
            self._losses.append(value)

    def __enter__(self) -> SiteLoop:
        self._rounds = self.session.rounds(self.model, self.optimizer)
        self._next_round()
        self._hook = self.optimizer.register_step_post_hook(lambda *_: self._stepped())
        return self

    def __exit__(self, *exc) -> None:
        if self._hook is not None:
            self._hook.remove()
        if not self.done:  # left early: nothing of the round in training is handed over
            self._rounds.close()

    def _stepped(self) -> None:
        if self.done:
            raise TrainerError("optimizer.step() after the job finished: leave when loop.done")
        try:
            self.step = next(self._steps)
        except StopIteration:
            self._end_round()
            self._next_round()

    def _end_round(self) -> None:
        if self._losses and not self.round.cancelled:
            self.round.report(train_loss=sum(self._losses) / len(self._losses))
        self._losses = []

    def _next_round(self) -> None:
        """On to the next task with a step to train (or to the end of the job)."""
        while True:
            try:
                self.round = next(self._rounds)  # hands the last update over, loads theta
            except StopIteration:
                self.round, self.step, self.done = None, None, True
                return
            if self.on_round is not None:
                self.on_round(self.round)
            self._steps = self.round.steps()
            try:
                self.step = next(self._steps)
                return
            except StopIteration:  # cancelled at once, or resumed at its very end
                self._end_round()
