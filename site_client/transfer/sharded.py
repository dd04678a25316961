"""A site's side of a coordinator split over shards (``JoinReply.shards``).

An update is cut by the shard map into one payload per shard (``split_payload``: views of the
update's own bytes, laid out again, each with its digest). The parts for shards 1..K-1 go
first, each on its own stream to its shard, side by side (``ShardRoutes.push_parts``); each
shard answers with a receipt, which the site carries, with the parts' digests, in the header
of its part for the coordinator (shard 0), pushed last through the transfer engine as any
update. theta comes down the same way: the coordinator's part through the engine, the other
parts from their shards side by side, all into one file (or one buffer) laid out as theta,
which is checked against theta's state digest as a whole (``ShardRoutes._assemble``). Every
call to a shard carries the lead's pass for the site and version (``ShardRoutes.pass_for``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc
import torch

from site_client.agent.update_payload import UpdatePayload
from site_client.errors import CoordinatorError
from site_client.transfer.movers import first_header
from site_client.transfer.theta import MAX_RESTARTS, GlobalState
from wire.bulk import BulkStub, chunk_frame, parse_chunk
from wire.chunking import tensor_pieces
from wire.digest import Hasher, dtype_name, state_digest
from wire.proto import isthmus_pb2 as pb
from wire.safetensors_io import MappedTensors, create_mapped, layout_of
from wire.tensors import ALIGN, Manifest, PayloadError, unpack

log = logging.getLogger("isthmus.site")
_ZEROS = bytes(ALIGN)


def split_payload(payload: UpdatePayload, owner: Mapping[str, int], k: int) -> list[UpdatePayload]:
    """``payload`` as one payload per shard: each holds its shard's tensors, 64-byte aligned
    from 0 as ``wire.tensors.pack`` lays them out, viewing the update's bytes (no copy)."""
    if payload.manifest.parts:
        raise PayloadError("a multi-node site's update cannot go to coordinator shards yet")
    per: list[list] = [[] for _ in range(k)]
    for e in payload.manifest.entries:
        shard = owner.get(e.name)
        if shard is None or not 0 <= shard < k:
            raise PayloadError(f"tensor {e.name!r} has no shard in the coordinator's shard map")
        per[shard].append(e)
    out = []
    for entries in per:
        laid, segments, hasher, offset = [], [], Hasher(), 0
        for j, e in enumerate(entries):
            data = payload.view(e.offset, e.offset + e.nbytes)
            laid.append(replace(e, offset=offset))
            segments.append((offset, data))
            hasher.update(data)
            end = offset + e.nbytes
            if j + 1 < len(entries):  # the zeros up to the next tensor are payload bytes too
                offset = -(-end // ALIGN) * ALIGN
                hasher.update(_ZEROS[: offset - end])
            else:
                offset = end
        manifest = Manifest(tuple(laid), offset, hasher.digest())
        out.append(UpdatePayload(manifest, segments, payload.keep))
    return out


class ShardRoutes:
    """The site's streams to shards 1..K-1 and what it sends and fetches over them."""

    def __init__(self, client, shard_map: pb.ShardMap, open_channel) -> None:
        self.client = client
        self.addresses = list(shard_map.addresses)
        self.owner = dict(shard_map.owner)
        self.k = len(self.addresses)
        # Raw frames (``wire.bulk``): each shard serves the coordinator's bulk methods.
        self._stubs = {i: BulkStub(open_channel(self.addresses[i])) for i in range(1, self.k)}
        self._pool = ThreadPoolExecutor(max_workers=max(1, self.k - 1), thread_name_prefix="shard")

    def push(
        self, round_number: int, payload: UpdatePayload, upload_id: str, weight: float, part=None
    ) -> tuple[UpdatePayload, list[bytes], list[bytes]]:
        """Cut ``payload`` by the shard map and push parts 1..K-1; the coordinator's part,
        and every part's digest and shard's receipt for the coordinator's header."""
        if part is not None:
            raise CoordinatorError(None, "a multi-node site cannot push to coordinator shards yet")
        try:
            parts = split_payload(payload, self.owner, self.k)
        except PayloadError as exc:
            raise CoordinatorError(None, f"push: {exc}") from exc
        digests, receipts = self.push_parts(round_number, parts, upload_id, weight)
        return parts[0], digests, receipts

    def push_parts(
        self, round_number: int, parts: Sequence[UpdatePayload], upload_id: str, weight: float
    ) -> tuple[list[bytes], list[bytes]]:
        """Push parts 1..K-1 to their shards side by side; every part's digest and shard's
        receipt (index 0 left empty: the coordinator's part)."""
        jobs = [
            self._pool.submit(self._push_one, i, round_number, parts[i], upload_id, weight)
            for i in range(1, self.k)
        ]
        receipts = [b""] + [job.result() for job in jobs]
        return [b""] + [p.manifest.digest for p in parts[1:]], receipts

    def _push_one(self, i: int, r: int, part: UpdatePayload, upload_id: str, w: float) -> bytes:
        c = self.client

        shard_pass = self.pass_for(r)

        def header(reserve: bool) -> bytes:
            return pb.PushMessage(
                header=pb.PushHeader(
                    lease=pb.Lease(site=c.site), round=r, upload_id=upload_id,
                    manifest=part.manifest.to_proto(), weight=w, base_version=r, reserve=reserve,
                    shard_pass=shard_pass,
                )
            ).SerializeToString()  # fmt: skip

        def attempt() -> bytes:
            # What the shard holds already (a part resumed after a break), then the rest.
            probe = self._stubs[i].Push(iter([header(True)]), timeout=c.rpc_timeout_s)
            if probe.complete:
                return probe.receipt
            start = probe.acked_offset

            def frames():
                yield header(False)
                for offset, data in part.chunks(start, c.chunk_bytes):
                    yield chunk_frame(offset, data)

            reply = self._stubs[i].Push(frames(), timeout=c.transfer_timeout_s)
            if not reply.complete:
                raise CoordinatorError(
                    grpc.StatusCode.UNAVAILABLE, f"shard {i}: part incomplete ({reply.message})"
                )
            c.bytes_sent += part.total_bytes - start
            return reply.receipt

        return c.call(f"push to shard {i}", attempt)

    def fetch(self, version: int | None, dest: Path | None) -> GlobalState:
        """theta whole: the coordinator's part, then the shards' of the same version; started
        over when the round closes in between (unless ``version`` was asked for). With
        ``dest`` every part streams straight into the one theta file there."""
        for _ in range(MAX_RESTARTS):
            part_file = dest.with_name(dest.name + ".part0") if dest is not None else None
            own = self.client.theta.fetch(version, None, part_file)
            try:
                whole, file = self._assemble(own, dest)
            except CoordinatorError as exc:
                if exc.code != grpc.StatusCode.NOT_FOUND or version is not None:
                    raise
                log.info("fetch: the shards moved past theta_%d; fetching anew", own.version)
                continue
            finally:
                if part_file is not None:
                    part_file.unlink(missing_ok=True)  # its mapping lives while it is read
            if state_digest(whole) != own.theta_hash:
                raise CoordinatorError(
                    grpc.StatusCode.DATA_LOSS,
                    "fetch: theta assembled from the shards does not match its state digest",
                )
            return GlobalState(own.version, whole, own.theta_hash, dest, file)
        raise CoordinatorError(
            grpc.StatusCode.NOT_FOUND, f"fetch: theta changed {MAX_RESTARTS} times during one fetch"
        )

    def _assemble(
        self, own: GlobalState, dest: Path | None
    ) -> tuple[dict[str, torch.Tensor], MappedTensors | None]:
        """theta whole, laid out from every part's manifest (each shard's header asked for
        first): in the one file at ``dest`` (else in memory), the coordinator's tensors copied
        in and every shard's streamed into place a chunk at a time, never a part held apart."""
        jobs = [self._pool.submit(self._manifest_of, i, own.version) for i in range(1, self.k)]
        parts = {i: job.result() for i, job in zip(range(1, self.k), jobs, strict=True)}
        specs = [(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in own.theta.items()]
        specs += [(e.name, e.dtype, tuple(e.shape)) for m in parts.values() for e in m.entries]
        layout, file = layout_of(specs), None
        if dest is None:
            buffer = bytearray(layout.total_bytes)
            tensors, view = unpack(layout, buffer), memoryview(buffer)
        else:  # every byte is written and checked by theta's digest: a spare is written over
            file = create_mapped(dest, layout, reuse=True)
            tensors, view = file.tensors, file.payload()
        for name, t in own.theta.items():
            tensors[name].copy_(t)
        at = {e.name: e.offset for e in layout.entries}
        streams = [
            self._pool.submit(self._stream_one, i, own.version, parts[i], view, at) for i in parts
        ]
        for job in streams:
            job.result()
        return tensors, file

    def _manifest_of(self, i: int, version: int) -> Manifest:
        c = self.client

        def attempt() -> Manifest:
            request = self._request(version)
            call = self._stubs[i].Fetch(request, timeout=c.rpc_timeout_s)
            try:
                header = pb.FetchHeader.FromString(next(call))
            finally:
                call.cancel()  # the header is all this call is for
            return Manifest.from_proto(header.manifest)

        return c.call(f"fetch from shard {i}", attempt)

    def _stream_one(self, i: int, version: int, part: Manifest, view, at) -> None:
        c = self.client
        entries = sorted(part.entries, key=lambda e: e.offset)

        def attempt() -> None:  # a break starts the part again: its bytes land where they did
            request = self._request(version)
            frames = iter(self._stubs[i].Fetch(request, timeout=c.transfer_timeout_s))
            header = pb.FetchHeader.FromString(next(frames))
            if Manifest.from_proto(header.manifest).entries != part.entries:
                raise CoordinatorError(
                    grpc.StatusCode.NOT_FOUND, f"shard {i}: its part changed during the fetch"
                )
            for frame in frames:
                offset, data = parse_chunk(frame)
                for e, inside, piece in tensor_pieces(entries, offset, data):
                    start = at[e.name] + inside
                    view[start : start + len(piece)] = piece
                c.bytes_received += len(data)

        c.call(f"fetch from shard {i}", attempt)

    def _request(self, version: int) -> pb.FetchRequest:
        """A shard's part of theta_``version`` (a shard knows a site by its certificate, and
        serves it with the lead's pass)."""
        return pb.FetchRequest(
            lease=pb.Lease(site=self.client.site),
            version=version,
            shard_pass=self.pass_for(version),
        )

    def pass_for(self, version: int) -> bytes:
        """The lead's pass for theta ``version`` and round ``version``: as it came with that
        theta, else asked of the lead now (a header-only fetch of that version)."""
        c = self.client
        known = c.theta.shard_passes.get(version)
        if known is not None:
            return known

        def ask() -> bytes:
            request = pb.FetchRequest(lease=c.lease, version=version, length=1)
            return first_header(c, request, drain=True).header.shard_pass

        got = c.call("fetch the shards' pass", ask)
        c.theta.note_pass(version, got)
        return got

    def close(self) -> None:
        self._pool.shutdown(wait=False)
