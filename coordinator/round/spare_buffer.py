"""The running sum's memory, kept from round to round instead of freed and taken anew.

Each round's sum is a model-sized buffer (``coordinator.round.accumulate``) that becomes
theta_{r+1} and is let go once theta_{r+1}'s file serves it (``persist.theta_writer``). A
buffer taken anew for the next sum is zeroed by page faults, page by page: measured here
0.4-1 CPU s per GB (the high end where the host had taken the freed memory back), against
0.03 for ``zero_`` on pages still resident. So the let-go buffer is kept as the spare, and
the next sum zeroes it in place.

The spare is only reused when nothing else still sees its memory: at the next round's first
fold no tensor, array or view but the spare's own may hold its storage (the check counts the
storage's holders). Otherwise it is dropped (freed once its last holder goes) and the sum
takes new memory, as before: whatever holds it (a strategy's hook keeping a tensor of
theta_{r+1}, say) never sees it change. Peak memory is unchanged: the spare is the memory the
next sum takes anyway.
"""

from __future__ import annotations

import threading

import torch


def holders(buffer: torch.Tensor) -> int:
    """How many tensors (views, arrays over it included) hold ``buffer``'s storage; None of
    this torch's counters: a large number, so nothing is reused."""
    count = getattr(torch._C, "_storage_Use_Count", None)  # private, stable since torch 1.x
    if count is None:
        return 1 << 30
    return count(buffer.untyped_storage()._cdata) - 1  # less the storage object just made


class SpareBuffer:
    """At most one uint8 buffer kept for the next round's sum."""

    def __init__(self) -> None:
        self._spare: torch.Tensor | None = None
        self._lock = threading.Lock()
        self.reused = 0  # how many sums took the spare (for tests and logs)

    @property
    def held(self) -> torch.Tensor | None:
        """The buffer kept for the next sum, if any."""
        return self._spare

    def keep(self, buffer: torch.Tensor) -> None:
        """``buffer`` (a uint8 tensor owning its storage) is let go: keep it for later."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.storage_offset():
            return
        with self._lock:
            self._spare = buffer

    def zeros(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` zero bytes: the spare zeroed in place when it fits and nothing else
        holds it, else new memory."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare.numel() == nbytes and holders(spare) == 1:
            self.reused += 1
            return spare.zero_()
        del spare  # freed here unless something else still holds it
        return torch.zeros(nbytes, dtype=torch.uint8)
