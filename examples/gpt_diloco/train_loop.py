"""The example GPT's trainer in the loop-wrapping form (``site_client.trainer.loop.SiteLoop``).

The same training as ``train.py``, written as one ordinary loop, the way a torchft
``local_sgd.DiLoCo(manager, model, inner_opt, sync_every=H)`` user writes it: every H-th
``optimizer.step()`` hands the pseudo-gradient to the agent and loads the next theta. It
takes the same flags and trains the same model, bit for bit::

    coordinator local --sites 2 --config examples/gpt_diloco/job.toml \\
        -- examples/gpt_diloco/train_loop.py
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file by the launcher: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.gpt_diloco.model import lm_loss
from examples.gpt_diloco.train import ValLoss, batch, finish, setup
from site_client.trainer.loop import SiteLoop


def main(argv=None) -> None:
    s = setup(argv)
    model, optimizer = s.model, s.optimizer
    with SiteLoop(s.session, model, optimizer, on_round=ValLoss(s)) as loop:
        while not loop.done:
            inputs, targets = batch(s, loop.round, loop.step)
            loss = lm_loss(model(inputs), targets)
            loss.backward()
            loop.loss = loss.item()
            optimizer.step()  # every H-th one syncs with the other sites
            optimizer.zero_grad(set_to_none=True)
    finish(s)


if __name__ == "__main__":
    main()
