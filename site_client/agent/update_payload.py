"""An update as the agent pushes it: the trainers' shard files, encoded, streamed in place.

Each trainer rank hands over its own file of update pieces (``site_client.trainer.shards``); the
agent
never assembles the whole tensors. It maps every file, drops a piece another rank already gave,
encodes each piece with the codec the job's ``[compression]`` rules pick for its tensor (the
error-feedback residual is kept per piece), and lays the pieces out one after another (64-byte
aligned, like ``wire.tensors.pack``). Raw pieces are sent straight from the mapped files; only
encoded bytes are new memory. The payload's digest is taken in the same pass that lays it out.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from site_client.trainer.shards import BOXES_KEY
from wire.codecs import CodecState, choose_codec
from wire.codecs.rules import CompressionConfig
from wire.digest import Hasher
from wire.safetensors_io import MappedTensors, map_tensors, tensor_bytes
from wire.tensors import ALIGN, Manifest, PayloadError, TensorEntry, dtype_name

_ZEROS = memoryview(bytes(ALIGN))


@dataclass
class UpdatePayload:
    """A payload held as segments (views of mapped files or encoded buffers) at offsets."""

    manifest: Manifest
    segments: list[tuple[int, memoryview]]
    keep: list[object]  # what the segments view (mapped files), kept alive
    # The digest of the payload and the zeros after it up to the next ALIGN boundary: its
    # digest as one part, not the last, of a multi-node site's payload (``agent.node_parts``).
    padded_digest: bytes = b""

    @property
    def total_bytes(self) -> int:
        return self.manifest.total_bytes

    def chunks(
        self, start: int, chunk_bytes: int, stop: int | None = None
    ) -> Iterator[tuple[int, memoryview]]:
        """``(offset, bytes)`` pieces of the payload from ``start`` (to ``stop``, default the
        end), each ``chunk_bytes`` long (the last one shorter); padding between segments is
        zeros."""
        total = self.total_bytes if stop is None else stop
        for offset in range(start, total, chunk_bytes):
            end = min(offset + chunk_bytes, total)
            yield offset, self._read(offset, end)

    def view(self, start: int, end: int) -> memoryview:
        """The payload bytes ``[start, end)``: a view where they lie in one segment."""
        return self._read(start, end)

    def _read(self, start: int, end: int) -> memoryview:
        parts, pos = [], start
        for seg_start, seg in self.segments:
            seg_end = seg_start + len(seg)
            if seg_end <= pos or seg_start >= end:
                continue
            if seg_start > pos:
                parts.append(_ZEROS[: seg_start - pos])
                pos = seg_start
            take = min(end, seg_end)
            parts.append(seg[pos - seg_start : take - seg_start])
            pos = take
        if pos < end:
            parts.append(memoryview(bytes(end - pos)))
        return parts[0] if len(parts) == 1 else memoryview(b"".join(parts))


@dataclass(frozen=True)
class _Piece:
    name: str
    tensor: torch.Tensor
    box_offset: tuple[int, ...]
    global_shape: tuple[int, ...]


def read_pieces(paths: list[Path]) -> tuple[list[_Piece], list[MappedTensors]]:
    """Every piece in the trainers' files, sorted by tensor and box, duplicates dropped."""
    pieces: dict[tuple[str, tuple[int, ...]], _Piece] = {}
    files = []
    for path in paths:
        f = map_tensors(path)
        files.append(f)
        try:
            boxes = json.loads(f.metadata.get(BOXES_KEY, "{}"))
        except ValueError as exc:
            raise PayloadError(f"{path}: unreadable piece boxes: {exc}") from None
        for name, t in f.tensors.items():
            box = boxes.get(name)
            offset = tuple(box["offset"]) if box else ()
            whole = tuple(box["shape"]) if box else ()
            pieces.setdefault((name, offset), _Piece(name, t, offset, whole))
    return [pieces[k] for k in sorted(pieces)], files


def piece_shapes(paths: list[Path]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every floating piece in the trainers' files: what an adaptive codec
    choice predicts the payload's size from (``wire.codecs.adaptive``)."""
    pieces, _ = read_pieces(paths)
    return [(p.name, tuple(p.tensor.shape)) for p in pieces if p.tensor.is_floating_point()]


def build_payload(
    paths: list[Path], compression: CompressionConfig | None, state: CodecState
) -> UpdatePayload:
    """Lay out (and encode) the pieces in ``paths``; residuals move in ``state``."""
    pieces, files = read_pieces(paths)
    entries, segments, offset = [], [], 0
    hasher = Hasher()
    for p in pieces:
        entry = TensorEntry(
            p.name,
            dtype_name(p.tensor.dtype),
            tuple(p.tensor.shape),
            offset,
            0,
            global_shape=p.global_shape,
            box_offset=p.box_offset,
        )
        codec = choose_codec(p.name, p.tensor, compression) if compression else None
        if codec is None or codec.name == "none":
            data = tensor_bytes(state.carry(entry.label, p.tensor))
        else:
            enc = state.encode(entry.label, p.tensor, codec)
            data, entry = enc.buffer(), replace(entry, codec=enc.codec, codec_meta=enc.meta)
        entry = replace(entry, nbytes=len(data))
        if entry.offset > _end(entries):
            hasher.update(_ZEROS[: entry.offset - _end(entries)])
        hasher.update(data)
        entries.append(entry)
        segments.append((offset, data))
        offset = -(-(offset + len(data)) // ALIGN) * ALIGN
    total = _end(entries)
    digest = hasher.digest()
    hasher.update(_ZEROS[: -total % ALIGN])
    manifest = Manifest(tuple(entries), total, digest)
    return UpdatePayload(manifest, segments, files, hasher.digest())


def placed(payload: UpdatePayload, offset: int, manifest: Manifest) -> UpdatePayload:
    """``payload`` as the part at ``offset`` of a larger payload described by ``manifest``."""
    segments = [(offset + start, seg) for start, seg in payload.segments]
    return UpdatePayload(manifest, segments, payload.keep, payload.padded_digest)


def payload_of(manifest: Manifest, payload: memoryview) -> UpdatePayload:
    """A payload already packed in one buffer (``wire.tensors.pack`` / ``pack_encoded``)."""
    return UpdatePayload(manifest, [(0, memoryview(payload).cast("B"))], [])


def _end(entries: list[TensorEntry]) -> int:
    return entries[-1].offset + entries[-1].nbytes if entries else 0


def residual_snapshot(state: CodecState) -> Mapping[str, torch.Tensor]:
    """A copy of the residuals, to put back if the update does not count."""
    return {k: v.clone() for k, v in state.state_dict().items()}
