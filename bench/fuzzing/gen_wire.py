"""Raw-byte and oversized cases: one serialized message of a valid request with its bytes
altered (the byte ops below), and messages far past the server's limits."""

from __future__ import annotations

from hypothesis import strategies as st

from wire.proto import isthmus_pb2 as pb

from .cases import Case, _fmt_message
from .constants import BIG_CALL_TIMEOUT_S, MAX_CHUNK_BYTES, SITE_A, SITE_B
from .mutations_header import _decode
from .oracle import corrupt_last_chunk, push_verdict
from .strategies import NAMES, U64, unknown_fields

# ---- byte-level ops for the raw cases: (data, bytes, method) -> (bytes, note) -------------------

# Hypothesis checks that the same choices lead to the same draws: a draw may not depend on state
# outside the case (the serialized size of a message depends on tokens, the round, the case
# number). Positions in serialized bytes are therefore drawn from a fixed range and folded.


def _index(data, n: int) -> int:
    """A position in ``range(n)`` (n > 0), often the first or the last."""
    where = data.draw(st.sampled_from(["first", "last", "any", "any"]))
    if where == "first":
        return 0
    if where == "last":
        return n - 1
    return data.draw(st.integers(0, 2**20)) % n


def _b_flip(data, b: bytes, method: str):
    if not b:
        return b"\xff", "flip(empty -> ff)"
    d = bytearray(b)
    i = _index(data, len(d))
    d[i] ^= 1 << data.draw(st.integers(0, 7))
    return bytes(d), f"flip(byte {i})"


def _b_set(data, b: bytes, method: str):
    if not b:
        return b"\x0a", "set(empty)"
    d = bytearray(b)
    i = _index(data, len(d))
    d[i] = data.draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0x0A, 0x12]) | st.integers(0, 255))
    return bytes(d), f"set(byte {i}={d[i]:#x})"


def _b_insert(data, b: bytes, method: str):
    i = _index(data, len(b) + 1)
    extra = data.draw(st.binary(min_size=1, max_size=8))
    return b[:i] + extra + b[i:], f"insert({extra.hex()} at {i})"


def _b_delete(data, b: bytes, method: str):
    if not b:
        return b, "delete(empty)"
    i = _index(data, len(b))
    n = data.draw(st.integers(1, 8))
    return b[:i] + b[i + n :], f"delete({n} at {i})"


def _b_truncate(data, b: bytes, method: str):
    n = _index(data, max(len(b), 1))
    return b[:n], f"truncate(to {n})"


def _b_append(data, b: bytes, method: str):
    extra = data.draw(st.binary(min_size=1, max_size=16))
    return b + extra, f"append({extra.hex()})"


def _b_unknown(data, b: bytes, method: str):
    extra = data.draw(unknown_fields())
    return b + extra, f"unknown_fields({extra.hex()[:40]})"


def _b_random(data, b: bytes, method: str):
    new = data.draw(st.binary(max_size=64))
    return new, f"random({new.hex()})"


def _b_merge(data, b: bytes, method: str):
    """Append a second encoding of one field: protobuf merges it (last scalar wins)."""
    if method == "Push":
        over = data.draw(
            st.sampled_from(["round", "offset", "token", "data", "site"]).map(
                lambda w: {
                    "round": pb.PushMessage(header=pb.PushHeader(round=1)),
                    "offset": pb.PushMessage(chunk=pb.Chunk(offset=1)),
                    "token": pb.PushMessage(header=pb.PushHeader(lease=pb.Lease(token=7))),
                    "data": pb.PushMessage(chunk=pb.Chunk(data=b"\x00")),
                    "site": pb.PushMessage(header=pb.PushHeader(lease=pb.Lease(site=SITE_B))),
                }[w]
            )
        )
    elif method == "Join":
        over = pb.JoinRequest(site=data.draw(NAMES))
    elif method == "Fetch":
        over = pb.FetchRequest(offset=data.draw(U64))
    else:
        over = pb.HeartbeatRequest(lease=pb.Lease(token=data.draw(U64)))
    extra = over.SerializeToString()
    return b + extra, f"merge({_fmt_message(over, 80)})"


BYTE_OPS = {
    "flip": _b_flip,
    "flip2": _b_flip,
    "set": _b_set,
    "insert": _b_insert,
    "delete": _b_delete,
    "truncate": _b_truncate,
    "append": _b_append,
    "unknown_fields": _b_unknown,
    "random": _b_random,
    "merge": _b_merge,
    # Push: an extra message after the last chunk (see gen_wire); elsewhere a plain append
    "append_message": _b_append,
}


class WireCases:
    """``Fuzzer``'s generators of raw-byte and oversized cases (a mixin)."""

    def gen_wire(self, data) -> Case:
        """One serialized message of a valid request with its bytes altered."""
        method = data.draw(
            st.sampled_from(["Push", "Push", "Push", "Join", "Heartbeat", "Fetch", "Leave"])
        )
        if method == "Push":
            msgs = self.base_push(data)
            items = [m.SerializeToString() for m in msgs]
        else:
            items = [self._valid_unary(method).SerializeToString()]
        op = data.draw(st.sampled_from(sorted(BYTE_OPS)))
        if op == "append_message" and method == "Push":
            items.append(data.draw(st.binary(min_size=1, max_size=40)))
            note = f"append_message({items[-1].hex()})"
        else:
            i = data.draw(st.integers(0, len(items) - 1))
            items[i], note = BYTE_OPS[op](data, items[i], method)
            note = f"message {i}: {note}"
        if method != "Push":
            return Case("", method, items[0], raw=True, ops=[note], verdict="accept")
        decoded = [_decode(pb.PushMessage, b) for b in items]
        verdict = push_verdict(decoded, self.participant_leases(), self.r)
        ops = [note]
        if verdict == "count":
            corrupt_last_chunk(decoded)
            last = max(i for i, m in enumerate(decoded) if m is not None and m.HasField("chunk"))
            items[last] = decoded[last].SerializeToString()
            ops.append("corrupt_last_chunk")
            verdict = push_verdict(decoded, self.participant_leases(), self.r)
        return Case("", "Push", items, raw=True, ops=ops, verdict=verdict)

    def _valid_unary(self, method: str):
        a = self._lease_copy(SITE_A)
        if method == "Join":
            caps = pb.Capabilities(codecs=["none"], world_size=2, num_examples=10)
            return pb.JoinRequest(site=f"w{self.report.cases + 1}", capabilities=caps)
        if method == "Heartbeat":
            progress = pb.Progress(round=self.r, inner_step=1, train_loss=0.5, phase="training")
            return pb.HeartbeatRequest(lease=a, progress=progress)
        if method == "Fetch":
            return pb.FetchRequest(lease=a, version=self.r, offset=0)
        return pb.LeaveRequest(lease=a, reason="done")

    def gen_oversize(self, data) -> Case:
        what = data.draw(
            st.sampled_from(
                [
                    "join_33MB",
                    "push_33MB_chunk",
                    "push_4MiB+1_chunk",
                    "tensors_100001",
                    "shape_200k_dims",
                    "codec_1MB",
                    "dtype_1MB",
                    "lease_site_1MB",
                    "heartbeat_phase_2MB",
                ]
            )
        )
        big = BIG_CALL_TIMEOUT_S
        if what == "join_33MB":
            return Case("", "Join", pb.JoinRequest(site="a" * (33 << 20)), ops=[what], timeout=big)
        if what == "heartbeat_phase_2MB":
            req = pb.HeartbeatRequest(lease=self._lease_copy(SITE_A))
            req.progress.phase = "p" * (2 << 20)
            return Case("", "Heartbeat", req, ops=[what], verdict="accept", timeout=big)
        msgs = self.base_push(data)
        h = msgs[0].header
        if what in ("push_33MB_chunk", "push_4MiB+1_chunk"):
            n = (33 << 20) if what == "push_33MB_chunk" else MAX_CHUNK_BYTES + 1
            msgs[1:] = [pb.PushMessage(chunk=pb.Chunk(offset=0, data=b"\0" * n))]
        elif what == "tensors_100001":
            h.manifest.tensors.extend(
                pb.TensorSpec(name=f"t{i}", dtype="float32", shape=[1], offset=4096, nbytes=4)
                for i in range(100_001)
            )
        elif what == "shape_200k_dims":
            h.manifest.tensors[0].shape.extend([1] * 200_000)
        elif what == "codec_1MB":
            h.manifest.tensors[0].codec = "z" * (1 << 20)
        elif what == "dtype_1MB":
            h.manifest.tensors[0].dtype = "f" * (1 << 20)
        elif what == "lease_site_1MB":
            h.lease.site = "s" * (1 << 20)
        case = self._push_case(msgs, [what])
        case.timeout = big
        return case
