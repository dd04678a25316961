"""Case generators for Push streams: a valid push for the open round (``base_push``), altered
by the mutation ops of ``OPS``, by random fields, by NaN/Inf with a correct SHA-256, resumed
with a hostile continuation, cancelled by the client, or raced by a second stream."""

from __future__ import annotations

import math
import struct

import torch
from hypothesis import strategies as st

from wire.digest import payload_digest
from wire.proto import isthmus_pb2 as pb
from wire.tensors import pack

from .cases import Case
from .constants import SITE_A, TORCH_DTYPES, TRAINABLE, UPDATE_ITEMSIZE, WIRE_DTYPES
from .mutations_header import _copy, _header
from .mutations_stream import OPS
from .oracle import Resume, corrupt_last_chunk, push_verdict
from .strategies import CHUNK_SIZES, DOUBLES, I64, NAMES, TEXT, U64, VALUE_SCALES


class PushCases:
    """``Fuzzer``'s generators of Push cases (a mixin)."""

    def base_push(self, data, name: str = SITE_A) -> list:
        """A valid push for the open round (the fuzzer never sends it unaltered)."""
        dtype = data.draw(st.sampled_from(["float32"] * 4 + ["float16", "bfloat16"]))
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
        scale = data.draw(VALUE_SCALES)
        names = list(TRAINABLE)
        if data.draw(st.booleans()):
            names.reverse()
        d = {
            n: (torch.randn(TRAINABLE[n], generator=g) * scale).to(TORCH_DTYPES[dtype])
            for n in names
        }
        manifest, payload = pack(d)
        payload = bytes(payload)
        size = data.draw(CHUNK_SIZES)
        header = pb.PushHeader(
            lease=self._lease_copy(name),
            round=self.r,
            upload_id=f"u{self.report.cases + 1}",
            manifest=manifest.to_proto(),
            weight=data.draw(st.sampled_from([1.0, 3.0, 0.5, 1e15, 1e-300])),
            base_version=self.r,
        )
        return [pb.PushMessage(header=header)] + [
            pb.PushMessage(chunk=pb.Chunk(offset=o, data=payload[o : o + size]))
            for o in range(0, len(payload), size)
        ]

    def _push_case(self, msgs: list, ops: list[str], resume: Resume | None = None, **kw) -> Case:
        verdict = push_verdict(msgs, self.participant_leases(), self.r, resume)
        if verdict == "count":
            assert corrupt_last_chunk(msgs), "a countable push without data"
            ops = [*ops, "corrupt_last_chunk"]
            verdict = push_verdict(msgs, self.participant_leases(), self.r, resume)
            assert verdict != "count", "corrupting the last chunk left the push countable"
        return Case("", "Push", msgs, ops=ops, verdict=verdict, **kw)

    def apply_ops(self, data, msgs: list, groups: list[str]) -> list[str]:
        """One op from ``groups[0]`` (most often), or two or three from any of ``groups``."""
        count = data.draw(st.sampled_from([1, 1, 1, 1, 2, 3]))
        notes = []
        for i in range(count):
            group = groups[0] if i == 0 else data.draw(st.sampled_from(groups))
            name = data.draw(st.sampled_from(sorted(OPS[group])))
            notes.append(OPS[group][name](self, data, msgs))
        return notes

    # ---- case generators (one per push kind) ---------------------------------------------------

    def gen_push_random(self, data) -> Case:
        lease, note = self.draw_lease(data)
        header = pb.PushHeader(
            round=data.draw(st.just(self.r) | U64),
            upload_id=data.draw(st.just(f"u{self.report.cases + 1}") | NAMES),
            data_unit=data.draw(TEXT),
            weight=data.draw(DOUBLES),
            base_version=data.draw(st.just(self.r) | U64),
        )
        if lease is not None:
            header.lease.CopyFrom(lease)
        small = st.integers(0, 5000)
        for _ in range(data.draw(st.integers(0, 5))):
            header.manifest.tensors.add(
                name=data.draw(st.sampled_from([*TRAINABLE, "seen"]) | TEXT),
                dtype=data.draw(st.sampled_from(WIRE_DTYPES) | TEXT),
                shape=data.draw(st.lists(st.sampled_from([16, 8, 0, 1]) | I64, max_size=5)),
                codec=data.draw(st.sampled_from(["none", "none", ""]) | TEXT),
                offset=data.draw(st.sampled_from([0, 64]) | small | U64),
                nbytes=data.draw(st.sampled_from([64, 512]) | small | U64),
                codec_meta=data.draw(st.binary(max_size=16)),
            )
        header.manifest.total_bytes = data.draw(st.sampled_from([576]) | small | U64)
        header.manifest.digest = data.draw(
            st.binary(min_size=32, max_size=32) | st.binary(max_size=64)
        )
        msgs = [pb.PushMessage(header=header)]
        contiguous = data.draw(st.booleans())
        offset = 0
        for _ in range(data.draw(st.integers(0, 6))):
            chunk = data.draw(st.binary(max_size=700))
            at = offset if contiguous else data.draw(st.integers(0, 700) | U64)
            msgs.append(pb.PushMessage(chunk=pb.Chunk(offset=at, data=chunk)))
            offset += len(chunk)
        return self._push_case(msgs, [note, "random header, manifest and chunks"])

    def _gen_push_group(self, data, group: str) -> Case:
        msgs = self.base_push(data)
        groups = [group, "header", "manifest", "chunks", "structure"]
        return self._push_case(msgs, self.apply_ops(data, msgs, groups))

    def gen_push_header(self, data) -> Case:
        return self._gen_push_group(data, "header")

    def gen_push_manifest(self, data) -> Case:
        return self._gen_push_group(data, "manifest")

    def gen_push_chunks(self, data) -> Case:
        return self._gen_push_group(data, "chunks")

    def gen_push_structure(self, data) -> Case:
        return self._gen_push_group(data, "structure")

    def gen_push_nonfinite(self, data) -> Case:
        """A valid push with one NaN or Inf and a correct SHA-256: the values are the fault."""
        msgs = self.base_push(data)
        header = msgs[0].header
        payload = bytearray(b"".join(m.chunk.data for m in msgs[1:]))
        t = data.draw(st.sampled_from(list(header.manifest.tensors)))
        index = data.draw(st.integers(0, math.prod(t.shape) - 1))
        value = data.draw(st.sampled_from(["nan", "inf", "-inf", "snan", "-nan"]))
        bits32 = {
            "nan": 0x7FC00000,
            "inf": 0x7F800000,
            "-inf": 0xFF800000,
            "snan": 0x7F800001,
            "-nan": 0xFFC00000,
        }[value]
        at = t.offset + index * UPDATE_ITEMSIZE[t.dtype]
        if t.dtype == "float32":
            payload[at : at + 4] = struct.pack("<I", bits32)
        elif t.dtype == "bfloat16":
            payload[at : at + 2] = struct.pack("<H", bits32 >> 16)
        else:
            bits16 = {"nan": 0x7E00, "inf": 0x7C00, "-inf": 0xFC00, "snan": 0x7C01, "-nan": 0xFE00}
            payload[at : at + 2] = struct.pack("<H", bits16[value])
        header.manifest.digest = payload_digest(payload)
        size = data.draw(CHUNK_SIZES)
        msgs[1:] = [
            pb.PushMessage(chunk=pb.Chunk(offset=o, data=bytes(payload[o : o + size])))
            for o in range(0, len(payload), size)
        ]
        ops = [f"{value} in {t.name}[{index}] ({t.dtype}), SHA-256 recomputed"]
        if data.draw(st.integers(0, 3)) == 0:
            ops += self.apply_ops(data, msgs, ["chunks", "header", "manifest"])
        return self._push_case(msgs, ops)

    def gen_push_resume(self, data) -> Case:
        """A valid partial upload (acknowledged), then a hostile continuation of it."""
        msgs = self.base_push(data)
        header = msgs[0].header
        payload = b"".join(m.chunk.data for m in msgs[1:])
        size = data.draw(st.sampled_from([64, 128, 200]))
        chunks = [
            pb.PushMessage(chunk=pb.Chunk(offset=o, data=payload[o : o + size]))
            for o in range(0, len(payload), size)
        ]
        j = data.draw(st.integers(1, len(chunks) - 1))
        prelude = [msgs[0], *chunks[:j]]
        acked = j * size
        second_header = pb.PushMessage()
        second_header.CopyFrom(msgs[0])
        second = [second_header, *(_copy(c) for c in chunks[j:])]
        ops = [f"resumed at {acked}"]
        ops += self.apply_ops(data, second, ["chunks", "header", "manifest", "structure"])
        resume = Resume(
            SITE_A,
            header.upload_id,
            bytes(header.manifest.digest),
            payload[:acked],
            header.manifest.total_bytes,
            list(header.manifest.tensors),
        )
        case = self._push_case(second, ops, resume)
        case.prelude, case.prelude_acked = prelude, acked
        return case

    def gen_push_cancel(self, data) -> Case:
        """A push the client aborts part-way or after its last chunk (no half-close)."""
        msgs = self.base_push(data)
        ops = []
        if data.draw(st.booleans()):
            ops = self.apply_ops(data, msgs, ["chunks", "header", "manifest", "structure"])
        cancel_at = data.draw(st.integers(0, len(msgs)))
        ops.append(f"cancel before message {cancel_at} of {len(msgs)}")
        # grpc may show the server a client's cancel as a clean end of stream: what was sent
        # before it must then not be a complete valid update (that would be a lost ack, not
        # hostile input).
        sent = msgs[:cancel_at]
        if push_verdict(sent, self.participant_leases(), self.r) == "count":
            corrupt_last_chunk(sent)
            ops.append("corrupt_last_chunk")
        return Case("", "Push", msgs, ops=ops, verdict="refuse", cancel_at=cancel_at)

    def gen_push_concurrent(self, data) -> Case:
        """A valid upload held open part-way while a second push (the same, or altered) for
        the same upload id runs: the second must be refused (busy, or another payload) or be
        an upload of its own; then the first ends, perhaps with hostile chunks."""
        msgs = self.base_push(data)
        uid = msgs[0].header.upload_id
        second = [_copy(m) for m in msgs]
        j = data.draw(st.integers(1, len(msgs) - 1))
        tail = msgs[1 + j :]
        ops = [f"hold_after({j} of {len(msgs) - 1} chunks)"]
        if tail and data.draw(st.booleans()):
            ops += self.apply_ops(data, tail, ["chunks", "structure"])
        msgs[1 + j :] = tail
        second_ops = []
        if data.draw(st.integers(0, 2)):
            second_ops = self.apply_ops(data, second, ["header", "manifest", "chunks"])
        case = self._push_case(msgs, ops)
        h2 = _header(second)
        if h2 is not None and (h2.lease.site, h2.upload_id) == (SITE_A, uid):
            pass  # busy, or an upload id reused for another payload: never counted
        elif push_verdict(second, self.participant_leases(), self.r) == "count":
            corrupt_last_chunk(second)
            second_ops.append("corrupt_last_chunk")
        case.hold_after, case.second = 1 + j, second
        case.ops += [f"second stream: {o}" for o in second_ops or ["the same push"]]
        return case
