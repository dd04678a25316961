"""Fetching theta: whole, or as the compressed delta from the version the site holds.

A part of ``CoordinatorClient`` (it uses the client's stub, lease, retry plumbing and byte
counters). The payload comes through the transfer engine (``site_client.transfer.engine``): its
first header (``movers.first_header``) names the version, the delta base, theta's state digest
and the manifest with the payload's size (and a delta's payload digest); then its pieces follow over
``[transfer] streams`` K streams, each landing at its offset in the sink. With K = 1 the
payload is one piece, and its call is the one that brought the header; with K > 1 the header
comes from a fetch of the payload's first byte, and the payload is cut into pieces of whole
chunks (``wire.transfer.plan_pieces``). A delta's payload digest is taken once over its
bytes, as they land in order where they do (``HashingSink``), and checked before it is applied.

The delta is applied with ``wire.downlink.apply_delta``, the same function the coordinator used
to make its official theta, and the result is checked against the coordinator's hash; a
mismatch falls back to a whole fetch and names the tensors that differed.

With ``dest`` theta is written straight into a safetensors file there (the stream lands in the
mapped file, a delta is applied into it), which the trainers then map: no copy of theta beyond
that file. Whole or rebuilt, theta is then checked by its state digest
(``wire.digest.state_digest``, one BLAKE3 per tensor, side by side): the one digest a whole
theta carries, so neither the coordinator nor the site takes a second.

When the version being fetched is no longer served (its round closed meanwhile) and the caller
asked for whatever is current, or a restarted coordinator made the version again with another
payload, the fetch starts over (at most ``MAX_RESTARTS`` times); a version the caller asked for
by number is refused with ``NOT_FOUND``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from site_client.errors import CoordinatorError
from site_client.transfer.endpoints import coordinator_endpoint
from site_client.transfer.engine import Tally, Transfer
from site_client.transfer.movers import FetchMover, FirstHeader, PayloadChanged, first_header
from site_client.transfer.plan import routed
from site_client.transfer.progress import TransferProgress
from wire.chunking import BufferSink
from wire.digest import Hasher, payload_digest, state_digest
from wire.downlink import apply_delta, differing
from wire.proto import isthmus_pb2 as pb
from wire.safetensors_io import MappedTensors, create_mapped
from wire.tensors import Manifest, PayloadError, unpack
from wire.transfer import Piece, plan_pieces

log = logging.getLogger("isthmus.site")
# How often one fetch starts over because the version it fetched was replaced meanwhile.
MAX_RESTARTS = 5


@dataclass
class GlobalState:
    version: int
    theta: dict[str, torch.Tensor]
    theta_hash: bytes
    path: Path | None = None  # the safetensors file ``theta`` is mapped from, if any
    file: MappedTensors | None = None


class MappedSink:
    """Writes a payload's pieces, each at its offset, into a new mapped file's data section."""

    def __init__(self, file: MappedTensors) -> None:
        self.file = file
        self.view = file.payload()

    def write_at(self, offset: int, data) -> None:
        self.view[offset : offset + len(data)] = data

    def payload_view(self) -> memoryview:
        return self.view


class HashingSink:
    """A sink that takes the payload's digest from the bytes as they land in order (one
    pass, while they are hot); bytes landing past the hashed ones are hashed from the sink
    at the end. A byte written again below them (two streams racing the end of a piece) may
    differ from what was hashed: then the whole payload is hashed again from the sink."""

    def __init__(self, inner, digest: bytes) -> None:
        self.inner, self.digest = inner, digest
        self._hasher = Hasher()
        self._hashed = 0
        self._rewritten = False
        self._lock = threading.Lock()

    def write_at(self, offset: int, data) -> None:
        self.inner.write_at(offset, data)
        with self._lock:
            if offset == self._hashed:
                self._hasher.update(data)
                self._hashed += len(data)
            elif offset < self._hashed:
                self._rewritten = True

    def check(self) -> None:
        """Raise unless the payload in the sink has the manifest's digest."""
        view = self.inner.payload_view()
        if self._rewritten:
            digest = payload_digest(view)
        else:
            rest = self._hasher.copy()
            rest.update(view[self._hashed :])
            digest = rest.digest()
        if digest != self.digest:
            raise CoordinatorError(
                grpc.StatusCode.DATA_LOSS,
                "fetch: bad payload from coordinator: payload digest mismatch once every piece "
                "was in (the streams' bytes do not make up the payload the manifest describes)",
            )


def _sink_for(manifest: Manifest, delta: bool, dest: Path | None):
    """Where a payload goes: the theta file itself for a whole theta laid out back to back (as
    the coordinator serves it), else memory."""
    if dest is None or delta:
        return BufferSink(manifest.total_bytes)
    try:
        # Every byte is written (and checked by theta's digest), so a file already at ``dest``
        # (``site_client.agent.theta_spare``) is written over in place.
        return MappedSink(create_mapped(dest, manifest, reuse=True))
    except PayloadError:  # not a safetensors layout: keep it in memory
        return BufferSink(manifest.total_bytes)


def fetch_label(header: pb.FetchHeader) -> str:
    delta = f" (delta from v{header.from_version})" if header.HasField("from_version") else ""
    return f"fetch theta v{header.version}{delta}"


class ThetaFetcher:
    def __init__(
        self, client, new_progress: Callable[[], TransferProgress] = TransferProgress
    ) -> None:
        self.client = client
        self.delta_mismatches = 0
        self.new_progress = new_progress
        self.opened_ahead = 0  # pieces whose call was made before the one before them ended
        # A sharded job: the coordinator serves its part of theta, checked once assembled.
        self.sharded = False
        # A sharded job's: the lead's pass for each recent version fetched (``FetchHeader``).
        self.shard_passes: dict[int, bytes] = {}

    def fetch(
        self, version: int | None = None, held: GlobalState | None = None, dest: Path | None = None
    ) -> GlobalState:
        """Download theta (the current version, or ``version``), resuming after breaks."""
        if held is not None and version is not None and held.version == version:
            return held
        from_version = held.version if held is not None else None
        manifest, sink, header = self.fetch_payload(version, from_version, dest)
        try:
            if header.HasField("from_version"):
                if held is None or header.from_version != held.version:
                    raise PayloadError(f"a delta from version {header.from_version} came back")
                state = self._rebuild(held, manifest, sink.buffer, header, dest)
            else:
                return self._whole(manifest, sink, header, dest)
        except PayloadError as exc:
            raise CoordinatorError(None, f"fetch: bad payload from coordinator: {exc}") from exc
        if state_digest(state.theta) == header.theta_hash:
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
            state = GlobalState(header.version, file.tensors, header.theta_hash, dest, file)
        else:
            theta = unpack(manifest, sink.buffer)
            state = GlobalState(header.version, theta, header.theta_hash)
        if not self.sharded and state_digest(state.theta) != header.theta_hash:
            raise CoordinatorError(
                grpc.StatusCode.DATA_LOSS,
                "fetch: bad payload from coordinator: theta does not match its state digest",
            )
        return state

    def _rebuild(self, held: GlobalState, manifest, payload, header, dest) -> GlobalState:
        if dest is None or held.file is None:
            theta = apply_delta(held.theta, manifest, payload)
            return GlobalState(header.version, theta, header.theta_hash)
        file = create_mapped(dest, held.file.manifest, reuse=True)
        apply_delta(held.theta, manifest, payload, out=file.tensors)
        return GlobalState(header.version, file.tensors, header.theta_hash, dest, file)

    def fetch_payload(self, version: int | None, from_version: int | None, dest: Path | None):
        """``(manifest, sink, header)`` of the payload, checked; started over while the
        version it fetched is replaced under it (``MAX_RESTARTS`` at most)."""
        progress = self.new_progress()
        complete = False
        try:
            for attempt in range(MAX_RESTARTS):
                try:
                    got = self._fetch_once(version, from_version, dest, progress)
                    complete = True
                    return got
                except CoordinatorError as exc:
                    gone = exc.code == grpc.StatusCode.NOT_FOUND and version is None
                    if not (gone or isinstance(exc, PayloadChanged)):
                        raise
                    if attempt == MAX_RESTARTS - 1:
                        raise CoordinatorError(
                            exc.code,
                            f"{exc} (the version served changed {MAX_RESTARTS} times during "
                            "one fetch)",
                        ) from exc
                    log.info("fetch: the payload fetched is gone (%s); fetching anew", exc)
        finally:
            progress.finish(complete)

    def note_pass(self, version: int, shard_pass: bytes) -> None:
        """Keep the lead's shard pass of ``version`` (the four newest)."""
        self.shard_passes[version] = bytes(shard_pass)
        for old in sorted(self.shard_passes)[:-4]:
            del self.shard_passes[old]

    def _fetch_once(self, version, from_version, dest, progress: TransferProgress):
        """The first header, then every piece of the payload it heads, into a new sink."""
        c = self.client
        streams = c.transfer.streams

        def ask() -> FirstHeader:
            # Built at each attempt: a retry after a re-join carries the new lease.
            req = pb.FetchRequest(lease=c.lease, offset=0)
            if version is not None:
                req.version = version
            if from_version is not None:
                req.from_version = from_version
            if streams > 1:
                req.length = 1  # a probe: the header, and the first byte, which its piece brings
            return first_header(c, req, drain=streams > 1)

        first = c.call("fetch", ask)
        header = first.header
        if header.shard_pass:
            self.note_pass(header.version, header.shard_pass)
        manifest = Manifest.from_proto(header.manifest)
        delta = header.HasField("from_version")
        if delta and not manifest.digest:
            raise CoordinatorError(
                grpc.StatusCode.DATA_LOSS,
                "fetch: bad payload from coordinator: a delta without its payload digest",
            )
        inner = _sink_for(manifest, delta, dest)
        # A delta's payload is checked as it lands; a whole theta by its state digest after.
        sink = HashingSink(inner, manifest.digest) if delta else inner
        progress.start(fetch_label(header), manifest.total_bytes, 0)
        total = manifest.total_bytes
        pieces = [Piece(0, total)] if streams == 1 else plan_pieces(total, c.chunk_bytes, streams)
        transfer = Transfer(
            c, FetchMover(c, header, sink), Tally(c, progress, sent=False), streams, first.rtt_s
        )
        try:
            transfer.run(
                routed(pieces if total else [], coordinator_endpoint(c, streams)),
                first_call=first.frames if streams == 1 else None,
            )
        finally:
            self.opened_ahead += transfer.opened_ahead
            if streams == 1:
                first.frames.cancel()  # ended already, unless an error left it open
        if delta:
            sink.check()
        return manifest, inner, header
