"""The shared data stream of shared-data mode, cut into units ``u0, u1, ...``.

The coordinator hands out units, and any site may train any unit (a backup copy of a
straggler's included), so a unit must be the same data wherever it runs:

* the stream runs through the training tokens epoch after epoch, each epoch a fresh
  permutation of its ``seq_len + 1`` windows (a random phase, then every window once), drawn
  with a ``torch.Generator`` seeded from ``(seed, seq_len, epoch)``;
* unit ``k`` is the ``steps_per_unit * batch_size`` windows of the stream from position
  ``k * steps_per_unit * batch_size``, ``batch_size`` per inner step.

So the units of one epoch share no window, and together they read the whole training split.
"""

from __future__ import annotations

import hashlib

import torch


def _seed(*parts: object) -> int:
    digest = hashlib.sha256(",".join(map(str, ("units", *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class SharedStream:
    """Window offsets of the shared stream over ``n_tokens`` training tokens."""

    def __init__(self, n_tokens: int, seq_len: int, seed: int) -> None:
        self.window = seq_len + 1
        self.seq_len, self.seed = seq_len, seed
        # Fits whatever the epoch's phase (< window): phase + n * window <= n_tokens.
        self.per_epoch = (n_tokens - self.window + 1) // self.window
        if self.per_epoch < 1:
            raise ValueError(f"training split ({n_tokens} tokens) is shorter than a window")
        self._epochs: dict[int, tuple[int, torch.Tensor]] = {}

    def window_starts(
        self, unit_index: int, inner_step: int, steps_per_unit: int, batch_size: int
    ) -> torch.Tensor:
        """Token offsets of the ``batch_size`` windows of ``inner_step`` of unit ``unit_index``."""
        if unit_index < 0:
            raise ValueError(f"unit_index must be >= 0, got {unit_index}")
        if not 0 <= inner_step < steps_per_unit:
            raise ValueError(f"inner_step {inner_step} not in [0, {steps_per_unit})")
        first = (unit_index * steps_per_unit + inner_step) * batch_size
        positions = torch.arange(first, first + batch_size)
        epochs, slots = positions // self.per_epoch, positions % self.per_epoch
        starts = torch.empty(batch_size, dtype=torch.int64)
        for epoch in epochs.unique().tolist():
            phase, order = self._epoch(epoch)
            rows = epochs == epoch
            starts[rows] = phase + order[slots[rows]] * self.window
        return starts

    def _epoch(self, epoch: int) -> tuple[int, torch.Tensor]:
        """(phase, window permutation) of ``epoch``; the last two are kept, since a unit's
        steps read one or two epochs and a permutation costs O(windows) to draw."""
        if epoch not in self._epochs:
            gen = torch.Generator().manual_seed(_seed(self.seed, self.seq_len, epoch))
            phase = int(torch.randint(self.window, (1,), generator=gen))
            if len(self._epochs) >= 2:
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[epoch] = phase, torch.randperm(self.per_epoch, generator=gen)
        return self._epochs[epoch]
