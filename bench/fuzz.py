"""Property-based fuzzing of every coordinator RPC against a live coordinator process.

``python -m bench.fuzz [--cases N] [--seed S] [--workdir DIR]`` starts ``coordinator serve``
(plaintext on loopback, the tiny model of ``tests/coord_harness.py``), joins two sites, ``fz-a``
(the victim whose lease most hostile requests carry) and ``fz-b``, waits for a round in which
both are participants, then lets hypothesis generate N hostile requests, each sent as a real RPC
over real gRPC: Join, Heartbeat, Fetch, Leave, Status and Push streams, typed and as raw bytes.

Cases come from three sources:

* random messages of every kind (unicode, huge and almost-valid names, random capabilities,
  leases, progress, versions, offsets, manifests, chunks);
* mutations of a valid message: a valid push for the open round from ``fz-a`` (or a valid
  Heartbeat/Fetch/Leave) with one to three fields or bytes altered: header fields, manifest
  entries, chunk offsets/data/order/count, stream structure (no header, two headers, chunks
  before the header, an empty message), NaN/Inf with a correct SHA-256, an interrupted upload
  resumed with a hostile continuation, a stream cancelled by the client, a second stream for
  an upload held open by a first (busy), one serialized message with a byte flipped, inserted,
  deleted or truncated, or an extra undecodable message (the server then sees bad bytes);
* oversized messages (33 MB, 4 MiB + 1 chunks, 100001 tensors, 1 MB strings echoed back).

The invariant is *hostile input changes nothing*. A client-side oracle, written from the
protocol's rules rather than from the server's code, says whether a push stream would be a
valid, complete update that must count. Such a stream is never sent as it is: its last chunk
gets one bit flipped (an SHA-256 mismatch), so every push sent is one that must not count.
After every case the fuzzer checks that the coordinator process is alive and answers Status,
that the round number, theta's hash and the round's count of updates are unchanged, and that
the reply was a well-formed gRPC status from the allowed set (an UNKNOWN or INTERNAL status is
an uncaught exception in the server). Two framework outcomes are allowed only where they are
the point of the case: ``INTERNAL(deserialize)`` (grpc's answer to bytes that are not the
request type) for raw-byte cases, and ``CLIENT_CANCEL`` for streams the client aborts. At the
end the coordinator's log is scanned for tracebacks (grpc's own log of undecodable requests
excepted).

A state change or a crash is recorded with a reproducer and the run goes on (the fuzzer brings
the job back to a clean open round: valid zero updates from both sites close the round). The
last line printed is ``cases=N crashes=C state_changes=S``; the exit status is 1 when either
count is not zero. Warnings that are neither (a refusal that echoes a huge attacker string, a
Join accepting a name the protocol forbids, a wrong Fetch answer) are printed above it.

``--kinds push_resume,wire`` runs a subset of the case kinds (``KINDS``); ``--skip-known-bugs``
leaves out the cases that hit a bug listed in ``KNOWN_BUGS`` (tests/test_fuzz.py does).
A run is reproducible from its seed (printed) up to timing; ``findings.jsonl`` in the work folder
holds every finding with its messages, base64-encoded.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import hashlib
import json
import logging
import math
import random
import re
import shutil
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import coord_harness as harness  # noqa: E402
import grpc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from google.protobuf import text_format  # noqa: E402
from google.protobuf.message import DecodeError  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import FlakyStrategyDefinition, HypothesisException  # noqa: E402

from wire.grpc_options import channel_options  # noqa: E402
from wire.proto import isthmus_pb2 as pb  # noqa: E402
from wire.proto import isthmus_pb2_grpc as pb_grpc  # noqa: E402
from wire.tensors import pack  # noqa: E402

SITE_A, SITE_B = "fz-a", "fz-b"
MAX_UPDATE_BYTES = 4096
MAX_CHUNK_BYTES = 4 << 20
TTL_S = 30.0
REFRESH_S = 5.0
CALL_TIMEOUT_S = 5.0
BIG_CALL_TIMEOUT_S = 20.0
SETTLE_S = 0.03
BIG_DETAILS = 4096  # a refusal message longer than this echoes attacker input back
U64_MAX = 2**64 - 1


def _u64(x: int) -> int:
    """Clamp a computed value into uint64 (protobuf refuses anything else)."""
    return min(max(int(x), 0), U64_MAX)


def _i64(x: int) -> int:
    return min(max(int(x), -(2**63)), 2**63 - 1)


# The protocol's rules, restated here (not imported from the server) for the oracle.
TRAINABLE = {"lin.bias": [16], "lin.weight": [16, 8]}
UPDATE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WIRE_DTYPES = [
    "float32", "float64", "bfloat16", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"
]  # fmt: skip
SPEC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")  # used with fullmatch: 1-63 chars

ALLOWED = frozenset(
    {
        "OK",
        "INVALID_ARGUMENT",
        "FAILED_PRECONDITION",
        "ABORTED",
        "ALREADY_EXISTS",
        "NOT_FOUND",
        "RESOURCE_EXHAUSTED",
        "UNAVAILABLE",
        # deliberate refusals of the mutual-TLS layer; never expected on the plaintext port
        "UNAUTHENTICATED",
        "PERMISSION_DENIED",
    }
)
DESERIALIZE = "INTERNAL(deserialize)"
CLIENT_CANCEL = "CLIENT_CANCEL"
METHOD_PATH = "/isthmus.v1.Coordinator/"

# Case kinds and their weights (out of 100).
KINDS = {
    "join": 8,
    "heartbeat": 7,
    "fetch": 7,
    "leave": 5,
    "status": 3,
    "push_random": 6,
    "push_header": 10,
    "push_manifest": 12,
    "push_chunks": 12,
    "push_structure": 5,
    "push_nonfinite": 4,
    "push_resume": 7,
    "push_cancel": 3,
    "push_concurrent": 3,
    "wire": 7,
    "oversize": 1,
}
KIND_LIST = [k for k, w in KINDS.items() for _ in range(w)]

# ---- strategies ---------------------------------------------------------------------------------

CHARS = st.characters(exclude_categories=("Cs",))  # protobuf strings are valid UTF-8
U64 = st.one_of(
    st.sampled_from([0, 1, 2, 63, 64, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, U64_MAX]),
    st.integers(0, U64_MAX),
)
U32 = st.one_of(st.sampled_from([0, 1, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
I64 = st.one_of(
    st.sampled_from([0, 1, -1, 8, 16, 128, 2**31, -(2**63), 2**63 - 1]),
    st.integers(-(2**63), 2**63 - 1),
)
DOUBLES = st.one_of(
    st.sampled_from(
        [0.0, -0.0, math.nan, -math.nan, math.inf, -math.inf, 5e-324, -5e-324, -1.0, 1.0]
        + [1e15, 1e15 * (1 + 2**-50), 1e300, 1.7976931348623157e308]
    ),
    st.floats(),
)
TEXT = st.text(CHARS, max_size=40)
HUGE_TEXT = st.builds(
    lambda piece, n: piece * n,
    st.text(CHARS, min_size=1, max_size=3),
    st.sampled_from([100, 2_000, 20_000, 100_000]),
)
VALID_NAME = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", fullmatch=True)
ODD = [
    "\n", "\r", "\r\n", " ", "\t", "\x00", "/", "\\", "+", "..", "é", "\u200b", "\uff10",
    "\U0001f600", ":", "%", "*", "\x7f", "\u0130", "\u212a",
]  # fmt: skip


def _near(name: str, odd: str, where: int) -> str:
    """``name`` with one forbidden character (or several) at its start, end or middle."""
    if where == 0:
        return odd + name
    if where == 1:
        return name + odd
    mid = len(name) // 2
    return name[:mid] + odd + name[mid:]


NEAR_VALID = st.one_of(
    st.builds(_near, VALID_NAME, st.sampled_from(ODD), st.integers(0, 2)),
    st.sampled_from(["", "-a", ".a", "_a", "a" * 64, "..", ".", "a/../b", "A" * 63 + "\n"]),
)
NAMES = st.one_of(VALID_NAME, NEAR_VALID, NEAR_VALID, TEXT, HUGE_TEXT)
CHUNK_SIZES = st.sampled_from([64, 64, 64, 128, 128, 256, 600, 1000, 100, 17, 1])
VALUE_SCALES = st.sampled_from([0.0, 1e-3, 1.0, 100.0])


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


@st.composite
def unknown_fields(draw) -> bytes:
    """Well-formed protobuf fields with numbers the schema does not use (and some it does)."""
    out = bytearray()
    for _ in range(draw(st.integers(1, 4))):
        number = draw(st.one_of(st.integers(1, 20), st.integers(21, 2**29 - 1)))
        wire_type = draw(st.sampled_from([0, 1, 2, 5]))
        out += _varint(number << 3 | wire_type)
        if wire_type == 0:
            out += _varint(draw(st.integers(0, U64_MAX)))
        elif wire_type == 1:
            out += draw(st.binary(min_size=8, max_size=8))
        elif wire_type == 5:
            out += draw(st.binary(min_size=4, max_size=4))
        else:
            payload = draw(st.binary(max_size=40))
            out += _varint(len(payload)) + payload
    return bytes(out)


# ---- the oracle -------------------------------------------------------------------------------


@dataclass
class Resume:
    """An upload the case left partly received, which the case's main stream may continue."""

    site: str
    upload_id: str
    sha: bytes
    prefix: bytes
    total: int
    entries: list


def manifest_problem(m: pb.Manifest) -> str | None:
    """Why ``m`` is not a valid update manifest for the tiny model (None: it is valid)."""
    if m.total_bytes > MAX_UPDATE_BYTES:
        return "oversize"
    if len(m.sha256) != 32:
        return "sha length"
    names = [t.name for t in m.tensors]
    if sorted(names) != sorted(TRAINABLE):
        return "tensor names"
    ranges = []
    for t in m.tensors:
        if t.dtype not in UPDATE_ITEMSIZE or t.codec != "none":
            return "dtype or codec"
        if list(t.shape) != TRAINABLE[t.name]:
            return "shape"
        if t.nbytes != math.prod(t.shape) * UPDATE_ITEMSIZE[t.dtype]:
            return "nbytes"
        if t.offset + t.nbytes > m.total_bytes:
            return "past the end"
        ranges.append((t.offset, t.offset + t.nbytes))
    ranges.sort()
    for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
        if start < end:
            return "overlap"
    return None


def all_finite(entries, data: bytes) -> bool:
    for t in entries:
        raw = data[t.offset : t.offset + t.nbytes]
        if t.dtype == "float32":
            a = np.frombuffer(raw, "<f4")
        elif t.dtype == "float16":
            a = np.frombuffer(raw, "<f2")
        else:  # bfloat16: the high half of a float32
            a = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        if not np.isfinite(a).all():
            return False
    return True


def push_verdict(msgs: list, leases: set, r: int, resume: Resume | None = None) -> str:
    """What the protocol says a push stream is: ``count`` (a valid, complete update),
    ``partial`` (valid so far, bytes missing: acknowledged, nothing counted) or ``refuse``.
    ``None`` in ``msgs`` stands for a message that does not decode."""
    if not msgs or msgs[0] is None or msgs[0].WhichOneof("kind") != "header":
        return "refuse"
    h = msgs[0].header
    if (h.lease.site, h.lease.token) not in leases or h.round != r or h.base_version != r:
        return "refuse"
    if not SPEC_NAME.fullmatch(h.upload_id):
        return "refuse"
    if not (math.isfinite(h.weight) and 0 < h.weight <= 1e15):
        return "refuse"
    if manifest_problem(h.manifest):
        return "refuse"
    total, sha, entries = h.manifest.total_bytes, bytes(h.manifest.sha256), h.manifest.tensors
    data = b""
    if resume and (resume.site, resume.upload_id) == (h.lease.site, h.upload_id):
        if sha != resume.sha:
            return "refuse"  # an upload id reused for another payload
        total, entries, data = resume.total, resume.entries, resume.prefix
    for m in msgs[1:]:
        if m is None or m.WhichOneof("kind") != "chunk":
            return "refuse"
        c = m.chunk
        n = len(c.data)
        if n == 0 or n > MAX_CHUNK_BYTES or c.offset != len(data) or len(data) + n > total:
            return "refuse"
        data += c.data
    if len(data) < total:
        return "partial"
    if hashlib.sha256(data).digest() != sha or not all_finite(entries, data):
        return "refuse"
    return "count"


def corrupt_last_chunk(msgs: list) -> bool:
    """Flip one bit of the last chunk's data (the payload's SHA-256 then fails)."""
    for m in reversed(msgs):
        if m is not None and m.WhichOneof("kind") == "chunk" and m.chunk.data:
            data = bytearray(m.chunk.data)
            data[-1] ^= 0x01
            m.chunk.data = bytes(data)
            return True
    return False


# ---- known server bugs ---------------------------------------------------------------------------

# What ``run(skip_known_bugs=True)`` leaves out (tests/test_fuzz.py reproduces each one in a
# strict xfail test). Remove an entry once its bug is fixed.
KNOWN_BUGS: dict[str, str] = {}  # none open; the ones found so far have regression tests


def known_bug(case: Case) -> str | None:
    """The KNOWN_BUGS entry ``case`` would trigger, if any (a rule per entry goes here)."""
    return None


# ---- cases, outcomes, findings ------------------------------------------------------------------


@dataclass
class Case:
    kind: str
    method: str  # Join, Heartbeat, Fetch, Leave, Status or Push
    request: object  # a message; for Push a list of messages; bytes (or a list) when raw
    raw: bool = False
    ops: list[str] = field(default_factory=list)  # what was done to a valid message
    verdict: str = "refuse"  # the oracle's word: refuse, accept or partial (never count)
    cancel_at: int | None = None  # Push: the client aborts the stream before this message
    prelude: list | None = None  # Push: sent first, a valid partial upload the case resumes
    prelude_acked: int = 0
    stay: bool = False  # Join: keep the new lease (else the fuzzer leaves at once)
    timeout: float = CALL_TIMEOUT_S
    hold_after: int | None = None  # Push: send this many messages, then hold the stream open
    second: list | None = None  # ... while this second push runs to its end
    second_ops: list[str] = field(default_factory=list)


@dataclass
class Finding:
    category: str  # crash, state_change, spec, echo, wrong_reply
    case_no: int
    case: Case
    outcome: str
    details: str
    extra: str = ""

    @property
    def signature(self) -> tuple:
        ops = tuple(sorted({o.split("(")[0] for o in self.case.ops}))
        return (self.category, self.case.kind, ops, self.outcome)


def _short(value, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else f"{text[:n]}...({len(value)} long)"


def _fmt_message(m, limit: int = 400) -> str:
    if isinstance(m, bytes | bytearray):
        return f"raw {len(m)} bytes: {bytes(m[:80]).hex()}" + ("..." if len(m) > 80 else "")
    if m is None:
        return "(undecodable)"
    text = text_format.MessageToString(m, as_one_line=True)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def describe(case: Case, max_messages: int = 14) -> str:
    head = f"kind={case.kind} method={case.method} ops={case.ops} oracle={case.verdict}"
    if case.cancel_at is not None:
        head += f" client_cancels_before_message={case.cancel_at}"
    lines = [head]
    if case.prelude is not None:
        lines.append(f"  prelude (acknowledged as partial, {case.prelude_acked} bytes):")
        lines += [f"    {_fmt_message(m)}" for m in case.prelude[:max_messages]]
        lines.append("  then:")
    msgs = case.request if isinstance(case.request, list) else [case.request]
    lines += [f"    {_fmt_message(m)}" for m in msgs[:max_messages]]
    if len(msgs) > max_messages:
        lines.append(f"    ... {len(msgs) - max_messages} more message(s)")
    if case.second is not None:
        lines.insert(len(lines) - len(msgs[:max_messages]) + case.hold_after, "    (held open)")
        lines.append("  the second stream, sent while the first was held open:")
        lines += [f"    {_fmt_message(m)}" for m in case.second[:max_messages]]
    return "\n".join(lines)


def _serialized(case: Case) -> dict:
    def enc(m):
        if m is None:
            return None
        raw = bytes(m) if isinstance(m, bytes | bytearray) else m.SerializeToString()
        if len(raw) > 1 << 20:
            return {"too_large_bytes": len(raw)}
        return base64.b64encode(raw).decode()

    msgs = case.request if isinstance(case.request, list) else [case.request]
    return {
        "kind": case.kind,
        "method": case.method,
        "raw": case.raw,
        "ops": case.ops,
        "cancel_at": case.cancel_at,
        "prelude": [enc(m) for m in case.prelude] if case.prelude is not None else None,
        "hold_after": case.hold_after,
        "second": [enc(m) for m in case.second] if case.second is not None else None,
        "messages": [enc(m) for m in msgs],
    }


@dataclass
class Report:
    seed: int
    cases: int = 0
    crashes: int = 0
    state_changes: int = 0
    elapsed_s: float = 0.0
    table: dict = field(default_factory=lambda: defaultdict(Counter))
    findings: list[Finding] = field(default_factory=list)
    log_tracebacks: list[str] = field(default_factory=list)
    status_bytes_max: int = 0
    stop_s: float = 0.0
    distinct: set = field(default_factory=set)
    skipped: Counter = field(default_factory=Counter)
    fuzzer_errors: list[str] = field(default_factory=list)
    flaky_restarts: int = 0
    workdir: Path | None = None

    def by_category(self, category: str) -> list[Finding]:
        return [f for f in self.findings if f.category == category]

    def table_lines(self) -> list[str]:
        codes = sorted({c for row in self.table.values() for c in row})
        kinds = [k for k in KINDS if k in self.table]
        kinds += sorted(k for k in self.table if k not in KINDS)
        width = max([len(k) for k in kinds] + [len("kind")])
        cols = [max(len(c), 5) for c in codes]
        heads = "  ".join(c.rjust(w) for c, w in zip(codes, cols, strict=True))
        lines = [f"{'kind'.ljust(width)}  {heads}  total"]
        for k in kinds:
            row = self.table[k]
            cells = "  ".join(str(row.get(c, 0)).rjust(w) for c, w in zip(codes, cols, strict=True))
            lines.append(f"{k.ljust(width)}  {cells}  {sum(row.values()):5d}")
        return lines

    def finding_lines(self, per_signature: int = 1) -> list[str]:
        groups: dict[tuple, list[Finding]] = defaultdict(list)
        for f in self.findings:
            groups[f.signature].append(f)
        lines = []
        for sig, items in sorted(groups.items(), key=lambda kv: (kv[0][0], -len(kv[1]))):
            category, kind, ops, outcome = sig
            lines.append(
                f"[{category}] {len(items)} case(s): kind={kind} ops={list(ops)} outcome={outcome}"
            )
            for f in items[:per_signature]:
                lines.append(f"  case #{f.case_no}: {f.extra}".rstrip())
                if f.details:
                    lines.append(f"  details: {_short(f.details, 300)}")
                lines += ["  " + line for line in describe(f.case).splitlines()]
        return lines

    def summary(self) -> str:
        return f"cases={self.cases} crashes={self.crashes} state_changes={self.state_changes}"


# ---- the fuzzer --------------------------------------------------------------------------------


class _Cancel(Exception):
    """Raised inside a request iterator: grpc then cancels the call (no half-close)."""


def _requests(items: list, cancel_at: int | None):
    for i, m in enumerate(items):
        if cancel_at is not None and i == cancel_at:
            raise _Cancel
        yield m
    if cancel_at is not None:
        raise _Cancel


def job_config() -> dict:
    return harness.job_config(
        name="fuzz",
        rounds={
            "total": 1_000_000,
            "inner_steps": 1,
            "min_sites": 1,
            "max_sites": 3,
            "join_window_s": 0.2,
            "deadline_s": 1e6,  # rounds close only on updates
        },
        timeouts={"heartbeat_interval_s": 1.0, "lease_ttl_s": TTL_S},
        server={"max_update_bytes": MAX_UPDATE_BYTES, "workers": 8},
    )


class Fuzzer:
    """One coordinator process, the fuzzer's two sites, the cases and the checks after each."""

    def __init__(self, workdir: Path, seed: int, out: Callable[[str], None] = print) -> None:
        self.workdir = Path(workdir)
        self.out = out
        self.report = Report(seed=seed, workdir=self.workdir)
        self.leases: dict[str, pb.Lease] = {}
        self.refreshed: dict[str, float] = {}
        self.extras: dict[str, tuple[pb.Lease, float]] = {}
        self.baseline: tuple | None = None
        self.r = 0
        self.published: tuple[int, bytes, bytes] | None = None  # version, theta hash, payload
        self.coord: harness.CoordinatorProcess | None = None
        self.channel: grpc.Channel | None = None
        self.findings_file = None
        self.progress_every = 0
        self.started = time.monotonic()
        self.kind_list = KIND_LIST
        self.skip_known_bugs = False
        self.previous: Case | None = None

    # ---- process and channel ------------------------------------------------------------------

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.findings_file = open(self.workdir / "findings.jsonl", "w")  # noqa: SIM115
        self.coord = harness.start_coordinator(self.workdir, job_config())
        self._connect()
        self.resync()

    def _connect(self) -> None:
        if self.channel is not None:
            self.channel.close()
        limits = ("grpc.max_send_message_length", "grpc.max_receive_message_length")
        options = [o for o in channel_options() if o[0] not in limits]
        options += [(name, -1) for name in limits]  # the fuzzer may send what no site would
        self.channel = grpc.insecure_channel(self.coord.address, options=options)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        ch = self.channel
        self.raw_calls = {
            "Join": ch.unary_unary(
                METHOD_PATH + "Join", None, response_deserializer=pb.JoinReply.FromString
            ),
            "Heartbeat": ch.unary_unary(
                METHOD_PATH + "Heartbeat", None, response_deserializer=pb.HeartbeatReply.FromString
            ),
            "Leave": ch.unary_unary(
                METHOD_PATH + "Leave", None, response_deserializer=pb.LeaveReply.FromString
            ),
            "Status": ch.unary_unary(
                METHOD_PATH + "Status", None, response_deserializer=pb.StatusReply.FromString
            ),
            "Fetch": ch.unary_stream(
                METHOD_PATH + "Fetch", None, response_deserializer=pb.FetchMessage.FromString
            ),
            "Push": ch.stream_unary(
                METHOD_PATH + "Push", None, response_deserializer=pb.PushReply.FromString
            ),
        }

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.coord is not None:
            t0 = time.monotonic()
            self.coord.stop()
            self.report.stop_s = time.monotonic() - t0
            rc = self.coord.proc.returncode if self.coord.proc else None
            if rc == -9:
                self.report.crashes += 1
                self.report.log_tracebacks.append(
                    "the coordinator did not exit within 10 s of SIGTERM and was killed (hang)"
                )
            elif rc not in (0, None):
                self.report.crashes += 1
                self.report.log_tracebacks.append(f"coordinator exited with status {rc}")
        if self.findings_file is not None:
            self.findings_file.close()
        self.scan_log()

    def scan_log(self) -> None:
        """Count tracebacks in the coordinator's log, except grpc's own log of a request that
        does not decode (the raw-byte cases send those on purpose)."""
        try:
            lines = self.coord.log_path.read_text(errors="replace").splitlines()
        except (OSError, AttributeError):
            return
        for i, line in enumerate(lines):
            if not line.startswith("Traceback (most recent call last)"):
                continue
            before = lines[i - 1] if i else ""
            if "Exception deserializing message!" in before:
                continue
            block = lines[max(i - 1, 0) : i + 30]
            end = next((j for j in range(1, len(block)) if block[j][:1] not in (" ", "T")), 30)
            self.report.log_tracebacks.append("\n".join(block[: end + 1]))
            self.report.crashes += 1

    # ---- leases and the clean open round -------------------------------------------------------

    def _join(self, name: str) -> None:
        try:
            reply = self.stub.Join(pb.JoinRequest(site=name), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            self._leave_extras()  # the fuzz sites took the slot: make room
            reply = self.stub.Join(pb.JoinRequest(site=name), timeout=CALL_TIMEOUT_S)
        self.leases[name] = reply.lease
        self.refreshed[name] = time.monotonic()

    def _heartbeat(self, name: str) -> pb.HeartbeatReply | None:
        try:
            reply = self.stub.Heartbeat(
                pb.HeartbeatRequest(lease=self.leases[name]), timeout=CALL_TIMEOUT_S
            )
        except grpc.RpcError:
            self._join(name)
            reply = self.stub.Heartbeat(
                pb.HeartbeatRequest(lease=self.leases[name]), timeout=CALL_TIMEOUT_S
            )
        self.refreshed[name] = time.monotonic()
        return reply

    def _status(self) -> pb.StatusReply:
        reply = self.stub.Status(pb.StatusRequest(), timeout=CALL_TIMEOUT_S)
        self.report.status_bytes_max = max(self.report.status_bytes_max, reply.ByteSize())
        return reply

    def ensure_leases(self, st_reply: pb.StatusReply) -> None:
        sites = {s.site: s for s in st_reply.sites}
        now = time.monotonic()
        for name in (SITE_A, SITE_B):
            s, lease = sites.get(name), self.leases.get(name)
            if lease is None or s is None or s.token != lease.token or s.lease_remaining_s < 3:
                self._join(name)
            elif now - self.refreshed.get(name, 0.0) > REFRESH_S:
                self._heartbeat(name)
        for name, (_, granted) in list(self.extras.items()):
            if now - granted > TTL_S + 3:  # certainly expired on the server by now
                del self.extras[name]

    def valid_leases(self) -> set[tuple[str, int]]:
        out = {(n, lease.token) for n, lease in self.leases.items()}
        return out | {(n, lease.token) for n, (lease, _) in self.extras.items()}

    def participant_leases(self) -> set[tuple[str, int]]:
        return {(n, lease.token) for n, lease in self.leases.items()}

    def _zero_push(self, name: str) -> None:
        d = {n: torch.zeros(shape) for n, shape in TRAINABLE.items()}
        manifest, payload = pack(d)
        header = pb.PushHeader(
            lease=self.leases[name],
            round=self.r,
            upload_id=f"resync-{time.monotonic_ns()}",
            manifest=manifest.to_proto(),
            weight=1.0,
            base_version=self.r,
        )
        msgs = [pb.PushMessage(header=header), pb.PushMessage(chunk=pb.Chunk(data=bytes(payload)))]
        # Refused when already delivered or not a participant: the caller looks again.
        with contextlib.suppress(grpc.RpcError):
            self.stub.Push(iter(msgs), timeout=CALL_TIMEOUT_S)

    def _leave_extras(self) -> None:
        for lease, _ in self.extras.values():
            with contextlib.suppress(grpc.RpcError):
                self.stub.Leave(pb.LeaveRequest(lease=lease), timeout=CALL_TIMEOUT_S)
        self.extras.clear()

    def resync(self) -> None:
        """Bring the job to an open round with both sites as participants and no update in."""
        self._leave_extras()
        deadline = time.monotonic() + 2 * TTL_S + 30
        while time.monotonic() < deadline:
            self.ensure_leases(self._status())
            part = {n: self._heartbeat(n).round for n in (SITE_A, SITE_B)}
            st_reply = self._status()
            self.r = st_reply.round.round
            if all(p.participant for p in part.values()) and st_reply.updates_received == 0:
                self.baseline = (st_reply.round.round, st_reply.round.theta_hash, 0)
                if self.published is None or self.published[0] != self.r:
                    self.published = self._fetch_theta()
                return
            pushed = False
            for name, info in part.items():
                if info.participant:
                    self._zero_push(name)
                    pushed = True
            time.sleep(0.05 if pushed else 0.1)
        raise RuntimeError("the fuzzer could not bring the job back to a clean open round")

    def _fetch_theta(self) -> tuple[int, bytes, bytes]:
        header, data = None, bytearray()
        request = pb.FetchRequest(lease=self.leases[SITE_A])
        for msg in self.stub.Fetch(request, timeout=CALL_TIMEOUT_S):
            if msg.HasField("header"):
                header = msg.header
            else:
                data += msg.chunk.data
        return header.version, bytes(header.theta_hash), bytes(data)

    def recover(self) -> None:
        """After the server died or stopped answering: restart it on its state and resync."""
        if self.coord.proc.poll() is None:
            try:
                self._status()
            except grpc.RpcError:
                self.coord.kill()
        if self.coord.proc.poll() is not None:
            self.coord.restart()
            self._connect()
            self.leases.clear()
        self.resync()

    # ---- one case -----------------------------------------------------------------------------

    def one_case(self, data, target: int) -> None:
        if self.report.cases >= target:
            return
        kind = data.draw(st.sampled_from(self.kind_list))
        try:
            case = getattr(self, f"gen_{kind}")(data)
        except HypothesisException:
            raise
        except Exception:  # a bug of the fuzzer itself: show it, keep fuzzing the server
            self.report.fuzzer_errors.append(f"generating a {kind} case:\n{traceback.format_exc()}")
            return
        case.kind = kind
        bug = known_bug(case) if self.skip_known_bugs else None
        if bug is not None:
            self.report.skipped[bug] += 1
            return
        self.run_case(case)
        n = self.report.cases
        if self.progress_every and n % self.progress_every == 0:
            self.out(
                f"[fuzz] {n}/{target} cases  crashes={self.report.crashes} "
                f"state_changes={self.report.state_changes}  "
                f"{time.monotonic() - self.started:.1f}s"
            )

    def _call(self, case: Case) -> tuple[str, str, object]:
        method = case.method
        try:
            if method == "Push":
                call = self.raw_calls["Push"] if case.raw else self.stub.Push
                reply = call(_requests(case.request, case.cancel_at), timeout=case.timeout)
            elif method == "Fetch":
                call = self.raw_calls["Fetch"] if case.raw else self.stub.Fetch
                reply = list(call(case.request, timeout=case.timeout))
            else:
                call = self.raw_calls[method] if case.raw else getattr(self.stub, method)
                reply = call(case.request, timeout=case.timeout)
            return "OK", "", reply
        except grpc.RpcError as exc:
            return (*_label(exc, case), None)

    def _call_concurrent(self, case: Case) -> tuple[str, str, object, str, str]:
        """Stream 1 sends ``hold_after`` messages and waits; once the server has taken them,
        stream 2 (``case.second``) runs to its end; then stream 1 sends the rest."""
        hold = threading.Event()
        items, k = case.request, case.hold_after

        def first():
            yield from items[:k]
            hold.wait(CALL_TIMEOUT_S)
            yield from items[k:]

        prefix = sum(len(m.chunk.data) for m in items[:k] if m.WhichOneof("kind") == "chunk")
        before = self._status().wan_bytes_in
        future = self.stub.Push.future(first(), timeout=CALL_TIMEOUT_S + 5)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not future.done():
            if self._status().wan_bytes_in >= before + prefix:
                break
            time.sleep(0.002)
        label2, details2, _ = self._call(Case(case.kind, "Push", case.second))
        hold.set()
        try:
            return "OK", "", future.result(), label2, details2
        except grpc.RpcError as exc:
            return (*_label(exc, case), None, label2, details2)

    def finding(self, category: str, case: Case, outcome: str, details: str, extra: str = ""):
        f = Finding(category, self.report.cases, case, outcome, details, extra)
        self.report.findings.append(f)
        if self.findings_file is not None:
            record = {"category": category, "case_no": f.case_no, "outcome": outcome}
            record |= {"details": details[:2000], "extra": extra, "case": _serialized(case)}
            self.findings_file.write(json.dumps(record) + "\n")
            self.findings_file.flush()

    def run_case(self, case: Case) -> None:
        self.report.cases += 1
        self.report.distinct.add(hashlib.sha256(repr(_serialized(case)).encode()).digest()[:8])
        if case.prelude is not None:
            try:
                reply = self.stub.Push(iter(case.prelude), timeout=CALL_TIMEOUT_S)
                if reply.complete or reply.acked_offset != case.prelude_acked:
                    self.finding("wrong_reply", case, "OK", "", f"prelude answered {reply}")
            except grpc.RpcError as exc:
                self.finding("wrong_reply", case, exc.code().name, exc.details() or "", "prelude")
        allowed = ALLOWED | ({DESERIALIZE} if case.raw else set())
        allowed |= {CLIENT_CANCEL} if case.cancel_at is not None else set()
        outcomes = []
        if case.second is None:
            label, details, reply = self._call(case)
        else:
            label, details, reply, label2, details2 = self._call_concurrent(case)
            outcomes.append((f"{case.kind}(2nd)", label2, details2, "the second stream: "))
        outcomes.insert(0, (case.kind, label, details, ""))
        for row, code, text, which in outcomes:
            self.report.table[row][code] += 1
            if code not in allowed:
                self.report.crashes += 1
                self.finding("crash", case, code, text, which + "a status outside the allowed set")
            if len(text) > BIG_DETAILS or "metadata size exceeds" in text:
                self.finding("echo", case, code, text, f"{which}refusal of {len(text)} chars")
        if label == "OK":
            self.after_ok(case, reply)
        if case.method == "Push" and label in (DESERIALIZE, CLIENT_CANCEL):
            # The client has its answer, but the server's handler may still be running.
            time.sleep(SETTLE_S)
        self.check_state(case, label, details)
        self.previous = case

    def after_ok(self, case: Case, reply) -> None:
        if case.method == "Join":
            lease = reply.lease
            if case.verdict == "refuse" and not case.raw:
                self.finding("spec", case, "OK", "", f"Join admitted site {lease.site!r}")
            if lease.site in (SITE_A, SITE_B):
                self.leases[lease.site] = lease
                self.refreshed[lease.site] = time.monotonic()
            elif case.stay:
                self.extras[lease.site] = (lease, time.monotonic())
            else:
                self.extras.pop(lease.site, None)
                with contextlib.suppress(grpc.RpcError):
                    self.stub.Leave(pb.LeaveRequest(lease=lease), timeout=CALL_TIMEOUT_S)
        elif case.method in ("Heartbeat", "Leave"):
            if case.verdict == "refuse" and not case.raw:
                self.finding("spec", case, "OK", "", f"{case.method} with an invalid lease")
            site = None if case.raw else case.request.lease.site
            if case.method == "Leave":
                self.extras.pop(site, None)
            elif site in self.extras:
                self.extras[site] = (self.extras[site][0], time.monotonic())
        elif case.method == "Fetch":
            request = case.request
            if case.raw:
                try:
                    request = pb.FetchRequest.FromString(case.request)
                except DecodeError:
                    return
            elif case.verdict == "refuse":
                self.finding("spec", case, "OK", "", "Fetch served an invalid request")
                return
            problem = self.check_fetch(request, reply)
            if problem:
                self.finding("wrong_reply", case, "OK", "", problem)

    def check_fetch(self, request: pb.FetchRequest, msgs: list) -> str | None:
        version, theta_hash, payload = self.published
        if not msgs or not msgs[0].HasField("header"):
            return "the stream does not start with a header"
        h = msgs[0].header
        if h.version != version or bytes(h.theta_hash) != theta_hash:
            return f"header names version {h.version}, expected {version}"
        offset, data = request.offset, bytearray()
        for m in msgs[1:]:
            if m.HasField("header") or m.chunk.offset != offset + len(data):
                return "chunks out of order"
            data += m.chunk.data
        if bytes(data) != payload[offset:]:
            return f"{len(data)} bytes served from offset {offset} differ from theta's payload"
        return None

    def check_state(self, case: Case, label: str, details: str) -> None:
        alive = self.coord.proc.poll() is None
        st_reply, err = None, ""
        if alive:
            try:
                st_reply = self._status()
            except grpc.RpcError as exc:
                err = f"Status failed: {exc.code().name} {exc.details()}"
        if st_reply is None:
            self.report.crashes += 1
            what = err or f"coordinator process exited ({self.coord.proc.returncode})"
            self.finding("crash", case, label, details, what)
            self.recover()
            return
        now = (st_reply.round.round, st_reply.round.theta_hash, st_reply.updates_received)
        if now != self.baseline:
            self.report.state_changes += 1
            extra = (
                f"round {self.baseline[0]}->{now[0]}, updates {self.baseline[2]}->{now[2]}, "
                f"theta {'changed' if now[1] != self.baseline[1] else 'same'}"
            )
            if self.previous is not None:
                extra += f" (the case before: {self.previous.kind} {self.previous.ops})"
            self.finding("state_change", case, label, details, extra)
            self.resync()
            return
        self.ensure_leases(st_reply)

    # ---- building blocks for cases -------------------------------------------------------------

    def _lease_copy(self, name: str) -> pb.Lease:
        lease = pb.Lease()
        lease.CopyFrom(self.leases[name])
        return lease

    def draw_lease(self, data) -> tuple[pb.Lease | None, str]:
        a = self._lease_copy(SITE_A)
        mode = data.draw(
            st.sampled_from(
                ["a"] * 4 + ["a_ignored", "a_token", "other_site", "b", "extra", "random", "absent"]
            )
        )
        if mode == "a":
            return a, "lease=a"
        if mode == "a_ignored":
            a.ttl_s, a.lease_id = data.draw(DOUBLES), data.draw(U64)
            return a, "lease=a_ignored_fields"
        if mode == "a_token":
            t = a.token
            a.token = data.draw(
                st.sampled_from([_u64(x) for x in (t - 1, t + 1, t + 2**32, t - 2**32, 0, t ^ 1)])
                | U64.filter(lambda x: x != t)
            )
            return a, f"lease_token({a.token})"
        if mode == "other_site":
            a.site = data.draw(NAMES | st.sampled_from([SITE_B, SITE_A.upper(), SITE_A + "\n"]))
            return a, f"lease_site({_short(a.site)})"
        if mode == "b":
            return self._lease_copy(SITE_B), "lease=b"
        if mode == "extra":
            pick = data.draw(st.integers(0, 7))  # drawn whatever the state (see _index)
            if self.extras:
                name = sorted(self.extras)[pick % len(self.extras)]
                lease = pb.Lease()
                lease.CopyFrom(self.extras[name][0])
                return lease, "lease=extra"
            return a, "lease=a"
        if mode == "random":
            lease = pb.Lease(site=data.draw(NAMES), lease_id=data.draw(U64), token=data.draw(U64))
            lease.ttl_s = data.draw(DOUBLES)
            return lease, "lease=random"
        return None, "lease=absent"

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

    # ---- case generators (one per kind) ---------------------------------------------------------

    def gen_join(self, data) -> Case:
        site = data.draw(NAMES | st.sampled_from([SITE_A, SITE_B]))
        req = pb.JoinRequest(site=site)
        if data.draw(st.booleans()):
            req.capabilities.CopyFrom(
                pb.Capabilities(
                    codecs=data.draw(st.lists(TEXT, max_size=4)),
                    world_size=data.draw(U32),
                    num_examples=data.draw(U64),
                )
            )
        if data.draw(st.booleans()):
            req.have_version = data.draw(U64)
        req.have_hash = data.draw(st.binary(max_size=64))
        verdict = "accept" if SPEC_NAME.fullmatch(site) else "refuse"
        stay = data.draw(st.booleans())
        return Case("", "Join", req, ops=[f"site({_short(site)})"], verdict=verdict, stay=stay)

    def _lease_verdict(self, lease: pb.Lease | None) -> str:
        if lease is None:
            return "refuse"
        return "accept" if (lease.site, lease.token) in self.valid_leases() else "refuse"

    def gen_heartbeat(self, data) -> Case:
        lease, note = self.draw_lease(data)
        req = pb.HeartbeatRequest()
        if lease is not None:
            req.lease.CopyFrom(lease)
        if data.draw(st.booleans()):
            req.progress.CopyFrom(
                pb.Progress(
                    round=data.draw(U64),
                    inner_step=data.draw(U32),
                    train_loss=data.draw(DOUBLES),
                    phase=data.draw(TEXT | HUGE_TEXT),
                )
            )
        return Case("", "Heartbeat", req, ops=[note], verdict=self._lease_verdict(lease))

    def gen_fetch(self, data) -> Case:
        lease, note = self.draw_lease(data)
        total = len(self.published[2])
        req = pb.FetchRequest()
        if lease is not None:
            req.lease.CopyFrom(lease)
        ops = [note]
        version_mode = data.draw(st.sampled_from(["absent", "absent", "current", "other"]))
        if version_mode == "current":
            req.version = self.r
        elif version_mode == "other":
            req.version = data.draw(st.sampled_from([self.r + 1, U64_MAX]) | U64)
            ops.append(f"version({req.version})")
        if data.draw(st.booleans()):
            req.from_version = data.draw(U64)
        req.offset = data.draw(
            st.sampled_from([0, 0, total, total + 1, U64_MAX]) | st.integers(0, total) | U64
        )
        ops.append(f"offset({req.offset})")
        ok = (
            self._lease_verdict(lease) == "accept"
            and (not req.HasField("version") or req.version == self.r)
            and req.offset <= total
        )
        return Case("", "Fetch", req, ops=ops, verdict="accept" if ok else "refuse")

    def gen_leave(self, data) -> Case:
        lease, note = self.draw_lease(data)
        req = pb.LeaveRequest(reason=data.draw(TEXT | HUGE_TEXT))
        if lease is not None:
            req.lease.CopyFrom(lease)
        return Case("", "Leave", req, ops=[note], verdict=self._lease_verdict(lease))

    def gen_status(self, data) -> Case:
        mode = data.draw(st.sampled_from(["typed", "unknown_fields", "random_bytes"]))
        if mode == "typed":
            return Case("", "Status", pb.StatusRequest(), verdict="accept")
        raw = data.draw(unknown_fields() if mode == "unknown_fields" else st.binary(max_size=64))
        return Case("", "Status", raw, raw=True, ops=[mode], verdict="accept")

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
        header.manifest.sha256 = data.draw(
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
        header.manifest.sha256 = hashlib.sha256(payload).digest()
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
            bytes(header.manifest.sha256),
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


# ---- push mutation ops: each alters ``msgs`` in place and returns a note -------------------------


def _label(exc: grpc.RpcError, case: Case) -> tuple[str, str]:
    """The table's name for a failed call's outcome, and its details."""
    code, details = exc.code(), exc.details() or ""
    label = code.name if code is not None else "NONE"
    if code is grpc.StatusCode.INTERNAL and details == "Exception deserializing request!":
        label = DESERIALIZE
    if case.cancel_at is not None and (
        code is grpc.StatusCode.CANCELLED
        or (code is grpc.StatusCode.UNKNOWN and details == "Exception iterating requests!")
    ):
        label = CLIENT_CANCEL
    return label, details


def _copy(m):
    out = type(m)()
    out.CopyFrom(m)
    return out


def _decode(cls, raw: bytes):
    try:
        return cls.FromString(raw)
    except DecodeError:
        return None


def _header(msgs: list) -> pb.PushHeader | None:
    for m in msgs:
        if m.WhichOneof("kind") == "header":
            return m.header
    return None


def _chunk_indices(msgs: list) -> list[int]:
    return [i for i, m in enumerate(msgs) if m.WhichOneof("kind") == "chunk"]


def _needs_header(fn):
    @functools.wraps(fn)
    def op(fz: Fuzzer, data, msgs):
        h = _header(msgs)
        return fn(fz, data, msgs, h) if h is not None else f"{fn.__name__}(no header left)"

    return op


def _needs_chunk(fn):
    @functools.wraps(fn)
    def op(fz: Fuzzer, data, msgs):
        idx = _chunk_indices(msgs)
        if not idx:
            return f"{fn.__name__}(no chunk left)"
        return fn(fz, data, msgs, idx)

    return op


def _needs_tensor(fn):
    @functools.wraps(fn)
    def op(fz: Fuzzer, data, msgs, h):
        if not h.manifest.tensors:
            return f"{fn.__name__}(no tensor left)"
        i = data.draw(st.integers(0, len(h.manifest.tensors) - 1))
        return fn(fz, data, h.manifest, i)

    return _needs_header(op)


@_needs_header
def lease_site(fz, data, msgs, h):
    h.lease.site = data.draw(
        NAMES | st.sampled_from([SITE_B, "", SITE_A.upper(), SITE_A + "\n", " " + SITE_A])
    )
    return f"lease_site({_short(h.lease.site)})"


@_needs_header
def lease_token(fz, data, msgs, h):
    t = h.lease.token
    choices = [t - 1, t + 1, t + 2**32, t - 2**32, 0, U64_MAX, fz.leases[SITE_B].token]
    h.lease.token = data.draw(st.sampled_from([_u64(c) for c in choices]) | U64)
    return f"lease_token({h.lease.token})"


@_needs_header
def lease_absent(fz, data, msgs, h):
    h.ClearField("lease")
    return "lease_absent"


@_needs_header
def lease_ignored_fields(fz, data, msgs, h):
    h.lease.ttl_s, h.lease.lease_id = data.draw(DOUBLES), data.draw(U64)
    return f"lease_ignored_fields(ttl_s={h.lease.ttl_s}, lease_id={h.lease.lease_id})"


@_needs_header
def lease_of_other_site(fz, data, msgs, h):
    names = [SITE_B, *sorted(fz.extras)]
    name = names[data.draw(st.integers(0, 7)) % len(names)]
    h.lease.CopyFrom(fz.leases[name] if name in fz.leases else fz.extras[name][0])
    return f"lease_of_other_site({name})"


@_needs_header
def round_number(fz, data, msgs, h):
    r = h.round
    choices = [r + 1, r - 1 if r else U64_MAX, r + 2**32, U64_MAX]
    h.round = data.draw(st.sampled_from([_u64(c) for c in choices]) | U64)
    if data.draw(st.booleans()):
        h.base_version = h.round
    return f"round({h.round}, base_version={h.base_version})"


@_needs_header
def base_version(fz, data, msgs, h):
    v = h.base_version
    choices = [v + 1, v - 1 if v else U64_MAX, U64_MAX]
    h.base_version = data.draw(st.sampled_from([_u64(c) for c in choices]) | U64)
    return f"base_version({h.base_version})"


@_needs_header
def upload_id(fz, data, msgs, h):
    base = h.upload_id
    uid = data.draw(
        st.builds(_near, st.just(base), st.sampled_from(ODD), st.integers(0, 2))
        | NAMES
        | st.sampled_from(["", "../../etc/passwd", "a" * 64, base + "+x", base + "/x"])
    )
    if SPEC_NAME.fullmatch(uid) and uid != base:
        uid = f"{uid[:50]}-{fz.report.cases + 1}"  # a valid id is kept unique to the case
    h.upload_id = uid
    return f"upload_id({_short(uid)})"


@_needs_header
def weight(fz, data, msgs, h):
    h.weight = data.draw(DOUBLES)
    return f"weight({h.weight!r})"


@_needs_header
def data_unit(fz, data, msgs, h):
    h.data_unit = data.draw(TEXT | HUGE_TEXT)
    return f"data_unit({_short(h.data_unit)})"


@_needs_header
def manifest_absent(fz, data, msgs, h):
    h.ClearField("manifest")
    return "manifest_absent"


@_needs_header
def total_bytes(fz, data, msgs, h):
    t = h.manifest.total_bytes
    choices = [0, t - 1, t + 1, t + 64, MAX_UPDATE_BYTES, MAX_UPDATE_BYTES + 1, U64_MAX]
    h.manifest.total_bytes = data.draw(
        st.sampled_from([_u64(c) for c in choices]) | st.integers(0, 5000) | U64
    )
    return f"total_bytes({h.manifest.total_bytes})"


@_needs_header
def sha256(fz, data, msgs, h):
    sha = bytearray(h.manifest.sha256)
    mode = data.draw(st.sampled_from(["truncate", "extend", "flip", "random", "empty"]))
    if mode == "truncate":
        sha = sha[: data.draw(st.integers(0, 31))]
    elif mode == "extend":
        sha += data.draw(st.binary(min_size=1, max_size=32))
    elif mode == "flip" and sha:
        i = data.draw(st.integers(0, len(sha) - 1))
        sha[i] ^= 1 << data.draw(st.integers(0, 7))
    elif mode == "random":
        sha = bytearray(data.draw(st.binary(min_size=32, max_size=32)))
    else:
        sha = bytearray()
    h.manifest.sha256 = bytes(sha)
    return f"sha256({mode}, {len(sha)} bytes)"


@_needs_tensor
def tensor_field(fz, data, m, i):
    t = m.tensors[i]
    what = data.draw(
        st.sampled_from(["name", "dtype", "shape", "offset", "nbytes", "codec", "codec_meta"])
    )
    if what == "name":
        t.name = data.draw(
            st.sampled_from(
                ["lin.bias", "lin.weight", "seen", "lin", "lin.bias ", "lin.bias\x00", "LIN.BIAS"]
                + ["lin.weight.x", "", "\u200blin.bias", "lin\nbias"]
            )
            | TEXT
        )
        value = _short(t.name)
    elif what == "dtype":
        t.dtype = data.draw(
            st.sampled_from(
                [*WIRE_DTYPES, "float", "torch.float32", "Float32", "float32 ", "complex64"]
                + ["float8_e4m3fn", "", "uint16", "float32\x00"]
            )
            | TEXT
        )
        value = _short(t.dtype)
    elif what == "shape":
        shape = list(t.shape)
        new = data.draw(
            st.sampled_from(
                [shape[::-1], [*shape, 1], [1, *shape], [math.prod(shape)], [], [-s for s in shape]]
                + [[0, *shape], [2**31, 2**31], [2**62, 4], [-1, -1]]
            )
            | st.lists(st.sampled_from([16, 8, 1, 0, -1, -16, 128, 2**31, 2**62]) | I64, max_size=6)
        )
        new = [_i64(d) for d in new]
        del t.shape[:]
        t.shape.extend(new)
        value = str(new)
    elif what in ("offset", "nbytes"):
        v = getattr(t, what)
        choices = [0, v + 1, v - 1, v + 4, v * 2, m.total_bytes, 2**63, U64_MAX]
        new = data.draw(st.sampled_from([_u64(c) for c in choices]) | st.integers(0, 5000) | U64)
        setattr(t, what, new)
        value = str(new)
    elif what == "codec":
        t.codec = data.draw(
            st.sampled_from(["", "None", "NONE", "none ", "zstd", "int8", "topk", "none\x00"])
            | TEXT
        )
        value = _short(t.codec)
    else:
        t.codec_meta = data.draw(st.binary(max_size=64))
        value = f"{len(t.codec_meta)} bytes"
    return f"tensor_field({t.name[:20]!r}.{what}={value})"


@_needs_tensor
def tensor_drop(fz, data, m, i):
    name = m.tensors[i].name
    del m.tensors[i]
    return f"tensor_drop({name})"


@_needs_tensor
def tensor_duplicate(fz, data, m, i):
    t = m.tensors.add()
    t.CopyFrom(m.tensors[i])
    if data.draw(st.booleans()):
        t.offset = m.total_bytes
        m.total_bytes = _u64(m.total_bytes + t.nbytes)
    return f"tensor_duplicate({t.name})"


@_needs_header
def tensor_extra(fz, data, msgs, h):
    m = h.manifest
    name = data.draw(st.sampled_from(["seen", "lin.extra", "lin.bias.grad", "seen "]) | TEXT)
    dtype = data.draw(st.sampled_from(["float32", "int64"]))
    n = 3 * (4 if dtype == "float32" else 8)
    offset = _u64((m.total_bytes + 63) // 64 * 64)
    m.tensors.add(name=name, dtype=dtype, shape=[3], codec="none", offset=offset, nbytes=n)
    if data.draw(st.booleans()):
        m.total_bytes = _u64(offset + n)
    return f"tensor_extra({_short(name)}, {dtype})"


@_needs_header
def tensor_reorder(fz, data, msgs, h):
    entries = [_copy(t) for t in h.manifest.tensors][::-1]
    del h.manifest.tensors[:]
    h.manifest.tensors.extend(entries)
    return "tensor_reorder"


@_needs_header
def tensor_swap_names(fz, data, msgs, h):
    ts = h.manifest.tensors
    if len(ts) < 2:
        return "tensor_swap_names(fewer than 2)"
    ts[0].name, ts[1].name = ts[1].name, ts[0].name
    return "tensor_swap_names"


@_needs_header
def tensors_clear(fz, data, msgs, h):
    del h.manifest.tensors[:]
    return "tensors_clear"


@_needs_header
def relabel_dtype(fz, data, msgs, h):
    """Every tensor labelled with another update dtype, nbytes made consistent: the bytes
    sent are the old dtype's (a manifest that lies about the payload)."""
    dtype = data.draw(st.sampled_from(sorted(UPDATE_ITEMSIZE)))
    for t in h.manifest.tensors:
        t.dtype = dtype
        t.nbytes = _u64(math.prod(t.shape) * UPDATE_ITEMSIZE[dtype])
    return f"relabel_dtype({dtype})"


@_needs_chunk
def flip_byte(fz, data, msgs, idx):
    idx = [i for i in idx if msgs[i].chunk.data]
    if not idx:
        return "flip_byte(no data left)"
    i = data.draw(st.sampled_from(idx))
    d = bytearray(msgs[i].chunk.data)
    pos = data.draw(st.integers(0, len(d) - 1))
    d[pos] ^= 1 << data.draw(st.integers(0, 7))
    msgs[i].chunk.data = bytes(d)
    return f"flip_byte(chunk at {msgs[i].chunk.offset}, +{pos})"


@_needs_chunk
def random_data(fz, data, msgs, idx):
    idx = [i for i in idx if msgs[i].chunk.data]
    if not idx:
        return "random_data(no data left)"
    i = data.draw(st.sampled_from(idx))
    n = len(msgs[i].chunk.data)
    msgs[i].chunk.data = data.draw(st.binary(min_size=n, max_size=n))
    return f"random_data(chunk at {msgs[i].chunk.offset})"


@_needs_chunk
def chunk_offset(fz, data, msgs, idx):
    i = data.draw(st.sampled_from(idx))
    c = msgs[i].chunk
    old = c.offset
    choices = [old + 1, old - 1, 0, old + len(c.data), 2**63, U64_MAX]
    c.offset = data.draw(st.sampled_from([_u64(c) for c in choices]) | st.integers(0, 1000) | U64)
    return f"chunk_offset({old}->{c.offset})"


@_needs_chunk
def drop_chunk(fz, data, msgs, idx):
    i = data.draw(st.sampled_from(idx))
    offset = msgs[i].chunk.offset
    del msgs[i]
    return f"drop_chunk(at {offset})"


@_needs_chunk
def duplicate_chunk(fz, data, msgs, idx):
    i = data.draw(st.sampled_from(idx))
    at = data.draw(st.integers(1, len(msgs)))
    msgs.insert(at, _copy(msgs[i]))
    return f"duplicate_chunk(at {msgs[at].chunk.offset} to position {at})"


@_needs_chunk
def swap_chunks(fz, data, msgs, idx):
    if len(idx) < 2:
        return "swap_chunks(fewer than 2)"
    i, j = data.draw(st.lists(st.sampled_from(idx), min_size=2, max_size=2, unique=True))
    msgs[i], msgs[j] = msgs[j], msgs[i]
    return f"swap_chunks({i}, {j})"


def empty_chunk(fz, data, msgs):
    at = data.draw(st.integers(1 if msgs else 0, max(len(msgs), 1)))
    offset = data.draw(st.sampled_from([0, 64]) | U64)
    msgs.insert(at, pb.PushMessage(chunk=pb.Chunk(offset=offset, data=b"")))
    return f"empty_chunk(offset {offset}, position {at})"


@_needs_chunk
def truncate_stream(fz, data, msgs, idx):
    keep = data.draw(st.integers(1, len(msgs) - 1)) if len(msgs) > 1 else 1
    del msgs[keep:]
    return f"truncate_stream(keep {keep} message(s))"


@_needs_chunk
def extend_last_chunk(fz, data, msgs, idx):
    c = msgs[idx[-1]].chunk
    c.data = c.data + data.draw(st.binary(min_size=1, max_size=64))
    return f"extend_last_chunk(to {len(c.data)} bytes)"


@_needs_chunk
def extra_chunk(fz, data, msgs, idx):
    last = msgs[idx[-1]].chunk
    offset = data.draw(st.sampled_from([_u64(last.offset + len(last.data))]) | U64)
    extra = data.draw(st.binary(min_size=1, max_size=64))
    msgs.append(pb.PushMessage(chunk=pb.Chunk(offset=offset, data=extra)))
    return f"extra_chunk(offset {offset}, {len(extra)} bytes)"


@_needs_chunk
def resplit(fz, data, msgs, idx):
    """Valid on its own: the same bytes in chunks of another size."""
    start = min(msgs[idx[0]].chunk.offset, U64_MAX - 4096)
    payload = b"".join(msgs[i].chunk.data for i in idx)
    size = data.draw(st.integers(1, 700))
    for i in reversed(idx):
        del msgs[i]
    msgs.extend(
        pb.PushMessage(chunk=pb.Chunk(offset=start + o, data=payload[o : o + size]))
        for o in range(0, len(payload), size)
    )
    return f"resplit({size})"


@_needs_header
def drop_header(fz, data, msgs, h):
    del msgs[next(i for i, m in enumerate(msgs) if m.WhichOneof("kind") == "header")]
    return "drop_header"


@_needs_header
def second_header(fz, data, msgs, h):
    other = pb.PushMessage()
    other.header.CopyFrom(h)
    if data.draw(st.booleans()):
        other.header.upload_id = h.upload_id + "b"
    at = data.draw(st.integers(1, len(msgs)))
    msgs.insert(at, other)
    return f"second_header(position {at})"


@_needs_header
def move_header(fz, data, msgs, h):
    i = next(i for i, m in enumerate(msgs) if m.WhichOneof("kind") == "header")
    m = msgs.pop(i)
    at = data.draw(st.integers(1, len(msgs))) if msgs else 0
    msgs.insert(at, m)
    return f"move_header(position {at})"


def empty_message(fz, data, msgs):
    at = data.draw(st.integers(0, len(msgs)))
    msgs.insert(at, pb.PushMessage())
    return f"empty_message(position {at})"


def only_header(fz, data, msgs):
    del msgs[1:]
    return "only_header"


def empty_stream(fz, data, msgs):
    msgs.clear()
    return "empty_stream"


def _by_name(*fns: Callable) -> dict[str, Callable]:
    return {fn.__name__: fn for fn in fns}


OPS: dict[str, dict[str, Callable]] = {
    "header": _by_name(
        lease_site,
        lease_token,
        lease_absent,
        lease_ignored_fields,
        lease_of_other_site,
        round_number,
        base_version,
        upload_id,
        weight,
        data_unit,
        manifest_absent,
    ),
    "manifest": _by_name(
        total_bytes,
        sha256,
        tensor_field,
        tensor_drop,
        tensor_duplicate,
        tensor_extra,
        tensor_reorder,
        tensor_swap_names,
        tensors_clear,
        relabel_dtype,
    ),
    "chunks": _by_name(
        flip_byte,
        random_data,
        chunk_offset,
        drop_chunk,
        duplicate_chunk,
        swap_chunks,
        empty_chunk,
        truncate_stream,
        extend_last_chunk,
        extra_chunk,
        resplit,
    ),
    "structure": _by_name(
        drop_header, second_header, move_header, empty_message, only_header, empty_stream
    ),
}
OPS["manifest"]["tensor_field2"] = tensor_field  # the richest op: drawn twice as often


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


# ---- running ------------------------------------------------------------------------------------


def run(
    cases: int = 10_000,
    seed: int | None = None,
    workdir: Path | None = None,
    progress_every: int = 1000,
    out: Callable[[str], None] = print,
    keep: bool = False,
    kinds: list[str] | None = None,
    skip_known_bugs: bool = False,
) -> Report:
    """Fuzz a fresh coordinator with ``cases`` cases; returns the report (see ``Report``)."""
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
    tmp = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="isthmus-fuzz-")) if tmp else Path(workdir)
    logging.getLogger("grpc._channel").setLevel(logging.CRITICAL)  # our own aborted iterators
    fz = Fuzzer(workdir, seed, out)
    if progress_every:
        out(f"[fuzz] seed={seed} cases={cases} workdir={workdir}")
    fz.progress_every = progress_every
    fz.skip_known_bugs = skip_known_bugs
    if kinds:
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown case kinds {sorted(unknown)}; known: {list(KINDS)}")
        fz.kind_list = [k for k in KIND_LIST if k in kinds]
    started = fz.started = time.monotonic()
    fz.start()
    try:
        batch_seed = seed
        while fz.report.cases < cases:
            before = fz.report.cases

            @settings(
                max_examples=cases - fz.report.cases,
                deadline=None,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
                print_blob=False,
            )
            @given(st.data())
            def drive(data):
                fz.one_case(data, cases)

            try:
                hypothesis_seed(batch_seed)(drive)()
            except FlakyStrategyDefinition:
                # Hypothesis saw one prefix of choices draw differently (a draw that depends
                # on outside state slipped in): go on with the next seed.
                fz.report.flaky_restarts += 1
            batch_seed += 1
            if fz.report.cases == before:
                raise RuntimeError("hypothesis generated no case")
    finally:
        fz.stop()
    fz.report.elapsed_s = time.monotonic() - started
    report = fz.report
    if tmp and not keep and report.crashes == 0 and report.state_changes == 0:
        shutil.rmtree(workdir, ignore_errors=True)
        report.workdir = None
    return report


def print_report(report: Report, out: Callable[[str], None] = print) -> None:
    out("")
    out(f"kinds x outcomes ({report.cases} cases, {report.elapsed_s:.1f}s, seed {report.seed}):")
    for line in report.table_lines():
        out("  " + line)
    if report.findings:
        out("")
        out("findings (one reproducer per signature; all in findings.jsonl):")
        for line in report.finding_lines():
            out("  " + line)
    for tb in report.log_tracebacks:
        out("coordinator log:")
        out("  " + tb.replace("\n", "\n  "))
    for err in report.fuzzer_errors[:3]:
        out("FUZZER ERROR (a bug of bench/fuzz.py, not of the server):")
        out("  " + err.replace("\n", "\n  "))
    counts = Counter(f.category for f in report.findings)
    out("")
    out(
        f"seed={report.seed} elapsed_s={report.elapsed_s:.1f} "
        f"cases_per_s={report.cases / max(report.elapsed_s, 1e-9):.0f} "
        f"log_tracebacks={len(report.log_tracebacks)} "
        f"echo_warnings={counts['echo']} spec_warnings={counts['spec']} "
        f"wrong_replies={counts['wrong_reply']} max_status_reply_bytes={report.status_bytes_max} "
        f"coordinator_stop_s={report.stop_s:.1f} distinct_cases={len(report.distinct)} "
        f"fuzzer_errors={len(report.fuzzer_errors)} hypothesis_restarts={report.flaky_restarts}"
        + "".join(f" skipped_{bug}={n}" for bug, n in sorted(report.skipped.items()))
    )
    if report.workdir is not None:
        out(f"workdir={report.workdir} (coordinator.log, findings.jsonl)")
    out(report.summary())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=10_000, help="cases to run (default 10000)")
    p.add_argument("--seed", type=int, help="hypothesis seed (default: random, printed)")
    p.add_argument("--workdir", type=Path, help="folder for the coordinator (default: temp)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    p.add_argument("--progress-every", type=int, default=1000, help="cases between progress lines")
    p.add_argument("--kinds", help=f"comma-separated subset of: {','.join(KINDS)}")
    p.add_argument(
        "--skip-known-bugs", action="store_true", help="do not send cases that hit KNOWN_BUGS"
    )
    args = p.parse_args(argv)
    kinds = args.kinds.split(",") if args.kinds else None
    report = run(
        args.cases,
        args.seed,
        args.workdir,
        args.progress_every,
        print,
        args.keep,
        kinds,
        args.skip_known_bugs,
    )
    print_report(report)
    return 1 if report.crashes or report.state_changes else 0


if __name__ == "__main__":
    sys.exit(main())
