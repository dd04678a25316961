"""NaN/Inf in an update's raw tensors, caught while its chunks arrive.

The bytes of a chunk are in cache as it is written to the spool, so checking its raw floating
values then costs a pass at memory speed and saves reading the whole update back once it is
complete. What cannot be checked on the way (an element split across two chunks, bytes received
before a coordinator restart, bfloat16, which numpy lacks) is left for the final check
(``coordinator.intake.receiver.screen``), which reads those entries back. Encoded tensors are always
checked there, by their codec.
"""

from __future__ import annotations

import numpy as np

from wire.tensors import Manifest

_NUMPY = {"float32": np.float32, "float16": np.float16, "float64": np.float64}


class ArrivalScreen:
    def __init__(self, manifest: Manifest, resumed_at: int = 0) -> None:
        self.entries = [
            (i, e) for i, e in enumerate(manifest.entries) if e.codec == "none" and e.nbytes
        ]
        self.late = {i for i, e in self.entries if e.dtype not in _NUMPY or e.offset < resumed_at}
        self.bad: str | None = None  # the first entry found holding NaN or Inf

    def add(self, offset: int, data) -> None:
        """Check the raw values of an accepted chunk that starts at ``offset``."""
        end = offset + len(data)
        for i, e in self.entries:
            if i in self.late or e.offset >= end or e.end <= offset:
                continue
            dtype = _NUMPY[e.dtype]
            size = np.dtype(dtype).itemsize
            start, stop = max(e.offset, offset), min(e.end, end)
            if (start - e.offset) % size or (stop - start) % size:
                self.late.add(i)  # an element split between chunks: checked at the end
                continue
            values = np.frombuffer(
                data, dtype=dtype, count=(stop - start) // size, offset=start - offset
            )
            if values.size and not (np.isfinite(values.min()) and np.isfinite(values.max())):
                self.bad = self.bad or e.label

    def unchecked(self) -> set[int]:
        """Indices of raw entries the final check must still read."""
        return set(self.late)
