"""The final model of a sharded job in one file, without holding it in the lead's memory.

The lead's tensors are copied from its checkpoint's theta file by the kernel; every other
shard's tensors stream from that shard (``Shard.Fetch`` of the checkpoint's version) straight
to their offsets in the file, each hashed as it passes and checked against the record the
checkpoint keeps of it (``shard_tensors``). The lead holds a chunk at a time, whatever the
model's size: a model-sized buffer here would undo what the shards are for.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from coordinator.shards.part_store import TensorRecord
from wire.chunking import tensor_pieces
from wire.digest import Hasher
from wire.proto import isthmus_pb2 as pb
from wire.safetensors_io import header_bytes, layout_of, read_header
from wire.tensors import Manifest, PayloadError

FETCH_TIMEOUT_S = 3600.0


class PartMismatch(ValueError):
    """A shard served tensors that are not those the checkpoint records."""


def layout(own: Manifest, others: Sequence[TensorRecord]) -> Manifest:
    """Every tensor back to back in canonical order (``wire.safetensors_io.layout_of``)."""
    specs = [(e.name, e.dtype, tuple(e.shape)) for e in own.entries]
    return layout_of(specs + [(r.name, r.dtype, tuple(r.shape)) for r in others])


def write_model(
    path: Path, theta_file: Path, others: Sequence[TensorRecord], stubs, version: int, metadata
) -> None:
    """Write theta_``version`` whole to ``path`` (see the module docstring); ``stubs``: the
    other shards' ``ShardStub`` s. Raises ``PartMismatch`` when a shard's tensors are not the
    recorded ones."""
    own, own_start, _ = read_header(theta_file)
    whole = layout(own, others)
    head = header_bytes(whole, metadata)
    at = {e.name: len(head) + e.offset for e in whole.entries}
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + whole.total_bytes)
        _copy_own(f, theta_file, own, own_start, at)
        expected = {r.name: r.digest for r in others}
        for stub in stubs:
            _stream_part(f, stub, version, at, expected)
        if expected:
            raise PartMismatch(f"no shard served tensor {sorted(expected)[0]!r}")
        f.flush()
        os.fsync(f.fileno())


def _copy_own(f, theta_file: Path, own: Manifest, start: int, at: dict[str, int]) -> None:
    with open(theta_file, "rb") as src:
        for e in own.entries:
            done = 0
            while done < e.nbytes:
                sent = os.copy_file_range(
                    src.fileno(), f.fileno(), e.nbytes - done, start + e.offset + done,
                    at[e.name] + done,
                )  # fmt: skip
                if sent == 0:
                    raise PayloadError(f"{theta_file}: {e.name} is cut short")
                done += sent


def _stream_part(f, stub, version: int, at: dict[str, int], expected: dict[str, bytes]) -> None:
    """One shard's part, each chunk written where its tensors go, each tensor hashed."""
    request = pb.FetchRequest(lease=pb.Lease(site="lead"), version=version)
    entries, hashers = [], {}
    for msg in stub.Fetch(request, timeout=FETCH_TIMEOUT_S):
        if msg.HasField("header"):
            entries = sorted(
                Manifest.from_proto(msg.header.manifest).entries, key=lambda e: e.offset
            )
            hashers = {e.name: Hasher() for e in entries}
            continue
        for e, inside, piece in tensor_pieces(entries, msg.chunk.offset, msg.chunk.data):
            os.pwrite(f.fileno(), piece, at[e.name] + inside)
            hashers[e.name].update(piece)
    for name, h in hashers.items():
        if expected.pop(name, None) != h.digest():
            raise PartMismatch(f"tensor {name!r} is not theta_{version}'s as recorded")
