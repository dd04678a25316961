"""What node 0's agent and every other node's agent do alike for a multi-node site's update.

``PartEncoder`` encodes a node's trainers' shard files as its part and keeps it until the
layout of the whole update is known (``site_client.agent.node_parts``); ``site_part`` then places it
in the site's payload. The lease travels between nodes as JSON (``lease_json``/``lease_of``).
"""

from __future__ import annotations

import threading
from pathlib import Path

from site_client.agent.node_parts import NodePart, site_layout
from site_client.agent.tasks import Task
from site_client.agent.update_payload import UpdatePayload, build_payload, placed
from site_client.transfer.node import SitePart
from wire.codecs import CodecState
from wire.codecs.rules import CompressionConfig
from wire.proto import isthmus_pb2 as pb
from wire.tensors import PayloadError


class PartEncoder:
    """Encodes node ``node``'s part of each task's update; holds it until it is placed."""

    def __init__(
        self, node: int, compression: CompressionConfig | None, codec_state: CodecState
    ) -> None:
        self.node, self.compression, self.codec_state = node, compression, codec_state
        self._encoded: dict[Task, UpdatePayload] = {}
        self._lock = threading.Lock()

    def encode(self, req: dict) -> dict:
        """``encode`` (``round``, ``data_unit``, ``paths``) -> ``{"part": NodePart JSON}``."""
        task = Task(int(req["round"]), str(req.get("data_unit", "")))
        paths = [Path(str(p)) for p in req["paths"]]
        payload = build_payload(paths, self.compression, self.codec_state)
        with self._lock:
            # A part of an earlier round never placed (a hand-off that failed half-way) goes.
            self._encoded = {t: p for t, p in self._encoded.items() if t.round >= task.round}
            self._encoded[task] = payload
        return {"part": NodePart.of(self.node, payload).to_json()}

    def take(self, task: Task) -> UpdatePayload:
        with self._lock:
            payload = self._encoded.pop(task, None)
        if payload is None:
            raise ValueError(f"round {task.round} {task.unit}: no part of it was encoded here")
        return payload


def site_part(payload: UpdatePayload, layout: list, node: int) -> tuple[UpdatePayload, SitePart]:
    """This node's encoded ``payload`` placed in the site's payload that ``layout`` (every
    node's ``NodePart`` JSON) describes; node 0 completes the update."""
    parts = [NodePart.from_json(p) for p in layout]
    manifest, ranges = site_layout(parts)
    mine = NodePart.of(node, payload)
    (given,) = [p for p in parts if p.node == node] or [None]
    if given is None or given.digest != mine.digest or given.length != mine.length:
        raise PayloadError(f"the site's layout does not hold node {node}'s part as encoded here")
    # Its range in the site's payload: its bytes and the padding up to the next part's start.
    offset, length = ranges[node]
    return placed(payload, offset, manifest), SitePart(offset, length, node == 0)


def lease_json(lease: pb.Lease) -> dict:
    return {
        "site": lease.site,
        "lease_id": lease.lease_id,
        "token": lease.token,
        "ttl_s": lease.ttl_s,
    }


def lease_of(value: dict) -> pb.Lease:
    return pb.Lease(
        site=str(value["site"]),
        lease_id=int(value["lease_id"]),
        token=int(value["token"]),
        ttl_s=float(value["ttl_s"]),
    )
