"""A multi-node site's update as parts: what each node says of its own, and the whole layout.

Each node's agent encodes only its own trainers' shards (``site_client.agent.update_payload``) and
describes the result as a ``NodePart``: its entries (offsets inside the part), its length and
its digests. The trainers pass the descriptions between nodes over their own process group, so
every node's agent ends with the same list, and ``site_layout`` turns it into the one manifest
all of them push under: the parts in node order, each at an ``ALIGN`` boundary, each hashed on
its own (``wire.payload_parts``). JSON crosses the trainers' channel, never pickle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from site_client.agent.update_payload import UpdatePayload
from wire.payload_parts import PayloadPart, lay_out, parts_digest
from wire.tensors import (
    ALIGN,
    Manifest,
    PayloadError,
    TensorEntry,
    entries_from_json,
    entries_to_json,
    validate_manifest,
)


@dataclass(frozen=True)
class NodePart:
    """Node ``node``'s share of the site's update, laid out from byte 0.

    ``digest`` covers its ``length`` bytes; ``padded_digest`` those and the zeros up to the
    next ``ALIGN`` boundary (its digest as any part but the last).
    """

    node: int
    entries: tuple[TensorEntry, ...]
    length: int
    digest: bytes
    padded_digest: bytes

    @classmethod
    def of(cls, node: int, payload: UpdatePayload) -> NodePart:
        m = payload.manifest
        return cls(node, m.entries, m.total_bytes, m.digest, payload.padded_digest)

    def to_json(self) -> dict:
        return {
            "node": self.node,
            "entries": entries_to_json(self.entries),
            "length": self.length,
            "digest": self.digest.hex(),
            "padded_digest": self.padded_digest.hex(),
        }

    @classmethod
    def from_json(cls, value: dict) -> NodePart:
        """Read back; ``PayloadError`` naming what is wrong."""
        try:
            return cls(
                int(value["node"]),
                entries_from_json(value["entries"]),
                int(value["length"]),
                bytes.fromhex(value["digest"]),
                bytes.fromhex(value["padded_digest"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PayloadError(f"a node's part description is malformed: {exc!r}") from None


def site_layout(parts: Sequence[NodePart]) -> tuple[Manifest, list[tuple[int, int]]]:
    """The site's manifest over ``parts`` (one per node, nodes 0..N-1), and each node's range
    ``(offset, length)`` of the payload (its bytes and the padding after them); a node with
    nothing to hand over has an empty range and no part. ``PayloadError`` if the parts do not
    make one valid payload."""
    ordered = sorted(parts, key=lambda p: p.node)
    if [p.node for p in ordered] != list(range(len(ordered))):
        raise PayloadError(f"parts of nodes {[p.node for p in ordered]}, not one per node 0..N-1")
    filled = [p for p in ordered if p.length]
    starts = dict(
        zip((p.node for p in filled), lay_out([p.length for p in filled], ALIGN), strict=True)
    )
    entries: list[TensorEntry] = []
    spans: list[PayloadPart] = []
    for i, part in enumerate(filled):
        start = starts[part.node]
        last = i == len(filled) - 1
        length = part.length if last else starts[filled[i + 1].node] - start
        spans.append(PayloadPart(start, length, part.digest if last else part.padded_digest))
        entries += [replace(e, offset=e.offset + start) for e in part.entries]
    total = spans[-1].end if spans else 0
    manifest = Manifest(tuple(entries), total, parts_digest(spans), tuple(spans))
    validate_manifest(manifest)
    by_start = {p.offset: (p.offset, p.length) for p in spans}
    ranges = [by_start[starts[p.node]] if p.node in starts else (total, 0) for p in ordered]
    return manifest, ranges
