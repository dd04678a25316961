"""The round's weighted sum, folded while updates arrive, in an order fixed by the round.

Floating-point addition is not associative, so a sum taken in arrival order would differ from
run to run. The order here is a list of *slots* fixed when the round opens (the participants by
name in federated mode, the data units by index in shared-data mode), extended at the end for
sites admitted late, then a tail of late updates folded in from the round before (by label).
Each update is decoded into the accumulator as soon as every slot before it is filled; the rest
(after a slot that never filled, say) at close, skipping the empty slots. theta_{r+1} therefore
depends only on the set of updates; the close record keeps the order actually used, so a
replay after a crash sums the same updates in the same order, bit for bit.

Fold lanes (``round.fold_lanes``) fold different tensors side by side, each in that order;
offering an update never blocks the caller. Memory: the accumulator (one float32 model,
allocated at the first fold) plus one chunk of scratch per lane.
Updates are read back from the spool with ``readinto`` rather than mapped, so their pages stay
out of the process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from coordinator.intake.spool import SpooledUpdate, read_entry, read_into
from coordinator.records import UpdateKey
from coordinator.round.fold_lanes import FoldLanes, Lane
from coordinator.round.spare_buffer import SpareBuffer
from wire.codecs import CodecError, decode_into
from wire.tensors import PayloadError, entry_tensor
from wire.theta import ThetaBuffer

_local = threading.local()


@dataclass(frozen=True)
class Folded:
    """The mean of a round's updates, and what went into it."""

    mean: dict[str, torch.Tensor]
    total_weight: float
    weights: dict[UpdateKey, float]
    order: tuple[UpdateKey, ...]


FOLD_CHUNK = 1 << 20  # elements; a multiple of every vector width, so chunking is exact


def fold_into(
    acc: Mapping[str, torch.Tensor],
    update: SpooledUpdate,
    alpha: float,
    names: Collection[str] | None = None,
) -> None:
    """``acc += alpha * update``, tensor by tensor (a piece into its box); only the tensors
    ``names`` (None: all). A raw float32 tensor is read and added a chunk at a time
    (elementwise, so the same bits), so folding holds 4 MiB of scratch (per thread) rather than
    a tensor's worth."""
    for e in update.manifest.entries:
        if names is not None and e.name not in names:
            continue
        target = acc[e.name][e.box()] if e.is_piece else acc[e.name]
        direct = e.dtype == "float32" and target.is_contiguous()
        if direct and e.codec == "none":
            _fold_raw(target.view(-1), update, e, alpha)
        elif direct:
            # Decoded straight into the sum, block by block: the same multiply and add per
            # element as decoding whole and adding, without a tensor's worth of new memory.
            try:
                decode_into(
                    target,
                    read_entry(update.path, e),
                    e.codec_meta,
                    alpha,
                    codec=e.codec,
                    name=e.label,
                )
            except CodecError as exc:
                raise PayloadError(str(exc)) from exc
        else:
            delta = entry_tensor(e, read_entry(update.path, e))
            target.add_(delta.to(torch.float32), alpha=alpha)


def _fold_raw(flat: torch.Tensor, update: SpooledUpdate, e, alpha: float) -> None:
    scratch = _chunk_scratch()
    for start in range(0, flat.numel(), FOLD_CHUNK):
        part = flat[start : start + FOLD_CHUNK]
        raw = scratch[: part.numel() * 4]
        read_into(update.path, e.offset + start * 4, raw)
        part.add_(raw.view(torch.float32), alpha=alpha)


def _chunk_scratch() -> torch.Tensor:
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = torch.empty(FOLD_CHUNK * 4, dtype=torch.uint8)
    return buf


def fold_order(slots: Sequence[str], filled: Mapping[str, UpdateKey], tail) -> list[UpdateKey]:
    """Filled slots in slot order, then the tail by label."""
    return [filled[s] for s in slots if s in filled] + sorted(tail, key=lambda k: k.label)


def start_sum(
    theta: ThetaBuffer,
    trainable: Sequence[str],
    worker: ThreadPoolExecutor,
    slots: Sequence[str],
    spare: SpareBuffer | None = None,
    lanes: FoldLanes | None = None,
) -> StreamingMean:
    """A zero sum for a round that opens, allocated when the first update is folded (not while
    theta_r may still be in memory, on its way to its file: the allocation runs on ``worker``,
    after the file's job). When every trainable tensor is float32 the sum lives in a buffer
    laid out like theta, so that theta_{r+1} can be written over it in place: the ``spare``
    buffer, when the last one is free, else new memory. Only theta's layout is kept, never its
    tensors. With ``lanes`` the tensors are folded side by side (``round.fold_lanes``)."""
    manifest = replace(theta.manifest, digest=b"")
    names = list(trainable)
    if all(theta.tensors[n].dtype == torch.float32 for n in names):
        spare = spare or SpareBuffer()

        def zeros():
            buffer = ThetaBuffer.on(manifest, spare.zeros(manifest.total_bytes))
            return {n: buffer.tensors[n] for n in names}, buffer

    else:
        shapes = {n: theta.tensors[n].shape for n in names}

        def zeros():
            return {n: torch.zeros(shape, dtype=torch.float32) for n, shape in shapes.items()}, None

    split = None
    if lanes is not None:
        split = lanes.split({n: theta.tensors[n].numel() * 4 for n in names})
    running = StreamingMean(zeros, worker, split)
    running.expect(slots)
    return running


class StreamingMean:
    """Folds one round's updates (see the module docstring); ``finish`` returns the mean.

    ``lanes``: the threads that fold, each over its own tensors (None: ``worker`` folds every
    tensor). Each lane keeps its own place in the fold order.
    """

    def __init__(
        self,
        like: Mapping[str, torch.Tensor] | Callable[[], tuple[dict, ThetaBuffer | None]],
        worker: ThreadPoolExecutor,
        lanes: Sequence[Lane] | None = None,
    ) -> None:
        # The zero float32 targets (e.g. views into the next theta's buffer), or what makes
        # them when they are first needed (on ``worker``).
        self._zeros = like if callable(like) else (lambda: (dict(like), None))
        self._like: dict[str, torch.Tensor] | None = None
        self._buffer: ThetaBuffer | None = None
        self._ready: Future | None = None
        self._worker = worker
        self._lanes = list(lanes) if lanes else [Lane(worker, frozenset())]
        self._whole = not lanes  # one lane over every tensor
        self._lock = threading.Lock()
        self._slots: list[str] = []
        self._filled: dict[str, UpdateKey] = {}
        self._updates: dict[UpdateKey, tuple[SpooledUpdate, float]] = {}
        self._tail: set[UpdateKey] = set()
        self._done: list[list[UpdateKey]] = [[] for _ in self._lanes]
        self._next = [0] * len(self._lanes)  # per lane: slots before it are folded (or skipped)
        self._error: BaseException | None = None

    def expect(self, slots: Sequence[str]) -> None:
        """Slots in fold order; a later call may only add slots at the end."""
        with self._lock:
            if list(slots[: len(self._slots)]) != self._slots:
                raise ValueError("slots of an open round can only be added at the end")
            self._slots = list(slots)

    def offer(self, slot: str | None, key: UpdateKey, update: SpooledUpdate, alpha: float) -> None:
        """A counted update for ``slot`` (None: the tail); it is folded when its turn comes."""
        with self._lock:
            self._updates[key] = (update, alpha)
            if slot is None:
                self._tail.add(key)
            else:
                self._filled[slot] = key
            if self._ready is None:
                self._ready = self._worker.submit(self._targets)
        for i, lane in enumerate(self._lanes):
            lane.worker.submit(self._fold_ready, i)

    @property
    def buffer(self) -> ThetaBuffer | None:
        """The buffer the mean lives in (theta's layout), once ``finish`` returned."""
        return self._buffer

    def _targets(self) -> dict[str, torch.Tensor]:
        if self._like is None:
            self._like, self._buffer = self._zeros()
        return self._like

    def order(self) -> list[UpdateKey]:
        """The fold order of everything offered so far."""
        with self._lock:
            return fold_order(self._slots, self._filled, self._tail)

    def finish(self, keys: Sequence[UpdateKey]) -> Future:
        """Fold ``keys`` (a fold order: the round's close record) and divide by their weight;
        the future's result is a ``Folded``."""
        return self._worker.submit(self._finish, list(keys))

    # ---- the lanes' threads ---------------------------------------------------------------

    def _fold_ready(self, lane: int) -> None:
        while self._error is None:
            with self._lock:
                at = self._next[lane]
                if at >= len(self._slots) or self._slots[at] not in self._filled:
                    return
                key = self._filled[self._slots[at]]
                self._next[lane] += 1
            self._fold(lane, key)

    def _fold(self, lane: int, key: UpdateKey) -> None:
        update, alpha = self._updates[key]
        try:
            self._ready.result()  # the targets exist (made on the worker, in its turn)
            names = None if self._whole else self._lanes[lane].names
            fold_into(self._targets(), update, alpha, names)
        except BaseException as exc:  # a spool file that no longer decodes: the close fails
            self._error = exc
            return
        self._done[lane].append(key)

    def _finish_lane(self, lane: int, keys: list[UpdateKey]) -> None:
        done = self._done[lane]
        if done != keys[: len(done)]:
            raise RuntimeError(f"folded {done}, but the round closes with {keys}")
        for key in keys[len(done) :]:
            if key not in self._updates:
                raise RuntimeError(f"update {key.label} was never offered")
            self._fold(lane, key)
            if self._error is not None:
                raise self._error

    def _finish(self, keys: list[UpdateKey]) -> Folded:
        if self._ready is None:
            self._targets()
            self._ready = Future()
            self._ready.set_result(None)
        inline = [i for i, lane in enumerate(self._lanes) if lane.worker is self._worker]
        side = [
            lane.worker.submit(self._finish_lane, i, keys)
            for i, lane in enumerate(self._lanes)
            if i not in inline
        ]
        for i in inline:
            self._finish_lane(i, keys)
        for f in side:
            f.result()
        if self._error is not None:
            raise self._error
        weights = {k: self._updates[k][0].weight for k in keys}
        total = sum(weights.values())
        if total <= 0:
            raise ValueError("no update weight to average")
        like = self._targets()
        for t in like.values():
            t.div_(total)
        return Folded(dict(like), total, weights, tuple(keys))
