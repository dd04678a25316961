"""Fetching theta: whole, or as the compressed delta from the version the site holds.

A mixin of ``CoordinatorClient`` (it uses the client's stub, lease, retry plumbing and byte
counters). The delta is applied with ``wire.downlink.apply_delta``, the same function the
coordinator used to make its official theta, and the result is checked against the
coordinator's hash; a mismatch falls back to a whole fetch and names the tensors that differed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
import torch

from site_client.errors import CoordinatorError
from wire.chunking import BufferSink, ChunkError, Reassembler
from wire.downlink import apply_delta, differing
from wire.proto import isthmus_pb2 as pb
from wire.tensors import Manifest, PayloadError, state_hash, unpack

log = logging.getLogger("isthmus.site")


@dataclass
class GlobalState:
    version: int
    theta: dict[str, torch.Tensor]
    theta_hash: bytes


class ThetaDownlink:
    def fetch(self, version: int | None = None, held: GlobalState | None = None) -> GlobalState:
        """Download theta (the current version, or ``version``), resuming after breaks.

        With ``held`` (the theta this site holds) the coordinator may send the compressed delta
        from it instead of the whole state; the result is checked against the coordinator's
        hash, and a mismatch falls back to a whole fetch, logging the tensors that differed.
        """
        if held is not None and version is not None and held.version == version:
            return held
        got = self._fetch_payload(version, held.version if held is not None else None)
        manifest, payload, header = got
        try:
            if header.HasField("from_version"):
                if held is None or header.from_version != held.version:
                    raise PayloadError(f"a delta from version {header.from_version} came back")
                theta = apply_delta(held.theta, manifest, payload)
            else:
                theta = unpack(manifest, payload)
        except PayloadError as exc:
            raise CoordinatorError(None, f"fetch: bad payload from coordinator: {exc}") from exc
        state = GlobalState(header.version, theta, header.theta_hash)
        if state_hash(theta) == header.theta_hash:
            return state
        if not header.HasField("from_version"):
            raise CoordinatorError(None, "fetch: theta does not match the coordinator's hash")
        whole = self.fetch(header.version)
        log.error(
            "theta_%d rebuilt from the delta does not match the coordinator's hash; fetched it "
            "whole. Tensors that differed: %s",
            header.version,
            ", ".join(differing(theta, whole.theta)) or "(none: only the hash)",
        )
        self.delta_mismatches += 1
        return whole

    def _fetch_payload(self, version: int | None, from_version: int | None):
        state: dict = {"manifest": None, "sink": None, "asm": None, "header": None}

        def attempt():
            asm = state["asm"]
            offset = asm.received if asm is not None else 0
            req = pb.FetchRequest(lease=self.lease, offset=offset)
            if from_version is not None:
                req.from_version = from_version
            if version is not None:
                req.version = version
            elif state["header"] is not None:
                req.version = state["header"].version  # continue the version we started
            try:
                receive(self.stub.Fetch(req, timeout=self.transfer_timeout_s), offset)
            except grpc.RpcError as exc:
                pinned = version is None and state["header"] is not None
                if exc.code() != grpc.StatusCode.NOT_FOUND or not pinned:
                    raise
                # The version being resumed is no longer served (its round closed meanwhile):
                # start over on the current one.
                gone = state["header"].version
                state.update(manifest=None, sink=None, asm=None, header=None)
                raise ChunkError(f"version {gone} is gone; fetching anew") from exc
            state["asm"].finish()

        def receive(stream, offset: int) -> None:
            for msg in stream:
                if msg.HasField("header"):
                    manifest = Manifest.from_proto(msg.header.manifest)
                    if state["manifest"] is None or state["manifest"].sha256 != manifest.sha256:
                        sink = BufferSink(manifest.total_bytes)
                        state.update(
                            manifest=manifest,
                            sink=sink,
                            header=msg.header,
                            asm=Reassembler(manifest.total_bytes, manifest.sha256, sink),
                        )
                        if offset:
                            raise ChunkError("the coordinator moved to a new payload; restarting")
                    continue
                state["asm"].add(msg.chunk.offset, msg.chunk.data)
                self.bytes_received += len(msg.chunk.data)

        try:
            self._call("fetch", attempt)
        except ChunkError as exc:
            raise CoordinatorError(None, f"fetch: bad payload from coordinator: {exc}") from exc
        return state["manifest"], state["sink"].buffer, state["header"]
