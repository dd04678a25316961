"""Fetching theta: whole, or as the compressed delta from the version the site holds.

A part of ``CoordinatorClient`` (it uses the client's stub, lease, retry plumbing and byte
counters). The delta is applied with ``wire.downlink.apply_delta``, the same function the
coordinator used to make its official theta, and the result is checked against the
coordinator's hash; a mismatch falls back to a whole fetch and names the tensors that differed.

With ``dest`` theta is written straight into a safetensors file there (the stream lands in the
mapped file, a delta is applied into it), which the trainers then map: no copy of theta beyond
that file. A whole theta whose payload SHA-256 verifies is the coordinator's, byte for byte, so
its state hash is not computed again; a rebuilt one is always hashed.

Every byte received is reported to a new ``TransferProgress`` per fetch (a bar on a terminal, a
log line now and then elsewhere, for a long fetch only); ``new_progress`` makes it.

With ``[transfer] streams`` K > 1 the payload comes over K streams at once
(``site_client.transfer.parallel_fetch``) into the same sinks, written at each piece's offset; what
is done with it then is the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from site_client.errors import CoordinatorError
from site_client.transfer.parallel_fetch import ParallelFetch, fetch_label
from site_client.transfer.progress import TransferProgress
from wire.bulk import parse_chunk
from wire.chunking import BufferSink, ChunkError, Reassembler
from wire.downlink import apply_delta, differing
from wire.proto import isthmus_pb2 as pb
from wire.safetensors_io import MappedTensors, create_mapped
from wire.tensors import Manifest, PayloadError, state_hash, unpack

log = logging.getLogger("isthmus.site")


@dataclass
class GlobalState:
    version: int
    theta: dict[str, torch.Tensor]
    theta_hash: bytes
    path: Path | None = None  # the safetensors file ``theta`` is mapped from, if any
    file: MappedTensors | None = None


class MappedSink:
    """Writes a stream into a new mapped file's data section: in order (``write``), or each
    piece at its offset (``write_at``, a parallel fetch)."""

    def __init__(self, file: MappedTensors) -> None:
        self.file = file
        self.view = file.payload()
        self.pos = 0

    def write(self, data) -> int:
        n = len(data)
        self.view[self.pos : self.pos + n] = data
        self.pos += n
        return n

    def write_at(self, offset: int, data) -> None:
        self.view[offset : offset + len(data)] = data

    def payload_view(self) -> memoryview:
        return self.view


def _sink_for(manifest: Manifest, delta: bool, dest: Path | None):
    """Where a payload goes: the theta file itself for a whole theta laid out back to back (as
    the coordinator serves it), else memory."""
    if dest is None or delta:
        return BufferSink(manifest.total_bytes)
    try:
        return MappedSink(create_mapped(dest, manifest))
    except PayloadError:  # not a safetensors layout: keep it in memory
        return BufferSink(manifest.total_bytes)


class ThetaFetcher:
    def __init__(
        self, client, new_progress: Callable[[], TransferProgress] = TransferProgress
    ) -> None:
        self.client = client
        self.delta_mismatches = 0
        self.new_progress = new_progress

    def fetch(
        self, version: int | None = None, held: GlobalState | None = None, dest: Path | None = None
    ) -> GlobalState:
        """Download theta (the current version, or ``version``), resuming after breaks."""
        if held is not None and version is not None and held.version == version:
            return held
        manifest, sink, header = self._fetch_payload(version, held, dest)
        try:
            if header.HasField("from_version"):
                if held is None or header.from_version != held.version:
                    raise PayloadError(f"a delta from version {header.from_version} came back")
                state = self._rebuild(held, manifest, sink.buffer, header, dest)
            else:
                return self._whole(manifest, sink, header, dest)
        except PayloadError as exc:
            raise CoordinatorError(None, f"fetch: bad payload from coordinator: {exc}") from exc
        if state_hash(state.theta) == header.theta_hash:
            return state
        if dest is not None:
            dest.unlink(missing_ok=True)  # keep the rebuilt copy readable beside the new one
        whole = self.fetch(header.version, dest=dest)
        log.error(
            "theta_%d rebuilt from the delta does not match the coordinator's hash; fetched it "
            "whole. Tensors that differed: %s",
            header.version,
            ", ".join(differing(state.theta, whole.theta)) or "(none: only the hash)",
        )
        self.delta_mismatches += 1
        return whole

    def _whole(self, manifest: Manifest, sink, header, dest: Path | None) -> GlobalState:
        if isinstance(sink, MappedSink):
            # No msync: the trainers map the same file, so they see its pages as written; it
            # lives in this agent's scratch folder and is never read after a restart.
            file = sink.file
            return GlobalState(header.version, file.tensors, header.theta_hash, dest, file)
        theta = unpack(manifest, sink.buffer)
        state = GlobalState(header.version, theta, header.theta_hash)
        if state_hash(theta) != header.theta_hash:
            raise CoordinatorError(None, "fetch: theta does not match the coordinator's hash")
        return state

    def _rebuild(self, held: GlobalState, manifest, payload, header, dest) -> GlobalState:
        if dest is None or held.file is None:
            theta = apply_delta(held.theta, manifest, payload)
            return GlobalState(header.version, theta, header.theta_hash)
        file = create_mapped(dest, held.file.manifest)
        apply_delta(held.theta, manifest, payload, out=file.tensors)
        return GlobalState(header.version, file.tensors, header.theta_hash, dest, file)

    def _fetch_payload(self, version: int | None, held: GlobalState | None, dest: Path | None):
        """``(manifest, sink, header)`` of the payload, over one stream or ``[transfer]
        streams`` of them."""
        from_version = held.version if held is not None else None
        if self.client.transfer.streams == 1:
            return self._fetch_single(version, from_version, dest)
        return ParallelFetch(
            self.client,
            version,
            from_version,
            self.new_progress(),
            lambda manifest, delta: _sink_for(manifest, delta, dest),
        ).run()

    def _fetch_single(self, version: int | None, from_version: int | None, dest: Path | None):
        c = self.client
        st: dict = {"manifest": None, "sink": None, "asm": None, "header": None}
        progress = self.new_progress()

        def attempt():
            asm = st["asm"]
            offset = asm.received if asm is not None else 0
            req = pb.FetchRequest(lease=c.lease, offset=offset)
            if from_version is not None:
                req.from_version = from_version
            if version is not None:
                req.version = version
            elif st["header"] is not None:
                req.version = st["header"].version  # continue the version we started
            try:
                receive(c.bulk.Fetch(req, timeout=c.transfer_timeout_s), offset)
            except grpc.RpcError as exc:
                pinned = version is None and st["header"] is not None
                if exc.code() != grpc.StatusCode.NOT_FOUND or not pinned:
                    raise
                # The version being resumed is no longer served (its round closed meanwhile):
                # start over on the current one.
                gone = st["header"].version
                st.update(manifest=None, sink=None, asm=None, header=None)
                raise ChunkError(f"version {gone} is gone; fetching anew") from exc
            st["asm"].finish()

        def receive(frames, offset: int) -> None:
            header = pb.FetchHeader.FromString(next(frames))  # then raw chunks (wire.bulk)
            manifest = Manifest.from_proto(header.manifest)
            if st["manifest"] is None or st["manifest"].sha256 != manifest.sha256:
                sink = _sink_for(manifest, header.HasField("from_version"), dest)
                st.update(
                    manifest=manifest,
                    sink=sink,
                    header=header,
                    asm=Reassembler(manifest.total_bytes, manifest.sha256, sink),
                )
                if offset:
                    raise ChunkError("the coordinator moved to a new payload; restarting")
            # A resumed stream starts at what arrived before the break, not at 0.
            progress.start(fetch_label(header), manifest.total_bytes, offset)
            for frame in frames:
                chunk_offset, data = parse_chunk(frame)
                st["asm"].add(chunk_offset, data)
                c.bytes_received += len(data)
                progress.advance(len(data))

        complete = False
        try:
            c.call("fetch", attempt)
            complete = True
        except ChunkError as exc:
            raise CoordinatorError(None, f"fetch: bad payload from coordinator: {exc}") from exc
        finally:
            progress.finish(complete)
        return st["manifest"], st["sink"], st["header"]
